"""The NVFP4 linear layer: the three GEMMs of y = x @ w.T with NVFP4 operands (docs/DESIGN.md, "NVFP4"), as
NVIDIA's recipe runs them, emulated or (backend 'cublas', sm_100) on torch._scaled_mm.

    forward      y  = x @ w.T   x along K (1x16), w along K (16x16 tiles, or 1x16)
    grad input   gx = g @ w     g along N (1x16, stochastic rounding), w along N (the same tiles)
    grad weight  gw = g.T @ x   g and x along M, after the random Hadamard transform along M

Each operand is ``nvfp4_operand``'s exact e2m1 * scale in the input dtype (``fake_quant_nvfp4``: the Triton
kernel for bf16 on CUDA, the reference elsewhere); the GEMM runs in that dtype
with fp32 accumulation, and its output is multiplied by the two per-tensor decode scales in fp32 (one
rounding to the output dtype more than the hardware's fp32 epilogue). Token rows are zero-padded to a
multiple of 16 for the along-M casts (zero rows add nothing to the grad-weight sum).

The cublas path quantizes with ``cast_nvfp4`` (packed e2m1, e4m3 block scales: the same kernel, writing codes,
on CUDA) into the layouts the op takes, rows padded to 32, and multiplies its fp32 output by the two decode
scales; its values are the emulated path's, its sums the hardware's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mx_recipe.formats.nvfp4 import NVFP4_BLOCK, NVFP4Tensor, random_signs
from mx_recipe.formats.recipe import NVFP4Recipe
from mx_recipe.formats.scale_layout import to_blocked
from mx_recipe.ops.nvfp4_cast import cast_nvfp4
from mx_recipe.ops.nvfp4_fake_quant import ROWS, NVFP4Operands, fake_quant_nvfp4


def weight_operand(w: torch.Tensor, along_k: bool, recipe: NVFP4Recipe, dtype: torch.dtype):
    """w [N, K] or [E, N, K] in the recipe's weight blocks, quantized along K or along N (with 16x16 tiles the same
    values either way; N is a multiple of 16, so no block straddles two experts): the operand [.., N, K] and s_dec."""
    w2 = w.to(dtype).reshape(-1, w.shape[-1])
    if along_k or recipe.weight_tiles:
        q = fake_quant_nvfp4(w2, tiles=recipe.weight_tiles)
        return q.along_k.view(w.shape), q.s_dec_k
    q = fake_quant_nvfp4(w2, along_k=False, along_m=True)
    return q.along_m.view(w.shape), q.s_dec_m


def signs_for(recipe: NVFP4Recipe, device: torch.device) -> torch.Tensor | None:
    """The signs of the recipe's random Hadamard transform on ``device``, or None without the transform."""
    return random_signs(recipe.hadamard_seed, device) if recipe.hadamard else None


