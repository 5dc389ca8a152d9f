"""A decode step's dense projections (bf16 weights) as a custom op: ``torch.ops.mx_recipe.gemv``, the Triton GEMV of
mx_kernels.decode_gemv (its docstring gives why and the figures), launched with PDL in a decode step and with
SwiGLU in its epilogue for a fused w1/w3. The fake implementation gives the shape, so torch.compile and CUDA-graph
capture take the kernel as one opaque node; Triton is imported on the first call only.

``use_gemv`` is the rule: bf16 activations and weight on an NVIDIA GPU of compute capability 8.0 or newer, at most
MAX_M rows; elsewhere ``F.linear`` (cuBLAS). ``linear`` applies it; ``apply_linear`` applies it to a module where
that module is a plain ``nn.Linear`` without bias, and calls any other module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mx_recipe.infer.weight_only import swiglu_of
from mx_recipe.library import define
from mx_recipe.ops.device import capability

MAX_M = 1  # mx_kernels.decode_gemv.MAX_M (one row: past it cuBLAS is faster), without importing Triton


def _launch(x: Tensor, w: Tensor, *, swiglu: bool = False) -> Tensor:
    from mx_kernels.decode_gemv import gemv

    return gemv(x, w, swiglu)


def _fake(x: Tensor, w: Tensor, *, swiglu: bool = False) -> Tensor:
    return x.new_empty((x.shape[0], w.shape[0] // 2 if swiglu else w.shape[0]))


define("gemv(Tensor x, Tensor w, *, bool swiglu=False) -> Tensor", _launch, _fake)


def use_gemv(x: Tensor, w: Tensor) -> bool:
    """Whether x @ w.T runs the GEMV kernel (module doc)."""
    cap = capability(x.device)
    return (
        x.dim() == 2
        and 1 <= x.shape[0] <= MAX_M
        and x.dtype == w.dtype == torch.bfloat16
        and cap is not None
        and cap >= (8, 0)
        and x.stride(-1) == 1
        and w.stride(-1) == 1
    )


def linear(x: Tensor, w: Tensor, swiglu: bool = False) -> Tensor:
    """``F.linear(x, w)`` for x [M, K], by the GEMV kernel where ``use_gemv``; ``swiglu``: w is SwiGLU's w1 and w3
    concatenated along N, and the result F.silu(x w1^T) * (x w3^T) [M, N / 2] (in the kernel's epilogue)."""
    if use_gemv(x, w):
        return torch.ops.mx_recipe.gemv(x, w, swiglu=swiglu)
    y = F.linear(x, w)
    return swiglu_of(y) if swiglu else y


def apply_linear(module: nn.Module, x: Tensor) -> Tensor:
    """``module(x)``, a plain ``nn.Linear`` without bias by ``linear`` (the GEMV kernel where it runs)."""
    if type(module) is nn.Linear and module.bias is None:
        return linear(x, module.weight)
    return module(x)
