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
the experts' w1 and w3; backward reads g once for its two casts. ``grouped_swiglu`` runs w1, w3 and the SwiGLU
between them and w2 as one Function whose SwiGLU kernel emits h's casts for w2 (forward) and the casts of the
gradients of w1's and w3's outputs (backward), so that neither h nor those gradients is written in bf16
(``fuse_swiglu_casts``).

NVFP4 recipes run on the emulated NVFP4 backend (``nvfp4_backends``): along M every group is padded with zero
rows to a multiple of 16, so that no block of 16, and no block of the Hadamard transform, straddles two experts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mx_recipe.formats.mx import BLOCK_SIZE
from mx_recipe.formats.recipe import HIGH_PRECISION, MXRecipe
from mx_recipe.formats.scale_layout import group_row_sources, padded_group_layout
from mx_recipe.ops.backends import Backend, Recipe, default_backend
from mx_recipe.ops.settings import get_kernel_settings
from mx_recipe.ops.swiglu_cast import swiglu_fake_quant_groups, swiglu_grad_fake_quant_groups


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
    w_casts: tuple | None = None, x_casts: tuple | None = None,
) -> torch.Tensor:  # fmt: skip
    """Differentiable grouped GEMM, MX or NVFP4 as ``recipe`` says: x [M_total, K], w [E, N, K], offs int32 [E]
    -> [M_total, N]. ``backend``: from ``resolve_backend(..., grouped=True)``; None resolves it for x's device
    (cached).

    offs: non-decreasing group ends in [0, M_total]; rows at and past offs[-1] belong to no group and come
    back as zeros, with zero gradients. The values are checked on the host for CPU tensors, and on a GPU
    only with the kernel setting ``check_offs=True`` (a device sync per call); unchecked, bad offs give unspecified
    values. ``w_casts``: w's casts made for the whole step (``mx_recipe.nn.weight_casts``), None to cast here.
    ``x_casts``: x's casts as ``grouped_input_casts`` makes them (``grouped_swiglu``'s), None to cast here."""
    backend = _check(x, w, offs, recipe, backend)
    _check_offs(x, offs)
    return _GroupedMMFunction.apply(x, w, offs, recipe, backend, torch.is_grad_enabled(), x_casts, w_casts)


def grouped_mm_on_one_input(
    x: torch.Tensor, ws: Sequence[torch.Tensor], offs: torch.Tensor, recipe: Recipe, backend: Backend | None = None,
    w_casts: Sequence[tuple | None] | None = None,
) -> list[torch.Tensor]:  # fmt: skip
    """``[mx_grouped_mm(x, w, offs, recipe, backend) for w in ws]`` (the experts' w1 and w3) with x cast once for
    all of them where the backend makes x's casts in forward (``grouped_input_casts``: x along K and, for the
    grad-weight GEMMs, along M in token groups, saved once for all). The same casts each GEMM makes on its own, so
    outputs and gradients are bit for bit those of the separate calls."""
    backend = _check(x, ws[0], offs, recipe, backend)
    for w in ws[1:]:
        _check(x, w, offs, recipe, backend)
    _check_offs(x, offs)
    x_casts = None
    if getattr(recipe, "share_input_casts", False):  # an MX recipe's option; NVFP4 casts in each GEMM
        any_grad_weight = torch.is_grad_enabled() and any(w.requires_grad for w in ws)
        with torch.no_grad():  # the casts carry no gradient: each GEMM's backward gives x its own
            x_casts = backend.grouped_input_casts(x, offs, recipe, any_grad_weight)
    grad_enabled = torch.is_grad_enabled()
    w_casts = w_casts or [None] * len(ws)
    return [
        _GroupedMMFunction.apply(x, w, offs, recipe, backend, grad_enabled, x_casts, casts)
        for w, casts in zip(ws, w_casts, strict=True)
    ]


