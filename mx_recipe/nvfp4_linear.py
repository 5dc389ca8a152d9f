"""The NVFP4 linear layer, emulated: the three GEMMs of y = x @ w.T with NVFP4 operands (docs/DESIGN.md,
"NVFP4"), as NVIDIA's recipe runs them.

    forward      y  = x @ w.T   x along K (1x16), w along K (16x16 tiles, or 1x16)
    grad input   gx = g @ w     g along N (1x16, stochastic rounding), w along N (the same tiles)
    grad weight  gw = g.T @ x   g and x along M, after the random Hadamard transform along M

Each operand is ``nvfp4_operand``'s exact e2m1 * scale in the input dtype; the GEMM runs in that dtype
with fp32 accumulation, and its output is multiplied by the two per-tensor decode scales in fp32 (one
rounding to the output dtype more than the hardware's fp32 epilogue). Token rows are zero-padded to a
multiple of 16 for the along-M casts (zero rows add nothing to the grad-weight sum).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from mx_recipe.nvfp4 import NVFP4_BLOCK, hadamard_transform, nvfp4_operand, random_signs
from mx_recipe.recipe import NVFP4Recipe

TILES = (NVFP4_BLOCK, NVFP4_BLOCK)
ROWS = (1, NVFP4_BLOCK)


@functools.lru_cache
def _signs(seed: int, device: torch.device) -> torch.Tensor:
    return random_signs(seed, device)


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """a @ b.T in ``dtype``, times the per-tensor scales' product ``alpha`` in fp32."""
    out = torch.mm(a.to(dtype), b.to(dtype).t())
    return out if alpha is None else (out.float() * alpha).to(dtype)


def _alpha(*scales: torch.Tensor | None) -> torch.Tensor | None:
    present = [s for s in scales if s is not None]
    return None if not present else functools.reduce(torch.mul, present)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    pad = -t.shape[0] % NVFP4_BLOCK
    return F.pad(t, (0, 0, 0, pad)) if pad else t


def _along_m(t: torch.Tensor, recipe: NVFP4Recipe, rounding: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """t [M, C] quantized along M (rows zero-padded to 16), after the Hadamard transform when the recipe has it:
    the grad-weight GEMM's operand, [ceil16(M), C] in t's dtype, and its s_dec."""
    t = _pad_rows(t)
    if recipe.hadamard:
        t = hadamard_transform(t, _signs(recipe.hadamard_seed, t.device), dim=0)
    values, s_dec = nvfp4_operand(t, dim=0, rounding=rounding)
    return values, s_dec


class _NVFP4LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, recipe: NVFP4Recipe) -> torch.Tensor:
        dtype = x.dtype
        x_k, s_x = nvfp4_operand(x, dim=-1)
        w_k, s_w = nvfp4_operand(w.to(dtype), dim=-1, block_shape=TILES if recipe.weight_tiles else ROWS)
        ctx.recipe = recipe
        ctx.save_for_backward(x, w)
        return _scaled_mm(x_k, w_k, _alpha(s_x, s_w), dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        recipe: NVFP4Recipe = ctx.recipe
        g, dtype, rounding = g.contiguous(), g.dtype, recipe.grad_rounding
        gx = gw = None
        if ctx.needs_input_grad[0]:
            g_n, s_g = nvfp4_operand(g, dim=-1, rounding=rounding)
            w_n, s_w = nvfp4_operand(w.to(dtype), dim=0, block_shape=TILES if recipe.weight_tiles else ROWS)
            gx = _scaled_mm(g_n, w_n.t(), _alpha(s_g, s_w), dtype).to(x.dtype)
        if ctx.needs_input_grad[1]:
            g_m, s_g = _along_m(g, recipe, rounding)
            x_m, s_x = _along_m(x.to(dtype), recipe, "nearest")
            gw = _scaled_mm(g_m.t(), x_m.t(), _alpha(s_g, s_x), dtype).to(w.dtype)
        return gx, gw, None


def nvfp4_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, recipe: NVFP4Recipe) -> torch.Tensor:
    """``F.linear`` with its three GEMMs in NVFP4 as ``recipe`` says (emulated). x: [..., K], w: [N, K], both
    multiples of 16."""
    n, k = w.shape
    if k % NVFP4_BLOCK or n % NVFP4_BLOCK:
        raise ValueError(f"nvfp4_linear: weight shape {tuple(w.shape)} needs in and out features divisible by 16")
    y = _NVFP4LinearFunction.apply(x.reshape(-1, k), w, recipe).reshape(*x.shape[:-1], n)
    return y if bias is None else y + bias.to(y.dtype)
