"""What the MX reference (``mx_recipe``) and the kernels (``mx_kernels``) both need: the block size, the
element formats, the scale rules, the E8M0 constants and the shapes of the blocked scale layout.

A leaf: it imports torch and nothing else, so every module of either package can import it first
(docs/DESIGN.md, Architecture). The numerics themselves live in ``mx_recipe.formats.mx`` (the reference)
and in the kernels' quantize routines.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_SIZE = 32  # elements per MX block, along the quantized dim
NVFP4_BLOCK = 16  # elements per NVFP4 block (one e4m3 scale each)
E8M0_BIAS = 127
E8M0_NAN = 0xFF
SCALE_EXP_MIN = -127
SCALE_EXP_MAX = 127
FP8_NAN_BITS = 0x7F  # every fp8 element of a NaN block (sign bit clear)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of the 8 non-negative e2m1 codes


@dataclass(frozen=True)
class ElemFormat:
    """An MX element format: sign, ``ebits`` exponent bits, ``mbits`` mantissa bits."""

    name: str
    ebits: int
    mbits: int
    emax: int  # exponent of the largest normal
    max_normal: float
    torch_dtype: torch.dtype | None  # None for e2m1, stored packed as uint8

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal (1 - bias)."""
        return 2 - 2 ** (self.ebits - 1)

    @property
    def max_mantissa_bits(self) -> int:
        """The 23-bit fp32 mantissa field of max_normal (1.75 -> 0x600000)."""
        return int((self.max_normal / 2.0**self.emax - 1.0) * 2**23)

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits


E4M3 = ElemFormat("e4m3", ebits=4, mbits=3, emax=8, max_normal=448.0, torch_dtype=torch.float8_e4m3fn)
E5M2 = ElemFormat("e5m2", ebits=5, mbits=2, emax=15, max_normal=57344.0, torch_dtype=torch.float8_e5m2)
E2M1 = ElemFormat("e2m1", ebits=2, mbits=1, emax=2, max_normal=6.0, torch_dtype=None)

ELEM_FORMATS: dict[str, ElemFormat] = {f.name: f for f in (E4M3, E5M2, E2M1)}
KERNEL_ELEMS = ("e4m3", "e5m2")  # what the cast kernels write; e2m1: the fake-quant kernels only
SCALE_RULES = ("floor", "rceil")
ROUNDINGS = ("nearest", "stochastic")


def elem_format(name: str) -> ElemFormat:
    if name not in ELEM_FORMATS:
        raise ValueError(f"unknown MX element format {name!r}; expected one of {sorted(ELEM_FORMATS)}")
    return ELEM_FORMATS[name]


# The blocked scale layout (docs/DESIGN.md, Scale layout): [rows, cols] scales padded to 128 x 4 tiles.
SCALE_TILE_ROWS = 128
SCALE_TILE_COLS = 4
SCALE_TILE_BYTES = SCALE_TILE_ROWS * SCALE_TILE_COLS  # 512


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) (triton.cdiv is a ConstexprFunction, 2.3 us a call on the host)."""
    return -(-a // b)


def blocked_shape(rows: int, cols: int) -> tuple[int, int]:
    """(padded_rows, padded_cols) of a [rows, cols] scale matrix in the blocked layout."""
    return cdiv(rows, SCALE_TILE_ROWS) * SCALE_TILE_ROWS, cdiv(cols, SCALE_TILE_COLS) * SCALE_TILE_COLS


def blocked_numel(rows: int, cols: int) -> int:
    """Bytes of a [rows, cols] scale matrix in the blocked layout, padding included."""
    padded_rows, padded_cols = blocked_shape(rows, cols)
    return padded_rows * padded_cols


def blocked_groups_numel(rows: int, cols: int, num_groups: int) -> int:
    """Bytes of the per-group blocked buffer for [rows, cols] scales cut into ``num_groups`` column groups.

    Each group pads its columns to a multiple of 4, so it takes at most one more tile column than its
    share: cdiv(cols, 4) + num_groups tile columns bound every ``offs`` without reading it."""
    return cdiv(rows, SCALE_TILE_ROWS) * SCALE_TILE_ROWS * SCALE_TILE_COLS * (cdiv(cols, SCALE_TILE_COLS) + num_groups)