def _input_casts(x: torch.Tensor, recipe: NVFP4Recipe, packed: bool, for_grad_weight: bool):
    """x [M, K] along K and, ``for_grad_weight``, along M after the Hadamard transform (the grad-weight operand),
    from one read: ``fake_quant_nvfp4``'s operands, or (``packed``, the cublas path) ``cast_nvfp4``'s tensors."""
    signs = signs_for(recipe, x.device) if for_grad_weight else None
    if packed:
        return cast_nvfp4(x, True, for_grad_weight, signs=signs, pad_m=CUBLAS_ROWS)
    return fake_quant_nvfp4(x, along_m=for_grad_weight, signs=signs)


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ b.T in ``dtype``, times the product of the per-tensor scales ``alpha`` in fp32."""
    return (torch.mm(a.to(dtype), b.to(dtype).t()).float() * alpha).to(dtype)


class _NVFP4LinearFunction(torch.autograd.Function):
    """The operands come from ``fake_quant_nvfp4``: one kernel per operand on the GPU (g's two in one read).
    The forward quantizes x along K and, when w needs a gradient, along M (the grad-weight operand) from one
    read of x, and saves the along-M operand instead of x (the same size): backward does not read x again."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, w: torch.Tensor, recipe: NVFP4Recipe, x_casts: NVFP4Operands | None
    ) -> torch.Tensor:
        need_gw = ctx.needs_input_grad[1]
        xq = x_casts if x_casts is not None else _input_casts(x, recipe, False, need_gw)
        w_k, s_w = weight_operand(w, True, recipe, x.dtype)
        ctx.recipe, ctx.x_dtype = recipe, x.dtype
        ctx.save_for_backward(w, *((xq.along_m, xq.s_dec_m) if need_gw else ()))
        return _scaled_mm(xq.along_k, w_k, xq.s_dec_k * s_w, x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        w, *x_m = ctx.saved_tensors
        recipe: NVFP4Recipe = ctx.recipe
        g, dtype = g.contiguous(), g.dtype
        need_gx, need_gw = ctx.needs_input_grad[:2]
        # g along N (grad input) and along M (grad weight, token rows zero-padded to 16) from one read
        signs = signs_for(recipe, g.device)
        gq = fake_quant_nvfp4(g, need_gx, need_gw, signs=signs, rounding=recipe.grad_rounding)
        gx = gw = None
        if need_gx:
            w_n, s_w = weight_operand(w, False, recipe, dtype)
            gx = _scaled_mm(gq.along_k, w_n.t(), gq.s_dec_k * s_w, dtype).to(ctx.x_dtype)
        if need_gw:  # zero rows add nothing to the sum
            x_along_m, s_x = x_m
            gw = _scaled_mm(gq.along_m.t(), x_along_m.t(), gq.s_dec_m * s_x, dtype).to(w.dtype)
        return gx, gw, None, None


# --- the cublas path (sm_100): packed NVFP4 operands for torch._scaled_mm ---

CUBLAS_ROWS = 32  # the op's K (a.size(1) packed) must be a multiple of 16 bytes: 32 elements


def torch_nvfp4_scaled_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """The real op: a [M, K/2] row-major @ b [K/2, N] column-major, float4_e2m1fn_x2, blocked e4m3 scales of 1x16
    blocks (the NVFP4 recipe, which torch infers from the scales' dtype and count)."""
    return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype)


def _nvfp4_gemm(a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: torch.dtype, scaled_mm: Callable) -> torch.Tensor:
    """a [M, K] @ b [N, K].T, both quantized along K: the block-scaled GEMM in fp32, then both per-tensor decode
    scales in fp32 and one rounding to ``out_dtype``."""
    fp4 = torch.float4_e2m1fn_x2
    out = scaled_mm(a.qdata.view(fp4), b.qdata.view(fp4).t(), to_blocked(a.scale), to_blocked(b.scale), torch.float32)
    return (out * (a.per_tensor_scale * b.per_tensor_scale)).to(out_dtype)


