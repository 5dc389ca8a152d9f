"""The MX linear layer: three GEMMs, each with its own casts (DESIGN.md).

For y = x @ w.T with x: [M, K], w: [N, K] and the upstream gradient g: [M, N]:

    forward      y  = x @ w.T   x along K, w along K
    grad input   gx = g @ w     g along N, w along N
    grad weight  gw = g.T @ x   g along M, x along M

With ``recipe.save_mx_input`` the forward also casts x along M (for the grad-weight GEMM) and
saves that MX tensor for backward instead of x: the same operand backward would have cast, so
the gradients are bit-identical, and the saved activation is ~1.03 bytes per element, not 2.
With ``recipe.fuse_x_casts`` (emulated backend) one kernel reads x once for both of its
fake-quants, and forward saves the along-M one (bf16) instead of x.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mx_recipe.cast import (
    BlockedMXTensor,
    cast_dim0,
    cast_dim0_dim1,
    cast_dim1,
    fake_quant_along_m,
    fake_quant_dim0,
    fake_quant_dim0_dim1,
)
from mx_recipe.formats import E2M1_VALUES, E8M0_BIAS, E8M0_NAN, MXTensor, exp2_fp32, unpack_fp4
from mx_recipe.gemm import mx_mm_blocked, mx_mm_triton, validate_backend
from mx_recipe.recipe import HIGH_PRECISION, MXRecipe

MXOperand = MXTensor | BlockedMXTensor


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero rows at the end so that blocks along dim 0 do not run off the tensor."""
    pad = -t.shape[0] % multiple
    return F.pad(t, (0, 0, 0, pad)) if pad else t


def _along_last(t: torch.Tensor, elem: str, rule: str, dtype: torch.dtype, rounding: str = "nearest") -> torch.Tensor:
    """t [R, C] quantized along C and dequantized: the emulated backend's operand."""
    return fake_quant_dim0(t, elem, rule, rounding).to(dtype)


