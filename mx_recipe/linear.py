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

from mx_recipe.cast import cast_dim0, cast_dim1
from mx_recipe.gemm import mx_mm
from mx_recipe.recipe import HIGH_PRECISION, MXRecipe


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero rows at the end so that blocks along dim 0 do not run off the tensor."""
    pad = -t.shape[0] % multiple
    return F.pad(t, (0, 0, 0, pad)) if pad else t


class _MXLinearFunction(torch.autograd.Function):
    """Each GEMM is ``mx_mm(a, b) = a @ b.T`` of two operands quantized along the GEMM's K:
    cast_dim0 quantizes a tensor along its last dim, cast_dim1 along its first (stored transposed)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, recipe: MXRecipe) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.recipe = recipe
        elem, rule = recipe.forward, recipe.scale_rule
        if elem == HIGH_PRECISION:
            return torch.mm(x, w.to(x.dtype).t())
        # y = x @ w.T: x along K, w along K.
        return mx_mm(cast_dim0(x, elem, rule), cast_dim0(w, elem, rule), x.dtype, recipe.backend)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        recipe: MXRecipe = ctx.recipe
        rule = recipe.scale_rule
        g = g.contiguous()
        gx = gw = None
        if ctx.needs_input_grad[0]:
            if recipe.grad_input == HIGH_PRECISION:
                gx = torch.mm(g, w.to(g.dtype))
            else:  # gx = g @ w: g along N, w along N (as [K, N])
                g_mx, w_mx = cast_dim0(g, recipe.grad, rule), cast_dim1(w, recipe.grad_input, rule)
                gx = mx_mm(g_mx, w_mx, g.dtype, recipe.backend)
        if ctx.needs_input_grad[1]:
            if recipe.grad_weight == HIGH_PRECISION:
                gw = torch.mm(g.t(), x.to(g.dtype))
            else:  # gw = g.T @ x: both along M; zero rows pad M and add nothing to the sum
                g_pad, x_pad = _pad_rows(g, recipe.block_size), _pad_rows(x, recipe.block_size)
                g_mx, x_mx = cast_dim1(g_pad, recipe.grad, rule), cast_dim1(x_pad, recipe.grad_weight, rule)
                gw = mx_mm(g_mx, x_mx, g.dtype, recipe.backend)
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
