"""MXLinear / mx_linear against a hand-written emulation of the three GEMMs
(docs/DESIGN.md, The MX linear: three GEMMs, six casts).

For y = x @ w.T with x: [M, K], w: [N, K] and upstream gradient g: [M, N]:

    forward      y  = x @ w.T   x along K, w along K
    grad input   gx = g @ w     g along N, w along N
    grad weight  gw = g.T @ x   g along M, x along M   (M padded with zero rows to a multiple of 32)

The emulation below builds each GEMM from ``to_mx`` + ``dequantize`` + ``torch.mm`` and feeds
``torch.mm`` operands with the same memory layout as the emulated backend (nn.Linear's own:
every operand row-major in its tensor's layout, g and x transposed as views for grad weight), so
that matmul runs the same summation order and the comparison can be bit for bit (``torch.equal``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from script_module import load_benchmark
from torch import nn

from mx_recipe.formats.mx import to_mx
from mx_recipe.formats.philox import philox_uniform
from mx_recipe.formats.recipe import RECIPES, MXRecipe
from mx_recipe.nn.linear import MXLinear, mx_linear
from mx_recipe.ops.dispatch import implementation

saved_bytes = load_benchmark("saved_memory").saved_bytes
K, N = 64, 96
CUSTOM = MXRecipe(
    "custom_mixed", forward="e4m3", grad_input="bf16", grad_weight="e5m2", grad="e5m2", scale_rule="rceil"
)
ALL_RECIPES = [*RECIPES.values(), CUSTOM]
DTYPES = [torch.bfloat16, torch.float32]


def deq(t: torch.Tensor, elem: str, rule: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Quantize-dequantize ``t`` in blocks of 32 along ``dim``."""
    return to_mx(t, elem, rule, dim=dim).dequantize(dtype)


def pad_rows(t: torch.Tensor) -> torch.Tensor:
    """Append zero rows up to a multiple of 32 (zeros do not change any block's amax)."""
    return torch.cat([t, t.new_zeros(-t.shape[0] % 32, t.shape[1])])


SR_SEED = 1234  # run_mx seeds the default generator with it before backward


