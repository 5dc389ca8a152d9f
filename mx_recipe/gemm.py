"""MX GEMM backends: ``mx_mm(a, b)`` computes ``a @ b.T`` for two MXTensors quantized along K.

Only the ``emulated`` backend exists today: dequantize both operands (exact in bf16 within
its range) and run a high-precision matmul with fp32 accumulation. It reproduces a hardware
MX GEMM up to summation order, on any device.
"""

from __future__ import annotations

import torch

from mx_recipe.formats import MXTensor


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend for ``backend`` on ``device``; 'auto' picks the best one there."""
    if backend in ("auto", "emulated"):
        return "emulated"
    raise ValueError(f"MX GEMM backend {backend!r} is not available on {device}")


def mx_mm(a: MXTensor, b: MXTensor, out_dtype: torch.dtype, backend: str = "auto") -> torch.Tensor:
    """``a @ b.T`` with a: [M, K] and b: [N, K], both quantized in blocks along K."""
    if a.dim != a.qdata.dim() - 1 or b.dim != b.qdata.dim() - 1:
        raise ValueError(f"mx_mm needs both operands quantized along K (their last dim); got dims {a.dim}, {b.dim}")
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"mx_mm: K differs, a {tuple(a.shape)} vs b {tuple(b.shape)}")
    resolve_backend(backend, a.qdata.device)
    return torch.mm(a.dequantize(out_dtype), b.dequantize(out_dtype).t())
