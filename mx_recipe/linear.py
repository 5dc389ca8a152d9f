"""The MX linear layer: three GEMMs, each with its own casts (DESIGN.md).

For y = x @ w.T with x: [M, K], w: [N, K] and the upstream gradient g: [M, N]:

    forward      y  = x @ w.T   x along K, w along K
    grad input   gx = g @ w     g along N, w along N
    grad weight  gw = g.T @ x   g along M, x along M
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mx_recipe.cast import cast_dim0, cast_dim1, fake_quant_dim0, fake_quant_dim1
from mx_recipe.gemm import mx_mm_blocked, validate_backend
from mx_recipe.recipe import HIGH_PRECISION, MXRecipe


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero rows at the end so that blocks along dim 0 do not run off the tensor."""
    pad = -t.shape[0] % multiple
    return F.pad(t, (0, 0, 0, pad)) if pad else t


def _along_last(t: torch.Tensor, elem: str, rule: str, dtype: torch.dtype) -> torch.Tensor:
    """t [R, C] quantized along C and dequantized: the emulated backend's operand."""
    return fake_quant_dim0(t, elem, rule).to(dtype)


def _along_first(t: torch.Tensor, elem: str, rule: str, dtype: torch.dtype) -> torch.Tensor:
    """t [R, C] quantized along R and dequantized, written transposed: [C, R]."""
    return fake_quant_dim1(t, elem, rule).to(dtype)


def _cublas_mm(a: torch.Tensor, b: torch.Tensor, a_elem: str, b_elem: str, rule: str, a_first: bool, b_first: bool):
    """a @ b.T on the hardware MX GEMM: each operand cast along its first dim (``*_first``, written
    transposed) or its last, with scales straight into the blocked layout."""
    a_mx = (cast_dim1 if a_first else cast_dim0)(a, a_elem, rule, blocked_scales=True)
    b_mx = (cast_dim1 if b_first else cast_dim0)(b, b_elem, rule, blocked_scales=True)
    return mx_mm_blocked(a_mx, b_mx, a.dtype)


class _MXLinearFunction(torch.autograd.Function):
    """Each GEMM is ``a @ b.T`` of two operands quantized along the GEMM's K. Emulated backend:
    both dequantized exactly by the fake-quant casts, then a bf16 GEMM (a hardware MX GEMM up to
    summation order). cublas backend (sm_100): fp8 operands and blocked scales to torch's MX GEMM."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, recipe: MXRecipe) -> torch.Tensor:
        ctx.cublas = validate_backend(recipe, x.device) == "cublas"
        ctx.save_for_backward(x, w)
        ctx.recipe = recipe
        elem, rule, dtype = recipe.forward, recipe.scale_rule, x.dtype
        if elem == HIGH_PRECISION:
            return torch.mm(x, w.to(dtype).t())
        # y = x @ w.T: x along K, w along K.
        if ctx.cublas:
            return _cublas_mm(x, w.to(dtype), elem, elem, rule, False, False)
        return torch.mm(_along_last(x, elem, rule, dtype), _along_last(w, elem, rule, dtype).t())

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        recipe: MXRecipe = ctx.recipe
        rule, dtype = recipe.scale_rule, g.dtype
        g = g.contiguous()
        gx = gw = None
        if ctx.needs_input_grad[0]:
            if recipe.grad_input == HIGH_PRECISION:
                gx = torch.mm(g, w.to(dtype))
            elif ctx.cublas:  # gx = g @ w: g along N, w along N (as [K, N])
                gx = _cublas_mm(g, w.to(dtype), recipe.grad, recipe.grad_input, rule, False, True)
            else:
                g_q, w_q = _along_last(g, recipe.grad, rule, dtype), _along_first(w, recipe.grad_input, rule, dtype)
                gx = torch.mm(g_q, w_q.t())
        if ctx.needs_input_grad[1]:
            if recipe.grad_weight == HIGH_PRECISION:
                gw = torch.mm(g.t(), x.to(dtype))
            else:  # gw = g.T @ x: both along M; zero rows pad M and add nothing to the sum
                g_pad, x_pad = _pad_rows(g, recipe.block_size), _pad_rows(x, recipe.block_size)
                if ctx.cublas:
                    gw = _cublas_mm(g_pad, x_pad.to(dtype), recipe.grad, recipe.grad_weight, rule, True, True)
                else:
                    g_q = _along_first(g_pad, recipe.grad, rule, dtype)  # [N, M]
                    x_q = _along_first(x_pad, recipe.grad_weight, rule, dtype)  # [K, M]
                    gw = torch.mm(g_q, x_q.t())
        return (
            None if gx is None else gx.to(x.dtype),
            None if gw is None else gw.to(w.dtype),
            None,
        )


def mx_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, recipe: MXRecipe) -> torch.Tensor:
    """``F.linear`` with each of its three GEMMs in MX as ``recipe`` says. x: [..., K], w: [N, K]."""
    n, k = w.shape
    if k % recipe.block_size or n % recipe.block_size:
        raise ValueError(
            f"mx_linear: weight shape {tuple(w.shape)} needs in and out features divisible by {recipe.block_size}"
        )
    y = _MXLinearFunction.apply(x.reshape(-1, k), w, recipe).reshape(*x.shape[:-1], n)
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
