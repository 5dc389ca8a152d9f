"""The MX reference (mx_recipe/formats/mx.py) against the numerics contract (docs/DESIGN.md, Numerics contract).

Expected scale bytes and element bits below are derived BY HAND from the contract, with the
derivation in a comment; none of them is computed by the code under test.

Encodings used in the derivations:
  e4m3  s eeee mmm, bias 7,  normal 2**(E-7) * 1.mmm, subnormal (E=0) m * 2**-9,  max 0x7E = 448
  e5m2  s eeeee mm, bias 15, normal 2**(E-15) * 1.mm, subnormal (E=0) m * 2**-16, max 0x7B = 57344
  e2m1  s ee m, codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6 (sign in bit 3), two per byte, first element low
  E8M0  byte = e + 127; 0xFF = NaN
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mx_recipe.formats.mx import (
    ELEM_FORMATS,
    MXTensor,
    elem_format,
    fake_quant,
    round_to_format,
    scale_exponent,
    to_mx,
)

INF = math.inf
NAN = math.nan
RULES = ("floor", "rceil")
FORMATS = ("e4m3", "e5m2", "e2m1")
# Hand-written format facts (docs/DESIGN.md, Numerics contract), kept apart from the ElemFormat objects under test.
MAX_NORMAL = {"e4m3": 448.0, "e5m2": 57344.0, "e2m1": 6.0}
EMAX = {"e4m3": 8, "e5m2": 15, "e2m1": 2}
EMIN = {"e4m3": -6, "e5m2": -14, "e2m1": 0}  # exponent of the smallest normal
MBITS = {"e4m3": 3, "e5m2": 2, "e2m1": 1}
TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def block(values, dtype=torch.float32, n=32):
    """One block of ``n`` values: ``values`` first, zeros after (python floats are exact in fp64)."""
    out = torch.zeros(n, dtype=torch.float64)
    out[: len(values)] = torch.tensor(values, dtype=torch.float64)
    return out.to(dtype)


def pad_bytes(expected, n):
    return list(expected) + [0] * (n - len(expected))


def u8(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.uint8).flatten().tolist()


def exactly_in_bf16(values) -> bool:
    v = torch.tensor(values, dtype=torch.float32)
    return bool(torch.equal(v.bfloat16().float().nan_to_num(), v.nan_to_num()))


def hexs(xs):
    return [f"0x{x:02X}" for x in xs]


# ---------------------------------------------------------------------------------------------
# Hand-computed vectors. Each entry: (id, elem, rules, values, scale byte, element bytes).
# For fp8, element bytes are one per value; for e2m1 they are the packed bytes (16 per block).
# Positions past the listed values hold 0.0, which encodes as 0x00 in every format.
# ---------------------------------------------------------------------------------------------
P = 2.0  # shorthand: P**k is exact
CASES = [
    # ---------------- e4m3 ----------------
    # amax 448 (from -448) pins e = 0 under both rules: floor(log2 448) - 8 = 8 - 8 = 0;
    # rceil ceil(log2(448/448)) = 0. Elements are the values themselves, rounded RNE.
    (
        "e4m3-scale0-ties-subnormals",
        "e4m3",
        RULES,
        [256.0, 17.0, 19.0, 1.0, -1.0, 0.5, 1.0625, 1.1875, 240.0, 248.0, -0.0, P**-9, P**-10, 3 * P**-10]
        + [7 * P**-9, P**-6, 0.3125, -448.0],
        127,
        [
            0x78,  # 256 = 2**8: E=15 m=0 -> 0 1111 000
            0x58,  # 17 in [16,32), ulp 2: 8.5 ulps, tie -> 8 (even) -> 16 = 0 1011 000
            0x5A,  # 19: 9.5 ulps, tie -> 10 (even) -> 20 = 16*1.25 -> 0 1011 010
            0x38,  # 1.0: E=7 -> 0 0111 000
            0xB8,  # -1.0
            0x30,  # 0.5: E=6
            0x38,  # 1.0625 = 1 + 1/16, ulp 1/8: 8.5 ulps, tie -> 8 -> 1.0
            0x3A,  # 1.1875 = 1 + 3/16: 9.5 ulps, tie -> 10 -> 1.25 = 0 0111 010
            0x77,  # 240 = 128*1.875: E=14 m=7 -> 0 1110 111
            0x78,  # 248 in [128,256), ulp 16: 15.5 ulps, tie -> 16 -> 256 (carries into next binade)
            0x80,  # -0.0 keeps its sign
            0x01,  # 2**-9 = min subnormal: m=1
            0x00,  # 2**-10 = half the min subnormal: tie between 0 and 1 units -> 0 (even)
            0x02,  # 3*2**-10 = 1.5 units: tie -> 2 units = 0 0000 010
            0x07,  # 7*2**-9: largest subnormal 0 0000 111
            0x08,  # 2**-6: smallest normal, E=1
            0x2A,  # 0.3125 = 0.25*1.25: E=5 m=2 -> 0 0101 010
            0xFE,  # -448 = -(256*1.75): 1 1111 110
        ],
    ),
    # amax 100: floor(log2 100) = 6 -> e = 6-8 = -2; rceil ceil(log2(100/448)) = ceil(-2.16) = -2.
    # Elements are v * 4.
    (
        "e4m3-scale-minus2",
        "e4m3",
        RULES,
        [100.0, 1.0, -2.0, 3.0, P**-11],
        125,
        [
            0x7C,  # 400 in [256,512), ulp 32: 12.5 ulps, tie -> 12 -> 384 = 256*1.5 -> 0 1111 100
            0x48,  # 4 = 2**2: E=9 -> 0 1001 000
            0xD0,  # -8: E=10 -> 1 1010 000
            0x54,  # 12 = 8*1.5 -> 0 1010 100
            0x01,  # 2**-11 * 4 = 2**-9 -> min subnormal
        ],
    ),
    # floor saturates: amax 500 = 256*1.953 (mantissa above max_normal's 1.75): e = 8-8 = 0 and
    # 500 -> 448. -480 also saturates.
    ("e4m3-floor-saturates", "e4m3", ("floor",), [500.0, 1.0, -480.0], 127, [0x7E, 0x38, 0xFE]),
    # rceil: ceil(log2(500/448)) = ceil(0.16) = 1 -> byte 128, elements v/2:
    # 250 in [128,256), ulp 16: 15.6 ulps -> 16 -> 256 (0x78); 0.5 (0x30); -240 = 1 1110 111 (0xF7).
    ("e4m3-rceil-no-saturation", "e4m3", ("rceil",), [500.0, 1.0, -480.0], 128, [0x78, 0x30, 0xF7]),
    # amax = max_normal exactly: floor 8-8 = 0; rceil log2(1) = 0 (mantissa equal, no bump).
    ("e4m3-amax-is-max-normal", "e4m3", RULES, [448.0, -448.0, 1.0], 127, [0x7E, 0xFE, 0x38]),
    # fp32 only: 449 = 256*1.754. floor: e = 0, saturates to 448.
    ("e4m3-floor-449", "e4m3", ("floor",), [449.0], 127, [0x7E]),
    # rceil: 449/448 > 1 -> e = 1; 224.5 in [128,256) ulp 16: 14.03 -> 14 -> 224 = 0 1110 110.
    ("e4m3-rceil-449", "e4m3", ("rceil",), [449.0], 128, [0x76]),
    # fp32 only: the next float after 448 (448 + 2**-15): exactly one fp32 ulp above max_normal
    # still bumps rceil (fl32(amax/448) = 1 + 2**-23 > 1) -> byte 128, 224.00002 -> 224 (0x76).
    ("e4m3-floor-448-plus-ulp", "e4m3", ("floor",), [448.0 + P**-15], 127, [0x7E]),
    ("e4m3-rceil-448-plus-ulp", "e4m3", ("rceil",), [448.0 + P**-15], 128, [0x76]),
    # tiny amax 2**-120: floor -120-8 = -128 and rceil ceil(-120 - 8.8) = -128, both clamp to -127
    # (byte 0). Elements are v * 2**127: 2**7 (E=14, 0x70); -2**6 (E=13, 0xE8); 2 (E=8, 0x40);
    # 2**-130 is an fp32 subnormal -> 2**-3 (E=4, 0x20).
    ("e4m3-clamp-minus127", "e4m3", RULES, [P**-120, -(P**-121), P**-126, P**-130], 0, [0x70, 0xE8, 0x40, 0x20]),
    # all fp32 subnormal (and bf16 subnormal): amax 1.5*2**-127 -> clamp, byte 0; elements v*2**127:
    # 1.5 -> 0 0111 100 (0x3C); 2**-3 (0x20); -2**-6 -> 1 0001 000 (0x88); 3*2**-6 = 1.5*2**-5 ->
    # E=2 m=4 -> 0 0010 100 (0x14).
    (
        "e4m3-subnormal-inputs",
        "e4m3",
        RULES,
        [1.5 * P**-127, P**-130, -(P**-133), 3 * P**-133],
        0,
        [0x3C, 0x20, 0x88, 0x14],
    ),
    # fp32 only: 2**-136 -> 2**-9 = min e4m3 subnormal (0x01); -2**-149 -> -2**-22 rounds to -0 (0x80).
    ("e4m3-fp32-subnormal-inputs", "e4m3", RULES, [1.5 * P**-127, P**-136, -(P**-149)], 0, [0x3C, 0x01, 0x80]),
    # Inf block: e = 127 (byte 254 = 0xFE). inf -> +max (0x7E), -inf -> -max (0xFE);
    # 2**126 * 2**-127 = 0.5 (0x30); 1.5*2**127 -> 1.5 (0x3C); 1.0 -> 2**-127 rounds to 0.
    ("e4m3-inf", "e4m3", RULES, [INF, -INF, P**126, 1.5 * P**127, 1.0], 254, [0x7E, 0xFE, 0x30, 0x3C, 0x00]),
    # ---------------- e5m2 ----------------
    # -57344 pins e = 0: floor 15-15 = 0; rceil log2(1) = 0.
    (
        "e5m2-scale0-ties-subnormals",
        "e5m2",
        RULES,
        [32768.0, 1.0, -1.0, 1.125, 1.375, 5.0, 9.0, 11.0, 30720.0, 28672.0, -0.0, P**-16, P**-17]
        + [3 * P**-17, 3 * P**-16, P**-14, -57344.0],
        127,
        [
            0x78,  # 2**15: E=30 -> 0 11110 00
            0x3C,  # 1.0: E=15 -> 0 01111 00
            0xBC,  # -1.0
            0x3C,  # 1.125, ulp 0.25: 4.5 ulps, tie -> 4 -> 1.0
            0x3E,  # 1.375: 5.5 ulps, tie -> 6 -> 1.5 = 0 01111 10
            0x45,  # 5 = 4*1.25: E=17 m=1 -> 0 10001 01
            0x48,  # 9 in [8,16), ulp 2: 4.5 ulps, tie -> 4 -> 8 = 0 10010 00
            0x4A,  # 11: 5.5 ulps, tie -> 6 -> 12 = 8*1.5 -> 0 10010 10
            0x78,  # 30720 in [2**14, 2**15), ulp 4096: 7.5 ulps, tie -> 8 -> 32768
            0x77,  # 28672 = 2**14 * 1.75: E=29 m=3 -> 0 11101 11
            0x80,  # -0.0
            0x01,  # 2**-16 = min subnormal
            0x00,  # 2**-17: tie between 0 and 1 unit -> 0
            0x02,  # 3*2**-17 = 1.5 units: tie -> 2
            0x03,  # 3*2**-16: largest subnormal 0 00000 11
            0x04,  # 2**-14: smallest normal, E=1 -> 0 00001 00
            0xFB,  # -57344: 1 11110 11
        ],
    ),
    # amax 1000 = 512*1.953. floor: 9-15 = -6 (byte 121), elements v*64:
    # 64000 > 57344 saturates (0x7B); 192 = 128*1.5 -> E=22 m=2 (0x5A); 2**-20*64 = 2**-14 (0x04).
    ("e5m2-floor-saturates", "e5m2", ("floor",), [1000.0, 3.0, P**-20], 121, [0x7B, 0x5A, 0x04]),
    # rceil: ceil(log2(1000/57344)) = ceil(-5.84) = -5 (byte 122), elements v*32:
    # 32000 in [2**14,2**15), ulp 4096: 7.8 -> 8 -> 32768 (0x78); 96 = 64*1.5 -> E=21 (0x56);
    # 2**-15 = 2 subnormal units (0x02).
    ("e5m2-rceil-no-saturation", "e5m2", ("rceil",), [1000.0, 3.0, P**-20], 122, [0x78, 0x56, 0x02]),
    ("e5m2-amax-is-max-normal", "e5m2", RULES, [57344.0, 1.0], 127, [0x7B, 0x3C]),
    # amax 2**-113: floor -113-15 = -128, rceil ceil(-113 - 15.8) = -128 -> both clamp to byte 0.
    # v*2**127: 2**14 (E=29, 0x74); -2**7 (E=22, 0xD8); 2**-127 (fp32 subnormal) -> 1.0 (0x3C).
    ("e5m2-clamp-minus127", "e5m2", RULES, [P**-113, -(P**-120), P**-127], 0, [0x74, 0xD8, 0x3C]),
    # subnormal inputs, byte 0, v*2**127: 1.5 (0x3E); 2**-3 E=12 (0x30); -2**-6 E=9 (0xA4);
    # 1.5*2**-5 E=10 m=2 (0x2A).
    (
        "e5m2-subnormal-inputs",
        "e5m2",
        RULES,
        [1.5 * P**-127, P**-130, -(P**-133), 3 * P**-133],
        0,
        [0x3E, 0x30, 0xA4, 0x2A],
    ),
    # fp32 only: 2**-136 -> 2**-9 E=6 (0x18); 2**-143 -> 2**-16 min subnormal (0x01); -2**-149 -> -0.
    (
        "e5m2-fp32-subnormal-inputs",
        "e5m2",
        RULES,
        [1.5 * P**-127, P**-136, P**-143, -(P**-149)],
        0,
        [0x3E, 0x18, 0x01, 0x80],
    ),
    # Inf: byte 254; +-57344 (0x7B, 0xFB); 0.5 E=14 (0x38); 1.5 (0x3E); 1.0 -> 0.
    ("e5m2-inf", "e5m2", RULES, [INF, -INF, P**126, 1.5 * P**127, 1.0], 254, [0x7B, 0xFB, 0x38, 0x3E, 0x00]),
    # ---------------- e2m1 (bytes are packed: low nibble = even position) ----------------
    # 6.0 pins e = 0: floor(log2 6) - 2 = 0; rceil log2(6/6) = 0.
    (
        "e2m1-scale0-ties",
        "e2m1",
        RULES,
        [4.0, 2.5, 3.5, 5.0, 0.25, 0.75, 1.25, 1.75, -3.0, -0.0, 0.5, 6.0, -6.0, -1.0, 1.5, -0.125],
        127,
        [
            0x46,  # 4 -> code 6 | 2.5 in [2,4), ulp 1: tie -> 2 -> code 4
            0x66,  # 3.5: tie -> 4 -> code 6 | 5 in [4,8), ulp 2: 2.5 ulps, tie -> 4 (mantissa 0) -> code 6
            0x20,  # 0.25: tie between 0 and 0.5 -> 0 -> code 0 | 0.75: tie 0.5/1.0 -> 1.0 -> code 2
            0x42,  # 1.25, ulp 0.5: tie -> 1.0 -> code 2 | 1.75: tie -> 2.0 -> code 4
            0x8D,  # -3 -> 8|5 = 0xD | -0.0 -> 0x8
            0x71,  # 0.5 -> code 1 | 6 -> code 7
            0xAF,  # -6 -> 0xF | -1 -> 8|2 = 0xA
            0x83,  # 1.5 -> code 3 | -0.125: -0.25 ulps rounds to -0 -> 0x8
        ],
    ),
    # amax 7 = 4*1.75 (mantissa above 1.5). floor: 2-2 = 0, 7 saturates to 6 (code 7);
    # 1 -> code 2; -2.5 -> tie -> -2 -> 0xC; 0.75 -> 1.0 -> code 2.
    ("e2m1-floor-saturates", "e2m1", ("floor",), [7.0, 1.0, -2.5, 0.75], 127, [0x27, 0x2C]),
    # rceil: ceil(log2(7/6)) = 1 (byte 128), v/2: 3.5 -> tie -> 4 (code 6); 0.5 (code 1);
    # -1.25 -> tie -> -1.0 (0xA); 0.375 = 0.75 ulps of 0.5 -> 1 ulp -> 0.5 (code 1).
    ("e2m1-rceil-no-saturation", "e2m1", ("rceil",), [7.0, 1.0, -2.5, 0.75], 128, [0x16, 0x1A]),
    # amax 0.375 = 0.25*1.5. floor: -2-2 = -4; rceil: log2(0.375/6) = log2(1/16) = -4 exactly.
    # byte 123, v*16: 6 (code 7); -1.5 (0xB); 2.5 -> tie -> 2 (code 4); 0 (code 0).
    ("e2m1-scale-minus4", "e2m1", RULES, [0.375, -0.09375, 0.15625], 123, [0xB7, 0x04]),
    # amax 2**-126: floor -126-2 = -128, rceil ceil(-128.6) = -128: both clamp, byte 0.
    # v*2**127: 2 (code 4); 1 (code 2); -0.5 (0x9); 0.
    ("e2m1-clamp-minus127", "e2m1", RULES, [P**-126, P**-127, -(P**-128)], 0, [0x24, 0x09]),
    # fp32 (and bf16) subnormal inputs, byte 0, v*2**127: 1.5 (3); 0.5 (1); 0.25 -> tie -> 0;
    # 0.75 -> tie -> 1.0 (2); -1.0 (0xA).
    ("e2m1-subnormal-inputs", "e2m1", RULES, [3 * P**-128, P**-128, P**-129, 3 * P**-129, -(P**-127)], 0,
     [0x13, 0x20, 0x0A]),
    # Inf: byte 254; inf -> 6 (code 7), -inf -> -6 (0xF); 0.5 (1); 1.5 (3); 1.0 -> 0.
    ("e2m1-inf", "e2m1", RULES, [INF, -INF, P**126, 1.5 * P**127, 1.0], 254, [0xF7, 0x31, 0x00]),
]  # fmt: skip

CASE_PARAMS = [
    pytest.param(elem, rule, values, scale, bits, id=f"{name}-{rule}")
    for name, elem, rules, values, scale, bits in CASES
    for rule in rules
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("elem, rule, values, scale, bits", CASE_PARAMS)
def test_hand_computed_block(elem, rule, values, scale, bits, dtype):
    if dtype == torch.bfloat16 and not exactly_in_bf16(values):
        return  # the vector exists only in fp32 (its values round in bf16); covered by the fp32 id
    x = block(values, dtype)
    mx = to_mx(x, elem, rule)
    n_bytes = 16 if elem == "e2m1" else 32
    assert u8(mx.scale) == [scale], f"scale byte {u8(mx.scale)} != {scale}"
    assert hexs(u8(mx.qdata)) == hexs(pad_bytes(bits, n_bytes))
    assert mx.scale.dtype == torch.float8_e8m0fnu
    assert mx.qdata.dtype == (torch.uint8 if elem == "e2m1" else TORCH_FP8[elem])


def _decode_expected(elem, bits):
    """Element values of hand-written bytes (fp8 via torch's own decode, e2m1 via the code table)."""
    raw = torch.tensor(bits, dtype=torch.uint8)
    if elem in TORCH_FP8:
        return raw.view(TORCH_FP8[elem]).float()
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    codes = torch.stack([raw & 0xF, raw >> 4], dim=-1).flatten().tolist()
    return torch.tensor([(-1.0 if c & 8 else 1.0) * table[c & 7] for c in codes])


@pytest.mark.parametrize("elem, rule, values, scale, bits", CASE_PARAMS)
def test_hand_computed_block_dequantizes(elem, rule, values, scale, bits):
    """dequantize() == element * 2**e computed in float64 from the hand-written bytes."""
    n_bytes = 16 if elem == "e2m1" else 32
    elems = _decode_expected(elem, pad_bytes(bits, n_bytes)).double()
    expected = (elems * 2.0 ** (scale - 127)).float()  # overflows to +-inf for +-max * 2**127
    got = to_mx(block(values), elem, rule).dequantize(torch.float32)
    assert torch.equal(got, expected)
    assert torch.equal(torch.signbit(got), torch.signbit(expected))  # -0 stays -0


def test_dequantize_spot_values():
    """A few dequantized values written out in full (no decoding helper)."""
    assert to_mx(block([256.0, 17.0, 19.0]), "e4m3", "floor").dequantize()[:3].tolist() == [256.0, 16.0, 20.0]
    assert to_mx(block([500.0, 1.0]), "e4m3", "floor").dequantize()[:2].tolist() == [448.0, 1.0]
    assert to_mx(block([500.0, 1.0]), "e4m3", "rceil").dequantize()[:2].tolist() == [512.0, 1.0]
    assert to_mx(block([6.0, 2.5, 3.5, 5.0]), "e2m1", "floor").dequantize()[:4].tolist() == [6.0, 2.0, 4.0, 4.0]
    got = to_mx(block([INF, -INF, 1.5 * P**127]), "e4m3", "rceil").dequantize()
    assert got[:3].tolist() == [INF, -INF, 1.5 * P**127]


def test_dequantize_hand_built_mxtensor():
    """MXTensor built from raw bytes (not from to_mx): element * 2**(byte - 127), 0xFF = NaN."""
    # block 0: scale byte 0 (2**-127), element 0x38 = 1.0 -> 2**-127 (an fp32 subnormal)
    # block 1: byte 127 (2**0), element 0x01 = 2**-9 -> 2**-9
    # block 2: byte 254 (2**127), element 0xFE = -448 -> -448 * 2**127 overflows -> -inf
    # block 3: byte 255 = NaN scale, element 0x38 = 1.0 (finite) -> NaN for every element
    elems = torch.tensor([0x38, 0x01, 0xFE, 0x38], dtype=torch.uint8).repeat_interleave(32)
    scale = torch.tensor([0, 127, 254, 255], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    mx = MXTensor(elems.view(torch.float8_e4m3fn), scale, "e4m3", dim=0)
    out = mx.dequantize(torch.float32).reshape(4, 32)
    assert bool((out[0] == P**-127).all()) and bool((out[1] == P**-9).all())
    assert bool((out[2] == -INF).all()) and bool(out[3].isnan().all())
    # e2m1: codes 0x7 (6.0) and 0x9 (-0.5) packed as 0x97; NaN scale -> NaN even for finite codes
    packed = torch.full((32,), 0x97, dtype=torch.uint8)
    scale = torch.tensor([126, 255], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    out = MXTensor(packed, scale, "e2m1", dim=0).dequantize().reshape(2, 32)
    assert out[0, :4].tolist() == [3.0, -0.25, 3.0, -0.25]
    assert bool(out[1].isnan().all())


def test_e2m1_packing_order():
    # [1.0, -3.0] at scale 2**0 (6.0 pins e=0): codes 2 and 8|5 = 0xD; first element in the low
    # nibble -> byte 0xD2. Then [6.0, 0.5] -> codes 7, 1 -> byte 0x17.
    mx = to_mx(block([1.0, -3.0, 6.0, 0.5]), "e2m1", "floor")
    assert u8(mx.qdata)[:3] == [0xD2, 0x17, 0x00]
    assert mx.qdata.shape == (16,) and mx.shape == (32,)


# ---------------------------------------------------------------------------------------------
# Special blocks: all zero, all -0, NaN.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("elem", FORMATS)
def test_all_zero_block(elem, rule, dtype):
    # amax 0: log2(0) = -inf -> clamped to -127 -> byte 0; every element is 0 (0x00).
    mx = to_mx(torch.zeros(2, 32, dtype=dtype), elem, rule)
    assert u8(mx.scale) == [0, 0]
    assert set(u8(mx.qdata)) == {0}
    assert torch.equal(mx.dequantize(), torch.zeros(2, 32))


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("elem", FORMATS)
def test_negative_zero_block_keeps_signs(elem, rule):
    # all -0.0: byte 0; fp8 element -0 = 0x80; e2m1 code 0x8 in both nibbles = 0x88.
    mx = to_mx(torch.full((32,), -0.0), elem, rule)
    assert u8(mx.scale) == [0]
    assert set(u8(mx.qdata)) == {0x88 if elem == "e2m1" else 0x80}
    out = mx.dequantize()
    assert torch.equal(out, torch.zeros(32)) and bool(torch.signbit(out).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("elem", FORMATS)
@pytest.mark.parametrize("nan_values", [[1.0, NAN, 2.0], [NAN], [INF, NAN, -INF], [-NAN, 3e-39]], ids=str)
def test_nan_block(elem, rule, dtype, nan_values):
    # block 0 holds a NaN: scale 0xFF, fp8 elements all 0x7F, e2m1 elements all 0.
    # block 1 is ordinary and must be unaffected: [4.0, 1.0] with 4 pinning e=-6..0 per format:
    #   e4m3: floor 2-8 = -6 (byte 121), rceil ceil(log2(4/448)) = ceil(-6.8) = -6 (byte 121),
    #         4*64 = 256 (0x78), 64 (E=13, 0x68)
    #   e5m2: floor 2-15 = -13, rceil ceil(log2(4/57344)) = ceil(-13.8) = -13 (byte 114),
    #         4*2**13 = 2**15 (0x78), 2**13 (E=28, 0x70)
    #   e2m1: floor 2-2 = 0, rceil ceil(log2(4/6)) = 0 (byte 127), codes 6, 2 -> byte 0x26
    x = torch.stack([block(nan_values), block([4.0, 1.0])]).to(dtype)
    mx = to_mx(x, elem, rule)
    ordinary = {"e4m3": (121, [0x78, 0x68]), "e5m2": (114, [0x78, 0x70]), "e2m1": (127, [0x26])}[elem]
    assert u8(mx.scale) == [0xFF, ordinary[0]]
    q = torch.tensor(u8(mx.qdata)).reshape(2, -1)
    nan_elem = 0x00 if elem == "e2m1" else 0x7F
    assert set(q[0].tolist()) == {nan_elem}
    assert hexs(q[1].tolist()) == hexs(pad_bytes(ordinary[1], q.shape[1]))
    out = mx.dequantize()
    assert bool(out[0].isnan().all())
    assert not bool(out[1].isnan().any())
    assert bool(mx.dequantize(torch.bfloat16)[0].isnan().all())


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("elem", FORMATS)
def test_inf_block_dequantizes_to_inf_and_neighbours_untouched(elem, rule):
    # +inf alone: e = 127 (byte 254), element +max, max * 2**127 overflows fp32 -> +inf.
    # The next block [1.0] keeps its own scale: floor -emax, rceil ceil(log2(1/max)) = -emax
    # for e4m3 (ceil(-8.8) = -8) and e5m2 (ceil(-15.8) = -15); e2m1 ceil(-2.58) = -2.
    x = torch.stack([block([INF]), block([1.0])])
    mx = to_mx(x, elem, rule)
    assert u8(mx.scale) == [254, 127 - EMAX[elem]]
    out = mx.dequantize()
    assert out[0, 0].item() == INF and out[1, 0].item() == 1.0


# ---------------------------------------------------------------------------------------------
# Dims, shapes, dtypes, errors.
# ---------------------------------------------------------------------------------------------
# One hand vector per format, reused: the e4m3 "scale -2" block, the e5m2 rceil block, the e2m1
# "scale -4" block (see CASES for the derivations).
LAYOUT_VECTORS = {
    "e4m3": ([100.0, 1.0, -2.0, 3.0, P**-11], 125, [0x7C, 0x48, 0xD0, 0x54, 0x01]),
    "e5m2": ([1000.0, 3.0, P**-20], 122, [0x78, 0x56, 0x02]),  # rceil only
    "e2m1": ([0.375, -0.09375, 0.15625], 123, [0xB7, 0x04]),
}


@pytest.mark.parametrize("elem", FORMATS)
@pytest.mark.parametrize(
    "shape, dim, where",
    [
        ((3, 64), -1, (1, slice(32, 64))),  # dim=-1, second block of row 1
        ((3, 64), 1, (2, slice(0, 32))),
        ((64, 3), 0, (slice(32, 64), 2)),  # dim=0: a column block
        ((2, 64, 3), 1, (1, slice(32, 64), 2)),  # 3D, dim in the middle
        ((2, 64, 3), -2, (0, slice(0, 32), 1)),
        ((2, 3, 32), 2, (1, 2, slice(0, 32))),
        ((32, 2, 3), 0, (slice(0, 32), 1, 0)),
    ],
)
def test_block_placement_along_dim(elem, shape, dim, where):
    values, scale, bits = LAYOUT_VECTORS[elem]
    x = torch.zeros(shape)
    x[where] = block(values)
    mx = to_mx(x, elem, "rceil", dim=dim)
    d = dim % len(shape)
    scale_shape = list(shape)
    scale_shape[d] //= 32
    q_shape = list(shape)
    q_shape[d] //= 2 if elem == "e2m1" else 1
    assert tuple(mx.scale.shape) == tuple(scale_shape)
    assert tuple(mx.qdata.shape) == tuple(q_shape)
    assert tuple(mx.shape) == tuple(shape)
    assert mx.dim == d

    # the one non-zero block has the hand-computed scale; every other block is all-zero (byte 0)
    scale_u8 = mx.scale.view(torch.uint8)
    swhere = list(where)
    swhere[d] = where[d].start // 32
    assert scale_u8[tuple(swhere)].item() == scale
    assert int((scale_u8 != 0).sum()) == 1

    q = mx.qdata.view(torch.uint8)
    qwhere = list(where)
    if elem == "e2m1":
        qwhere[d] = slice(where[d].start // 2, where[d].stop // 2)
    n = 16 if elem == "e2m1" else 32
    assert hexs(q[tuple(qwhere)].tolist()) == hexs(pad_bytes(bits, n))
    assert int((q != 0).sum()) == sum(b != 0 for b in bits)

    out = mx.dequantize()
    assert out.shape == x.shape
    assert torch.equal(out[where], to_mx(block(values), elem, "rceil").dequantize())


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("elem", FORMATS)
def test_quantizing_along_a_dim_is_quantizing_its_rows(elem, rule):
    # dim-independence: blocks along dim d of x are exactly the blocks along -1 of x.movedim(d, -1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 32, 64, generator=g) * torch.exp2(torch.randint(-20, 20, (32, 32, 64), generator=g).float())
    for d in range(3):
        a = to_mx(x, elem, rule, dim=d)
        b = to_mx(x.movedim(d, -1).contiguous(), elem, rule, dim=-1)
        assert torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8).movedim(-1, d))
        assert torch.equal(a.qdata.view(torch.uint8), b.qdata.view(torch.uint8).movedim(-1, d))
        assert torch.equal(a.dequantize(), b.dequantize().movedim(-1, d))


def test_transpose_view_dequantizes_to_transpose():
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    for elem in FORMATS:
        mx = to_mx(x, elem, "floor", dim=0)
        assert torch.equal(mx.t().dequantize(), mx.dequantize().t())
        assert tuple(mx.t().shape) == (96, 64)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("elem", FORMATS)
def test_bf16_and_fp32_inputs_agree(elem, rule):
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    a, b = to_mx(x, elem, rule), to_mx(x.float(), elem, rule)
    assert torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
    assert torch.equal(a.qdata.view(torch.uint8), b.qdata.view(torch.uint8))
    # dequantized values are exact in bf16 within its range (docs/DESIGN.md, Numerics contract)
    assert torch.equal(a.dequantize(torch.bfloat16).float(), a.dequantize(torch.float32))


@pytest.mark.parametrize(
    "shape, dim, named_dim",
    [((4, 33), -1, 1), ((4, 33), 1, 1), ((33, 64), 0, 0), ((2, 40, 32), 1, 1), ((2, 32, 16), -1, 2)],
)
def test_dim_not_multiple_of_32_raises(shape, dim, named_dim):
    with pytest.raises(ValueError) as err:
        to_mx(torch.zeros(shape), "e4m3", "floor", dim=dim)
    msg = str(err.value)
    assert str(tuple(shape)) in msg, msg
    assert f"dim {named_dim}" in msg, msg


@pytest.mark.parametrize("dim", [2, -3, 5])
def test_dim_out_of_range_raises(dim):
    """Not taken modulo the rank: dim=2 of a 2D tensor is an error, not dim 0."""
    with pytest.raises(ValueError, match=rf"dim {dim} is out of range for a 2D tensor \(expected -2 to 1\)"):
        to_mx(torch.zeros(32, 32), "e4m3", "floor", dim=dim)
    with pytest.raises(ValueError, match="out of range"):
        fake_quant(torch.zeros(32, 32), "e4m3", "floor", dim=dim)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.int32, torch.float8_e4m3fn])
def test_wrong_dtype_raises_type_error(dtype):
    with pytest.raises(TypeError, match=str(dtype).replace("torch.", "")):
        to_mx(torch.zeros(32).to(dtype), "e4m3", "floor")


def test_unknown_format_and_rule_raise_value_error():
    with pytest.raises(ValueError, match="e3m2"):
        to_mx(torch.zeros(32), "e3m2", "floor")
    with pytest.raises(ValueError, match="ceil"):
        to_mx(torch.zeros(32), "e4m3", "ceil")
    with pytest.raises(ValueError, match="fp8"):
        elem_format("fp8")
    with pytest.raises(ValueError, match="nearest"):
        scale_exponent(torch.ones(1), ELEM_FORMATS["e4m3"], "nearest")
    with pytest.raises(ValueError):
        to_mx(torch.tensor(1.0), "e4m3", "floor")  # 0-dim


def test_format_table_matches_design():
    # docs/DESIGN.md, Numerics contract: name, bits, max normal, emax, mantissa bits
    for name, bits, max_normal, emax, mbits in [
        ("e4m3", 8, 448.0, 8, 3),
        ("e5m2", 8, 57344.0, 15, 2),
        ("e2m1", 4, 6.0, 2, 1),
    ]:
        f = ELEM_FORMATS[name]
        assert (f.bits, f.max_normal, f.emax, f.mbits) == (bits, max_normal, emax, mbits)
    assert ELEM_FORMATS["e4m3"].torch_dtype == torch.float8_e4m3fn
    assert ELEM_FORMATS["e5m2"].torch_dtype == torch.float8_e5m2


# ---------------------------------------------------------------------------------------------
# Scale rules: hand values, exhaustive over bf16, exact over random fp32.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "elem, amax, floor_e, rceil_e",
    [
        ("e4m3", 448.0, 0, 0),  # 448 = 2**8 * 1.75: floor 8-8; rceil log2(1)
        ("e4m3", 256.0, 0, 0),  # floor 8-8; rceil ceil(log2(0.571)) = 0
        ("e4m3", 224.0, -1, -1),  # floor 7-8; rceil log2(0.5) = -1 exactly
        ("e4m3", 240.0, -1, 0),  # 128*1.875: floor -1; rceil ceil(log2(0.536)) = 0
        ("e4m3", 1.0, -8, -8),  # rceil ceil(-8.8) = -8
        ("e4m3", 0.0, -127, -127),  # log2(0) = -inf, clamped
        ("e4m3", INF, 127, 127),  # log2(inf) = inf, clamped
        ("e4m3", 2.0**127, 119, 119),  # floor 127-8; rceil ceil(127-8.8) = 119
        ("e4m3", 1.75 * 2.0**127, 119, 119),
        ("e4m3", 1.875 * 2.0**127, 119, 120),
        ("e4m3", 2.0**-149, -127, -127),  # fp32 min subnormal
        ("e4m3", 2.0**-119, -127, -127),  # floor -127; rceil ceil(-127.8) = -127
        ("e4m3", 1.875 * 2.0**-119, -127, -126),  # rceil ceil(log2(1.875/1.75) - 127) = -126
        ("e4m3", 2.0**-118, -126, -126),
        ("e5m2", 57344.0, 0, 0),
        ("e5m2", 61440.0, 0, 1),  # 2**15 * 1.875
        ("e5m2", 1.0, -15, -15),  # rceil ceil(-15.8)
        ("e5m2", 2.0**-112, -127, -127),
        ("e5m2", INF, 127, 127),
        ("e2m1", 6.0, 0, 0),
        ("e2m1", 7.0, 0, 1),
        ("e2m1", 4.0, 0, 0),  # rceil ceil(log2(2/3)) = 0
        ("e2m1", 3.0, -1, -1),  # floor 1-2; rceil log2(0.5)
        ("e2m1", 1.0, -2, -2),  # rceil ceil(-2.58) = -2
        ("e2m1", INF, 127, 127),
        ("e2m1", 2.0**-125, -127, -127),  # floor -127; rceil ceil(-125 - 2.58) = -127
        ("e2m1", 1.75 * 2.0**-125, -127, -126),  # rceil ceil(-125 + log2(1.75/6)) = ceil(-126.78)
    ],
)
def test_scale_exponent_hand_values(elem, amax, floor_e, rceil_e):
    a = torch.tensor([amax], dtype=torch.float32)
    f = ELEM_FORMATS[elem]
    assert scale_exponent(a, f, "floor").item() == floor_e
    assert scale_exponent(a, f, "rceil").item() == rceil_e
    assert scale_exponent(a, f, "floor").dtype == torch.int32


