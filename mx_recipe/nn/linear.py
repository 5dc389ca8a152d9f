"""The MX linear layer: three GEMMs, each with its own casts (docs/DESIGN.md, "The MX linear: three
GEMMs, six casts").

For y = x @ w.T with x: [M, K], w: [N, K] and the upstream gradient g: [M, N]:

    forward      y  = x @ w.T   x along K, w along K
    grad input   gx = g @ w     g along N, w along N
    grad weight  gw = g.T @ x   g along M, x along M

Each GEMM is ``backend.mm(a, b) = a @ b.T`` of two operands cast along its K by the backend
(gemm.py), resolved once for the model; a GEMM the recipe keeps in bf16 casts nothing.

With ``recipe.save_mx_input`` the forward also casts x along M (for the grad-weight GEMM) and
saves that MX tensor for backward instead of x: the same operand backward would have cast, so
the gradients are bit-identical, and the saved activation is ~1.03 bytes per element, not 2.
With ``recipe.fuse_x_casts`` (on by default; emulated backend, one format for both GEMMs of x) one
kernel reads x once for both of its fake-quants, and forward saves the along-M one (bf16) instead of x.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mx_recipe.formats.recipe import HIGH_PRECISION, MXRecipe, NVFP4Recipe
from mx_recipe.nn.nvfp4_linear import nvfp4_input_casts, nvfp4_linear
from mx_recipe.ops.gemm import Backend, Operand, default_backend


def _input_casts(
    x: torch.Tensor, recipe: MXRecipe, backend: Backend, save_mx: bool, fuse_x: bool
) -> tuple[Operand | None, Operand | None]:
    """x along K, the forward GEMM's operand (None when that GEMM runs in bf16), and x along M, the
    grad-weight GEMM's, when ``save_mx`` (MX form) or ``fuse_x`` (the emulated operand) has forward make it."""
    elem, rule, dtype = recipe.forward, recipe.scale_rule, x.dtype
    x_k = x_m = None
    if elem != HIGH_PRECISION:
        # One read of x for both orientations. Not for save_mx_input on the emulated backend, whose
        # fused cast gives fake-quants: there the saved x along M is an MX cast of its own (below).
        if fuse_x or (save_mx and backend.name != "emulated" and recipe.grad_weight == elem):
            x_k, x_m = backend.cast_both(x, elem, rule, dtype)
        else:
            x_k = backend.cast(x, elem, rule, dtype)
    if save_mx and x_m is None:
        x_m = backend.cast_saved(x, recipe.grad_weight, rule)
    return x_k, x_m


def _forward(x: torch.Tensor, x_k: Operand | None, w: torch.Tensor, recipe: MXRecipe, backend: Backend) -> torch.Tensor:
    """y = x @ w.T: x along K (``x_k``), w along K."""
    if x_k is None:
        return torch.mm(x, w.to(x.dtype).t())
    return backend.mm(x_k, backend.cast(w, recipe.forward, recipe.scale_rule, x.dtype), x.dtype)


def _grad_input(
    g: torch.Tensor, g_n: Operand | None, w: torch.Tensor, recipe: MXRecipe, backend: Backend
) -> torch.Tensor:
    """gx = g @ w: g along N (``g_n``), w along N."""
    if recipe.grad_input == HIGH_PRECISION:
        return torch.mm(g, w.to(g.dtype))
    w_n = backend.cast(w, recipe.grad_input, recipe.scale_rule, g.dtype, along_rows=True)
    return backend.mm(g_n, w_n, g.dtype)


def _grad_weight(
    g: torch.Tensor,
    g_m: Operand | None,
    x: torch.Tensor | None,
    x_m: Operand | None,
    recipe: MXRecipe,
    backend: Backend,
) -> torch.Tensor:
    """gw = g.T @ x: g along M (``g_m``), x along M (``x_m`` when forward made it, else cast from x)."""
    if recipe.grad_weight == HIGH_PRECISION:
        return torch.mm(g.t(), x.to(g.dtype))
    if x_m is None:
        x_m = backend.cast(x, recipe.grad_weight, recipe.scale_rule, g.dtype, along_rows=True)
    return backend.mm(g_m, x_m, g.dtype)


