"""MXLinear / mx_linear against a hand-written emulation of the three GEMMs (DESIGN.md).

For y = x @ w.T with x: [M, K], w: [N, K] and upstream gradient g: [M, N]:

    forward      y  = x @ w.T   x along K, w along K
    grad input   gx = g @ w     g along N, w along N
    grad weight  gw = g.T @ x   g along M, x along M   (M padded with zero rows to a multiple of 32)

The emulation below builds each GEMM from ``to_mx`` + ``dequantize`` + ``torch.mm`` and feeds
``torch.mm`` operands with the same memory layout as the emulated backend, so that CPU matmul
runs the same summation order and the comparison can be bit for bit (``torch.equal``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mx_recipe.formats import to_mx
from mx_recipe.linear import MXLinear, mx_linear
from mx_recipe.recipe import RECIPES, MXRecipe

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


def emulate(x, w, b, g, r: MXRecipe):
    """(y, gx, gw, gb) of F.linear(x, w, b) with upstream gradient g, each GEMM per recipe ``r``."""
    dt = x.dtype
    x2, g2 = x.reshape(-1, K), g.reshape(-1, N)
    rule = r.scale_rule

    # forward: x [M, K] and w [N, K] both along K (dim 1); y = xq @ wq.T
    if r.forward == "bf16":
        y = torch.mm(x2, w.t())
    else:
        y = torch.mm(deq(x2, r.forward, rule, 1, dt), deq(w, r.forward, rule, 1, dt).t())

    # grad input: g [M, N] along N (dim 1), w [N, K] along N (dim 0); gx = gq @ wq
    if r.grad_input == "bf16":
        gx = torch.mm(g2, w)
    else:
        gq = deq(g2, r.grad, rule, 1, dt)
        wq = deq(w, r.grad_input, rule, 0, dt)
        gx = torch.mm(gq, wq.t().contiguous().t())  # layout: w's copy is [K, N] row-major

    # grad weight: g and x along M (dim 0), M padded with zero rows; gw = gq.T @ xq
    if r.grad_weight == "bf16":
        gw = torch.mm(g2.t(), x2)
    else:
        gq = deq(pad_rows(g2), r.grad, rule, 0, dt)  # [Mp, N]
        xq = deq(pad_rows(x2), r.grad_weight, rule, 0, dt)  # [Mp, K]
        gw = torch.mm(gq.t().contiguous(), xq.t().contiguous().t())  # layout: [N, Mp] @ ([K, Mp]).T

    y = y.reshape(*x.shape[:-1], N)
    if b is not None:
        y = y + b
    gb = None if b is None else g2.sum(0)
    return y, gx.reshape(x.shape), gw, gb


def run_mx(x, w, b, g, recipe):
    x = x.clone().requires_grad_(True)
    lin = MXLinear(K, N, bias=b is not None, recipe=recipe, dtype=x.dtype, device=x.device)
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    y = lin(x)
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
    gq = deq(pad_rows(gy), recipe.grad, recipe.scale_rule, 0, torch.float32)
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
