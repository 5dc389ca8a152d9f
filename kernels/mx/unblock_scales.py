"""Blocked MX scales -> plain [rows, cols] in one Triton kernel (the inverse of the blocked layout).

The Gluon casts write plain scales in the blocked layout and permute them after (gluon_casts): storing
them plain from the cast costs more than this pass. ``scale_layout.from_blocked`` (a torch int32 permute
copy) took 19.8 us for [16384, 512] scales on an H200, this kernel 9.7 us.

Layout (docs/DESIGN.md, Scale layout): a tile's 4 column bytes of one row are contiguous in both layouts, so both are
moved as int32 words. Blocked, in words: [row_tiles, col_tiles, 32 (r_lo), 4 (r_hi)]; plain:
[row_tiles * 128, col_tiles] with row = tile_row * 128 + r_hi * 32 + r_lo. A program moves BLOCK_C
tiles of one tile row: BLOCK_C * 512 contiguous bytes in, 128 rows of BLOCK_C words out. Expert
scales [E, n] are E blocked matrices one after the other, which is the blocked layout of the
[E * padded_rows, padded_cols] matrix: one launch serves them all. Pure data movement, so the
Triton interpreter is a faithful judge of it (tests/test_cast_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from mx_kernels.launch_cache import LaunchCache
from mx_kernels.spec import blocked_shape, cdiv

BLOCK_C = 32  # tiles (int32 output columns) per program: 128-byte row segments


@triton.jit
def _unblock_kernel(b_ptr, p_ptr, COL_TILES, BLOCK_C: tl.constexpr):
    tile_row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # tile columns = int32 output columns
    r = tl.arange(0, 128)  # row within the tile: r_hi * 32 + r_lo
    word_in_tile = (r % 32) * 4 + r // 32
    src = (tile_row * COL_TILES + cols[None, :]).to(tl.int64) * 128 + word_in_tile[:, None]
    mask = cols[None, :] < COL_TILES
    words = tl.load(b_ptr + src, mask=mask)
    dst = (tile_row * 128 + r[:, None]).to(tl.int64) * COL_TILES + cols[None, :]
    tl.store(p_ptr + dst, words, mask=mask)


_LAUNCHES = LaunchCache(_unblock_kernel)


def unblock_scales(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``scale_layout.from_blocked`` for 1D ``blocked`` ([rows, cols] out) and ``from_blocked_3d``
    for [E, n] ``blocked`` ([E, rows, cols] out), in one kernel launch (plus a slice copy when
    rows % 128 or cols % 4 leave padding). Any device Triton runs on, the interpreter included."""
    if blocked.dim() not in (1, 2):
        raise ValueError(f"unblock_scales takes 1D or [E, n] blocked scales, got shape {tuple(blocked.shape)}")
    padded_rows, padded_cols = blocked_shape(rows, cols)
    experts = blocked.shape[0] if blocked.dim() == 2 else 1
    if blocked.numel() != experts * padded_rows * padded_cols:
        raise ValueError(
            f"unblock_scales: {tuple(blocked.shape)} does not hold {experts} blocked [{rows}, {cols}] "
            f"matrices ({padded_rows * padded_cols} bytes each)"
        )
    col_tiles = padded_cols // 4
    out = torch.empty(experts * padded_rows, col_tiles, dtype=torch.int32, device=blocked.device)
    if out.numel():
        words = blocked.contiguous().view(torch.uint8).view(torch.int32)
        grid = (experts * padded_rows // 128, cdiv(col_tiles, BLOCK_C))
        _LAUNCHES.launch(grid, dict(b_ptr=words, p_ptr=out, COL_TILES=col_tiles, BLOCK_C=BLOCK_C))
    plain = out.view(torch.uint8).view(experts, padded_rows, padded_cols)
    if (padded_rows, padded_cols) != (rows, cols):
        plain = plain[:, :rows, :cols].contiguous()
    plain = plain.view(blocked.dtype)
    return plain if blocked.dim() == 2 else plain[0]


def plain_scales(blocked: torch.Tensor, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The plain [.., rows, cols] scales of a cast of x (2D, or 3D per expert) that wrote them ``blocked``: the
    Gluon casts' plain scales (an empty x's are an empty tensor of that shape)."""
    if x.numel():
        return unblock_scales(blocked, rows, cols)
    return torch.empty((*x.shape[:-2], rows, cols), dtype=torch.float8_e8m0fnu, device=x.device)