def _all_positive_finite_bf16() -> torch.Tensor:
    bits = torch.arange(0x0001, 0x7F80, dtype=torch.int32).to(torch.int16)  # 0x7F80 is +inf
    return bits.view(torch.bfloat16).float()


@pytest.mark.parametrize("elem", FORMATS)
def test_scale_rules_exhaustive_over_bf16_amax(elem):
    """Every finite positive bf16 amax: exact-integer rules == the log2 formulas in float64."""
    amax = _all_positive_finite_bf16()
    assert amax.numel() == 0x7F7F
    max_normal, emax = MAX_NORMAL[elem], EMAX[elem]
    a64 = amax.double().numpy()

    # floor: floor(log2(amax)) - emax (log2 of a float64 power of two is exact)
    floor_ref = np.clip(np.floor(np.log2(a64)) - emax, -127, 127)
    # rceil: ceil(log2(fl32(amax / max_normal))); the quotient is rounded to fp32 first
    q32 = (amax / torch.tensor(max_normal, dtype=torch.float32)).double().numpy()
    assert (q32 > 0).all()
    rceil_ref = np.clip(np.ceil(np.log2(q32)), -127, 127)
    # the same two references without log2 (frexp is exact): guards against a libm log2 off by an ulp
    m, ex = np.frexp(a64)
    assert np.array_equal(floor_ref, np.clip(ex - 1 - emax, -127, 127))
    m, ex = np.frexp(q32)
    assert np.array_equal(rceil_ref, np.clip(np.where(m == 0.5, ex - 1, ex), -127, 127))

    f = ELEM_FORMATS[elem]
    got_floor = scale_exponent(amax, f, "floor").numpy()
    got_rceil = scale_exponent(amax, f, "rceil").numpy()
    bad = np.nonzero(got_floor != floor_ref)[0]
    assert bad.size == 0, f"floor differs at amax={a64[bad[:5]]}: {got_floor[bad[:5]]} vs {floor_ref[bad[:5]]}"
    bad = np.nonzero(got_rceil != rceil_ref)[0]
    assert bad.size == 0, f"rceil differs at amax={a64[bad[:5]]}: {got_rceil[bad[:5]]} vs {rceil_ref[bad[:5]]}"

    # and through to_mx: one block per amax (amax in lane 0, zeros elsewhere)
    x = torch.zeros(amax.numel(), 32, dtype=torch.bfloat16)
    x[:, 0] = amax.bfloat16()
    for rule, ref in (("floor", floor_ref), ("rceil", rceil_ref)):
        s = to_mx(x, elem, rule).scale.view(torch.uint8).flatten().numpy().astype(np.int64)
        assert np.array_equal(s - 127, ref.astype(np.int64)), rule


