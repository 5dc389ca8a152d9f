"""The NVFP4 linear layer, emulated: the three GEMMs of y = x @ w.T with NVFP4 operands (docs/DESIGN.md,
"NVFP4"), as NVIDIA's recipe runs them.

    forward      y  = x @ w.T   x along K (1x16), w along K (16x16 tiles, or 1x16)
    grad input   gx = g @ w     g along N (1x16, stochastic rounding), w along N (the same tiles)
    grad weight  gw = g.T @ x   g and x along M, after the random Hadamard transform along M

Each operand is ``nvfp4_operand``'s exact e2m1 * scale in the input dtype (``fake_quant_nvfp4``: the Triton
kernel for bf16 on CUDA, the reference elsewhere); the GEMM runs in that dtype
with fp32 accumulation, and its output is multiplied by the two per-tensor decode scales in fp32 (one
rounding to the output dtype more than the hardware's fp32 epilogue). Token rows are zero-padded to a
multiple of 16 for the along-M casts (zero rows add nothing to the grad-weight sum).
"""

from __future__ import annotations

import functools

import torch

from mx_recipe.nvfp4 import NVFP4_BLOCK, hadamard_transform, nvfp4_operand, random_signs
from mx_recipe.nvfp4_fake_quant import NVFP4Operands, fake_quant_nvfp4
from mx_recipe.recipe import NVFP4Recipe

TILES = (NVFP4_BLOCK, NVFP4_BLOCK)
ROWS = (1, NVFP4_BLOCK)


@functools.lru_cache
def hadamard_signs(seed: int, device: torch.device) -> torch.Tensor:
    """The recipe's transform signs on ``device``, made once per seed and device."""
    return random_signs(seed, device)


def weight_operand(w: torch.Tensor, dim: int, recipe: NVFP4Recipe, dtype: torch.dtype):
    """w quantized along ``dim`` in the recipe's weight blocks (16x16 tiles, or 1x16): operand and s_dec."""
    return nvfp4_operand(w.to(dtype), dim=dim, block_shape=TILES if recipe.weight_tiles else ROWS)


def quantize_along_m(t: torch.Tensor, recipe: NVFP4Recipe, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """t [M, C], M a multiple of 16 (blocks never straddling what they must not), transformed along M when the
    recipe has the Hadamard transform, then quantized along M: the grad-weight GEMM's operand and its s_dec."""
    if recipe.hadamard:
        t = hadamard_transform(t, hadamard_signs(recipe.hadamard_seed, t.device), dim=0)  # fp32, quantized as is
    return nvfp4_operand(t, dim=0, rounding=rounding)


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ b.T in ``dtype``, times the product of the per-tensor scales ``alpha`` in fp32."""
    return (torch.mm(a.to(dtype), b.to(dtype).t()).float() * alpha).to(dtype)


def _weight_along_k(w: torch.Tensor, recipe: NVFP4Recipe, dtype: torch.dtype) -> NVFP4Operands:
    return fake_quant_nvfp4(w.to(dtype), along_k=True, tiles=recipe.weight_tiles)


class _NVFP4LinearFunction(torch.autograd.Function):
    """The operands come from ``fake_quant_nvfp4``: one kernel per operand on the GPU (g's two in one read)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, recipe: NVFP4Recipe) -> torch.Tensor:
        xq, wq = fake_quant_nvfp4(x), _weight_along_k(w, recipe, x.dtype)
        ctx.recipe = recipe
        ctx.save_for_backward(x, w)
        return _scaled_mm(xq.along_k, wq.along_k, xq.s_dec_k * wq.s_dec_k, x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        recipe: NVFP4Recipe = ctx.recipe
        g, dtype = g.contiguous(), g.dtype
        need_gx, need_gw = ctx.needs_input_grad[:2]
        signs = hadamard_signs(recipe.hadamard_seed, g.device) if recipe.hadamard else None
        # g along N (grad input) and along M (grad weight, token rows zero-padded to 16) from one read
        gq = fake_quant_nvfp4(g, need_gx, need_gw, signs=signs, rounding=recipe.grad_rounding)
        gx = gw = None
        if need_gx:  # w along N: with 16x16 tiles the very values of the forward's w along K
            if recipe.weight_tiles:
                wq = _weight_along_k(w, recipe, dtype)
                w_n, s_w = wq.along_k, wq.s_dec_k
            else:
                wq = fake_quant_nvfp4(w.to(dtype), along_k=False, along_m=True)
                w_n, s_w = wq.along_m, wq.s_dec_m
            gx = _scaled_mm(gq.along_k, w_n.t(), gq.s_dec_k * s_w, dtype).to(x.dtype)
        if need_gw:  # zero rows add nothing to the sum
            xq = fake_quant_nvfp4(x.to(dtype), along_k=False, along_m=True, signs=signs)
            gw = _scaled_mm(gq.along_m.t(), xq.along_m.t(), gq.s_dec_m * xq.s_dec_m, dtype).to(w.dtype)
        return gx, gw, None


def nvfp4_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, recipe: NVFP4Recipe) -> torch.Tensor:
    """``F.linear`` with its three GEMMs in NVFP4 as ``recipe`` says (emulated). x: [..., K], w: [N, K], both
    multiples of 16."""
    n, k = w.shape
    if k % NVFP4_BLOCK or n % NVFP4_BLOCK:
        raise ValueError(f"nvfp4_linear: weight shape {tuple(w.shape)} needs in and out features divisible by 16")
    y = _NVFP4LinearFunction.apply(x.reshape(-1, k), w, recipe).reshape(*x.shape[:-1], n)
    return y if bias is None else y + bias.to(y.dtype)
