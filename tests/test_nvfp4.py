"""The NVFP4 reference (mx_recipe/formats/nvfp4.py) against an independent statement of its definition, element by
element in numpy fp32 with exact rational rounding to e4m3 and Transformer Engine's e2m1 thresholds; the edge
cases; 16x16 weight tiles; stochastic rounding; the random Hadamard transform."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from mx_recipe.formats.nvfp4 import (
    NVFP4Tensor,
    hadamard_transform,
    nvfp4_operand,
    per_tensor_scales,
    random_signs,
    to_nvfp4,
)

F32 = np.float32
E4M3_VALUES = sorted(
    {float(v) for v in torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()}
)  # the finite non-negative e4m3 values, 0 to 448


def e4m3_round(d: float) -> float:
    """Nearest e4m3 value to d >= 0 (exact rationals), ties to the even code."""
    if np.isnan(d):
        return float("nan")
    target = Fraction(d)
    best = min(range(len(E4M3_VALUES)), key=lambda i: (abs(Fraction(E4M3_VALUES[i]) - target), i % 2))
    return E4M3_VALUES[best]


def e2m1_round(v: float) -> float:
    """Transformer Engine's thresholds (round to nearest even, saturating at 6); the sign kept for -0."""
    mag = abs(v)
    grid = [(0.25, 0.0), (0.75, 0.5), (1.25, 1.0), (1.75, 1.5), (2.5, 2.0), (3.5, 3.0), (5.0, 4.0)]
    out = 6.0
    for edge, value in grid:
        inclusive = value in (0.0, 1.0, 2.0, 4.0)  # ties go to the even neighbour: the edge belongs to it
        if mag < edge or (mag == edge and inclusive):
            out = value
            break
    return -out if np.signbit(v) else out