def _dequantize(t: MXTensor, dtype: torch.dtype) -> torch.Tensor:
    """A 2D MXTensor quantized along its last dim -> values in ``dtype``, bit for bit
    ``t.dequantize(dtype)``, with per-block scales broadcast rather than repeated and no full-size
    fp32 temporaries for fp8 (this runs in backward, where memory peaks).

    Elements and 2**e (e in [-127, 127]) are exact in bf16, and their product is exact in fp32,
    which is how PyTorch multiplies bf16: one rounding to dtype, as ``dequantize`` does."""
    rows, cols = t.shape
    if t.elem == "e2m1":
        codes = unpack_fp4(t.qdata)
        table = torch.tensor(E2M1_VALUES, dtype=dtype, device=codes.device)
        mag = table[(codes & 0x7).long()]
        elems = torch.where((codes & 0x8) != 0, -mag, mag)
    else:
        elems = t.qdata.to(dtype)
    biased = t.scale.view(torch.uint8).to(torch.int32)
    factor = torch.where(biased == E8M0_NAN, torch.nan, exp2_fp32(biased - E8M0_BIAS)).to(dtype)
    return (elems.view(rows, cols // t.block_size, t.block_size) * factor[..., None]).view(rows, cols)


def _cast(backend: str, t: torch.Tensor, elem: str, rule: str, first: bool, rounding: str = "nearest") -> MXOperand:
    """t quantized along its first dim (``first``: written transposed, [C, R]) or its last, in the
    form the backend's GEMM reads: blocked scales for cublas, plain ones for triton."""
    cast = cast_dim1 if first else cast_dim0
    return cast(t, elem, rule, blocked_scales=backend == "cublas", rounding=rounding)


def _mx_mm(backend: str, a: MXOperand, b: MXOperand, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b.T on the backend's MX GEMM kernel; both operands quantized along their last dim."""
    if backend == "cublas":
        return mx_mm_blocked(a, b, out_dtype)
    return mx_mm_triton(a, b, out_dtype)


class _MXLinearFunction(torch.autograd.Function):
    """Each GEMM is ``a @ b.T`` of two operands quantized along the GEMM's K. Emulated backend:
    both dequantized exactly by the fake-quant casts, then a bf16 GEMM (a hardware MX GEMM up to
    summation order). cublas backend (sm_100): fp8 operands and blocked scales to torch's MX GEMM.
    triton backend: the same casts with plain scales to ``tl.dot_scaled`` (gemm.mx_mm_triton)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, recipe: MXRecipe, for_grad_weight: bool) -> torch.Tensor:
        """``for_grad_weight``: the grad-weight GEMM will run, so the recipe's save_mx_input and
        fuse_x_casts may cast x for it here."""
        backend = validate_backend(recipe, x.device)
        elem, rule, dtype, bs = recipe.forward, recipe.scale_rule, x.dtype, recipe.block_size
        wgrad_elem = recipe.grad_weight
        save_mx = for_grad_weight and recipe.save_mx_input
        fuse_x = for_grad_weight and recipe.fuse_x_casts and backend == "emulated"
        x_m = None  # x along M in MX form ([K, M padded to 32]), when it is saved that way
        x_m_fq = None  # x along M fake-quantized ([M padded to 32, K], bf16), with fuse_x
        if elem == HIGH_PRECISION:
            y = torch.mm(x, w.to(dtype).t())
        elif backend == "emulated":
            # y = x @ w.T: x along K, w along K. For save_mx_input not the fused cast_dim0_dim1: it
            # gives x along K as MX data, to dequantize in another pass, where fake_quant_dim0 reads x
            # and writes the GEMM operand in one kernel; the saved x along M is cast below.
            if fuse_x:  # one read of x for both of its fake-quants (fuse_x_casts)
                x_k, x_m_fq = fake_quant_dim0_dim1(x, elem, rule)
            else:
                x_k = fake_quant_dim0(x, elem, rule)
            y = torch.mm(x_k.to(dtype), _along_last(w, elem, rule, dtype).t())
        else:
            w_k = _cast(backend, w.to(dtype), elem, rule, first=False)
            if save_mx and wgrad_elem == elem and x.shape[0] % bs == 0:
                # one read of x for both orientations (no padding needed, so the forward operand
                # is the very one cast_dim0 gives)
                x_k, x_m = cast_dim0_dim1(x, elem, rule, blocked_scales=backend == "cublas")
            else:
                x_k = _cast(backend, x, elem, rule, first=False)
            y = _mx_mm(backend, x_k, w_k, dtype)
        if save_mx and x_m is None:
            x_m = _cast(backend, _pad_rows(x, bs), wgrad_elem, rule, first=True)  # emulated: plain scales
        ctx.backend, ctx.recipe, ctx.x_dtype = backend, recipe, x.dtype
        # what backward gets for x: "x" itself, "mx" (x along M in MX form) or "along_m" (x along M
        # fake-quantized, the grad-weight GEMM's operand as it is)
        ctx.saved = "mx" if x_m is not None else "along_m" if x_m_fq is not None else "x"
        if x_m is not None:
            ctx.save_for_backward(x_m.qdata, x_m.scale, w)
        else:
            ctx.save_for_backward(x if x_m_fq is None else x_m_fq, w)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        recipe: MXRecipe = ctx.recipe
        backend: str = ctx.backend
        bs = recipe.block_size
        x = x_saved = None
        if ctx.saved == "mx":
            xm_data, xm_scale, w = ctx.saved_tensors
        elif ctx.saved == "along_m":
            x_saved, w = ctx.saved_tensors
        else:
            x, w = ctx.saved_tensors
        g = g.contiguous()
        if backend == "emulated":
            if ctx.saved == "mx":  # forward's cast, dequantized as fake_quant_along_m gives it: [Mp, K]
                x_mx = MXTensor(xm_data, xm_scale, recipe.grad_weight, 1, bs)
                x_saved = _dequantize(x_mx, ctx.x_dtype).t().contiguous()
            gx, gw = _emulated_backward(ctx.needs_input_grad, g, x, x_saved, w, recipe)
        else:
            x_mx = None if ctx.saved != "mx" else _saved_operand(backend, xm_data, xm_scale, recipe.grad_weight, bs)
            gx, gw = _mx_backward(backend, ctx.needs_input_grad, g, x, x_mx, w, recipe)
        return (
            None if gx is None else gx.to(ctx.x_dtype),
            None if gw is None else gw.to(w.dtype),
            None,
            None,
        )


def _emulated_backward(
    needs_grad: tuple[bool, ...],
    g: torch.Tensor,
    x: torch.Tensor | None,
    x_m: torch.Tensor | None,
    w: torch.Tensor,
    recipe: MXRecipe,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(gx, gw) of the emulated backend. Every fake-quant result stays in its input's layout, and
    each GEMM takes its operands in the layouts of nn.Linear's own backward (gx = g @ w, gw = g.T @ x):
    the bf16 GEMMs run as fast as bf16 training's. When both GEMMs are MX, g is read once for both
    of its fake-quants (fake_quant_dim0_dim1). ``x_m``: x along M fake-quantized, [M padded to 32, K], when
    forward made it (fuse_x_casts, save_mx_input); otherwise it is made here from x."""
    rule, dtype, rounding = recipe.scale_rule, g.dtype, recipe.grad_rounding  # rounding: of g only
    mx_gx = needs_grad[0] and recipe.grad_input != HIGH_PRECISION
    mx_gw = needs_grad[1] and recipe.grad_weight != HIGH_PRECISION
    g_n = g_m = None  # g along N [M, N]; g along M, rows zero-padded to a multiple of 32 [Mp, N]
    if mx_gx and mx_gw:
        g_n, g_m = fake_quant_dim0_dim1(g, recipe.grad, rule, rounding)
    elif mx_gx:
        g_n = fake_quant_dim0(g, recipe.grad, rule, rounding)
    elif mx_gw:
        g_m = fake_quant_along_m(g, recipe.grad, rule, rounding)
    gx = gw = None
    if needs_grad[0]:
        if mx_gx:  # g along N, w along N: [N, K]
            gx = torch.mm(g_n.to(dtype), fake_quant_along_m(w, recipe.grad_input, rule).to(dtype))
        else:
            gx = torch.mm(g, w.to(dtype))
    if needs_grad[1]:
        if not mx_gw:
            gw = torch.mm(g.t(), x.to(dtype))
        else:  # g and x along M; their zero rows padding M add nothing to the sum
            if x_m is None:
                x_m = fake_quant_along_m(x, recipe.grad_weight, rule)  # [Mp, K]
            gw = torch.mm(g_m.to(dtype).t(), x_m.to(dtype))
    return gx, gw


def _mx_backward(
    backend: str,
    needs_grad: tuple[bool, ...],
    g: torch.Tensor,
    x: torch.Tensor | None,
    x_saved: MXOperand | None,
    w: torch.Tensor,
    recipe: MXRecipe,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(gx, gw) on an MX GEMM kernel (cublas, triton): each GEMM ``a @ b.T`` of two casts along its K."""
    rule, dtype, bs = recipe.scale_rule, g.dtype, recipe.block_size
    rounding = recipe.grad_rounding  # of g only: the upstream gradient
    gx = gw = None
    if needs_grad[0]:
        if recipe.grad_input == HIGH_PRECISION:
            gx = torch.mm(g, w.to(dtype))
        else:  # gx = g @ w: g along N, w along N
            g_n = _cast(backend, g, recipe.grad, rule, first=False, rounding=rounding)
            gx = _mx_mm(backend, g_n, _cast(backend, w.to(dtype), recipe.grad_input, rule, first=True), dtype)
    if needs_grad[1]:
        if recipe.grad_weight == HIGH_PRECISION:
            gw = torch.mm(g.t(), x.to(dtype))
        else:  # gw = g.T @ x: both along M; zero rows pad M and add nothing to the sum
            g_m = _cast(backend, _pad_rows(g, bs), recipe.grad, rule, first=True, rounding=rounding)  # [N, M]
            x_m = x_saved
            if x_m is None:
                x_m = _cast(backend, _pad_rows(x, bs).to(dtype), recipe.grad_weight, rule, first=True)
            gw = _mx_mm(backend, g_m, x_m, dtype)
    return gx, gw


def _saved_operand(backend: str, qdata: torch.Tensor, scale: torch.Tensor, elem: str, bs: int) -> MXOperand:
    """The saved x along M ([K, M_pad], quantized along its last dim) as the backend's GEMM operand."""
    if backend == "cublas":  # fp8 only (one element per byte); the blocked bytes hold [K, M_pad / 32]
        rows, cols = qdata.shape
        return BlockedMXTensor(qdata, scale, elem, 1, (rows, cols // bs), bs)
    return MXTensor(qdata, scale, elem, 1, bs)


def mx_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, recipe: MXRecipe) -> torch.Tensor:
    """``F.linear`` with each of its three GEMMs in MX as ``recipe`` says. x: [..., K], w: [N, K]."""
    n, k = w.shape
    if k % recipe.block_size or n % recipe.block_size:
        raise ValueError(
            f"mx_linear: weight shape {tuple(w.shape)} needs in and out features divisible by {recipe.block_size}"
        )
    # Cast x for grad weight in forward (save_mx_input, fuse_x_casts) only when that gradient will
    # be computed (not under no_grad, as in evaluation, nor for a frozen weight).
    for_grad_weight = torch.is_grad_enabled() and w.requires_grad
    y = _MXLinearFunction.apply(x.reshape(-1, k), w, recipe, for_grad_weight).reshape(*x.shape[:-1], n)
    return y if bias is None else y + bias.to(y.dtype)


class MXLinear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run in MX. Same parameters and state_dict keys."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe: MXRecipe, **kwargs):
        super().__init__(in_features, out_features, bias, **kwargs)
        self.recipe = recipe

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: MXRecipe) -> MXLinear:
        """An MXLinear that shares ``linear``'s parameters (no copy)."""
        mx = cls.__new__(cls)
        nn.Module.__init__(mx)
        mx.in_features, mx.out_features = linear.in_features, linear.out_features
        mx.weight = linear.weight
        mx.bias = linear.bias
        mx.recipe = recipe
        mx.train(linear.training)
        return mx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mx_linear(x, self.weight, self.bias, self.recipe)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"
