"""The NVFP4 grouped GEMM of MoE experts, emulated: the three GEMMs of ``mx_grouped_mm`` (grouped.py) with the
NVFP4 recipe's operands (docs/DESIGN.md, "NVFP4").

    forward      [M, K] x [E, K, N] -> [M, N]   x along K (1x16); each w[e] in 16x16 tiles
    grad input   [M, N] x [E, N, K] -> [M, K]   g along N (1x16, the recipe's rounding); the same tiles
    grad weight  g_e.T @ x_e -> [E, N, K]       g and x along M inside each group, transformed first

The weight [E, N, K] has one per-tensor scale, and so does each activation and gradient. Along M, every
group is padded with zero rows to a multiple of 16 (``padded_group_layout``), so that no block of 16, and no
block of the Hadamard transform, straddles two experts; the grad-weight GEMM then runs on the padded groups.
Rows at and past offs[-1] belong to no group: they count as zeros in the casts, come back zero in the output
and in x's gradient, and are left out of the grad-weight GEMM.

``fake_quant_nvfp4_groups`` reads x once in forward for its two operands (along K, and along M in the padded
groups) and g once in backward for its two, with no padded copies; the forward saves x along M instead of x.
With 16x16 weight tiles the forward's and the grad-input GEMM's weight operands are one call with the same
arguments: torch.compile (inductor) merges the two and keeps the result for backward; eager casts w twice.
"""

from __future__ import annotations

import torch

from mx_recipe.formats.nvfp4 import NVFP4_BLOCK
from mx_recipe.formats.recipe import NVFP4Recipe
from mx_recipe.formats.scale_layout import group_row_sources, padded_group_layout, zero_rows_past_groups
from mx_recipe.nn.nvfp4_linear import signs_for, weight_operand
from mx_recipe.ops.nvfp4_fake_quant import fake_quant_nvfp4_groups


def _grouped(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, alpha: torch.Tensor, dtype: torch.dtype):
    """``torch._grouped_mm`` in ``dtype``, times the product of the per-tensor scales ``alpha`` in fp32."""
    return (torch._grouped_mm(a.to(dtype), b.to(dtype), offs=offs).float() * alpha).to(dtype)


class _NVFP4GroupedMMFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: NVFP4Recipe) -> torch.Tensor:
        need_gw = ctx.needs_input_grad[1]
        dest, padded_offs, size = padded_group_layout(offs, x.shape[0], NVFP4_BLOCK)  # backward reuses it
        src = group_row_sources(dest, size)
        signs = signs_for(recipe, x.device) if need_gw else None
        xq = fake_quant_nvfp4_groups(x, offs, dest, src, along_m=need_gw, signs=signs)
        w_k, s_w = weight_operand(w, True, recipe, x.dtype)
        ctx.recipe, ctx.x_shape, ctx.x_dtype = recipe, x.shape, x.dtype
        x_m = (xq.along_m, xq.s_dec_m) if need_gw else (None, None)
        ctx.save_for_backward(w, offs, dest, src, padded_offs, *x_m)
        return zero_rows_past_groups(_grouped(xq.along_k, w_k.transpose(-2, -1), offs, xq.s_dec_k * s_w, x.dtype), offs)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        w, offs, dest, src, padded_offs, x_along_m, s_x = ctx.saved_tensors
        recipe: NVFP4Recipe = ctx.recipe
        need_gx, need_gw = ctx.needs_input_grad[:2]
        if ctx.x_shape[0] == 0:  # no tokens: nothing flows back (torch._grouped_mm rejects an empty K)
            return g.new_zeros(ctx.x_shape, dtype=ctx.x_dtype), torch.zeros_like(w), None, None
        g, dtype = g.contiguous(), g.dtype
        signs = signs_for(recipe, g.device) if need_gw else None
        gq = fake_quant_nvfp4_groups(g, offs, dest, src, need_gx, need_gw, signs, recipe.grad_rounding)
        gx = gw = None
        if need_gx:
            w_n, s_wn = weight_operand(w, False, recipe, dtype)
            gx = zero_rows_past_groups(_grouped(gq.along_k, w_n, offs, gq.s_dec_k * s_wn, dtype), offs).to(ctx.x_dtype)
        if need_gw:  # the padded groups: zero rows add nothing to the sums
            gw = _grouped(gq.along_m.t(), x_along_m, padded_offs, gq.s_dec_m * s_x, dtype).to(w.dtype)
        return gx, gw, None, None


def nvfp4_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: NVFP4Recipe) -> torch.Tensor:
    """Differentiable grouped GEMM with NVFP4 operands (emulated): x [M, K], w [E, N, K], offs int32 [E]
    -> [M, N]. N and K must be multiples of 16; offs as ``mx_grouped_mm`` takes them (it checks them)."""
    _, n, k = w.shape
    if k % NVFP4_BLOCK or n % NVFP4_BLOCK:
        raise ValueError(f"nvfp4_grouped_mm: w {tuple(w.shape)} needs N and K divisible by {NVFP4_BLOCK}")
    return _NVFP4GroupedMMFunction.apply(x, w, offs, recipe)