def oracle(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """(dequantized e2m1 * scale per element, block scales, s_dec) for a 2D fp32 array, blocks along rows."""
    amax = F32(np.max(np.abs(x)))
    s_enc = F32(2688.0) / amax if amax != 0 else F32(np.finfo(F32).max)
    s_enc = F32(min(s_enc, np.finfo(F32).max)) if not np.isnan(s_enc) else s_enc
    s_enc = F32(1.0) if s_enc == 0 else s_enc
    s_dec = F32(1.0) / s_enc
    mult = s_enc * F32(F32(1.0) / F32(6.0))
    rows, cols = x.shape
    values = np.zeros_like(x)
    scales = np.zeros((rows, cols // 16), dtype=F32)
    for r in range(rows):
        for b in range(cols // 16):
            block = x[r, 16 * b : 16 * b + 16]
            bmax = F32(np.max(np.abs(block)))
            with np.errstate(over="ignore", invalid="ignore"):
                d = F32(bmax * mult)
            d = F32(np.clip(min(d, np.finfo(F32).max), -448.0, 448.0)) if not np.isnan(d) else d
            s = F32(e4m3_round(float(d)))
            scales[r, b] = s
            with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
                enc = F32(1.0) / F32(s * s_dec)
            enc = F32(min(enc, np.finfo(F32).max)) if not np.isnan(enc) else enc
            for c in range(16):
                if np.isnan(s):
                    values[r, 16 * b + c] = np.nan
                    continue
                with np.errstate(over="ignore", invalid="ignore"):
                    scaled = F32(block[c] * enc)
                values[r, 16 * b + c] = F32(e2m1_round(float(scaled)) * s)
    return values, scales, float(s_dec)


def _check_against_oracle(x: torch.Tensor) -> NVFP4Tensor:
    t = to_nvfp4(x)
    values, scales, s_dec = oracle(x.float().numpy())
    got = t.block_values().numpy()
    assert np.array_equal(np.isnan(got), np.isnan(values))
    ok = ~np.isnan(values)
    assert np.array_equal(got[ok].view(np.uint32), values[ok].view(np.uint32))  # bits, -0 included
    assert np.array_equal(t.scale.float().numpy(), scales, equal_nan=True)
    assert np.array_equal(np.float32(t.per_tensor_scale.item()), np.float32(s_dec), equal_nan=True)
    return t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_random_tensors_match_the_definition(dtype):
    generator = torch.Generator().manual_seed(0)
    for scale in (1e-3, 1.0, 300.0):
        x = (torch.randn(8, 64, generator=generator) * scale).to(dtype)
        x[0, :16] *= 1e-4  # a block far below the tensor's amax: small and subnormal e4m3 scales
        _check_against_oracle(x)


def test_edge_cases_match_the_definition():
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))
    x[0, :16] = 0.0  # a zero block
    x[0, 16:] = -0.0
    x[1, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0] * 2) / 6  # ties (block amax 5/6)
    x[2, 3] = 1e30  # saturation of every other block to tiny scales
    x[3, :16] = 2.0**-140  # fp32 subnormals
    _check_against_oracle(x)
    t = _check_against_oracle(torch.zeros(2, 16))  # amax 0: s_enc is the fp32 max, everything decodes to 0
    assert torch.equal(t.dequantize(), torch.zeros(2, 16))

    nan = x.clone()
    nan[4, 5] = float("nan")  # NaN anywhere: every scale NaN, every value NaN
    t = to_nvfp4(nan)
    assert t.dequantize().isnan().all() and t.scale.float().isnan().all()
    assert (unpacked := t.qdata).eq(0).all(), unpacked

    inf = x.clone()
    inf[5, 0] = float("inf")  # amax Inf: s_enc = 1, the Inf saturates to 6 * 448
    t = to_nvfp4(inf)
    assert t.per_tensor_scale.item() == 1.0 and t.dequantize()[5, 0].item() == 6 * 448
    assert not t.dequantize().isnan().any()


def test_operand_per_tensor_scale_two_level_and_bad_input():
    x = torch.randn(32, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    t = to_nvfp4(x, dim=0)
    operand, s_dec = nvfp4_operand(x, dim=0)
    assert torch.equal(operand, t.block_values().to(torch.bfloat16)) and torch.equal(s_dec, t.per_tensor_scale)
    assert torch.equal(operand.float(), t.block_values())  # the product is exact in bf16
    assert t.qdata.shape == (16, 64) and t.scale.shape == (2, 64) and t.shape == x.shape
    # dim 0 is the transpose's dim -1
    assert torch.equal(to_nvfp4(x.t().contiguous()).dequantize(), t.dequantize().t())

    shared = to_nvfp4(x * 0.5, per_tensor_scale=t.per_tensor_scale)  # a given s_dec is used as it is
    assert torch.equal(shared.per_tensor_scale, t.per_tensor_scale)
    s_enc, s_dec = per_tensor_scales(torch.tensor(3.0))
    assert s_enc.item() == np.float32(2688.0) / np.float32(3.0) and s_dec.item() == np.float32(1.0) / s_enc.item()

    one_level = to_nvfp4(x, two_level=False)
    assert one_level.per_tensor_scale is None
    expected_scale = (x.float().reshape(32, 4, 16).abs().amax(-1) / 6).to(torch.float8_e4m3fn)
    assert torch.equal(one_level.scale.float(), expected_scale.float())

    with pytest.raises(ValueError, match="not a multiple of 16"):
        to_nvfp4(torch.zeros(4, 24))
    with pytest.raises(ValueError, match="out of range"):
        to_nvfp4(x, dim=2)
    with pytest.raises(TypeError, match="bf16 or fp32"):
        to_nvfp4(x.half())
    with pytest.raises(ValueError, match="two-level"):
        to_nvfp4(x, per_tensor_scale=1.0, two_level=False)
    with pytest.raises(ValueError, match="16x16 blocks"):
        to_nvfp4(torch.zeros(24, 32), block_shape=(16, 16))  # 24 rows: no whole tiles


def test_16x16_weight_tiles_give_one_weight_for_forward_and_backward():
    """Quantized along K (forward GEMM) or along N (grad-input GEMM), a 16x16-tiled weight dequantizes to the
    same values, bit for bit; its scale is the e4m3 of the tile amax's; 3D experts tile per expert."""
    w = torch.randn(48, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    w[16:32, 16:32] *= 50  # one tile much larger than its neighbours
    along_k = to_nvfp4(w, dim=-1, block_shape=(16, 16))
    along_n = to_nvfp4(w, dim=0, block_shape=(16, 16))
    assert torch.equal(along_k.dequantize(), along_n.dequantize())
    transposed = to_nvfp4(w.t(), block_shape=(16, 16)).dequantize(torch.bfloat16)
    assert torch.equal(along_k.dequantize(torch.bfloat16).t(), transposed)
    tile_amax = w.float().reshape(3, 16, 4, 16).abs().amax(dim=(1, 3))
    s_enc, _ = per_tensor_scales(w.float().abs().amax())
    expected = (tile_amax * (s_enc * torch.reciprocal(torch.tensor(6.0)))).to(torch.float8_e4m3fn).float()
    assert torch.equal(along_k.scale.float()[::16], expected)  # each tile's scale over its 16 rows
    assert not torch.equal(along_k.dequantize(), to_nvfp4(w).dequantize())  # 1x16 blocks differ

    experts = torch.randn(2, 32, 48, generator=torch.Generator().manual_seed(4))
    both = to_nvfp4(experts, dim=-1, block_shape=(16, 16)).dequantize()
    assert torch.equal(both, to_nvfp4(experts, dim=1, block_shape=(16, 16)).dequantize())


def test_stochastic_rounding_is_unbiased_and_nearest_elsewhere():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(5))
    generator = torch.Generator().manual_seed(6)
    draws = torch.stack([to_nvfp4(x, rounding="stochastic", generator=generator).block_values() for _ in range(4000)])
    nearest = to_nvfp4(x)
    assert torch.equal(nearest.scale, to_nvfp4(x, rounding="stochastic", generator=generator).scale)
    # the exact value each element would decode to before rounding: x * encode * scale
    s = nearest.scale.float().repeat_interleave(16, dim=-1)
    encode = 1.0 / (s * nearest.per_tensor_scale)
    target = torch.clamp(x * encode, -6, 6) * s
    spread = draws.std(dim=0) / 4000**0.5
    assert ((draws.mean(dim=0) - target).abs() <= 5 * spread + 1e-6 * target.abs()).all()
    # each draw is one of the two grid neighbours of the target
    slack = 1e-6 * target.abs()  # target's own fp32 rounding
    assert (draws.min(dim=0).values <= target + slack).all() and (draws.max(dim=0).values >= target - slack).all()
    with pytest.raises(ValueError, match="stochastic"):
        to_nvfp4(x, generator=generator)  # random bits for nearest rounding


def test_hadamard_transform_is_orthogonal_and_within_its_bound():
    signs = random_signs(7)
    assert set(signs.tolist()) == {-1.0, 1.0} and torch.equal(signs, random_signs(7))
    eye = torch.eye(16)
    t = hadamard_transform(eye, signs)  # rows of T
    assert torch.equal(t @ t.t(), eye)  # exactly: entries +-1/4
    h = torch.tensor([[(-1.0) ** bin(i & j).count("1") for j in range(16)] for i in range(16)])
    assert torch.equal(t, torch.diag(signs) @ h / 4)

    x = torch.randn(64, 48, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(8))
    y = hadamard_transform(x, signs, dim=0)
    exact = (t.double().t() @ x.double().reshape(4, 16, 48)).reshape(64, 48)  # blocks along dim 0: T.T @ block
    bound = 4 * 2.0**-24 * x.double().abs().reshape(4, 16, 48).sum(dim=1, keepdim=True).expand(4, 16, 48) / 4
    assert ((y.double() - exact).abs() <= bound.reshape(64, 48)).all()
    # the inverse: its own rounding (at most 4 bounds: |y| sums to at most 4x |x|'s 1-norm) plus the forward's
    # error carried through T.T (at most 4 bounds)
    back = hadamard_transform(y, signs, dim=0, inverse=True)
    assert ((back.double() - x.double()).abs() <= 8 * bound.reshape(64, 48)).all()
    g = torch.randn(64, 32, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(9))
    product = hadamard_transform(g, signs, dim=0).double().t() @ y.double()  # transformed along M, the GEMM's K
    assert torch.allclose(product, g.double().t() @ x.double(), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of 16"):
        hadamard_transform(torch.zeros(8, 8), signs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_shape", [(1, 16), (16, 16)])
@pytest.mark.parametrize("dim", [0, 1])
def test_to_nvfp4_and_the_transform_on_cuda_equal_the_cpu(dtype, block_shape, dim):
    x = (torch.randn(64, 128, generator=torch.Generator().manual_seed(10)) * 3).to(dtype)
    x[0, :16], x[1, 3], x[2, :16] = 0.0, 1e4, 2.0**-120  # a zero block, a large value, tiny values
    cpu, gpu = to_nvfp4(x, dim, block_shape=block_shape), to_nvfp4(x.cuda(), dim, block_shape=block_shape)
    assert torch.equal(cpu.qdata, gpu.qdata.cpu()) and torch.equal(
        cpu.scale.view(torch.uint8), gpu.scale.cpu().view(torch.uint8)
    )
    assert torch.equal(cpu.per_tensor_scale, gpu.per_tensor_scale.cpu())
    signs = random_signs(11)
    assert torch.equal(hadamard_transform(x, signs, dim), hadamard_transform(x.cuda(), signs, dim).cpu())
