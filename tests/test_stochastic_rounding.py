"""Stochastic rounding in the MX reference (formats/mx.py ``rounding="stochastic"``) and its dispatch.

The contract: a scaled value v / 2**e between adjacent grid points lo < |v| < hi of the element
format goes to hi with probability f = (|v| - lo) / (hi - lo), else to lo: up exactly when f + u >= 1
for the uniform draw u (its bits added below the kept mantissa bits, the carry rounding up). Scale
rule, saturation, NaN, Inf and zero are as round-to-nearest's. Expected bytes below are derived by
hand (encodings as in tests/test_formats.py).
"""

from __future__ import annotations

import pytest
import torch

from mx_recipe.formats.mx import elem_format, fake_quant, round_to_format, round_to_format_stochastic, to_mx
from mx_recipe.ops.dispatch import implementation
from mx_recipe.ops.mx_cast import cast_dim0, cast_dim1, fake_quant_along_m, fake_quant_dim0

FORMATS = ("e4m3", "e5m2", "e2m1")
RULES = ("floor", "rceil")
MAX_NORMAL = {"e4m3": 448.0, "e5m2": 57344.0, "e2m1": 6.0}  # pins the scale to 2**0 under both rules
ULP24 = 2.0**-24  # the spacing of torch.rand's fp32 draws


