"""The MX grouped GEMM of MoE experts (DESIGN.md, "MoE grouped GEMMs").

Tokens routed to experts are stacked: x [M_total, K] with int32 cumulative group ends ``offs``
(offs[-1] == M_total), expert weights w [E, N, K]; group e computes x_e @ w[e].T.

    forward      [M_total, K] x [E, K, N] -> [M_total, N]   x along K; each w[e] along K
    grad input   [M_total, N] x [E, N, K] -> [M_total, K]   g along N; each w[e] along N (3D dim1)
    grad weight  g_e.T @ x_e per expert   -> [E, N, K]      g and x along M inside each group

The backend is resolved per call with ``gemm.validate_backend(recipe, device, grouped=True)``:

* ``emulated`` (anywhere): fake-quant casts, then ``torch._grouped_mm`` in the input dtype, each
  GEMM's operands in the layouts of the bf16 backward (the along-M fake-quants write in their
  input's layout). Only the grad-weight GEMM quantizes along M inside token groups: its casts quantize
  each group as if zero-padded to a multiple of 32 rows (no scale block may straddle two experts)
  and write the rows back unpadded, so that GEMM runs on the groups as they are.
* ``cublas`` (sm_100 with an MSLK build; e4m3 operands): fp8 casts with blocked scales, then
  ``torch._scaled_grouped_mm`` through gemm.py's ``mx_grouped_mm_2d_3d`` (forward, grad input) and
  ``mx_grouped_mm_2d_2d`` (grad weight), bf16 out. The op is run and tested (PyTorch's own tests,
  torchao) with token groups of multiples of 32 rows only, and our emulator enforces that, so every
  GEMM pads: the 2d-3d ones scatter the rows of their dim0 cast (row-local: casting before padding
  gives the same bits) into groups padded to 32 and gather the output rows back.

The padding happens on the device, into a buffer of static size ceil32(M_total) + 32 * E
(``scale_layout.padded_group_layout``), so the hot path never synchronizes with the host.
"""

from __future__ import annotations

import dataclasses

import torch

from mx_recipe.cast import (
    BlockedMXTensor,
    cast_3d_dim0,
    cast_3d_dim1,
    cast_dim0,
    cast_groups_dim1,
    fake_quant_along_m,
    fake_quant_dim0,
    fake_quant_dim0_dim1,
    fake_quant_groups_along_m,
)
from mx_recipe.formats import MXTensor
from mx_recipe.gemm import mx_grouped_mm_2d_2d, mx_grouped_mm_2d_3d, validate_backend
from mx_recipe.recipe import HIGH_PRECISION, MXRecipe
from mx_recipe.scale_layout import padded_group_layout

CUBLAS_OUT_DTYPE = torch.bfloat16  # MXFP8 torch._scaled_grouped_mm writes bf16 only

GroupLayout = tuple[torch.Tensor, torch.Tensor, int]  # padded_group_layout: (dest rows, padded ends, size)


