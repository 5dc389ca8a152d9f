"""MoE: mx_grouped_mm against a per-group reference, routing against a per-token loop,
load balancing, conversion, and training on the CPU."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from mx_recipe import MXRecipe, convert_to_mx, to_mx
from mx_recipe.formats.recipe import NVFP4_RECIPES, NVFP4Recipe
from mx_recipe.formats.scale_layout import padded_group_layout
from mx_recipe.models import build_model, flops_per_token, model_args, moe_layers
from mx_recipe.models.moe import MOE_FLAVORS, MoE, MoEArgs
from mx_recipe.nn.convert import MXGroupedExperts
from mx_recipe.nn.grouped import grouped_mm_on_one_input, mx_grouped_mm
from mx_recipe.ops import kernel_settings

RECIPES = ["mxfp8", "mxfp8_rceil", "mxfp8_wgrad_bf16", "mxfp8_e5m2_grads", "mxfp4"]
# Group sizes: ragged (not multiples of 32), empty in the middle and at the ends, no tokens at all.
GROUP_SIZES = [[40, 0, 60, 60], [0, 32, 1, 95], [17, 0, 0, 0], [0, 0, 0, 64], [0, 0, 0, 0]]


def _deq(t: torch.Tensor, elem: str, rule: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if elem == "bf16" else to_mx(t, elem, rule, dim=dim).dequantize(dtype)


def _pad32(t: torch.Tensor) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, -t.shape[0] % 32))


def reference(x, w, sizes, g, recipe: MXRecipe):
    """Per expert, with to_mx and torch.mm only: y, dx, dw."""
    r, dt = recipe, x.dtype
    ys, dxs, dws, start = [], [], [], 0
    for e, size in enumerate(sizes):
        xe, ge = x[start : start + size], g[start : start + size]
        start += size
        ys.append(torch.mm(_deq(xe, r.forward, r.scale_rule, -1, dt), _deq(w[e], r.forward, r.scale_rule, -1, dt).t()))
        dxs.append(
            torch.mm(
                _deq(ge, r.grad_elem(r.grad_input), r.scale_rule, -1, dt), _deq(w[e], r.grad_input, r.scale_rule, 0, dt)
            )
        )
        # Blocks along M inside the group: pad the group alone to a multiple of 32.
        gq = _deq(_pad32(ge), r.grad_elem(r.grad_weight), r.scale_rule, 0, dt)
        xq = _deq(_pad32(xe), r.grad_weight, r.scale_rule, 0, dt)
        dws.append(torch.mm(gq.t(), xq))
    return torch.cat(ys), torch.cat(dxs), torch.stack(dws)


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("sizes", GROUP_SIZES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mx_grouped_mm_matches_per_group_reference(name, sizes, dtype):
    torch.manual_seed(sum(sizes))
    recipe = MXRecipe.from_name(name)
    m, n, k = sum(sizes), 96, 64
    x = torch.randn(m, k, dtype=dtype, requires_grad=True)
    w = (torch.randn(len(sizes), n, k) * 0.1).to(dtype).requires_grad_()
    g = torch.randn(m, n, dtype=dtype)
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    y = mx_grouped_mm(x, w, offs, recipe)
    y.backward(g)
    ry, rdx, rdw = reference(x.detach(), w.detach(), sizes, g, recipe)
    # _grouped_mm and torch.mm may sum in different orders: equal to fp32 accumulation error.
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(y, ry, **tol)
    torch.testing.assert_close(x.grad, rdx, **tol)
    torch.testing.assert_close(w.grad, rdw, **tol)
    for e, size in enumerate(sizes):
        if size == 0:
            assert torch.count_nonzero(w.grad[e]) == 0  # an empty expert gets a zero gradient


@pytest.mark.parametrize("name", RECIPES + ["mxfp8_e5m2_grad_input"])
@pytest.mark.parametrize("sizes", GROUP_SIZES[:2])
def test_fuse_expert_casts_is_bit_identical(name, sizes):
    """w along N made in forward (fuse_expert_casts) is the operand backward would make: same bits. Where grad
    input runs in bf16 or in another format than forward, the option changes nothing."""
    torch.manual_seed(3)
    m, n, k = sum(sizes), 96, 64
    x0 = torch.randn(m, k, dtype=torch.bfloat16)
    w0 = (torch.randn(len(sizes), n, k) * 0.1).to(torch.bfloat16)
    g = torch.randn(m, n, dtype=torch.bfloat16)
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    results = []
    for fuse in (False, True):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        recipe = MXRecipe("custom", grad_input="e5m2") if name == "mxfp8_e5m2_grad_input" else MXRecipe.from_name(name)
        mx_grouped_mm(x, w, offs, dataclasses.replace(recipe, fuse_expert_casts=fuse)).backward(g)
        results.append((x.grad, w.grad))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_fuse_expert_casts_casts_w_once(monkeypatch):
    """Forward: one fake_quant_dim0_dim1 of w (not fake_quant_dim0); backward: no cast of w along N.
    Under no_grad, or when x needs no gradient, forward casts w along K only."""
    import mx_recipe.ops.mx_backends as gemm

    calls = []
    for fname in ("fake_quant_dim0", "fake_quant_dim0_dim1", "fake_quant_along_m", "fake_quant_dim0_groups_along_m"):
        fn = getattr(gemm, fname)
        monkeypatch.setattr(
            gemm, fname, lambda t, *a, _n=fname, _f=fn, **kw: calls.append((_n, t.dim())) or _f(t, *a, **kw)
        )
    recipe = MXRecipe.from_name("mxfp8", fuse_expert_casts=True)
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(2, 32, 64, requires_grad=True)
    offs = torch.tensor([40, 64], dtype=torch.int32)
    y = mx_grouped_mm(x, w, offs, recipe)
    assert calls == [("fake_quant_dim0_dim1", 3), ("fake_quant_dim0_groups_along_m", 2)]
    calls.clear()
    y.backward(torch.randn_like(y))
    assert calls == [("fake_quant_dim0_groups_along_m", 2)]  # g, once for both GEMMs; nothing of w or x
    # x needs no gradient: w along K alone; x along M too (for w's gradient), but not under no_grad
    for ctx, x_cast in ((torch.no_grad(), "fake_quant_dim0"), (torch.enable_grad(), "fake_quant_dim0_groups_along_m")):
        calls.clear()
        with ctx:
            mx_grouped_mm(x.detach(), w, offs, recipe)
        assert calls == [("fake_quant_dim0", 3), (x_cast, 2)]


SHARED_CASES = [
    *RECIPES,
    "mxfp4_sr",  # g rounds stochastically: cast once per GEMM, x still once for both
    dict(name="mxfp8", fuse_x_casts=False),  # x along M cast in backward, by each GEMM
    dict(name="mxfp8", share_input_casts=False),
    dict(name="mxfp8", grad_weight="e5m2"),  # x along M in another format: its own cast, still in forward
]


def _recipe(case) -> MXRecipe:
    return MXRecipe.from_name(case) if isinstance(case, str) else MXRecipe.from_name(**case)


def run_experts_pair(fn, x0, ws0, offs, gs, frozen=()):
    """Outputs, x.grad and the weights' grads of ``fn(x, ws)`` and a backward of ``gs``."""
    x = x0.clone().requires_grad_()
    ws = [w.clone().requires_grad_(i not in frozen) for i, w in enumerate(ws0)]
    ys = fn(x, ws)
    torch.manual_seed(0)  # stochastic rounding's draws, the same for both
    torch.autograd.backward(ys, gs)
    return [*(y.detach() for y in ys), x.grad, *(w.grad for w in ws if w.requires_grad)]


