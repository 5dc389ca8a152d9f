"""Triton kernels of NVFP4: the per-tensor maxima, the fake-quants and the packed casts."""
