"""The MX grouped GEMM of MoE experts (DESIGN.md, "MoE grouped GEMMs").

Tokens routed to experts are stacked: x [M_total, K] with int32 cumulative group ends ``offs``,
expert weights w [E, N, K]; group e computes x_e @ w[e].T.

    forward      [M_total, K] x [E, K, N] -> [M_total, N]   x along K; each w[e] along K
    grad input   [M_total, N] x [E, N, K] -> [M_total, K]   g along N; each w[e] along N (3D dim1)
    grad weight  g_e.T @ x_e per expert   -> [E, N, K]      g and x along M inside each group

Only the grad-weight GEMM quantizes along M, so only it needs groups padded to multiples of 32
(no scale block may straddle two experts). The padding happens on the device, into a buffer of
static size ceil32(M_total) + 32 * E, so the hot path never synchronizes with the host.
"""

from __future__ import annotations

import torch

from mx_recipe.cast import fake_quant_dim0, fake_quant_dim1
from mx_recipe.recipe import HIGH_PRECISION, MXRecipe
from mx_recipe.scale_layout import padded_group_layout


def _grouped(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return torch._grouped_mm(a.to(out_dtype), b.to(out_dtype), offs=offs)


def pad_groups(t: torch.Tensor, dest: torch.Tensor, size: int) -> torch.Tensor:
    """Rows of ``t`` scattered to ``dest`` in a zeroed [size, ...] buffer."""
    out = t.new_zeros(size, *t.shape[1:])
    return out.index_copy_(0, dest, t)


class _MXGroupedMMFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: MXRecipe) -> torch.Tensor:
        ctx.save_for_backward(x, w, offs)
        ctx.recipe = recipe
        elem, rule, dtype = recipe.forward, recipe.scale_rule, x.dtype
        if elem == HIGH_PRECISION:
            return _grouped(x, w.transpose(-2, -1), offs, dtype)
        # x along K; each expert's w along K.
        x_deq, w_deq = fake_quant_dim0(x, elem, rule).to(dtype), fake_quant_dim0(w, elem, rule).to(dtype)
        return _grouped(x_deq, w_deq.transpose(-2, -1), offs, dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w, offs = ctx.saved_tensors
        recipe: MXRecipe = ctx.recipe
        rule, dtype = recipe.scale_rule, g.dtype
        rounding = recipe.grad_rounding  # of g only: the upstream gradient
        g = g.contiguous()
        gx = gw = None
        if ctx.needs_input_grad[0]:
            if recipe.grad_input == HIGH_PRECISION:
                gx = _grouped(g, w, offs, dtype)
            else:  # g along N; each expert's w along N, written [E, K, N] by the 3D dim1 cast
                g_deq = fake_quant_dim0(g, recipe.grad, rule, rounding).to(dtype)
                w_deq = fake_quant_dim1(w, recipe.grad_input, rule).to(dtype)  # [E, K, N]
                gx = _grouped(g_deq, w_deq.transpose(-2, -1), offs, dtype)
        if ctx.needs_input_grad[1]:
            if recipe.grad_weight == HIGH_PRECISION:
                gw = _grouped(g.t(), x, offs, dtype)
            else:  # g and x along M inside each group, groups padded to multiples of 32
                dest, padded_offs, size = padded_group_layout(offs, x.shape[0], recipe.block_size)
                g_pad, x_pad = pad_groups(g, dest, size), pad_groups(x, dest, size)
                g_deq = fake_quant_dim1(g_pad, recipe.grad, rule, rounding).to(dtype)  # [N, M_pad]
                x_deq = fake_quant_dim1(x_pad, recipe.grad_weight, rule).to(dtype)  # [K, M_pad]
                gw = _grouped(g_deq, x_deq.t(), padded_offs, dtype)
        return (
            None if gx is None else gx.to(x.dtype),
            None if gw is None else gw.to(w.dtype),
            None,
            None,
        )


def mx_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: MXRecipe) -> torch.Tensor:
    """Differentiable grouped GEMM in MX: x [M_total, K], w [E, N, K], offs int32 [E] -> [M_total, N]."""
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
    return _MXGroupedMMFunction.apply(x, w, offs, recipe)
