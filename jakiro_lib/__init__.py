"""Jakiro reproduction: decoupled-MoE draft heads, EAGLE-2 dynamic trees and CEPD hybrid decoding."""
__version__ = "0.1.0"