def fuses_swiglu_casts(recipe: Recipe, backend: Backend, x: torch.Tensor, ws: Sequence[torch.Tensor]) -> bool:
    """Whether ``grouped_swiglu`` fuses the SwiGLU with its casts for these operands: the option on, the emulated
    backend, every GEMM MX with grad_weight == forward (h's two casts from one read), gradients rounded to nearest
    (the kernel's), and a backward that will run for every weight."""
    return (
        isinstance(recipe, MXRecipe)
        and recipe.fuse_swiglu_casts
        and recipe.fuse_x_casts
        and backend.name == "emulated"
        and HIGH_PRECISION not in (recipe.forward, recipe.grad_input, recipe.grad_weight)
        and recipe.grad_weight == recipe.forward
        and recipe.grad_rounding == "nearest"
        and x.shape[0] > 0
        and torch.is_grad_enabled()
        and all(w.requires_grad for w in ws)
    )


class _GroupedSwiGLUFunction(torch.autograd.Function):
    """silu(x @ w1.T) * (x @ w3.T) per token group, handed out as its two casts for the w2 GEMM (along K; along M
    in the groups, not differentiable). x's casts are shared by w1 and w3 as in ``grouped_mm_on_one_input``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, offs: torch.Tensor, recipe: MXRecipe,
                backend: Backend, w1_casts: tuple | None, w3_casts: tuple | None):  # fmt: skip
        need_gx, need_gw1, need_gw3 = ctx.needs_input_grad[:3]
        x_casts = backend.grouped_input_casts(x, offs, recipe, need_gw1 or need_gw3)
        y1, saved1 = backend.grouped_forward(x, w1, offs, recipe, need_gx, need_gw1, x_casts, w1_casts)
        y3, saved3 = backend.grouped_forward(x, w3, offs, recipe, need_gx, need_gw3, x_casts, w3_casts)
        layout = padded_group_layout(offs, x.shape[0], BLOCK_SIZE)
        src = group_row_sources(layout[0], layout[2])
        h_k, h_m = swiglu_fake_quant_groups(y1, y3, src, recipe.forward, recipe.scale_rule)
        ctx.recipe, ctx.backend, ctx.n_saved = recipe, backend, len(saved1)
        ctx.save_for_backward(y1, y3, src, *saved1, *saved3)
        ctx.mark_non_differentiable(h_m)
        return h_k, h_m

    @staticmethod
    def backward(ctx, g: torch.Tensor, _: torch.Tensor | None):
        y1, y3, src, *saved = ctx.saved_tensors
        saved1, saved3 = tuple(saved[: ctx.n_saved]), tuple(saved[ctx.n_saved :])
        recipe, backend = ctx.recipe, ctx.backend
        need_gx, need_gw1, need_gw3 = ctx.needs_input_grad[:3]
        g1_n, g1_m, g3_n, g3_m = swiglu_grad_fake_quant_groups(g, y1, y3, src, recipe.grad, recipe.scale_rule)
        gx1, gw1 = backend.grouped_backward(g1_n, saved1, recipe, need_gx, need_gw1, g_casts=(g1_n, g1_m))
        gx3, gw3 = backend.grouped_backward(g3_n, saved3, recipe, need_gx, need_gw3, g_casts=(g3_n, g3_m))
        gx = gx1 + gx3 if need_gx else None  # as autograd sums the two GEMMs' gradients of x
        return gx, gw1, gw3, *(None,) * 5


def grouped_swiglu(
    x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, offs: torch.Tensor, recipe: Recipe,
    backend: Backend | None = None, w_casts: Sequence[tuple | None] = (None, None),
) -> tuple[torch.Tensor, tuple | None]:  # fmt: skip
    """The experts' hidden activation h = silu(x @ w1.T) * (x @ w3.T) per token group, for the w2 GEMM: (its
    input, its casts for ``mx_grouped_mm(..., x_casts=)``). Where ``fuses_swiglu_casts``, the input is h's cast
    along K and the casts come from the SwiGLU kernel (h is never written); elsewhere h and None. The same bits
    as eager ``F.silu(y1) * y3`` and w2's own casts, in forward and backward."""
    backend = _check(x, w1, offs, recipe, backend)
    _check(x, w3, offs, recipe, backend)
    if not fuses_swiglu_casts(recipe, backend, x, (w1, w3)):
        y1, y3 = grouped_mm_on_one_input(x, (w1, w3), offs, recipe, backend, w_casts)
        return F.silu(y1) * y3, None
    _check_offs(x, offs)
    h_k, h_m = _GroupedSwiGLUFunction.apply(x, w1, w3, offs, recipe, backend, *w_casts)
    return h_k, (h_k, h_m)
