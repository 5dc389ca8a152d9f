"""Per-group MX cast along M for the MoE grad-weight GEMM, with per-group blocked scales.

x [M_total, K] holds token groups that end at ``offs`` (int32, cumulative, each group a
multiple of 32 rows, empty groups allowed). No 32-row block straddles two groups, so the
quantized data is the plain dim1 cast, qdata [K, M_total], whose column range
[offs[g-1], offs[g]) is group g's ``to_mx(x_g.t().contiguous())``. Only the blocked scales
depend on the groups: each group's [K, M_g/32] scales are blocked on their own (columns
padded to a multiple of 4) and the groups concatenated (``scale_layout.to_blocked_groups``).

The grid walks the destination, not the source: program t along axis 0 owns tile column t
of the buffer, i.e. 128 rows of one group, found from ``offs`` on the device (no host
sync); e2m1 of bf16, read as int32 words, takes two programs of 64 rows a tile column. The
programs past the last group own the buffer's tail and write it as zeros.
Contract: offs is validated on the host only on CPU (or when asked). On GPU invalid offs
give unspecified values but never an access out of bounds (group ends are clamped to
[0, M_total], scale stores to the buffer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from mx_kernels.common import check_cast, e2m1_reads_words, empty_outputs, groups_dim1_shapes, software_round
from mx_kernels.launch_cache import LaunchCache
from mx_kernels.mx.casts import LANE_WORDS, WORDS_DIM1_TILE
from mx_kernels.quantize import (
    blocked_scale_offset,
    e2m1_words_along_m,
    pack_pairs_along_rows,
    quantize_blocks,
    to_fp32,
)
from mx_kernels.spec import cdiv

BLOCK_K, NUM_WARPS = 64, 1  # one warp per program: see triton_casts.py; 128 source rows (one scale tile column)
# e2m1 of bf16 read as words: the tile of triton_casts' cast along M (64 rows x 128, one warp, LANE_WORDS words a lane),
# two programs to a tile column
WORDS_ROWS, WORDS_BLOCK_K = 32 * WORDS_DIM1_TILE[0], WORDS_DIM1_TILE[1]
assert WORDS_DIM1_TILE[2] == NUM_WARPS and 128 % WORDS_ROWS == 0 and LANE_WORDS > 0


@triton.jit
def _cast_groups_dim1_kernel(
    x_ptr, offs_ptr, q_ptr, s_ptr, M, K, num_groups, max_tile_cols, stride_xm, stride_xk,
    GROUPS_POW2: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, ELEM: tl.constexpr, RCEIL: tl.constexpr,
    SOFTWARE_ROUND: tl.constexpr, WORDS: tl.constexpr, LANE_WORDS: tl.constexpr,
):  # fmt: skip
    """A program casts ROWS (128 or 64) rows of one tile column of the scale buffer. WORDS: x_ptr is bf16 x read as
    int32 words (strides in words), cast to e2m1 to nearest without widening it (``mx_quantize.e2m1_words_along_m``);
    BLOCK_K counts elements."""
    t = tl.program_id(0) // (128 // ROWS)  # tile column of the scale buffer
    part = tl.program_id(0) % (128 // ROWS)  # which ROWS of its 128
    pid_k = tl.program_id(1)

    # Which group owns tile column t: groups take cdiv(size, 128) tile columns each, in order.
    g_idx = tl.arange(0, GROUPS_POW2)
    in_range = g_idx < num_groups
    # clamped to [0, M] and rounded down to 32 rows: bad offs stay in bounds and aligned
    ends = tl.minimum(tl.maximum(tl.load(offs_ptr + g_idx, mask=in_range, other=0), 0), M) & -32
    starts = tl.minimum(tl.maximum(tl.load(offs_ptr + g_idx - 1, mask=in_range & (g_idx > 0), other=0), 0), M) & -32
    tiles = tl.where(in_range, (tl.maximum(ends - starts, 0) + 127) >> 7, 0)
    tiles_end = tl.cumsum(tiles, axis=0)
    g = tl.sum((in_range & (tiles_end <= t)).to(tl.int32), axis=0)  # groups wholly before t
    is_group = g < num_groups
    this = g_idx == g
    used_tiles = tl.sum(tiles, axis=0)
    tile_start = tl.where(is_group, tl.sum(tl.where(this, tiles_end - tiles, 0), axis=0), used_tiles)
    group_tiles = tl.where(is_group, tl.sum(tl.where(this, tiles, 0), axis=0), max_tile_cols - used_tiles)
    row_end = tl.multiple_of(tl.where(is_group, tl.sum(tl.where(this, ends, 0), axis=0), 0), 32)
    row0 = tl.where(is_group, tl.sum(tl.where(this, starts, 0), axis=0), 0) + (t - tile_start) * 128 + part * ROWS
    row0 = tl.multiple_of(row0, 32)  # group starts are rounded down to 32 rows above

    SUBS: tl.constexpr = ROWS // 32  # 32-row blocks: this program's scale columns of the tile
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    c = tl.arange(0, SUBS)
    if WORDS:  # each lane loads LANE_WORDS words of every row, so that it holds whole columns as loaded (triton_casts)
        half_k = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        rows = row0 + tl.arange(0, ROWS)
        w_mask = (rows < row_end)[:, None] & (half_k < K // 2)[None, :]
        w_cols = tl.max_contiguous(tl.multiple_of(half_k, LANE_WORDS), LANE_WORDS)
        w = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + w_cols[None, :], mask=w_mask, other=0)
        q, scales = e2m1_words_along_m(w, RCEIL, False)  # [BLOCK_K, ROWS / 2] bytes, [BLOCK_K, SUBS] scales
        half = row0 // 2 + tl.arange(0, ROWS // 2)
        tl.store(q_ptr + cols.to(tl.int64)[:, None] * (M // 2) + half[None, :], q,
                 mask=(cols < K)[:, None] & (half < row_end // 2)[None, :])  # fmt: skip
    else:  # 32-row sub-tiles (one warp each, as in triton_casts.py)
        scales = tl.zeros((BLOCK_K, SUBS), dtype=tl.uint8)
        for i in tl.static_range(SUBS):
            rows = row0 + i * 32 + tl.arange(0, 32)
            mask = (rows < row_end)[:, None] & (cols < K)[None, :]
            x_offs = rows.to(tl.int64)[:, None] * stride_xm + cols[None, :] * stride_xk
            x = to_fp32(tl.load(x_ptr + x_offs, mask=mask, other=0.0), SOFTWARE_ROUND)
            q, scale = quantize_blocks(x, 0, ELEM, RCEIL, SOFTWARE_ROUND)
            if ELEM == "e2m1":  # two codes a byte along M: [K, M_total/2]
                half = (row0 + i * 32) // 2 + tl.arange(0, 16)
                q_offs = cols.to(tl.int64)[None, :] * (M // 2) + half[:, None]
                tl.store(q_ptr + q_offs, pack_pairs_along_rows(q),
                         mask=(half < row_end // 2)[:, None] & (cols < K)[None, :])  # fmt: skip
            else:
                tl.store(q_ptr + cols.to(tl.int64)[None, :] * M + rows[:, None], q, mask=mask)
            scales = tl.where(c[None, :] == i, scale[:, None], scales)

    # This program's [BLOCK_K, SUBS] scales: rows of tile (k // 128, t - tile_start) of its group,
    # SUBS contiguous bytes per k.
    valid = (cols < K)[:, None] & (row0 + c * 32 < row_end)[None, :]
    padded_k = (K + 127) >> 7 << 7
    group_base = padded_k.to(tl.int64) * 4 * tile_start
    s_cols = (t - tile_start) * 4 + part * SUBS + c
    s_offs = group_base + blocked_scale_offset(cols[:, None], s_cols[None, :], group_tiles)
    in_buffer = (cols < padded_k)[:, None] & (s_offs < padded_k.to(tl.int64) * 4 * max_tile_cols)
    tl.store(s_ptr + s_offs, tl.where(valid, scales, 0), mask=in_buffer)


_LAUNCHES = LaunchCache(_cast_groups_dim1_kernel)


def cast_groups_dim1(x: torch.Tensor, offs: torch.Tensor, elem: str, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M_total, K], offs int32 [G] -> (qdata [K, M_total] fp8, or e2m1 packed [K, M_total / 2] uint8;
    per-group blocked scales e8m0, 1D).

    The caller validates ``offs`` (``common.check_offs``); for plain scales use ``cast_dim1``.
    """
    check_cast(x, elem, mode, ndims=(2,), qdim=0, op="cast_groups_dim1", fp4=True)
    qdata, scale = empty_outputs(x, elem, groups_dim1_shapes(x.shape, offs.numel(), blocked=True))
    m, k = x.shape
    if k == 0:
        return qdata, scale
    software = software_round(x, "cast_groups_dim1")
    words = e2m1_reads_words(x, elem, software, False)
    xw = x.view(torch.int32) if words else x

    def build() -> tuple[tuple[int, int], dict]:
        max_tile_cols = cdiv(m // 32, 4) + offs.numel()  # as spec.blocked_groups_numel
        block_k, rows = (WORDS_BLOCK_K, WORDS_ROWS) if words else (BLOCK_K, 128)
        grid = (max_tile_cols * (128 // rows), cdiv(cdiv(k, 128) * 128, block_k))
        return grid, dict(
            x_ptr=xw, offs_ptr=offs, q_ptr=qdata.view(torch.uint8), s_ptr=scale.view(torch.uint8), M=m, K=k,
            num_groups=offs.numel(), max_tile_cols=max_tile_cols, stride_xm=xw.stride(0), stride_xk=xw.stride(1),
            GROUPS_POW2=triton.next_power_of_2(offs.numel()), BLOCK_K=block_k, ROWS=rows, ELEM=elem,
            RCEIL=mode == "rceil", SOFTWARE_ROUND=software, WORDS=words, LANE_WORDS=LANE_WORDS,
            num_warps=NUM_WARPS,
        )  # fmt: skip

    key = (x.shape, x.stride(), x.dtype, offs.numel(), elem, mode, software, words)
    _LAUNCHES.launch_keyed(key, build, x_ptr=xw, offs_ptr=offs, q_ptr=qdata, s_ptr=scale)
    return qdata, scale