def _grouped(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return torch._grouped_mm(a.to(out_dtype), b.to(out_dtype), offs=offs)


def group_row_sources(dest: torch.Tensor, size: int) -> torch.Tensor:
    """The inverse of padded_group_layout's ``dest``: for each of the ``size`` padded rows, the row
    of the unpadded tensor it holds, or -1 for a padding row (int32, on the device, no sync)."""
    src = torch.full((size,), -1, dtype=torch.int32, device=dest.device)
    return src.index_copy_(0, dest, torch.arange(dest.numel(), dtype=torch.int32, device=dest.device))


def pad_groups(t: torch.Tensor, dest: torch.Tensor, size: int) -> torch.Tensor:
    """Rows of ``t`` scattered to ``dest`` in a zeroed [size, ...] buffer."""
    out = t.new_zeros(size, *t.shape[1:])
    return out.index_copy_(0, dest, t)


# --- the cublas path ---


def _pad_mx_rows(t: MXTensor, layout: GroupLayout) -> MXTensor:
    """A dim0 cast's rows (data and plain scales) scattered into groups padded to 32 rows; the
    padding rows hold zero elements under scale byte 0 (2**-127), i.e. zeros."""
    dest, _, size = layout
    qdata = pad_groups(t.qdata.view(torch.uint8), dest, size).view(t.qdata.dtype)
    scale = pad_groups(t.scale.view(torch.uint8), dest, size).view(t.scale.dtype)
    return MXTensor(qdata, scale, t.elem, t.dim, t.block_size)


def _cublas_2d_3d(
    a: torch.Tensor,
    elem: str,
    rule: str,
    w: BlockedMXTensor,
    layout: GroupLayout,
    rounding: str = "nearest",
) -> torch.Tensor:
    """Token groups a [M_total, C] along C times per-expert w [E, D, C] -> [M_total, D] (bf16)."""
    dest, padded_offs, _ = layout
    a_padded = _pad_mx_rows(cast_dim0(a, elem, rule, rounding=rounding), layout)
    return mx_grouped_mm_2d_3d(a_padded, w, padded_offs, CUBLAS_OUT_DTYPE).index_select(0, dest)


def _cast_groups_along_m(t: torch.Tensor, elem: str, rule: str, layout: GroupLayout) -> BlockedMXTensor:
    """t [M_total, C] along M inside each token group, groups padded to 32 rows: [C, size] with
    per-group blocked scales, grouped by the E padded group ends.

    cast_groups_dim1 wants groups that cover the whole buffer, so the buffer's tail past the last
    padded group goes to it as one more (all-zero) group. Its scale tiles come after every expert's,
    so the GEMM, given the E expert ends, reads the same bytes as without it and never the tail.
    """
    dest, padded_offs, size = layout
    cast_offs = torch.cat([padded_offs, padded_offs.new_full((1,), size)])
    cast = cast_groups_dim1(pad_groups(t, dest, size), cast_offs, elem, rule, blocked_scales=True)
    return dataclasses.replace(cast, group_offs=padded_offs)


class _MXGroupedMMFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: MXRecipe, for_grad_input: bool
    ) -> torch.Tensor:
        """``for_grad_input``: the grad-input GEMM will run, so fuse_expert_casts may cast w for it here."""
        backend = validate_backend(recipe, x.device, grouped=True)
        ctx.recipe, ctx.backend, ctx.w_dtype = recipe, backend, w.dtype
        elem, rule, dtype = recipe.forward, recipe.scale_rule, x.dtype
        w_n = None  # each expert's w along N, fake-quantized [E, N, K] (fuse_expert_casts)
        if elem == HIGH_PRECISION:
            y = _grouped(x, w.transpose(-2, -1), offs, dtype)
        elif backend == "cublas":  # x along K; each expert's w along K, per-expert blocked scales
            layout = padded_group_layout(offs, x.shape[0], recipe.block_size)
            w_k = cast_3d_dim0(w, elem, rule, blocked_scales=True)
            y = _cublas_2d_3d(x, elem, rule, w_k, layout).to(dtype)
        else:  # x along K; each expert's w along K (and along N in the same read, fuse_expert_casts)
            if for_grad_input and recipe.fuse_expert_casts:
                w_k, w_n = fake_quant_dim0_dim1(w, elem, rule)
            else:
                w_k = fake_quant_dim0(w, elem, rule)
            x_deq = fake_quant_dim0(x, elem, rule).to(dtype)
            y = _grouped(x_deq, w_k.to(dtype).transpose(-2, -1), offs, dtype)
        ctx.save_for_backward(x, w, offs, w_n)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w, offs, w_n = ctx.saved_tensors
        recipe: MXRecipe = ctx.recipe
        if x.shape[0] == 0:  # no tokens: nothing flows back (torch._grouped_mm rejects an empty K)
            return torch.zeros_like(x), torch.zeros_like(w), None, None, None
        if ctx.backend == "cublas":
            return _backward_cublas(ctx, x, w, offs, g.contiguous())
        rule, dtype = recipe.scale_rule, g.dtype
        rounding = recipe.grad_rounding  # of g only: the upstream gradient
        g = g.contiguous()
        gx = gw = None
        if ctx.needs_input_grad[0]:
            if recipe.grad_input == HIGH_PRECISION:
                gx = _grouped(g, w, offs, dtype)
            else:  # g along N; each expert's w along N, in w's own layout [E, N, K]
                g_deq = fake_quant_dim0(g, recipe.grad, rule, rounding).to(dtype)
                if w_n is None:
                    w_n = fake_quant_along_m(w, recipe.grad_input, rule)
                gx = _grouped(g_deq, w_n.to(dtype), offs, dtype)
        if ctx.needs_input_grad[1]:
            if recipe.grad_weight == HIGH_PRECISION:
                gw = _grouped(g.t(), x, offs, dtype)
            else:  # g and x along M inside each group, blocks of 32 from each group's start (a group's
                # last block zero-padded); both stay in their own layout, so the GEMM takes the bf16
                # backward's operands and groups, no padded copies and no padding rows
                dest, _, size = padded_group_layout(offs, x.shape[0], recipe.block_size)
                src = group_row_sources(dest, size)
                g_deq = fake_quant_groups_along_m(g, src, recipe.grad, rule, rounding).to(dtype)
                x_deq = fake_quant_groups_along_m(x, src, recipe.grad_weight, rule).to(dtype)
                gw = _grouped(g_deq.t(), x_deq, offs, dtype)
        return (
            None if gx is None else gx.to(x.dtype),
            None if gw is None else gw.to(ctx.w_dtype),
            None,
            None,
            None,
        )


