"""A decode step's one-row GEMMs as a custom op: ``torch.ops.mx_recipe.gemv``, the Triton GEMV of
mx_kernels.decode_gemv (its docstring gives why and the figures) for bf16 weights and MXFP8 ones, launched with PDL in
a decode step and with SwiGLU in its epilogue for a fused w1/w3; and ``torch.ops.mx_recipe.grouped_gemv``, the same
kernel over an MoE step's rows sorted by expert, each row's expert's weight. The fake implementations give the
shapes, so torch.compile and CUDA-graph capture take the kernel as one opaque node; Triton is imported on the first
call only.

``takes(x)`` is the rule: one row of bf16 activations on an NVIDIA GPU of compute capability 8.0 or newer (rows
contiguous). Where it holds, ``linear`` runs a bf16 weight by the GEMV (elsewhere ``F.linear``: cuBLAS) and
``PackedWeight.mm`` (mx_recipe.infer.weights) an MXFP8 one (elsewhere the weight-only kernel); ``apply_linear``
is ``linear`` for a module that is a plain ``nn.Linear`` without bias, and calls any other module.
``takes_grouped(x, m)`` is the grouped one's: m grouped rows, at most GROUPED_MAX_M (a token's experts), of bf16
activations on such a GPU; where it holds, bf16 experts (``FusedExperts``) and MXFP8 ones (``PackedWeight.grouped_mm``)
run by ``grouped_gemv``, elsewhere by ``torch._grouped_mm`` and the weight-only kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mx_recipe.infer.weight_only import swiglu_of
from mx_recipe.library import define
from mx_recipe.ops.device import capability

MAX_M = 1  # mx_kernels.decode_gemv.MAX_M (one row: past it cuBLAS is faster), without importing Triton
GROUPED_MAX_M = 8  # mx_kernels.decode_gemv.GROUPED_MAX_M


def _launch(x: Tensor, w: Tensor, scale: Tensor | None = None, *, swiglu: bool = False) -> Tensor:
    from mx_kernels.decode_gemv import gemv as launch

    return launch(x, w, scale, swiglu)


def _fake(x: Tensor, w: Tensor, scale: Tensor | None = None, *, swiglu: bool = False) -> Tensor:
    return x.new_empty((x.shape[0], w.shape[0] // 2 if swiglu else w.shape[0]))


define("gemv(Tensor x, Tensor w, Tensor? scale=None, *, bool swiglu=False) -> Tensor", _launch, _fake)


def _launch_grouped(x: Tensor, w: Tensor, offs: Tensor, rows: Tensor | None = None, scale: Tensor | None = None, *,
                    swiglu: bool = False, offs_ready: bool = False, early: int = 0) -> Tensor:  # fmt: skip
    from mx_kernels.decode_gemv import grouped_gemv as launch

    return launch(x, w, offs, rows, scale, swiglu, offs_ready, early)


def _fake_grouped(x: Tensor, w: Tensor, offs: Tensor, rows: Tensor | None = None, scale: Tensor | None = None, *,
                  swiglu: bool = False, offs_ready: bool = False, early: int = 0) -> Tensor:  # fmt: skip
    m = x.shape[0] if rows is None else rows.shape[0]
    return x.new_empty((m, w.shape[1] // 2 if swiglu else w.shape[1]))


define("grouped_gemv(Tensor x, Tensor w, Tensor offs, Tensor? rows=None, Tensor? scale=None, *, bool swiglu=False, "
       "bool offs_ready=False, int early=0) -> Tensor", _launch_grouped, _fake_grouped)  # fmt: skip


def takes(x: Tensor) -> bool:
    """Whether activations x [..., K] run the GEMV (module doc)."""
    return x.dim() >= 1 and 1 <= x.numel() // max(x.shape[-1], 1) <= MAX_M and _on_kernel(x)


def takes_grouped(x: Tensor, m: int) -> bool:
    """Whether ``m`` grouped rows of activations x [T, K] (the rows, or the tokens they index) run the grouped GEMV
    (module doc)."""
    return x.dim() == 2 and 1 <= m <= GROUPED_MAX_M and _on_kernel(x)


def _on_kernel(x: Tensor) -> bool:
    """bf16 activations, rows contiguous, on an NVIDIA GPU of compute capability 8.0 or newer."""
    cap = capability(x.device)
    return x.dtype == torch.bfloat16 and cap is not None and cap >= (8, 0) and x.stride(-1) == 1


def gemv(x: Tensor, w: Tensor, scale: Tensor | None = None, swiglu: bool = False) -> Tensor:
    """x [..., K] (one row) @ w.T by the kernel: w bf16 [N, K], or MXFP8 codes [N, K] with their ``scale`` [N,
    K / 32]; ``swiglu``: w is SwiGLU's w1 and w3 concatenated along N, and the result F.silu(x w1^T) * (x w3^T)
    [..., N / 2]."""
    y = torch.ops.mx_recipe.gemv(x.reshape(-1, x.shape[-1]), w, scale, swiglu=swiglu)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def grouped_gemv(x: Tensor, w: Tensor, offs: Tensor, rows: Tensor | None = None, scale: Tensor | None = None,
                 swiglu: bool = False, offs_ready: bool = False, early: int = 0) -> Tensor:  # fmt: skip
    """Per group, its rows of x (or x[rows]) @ w[e].T by the kernel: w [E, N, K] bf16, or MXFP8 codes with their
    ``scale`` [E, N, K / 32]; ``offs`` [E] int32 the groups' cumulative row ends, ``rows`` int32; ``swiglu`` as
    ``gemv``'s; ``offs_ready``: ``offs`` and ``rows`` were written before the launch right before this one (the
    kernel reads them before its PDL wait: mx_kernels.decode_gemv); ``early``: the last groups, every token of x
    in order (folded shared experts), run without that wait, x written before that launch."""
    return torch.ops.mx_recipe.grouped_gemv(x, w, offs, rows, scale, swiglu=swiglu, offs_ready=offs_ready,
                                            early=early)  # fmt: skip


def use_gemv(x: Tensor, w: Tensor) -> bool:
    """Whether x @ w.T for a bf16 weight runs the GEMV: where it ``takes`` x, w bf16 with rows contiguous, and no
    gradient is asked for (the op has no backward; F.linear has)."""
    return takes(x) and _weight_fits(x, w)


def use_grouped_gemv(x: Tensor, w: Tensor, m: int) -> bool:
    """Whether ``m`` grouped rows of x by bf16 experts w [E, N, K] run the grouped GEMV: ``takes_grouped`` and w as
    ``use_gemv`` asks."""
    return takes_grouped(x, m) and w.dim() == 3 and _weight_fits(x, w)


def _weight_fits(x: Tensor, w: Tensor) -> bool:
    grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
    return w.dtype == torch.bfloat16 and w.stride(-1) == 1 and not grad


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
