"""The NVFP4 grouped GEMM (mx_recipe/ops/nvfp4_backends.py): its three GEMMs rebuilt from the reference pieces bit
for bit on ragged groups (an empty one, rows past the last group), one group equal to the dense NVFP4 linear,
and an MoE model converted to NVFP4 trains."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mx_recipe import convert_to_mx, mx_grouped_mm, mx_linear
from mx_recipe.formats.nvfp4 import hadamard_transform, random_signs, to_nvfp4
from mx_recipe.formats.recipe import NVFP4_RECIPES, NVFP4Recipe
from mx_recipe.models import build_model, model_args


def _values(t, dim, **kwargs):
    q = to_nvfp4(t, dim, **kwargs)
    return q.block_values(), q.per_tensor_scale


def _expected(x, w, offs, g, recipe: NVFP4Recipe, seed: int):
    """y, gx, gw from to_nvfp4 and hadamard_transform, group by group in Python. x's and g's rows past the last
    group count as zeros (they belong to no expert: their values reach no scale)."""
    dtype, ends = x.dtype, [0, *offs.tolist()]
    in_groups = (torch.arange(x.shape[0]) < ends[-1])[:, None]
    x, g = torch.where(in_groups, x, 0), torch.where(in_groups, g, 0)
    tiles = {"block_shape": (16, 16) if recipe.weight_tiles else (1, 16)}
    x_k, s_x = _values(x, -1)
    w_k, s_w = _values(w, -1, **tiles)
    y = torch.zeros(x.shape[0], w.shape[1], dtype=dtype)
    for e in range(w.shape[0]):
        rows = slice(ends[e], ends[e + 1])
        y[rows] = (x_k[rows].to(dtype) @ w_k[e].to(dtype).t()).float().mul(s_x * s_w).to(dtype)
    torch.manual_seed(seed)
    g_n, s_g = _values(g, -1, rounding=recipe.grad_rounding)
    w_n, s_wn = _values(w, 1, **tiles)
    gx = torch.zeros_like(x)
    for e in range(w.shape[0]):
        rows = slice(ends[e], ends[e + 1])
        gx[rows] = (g_n[rows].to(dtype) @ w_n[e].to(dtype)).float().mul(s_g * s_wn).to(dtype)
    # along M: each group padded to 16 rows, then all groups stacked (the per-tensor scale spans them)
    padded = [(F.pad(t[ends[e] : ends[e + 1]], (0, 0, 0, -(ends[e + 1] - ends[e]) % 16))) for e in range(len(ends) - 1)
              for t in (g, x)]  # fmt: skip
    g_p, x_p = torch.cat(padded[0::2]), torch.cat(padded[1::2])
    if recipe.hadamard:
        signs = random_signs(recipe.hadamard_seed)
        g_p, x_p = hadamard_transform(g_p, signs, dim=0), hadamard_transform(x_p, signs, dim=0)
    g_m, s_gm = _values(g_p, 0, rounding=recipe.grad_rounding)
    x_m, s_xm = _values(x_p, 0)
    gw = torch.zeros(w.shape, dtype=dtype)
    start = 0
    for e in range(w.shape[0]):
        size = -(-(ends[e + 1] - ends[e]) // 16) * 16
        rows = slice(start, start + size)
        gw[e] = (g_m[rows].to(dtype).t() @ x_m[rows].to(dtype)).float().mul(s_gm * s_xm).to(dtype)
        start += size
    return y, gx, gw


@pytest.mark.parametrize("name", sorted(NVFP4_RECIPES))
def test_nvfp4_grouped_mm_is_its_reference_pieces_bit_for_bit(name):
    recipe = NVFP4Recipe.from_name(name, hadamard_seed=2)
    generator = torch.Generator().manual_seed(0)
    offs = torch.tensor([20, 20, 57, 90], dtype=torch.int32)  # ragged, one empty group, rows 90-95 in none
    x = torch.randn(96, 64, generator=generator).to(torch.bfloat16)
    x[92] = 100.0  # rows past the groups reach no scale: their maximum must not be the per-tensor one
    x.requires_grad_()
    w = (torch.randn(4, 48, 64, generator=generator) * 0.1).to(torch.bfloat16).requires_grad_()
    g = torch.randn(96, 48, generator=generator).to(torch.bfloat16)
    g[93] = -100.0
    y = mx_grouped_mm(x, w, offs, recipe)
    torch.manual_seed(5)
    y.backward(g)
    y_ref, gx_ref, gw_ref = _expected(x.detach(), w.detach(), offs, g, recipe, seed=5)
    assert torch.equal(y, y_ref) and torch.equal(x.grad, gx_ref) and torch.equal(w.grad, gw_ref)
    assert (y[90:] == 0).all() and (x.grad[90:] == 0).all()


def test_one_group_is_the_dense_nvfp4_linear():
    recipe = NVFP4Recipe(hadamard_seed=4)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(40, 64, generator=generator).to(torch.bfloat16)
    w = torch.randn(32, 64, generator=generator).to(torch.bfloat16)
    g = torch.randn(40, 32, generator=generator).to(torch.bfloat16)
    outs = []
    for grouped in (False, True):
        xr, wr = x.clone().requires_grad_(), (w[None] if grouped else w).clone().requires_grad_()
        if grouped:
            y = mx_grouped_mm(xr, wr, torch.tensor([40], dtype=torch.int32), recipe)
        else:
            y = mx_linear(xr, wr, None, recipe)
        torch.manual_seed(0)
        y.backward(g)
        outs.append((y, xr.grad, wr.grad.reshape(w.shape)))
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


def test_an_moe_model_converted_to_nvfp4_trains():
    torch.manual_seed(0)
    model = build_model(model_args("moe", "debug_moe", 256, 64))
    model.init_weights()
    records = convert_to_mx(model, NVFP4Recipe(), log=False)
    assert all(r.converted for r in records if r.fqn.endswith("moe.experts"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(4):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