class _MXLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        w: torch.Tensor,
        recipe: MXRecipe,
        backend: Backend,
        for_grad_weight: bool,
        x_casts: tuple[Operand | None, Operand | None] | None = None,
    ):
        """``for_grad_weight``: the grad-weight GEMM will run, so the recipe's save_mx_input and
        fuse_x_casts may cast x for it here. ``x_casts``: x's casts made once for several linears
        (``linears_on_one_input``), used instead."""
        if x_casts is None:
            save_mx = for_grad_weight and recipe.save_mx_input
            fuse_x = for_grad_weight and recipe.fuses_x_casts(backend.name)
            x_casts = _input_casts(x, recipe, backend, save_mx, fuse_x)
        x_k, x_m = x_casts
        y = _forward(x, x_k, w, recipe, backend)
        ctx.recipe, ctx.backend, ctx.x_dtype = recipe, backend, x.dtype
        # what backward gets for x: "x" itself, "operand" (x along M as the grad-weight GEMM takes it)
        # or "mx" (x along M in MX form, to load as that operand)
        ctx.x_form = "x" if x_m is None else "operand" if isinstance(x_m, torch.Tensor) else "mx"
        if ctx.x_form == "mx":
            ctx.save_for_backward(x_m.qdata, x_m.scale, w)
        else:
            ctx.save_for_backward(x if x_m is None else x_m, w)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        recipe: MXRecipe = ctx.recipe
        backend: Backend = ctx.backend
        *saved_x, w = ctx.saved_tensors
        x = x_m = None
        if ctx.x_form == "mx":
            x_m = backend.load_saved(*saved_x, recipe.grad_weight, ctx.x_dtype)
        elif ctx.x_form == "operand":
            (x_m,) = saved_x
        else:
            (x,) = saved_x
        g = g.contiguous()
        rule, dtype, rounding = recipe.scale_rule, g.dtype, recipe.grad_rounding  # rounding: of g only
        mx_gx = ctx.needs_input_grad[0] and recipe.grad_input != HIGH_PRECISION
        mx_gw = ctx.needs_input_grad[1] and recipe.grad_weight != HIGH_PRECISION
        g_n = g_m = None  # g along N, g along M (rows zero-padded to a multiple of 32)
        if mx_gx and mx_gw:  # one read of g for both
            g_n, g_m = backend.cast_both(g, recipe.grad, rule, dtype, rounding)
        elif mx_gx:
            g_n = backend.cast(g, recipe.grad, rule, dtype, rounding=rounding)
        elif mx_gw:
            g_m = backend.cast(g, recipe.grad, rule, dtype, along_rows=True, rounding=rounding)
        gx = _grad_input(g, g_n, w, recipe, backend) if ctx.needs_input_grad[0] else None
        gw = _grad_weight(g, g_m, x, x_m, recipe, backend) if ctx.needs_input_grad[1] else None
        return (
            None if gx is None else gx.to(ctx.x_dtype),
            None if gw is None else gw.to(w.dtype),
            None,
            None,
            None,
            None,
        )


def _check_weight(w: torch.Tensor, recipe: MXRecipe) -> None:
    n, k = w.shape
    if k % recipe.block_size or n % recipe.block_size:
        raise ValueError(
            f"mx_linear: weight shape {tuple(w.shape)} needs in and out features divisible by {recipe.block_size}"
        )


def _apply(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: MXRecipe,
    backend: Backend,
    x_casts: tuple[Operand | None, Operand | None] | None = None,
) -> torch.Tensor:
    n, k = w.shape
    # Cast x for grad weight in forward (save_mx_input, fuse_x_casts) only when that gradient will
    # be computed (not under no_grad, as in evaluation, nor for a frozen weight).
    for_grad_weight = torch.is_grad_enabled() and w.requires_grad
    if x_casts is not None and not for_grad_weight:
        x_casts = (x_casts[0], None)
    x2 = x.reshape(-1, k)
    y = _MXLinearFunction.apply(x2, w, recipe, backend, for_grad_weight, x_casts).reshape(*x.shape[:-1], n)
    return y if bias is None else y + bias.to(y.dtype)


def mx_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: MXRecipe | NVFP4Recipe,
    backend: Backend | None = None,
) -> torch.Tensor:
    """``F.linear`` with each of its three GEMMs in MX as ``recipe`` says. x: [..., K], w: [N, K].
    ``backend``: from ``gemm.resolve_backend``; None resolves it for x's device (cached). An NVFP4Recipe
    runs ``nvfp4_linear`` (emulated, or cublas on sm_100)."""
    if isinstance(recipe, NVFP4Recipe):
        return nvfp4_linear(x, w, bias, recipe, backend or default_backend(recipe, x.device))
    _check_weight(w, recipe)
    return _apply(x, w, bias, recipe, backend or default_backend(recipe, x.device))


