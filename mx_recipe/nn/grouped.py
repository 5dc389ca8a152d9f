"""The MX grouped GEMM of MoE experts (docs/DESIGN.md, "MoE grouped GEMMs").

Tokens routed to experts are stacked: x [M_total, K] with int32 cumulative group ends ``offs``
(offs[-1] == M_total), expert weights w [E, N, K]; group e computes x_e @ w[e].T.

    forward      [M_total, K] x [E, K, N] -> [M_total, N]   x along K; each w[e] along K
    grad input   [M_total, N] x [E, N, K] -> [M_total, K]   g along N; each w[e] along N
    grad weight  g_e.T @ x_e per expert   -> [E, N, K]      g and x along M inside each group

One autograd Function runs them for every recipe, on the backend (``mx_recipe.ops.backends``) resolved once for
the model (``resolve_backend`` with ``grouped=True``). For MX recipes, emulated or cublas:

* emulated: fake-quant casts, then ``torch._grouped_mm`` in the input dtype. Only the grad-weight
  GEMM quantizes along M inside token groups: its casts quantize each group as if zero-padded to a
  multiple of 32 rows (no scale block may straddle two experts) and write the rows back unpadded,
  so that GEMM runs on the groups as they are.
* cublas (sm_100 with an MSLK build; e4m3 operands): fp8 casts with blocked scales, then
  ``torch._scaled_grouped_mm``. The op is run and tested (PyTorch's own tests, torchao) with token
  groups of multiples of 32 rows only, and tests/scaled_mm_emulator.py enforces that, so every
  GEMM pads its token groups to 32 rows.

The padding happens on the device, into a buffer of static size ceil32(M_total) + 32 * E
(``scale_layout.padded_group_layout``), so the hot path never synchronizes with the host.

NVFP4 recipes run on the emulated NVFP4 backend (``nvfp4_backends``): along M every group is padded with zero
rows to a multiple of 16, so that no block of 16, and no block of the Hadamard transform, straddles two experts.
"""

from __future__ import annotations

import torch

from mx_recipe.ops.backends import Backend, Recipe, default_backend
from mx_recipe.ops.settings import get_kernel_settings


def check_group_ends(offs: torch.Tensor, m: int) -> None:
    """Raise unless ``offs`` holds non-decreasing group ends in [0, m]. Reads offs on the host: a device sync on
    a GPU, so mx_grouped_mm does it there only when asked (the kernel setting ``check_offs=True``)."""
    ends = offs.cpu().to(torch.int64)
    if (torch.diff(ends, prepend=ends.new_zeros(1)) < 0).any():
        raise ValueError(f"mx_grouped_mm: offs must be non-decreasing group ends >= 0, got {ends.tolist()}")
    if ends[-1].item() > m:
        raise ValueError(f"mx_grouped_mm: offs ends at row {ends[-1].item()}, past x's {m} rows: {ends.tolist()}")


class _GroupedMMFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: Recipe, backend: Backend):
        need_gx, need_gw = ctx.needs_input_grad[:2]
        y, saved = backend.grouped_forward(x, w, offs, recipe, need_gx, need_gw)
        ctx.recipe, ctx.backend = recipe, backend
        ctx.x_meta, ctx.w_meta = (x.shape, x.dtype), (w.shape, w.dtype)
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (x_shape, x_dtype), (w_shape, w_dtype) = ctx.x_meta, ctx.w_meta
        if x_shape[0] == 0:  # no tokens: nothing flows back (torch._grouped_mm rejects an empty K)
            return g.new_zeros(x_shape, dtype=x_dtype), g.new_zeros(w_shape, dtype=w_dtype), None, None, None
        need_gx, need_gw = ctx.needs_input_grad[:2]
        gx, gw = ctx.backend.grouped_backward(g.contiguous(), ctx.saved_tensors, ctx.recipe, need_gx, need_gw)
        return (
            None if gx is None else gx.to(x_dtype),
            None if gw is None else gw.to(w_dtype),
            None,
            None,
            None,
        )


def mx_grouped_mm(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: Recipe, backend: Backend | None = None
) -> torch.Tensor:
    """Differentiable grouped GEMM, MX or NVFP4 as ``recipe`` says: x [M_total, K], w [E, N, K], offs int32 [E]
    -> [M_total, N]. ``backend``: from ``resolve_backend(..., grouped=True)``; None resolves it for x's device
    (cached).

    offs: non-decreasing group ends in [0, M_total]; rows at and past offs[-1] belong to no group and come
    back as zeros, with zero gradients. The values are checked on the host for CPU tensors, and on a GPU
    only with the kernel setting ``check_offs=True`` (a device sync per call); unchecked, bad offs give unspecified
    values."""
    if x.dim() != 2 or w.dim() != 3 or offs.dim() != 1 or offs.shape[0] != w.shape[0]:
        raise ValueError(
            f"mx_grouped_mm: expected x [M, K], w [E, N, K], offs [E]; got {tuple(x.shape)}, "
            f"{tuple(w.shape)}, {tuple(offs.shape)}"
        )
    if offs.dtype != torch.int32:
        raise TypeError(f"mx_grouped_mm: offs must be int32 cumulative group ends, got {offs.dtype}")
    _, n, k = w.shape
    if x.shape[1] != k:
        raise ValueError(f"mx_grouped_mm: K differs, x {tuple(x.shape)} vs w {tuple(w.shape)}")
    if k % recipe.block_size or n % recipe.block_size:
        raise ValueError(f"mx_grouped_mm: w {tuple(w.shape)} needs N and K divisible by {recipe.block_size}")
    if offs.device != x.device:
        raise ValueError(f"mx_grouped_mm: offs is on {offs.device}, x on {x.device}")
    if not torch.compiler.is_compiling() and (not x.is_cuda or get_kernel_settings().check_offs):
        check_group_ends(offs, x.shape[0])  # free on the CPU; a device sync on a GPU
    backend = backend or default_backend(recipe, x.device, grouped=True)
    if not isinstance(recipe, backend.recipe_type) or not backend.grouped:
        raise ValueError(
            f"mx_grouped_mm: recipe {recipe.name!r} cannot run on the {type(backend).__name__} (no grouped GEMM for "
            "it): resolve the backend with resolve_backend(recipe, device, grouped=True)"
        )
    return _GroupedMMFunction.apply(x, w, offs, recipe, backend)