def grid(elem: str) -> list[float]:
    """Every non-negative finite value of the format, ascending (fp8 from all byte codes)."""
    if elem == "e2m1":
        return [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[elem]
    values = torch.arange(0, 0x80, dtype=torch.uint8).view(dtype).float()
    return sorted({v for v in values.tolist() if v == v and v != float("inf")})


def rows_at_scale_one(elem: str, values: list[float]) -> torch.Tensor:
    """Blocks of 32 (fp32): max_normal first, which sets e = 0 under both rules, then 31 values."""
    values = values + [0.0] * (-len(values) % 31)
    body = torch.tensor(values, dtype=torch.float32).reshape(-1, 31)
    return torch.cat([torch.full((body.shape[0], 1), MAX_NORMAL[elem]), body], dim=1)


def u8(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.uint8).flatten().tolist()


# ---------------------------------------------------------------------------------------------
# Hand-computed blocks (6 / 448 / 57344 pins e = 0 under both rules).
# ---------------------------------------------------------------------------------------------
def test_hand_computed_e2m1():
    # e = 0 (6.0 pins it). Each pair: value, u -> element (code); up when f + u >= 1:
    #   6.0            on the grid, never moves                       -> 6    (7)
    #   0.25, u 0.49   f = (0.25-0)/0.5 = 0.5, 0.99 < 1: down         -> 0    (0)
    #   0.25, u 0.5    0.5 + 0.5 = 1: up                              -> 0.5  (1)
    #   1.25, u 0.5    f (1.25-1)/0.5 = 0.5: up                       -> 1.5  (3)
    #   5.0,  u 0.25   f (5-4)/2 = 0.5: down                          -> 4    (6)
    #   5.0,  u 0.75   up                                             -> 6    (7)
    #   -2.25, u 0.75  f (2.25-2)/1 = 0.25: up, sign kept             -> -3   (8|5 = 0xD)
    #   -2.25, u 0.74  down                                           -> -2   (8|4 = 0xC)
    #   7.0,  u 0.0    saturates to max normal 6 (floor rule)          -> 6    (7)
    #   0.0,  u 0.99   zero never moves                               -> 0    (0)
    #   -0.0, u 0.99   keeps its sign                                 -> -0   (0x8)
    #   0.4,  u 0.21   below 1: fl32(0.4 + 1) = 1.39999998, f = 0.79999995; 1.00999995 >= 1: up -> 0.5 (1)
    #   0.4,  u 0.19   0.98999995 < 1: down                           -> 0    (0)
    #   -0.1, u 0.81   f 0.2 (fl32(0.1 + 1) = 1.10000002): up, sign kept -> -0.5 (0x9)
    #   -0.1, u 0.79   down to zero, sign kept                        -> -0   (0x8)
    values = [6.0, 0.25, 0.25, 1.25, 5.0, 5.0, -2.25, -2.25, 7.0, 0.0, -0.0, 0.4, 0.4, -0.1, -0.1]
    draws = [0.0, 0.49, 0.5, 0.5, 0.25, 0.75, 0.75, 0.74, 0.0, 0.99, 0.99, 0.21, 0.19, 0.81, 0.79]
    codes = [0x7, 0x0, 0x1, 0x3, 0x6, 0x7, 0xD, 0xC, 0x7, 0x0, 0x8, 0x1, 0x0, 0x9, 0x8]
    x = torch.zeros(32)
    x[: len(values)] = torch.tensor(values)
    u = torch.full((32,), 0.5)
    u[: len(draws)] = torch.tensor(draws)
    mx = to_mx(x, "e2m1", "floor", rounding="stochastic", uniform=u)
    assert u8(mx.scale) == [127]
    codes = codes + [0] * (32 - len(codes))
    packed = [lo | (hi << 4) for lo, hi in zip(codes[0::2], codes[1::2], strict=True)]
    assert [f"{b:02X}" for b in u8(mx.qdata)] == [f"{b:02X}" for b in packed]


def test_hand_computed_fp8():
    # e4m3, 448 pins e = 0. 17 in [16, 32), ulp 2: lo 16 (0x58), hi 18 (0 1011 001 = 0x59), f 0.5: up from u 0.5.
    # 0.3 * 2**-9 (between 0 and the min subnormal 2**-9, f 0.3, exact after the offset 2**-6 at 20 dropped
    # bits' resolution): u 0.69 -> 0, u 0.71 -> 2**-9 (0x01).
    # -300 in [256, 512), ulp 32: lo 288 (0 1111 001), hi 320 (0 1111 010), f 0.375 -> u 0.63: -320 (0xFA).
    # 460 saturates to 448 (0x7E) whatever u (the grid stops at 448).
    sub = 0.3 * 2.0**-9
    x = torch.tensor([448.0, 17.0, 17.0, sub, sub, -300.0, 460.0] + [0.0] * 25)
    u = torch.tensor([0.0, 0.5, 0.49, 0.71, 0.69, 0.63, 0.99] + [0.0] * 25)
    mx = to_mx(x, "e4m3", "floor", rounding="stochastic", uniform=u)
    assert u8(mx.scale) == [127]
    assert u8(mx.qdata)[:7] == [0x7E, 0x59, 0x58, 0x01, 0x00, 0xFA, 0x7E]
    # e5m2, 57344 pins e = 0. 5.5 in [4, 8), ulp 1: lo 5 (0 10001 01 = 0x45), hi 6 (0x46), f 0.5.
    x = torch.tensor([57344.0, 5.5, 5.5] + [0.0] * 29)
    u = torch.tensor([0.0, 0.6, 0.4] + [0.0] * 29)
    mx = to_mx(x, "e5m2", "floor", rounding="stochastic", uniform=u)
    assert u8(mx.qdata)[:3] == [0x7B, 0x46, 0x45]


def test_scale_rule_is_unchanged():
    # rceil, amax 7 (e2m1): e = ceil(log2(7/6)) = 1 whatever the rounding; 7 / 2 = 3.5 -> 3 or 4.
    x = torch.tensor([7.0] + [0.0] * 31)
    for u0, code in ((0.49, 0x5), (0.5, 0x6)):
        u = torch.full((32,), u0)
        mx = to_mx(x, "e2m1", "rceil", rounding="stochastic", uniform=u)
        assert u8(mx.scale) == [128] and u8(mx.qdata)[0] & 0xF == code


# ---------------------------------------------------------------------------------------------
# Every grid interval, in the scaled domain and end to end.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("elem", FORMATS)
def test_every_grid_interval(elem):
    """Inside each [lo, hi]: v = lo + f (hi - lo) goes up exactly when u >= 1 - f, for both signs; the draw
    counts to 2**-20 (20, 21 and 22 dropped bits for e4m3, e5m2 and e2m1)."""
    fmt = elem_format(elem)
    points = grid(elem)
    lo = torch.tensor(points[:-1]).repeat_interleave(3)
    hi = torch.tensor(points[1:]).repeat_interleave(3)
    f = torch.tensor([0.25, 0.5, 0.75]).repeat(len(points) - 1)
    v = lo + f * (hi - lo)  # exact: lo and hi have a few significant bits
    for sign in (1.0, -1.0):
        up = round_to_format_stochastic(sign * v, fmt, 1 - f)
        down = round_to_format_stochastic(sign * v, fmt, 1 - f - 2.0**-20)
        assert torch.equal(up, sign * hi) and torch.equal(down, sign * lo)
    # end to end through to_mx at scale 2**0, fp32 input
    x = rows_at_scale_one(elem, v.tolist())
    ups = rows_at_scale_one(elem, (1 - f).tolist())
    ups[:, 0] = 0.5  # max_normal is on the grid: any draw
    got = fake_quant(x, elem, "floor", rounding="stochastic", uniform=ups)
    want = rows_at_scale_one(elem, hi.tolist())
    assert torch.equal(got, want)


@pytest.mark.parametrize("elem", FORMATS)
def test_grid_values_never_move(elem):
    fmt = elem_format(elem)
    values = torch.tensor(grid(elem))
    values = torch.cat([values, -values])
    for u in (0.0, 0.5, 1.0 - ULP24):
        got = round_to_format_stochastic(values, fmt, torch.full_like(values, u))
        assert torch.equal(got, values) and torch.equal(got.signbit(), values.signbit())
    # and end to end with random draws: the grid at scale 2**0 round-trips for any generator
    x = rows_at_scale_one(elem, grid(elem))
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        assert torch.equal(fake_quant(x, elem, "floor", rounding="stochastic", generator=gen), x)


SATURATING = {"e4m3": 500.0, "e5m2": 60000.0, "e2m1": 7.0}  # floor: e = 0, scaled value above max_normal


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("elem", FORMATS)
def test_special_values_as_nearest(elem, rule):
    """NaN blocks, Inf blocks, zero blocks, -0 and saturation: the same bytes as round-to-nearest."""
    nan, inf = float("nan"), float("inf")
    rows = [
        [1.0, nan, -2.0, 3.3],  # NaN block: NaN scale, every element NaN (fp8) or 0 (e2m1)
        [inf, -inf, 0.0, -0.0],  # Inf block: e = 127, +-inf saturate to +-max_normal
        [],  # all zero: e = -127, zero elements
        [-0.0, 0.0, -0.0],
    ]
    if rule == "floor":  # rceil never saturates
        rows.append([SATURATING[elem], -SATURATING[elem], MAX_NORMAL[elem]])
    x = torch.tensor([r + [0.0] * (32 - len(r)) for r in rows])
    nearest = to_mx(x, elem, rule)
    for seed in range(4):
        sr = to_mx(x, elem, rule, rounding="stochastic", generator=torch.Generator().manual_seed(seed))
        assert u8(sr.scale) == u8(nearest.scale)
        assert u8(sr.qdata) == u8(nearest.qdata)


# ---------------------------------------------------------------------------------------------
# Unbiased in expectation; reproducible bits.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("elem", FORMATS)
def test_expectation_is_the_value(elem):
    """The mean of n draws is within 6 standard deviations of v: (hi - lo) * 0.5 / sqrt(n) bounds one
    draw's deviation from the mean, and 6 sigma is exceeded with probability < 2e-9 per value, so
    no seed makes this flaky; the seed is fixed anyway. Round-to-nearest misses the same bound."""
    fmt = elem_format(elem)
    points = torch.tensor(grid(elem))
    pick = torch.linspace(0, len(points) - 2, 12).round().long().unique()
    lo, hi = points[pick], points[pick + 1]
    v = lo + torch.tensor([0.1, 0.3, 0.7, 0.9]).repeat(len(pick) // 4 + 1)[: len(pick)] * (hi - lo)
    n = 8192
    vs = torch.cat([v, -v]).repeat(n, 1)  # [n, values]
    q = round_to_format_stochastic(vs, fmt, torch.rand(vs.shape, generator=torch.Generator().manual_seed(0)))
    bound = 6 * (torch.cat([hi - lo, hi - lo]) * 0.5 / n**0.5)
    assert bool(((q.double().mean(0) - vs[0].double()).abs() <= bound.double()).all())
    biased = (round_to_format(vs[0], fmt).double() - vs[0].double()).abs()
    assert bool((biased > bound.double()).all()), "round-to-nearest should miss the bound"
    # end to end: the dequantized mean of an MX block over n draws, with its scale (rceil: floor's
    # saturation of the amax element is a bias of its own)
    x = (torch.randn(32, generator=torch.Generator().manual_seed(1)) * 3).repeat(n, 1)
    deq = fake_quant(x, elem, "rceil", rounding="stochastic", generator=torch.Generator().manual_seed(2))
    e = to_mx(x[:1], elem, "rceil").scale.view(torch.uint8).item() - 127
    widest = 2.0 ** (e + fmt.emax - fmt.mbits)  # grid spacing of the top binade: the widest interval
    assert bool(((deq.double().mean(0) - x[0].double()).abs() <= 6 * widest * 0.5 / n**0.5).all())


def test_same_seed_same_bits():
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(5))
    a = to_mx(x, "e2m1", rounding="stochastic", generator=torch.Generator().manual_seed(7))
    b = to_mx(x, "e2m1", rounding="stochastic", generator=torch.Generator().manual_seed(7))
    c = to_mx(x, "e2m1", rounding="stochastic", generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.qdata, b.qdata) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
    assert not torch.equal(a.qdata, c.qdata)
    # the generator's draws are torch.rand of the input's shape: the same as passing them
    u = torch.rand(x.shape, generator=torch.Generator().manual_seed(7))
    assert torch.equal(to_mx(x, "e2m1", rounding="stochastic", uniform=u).qdata, a.qdata)
    # the default generator, seeded, repeats too
    torch.manual_seed(3)
    d = to_mx(x, "e2m1", rounding="stochastic")
    torch.manual_seed(3)
    assert torch.equal(to_mx(x, "e2m1", rounding="stochastic").qdata, d.qdata)


def test_argument_errors():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="unknown MX rounding 'up'"):
        to_mx(x, rounding="up")
    with pytest.raises(ValueError, match="rounding='stochastic' only"):
        to_mx(x, uniform=torch.rand(4, 32))
    with pytest.raises(ValueError, match="rounding='stochastic' only"):
        fake_quant(x, generator=torch.Generator())
    with pytest.raises(ValueError, match=r"uniform must be fp32 of the input's shape \(4, 32\)"):
        to_mx(x, rounding="stochastic", uniform=torch.rand(32, 4))
    with pytest.raises(ValueError, match="uniform must be fp32"):
        to_mx(x, rounding="stochastic", uniform=torch.rand(4, 32, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# Dispatch (cast.py): the casts and fake-quants take the reference's stochastic path, draws in the layout they
# read, except the Triton kernels for e2m1 on CUDA (tested in test_mxfp4_stochastic_kernel.py).
# ---------------------------------------------------------------------------------------------
def _casts_match(device: str) -> None:
    x = torch.randn(64, 96, device=device, dtype=torch.bfloat16)
    xt = x.t().contiguous()
    sr = dict(rounding="stochastic")

    def gen(seed: int) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(seed)

    for elem in FORMATS:
        ref0 = to_mx(x, elem, "floor", generator=gen(1), **sr)
        ref1 = to_mx(xt, elem, "floor", generator=gen(1), **sr)
        got0 = cast_dim0(x, elem, "floor", generator=gen(1), **sr)
        got1 = cast_dim1(x, elem, "floor", generator=gen(1), **sr)
        if implementation("cast_dim0", x, elem, "stochastic") == "reference":  # e2m1 kernels draw Philox bits
            for got, ref in ((got0, ref0), (got1, ref1)):
                assert torch.equal(got.qdata.view(torch.uint8), ref.qdata.view(torch.uint8)), elem
                assert torch.equal(got.scale.view(torch.uint8), ref.scale.view(torch.uint8)), elem
        if implementation("fake_quant_2d", x, elem, "stochastic") == "reference":  # the kernel draws Philox bits
            assert torch.equal(fake_quant_dim0(x, elem, "floor", generator=gen(1), **sr), ref0.dequantize(x.dtype))
            along_m = fake_quant_along_m(x, elem, "floor", generator=gen(1), **sr)  # [64, 96]: x's layout
            assert torch.equal(along_m, ref1.dequantize(x.dtype).t())
        # and it is not round-to-nearest
        assert not torch.equal(got0.qdata.view(torch.uint8), cast_dim0(x, elem, "floor").qdata.view(torch.uint8))


def test_casts_dispatch_stochastic_cpu():
    _casts_match("cpu")


@pytest.mark.gpu
def test_casts_dispatch_stochastic_cuda():
    """On CUDA the fp8 kernels round to nearest, so stochastic fp8 casts must take the reference; e2m1 takes
    the Triton kernels, which round stochastically (tests/test_mxfp4_stochastic_kernel.py checks their bits)."""
    _casts_match("cuda")


# ---------------------------------------------------------------------------------------------
# Wiring: the MoE grouped GEMM rounds g stochastically in both backward GEMMs (MXLinear's wiring is
# checked bit for bit in tests/test_linear.py).
# ---------------------------------------------------------------------------------------------
def test_grouped_mm_rounds_gradients_stochastically():
    from mx_recipe.formats.recipe import RECIPES
    from mx_recipe.formats.scale_layout import pad_groups, padded_group_layout
    from mx_recipe.nn.grouped import mx_grouped_mm

    sizes, n, k = [40, 0, 60, 28], 96, 64
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(sizes), k, generator=gen)
    w = torch.randn(len(sizes), n, k, generator=gen) * 0.1
    g = torch.randn(sum(sizes), n, generator=gen)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)

    def grads(name: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = mx_grouped_mm(xr, wr, offs, RECIPES[name])
        torch.manual_seed(seed)
        y.backward(g)
        return xr.grad, wr.grad

    gx, gw = grads("mxfp4_sr", 5)
    # replay the draws: grad input's g [M, N] first, then grad weight's, g padded per group and read
    # transposed ([N, M_pad]); everything else as round-to-nearest mxfp4
    torch.manual_seed(5)
    g_n = to_mx(g, "e2m1", rounding="stochastic").dequantize()
    dest, padded_offs, size = padded_group_layout(offs, g.shape[0], 32)
    g_m = to_mx(pad_groups(g, dest, size).t().contiguous(), "e2m1", rounding="stochastic").dequantize()
    x_m = fake_quant(pad_groups(x, dest, size).t().contiguous(), "e2m1")
    w_n = fake_quant(w.transpose(-2, -1).contiguous(), "e2m1")  # [E, K, N]
    start, pstart = 0, 0
    for e, rows in enumerate(sizes):
        prows = -(-rows // 32) * 32
        want_gx = g_n[start : start + rows] @ w_n[e].t()
        want_gw = g_m[:, pstart : pstart + prows] @ x_m[:, pstart : pstart + prows].t()
        torch.testing.assert_close(gx[start : start + rows], want_gx, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gw[e], want_gw, rtol=1e-5, atol=1e-5)
        start, pstart = start + rows, pstart + prows
    # the same seed repeats the bits; nearest rounding gives other gradients
    again = grads("mxfp4_sr", 5)
    assert torch.equal(again[0], gx) and torch.equal(again[1], gw)
    nearest = grads("mxfp4", 5)
    assert not torch.equal(nearest[0], gx) and not torch.equal(nearest[1], gw)
