"""Inference: weights kept in an MX or NVFP4 format, and decoding with a static KV cache."""