def linears_on_one_input(x: torch.Tensor, linears: Sequence[MXLinear]) -> list[torch.Tensor]:
    """``[linear(x) for linear in linears]`` with x cast once per orientation for all of them (wq, wk and wv;
    w1 and w3): x along K for the forward GEMMs and, where a grad-weight GEMM will run, x along M, made in
    forward and saved once for all of them. The same casts each linear makes of x on its own, so outputs and
    gradients are bit for bit those of the separate calls. Linears of different recipes or backends, and an MX
    recipe without share_input_casts, are called one by one (NVFP4 recipes always share)."""
    first = linears[0]
    recipe, backend = first.recipe, first.backend or default_backend(first.recipe, x.device)
    if isinstance(recipe, NVFP4Recipe):  # always shared: the same casts, one read of x
        shared = True
    else:  # something of x to share: a cast along K, or along M for an MX grad-weight GEMM
        shared = recipe.share_input_casts and (recipe.forward, recipe.grad_weight) != (HIGH_PRECISION,) * 2
    if not shared or any(lin.recipe != recipe or (lin.backend or backend) is not backend for lin in linears[1:]):
        return [lin(x) for lin in linears]
    any_grad_weight = torch.is_grad_enabled() and any(lin.weight.requires_grad for lin in linears)
    if isinstance(recipe, NVFP4Recipe):
        x_casts = nvfp4_input_casts(x, recipe, backend, any_grad_weight)
        return [nvfp4_linear(x, lin.weight, lin.bias, recipe, backend, x_casts) for lin in linears]
    for lin in linears:
        _check_weight(lin.weight, recipe)
    x2 = x.reshape(-1, x.shape[-1])
    with torch.no_grad():  # the casts carry no gradient: each linear's backward gives x its own
        x_casts = _shared_casts(x2, recipe, backend, any_grad_weight)
    return [_apply(x, lin.weight, lin.bias, recipe, backend, x_casts) for lin in linears]


def _shared_casts(
    x: torch.Tensor, recipe: MXRecipe, backend: Backend, for_grad_weight: bool
) -> tuple[Operand | None, Operand | None]:
    """x along K and, for an MX grad-weight GEMM that will run, x along M: in MX form where the backend takes
    MX operands or the recipe saves MX inputs, else the emulated operand (one fused read when both casts
    share a format)."""
    mx_grad_weight = for_grad_weight and recipe.grad_weight != HIGH_PRECISION
    if not mx_grad_weight:
        return _input_casts(x, recipe, backend, save_mx=False, fuse_x=False)
    if recipe.save_mx_input or backend.name != "emulated":
        return _input_casts(x, recipe, backend, save_mx=True, fuse_x=False)
    if recipe.grad_weight == recipe.forward:
        return _input_casts(x, recipe, backend, save_mx=False, fuse_x=True)
    x_k, _ = _input_casts(x, recipe, backend, save_mx=False, fuse_x=False)
    return x_k, backend.cast(x, recipe.grad_weight, recipe.scale_rule, x.dtype, along_rows=True)


class MXLinear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run in MX. Same parameters and state_dict keys. ``backend``: the
    model's (convert_to_mx resolves it once); None resolves it for the input's device."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        recipe: MXRecipe,
        backend: Backend | None = None,
        **kwargs,
    ):
        super().__init__(in_features, out_features, bias, **kwargs)
        self.recipe, self.backend = recipe, backend

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: MXRecipe, backend: Backend | None = None) -> MXLinear:
        """An MXLinear that shares ``linear``'s parameters (no copy)."""
        mx = cls.__new__(cls)
        nn.Module.__init__(mx)
        mx.in_features, mx.out_features = linear.in_features, linear.out_features
        mx.weight = linear.weight
        mx.bias = linear.bias
        mx.recipe, mx.backend = recipe, backend
        mx.train(linear.training)
        return mx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mx_linear(x, self.weight, self.bias, self.recipe, self.backend)

    @staticmethod
    def apply_to_shared_input(x: torch.Tensor, linears: Sequence[MXLinear]) -> list[torch.Tensor]:
        """``[linear(x) for linear in linears]``, x cast once for all (``linears_on_one_input``): the hook
        the models call where several linears read one input."""
        return linears_on_one_input(x, linears)

    def extra_repr(self) -> str:
        backend = "" if self.backend is None else f", backend={self.backend.name}"
        return f"{super().extra_repr()}, recipe={self.recipe.name}{backend}"