def check_shared_expert_casts(case, sizes, device: str, frozen=()) -> None:
    """grouped_mm_on_one_input (w1 and w3 reading one x) against separate mx_grouped_mm calls, and a single
    GEMM with x's casts made in forward (fuse_x_casts) against one that makes them in backward: bit for bit."""
    recipe = _recipe(case)
    gen = torch.Generator().manual_seed(len(sizes) + sum(sizes))
    m, n, k = sum(sizes), 96, 64
    x0 = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(device)
    ws0 = [(torch.randn(len(sizes), n, k, generator=gen) * 0.1).to(torch.bfloat16).to(device) for _ in range(2)]
    gs = [torch.randn(m, n, generator=gen).to(torch.bfloat16).to(device) for _ in range(2)]
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    shared = run_experts_pair(lambda x, ws: grouped_mm_on_one_input(x, ws, offs, recipe), x0, ws0, offs, gs, frozen)
    separate = run_experts_pair(
        lambda x, ws: [mx_grouped_mm(x, w, offs, recipe) for w in ws], x0, ws0, offs, gs, frozen
    )
    unfused = dataclasses.replace(recipe, fuse_x_casts=False)
    backward_casts = run_experts_pair(
        lambda x, ws: [mx_grouped_mm(x, w, offs, unfused) for w in ws], x0, ws0, offs, gs, frozen
    )
    for what, other in (("separate", separate), ("x cast in backward", backward_casts)):
        for i, (a, b) in enumerate(zip(shared, other, strict=True)):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16)), (case, what, i)


