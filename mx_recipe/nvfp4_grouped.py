"""The NVFP4 grouped GEMM of MoE experts, emulated: the three GEMMs of ``mx_grouped_mm`` (grouped.py) with the
NVFP4 recipe's operands (docs/DESIGN.md, "NVFP4").

    forward      [M, K] x [E, K, N] -> [M, N]   x along K (1x16); each w[e] in 16x16 tiles
    grad input   [M, N] x [E, N, K] -> [M, K]   g along N (1x16, the recipe's rounding); the same tiles
    grad weight  g_e.T @ x_e -> [E, N, K]       g and x along M inside each group, transformed first

The weight [E, N, K] has one per-tensor scale, and so does each activation and gradient. Along M, every
group is padded with zero rows to a multiple of 16 (``padded_group_layout``), so that no block of 16, and no
block of the Hadamard transform, straddles two experts; the grad-weight GEMM then runs on the padded groups.
Rows at and past offs[-1] belong to no group: zero in the output and in x's gradient, and left out of the
grad-weight GEMM.
"""

from __future__ import annotations

import torch

from mx_recipe.nvfp4 import NVFP4_BLOCK
from mx_recipe.nvfp4_fake_quant import fake_quant_nvfp4
from mx_recipe.nvfp4_linear import quantize_along_m, weight_operand
from mx_recipe.recipe import NVFP4Recipe
from mx_recipe.scale_layout import padded_group_layout, zero_rows_past_groups


def _grouped(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, alpha: torch.Tensor, dtype: torch.dtype):
    """``torch._grouped_mm`` in ``dtype``, times the product of the per-tensor scales ``alpha`` in fp32."""
    return (torch._grouped_mm(a.to(dtype), b.to(dtype), offs=offs).float() * alpha).to(dtype)


def _padded_groups(t: torch.Tensor, offs: torch.Tensor, layout) -> torch.Tensor:
    """t [M, C] with each group's rows moved into a group padded with zero rows to a multiple of 16 ([size, C])."""
    dest, _, size = layout
    return t.new_zeros(size, t.shape[1]).index_copy_(0, dest, zero_rows_past_groups(t, offs))


class _NVFP4GroupedMMFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: NVFP4Recipe) -> torch.Tensor:
        xq = fake_quant_nvfp4(x)
        w_k, s_w = weight_operand(w, True, recipe, x.dtype)
        ctx.recipe = recipe
        ctx.save_for_backward(x, w, offs)
        return zero_rows_past_groups(_grouped(xq.along_k, w_k.transpose(-2, -1), offs, xq.s_dec_k * s_w, x.dtype), offs)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w, offs = ctx.saved_tensors
        recipe: NVFP4Recipe = ctx.recipe
        g, dtype, rounding = g.contiguous(), g.dtype, recipe.grad_rounding
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gq = fake_quant_nvfp4(g, rounding=rounding)
            w_n, s_w = weight_operand(w, False, recipe, dtype)
            gx = zero_rows_past_groups(_grouped(gq.along_k, w_n, offs, gq.s_dec_k * s_w, dtype), offs).to(x.dtype)
        if ctx.needs_input_grad[1]:
            layout = padded_group_layout(offs, x.shape[0], NVFP4_BLOCK)
            g_m, s_g = quantize_along_m(_padded_groups(g, offs, layout), recipe, rounding)
            x_m, s_x = quantize_along_m(_padded_groups(x.to(dtype), offs, layout), recipe, "nearest")
            gw = _grouped(g_m.t(), x_m, layout[1], s_g * s_x, dtype).to(w.dtype)
        return gx, gw, None, None


def nvfp4_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: NVFP4Recipe) -> torch.Tensor:
    """Differentiable grouped GEMM with NVFP4 operands (emulated): x [M, K], w [E, N, K], offs int32 [E]
    -> [M, N]. N and K must be multiples of 16; offs as ``mx_grouped_mm`` takes them (it checks them)."""
    _, n, k = w.shape
    if k % NVFP4_BLOCK or n % NVFP4_BLOCK:
        raise ValueError(f"nvfp4_grouped_mm: w {tuple(w.shape)} needs N and K divisible by {NVFP4_BLOCK}")
    return _NVFP4GroupedMMFunction.apply(x, w, offs, recipe)
