"""The MX grouped GEMM of MoE experts (docs/DESIGN.md, "MoE grouped GEMMs").

Tokens routed to experts are stacked: x [M_total, K] with int32 cumulative group ends ``offs``
(offs[-1] == M_total), expert weights w [E, N, K]; group e computes x_e @ w[e].T.

    forward      [M_total, K] x [E, K, N] -> [M_total, N]   x along K; each w[e] along K
    grad input   [M_total, N] x [E, N, K] -> [M_total, K]   g along N; each w[e] along N
    grad weight  g_e.T @ x_e per expert   -> [E, N, K]      g and x along M inside each group

One autograd Function runs them for every recipe, on the backend (``mx_recipe.ops.backends``) resolved once for
the model (``resolve_backend`` with ``grouped=True``). For MX recipes, emulated or cublas:

* emulated: fake-quant casts, then ``torch._grouped_mm`` in the input dtype. Only the grad-weight
  GEMM quantizes along M inside token groups: its casts quantize each group as if zero-padded to a
  multiple of 32 rows (no scale block may straddle two experts) and write the rows back unpadded,
  so that GEMM runs on the groups as they are.
* cublas (sm_100 with an MSLK build; e4m3 operands): fp8 casts with blocked scales, then
  ``torch._scaled_grouped_mm``. The op is run and tested (PyTorch's own tests, torchao) with token
  groups of multiples of 32 rows only, and tests/scaled_mm_emulator.py enforces that, so every
  GEMM pads its token groups to 32 rows.

The padding happens on the device, into a buffer of static size ceil32(M_total) + 32 * E
(``scale_layout.padded_group_layout``), so the hot path never synchronizes with the host.

On the emulated backend x is cast in forward for both of its GEMMs (``grouped_input_casts``: along K, and
along M inside the groups for grad weight, one read) and ``grouped_mm_on_one_input`` shares those casts between
the experts' w1 and w3, reading the routed tokens through their indices (``routed``: the copy x[routed] that
routing would write is never made); backward reads g once for its two casts.

NVFP4 recipes run on the emulated NVFP4 backend (``nvfp4_backends``): along M every group is padded with zero
rows to a multiple of 16, so that no block of 16, and no block of the Hadamard transform, straddles two experts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mx_recipe.ops.backends import Backend, Recipe, default_backend
from mx_recipe.ops.settings import get_kernel_settings


def check_group_ends(offs: torch.Tensor, m: int) -> None:
    """Raise unless ``offs`` holds non-decreasing group ends in [0, m]. Reads offs on the host: a device sync on
    a GPU, so mx_grouped_mm does it there only when asked (the kernel setting ``check_offs=True``)."""
    ends = offs.cpu().to(torch.int64)
    if (torch.diff(ends, prepend=ends.new_zeros(1)) < 0).any():
        raise ValueError(f"mx_grouped_mm: offs must be non-decreasing group ends >= 0, got {ends.tolist()}")
    if ends[-1].item() > m:
        raise ValueError(f"mx_grouped_mm: offs ends at row {ends[-1].item()}, past x's {m} rows: {ends.tolist()}")


class _GroupedMMFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: Recipe, backend: Backend,
                grad_enabled: bool, x_casts: tuple | None = None, w_casts: tuple | None = None):  # fmt: skip
        """``grad_enabled``: the caller's grad mode (needs_input_grad holds under no_grad too): nothing is cast
        for a backward that cannot run. ``w_casts``: w's casts made for the whole step (``weight_casts``)."""
        need_gx, need_gw = (grad_enabled and need for need in ctx.needs_input_grad[:2])
        y, saved = backend.grouped_forward(x, w, offs, recipe, need_gx, need_gw, x_casts, w_casts)
        ctx.recipe, ctx.backend = recipe, backend
        ctx.x_meta, ctx.w_meta = (x.shape, x.dtype), (w.shape, w.dtype)
        # an MX operand (a step's weight cast on the cublas path) is no tensor: kept on ctx as it is
        ctx.operands = {i: s for i, s in enumerate(saved) if s is not None and not isinstance(s, torch.Tensor)}
        ctx.save_for_backward(*(None if i in ctx.operands else s for i, s in enumerate(saved)))
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (x_shape, x_dtype), (w_shape, w_dtype) = ctx.x_meta, ctx.w_meta
        if x_shape[0] == 0:  # no tokens: nothing flows back (torch._grouped_mm rejects an empty K)
            return g.new_zeros(x_shape, dtype=x_dtype), g.new_zeros(w_shape, dtype=w_dtype), *(None,) * 6
        need_gx, need_gw = ctx.needs_input_grad[:2]
        saved = [ctx.operands.get(i, s) for i, s in enumerate(ctx.saved_tensors)]
        gx, gw = ctx.backend.grouped_backward(g.contiguous(), tuple(saved), ctx.recipe, need_gx, need_gw)
        return (
            None if gx is None else gx.to(x_dtype),
            None if gw is None else gw.to(w_dtype),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def _check(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: Recipe, backend: Backend | None) -> Backend:
    """Validate one grouped GEMM's operands; the backend to run it on."""
    if x.dim() != 2 or w.dim() != 3 or offs.dim() != 1 or offs.shape[0] != w.shape[0]:
        raise ValueError(
            f"mx_grouped_mm: expected x [M, K], w [E, N, K], offs [E]; got {tuple(x.shape)}, "
            f"{tuple(w.shape)}, {tuple(offs.shape)}"
        )
    if offs.dtype != torch.int32:
        raise TypeError(f"mx_grouped_mm: offs must be int32 cumulative group ends, got {offs.dtype}")
    _, n, k = w.shape
    if x.shape[1] != k:
        raise ValueError(f"mx_grouped_mm: K differs, x {tuple(x.shape)} vs w {tuple(w.shape)}")
    if k % recipe.block_size or n % recipe.block_size:
        raise ValueError(f"mx_grouped_mm: w {tuple(w.shape)} needs N and K divisible by {recipe.block_size}")
    if offs.device != x.device:
        raise ValueError(f"mx_grouped_mm: offs is on {offs.device}, x on {x.device}")
    backend = backend or default_backend(recipe, x.device, grouped=True)
    if not isinstance(recipe, backend.recipe_type) or not backend.grouped:
        raise ValueError(
            f"mx_grouped_mm: recipe {recipe.name!r} cannot run on the {type(backend).__name__} (no grouped GEMM for "
            "it): resolve the backend with resolve_backend(recipe, device, grouped=True)"
        )
    return backend


def _check_offs(x: torch.Tensor, offs: torch.Tensor) -> None:
    if not torch.compiler.is_compiling() and (not x.is_cuda or get_kernel_settings().check_offs):
        check_group_ends(offs, x.shape[0])  # free on the CPU; a device sync on a GPU


def mx_grouped_mm(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: Recipe, backend: Backend | None = None,
    w_casts: tuple | None = None,
) -> torch.Tensor:  # fmt: skip
    """Differentiable grouped GEMM, MX or NVFP4 as ``recipe`` says: x [M_total, K], w [E, N, K], offs int32 [E]
    -> [M_total, N]. ``backend``: from ``resolve_backend(..., grouped=True)``; None resolves it for x's device
    (cached).

    offs: non-decreasing group ends in [0, M_total]; rows at and past offs[-1] belong to no group and come
    back as zeros, with zero gradients. The values are checked on the host for CPU tensors, and on a GPU
    only with the kernel setting ``check_offs=True`` (a device sync per call); unchecked, bad offs give unspecified
    values. ``w_casts``: w's casts made for the whole step (``mx_recipe.nn.weight_casts``), None to cast here."""
    backend = _check(x, w, offs, recipe, backend)
    _check_offs(x, offs)
    return _GroupedMMFunction.apply(x, w, offs, recipe, backend, torch.is_grad_enabled(), None, w_casts)


class _RoutedInputFunction(torch.autograd.Function):
    """x[routed] handed out as its two casts (along K, as differentiable as x[routed]; along M in token groups),
    made from x without the routed copy; backward gives x the gradient that indexing would (an accumulating
    index_put of the routed rows' gradient, the op autograd runs for x[routed])."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, routed: torch.Tensor, offs: torch.Tensor, recipe: Recipe, backend: Backend):
        x_k, x_m = backend.routed_input_casts(x, routed, offs, recipe)
        ctx.save_for_backward(routed)
        ctx.x_shape = x.shape
        ctx.mark_non_differentiable(x_m)
        return x_k, x_m

    @staticmethod
    def backward(ctx, g: torch.Tensor, _: torch.Tensor | None):
        (routed,) = ctx.saved_tensors
        return g.new_zeros(ctx.x_shape).index_put_((routed,), g, accumulate=True), None, None, None, None


def grouped_mm_on_one_input(
    x: torch.Tensor, ws: Sequence[torch.Tensor], offs: torch.Tensor, recipe: Recipe, backend: Backend | None = None,
    w_casts: Sequence[tuple | None] | None = None, routed: torch.Tensor | None = None,
) -> list[torch.Tensor]:  # fmt: skip
    """``[mx_grouped_mm(x, w, offs, recipe, backend) for w in ws]`` (the experts' w1 and w3) with x cast once for
    all of them where the backend makes x's casts in forward (``grouped_input_casts``: x along K and, for the
    grad-weight GEMMs, along M in token groups, saved once for all). The same casts each GEMM makes on its own, so
    outputs and gradients are bit for bit those of the separate calls.

    ``routed`` (int64 [M_total]): the GEMMs' input is x[routed] (the tokens each expert group receives); where the
    backend can (``casts_routed_input``) its casts are made from x and the routed copy is never written."""
    backend = _check(x, ws[0], offs, recipe, backend)
    for w in ws[1:]:
        _check(x, w, offs, recipe, backend)
    share = getattr(recipe, "share_input_casts", False)  # an MX recipe's option; NVFP4 casts in each GEMM
    grad_enabled = torch.is_grad_enabled()
    any_grad_weight = grad_enabled and any(w.requires_grad for w in ws)
    w_casts = w_casts or [None] * len(ws)
    x_casts = None
    if routed is not None and share and any_grad_weight and routed.shape[0] and backend.casts_routed_input(recipe):
        _check_offs(routed, offs)
        x_casts = _RoutedInputFunction.apply(x, routed, offs, recipe, backend)
        x = x_casts[0]  # x[routed] cast along K: the GEMMs' input, through which x gets its gradient
    else:
        x = x if routed is None else x[routed]
        _check_offs(x, offs)
        if share:
            with torch.no_grad():  # the casts carry no gradient: each GEMM's backward gives x its own
                x_casts = backend.grouped_input_casts(x, offs, recipe, any_grad_weight)
    return [
        _GroupedMMFunction.apply(x, w, offs, recipe, backend, grad_enabled, x_casts, casts)
        for w, casts in zip(ws, w_casts, strict=True)
    ]