@pytest.mark.parametrize("case", SHARED_CASES)
@pytest.mark.parametrize("sizes", GROUP_SIZES)
def test_shared_expert_casts_give_the_bits_of_separate_calls(case, sizes):
    check_shared_expert_casts(case, sizes, "cpu")


def test_shared_expert_casts_with_a_frozen_weight_and_no_grad():
    check_shared_expert_casts("mxfp8", [40, 0, 60, 60], "cpu", frozen=(1,))
    x, offs = torch.randn(64, 64, dtype=torch.bfloat16), torch.tensor([10, 64], dtype=torch.int32)
    ws = [torch.randn(2, 32, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    recipe = MXRecipe.from_name("mxfp8")
    with torch.no_grad():
        got = grouped_mm_on_one_input(x, ws, offs, recipe)
        want = [mx_grouped_mm(x, w, offs, recipe) for w in ws]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_experts_cast_x_once_per_orientation(monkeypatch):
    """MX experts (w1 and w3 on x, w2 on h): forward makes x's and h's casts, each from one read (along K and
    along M in groups); backward casts each upstream gradient once, for both of its GEMMs, and nothing of x or h."""
    import mx_recipe.ops.mx_backends as gemm

    calls = []
    for fname in (
        "fake_quant_dim0",
        "fake_quant_dim0_dim1",
        "fake_quant_groups_along_m",
        "fake_quant_dim0_groups_along_m",
    ):
        fn = getattr(gemm, fname)
        monkeypatch.setattr(
            gemm, fname, lambda t, *a, _n=fname, _f=fn, **kw: calls.append((_n, t.shape)) or _f(t, *a, **kw)
        )
    moe = MoE(_small_moe_args(n_shared_experts=0))
    convert_to_mx(moe, MXRecipe.from_name("mxfp8"))
    x = torch.randn(20, 64, requires_grad=True)
    y = moe.experts(x, torch.tensor([5, 5, 12, 20], dtype=torch.int32))
    assert [c[0] for c in calls if len(c[1]) == 2] == ["fake_quant_dim0_groups_along_m"] * 2, calls  # x, then h
    assert [c[0] for c in calls if len(c[1]) == 3] == ["fake_quant_dim0_dim1"] * 3, calls  # w1, w3, w2: both ways
    calls.clear()
    y.sum().backward()
    assert [c[0] for c in calls] == ["fake_quant_dim0_groups_along_m"] * 3, calls  # g2, g1, g3; nothing of x, h, w


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", SHARED_CASES)
def test_gpu_shared_expert_casts_give_the_bits_of_separate_calls(case):
    for sizes in GROUP_SIZES + [[1040, 7, 0, 300]]:
        check_shared_expert_casts(case, sizes, "cuda")


def test_padded_group_layout_by_hand():
    # Groups of 40, 0, 60, 60 rows -> padded to 64, 0, 64, 64: starts 0, 64, 64, 128.
    dest, padded_offs, size = padded_group_layout(torch.tensor([40, 40, 100, 160], dtype=torch.int32), 160, 32)
    assert padded_offs.tolist() == [64, 64, 128, 192] and size == 160 + 4 * 32  # 160 is a multiple of 32
    assert dest[:40].tolist() == list(range(40))
    assert dest[40:100].tolist() == list(range(64, 124))
    assert dest[100:].tolist() == list(range(128, 188))


def test_mx_grouped_mm_input_errors():
    recipe = MXRecipe.from_name("mxfp8")
    x, w = torch.randn(64, 64), torch.randn(2, 96, 64)
    with pytest.raises(TypeError, match="int32"):
        mx_grouped_mm(x, w, torch.tensor([32, 64]), recipe)
    with pytest.raises(ValueError, match="offs"):
        mx_grouped_mm(x, w, torch.tensor([64], dtype=torch.int32), recipe)
    with pytest.raises(ValueError, match="divisible by 32"):
        mx_grouped_mm(torch.randn(64, 48), torch.randn(2, 96, 48), torch.tensor([32, 64], dtype=torch.int32), recipe)


@pytest.mark.parametrize(
    "offs, error",
    [
        ([64, 32], r"offs must be non-decreasing group ends >= 0, got \[64, 32\]"),
        ([-8, 64], r"offs must be non-decreasing group ends >= 0, got \[-8, 64\]"),
        ([64, 200], r"offs ends at row 200, past x's 96 rows"),
        ([32, 32], None),  # an empty group
        ([32, 70], None),  # rows past the last group: zeros (below)
    ],
)
def test_mx_grouped_mm_refuses_bad_group_ends_on_the_cpu(offs, error):
    """Decreasing, negative or past M: an error that shows them (on a GPU: with the kernel setting check_offs)."""
    x, w, offs = torch.randn(96, 64), torch.randn(2, 96, 64), torch.tensor(offs, dtype=torch.int32)
    if error is None:
        mx_grouped_mm(x, w, offs, MXRecipe.from_name("mxfp8"))
        return
    with pytest.raises(ValueError, match="mx_grouped_mm: " + error):
        mx_grouped_mm(x, w, offs, MXRecipe.from_name("mxfp8"))


def check_rows_past_the_last_group(device: str, recipe: str) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(96, 64, generator=gen).to(device, torch.bfloat16).requires_grad_(True)
    w = torch.randn(2, 64, 64, generator=gen).to(device, torch.bfloat16).requires_grad_(True)
    offs = torch.tensor([32, 70], dtype=torch.int32, device=device)  # rows 70..95 in no group
    y = mx_grouped_mm(x, w, offs, MXRecipe.from_name(recipe))
    again = mx_grouped_mm(x, w, offs, MXRecipe.from_name(recipe))
    assert torch.equal(y, again) and not y[70:].any() and y[:70].abs().sum() > 0
    y.backward(torch.randn(y.shape, generator=gen).to(device, torch.bfloat16))
    assert not x.grad[70:].any() and x.grad[:70].abs().sum() > 0 and torch.isfinite(w.grad).all()
    full = torch.tensor([32, 96], dtype=torch.int32, device=device)  # the rows in the last group: written
    assert mx_grouped_mm(x, w, full, MXRecipe.from_name(recipe))[70:].abs().sum() > 0


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
def test_rows_past_the_last_group_are_zero_with_zero_gradients(recipe):
    check_rows_past_the_last_group("cpu", recipe)


def check_rows_past_the_last_group_reach_nothing(device: str, name: str) -> None:
    """Rows at and past offs[-1] belong to no expert: scaling them by 1e4, in x and in the gradient, changes
    no output, no gradient and no scale of the rows in groups (a row past the groups once shared the last
    group's last block along M, and moved its scale)."""
    recipe = NVFP4Recipe.from_name(name) if name in NVFP4_RECIPES else MXRecipe.from_name(name)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    w = torch.randn(2, 64, 64, generator=gen).to(torch.bfloat16)
    g = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    offs = torch.tensor([32, 70], dtype=torch.int32, device=device)  # the last group ends mid-block
    results = []
    for scale in (1.0, 1e4):
        xs, gs = x.clone(), g.clone()
        xs[70:] *= scale
        gs[70:] *= scale
        xs, ws = xs.to(device).requires_grad_(), w.to(device).clone().requires_grad_()
        torch.manual_seed(0)  # the same stochastic draws
        y = mx_grouped_mm(xs, ws, offs, recipe)
        y.backward(gs.to(device))
        results.append((y[:70], xs.grad[:70], ws.grad))
    for a, b, what in zip(*results, ("y", "x.grad", "w.grad"), strict=True):
        assert torch.equal(a, b), f"{name}: {what} depends on the rows past the last group"


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4_sr", "nvfp4"])
def test_rows_past_the_last_group_reach_no_scale(recipe):
    check_rows_past_the_last_group_reach_nothing("cpu", recipe)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4", "nvfp4"])
def test_gpu_rows_past_the_last_group_reach_no_scale(recipe):
    check_rows_past_the_last_group_reach_nothing("cuda", recipe)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_rceil"])
def test_gpu_rows_past_the_last_group_are_zero_with_zero_gradients(recipe):
    check_rows_past_the_last_group("cuda", recipe)
    x, w = torch.randn(96, 64, device="cuda"), torch.randn(2, 96, 64, device="cuda")
    with kernel_settings(check_offs=True), pytest.raises(ValueError, match="past x's 96 rows"):
        mx_grouped_mm(x, w, torch.tensor([64, 200], dtype=torch.int32, device="cuda"), MXRecipe.from_name(recipe))


def _small_moe_args(**kw) -> MoEArgs:
    base = dict(
        dim=64,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2,
        multiple_of=32,
        vocab_size=64,
        max_seq_len=16,
        n_routed_experts=4,
        top_k=2,
        n_shared_experts=1,
        moe_hidden_dim=32,
    )
    return MoEArgs(**{**base, **kw})


@pytest.mark.parametrize("score_func, route_norm", [("softmax", False), ("sigmoid", True)])
def test_moe_matches_per_token_loop(score_func, route_norm):
    torch.manual_seed(0)
    moe = MoE(_small_moe_args(score_func=score_func, route_norm=route_norm))
    moe.init_weights(0.02)
    moe.expert_bias.copy_(torch.tensor([0.3, -0.1, 0.0, 0.05]))  # steers the choice, not the weights
    x = torch.randn(3, 5, 64)
    out = moe(x)
    flat, expected = x.reshape(-1, 64), []
    probs = moe.router.gate(flat).float()
    probs = probs.softmax(-1) if score_func == "softmax" else probs.sigmoid()
    for t in range(flat.shape[0]):
        chosen = (probs[t] + moe.expert_bias).topk(2).indices
        weights = probs[t, chosen] / (probs[t, chosen].sum() if route_norm else 1)
        acc = moe.shared_experts(flat[t : t + 1])[0]
        for e, wt in zip(chosen.tolist(), weights, strict=True):
            ex = moe.experts
            h = F.silu(flat[t] @ ex.w1[e].t()) * (flat[t] @ ex.w3[e].t())
            acc = acc + wt * (h @ ex.w2[e].t())
        expected.append(acc)
    torch.testing.assert_close(out.reshape(-1, 64), torch.stack(expected), rtol=1e-5, atol=1e-5)
    assert moe.tokens_per_expert.sum() == 15 * 2


def test_expert_bias_update_moves_toward_balance():
    moe = MoE(_small_moe_args(bias_update_speed=0.01))
    moe.init_weights(0.02)
    moe.update_expert_bias(torch.tensor([10.0, 2.0, 2.0, 2.0]))
    assert moe.expert_bias[0] < 0 and (moe.expert_bias[1:] > 0).all()
    assert abs(moe.expert_bias.sum()) < 1e-6 and moe.tokens_per_expert.sum() == 0


def test_public_moe_dims_and_active_flops():
    a = MOE_FLAVORS["moe_16B"]
    assert (a.dim, a.n_layers, a.n_routed_experts, a.top_k, a.n_shared_experts, a.moe_hidden_dim) == (
        2048,
        28,
        64,
        6,
        2,
        1408,
    )
    s = MOE_FLAVORS["moe_scout"]
    assert (s.dim, s.n_layers, s.n_heads, s.n_kv_heads, s.n_routed_experts, s.top_k, s.moe_hidden_dim) == (
        5120,
        48,
        40,
        8,
        16,
        1,
        8192,
    )
    args = model_args("moe", "moe_16B", vocab_size=102400, max_seq_len=4096)
    with torch.device("meta"):
        model = build_model(args)
    total = sum(p.numel() for p in model.parameters())
    assert 16.3e9 < total < 16.5e9  # DeepSeek-MoE 16B: 16.4B parameters
    routed = sum(p.numel() for m in moe_layers(model) for p in m.experts.parameters())
    active = total - 102400 * 2048 - routed * (1 - 6 / 64)
    assert flops_per_token(args, model, 4096) == 6 * active + 12 * 28 * 16 * 128 * 4096


def test_converter_swaps_experts_and_keeps_router_gate():
    args = model_args("moe", "debug_moe", vocab_size=320, max_seq_len=32)
    model = build_model(args)
    model.init_weights()
    params = {n: p for n, p in model.named_parameters()}
    records = convert_to_mx(model, MXRecipe.from_name("mxfp8"))
    by_fqn = {r.fqn: r for r in records}
    assert by_fqn["layers.1.moe.experts"].converted and by_fqn["layers.1.moe.experts"].shape == (8, 128, 256)
    assert isinstance(model.layers["1"].moe.experts, MXGroupedExperts)
    assert not by_fqn["layers.1.moe.router.gate"].converted
    assert "layers.0.feed_forward.w1" in by_fqn  # the dense first layer
    assert all(p is params[n] for n, p in model.named_parameters())
    logits = model(torch.randint(0, 320, (2, 32)))
    logits.float().mean().backward()
    assert model.layers["1"].moe.experts.w1.grad is not None


@pytest.mark.parametrize("name", ["mxfp8", "mxfp8_rceil", "mxfp4", "mxfp8_wgrad_bf16"])
@pytest.mark.parametrize("sizes", [[5, 0, 40, 1], [0, 0, 64, 0]])
def test_routed_experts_are_bit_identical_to_the_routed_copy(name, sizes):
    check_routed_experts(name, sizes, "cpu")


def check_routed_experts(name: str, sizes: list[int], device: str) -> None:
    """experts(tokens, offs, routed) casts x[routed] from the tokens (no copy, where the recipe allows): outputs and
    every gradient equal experts(tokens[routed], offs), tokens repeated and some never routed."""
    torch.manual_seed(3)
    moe = MoE(_small_moe_args(n_shared_experts=0)).to(device=device, dtype=torch.bfloat16)
    moe.init_weights(0.02)
    convert_to_mx(moe, MXRecipe.from_name(name), log=False)
    tokens0 = torch.randn(30, 64, device=device).to(torch.bfloat16)
    routed = torch.randint(0, 30, (sum(sizes),), device=device)
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    g = torch.randn(sum(sizes), 64, device=device).to(torch.bfloat16)
    results = []
    for gather in (True, False):
        tokens = tokens0.clone().requires_grad_()
        y = moe.experts(tokens, offs, routed) if gather else moe.experts(tokens[routed], offs)
        y.backward(g)
        grads = [p.grad.clone() for p in moe.experts.parameters()]
        moe.experts.zero_grad()
        results.append((y, tokens.grad, *grads))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