def _exact_ceil_log2(r: Fraction) -> int:
    """Smallest integer k with r <= 2**k, for a rational r > 0 (exact)."""
    k = r.numerator.bit_length() - r.denominator.bit_length()
    while Fraction(2) ** k < r:
        k += 1
    while Fraction(2) ** (k - 1) >= r:
        k -= 1
    return k


@settings(max_examples=300, deadline=None)
@given(
    amax=st.floats(min_value=0.0, allow_nan=False, allow_infinity=False, width=32),
    elem=st.sampled_from(FORMATS),
)
@example(amax=448.0 + 2.0**-15, elem="e4m3")  # one fp32 ulp above max_normal
@example(amax=(1.5 + 2.0**-23) * 2.0**-125, elem="e2m1")  # amax/6 is subnormal in fp32
@example(amax=(1.75 + 2.0**-23) * 2.0**-119, elem="e4m3")  # amax/448 is subnormal in fp32
@example(amax=2.0**-149, elem="e5m2")
def test_scale_rules_exact_for_any_fp32_amax(amax, elem):
    """The contract's formulas in exact rational arithmetic, for arbitrary fp32 amax."""
    f = ELEM_FORMATS[elem]
    assert float(np.float32(amax)) == amax  # an fp32 value, so Fraction(amax) is the tensor's value
    a = torch.tensor([amax], dtype=torch.float32)
    if amax == 0:
        ref_floor = ref_rceil = -127
    else:
        r = Fraction(amax)
        ref_floor = max(-127, min(127, -_exact_ceil_log2(1 / r) - EMAX[elem]))  # floor(log2 r) = -ceil(log2 1/r)
        ref_rceil = max(-127, min(127, _exact_ceil_log2(r / Fraction(MAX_NORMAL[elem]))))
    assert scale_exponent(a, f, "floor").item() == ref_floor
    assert scale_exponent(a, f, "rceil").item() == ref_rceil