class _NVFP4CublasLinearFunction(torch.autograd.Function):
    """The recipe's three GEMMs as torch._scaled_mm calls on packed NVFP4 operands (``cast_nvfp4``: the kernel
    on CUDA, the same bits as ``to_nvfp4``, so the same quantized values as the emulated path; only the GEMMs'
    summation differs). The grad-weight operands are quantized along M with the token rows zero-padded to 32
    (zero blocks only) and stored transposed, as the op reads them; g's two come from one read, and so do x's:
    the forward saves x along M, packed (about 0.56 bytes an element), instead of x."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, w: torch.Tensor, recipe: NVFP4Recipe, scaled_mm: Callable,
        x_casts: tuple[NVFP4Tensor, NVFP4Tensor | None] | None,
    ) -> torch.Tensor:  # fmt: skip
        need_gw = ctx.needs_input_grad[1]
        ctx.recipe, ctx.scaled_mm, ctx.x_dtype = recipe, scaled_mm, x.dtype
        xq, x_m = x_casts if x_casts is not None else _input_casts(x, recipe, True, need_gw)
        ctx.save_for_backward(w, *((x_m.qdata, x_m.scale, x_m.per_tensor_scale) if need_gw else ()))
        wq, _ = cast_nvfp4(w.to(x.dtype), tiles=recipe.weight_tiles)
        return _nvfp4_gemm(xq, wq, x.dtype, scaled_mm)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        w, *x_m = ctx.saved_tensors
        recipe: NVFP4Recipe = ctx.recipe
        g, dtype = g.contiguous(), g.dtype
        need_gx, need_gw = ctx.needs_input_grad[:2]
        signs = signs_for(recipe, g.device)
        g_n, g_m = cast_nvfp4(g, need_gx, need_gw, signs=signs, rounding=recipe.grad_rounding, pad_m=CUBLAS_ROWS)
        gx = gw = None
        if need_gx:  # w along N, [K, N / 2] packed: w.T along its K; with tiles the values of the forward's w
            w_n, _ = cast_nvfp4(w.to(dtype).t(), tiles=recipe.weight_tiles)
            gx = _nvfp4_gemm(g_n, w_n, dtype, ctx.scaled_mm).to(ctx.x_dtype)
        if need_gw:
            gw = _nvfp4_gemm(g_m, NVFP4Tensor(*x_m, 1, ROWS), dtype, ctx.scaled_mm).to(w.dtype)
        return gx, gw, None, None, None


def nvfp4_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, recipe: NVFP4Recipe, backend=None, x_casts=None
) -> torch.Tensor:
    """``F.linear`` with its three GEMMs in NVFP4 as ``recipe`` says. x: [..., K], w: [N, K], both multiples of 16
    (of 32 on the cublas path). ``backend`` (``gemm.resolve_backend``): None or emulated, the emulated GEMMs; a
    cublas backend, torch._scaled_mm on sm_100 (or the backend's ``scaled_mm`` stand-in, as the tests pass).
    ``x_casts``: x's casts from ``nvfp4_input_casts``, made once for several linears that read x."""
    n, k = w.shape
    if k % NVFP4_BLOCK or n % NVFP4_BLOCK:
        raise ValueError(f"nvfp4_linear: weight shape {tuple(w.shape)} needs in and out features divisible by 16")
    x2 = x.reshape(-1, k)
    if _is_cublas(backend):
        if k % CUBLAS_ROWS or n % CUBLAS_ROWS:
            raise ValueError(
                f"nvfp4_linear: the cublas path needs in and out features divisible by {CUBLAS_ROWS} (torch._scaled_mm "
                f"takes K/2 in multiples of 16 bytes), got weight shape {tuple(w.shape)}"
            )
        y = _NVFP4CublasLinearFunction.apply(x2, w, recipe, backend.scaled_mm or torch_nvfp4_scaled_mm, x_casts)
    else:
        y = _NVFP4LinearFunction.apply(x2, w, recipe, x_casts)
    y = y.reshape(*x.shape[:-1], n)
    return y if bias is None else y + bias.to(y.dtype)


def nvfp4_input_casts(x: torch.Tensor, recipe: NVFP4Recipe, backend, for_grad_weight: bool):
    """x [..., K] cast once for several linears of ``recipe`` and ``backend`` that read it (wq, wk and wv; w1 and
    w3): along K, and along M where a grad-weight GEMM will run (``for_grad_weight``). Each linear makes the
    same casts of x on its own, so outputs and gradients are bit for bit those of separate calls."""
    with torch.no_grad():  # the casts carry no gradient: each linear's backward gives x its own
        return _input_casts(x.reshape(-1, x.shape[-1]), recipe, _is_cublas(backend), for_grad_weight)


def _is_cublas(backend) -> bool:
    return backend is not None and backend.name == "cublas"
