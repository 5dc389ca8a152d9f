"""The MX linear layer: three GEMMs, each with its own casts (docs/DESIGN.md, "The MX linear: three
GEMMs, six casts").

For y = x @ w.T with x: [M, K], w: [N, K] and the upstream gradient g: [M, N]:

    forward      y  = x @ w.T   x along K, w along K
    grad input   gx = g @ w     g along N, w along N
    grad weight  gw = g.T @ x   g along M, x along M

One autograd Function runs them for every recipe: the backend (``mx_recipe.ops.backends``, resolved once for the
model) casts the operands as the recipe says and multiplies them, MX (``MXRecipe``) or NVFP4 (``NVFP4Recipe``)
alike. Forward may cast x along M for the grad-weight GEMM and save that instead of x (the recipe's
``save_mx_input`` and ``fuse_x_casts``; NVFP4 always does): the same operand backward would have cast, so the
gradients are bit-identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from mx_recipe.formats.recipe import MXRecipe, NVFP4Recipe
from mx_recipe.ops.backends import Backend, Recipe, default_backend

if TYPE_CHECKING:
    from mx_recipe.nn.weight_casts import WeightCasts


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, recipe: Recipe, backend: Backend, for_grad_weight: bool,
                x_casts: tuple | None = None, w_casts: tuple | None = None):  # fmt: skip
        """``for_grad_weight``: the grad-weight GEMM will run, so forward may cast x for it. ``x_casts``: x's casts
        made once for several linears (``linears_on_one_input``), used instead. ``w_casts``: w along K and along
        N made once for the step (``mx_recipe.nn.weight_casts``)."""
        if x_casts is None:
            x_casts = backend.input_casts(x, recipe, for_grad_weight)
        x_k, x_m = x_casts
        w_k, ctx.w_n = w_casts or (None, None)  # w_n: a step's operand, not a tensor on every backend
        y = backend.forward(x, x_k, w, recipe, w_k)
        saved, ctx.x_form = backend.save_input(x, x_m)
        ctx.recipe, ctx.backend, ctx.x_dtype = recipe, backend, x.dtype
        ctx.save_for_backward(w, *saved)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        recipe, backend = ctx.recipe, ctx.backend
        w, *saved = ctx.saved_tensors
        x, x_m = backend.load_input(tuple(saved), ctx.x_form, recipe, ctx.x_dtype)
        g = g.contiguous()
        need_gx, need_gw = ctx.needs_input_grad[:2]
        g_n, g_m = backend.grad_casts(g, recipe, need_gx, need_gw)
        gx = backend.grad_input(g, g_n, w, recipe, ctx.w_n).to(ctx.x_dtype) if need_gx else None
        gw = backend.grad_weight(g, g_m, x, x_m, recipe).to(w.dtype) if need_gw else None
        return gx, gw, None, None, None, None, None


def _backend_for(recipe: Recipe, backend: Backend | None, device: torch.device) -> Backend:
    backend = backend or default_backend(recipe, device)
    if not isinstance(recipe, backend.recipe_type):
        raise TypeError(
            f"recipe {recipe.name!r} ({type(recipe).__name__}) cannot run on the {type(backend).__name__}: resolve its "
            "backend with mx_recipe.ops.backends.resolve_backend(recipe, device)"
        )
    return backend


def _apply(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, recipe: Recipe, backend: Backend,
           x_casts: tuple | None = None, w_casts: tuple | None = None) -> torch.Tensor:  # fmt: skip
    n, k = w.shape
    # Cast x for grad weight in forward only when that gradient will be computed (not under no_grad, as in
    # evaluation, nor for a frozen weight).
    for_grad_weight = torch.is_grad_enabled() and w.requires_grad
    if x_casts is not None and not for_grad_weight:
        x_casts = (x_casts[0], None)
    x2 = x.reshape(-1, k)
    y = _LinearFunction.apply(x2, w, recipe, backend, for_grad_weight, x_casts, w_casts).reshape(*x.shape[:-1], n)
    return y if bias is None else y + bias.to(y.dtype)


def mx_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, recipe: Recipe, backend: Backend | None = None,
    w_casts: tuple | None = None,
) -> torch.Tensor:  # fmt: skip
    """``F.linear`` with each of its three GEMMs as ``recipe`` says (MX or NVFP4). x: [..., K], w: [N, K].
    ``backend``: from ``resolve_backend``; None resolves it for x's device (cached). ``w_casts``: w's casts made
    once for the step (``backend.weight_casts(w, recipe, x.dtype)``), None to cast here."""
    backend = _backend_for(recipe, backend, x.device)
    backend.check_weight(w, recipe)
    return _apply(x, w, bias, recipe, backend, w_casts=w_casts)


def linears_on_one_input(x: torch.Tensor, linears: Sequence[MXLinear]) -> list[torch.Tensor]:
    """``[linear(x) for linear in linears]`` with x cast once per orientation for all of them (wq, wk and wv;
    w1 and w3): x along K for the forward GEMMs and, where a grad-weight GEMM will run, x along M, made in
    forward and saved once for all of them. The same casts each linear makes of x on its own, so outputs and
    gradients are bit for bit those of the separate calls. Linears of different recipes or backends are called
    one by one."""
    first = linears[0]
    recipe = first.recipe
    backend = _backend_for(recipe, first.backend, x.device)
    if not backend.shares_input_casts(recipe) or any(
        lin.recipe != recipe or (lin.backend or backend) is not backend for lin in linears[1:]
    ):
        return [lin(x) for lin in linears]
    for lin in linears:
        backend.check_weight(lin.weight, recipe)
    any_grad_weight = torch.is_grad_enabled() and any(lin.weight.requires_grad for lin in linears)
    with torch.no_grad():  # the casts carry no gradient: each linear's backward gives x its own
        x_casts = backend.input_casts(x.reshape(-1, x.shape[-1]), recipe, any_grad_weight, shared=True)
    return [_apply(x, lin.weight, lin.bias, recipe, backend, x_casts, lin.step_weight_casts(x)) for lin in linears]


class MXLinear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run in MX or NVFP4. Same parameters and state_dict keys. ``backend``: the
    model's (convert_to_mx resolves it once); None resolves it for the input's device."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        recipe: MXRecipe | NVFP4Recipe,
        backend: Backend | None = None,
        **kwargs,
    ):
        super().__init__(in_features, out_features, bias, **kwargs)
        self.recipe, self.backend = recipe, backend

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe, backend: Backend | None = None) -> MXLinear:
        """An MXLinear that shares ``linear``'s parameters (no copy)."""
        mx = cls.__new__(cls)
        nn.Module.__init__(mx)
        mx.in_features, mx.out_features = linear.in_features, linear.out_features
        mx.weight = linear.weight
        mx.bias = linear.bias
        mx.recipe, mx.backend = recipe, backend
        mx.train(linear.training)
        return mx

    weight_casts: WeightCasts | None = None  # set for a step by mx_recipe.nn.weight_casts.weight_casts_once

    def step_weight_casts(self, x: torch.Tensor) -> tuple | None:
        """The step's casts of the weight, where made for x's dtype."""
        casts = self.weight_casts
        return None if casts is None or casts.dtype != x.dtype else casts.operands

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mx_linear(x, self.weight, self.bias, self.recipe, self.backend, self.step_weight_casts(x))

    @staticmethod
    def apply_to_shared_input(x: torch.Tensor, linears: Sequence[MXLinear]) -> list[torch.Tensor]:
        """``[linear(x) for linear in linears]``, x cast once for all (``linears_on_one_input``): the hook
        the models call where several linears read one input."""
        return linears_on_one_input(x, linears)

    def extra_repr(self) -> str:
        backend = "" if self.backend is None else f", backend={self.backend.name}"
        return f"{super().extra_repr()}, recipe={self.recipe.name}{backend}"