# ---------------------------------------------------------------------------------------------
# Element rounding: exhaustive over bf16 against independent implementations.
# ---------------------------------------------------------------------------------------------
def _all_finite_bf16() -> torch.Tensor:
    v = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return v[v.isfinite()]


def _torch_fp8_bits(v: torch.Tensor, elem: str) -> torch.Tensor:
    """torch's own fp32 -> fp8 cast (round to nearest even), after saturating to +-max."""
    m = MAX_NORMAL[elem]
    return v.clamp(-m, m).to(TORCH_FP8[elem]).view(torch.uint8)


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
def test_round_to_format_exhaustive_bf16_vs_torch_cast(elem):
    v = _all_finite_bf16()
    got = round_to_format(v, ELEM_FORMATS[elem])
    expected = _torch_fp8_bits(v, elem)
    got_bits = got.to(TORCH_FP8[elem]).view(torch.uint8)  # exact: got must be representable
    assert torch.equal(got_bits.view(TORCH_FP8[elem]).float(), got), "round_to_format returned a non-format value"
    bad = (got_bits != expected).nonzero().flatten()
    assert bad.numel() == 0, f"{elem}: v={v[bad[:5]].tolist()} got={got[bad[:5]].tolist()}"


def _e2m1_reference_codes(v: torch.Tensor) -> torch.Tensor:
    """Brute force: nearest of the 8 magnitudes after saturating, ties to the even code
    (codes 0, 2, 4, 6 have mantissa bit 0), sign bit from v."""
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    a = v.double().abs().clamp(max=6.0)
    dist = (a[:, None] - mags[None, :]).abs()
    nearest = dist == dist.min(dim=1, keepdim=True).values
    even = nearest & (torch.arange(8) % 2 == 0)
    code = torch.where(even.any(dim=1), even.int().argmax(dim=1), nearest.int().argmax(dim=1))
    return code.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)