def grad_operands(g2: torch.Tensor, r: MXRecipe, dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantized upstream gradient of the backward GEMMs of the emulated backend: (g along N [M, N], g along
    M [Mp, N]).

    Stochastic rounding replays the backward's draws from the default generator, seeded with SR_SEED. On the
    reference: grad input's first (one per element of g [M, N]), then grad weight's, one per element of the
    padded g read transposed ([N, Mp], the layout its cast quantizes). On the Triton fake-quant (bf16 e2m1 on
    CUDA, dispatch.rule): the one seed of the backward's one fake-quant call, and Philox streams 0 (along N)
    and 1 (along M) indexed by each output's row-major position (``philox.philox_uniform``)."""
    rule = r.scale_rule
    if r.grad_rounding == "nearest":
        return deq(g2, r.grad, rule, 1, dt), deq(pad_rows(g2), r.grad, rule, 0, dt).contiguous()
    torch.manual_seed(SR_SEED)
    g_m_in = pad_rows(g2).t().contiguous()
    if implementation("fake_quant_2d", g2, r.grad, "stochastic") == "triton":
        seed = int(torch.randint(0, 2**62, (1,), device=g2.device, dtype=torch.int64).item())  # one call, one seed
        u_n = philox_uniform(seed, 0, tuple(g2.shape), g2.device)
        u_m = philox_uniform(seed, 1, (g_m_in.shape[1], g_m_in.shape[0]), g2.device).t().contiguous()
        random_n, random_m = dict(uniform=u_n), dict(uniform=u_m)
    else:
        random_n = random_m = {}
    sr = dict(dim=1, rounding="stochastic")
    g_n = to_mx(g2, r.grad, rule, **sr, **random_n).dequantize(dt) if r.grad_input != "bf16" else None
    g_m = to_mx(g_m_in, r.grad, rule, **sr, **random_m).dequantize(dt).t()
    return g_n, g_m.contiguous()


def emulate(x, w, b, g, r: MXRecipe):
    """(y, gx, gw, gb) of F.linear(x, w, b) with upstream gradient g, each GEMM per recipe ``r``."""
    dt = x.dtype
    x2, g2 = x.reshape(-1, K), g.reshape(-1, N)
    rule = r.scale_rule
    g_along_n, g_along_m = grad_operands(g2, r, dt)

    # forward: x [M, K] and w [N, K] both along K (dim 1); y = xq @ wq.T
    if r.forward == "bf16":
        y = torch.mm(x2, w.t())
    else:
        y = torch.mm(deq(x2, r.forward, rule, 1, dt), deq(w, r.forward, rule, 1, dt).t())

    # grad input: g [M, N] along N (dim 1), w [N, K] along N (dim 0); gx = gq @ wq
    if r.grad_input == "bf16":
        gx = torch.mm(g2, w)
    else:
        gq = g_along_n
        wq = deq(w, r.grad_input, rule, 0, dt).contiguous()  # [N, K] row-major, as w
        gx = torch.mm(gq, wq)

    # grad weight: g and x along M (dim 0), M padded with zero rows; gw = gq.T @ xq
    if r.grad_weight == "bf16":
        gw = torch.mm(g2.t(), x2)
    else:
        gq = g_along_m  # [Mp, N] row-major
        xq = deq(pad_rows(x2), r.grad_weight, rule, 0, dt).contiguous()  # [Mp, K] row-major
        gw = torch.mm(gq.t(), xq)

    y = y.reshape(*x.shape[:-1], N)
    if b is not None:
        y = y + b
    gb = None if b is None else g2.sum(0)
    return y, gx.reshape(x.shape), gw, gb


def run_mx(x, w, b, g, recipe, backend=None):
    x = x.clone().requires_grad_(True)
    lin = MXLinear(K, N, bias=b is not None, recipe=recipe, backend=backend, dtype=x.dtype, device=x.device)
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    y = lin(x)
    torch.manual_seed(SR_SEED)  # the random bits of stochastic rounding (grad_operands replays them)
    y.backward(g)
    return y.detach(), x.grad, lin.weight.grad, None if b is None else lin.bias.grad


def make_inputs(lead, dtype, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    gy = torch.randn(*lead, N, generator=g).to(dtype)
    return x, w, b, gy


LEADS = {"2d-M64": (64,), "2d-M40": (40,), "3d-M70": (2, 35), "3d-M96": (3, 32), "2d-M1": (1,)}


@pytest.mark.parametrize("lead", LEADS.values(), ids=LEADS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=lambda r: r.name)
def test_mx_linear_bit_exact_vs_emulation(recipe, dtype, lead):
    x, w, b, gy = make_inputs(lead, dtype)
    y, gx, gw, gb = run_mx(x, w, b, gy, recipe)
    ey, egx, egw, egb = emulate(x, w, b, gy, recipe)
    assert y.dtype == gx.dtype == gw.dtype == dtype
    assert y.shape == (*lead, N) and gx.shape == x.shape and gw.shape == w.shape
    assert torch.equal(y, ey), "forward"
    assert torch.equal(gx, egx), "grad input"
    assert torch.equal(gw, egw), "grad weight"
    assert torch.equal(gb, egb), "grad bias"


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_no_bias_and_frozen_input(dtype):
    recipe = RECIPES["mxfp8"]
    x, w, _, gy = make_inputs((40,), dtype, seed=1, bias=False)
    lin = MXLinear(K, N, bias=False, recipe=recipe, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
    y = lin(x)  # x does not require grad: only the weight gradient is computed
    y.backward(gy)
    ey, _, egw, _ = emulate(x, w, None, gy, recipe)
    assert x.grad is None
    assert torch.equal(y, ey) and torch.equal(lin.weight.grad, egw)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("recipe", [r for r in ALL_RECIPES if r.grad_weight != "bf16"], ids=lambda r: r.name)
def test_padding_rows_is_the_unpadded_math(recipe, dtype):
    """Grad weight with M = 40: the zero rows appended for the casts change nothing, so the result
    is the float64 sum over the 40 real rows of the quantized operands, up to fp32 accumulation."""
    M = 40
    x, w, b, gy = make_inputs((M,), dtype, seed=2)
    _, _, gw, _ = run_mx(x, w, b, gy, recipe)
    gq = grad_operands(gy, recipe, torch.float32)[1]
    xq = deq(pad_rows(x), recipe.grad_weight, recipe.scale_rule, 0, torch.float32)
    assert not bool(gq[M:].any()) and not bool(xq[M:].any())  # padded rows quantize to exact zeros
    # the second block along M holds rows 32..39 only; its scale is set by those 8 rows: check a
    # column against the 8 rows quantized alone in a block whose other 24 entries are zero
    col = torch.cat([x[32:M, 5].float(), torch.zeros(24)])
    assert torch.equal(xq[32:, 5], deq(col, recipe.grad_weight, recipe.scale_rule, 0, torch.float32))
    ref = gq[:M].double().t() @ xq[:M].double()  # unpadded math on the real rows, exact products
    tol = (gq[:M].double().abs().t() @ xq[:M].double().abs()) * (M * 2.0**-24)  # fp32 accumulation
    if dtype == torch.bfloat16:
        tol = tol + ref.abs() * 2.0**-8  # the bf16 result is one more rounding
    assert bool(((gw.double() - ref).abs() <= tol).all())


def test_wgrad_bf16_is_plain_mm():
    """mxfp8_wgrad_bf16: grad weight is torch.mm(g.T, x) on the bf16 tensors, no cast at all."""
    recipe = RECIPES["mxfp8_wgrad_bf16"]
    for lead in [(64,), (40,), (2, 35)]:
        x, w, b, gy = make_inputs(lead, torch.bfloat16, seed=3)
        _, gx, gw, _ = run_mx(x, w, b, gy, recipe)
        assert torch.equal(gw, torch.mm(gy.reshape(-1, N).t(), x.reshape(-1, K)))
        # and the grad-input GEMM is still MX (it differs from the plain bf16 one)
        assert not torch.equal(gx, (gy.reshape(-1, N) @ w).reshape(x.shape))


@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=lambda r: r.name)
def test_each_gemm_uses_its_own_format(recipe):
    """Swapping the format of one GEMM changes exactly that GEMM's result (catches crossed wires)."""
    x, w, b, gy = make_inputs((64,), torch.float32, seed=4)
    base = run_mx(x, w, b, gy, recipe)
    for field, idx in (("forward", 0), ("grad_input", 1), ("grad_weight", 2)):
        other = "e5m2" if getattr(recipe, field) != "e5m2" else "e4m3"
        changed = run_mx(x, w, b, gy, MXRecipe(**{**recipe.__dict__, field: other}))
        for j in range(3):
            assert torch.equal(base[j], changed[j]) == (j != idx), (field, j)


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# Upper bounds: with e4m3 (3 mantissa bits) the relative rounding error of one element is at
# most 2**-4 and a few per cent on average, so a product of two such operands stays well under
# 0.1; e2m1 (1 mantissa bit) is coarse, hence 0.35. Lower bounds show that quantization happened.
TOLERANCES = {"e4m3": (1e-3, 0.1), "e5m2": (1e-3, 0.15), "e2m1": (0.05, 0.35)}


@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=lambda r: r.name)
def test_close_to_bf16_linear(recipe):
    x, w, b, gy = make_inputs((4, 64), torch.bfloat16, seed=5)
    lin = nn.Linear(K, N, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    xr = x.clone().requires_grad_(True)
    yr = lin(xr)
    yr.backward(gy)
    y, gx, gw, gb = run_mx(x, w, b, gy, recipe)

    lo, hi = TOLERANCES[recipe.forward]
    # compare the GEMM part only (the bias is added in high precision in both)
    err = rel_fro(y - b, yr.detach() - b)
    assert lo < err < hi, f"forward rel error {err}"
    checks = [(gx, xr.grad, recipe.grad_input, "grad input"), (gw, lin.weight.grad, recipe.grad_weight, "grad weight")]
    for got, ref, fmt, what in checks:
        err = rel_fro(got, ref)
        if fmt == "bf16":
            assert err < 1e-2, f"{what} rel error {err}"
        else:
            # the gradient operand uses recipe.grad: take the looser of the two formats' bounds
            lo = min(TOLERANCES[fmt][0], TOLERANCES[recipe.grad][0])
            hi = max(TOLERANCES[fmt][1], TOLERANCES[recipe.grad][1])
            assert lo < err < hi, f"{what} rel error {err}"
    assert torch.equal(gb, lin.bias.grad)


def test_from_linear_shares_parameters_and_state_dict():
    lin = nn.Linear(K, N)
    mx = MXLinear.from_linear(lin, RECIPES["mxfp8"])
    assert isinstance(mx, nn.Linear)
    assert mx.weight is lin.weight and mx.bias is lin.bias
    assert list(mx.state_dict()) == list(lin.state_dict()) == ["weight", "bias"]
    assert [p for p in mx.parameters()] == [lin.weight, lin.bias]
    assert (mx.in_features, mx.out_features) == (K, N)
    assert mx.recipe is RECIPES["mxfp8"]
    assert "mxfp8" in repr(mx)
    # a step on one is a step on the other
    with torch.no_grad():
        mx.weight.add_(1.0)
    assert torch.equal(mx.weight, lin.weight)

    lin_nb = nn.Linear(K, N, bias=False)
    mx_nb = MXLinear.from_linear(lin_nb, RECIPES["mxfp4"])
    assert list(mx_nb.state_dict()) == list(lin_nb.state_dict()) == ["weight"]
    assert mx_nb.bias is None
    x = torch.randn(3, K)
    assert torch.equal(mx_nb(x), mx_linear(x, lin_nb.weight, None, RECIPES["mxfp4"]))


def test_from_linear_output_matches_mx_linear():
    lin = nn.Linear(K, N, dtype=torch.bfloat16)
    mx = MXLinear.from_linear(lin, RECIPES["mxfp8_rceil"])
    x = torch.randn(5, K, dtype=torch.bfloat16)
    ey = emulate(x, lin.weight.detach(), lin.bias.detach(), torch.zeros(5, N, dtype=torch.bfloat16),
                 RECIPES["mxfp8_rceil"])[0]  # fmt: skip
    assert torch.equal(mx(x).detach(), ey)


def test_constructor_state_dict_matches_nn_linear():
    mx = MXLinear(K, N, recipe=RECIPES["mxfp8"])
    assert list(mx.state_dict()) == list(nn.Linear(K, N).state_dict())
    assert mx.weight.shape == (N, K)


@pytest.mark.parametrize("shape", [(N, 48), (48, K), (33, 33), (N, 16)])
def test_weight_shape_not_multiple_of_32_raises(shape):
    n, k = shape
    w = torch.randn(n, k)
    with pytest.raises(ValueError, match=str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")):
        mx_linear(torch.randn(4, k), w, None, RECIPES["mxfp8"])
    lin = MXLinear(k, n, recipe=RECIPES["mxfp8"])
    with pytest.raises(ValueError, match="divisible by 32"):
        lin(torch.randn(4, k))


def test_mx_linear_matches_functional_shape_semantics():
    # x with several leading dims, same shape contract as F.linear
    w = torch.randn(N, K)
    x = torch.randn(2, 3, 4, K)
    y = mx_linear(x, w, None, RECIPES["mxfp8"])
    assert y.shape == F.linear(x, w).shape


# ---------------------------------------------------------------------------------------------
# save_mx_input: x saved for backward in MX form (along M, as the grad-weight GEMM casts it).
# ---------------------------------------------------------------------------------------------
SAVE_MX_RECIPES = [r for r in ALL_RECIPES if r.grad_weight != "bf16"]


def with_save_mx(r: MXRecipe) -> MXRecipe:
    return MXRecipe(**{**r.__dict__, "save_mx_input": True})


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal bit patterns (so -0 differs from +0), NaNs in the same places."""
    if a is None or b is None:
        return a is b
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    nan = a.isnan()
    return a.dtype == b.dtype and torch.equal(nan, b.isnan()) and torch.equal(a.view(ints)[~nan], b.view(ints)[~nan])


def special_input(lead, dtype, seed=7):
    """x whose rows span many binades: bf16-subnormal and huge blocks, zero rows, -0, one Inf."""
    x, w, b, gy = make_inputs(lead, dtype, seed=seed)
    x2 = x.reshape(-1, K)
    exps = torch.tensor([-130.0, -100.0, -20.0, 0.0, 20.0, 60.0])
    x2.mul_(torch.pow(2.0, exps[torch.arange(x2.shape[0]) % len(exps)]).to(dtype)[:, None])
    x2[1::7] = 0.0
    x2[2::7, :5] = -0.0
    if x2.shape[0] > 4:
        x2[4, 3] = float("inf")
    return x, w, b, gy


SAVE_MX_CASES = {**{f"randn-{k}": (v, False) for k, v in LEADS.items()}, "special-2d-M40": ((40,), True),
                 "special-3d-M70": ((2, 35), True)}  # fmt: skip


def test_save_mx_input_needs_mx_grad_weight():
    """With grad_weight='bf16' x is needed in bf16: the recipe refuses the option (tests/test_recipe.py)."""
    with pytest.raises(ValueError, match=r"save_mx_input=True needs an MX grad_weight"):
        with_save_mx(RECIPES["mxfp8_wgrad_bf16"])


@pytest.mark.parametrize(
    "name, expected",
    [
        # x [64, 64] in bf16: 8192 bytes. MX: x.T's fp8 data [64, 64] + e8m0 scales [64, 2]: 4224.
        ("mxfp8", 4224),
        ("mxfp8_e5m2_grads", 4224),
        # fp4: two elements per byte, [64, 32] + [64, 2] scales: 2176
        ("mxfp4", 2176),
    ],
)
def test_save_mx_input_saves_fewer_bytes(name, expected):
    x = torch.randn(64, K, dtype=torch.bfloat16, requires_grad=True)
    lin = MXLinear(K, 64, bias=False, recipe=RECIPES[name], dtype=torch.bfloat16)
    assert saved_bytes(lin, x) == 64 * K * 2
    lin.recipe = with_save_mx(RECIPES[name])
    assert saved_bytes(lin, x) == expected
    # M = 40 pads to 64 rows for the blocks along M: the same bytes as 64 rows, vs 5120 in bf16
    lin.recipe = with_save_mx(RECIPES["mxfp8"])
    assert saved_bytes(lin, x[:40].detach().requires_grad_()) == 4224


def test_save_mx_input_casts_only_when_grad_weight_is_needed(monkeypatch):
    """No cast of x along M in forward under no_grad (evaluation) or for a frozen weight."""
    import mx_recipe.ops.mx_backends as gemm

    calls = []

    def counting_cast_dim1(t, *args, **kwargs):
        calls.append(tuple(t.shape))
        return counting_cast_dim1.__wrapped__(t, *args, **kwargs)

    counting_cast_dim1.__wrapped__ = gemm.cast_dim1
    monkeypatch.setattr(gemm, "cast_dim1", counting_cast_dim1)
    lin = MXLinear(K, N, recipe=with_save_mx(RECIPES["mxfp8"]))
    x = torch.randn(40, K, requires_grad=True)
    with torch.no_grad():
        lin(x)
    assert calls == []
    lin.weight.requires_grad_(False)
    lin(x).sum().backward()
    assert calls == [] and x.grad is not None
    lin.weight.requires_grad_(True)
    lin(x)
    assert calls == [(64, K)]  # in forward: x padded to 64 rows, along M


# ---------------------------------------------------------------------------------------------
# fuse_x_casts (emulated): one read of x for both of its fake-quants; x along M saved instead of x.
# ---------------------------------------------------------------------------------------------
FUSE_X_RECIPES = [r for r in ALL_RECIPES if r.grad_weight != "bf16" and r.grad_weight == r.forward]


def with_fuse_x(r: MXRecipe) -> MXRecipe:
    return MXRecipe(**{**r.__dict__, "fuse_x_casts": True})


def unfused(r: MXRecipe) -> MXRecipe:
    """Each cast of x on its own: x along K in forward, along M in backward (fuse_x_casts is on by default)."""
    return MXRecipe(**{**r.__dict__, "fuse_x_casts": False})


# Both options make x along M in forward, the operand backward would otherwise make from x.
X_IN_FORWARD = [(unfused(r), with_save_mx(r)) for r in SAVE_MX_RECIPES]
X_IN_FORWARD += [(unfused(r), with_fuse_x(r)) for r in FUSE_X_RECIPES]


@pytest.mark.parametrize("lead, special", SAVE_MX_CASES.values(), ids=SAVE_MX_CASES.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "recipe, option",
    X_IN_FORWARD,
    ids=[f"{r.name}-{'save_mx' if o.save_mx_input else 'fuse_x'}" for r, o in X_IN_FORWARD],
)
def test_x_along_m_made_in_forward_is_bit_identical(recipe, option, dtype, lead, special):
    """save_mx_input (MX form) and fuse_x_casts (bf16) change no bit of y, gx, gw, gb."""
    inputs = special_input(lead, dtype) if special else make_inputs(lead, dtype, seed=6)
    base = run_mx(*inputs, recipe)
    other = run_mx(*inputs, option)
    for what, a, b in zip(("y", "gx", "gw", "gb"), base, other, strict=True):
        assert same_bits(a, b), what


def test_fuse_x_casts_reads_x_once_and_saves_x_along_m(monkeypatch):
    """Forward: one fake_quant_dim0_dim1 of x, no fake_quant_dim0 of x; backward: no cast of x along M
    (only w's along N). Saved: x along M padded to 32 rows, bf16, instead of x."""
    import mx_recipe.ops.mx_backends as gemm

    calls = []
    for name in ("fake_quant_dim0", "fake_quant_dim0_dim1", "fake_quant_along_m"):
        fn = getattr(gemm, name)
        monkeypatch.setattr(
            gemm, name, lambda t, *a, _n=name, _f=fn, **kw: calls.append((_n, t.shape)) or _f(t, *a, **kw)
        )
    lin = MXLinear(K, N, bias=False, recipe=with_fuse_x(RECIPES["mxfp8"]), dtype=torch.bfloat16)
    x = torch.randn(40, K, dtype=torch.bfloat16, requires_grad=True)
    y = lin(x)
    assert calls == [("fake_quant_dim0_dim1", (40, K)), ("fake_quant_dim0", (N, K))]
    calls.clear()
    y.backward(torch.randn_like(y))
    # g read once for both of its fake-quants, w along N; x is not read again
    assert calls == [("fake_quant_dim0_dim1", (40, N)), ("fake_quant_along_m", (N, K))]
    assert saved_bytes(lin, x) == 64 * K * 2  # [64, K] bf16, where x itself is 40 * K * 2 bytes
    lin.recipe = MXRecipe.from_name("mxfp8", fuse_x_casts=False)
    assert saved_bytes(lin, x) == 40 * K * 2


def test_fuse_x_casts_only_when_grad_weight_is_needed(monkeypatch):
    """Under no_grad or for a frozen weight forward casts x along K only, as without the option."""
    import mx_recipe.ops.mx_backends as gemm

    fused = []
    fn = gemm.fake_quant_dim0_dim1
    monkeypatch.setattr(gemm, "fake_quant_dim0_dim1", lambda *a, **kw: fused.append(1) or fn(*a, **kw))
    lin = MXLinear(K, N, recipe=with_fuse_x(RECIPES["mxfp8"]))
    x = torch.randn(40, K, requires_grad=True)
    with torch.no_grad():
        lin(x)
    lin.weight.requires_grad_(False)
    lin(x).sum().backward()  # backward: g's fake-quants do not need both orientations either
    assert fused == [] and x.grad is not None


# ---------------------------------------------------------------------------------------------
# The hardware backends' wiring on the CPU: which casts reach which GEMM.
# ---------------------------------------------------------------------------------------------
def fake_triton_mm(calls: list):
    """A stand-in for gemm.mx_mm_triton that records its operands and multiplies them emulated.

    Only for the orientation and formats of the operands: the kernel is tested elsewhere."""
    from mx_recipe.formats.mx import MXTensor
    from mx_recipe.ops.mx_cast import BlockedMXTensor

    def mm(a, b, out_dtype):
        for t in (a, b):
            assert isinstance(t, MXTensor) and not isinstance(t, BlockedMXTensor)
            assert t.qdata.dim() == 2 and t.dim == 1 and t.scale.shape == (t.shape[0], t.shape[1] // 32)
        calls.append((a.elem, b.elem, tuple(a.shape), tuple(b.shape)))
        return torch.mm(a.dequantize(out_dtype), b.dequantize(out_dtype).t())

    return mm


@pytest.mark.parametrize("save_mx", [False, True], ids=["save_x", "save_mx"])
@pytest.mark.parametrize("lead", [(64,), (40,)], ids=["M64", "M40"])
@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=lambda r: r.name)
def test_triton_backend_operands(monkeypatch, recipe, lead, save_mx):
    """Each GEMM gets a @ b.T of plain-scale casts along its K: forward x [M, K] and w [N, K] in the
    forward format; grad input g [M, N] in ``grad`` and w along N ([K, N]) in grad_input's; grad
    weight g and x along M, padded to a multiple of 32 ([N, Mp], [K, Mp]). With that stand-in the
    results are the emulated backend's bit for bit."""
    import mx_recipe.ops.mx_backends as gemm

    if save_mx and recipe.grad_weight == "bf16":
        pytest.skip("save_mx_input needs an MX grad_weight")
    r = with_save_mx(recipe) if save_mx else recipe
    x, w, b, gy = make_inputs(lead, torch.bfloat16, seed=8)
    want = emulate(x, w, b, gy, r)
    calls, fused = [], []
    cast_dim0_dim1 = gemm.cast_dim0_dim1
    monkeypatch.setattr(gemm, "mx_mm_triton", fake_triton_mm(calls))
    monkeypatch.setattr(
        gemm, "cast_dim0_dim1", lambda t, *a, **kw: fused.append(t.shape) or cast_dim0_dim1(t, *a, **kw)
    )
    got = run_mx(x, w, b, gy, r, gemm.TritonBackend())
    # one read for both orientations where M needs no padding: of x in forward where the formats
    # agree, of g in backward where both backward GEMMs are MX and g rounds to nearest
    m = lead[0]
    fuse_x = save_mx and r.forward == r.grad_weight and m % 32 == 0
    fuse_g = "bf16" not in (r.grad_input, r.grad_weight) and r.grad_rounding == "nearest" and m % 32 == 0
    assert fused == [(m, K)] * fuse_x + [(m, N)] * fuse_g
    for what, a, e in zip(("y", "gx", "gw", "gb"), got, want, strict=True):
        assert torch.equal(a, e), what
    mp = -(-m // 32) * 32
    expected = []
    if r.forward != "bf16":
        expected.append((r.forward, r.forward, (m, K), (N, K)))
    if r.grad_input != "bf16":
        expected.append((r.grad, r.grad_input, (m, N), (K, N)))
    if r.grad_weight != "bf16":
        expected.append((r.grad, r.grad_weight, (N, mp), (K, mp)))
    assert calls == expected


@pytest.mark.parametrize("m", [64, 200])  # 64: one fused cast of x for both orientations; 200: padded along M
@pytest.mark.parametrize("name", ["mxfp8", "mxfp8_e5m2_grads"])
def test_cublas_save_mx_input_is_bit_identical(name, m):
    """The cublas path (sm_100), its op replaced by the layout-faithful emulator as in
    tests/test_linear_cublas.py: the blocked x saved in forward gives the same bits."""
    from scaled_mm_emulator import scaled_mm as emulated_scaled_mm

    from mx_recipe.ops.mx_backends import CublasBackend

    backend = CublasBackend(scaled_mm=emulated_scaled_mm)
    x, w, b, gy = make_inputs((m,), torch.bfloat16, seed=9)
    base = run_mx(x, w, b, gy, unfused(RECIPES[name]), backend)
    saved = run_mx(x, w, b, gy, with_save_mx(RECIPES[name]), backend)
    for what, a, e in zip(("y", "gx", "gw", "gb"), base, saved, strict=True):
        assert same_bits(a, e), what


@pytest.mark.gpu
@pytest.mark.parametrize("lead", [(64,), (40,), (3, 50)], ids=["M64", "M40", "3d-M150"])
@pytest.mark.parametrize("name", ["mxfp8", "mxfp8_rceil", "mxfp8_e5m2_grads", "mxfp4"])
def test_fuse_x_casts_is_bit_identical_cuda(name, lead):
    """On the GPU: fake_quant_2d's kernel for x in forward, bit-identical to the separate casts."""
    inputs = [None if t is None else t.cuda() for t in special_input(lead, torch.bfloat16)]
    base = run_mx(*inputs, unfused(RECIPES[name]))
    fused = run_mx(*inputs, with_fuse_x(RECIPES[name]))
    for what, a, b in zip(("y", "gx", "gw", "gb"), base, fused, strict=True):
        assert same_bits(a, b), what


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("lead", [(64,), (40,)], ids=["M64", "M40"])
@pytest.mark.parametrize("name", ["mxfp8", "mxfp8_e5m2_grads", "mxfp4", "mxfp4_sr"])
def test_save_mx_input_is_bit_identical_cuda(name, lead, backend):
    """On the GPU: the cast kernels (fused dim0+dim1 for triton and M64) and the hardware GEMM paths."""
    recipe = MXRecipe(**{**RECIPES[name].__dict__, "backend": backend})
    inputs = [None if t is None else t.cuda() for t in make_inputs(lead, torch.bfloat16, seed=10)]
    base = run_mx(*inputs, recipe)
    saved = run_mx(*inputs, with_save_mx(recipe))
    for what, a, b in zip(("y", "gx", "gw", "gb"), base, saved, strict=True):
        assert same_bits(a, b), what


def test_mx_linear_without_backend_resolves_once_per_recipe_and_device():
    """The functional API resolves x's device's backend on the first call; later calls hit the cache."""
    from mx_recipe.ops.backends import _cached_backend

    _cached_backend.cache_clear()
    x, w = torch.randn(40, K), torch.randn(N, K)
    for _ in range(3):
        mx_linear(x, w, None, RECIPES["mxfp8"])
    info = _cached_backend.cache_info()
    assert (info.misses, info.hits) == (1, 2)
