"""Triton kernels for MX casts, scale layouts and GEMMs, installed as ``mx_kernels``."""