def test_e2m1_rounding_exhaustive_bf16_vs_brute_force():
    v = _all_finite_bf16()
    got = round_to_format(v, ELEM_FORMATS["e2m1"])
    codes = _e2m1_reference_codes(v)
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    expected = torch.where((codes & 8) != 0, -table[(codes & 7).long()], table[(codes & 7).long()])
    assert torch.equal(got, expected)
    assert torch.equal(torch.signbit(got), torch.signbit(expected))


# scale-pinning value per (format, rule): with it in the block, e = 0 and the largest other |v|
# allowed keeps it so. floor: e=0 iff amax in [2**emax, 2**(emax+1)); rceil: iff amax in (max/2, max].
PIN = {"e4m3": 256.0, "e5m2": 32768.0, "e2m1": 4.0}


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("elem", FORMATS)
def test_to_mx_elements_exhaustive_bf16_at_scale_one(elem, rule):
    """Every finite bf16 value as an element of a block pinned to scale 2**0 (31 values + the pin)."""
    v = _all_finite_bf16()
    limit = 2.0 ** (EMAX[elem] + 1) if rule == "floor" else MAX_NORMAL[elem]
    v = v[v.abs() < limit] if rule == "floor" else v[v.abs() <= limit]
    v = torch.cat([v, torch.zeros(-v.numel() % 31)])
    blocks = torch.cat([torch.full((v.numel() // 31, 1), PIN[elem]), v.reshape(-1, 31)], dim=1)
    mx = to_mx(blocks.bfloat16(), elem, rule)
    assert set(mx.scale.view(torch.uint8).flatten().tolist()) == {127}
    if elem == "e2m1":
        q = mx.qdata.view(torch.uint8)
        codes = torch.stack([q & 0xF, q >> 4], dim=-1).reshape(blocks.shape)[:, 1:].flatten()
        expected = _e2m1_reference_codes(v)
    else:
        codes = mx.qdata.view(torch.uint8)[:, 1:].flatten()
        expected = _torch_fp8_bits(v, elem)
    bad = (codes != expected).nonzero().flatten()
    assert bad.numel() == 0, f"v={v[bad[:5]].tolist()} got={hexs(codes[bad[:5]].tolist())}"
    if rule == "floor":  # saturation happens exactly for |v| > max_normal
        sat = v.abs() > MAX_NORMAL[elem]
        assert bool(sat.any())
        assert bool((mx.dequantize()[:, 1:].flatten()[sat].abs() == MAX_NORMAL[elem]).all())


# ---------------------------------------------------------------------------------------------
# Round-trip error bounds on random data (float64 reference arithmetic).
# ---------------------------------------------------------------------------------------------
def _check_round_trip(x: torch.Tensor, elem: str, rule: str):
    mx = to_mx(x, elem, rule)
    deq = mx.dequantize(torch.float32).double()
    x64 = x.double()
    e = mx.scale.view(torch.uint8).double() - 127
    assert bool((e > -128).all() & (e < 128).all())  # finite inputs: never the NaN byte

    blocks = x64.reshape(*x64.shape[:-1], -1, 32)
    amax = blocks.abs().amax(dim=-1)
    # the scale follows the rule (float64 is exact here: amax has 24 bits)
    nz = amax > 0
    _, ex = torch.frexp(amax)
    floor_e = ex - 1 - EMAX[elem]
    m, exq = torch.frexp(amax / MAX_NORMAL[elem])
    rceil_e = torch.where(m == 0.5, exq - 1, exq)
    ref_e = torch.where(nz, floor_e if rule == "floor" else rceil_e, -127).clamp(-127, 127)
    assert torch.equal(e, ref_e.double())

    scale = torch.exp2(e).repeat_interleave(32, dim=-1)
    v = x64 / scale  # exact scaled element, float64
    q = deq / scale  # the stored element (dequantization is exact in fp32, checked by the bound)
    saturated = v.abs() > MAX_NORMAL[elem]
    binade = torch.frexp(v.abs())[1] - 1  # floor(log2|v|) (0 -> -1, harmless after the clamp)
    half_ulp = torch.exp2((binade.clamp(min=EMIN[elem]) - MBITS[elem]).double()) / 2
    err = (q - v).abs()
    ok = saturated | (err <= half_ulp)
    assert bool(ok.all()), f"error {err[~ok][:5].tolist()} > half ulp {half_ulp[~ok][:5].tolist()}"
    assert bool((q[saturated].abs() == MAX_NORMAL[elem]).all())
    assert bool((torch.sign(q[saturated]) == torch.sign(v[saturated])).all())
    if rule == "rceil":
        assert not bool(saturated.any()), "rceil saturated a finite input"
    return saturated


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    dist=st.sampled_from(["normal", "lognormal"]),
    log2_scale=st.integers(-140, 100),
    elem=st.sampled_from(FORMATS),
    rule=st.sampled_from(RULES),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_round_trip_error_bound(seed, dist, log2_scale, elem, rule, dtype):
    g = torch.Generator().manual_seed(seed)
    if dist == "normal":
        x = torch.randn(8, 128, generator=g, dtype=torch.float64)
    else:  # heavy spread within a block: |x| over ~20 binades
        sign = torch.randint(0, 2, (8, 128), generator=g) * 2 - 1
        x = sign * torch.exp(3.0 * torch.randn(8, 128, generator=g, dtype=torch.float64))
    x = (x * 2.0**log2_scale).to(dtype)
    if not bool(x.isfinite().all()):
        return
    _check_round_trip(x, elem, rule)


@pytest.mark.parametrize("elem", FORMATS)
def test_floor_does_saturate_on_typical_data(elem):
    # guard against a vacuous bound test: under floor, blocks whose amax mantissa exceeds
    # max_normal's do saturate (e.g. e4m3: amax in (448, 512) * 2**k), and the bound still holds.
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    assert bool(_check_round_trip(x, elem, "floor").any())
    _check_round_trip(x, elem, "rceil")


# ---------------------------------------------------------------------------------------------
# fake_quant: to_mx(...).dequantize(x.dtype) without the MXTensor in between, bit for bit.
# ---------------------------------------------------------------------------------------------
def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape, NaN positions and bit patterns elsewhere (so -0 differs from +0)."""
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    keep = ~a.isnan()
    return torch.equal(a.view(ints)[keep], b.view(ints)[keep])


def _special_blocks(dtype: torch.dtype) -> torch.Tensor:
    """Rows of 64: the CASES vectors that dtype holds exactly, a NaN block, an Inf block, zeros, -0."""
    rows = [torch.cat([block(values), block([])]) for _, _, _, values, _, _ in CASES if exactly_in_bf16(values)]
    rows.append(torch.cat([block([1.0, NAN, -2.0]), block([INF, -INF, 3.0, -0.0])]))
    rows.append(torch.cat([block([]), block([-0.0, -(P**-140), 0.0])]))
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("elem", FORMATS)
def test_fake_quant_is_to_mx_dequantize(elem, rule, dtype):
    g = torch.Generator().manual_seed(11)
    random = (torch.randn(6, 64, generator=g) * torch.exp(4 * torch.randn(6, 1, generator=g))).to(dtype)
    for x in (_special_blocks(dtype), random):
        for dim in (-1, 0):
            if x.shape[dim] % 32:
                continue
            want = to_mx(x, elem, rule, dim=dim).dequantize(dtype)
            got = fake_quant(x, elem, rule, dim=dim)
            assert same_bits(got, want), (elem, rule, dim)
            assert got.is_contiguous()
            # stochastic rounding: the same random bits give the same values on both paths
            u = torch.rand(x.shape, generator=g)
            want = to_mx(x, elem, rule, dim=dim, rounding="stochastic", uniform=u).dequantize(dtype)
            assert same_bits(fake_quant(x, elem, rule, dim=dim, rounding="stochastic", uniform=u), want)
