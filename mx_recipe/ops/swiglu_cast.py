"""The MoE experts' SwiGLU fused with the fake-quants its GEMMs need (the emulated MX grouped path).

``swiglu_fake_quant_groups(y1, y3, row_src)`` gives the two casts of h = silu(y1) * y3 that the w2 GEMM reads
(along N for its forward, along M inside the token groups for its grad weight) without h itself;
``swiglu_grad_fake_quant_groups(g, y1, y3, row_src)`` gives the two casts each of g1 and g3, the gradients of
y1 and y3 given h's gradient g, that the w1 and w3 GEMMs read in backward. On a CUDA GPU each is one Triton
kernel (``mx_kernels.mx.swiglu_casts``) that never writes h, g1 or g3; elsewhere the reference below, the
eager composition whose bits the kernel reproduces: ``F.silu`` and the product, or their autograd backward
(ATen's ``silu_backward``), then ``fake_quant_dim0_groups_along_m`` of each result. Round to nearest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from mx_kernels.common import check_cast, groups_along_m_rows, interpreting
from torch import Tensor

from mx_recipe.library import define
from mx_recipe.ops.device import capability
from mx_recipe.ops.dispatch import reference_fake_quant_groups


def reference_swiglu_casts(y1: Tensor, y3: Tensor, row_src: Tensor, elem: str, mode: str) -> tuple[Tensor, Tensor]:
    return reference_fake_quant_groups(F.silu(y1) * y3, elem, mode, row_src)


def reference_swiglu_grad_casts(
    g: Tensor, y1: Tensor, y3: Tensor, row_src: Tensor, elem: str, mode: str
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # what autograd runs for F.silu(y1) * y3: the product's two sides, then silu's backward
    g1 = torch.ops.aten.silu_backward(g * y3, y1)
    g3 = g * F.silu(y1)
    g1_casts = reference_fake_quant_groups(g1, elem, mode, row_src)
    return (*g1_casts, *reference_fake_quant_groups(g3, elem, mode, row_src))


def _check(tensors: tuple[Tensor, ...], row_src: Tensor, elem: str, mode: str, op: str) -> None:
    for t in tensors:
        check_cast(t, elem, mode, ndims=(2,), qdim=-1, op=op, fp4=True)
        if t.shape != tensors[0].shape or t.dtype != tensors[0].dtype:
            raise ValueError(f"{op}: operands differ: " + ", ".join(f"{tuple(u.shape)} {u.dtype}" for u in tensors))
    groups_along_m_rows(row_src)


def _runs_kernel(y1: Tensor) -> bool:
    """The Triton kernel takes contiguous bf16 on an NVIDIA GPU (the interpreter's CPU tensors in tests)."""
    return y1.dtype == torch.bfloat16 and (capability(y1.device) is not None or interpreting())


def _swiglu_op(y1: Tensor, y3: Tensor, row_src: Tensor, elem: str, mode: str) -> tuple[Tensor, Tensor]:
    from mx_kernels.mx.swiglu_casts import swiglu_fake_quant_groups as launch

    return launch(y1.contiguous(), y3.contiguous(), row_src, elem, mode)


def _swiglu_fake(y1: Tensor, y3: Tensor, row_src: Tensor, elem: str, mode: str) -> tuple[Tensor, Tensor]:
    _check((y1, y3), row_src, elem, mode, "swiglu_fake_quant_groups")
    return torch.empty_like(y1), torch.empty_like(y1)


define(
    "swiglu_fake_quant_groups(Tensor y1, Tensor y3, Tensor row_src, str elem, str mode) -> (Tensor, Tensor)",
    _swiglu_op,
    _swiglu_fake,
)


def _swiglu_grad_op(
    g: Tensor, y1: Tensor, y3: Tensor, row_src: Tensor, elem: str, mode: str
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from mx_kernels.mx.swiglu_casts import swiglu_grad_fake_quant_groups as launch

    return launch(g.contiguous(), y1.contiguous(), y3.contiguous(), row_src, elem, mode)


def _swiglu_grad_fake(
    g: Tensor, y1: Tensor, y3: Tensor, row_src: Tensor, elem: str, mode: str
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check((g, y1, y3), row_src, elem, mode, "swiglu_grad_fake_quant_groups")
    return tuple(torch.empty_like(y1) for _ in range(4))


define(
    "swiglu_grad_fake_quant_groups(Tensor g, Tensor y1, Tensor y3, Tensor row_src, str elem, str mode)"
    " -> (Tensor, Tensor, Tensor, Tensor)",
    _swiglu_grad_op,
    _swiglu_grad_fake,
)


def swiglu_fake_quant_groups(
    y1: Tensor, y3: Tensor, row_src: Tensor, elem: str = "e4m3", mode: str = "floor"
) -> tuple[Tensor, Tensor]:
    """y1, y3 [M, N] in token groups, row_src int32 [R] (``scale_layout.group_row_sources``) -> the fake-quants of
    h = F.silu(y1) * y3 along N and along M inside the groups (``fake_quant_dim0_groups_along_m(h, row_src)``),
    bit for bit, without writing h on a GPU."""
    _check((y1, y3), row_src, elem, mode, "swiglu_fake_quant_groups")
    if _runs_kernel(y1):
        return torch.ops.mx_recipe.swiglu_fake_quant_groups(y1, y3, row_src, elem, mode)
    return reference_swiglu_casts(y1, y3, row_src, elem, mode)


def swiglu_grad_fake_quant_groups(
    g: Tensor, y1: Tensor, y3: Tensor, row_src: Tensor, elem: str = "e4m3", mode: str = "floor"
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """g, h's gradient, with y1 and y3 [M, N] -> (g1 along N, g1 along M, g3 along N, g3 along M): the fake-quants
    (as ``fake_quant_dim0_groups_along_m``) of the gradients that autograd gives y1 and y3 through
    F.silu(y1) * y3, bit for bit, without writing g1 or g3 on a GPU."""
    _check((g, y1, y3), row_src, elem, mode, "swiglu_grad_fake_quant_groups")
    if _runs_kernel(y1):
        return torch.ops.mx_recipe.swiglu_grad_fake_quant_groups(g, y1, y3, row_src, elem, mode)
    return reference_swiglu_grad_casts(g, y1, y3, row_src, elem, mode)
