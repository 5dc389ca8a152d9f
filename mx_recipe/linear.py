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

from mx_recipe.formats import to_mx
from mx_recipe.gemm import mx_mm
from mx_recipe.recipe import HIGH_PRECISION, MXRecipe


def _gemm(a: torch.Tensor, b: torch.Tensor, a_elem: str, b_elem: str, recipe: MXRecipe, out_dtype: torch.dtype):
    """a @ b.T, with a: [M, K], b: [N, K], each quantized along K unless its GEMM is bf16."""
    if a_elem == HIGH_PRECISION:
        return torch.mm(a.to(out_dtype), b.to(out_dtype).t())
    a_mx = to_mx(a, a_elem, recipe.scale_rule, dim=-1)
    b_mx = to_mx(b, b_elem, recipe.scale_rule, dim=-1)
    return mx_mm(a_mx, b_mx, out_dtype, recipe.backend)


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero rows at the end so that blocks along dim 0 do not run off the tensor."""
    pad = -t.shape[0] % multiple
    return F.pad(t, (0, 0, 0, pad)) if pad else t


class _MXLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, recipe: MXRecipe) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.recipe = recipe
        return _gemm(x, w, recipe.forward, recipe.forward, recipe, x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        recipe: MXRecipe = ctx.recipe
        g = g.contiguous()
        gx = gw = None
        if ctx.needs_input_grad[0]:
            # gx = g @ w: g [M, N] along N, w along N (w.t() is [K, N]).
            gx = _gemm(g, w.t(), recipe.grad_elem(recipe.grad_input), recipe.grad_input, recipe, g.dtype)
        if ctx.needs_input_grad[1]:
            # gw = g.T @ x: both along M; pad M with zero rows (they add nothing to the sum).
            g_t = _pad_rows(g, recipe.block_size).t()
            x_t = _pad_rows(x, recipe.block_size).t()
            gw = _gemm(g_t, x_t, recipe.grad_elem(recipe.grad_weight), recipe.grad_weight, recipe, g.dtype)
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
