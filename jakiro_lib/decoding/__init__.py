"""Speculative decoding: trees, drafters, verification, the target runner and both engines."""