def _backward_cublas(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, g: torch.Tensor):
    """The two backward GEMMs on torch._scaled_grouped_mm; a GEMM the recipe keeps in bf16 runs as
    in the emulated path."""
    recipe: MXRecipe = ctx.recipe
    rule, dtype = recipe.scale_rule, g.dtype
    layout = padded_group_layout(offs, x.shape[0], recipe.block_size)
    gx = gw = None
    if ctx.needs_input_grad[0]:
        if recipe.grad_input == HIGH_PRECISION:
            gx = _grouped(g, w, offs, dtype)
        else:  # g along N; each expert's w along N, written [E, K, N] by the 3D dim1 cast
            w_n = cast_3d_dim1(w, recipe.grad_input, rule, blocked_scales=True)
            gx = _cublas_2d_3d(g, recipe.grad, rule, w_n, layout, recipe.grad_rounding)
    if ctx.needs_input_grad[1]:
        if recipe.grad_weight == HIGH_PRECISION:
            gw = _grouped(g.t(), x, offs, dtype)
        else:  # per expert g_e.T @ x_e: both along M inside each group -> [E, N, K]
            g_m = _cast_groups_along_m(g, recipe.grad, rule, layout)  # [N, size]
            x_m = _cast_groups_along_m(x, recipe.grad_weight, rule, layout)  # [K, size]
            gw = mx_grouped_mm_2d_2d(g_m, x_m, CUBLAS_OUT_DTYPE)
    return (
        None if gx is None else gx.to(x.dtype),
        None if gw is None else gw.to(w.dtype),
        None,
        None,
        None,
    )


def mx_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: MXRecipe) -> torch.Tensor:
    """Differentiable grouped GEMM in MX: x [M_total, K], w [E, N, K], offs int32 [E] -> [M_total, N]."""
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
    # w along N is cast in forward (fuse_expert_casts) only when grad input will be computed
    for_grad_input = torch.is_grad_enabled() and x.requires_grad
    return _MXGroupedMMFunction.apply(x, w, offs, recipe, for_grad_input)
