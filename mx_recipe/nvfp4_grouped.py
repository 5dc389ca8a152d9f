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

from mx_recipe.nvfp4 import NVFP4_BLOCK, hadamard_transform, nvfp4_operand
from mx_recipe.nvfp4_linear import ROWS, TILES, _alpha, _signs
from mx_recipe.recipe import NVFP4Recipe
from mx_recipe.scale_layout import padded_group_layout


def _in_groups(t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """t with the rows at and past offs[-1] set to zero (a mask on the device: no sync)."""
    rows = torch.arange(t.shape[0], device=t.device)
    return torch.where((rows < offs[-1])[:, None], t, torch.zeros((), dtype=t.dtype, device=t.device))


def _grouped(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, alpha, dtype: torch.dtype) -> torch.Tensor:
    out = torch._grouped_mm(a.to(dtype), b.to(dtype), offs=offs)
    return out if alpha is None else (out.float() * alpha).to(dtype)


def _along_m_in_groups(
    t: torch.Tensor, offs: torch.Tensor, layout, recipe: NVFP4Recipe, rounding: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """t [M, C] scattered into groups padded to 16 rows, transformed along M when the recipe says so, and
    quantized along M: the grad-weight GEMM's operand [size, C] and its s_dec."""
    dest, _, size = layout
    padded = t.new_zeros(size, t.shape[1]).index_copy_(0, dest, _in_groups(t, offs))
    if recipe.hadamard:
        padded = hadamard_transform(padded, _signs(recipe.hadamard_seed, t.device), dim=0)  # fp32, cast as it is
    return nvfp4_operand(padded, dim=0, rounding=rounding)


class _NVFP4GroupedMMFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: NVFP4Recipe) -> torch.Tensor:
        dtype = x.dtype
        x_k, s_x = nvfp4_operand(x, dim=-1)
        w_k, s_w = nvfp4_operand(w.to(dtype), dim=-1, block_shape=TILES if recipe.weight_tiles else ROWS)
        ctx.recipe = recipe
        ctx.save_for_backward(x, w, offs)
        return _in_groups(_grouped(x_k, w_k.transpose(-2, -1), offs, _alpha(s_x, s_w), dtype), offs)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w, offs = ctx.saved_tensors
        recipe: NVFP4Recipe = ctx.recipe
        g, dtype, rounding = g.contiguous(), g.dtype, recipe.grad_rounding
        gx = gw = None
        if ctx.needs_input_grad[0]:
            g_n, s_g = nvfp4_operand(g, dim=-1, rounding=rounding)
            w_n, s_w = nvfp4_operand(w.to(dtype), dim=1, block_shape=TILES if recipe.weight_tiles else ROWS)
            gx = _in_groups(_grouped(g_n, w_n, offs, _alpha(s_g, s_w), dtype), offs).to(x.dtype)
        if ctx.needs_input_grad[1]:
            layout = padded_group_layout(offs, x.shape[0], NVFP4_BLOCK)
            g_m, s_g = _along_m_in_groups(g, offs, layout, recipe, rounding)
            x_m, s_x = _along_m_in_groups(x.to(dtype), offs, layout, recipe, "nearest")
            gw = _grouped(g_m.t(), x_m, layout[1], _alpha(s_g, s_x), dtype).to(w.dtype)
        return gx, gw, None, None


def nvfp4_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: NVFP4Recipe) -> torch.Tensor:
    """Differentiable grouped GEMM with NVFP4 operands (emulated): x [M, K], w [E, N, K], offs int32 [E]
    -> [M, N]. N and K must be multiples of 16; offs as ``mx_grouped_mm`` takes them (it checks them)."""
    _, n, k = w.shape
    if k % NVFP4_BLOCK or n % NVFP4_BLOCK:
        raise ValueError(f"nvfp4_grouped_mm: w {tuple(w.shape)} needs N and K divisible by {NVFP4_BLOCK}")
    return _NVFP4GroupedMMFunction.apply(x, w, offs, recipe)
