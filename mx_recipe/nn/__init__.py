"""The layers: the MX and NVFP4 linear, the grouped GEMM of MoE experts, and ``convert_to_mx``."""
