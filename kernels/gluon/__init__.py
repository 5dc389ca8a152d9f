"""Gluon kernels for Hopper (sm_90): the MX casts and fake-quants of bf16 on 128 x 128 tiles."""
