"""Jakiro reproduction: decoupled-MoE draft heads, EAGLE-2 dynamic trees and CEPD hybrid decoding."""
import warnings

# tqdm.auto (imported by transformers and accelerate) warns "IProgress not found" in every notebook kernel
# without ipywidgets, on stderr, which an executed notebook shows in red; its bars fall back to text anyway
warnings.filterwarnings("ignore", message="IProgress not found")

__version__ = "0.1.0"
