"""A decode step's one-row GEMMs as a custom op: ``torch.ops.mx_recipe.gemv``, the Triton GEMV of
mx_kernels.decode_gemv (its docstring gives why and the figures) for bf16 weights and MXFP8 ones, launched with PDL in
a decode step and with SwiGLU in its epilogue for a fused w1/w3. The fake implementation gives the shape, so
torch.compile and CUDA-graph capture take the kernel as one opaque node; Triton is imported on the first call only.

``takes(x)`` is the rule: one row of bf16 activations on an NVIDIA GPU of compute capability 8.0 or newer (rows
contiguous). Where it holds, ``linear`` runs a bf16 weight by the GEMV (elsewhere ``F.linear``: cuBLAS) and
``PackedWeight.mm`` (mx_recipe.infer.weights) an MXFP8 one (elsewhere the weight-only kernel); ``apply_linear``
is ``linear`` for a module that is a plain ``nn.Linear`` without bias, and calls any other module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mx_recipe.infer.weight_only import swiglu_of
from mx_recipe.library import define
from mx_recipe.ops.device import capability

MAX_M = 1  # mx_kernels.decode_gemv.MAX_M (one row: past it cuBLAS is faster), without importing Triton


def _launch(x: Tensor, w: Tensor, scale: Tensor | None = None, *, swiglu: bool = False) -> Tensor:
    from mx_kernels.decode_gemv import gemv as launch

    return launch(x, w, scale, swiglu)


def _fake(x: Tensor, w: Tensor, scale: Tensor | None = None, *, swiglu: bool = False) -> Tensor:
    return x.new_empty((x.shape[0], w.shape[0] // 2 if swiglu else w.shape[0]))


define("gemv(Tensor x, Tensor w, Tensor? scale=None, *, bool swiglu=False) -> Tensor", _launch, _fake)


def takes(x: Tensor) -> bool:
    """Whether activations x [..., K] run the GEMV (module doc)."""
    cap = capability(x.device)
    return (
        x.dim() >= 1
        and 1 <= x.numel() // max(x.shape[-1], 1) <= MAX_M
        and x.dtype == torch.bfloat16
        and cap is not None
        and cap >= (8, 0)
        and x.stride(-1) == 1
    )


def gemv(x: Tensor, w: Tensor, scale: Tensor | None = None, swiglu: bool = False) -> Tensor:
    """x [..., K] (one row) @ w.T by the kernel: w bf16 [N, K], or MXFP8 codes [N, K] with their ``scale`` [N,
    K / 32]; ``swiglu``: w is SwiGLU's w1 and w3 concatenated along N, and the result F.silu(x w1^T) * (x w3^T)
    [..., N / 2]."""
    y = torch.ops.mx_recipe.gemv(x.reshape(-1, x.shape[-1]), w, scale, swiglu=swiglu)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def use_gemv(x: Tensor, w: Tensor) -> bool:
    """Whether x @ w.T for a bf16 weight runs the GEMV: where it ``takes`` x, w bf16 with rows contiguous, and no
    gradient is asked for (the op has no backward; F.linear has)."""
    grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
    return takes(x) and w.dtype == torch.bfloat16 and w.stride(-1) == 1 and not grad


def linear(x: Tensor, w: Tensor, swiglu: bool = False) -> Tensor:
    """``F.linear(x, w)``, by the GEMV where ``use_gemv``; ``swiglu``: as ``gemv``'s."""
    if use_gemv(x, w):
        return gemv(x, w, swiglu=swiglu)
    y = F.linear(x, w)
    return swiglu_of(y) if swiglu else y


def apply_linear(module: nn.Module, x: Tensor) -> Tensor:
    """``module(x)``, a plain ``nn.Linear`` without bias by ``linear`` (the GEMV where it runs)."""
    if type(module) is nn.Linear and module.bias is None:
        return linear(x, module.weight)
    return module(x)
