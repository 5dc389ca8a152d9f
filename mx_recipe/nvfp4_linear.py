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

import torch

from mx_recipe.nvfp4 import NVFP4_BLOCK, random_signs
from mx_recipe.nvfp4_fake_quant import fake_quant_nvfp4
from mx_recipe.recipe import NVFP4Recipe


def weight_operand(w: torch.Tensor, along_k: bool, recipe: NVFP4Recipe, dtype: torch.dtype):
    """w [N, K] or [E, N, K] in the recipe's weight blocks, quantized along K or along N (with 16x16 tiles the same
    values either way; N is a multiple of 16, so no block straddles two experts): the operand [.., N, K] and s_dec."""
    w2 = w.to(dtype).reshape(-1, w.shape[-1])
    if along_k or recipe.weight_tiles:
        q = fake_quant_nvfp4(w2, tiles=recipe.weight_tiles)
        return q.along_k.view(w.shape), q.s_dec_k
    q = fake_quant_nvfp4(w2, along_k=False, along_m=True)
    return q.along_m.view(w.shape), q.s_dec_m


def quantize_along_m(t: torch.Tensor, recipe: NVFP4Recipe, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """t [M, C], M a multiple of 16 (blocks never straddling what they must not), transformed along M when the
    recipe has the Hadamard transform, then quantized along M: the grad-weight GEMM's operand and its s_dec."""
    q = fake_quant_nvfp4(t, along_k=False, along_m=True, signs=_signs(recipe, t.device), rounding=rounding)
    return q.along_m, q.s_dec_m


def _signs(recipe: NVFP4Recipe, device: torch.device) -> torch.Tensor | None:
    return random_signs(recipe.hadamard_seed, device) if recipe.hadamard else None


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ b.T in ``dtype``, times the product of the per-tensor scales ``alpha`` in fp32."""
    return (torch.mm(a.to(dtype), b.to(dtype).t()).float() * alpha).to(dtype)


class _NVFP4LinearFunction(torch.autograd.Function):
    """The operands come from ``fake_quant_nvfp4``: one kernel per operand on the GPU (g's two in one read)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, recipe: NVFP4Recipe) -> torch.Tensor:
        xq = fake_quant_nvfp4(x)
        w_k, s_w = weight_operand(w, True, recipe, x.dtype)
        ctx.recipe = recipe
        ctx.save_for_backward(x, w)
        return _scaled_mm(xq.along_k, w_k, xq.s_dec_k * s_w, x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        recipe: NVFP4Recipe = ctx.recipe
        g, dtype = g.contiguous(), g.dtype
        need_gx, need_gw = ctx.needs_input_grad[:2]
        # g along N (grad input) and along M (grad weight, token rows zero-padded to 16) from one read
        signs = _signs(recipe, g.device)
        gq = fake_quant_nvfp4(g, need_gx, need_gw, signs=signs, rounding=recipe.grad_rounding)
        gx = gw = None
        if need_gx:
            w_n, s_w = weight_operand(w, False, recipe, dtype)
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
