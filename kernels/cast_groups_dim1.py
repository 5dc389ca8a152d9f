"""Per-group MX cast along M for the MoE grad-weight GEMM, with per-group blocked scales.

x [M_total, K] holds token groups that end at ``offs`` (int32, cumulative, each group a
multiple of 32 rows, empty groups allowed). No 32-row block straddles two groups, so the
quantized data is the plain dim1 cast, qdata [K, M_total], whose column range
[offs[g-1], offs[g]) is group g's ``to_mx(x_g.t().contiguous())``. Only the blocked scales
depend on the groups: each group's [K, M_g/32] scales are blocked on their own (columns
padded to a multiple of 4) and the groups concatenated (``scale_layout.to_blocked_groups``).

The grid walks the destination, not the source: program t along axis 0 owns tile column t
of the buffer, i.e. 128 rows of one group, found from ``offs`` on the device (no host
sync). The programs past the last group own the buffer's tail and write it as zeros.
Contract: offs is validated on the host only on CPU (or when asked). On GPU invalid offs
give unspecified values but never an access out of bounds (group ends are clamped to
[0, M_total], scale stores to the buffer).
On Hopper, bf16 input goes to the Gluon kernel of ``gluon_cast_groups`` (same walk, same bits;
``common.use_gluon``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from mx_kernels.common import (
    cdiv,
    check_cast,
    format_constexprs,
    fp8_dtype,
    groups_dim1_shapes,
    software_round,
    use_gluon,
)
from mx_kernels.mx_quantize import blocked_scale_offset, quantize_blocks, to_fp32

GROUPS_DIM1_CONFIG = dict(BLOCK_K=64, num_warps=1)  # one warp: see cast_dim1.py
GROUP_TILE_M = 128  # source rows per program: one 4-column tile of scales


@triton.jit
def _cast_groups_dim1_kernel(
    x_ptr,
    offs_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    num_groups,
    max_tile_cols,
    stride_xm,
    stride_xk,
    GROUPS_POW2: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EMAX: tl.constexpr,
    MAX_MANT: tl.constexpr,
    MAX_NORMAL: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    IS_E4M3: tl.constexpr,
    RCEIL: tl.constexpr,
    SOFTWARE_ROUND: tl.constexpr,
):
    t = tl.program_id(0)  # tile column of the scale buffer
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
    row0 = tl.where(is_group, tl.sum(tl.where(this, starts, 0), axis=0), 0) + (t - tile_start) * 128
    row0 = tl.multiple_of(row0, 32)  # group starts are rounded down to 32 rows above

    # four 32-row sub-tiles (one warp each, as in cast_dim1.py): the group's four scale columns
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    c = tl.arange(0, 4)
    scales = tl.zeros((BLOCK_K, 4), dtype=tl.uint8)
    for i in tl.static_range(4):
        rows = row0 + i * 32 + tl.arange(0, 32)
        mask = (rows < row_end)[:, None] & (cols < K)[None, :]
        x_offs = rows.to(tl.int64)[:, None] * stride_xm + cols[None, :] * stride_xk
        x = to_fp32(tl.load(x_ptr + x_offs, mask=mask, other=0.0), SOFTWARE_ROUND)
        q, scale = quantize_blocks(x, 0, EMAX, MAX_MANT, MAX_NORMAL, MBITS, EMIN, IS_E4M3, RCEIL, SOFTWARE_ROUND)
        tl.store(q_ptr + cols.to(tl.int64)[None, :] * M + rows[:, None], q, mask=mask)
        scales = tl.where(c[None, :] == i, scale[:, None], scales)

    # This program's [BLOCK_K, 4] scales: rows of tile (k // 128, t - tile_start) of its group,
    # 4 contiguous bytes per k.
    valid = (cols < K)[:, None] & (row0 + c * 32 < row_end)[None, :]
    padded_k = (K + 127) >> 7 << 7
    group_base = padded_k.to(tl.int64) * 4 * tile_start
    s_offs = group_base + blocked_scale_offset(cols[:, None], (t - tile_start) * 4 + c[None, :], group_tiles)
    in_buffer = (cols < padded_k)[:, None] & (s_offs < padded_k.to(tl.int64) * 4 * max_tile_cols)
    tl.store(s_ptr + s_offs, tl.where(valid, scales, 0), mask=in_buffer)


def cast_groups_dim1(
    x: torch.Tensor, offs: torch.Tensor, elem: str, mode: str, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M_total, K], offs int32 [G] -> (qdata [K, M_total] fp8, per-group blocked scales e8m0, 1D).

    The caller validates ``offs`` (``common.check_offs``); for plain scales use ``cast_dim1``.
    """
    check_cast(x, elem, mode, ndims=(2,), qdim=0, op="cast_groups_dim1")
    if use_gluon(x, config):  # Hopper: 80% / 77% of copy for 16 / 64 groups, Triton 60% / 49% (H200)
        from mx_kernels.gluon_cast_groups import gluon_cast_groups_dim1

        return gluon_cast_groups_dim1(x, offs, elem, mode)
    q_shape, s_shape = groups_dim1_shapes(x.shape, offs.numel(), blocked=True)
    qdata = torch.empty(q_shape, dtype=fp8_dtype(elem), device=x.device)
    scale = torch.empty(s_shape, dtype=torch.float8_e8m0fnu, device=x.device)
    m, k = x.shape
    if k == 0:
        return qdata, scale
    cfg = {**GROUPS_DIM1_CONFIG, **(config or {})}
    max_tile_cols = cdiv(m // 32, 4) + offs.numel()  # as scale_layout.blocked_groups_numel
    grid = (max_tile_cols, cdiv(cdiv(k, 128) * 128, cfg["BLOCK_K"]))
    _cast_groups_dim1_kernel[grid](
        x,
        offs,
        qdata.view(torch.uint8),
        scale.view(torch.uint8),
        m,
        k,
        offs.numel(),
        max_tile_cols,
        x.stride(0),
        x.stride(1),
        GROUPS_POW2=triton.next_power_of_2(offs.numel()),
        BLOCK_K=cfg["BLOCK_K"],
        SOFTWARE_ROUND=software_round(x, "cast_groups_dim1"),
        num_warps=cfg["num_warps"],
        **format_constexprs(elem, mode),
    )
    return qdata, scale
