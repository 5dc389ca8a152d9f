"""The MX grouped GEMM of MoE experts (docs/DESIGN.md, "MoE grouped GEMMs").

Tokens routed to experts are stacked: x [M_total, K] with int32 cumulative group ends ``offs``
(offs[-1] == M_total), expert weights w [E, N, K]; group e computes x_e @ w[e].T.

    forward      [M_total, K] x [E, K, N] -> [M_total, N]   x along K; each w[e] along K
    grad input   [M_total, N] x [E, N, K] -> [M_total, K]   g along N; each w[e] along N
    grad weight  g_e.T @ x_e per expert   -> [E, N, K]      g and x along M inside each group

Each GEMM runs on the backend (gemm.py) resolved once for the model (``resolve_backend`` with
``grouped=True``), emulated or cublas:

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
"""

from __future__ import annotations

import torch

from mx_recipe.formats.mx import BLOCK_SIZE
from mx_recipe.formats.recipe import HIGH_PRECISION, MXRecipe, NVFP4Recipe
from mx_recipe.formats.scale_layout import padded_group_layout, zero_rows_past_groups
from mx_recipe.nn.nvfp4_grouped import nvfp4_grouped_mm
from mx_recipe.ops.gemm import Backend, GroupLayout, Operand, default_backend, plain_grouped_mm
from mx_recipe.ops.settings import get_kernel_settings


def _forward(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: MXRecipe, backend: Backend, fuse_w: bool
) -> tuple[torch.Tensor, Operand | None]:
    """y = x_e @ w[e].T per group: x along K, each w[e] along K. With ``fuse_w`` (fuse_expert_casts,
    emulated) also each w[e] along N from the same read of w, the grad-input GEMM's operand."""
    elem, rule, dtype = recipe.forward, recipe.scale_rule, x.dtype
    if elem == HIGH_PRECISION:
        return plain_grouped_mm(x, w.transpose(-2, -1), offs, dtype), None
    w_n = None
    if fuse_w:
        w_k, w_n = backend.cast_both(w, elem, rule, dtype)
    else:
        w_k = backend.cast_experts(w, elem, rule, dtype)
    return backend.grouped_mm(x, elem, rule, w_k, offs, dtype), w_n


def _grad_input(
    g: torch.Tensor,
    w: torch.Tensor,
    w_n: Operand | None,
    offs: torch.Tensor,
    layout: GroupLayout | None,
    recipe: MXRecipe,
    backend: Backend,
) -> torch.Tensor:
    """gx = g_e @ w[e] per group: g along N, each w[e] along N (``w_n`` when forward made it)."""
    if recipe.grad_input == HIGH_PRECISION:
        return plain_grouped_mm(g, w, offs, g.dtype)
    if w_n is None:
        w_n = backend.cast_experts(w, recipe.grad_input, recipe.scale_rule, g.dtype, along_rows=True)
    return backend.grouped_mm(g, recipe.grad, recipe.scale_rule, w_n, offs, g.dtype, recipe.grad_rounding, layout)


def _grad_weight(
    g: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, layout: GroupLayout | None, recipe: MXRecipe, backend: Backend
) -> torch.Tensor:
    """gw[e] = g_e.T @ x_e: g and x along M inside each group."""
    if recipe.grad_weight == HIGH_PRECISION:
        return plain_grouped_mm(g.t(), x, offs, g.dtype)
    return backend.grouped_mm_along_m(
        g, recipe.grad, x, recipe.grad_weight, recipe.scale_rule, offs, layout, g.dtype, recipe.grad_rounding
    )


def check_group_ends(offs: torch.Tensor, m: int) -> None:
    """Raise unless ``offs`` holds non-decreasing group ends in [0, m]. Reads offs on the host: a device sync on
    a GPU, so mx_grouped_mm does it there only when asked (the kernel setting ``check_offs=True``)."""
    ends = offs.cpu().to(torch.int64)
    if (torch.diff(ends, prepend=ends.new_zeros(1)) < 0).any():
        raise ValueError(f"mx_grouped_mm: offs must be non-decreasing group ends >= 0, got {ends.tolist()}")
    if ends[-1].item() > m:
        raise ValueError(f"mx_grouped_mm: offs ends at row {ends[-1].item()}, past x's {m} rows: {ends.tolist()}")


class _MXGroupedMMFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: MXRecipe, backend: Backend, for_grad_input
    ) -> torch.Tensor:
        """``for_grad_input``: the grad-input GEMM will run, so fuse_expert_casts may cast w for it here."""
        fuse_w = for_grad_input and recipe.fuse_expert_casts and backend.name == "emulated"
        y, w_n = _forward(x, w, offs, recipe, backend, fuse_w)
        y = zero_rows_past_groups(y, offs)
        ctx.recipe, ctx.backend, ctx.w_dtype = recipe, backend, w.dtype
        ctx.save_for_backward(x, w, offs, w_n)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w, offs, w_n = ctx.saved_tensors
        recipe: MXRecipe = ctx.recipe
        if x.shape[0] == 0:  # no tokens: nothing flows back (torch._grouped_mm rejects an empty K)
            return torch.zeros_like(x), torch.zeros_like(w), None, None, None, None
        g = g.contiguous()
        need_gx, need_gw = ctx.needs_input_grad[:2]
        layout = None  # token rows in groups padded to 32: the MX grad-weight GEMM's, shared with grad input
        if need_gw and recipe.grad_weight != HIGH_PRECISION:
            layout = padded_group_layout(offs, x.shape[0], BLOCK_SIZE)
        gx = _grad_input(g, w, w_n, offs, layout, recipe, ctx.backend) if need_gx else None
        gx = None if gx is None else zero_rows_past_groups(gx, offs)
        gw = _grad_weight(g, x, offs, layout, recipe, ctx.backend) if need_gw else None
        return (
            None if gx is None else gx.to(x.dtype),
            None if gw is None else gw.to(ctx.w_dtype),
            None,
            None,
            None,
            None,
        )


def mx_grouped_mm(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: MXRecipe | NVFP4Recipe, backend: Backend | None = None
) -> torch.Tensor:
    """Differentiable grouped GEMM in MX: x [M_total, K], w [E, N, K], offs int32 [E] -> [M_total, N].
    ``backend``: from ``gemm.resolve_backend(..., grouped=True)``; None resolves it for x's device (cached).
    An NVFP4Recipe runs ``nvfp4_grouped_mm`` (emulated; no backend).

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
    if isinstance(recipe, NVFP4Recipe):  # emulated; no backend
        return nvfp4_grouped_mm(x, w, offs, recipe)
    if backend is None:
        backend = default_backend(recipe, x.device, grouped=True)
    # w along N is cast in forward (fuse_expert_casts) only when grad input will be computed
    for_grad_input = torch.is_grad_enabled() and x.requires_grad
    return _MXGroupedMMFunction.apply(x, w, offs, recipe, backend, for_grad_input)
