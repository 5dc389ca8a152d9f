"""Triton kernels of the MX formats: casts, fake-quants, scale layouts and the ``tl.dot_scaled`` GEMM."""
