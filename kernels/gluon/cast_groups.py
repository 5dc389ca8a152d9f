"""Gluon per-group dim1 MX cast (MoE grad-weight operand): ``cast_groups_dim1``'s contract, bit for bit.

The Hopper implementation of ``cast_groups_dim1`` (mx_recipe.ops.dispatch picks it for bf16 input on compute
capability 9.x). x [M_total, K] holds token groups ending at ``offs`` (int32, cumulative, each group a multiple
of 32 rows, empty groups allowed). qdata [K, M_total] fp8 is the plain dim1 cast (column range
[offs[g-1], offs[g]) is group g's ``to_mx(x_g.t().contiguous())``); the scales are each group's [K, M_g/32]
matrix blocked on its own, groups concatenated in a buffer of ``blocked_groups_numel(K, M_total/32, G)`` bytes,
every byte written (zeros in the padding and the tail); ``scale_layout.to_blocked_groups`` is the reference.

Same walk as the Triton kernel: the grid walks the destination, not the source. A 128-row tile column t of the
scale buffer (4 scale columns of one group) is cut into 4 / NUM_SUB programs along grid axis 0; grid axis 1
walks the padded K. Each program finds its group from ``offs`` on the device (no host sync): the G group ends
are loaded as one vector held whole by each warp, so the scan and the sums stay in shuffles; up to PACKED_MAX
the owner's four values travel as two sums of 16-bit fields (``_tile_column_group``). Two tiles, by the average
group size: 128 x 128 with whole-line stores (the casts' tile) for groups of 1024 rows and more, 32 x 256
below, where each group's partly masked last 128-row tile would cost more than the line stores gain. As in the
Triton kernel, invalid offs give unspecified values but no access out of bounds (group ends clamped to
[0, M_total] and rounded down to 32 rows; scale stores bounded by the buffer).
"""

from __future__ import annotations

import torch
import triton
import triton.experimental.gluon.language as gl
from mx_kernels.common import check_cast, check_offs, fp8_dtype, groups_dim1_shapes
from mx_kernels.gluon.common import (
    arange_along,
    compile_for_arch,
    dim1_scale_layout,
    dim1_tile,
    quantize,
    require_gpu,
    store_lines,
    tile_layout,
    transposed_layout,
    wide,
)
from mx_kernels.launch_cache import LaunchCache
from mx_kernels.quantize import blocked_scale_offset
from mx_kernels.spec import cdiv
from triton.experimental import gluon

# The two tiles (docs/DESIGN.md, Kernels: why each is shaped as it is): H200, bf16, e4m3, events time:
# 16 groups of [16640, 5120] (1040 rows on average) 70.6 us with LINES against 72.2, 16 of [65536, 4096] 207.4
# against 220.7; 64 of [16640, 5120] (260 rows) 79.1 against 74.3.
SMALL_TILE = dict(NUM_SUB=1, ROWS=8, NUM_WARPS=4, REPS=1, WARPS_M=1, LINES=False)  # 32 x 256
LINES_TILE = dict(NUM_SUB=4, ROWS=8, NUM_WARPS=2, REPS=1, WARPS_M=4, LINES=True)  # 128 x 128
LINES_MIN_ROWS = 1024  # average rows a group from which LINES_TILE runs
TILE_ROWS = 128  # rows of one 4-column tile of a group's blocked scales
PACKED_MAX = 2**16 - 1  # the group lookup packs two values in an int32 up to this (M_total < 2**21 rows)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.constexpr_function
def _groups_layout(groups_pow2, num_warps):
    """1D layout of the G-vector: lanes along G (groups_pow2 / 32 registers each past 32 groups), every
    warp a copy, so that its scan and reductions need no shared memory."""
    return gl.BlockedLayout([max(groups_pow2 // 32, 1)], [32], [num_warps], [0])


@gluon.jit
def _tile_column_group(
    offs_ptr, t, M, num_groups, max_tile_cols, GROUPS_POW2: gl.constexpr, WARPS: gl.constexpr, PACKED: gl.constexpr
):
    """The group that owns tile column t of the scale buffer (groups take cdiv(size, 128) tile columns each, in
    order; the Triton kernel's arithmetic, term for term): (its first tile column, its tile columns, its first
    row, its end row); past the last group (the buffer's tail): (tile columns used, tile columns left, 0, 0)."""
    GL: gl.constexpr = _groups_layout(GROUPS_POW2, WARPS)
    g_idx = gl.arange(0, GROUPS_POW2, layout=GL)
    in_range = g_idx < num_groups
    # clamped to [0, M] and rounded down to 32 rows: bad offs stay in bounds and aligned
    ends = gl.minimum(gl.maximum(gl.load(offs_ptr + g_idx, mask=in_range, other=0), 0), M) & -32
    prev = gl.load(offs_ptr + g_idx - 1, mask=in_range & (g_idx > 0), other=0)
    starts = gl.minimum(gl.maximum(prev, 0), M) & -32
    tiles = gl.where(in_range, (gl.maximum(ends - starts, 0) + 127) >> 7, 0)
    tiles_end = gl.associative_scan(tiles, 0, _add)  # non-decreasing whatever offs holds
    first = tiles_end - tiles
    if PACKED:
        # At most one lane contributes: the owner of t (its tile columns [first, tiles_end) are disjoint from
        # the others'), or in the tail the last group's lane. Every field is < 2**16: first and tiles_end
        # <= t < max_tile_cols, a group's tiles <= cdiv(M, 128), rows / 32 <= M / 32 (PACKED_MAX, host).
        # Why: the lookup costs a 67 us cast 2.5 us (H200, 16 equal groups of [16384, 5120]: rows from constants
        # 64.6 us; with only the offs load and one reduction 65.1), its scan and reductions, not the load. Packed
        # against 6 reductions: 68.0 against 69.0 us at [16640, 5120] G=16, 199.3 against 200.3 at [65536, 4096];
        # H100 within 0.3%.
        owner = in_range & (first <= t) & (t < tiles_end)
        tail = (g_idx == num_groups - 1) & (tiles_end <= t)
        tile_fields = gl.where(owner, first | (tiles << 16), 0)
        tile_fields += gl.where(tail, tiles_end | ((max_tile_cols - tiles_end) << 16), 0)
        row_fields = gl.where(owner, (starts >> 5) | ((ends >> 5) << 16), 0)
        tile_fields = gl.sum(tile_fields, axis=0)
        row_fields = gl.sum(row_fields, axis=0)
        tile_start = tile_fields & 0xFFFF
        group_tiles = (tile_fields >> 16) & 0xFFFF
        row_start = (row_fields & 0xFFFF) << 5
        row_end = ((row_fields >> 16) & 0xFFFF) << 5
    else:
        g = gl.sum((in_range & (tiles_end <= t)).to(gl.int32), axis=0)  # groups wholly before t
        is_group = g < num_groups
        this = g_idx == g
        used_tiles = gl.sum(tiles, axis=0)
        tile_start = gl.where(is_group, gl.sum(gl.where(this, first, 0), axis=0), used_tiles)
        group_tiles = gl.where(is_group, gl.sum(gl.where(this, tiles, 0), axis=0), max_tile_cols - used_tiles)
        row_start = gl.where(is_group, gl.sum(gl.where(this, starts, 0), axis=0), 0)
        row_end = gl.where(is_group, gl.sum(gl.where(this, ends, 0), axis=0), 0)
    return tile_start, group_tiles, row_start, gl.multiple_of(row_end, 32)


@gluon.jit
def _gluon_cast_groups_dim1_kernel(
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
    GROUPS_POW2: gl.constexpr,
    PACKED: gl.constexpr,  # the lookup's values fit 16 bits (PACKED_MAX): 2 reductions instead of 6
    NUM_SUB: gl.constexpr,
    ROWS: gl.constexpr,
    NUM_WARPS: gl.constexpr,
    REPS: gl.constexpr,
    MASK_COLS: gl.constexpr,  # the grid's columns pass K (else no column masks)
    OFFS64: gl.constexpr,
    WARPS_M: gl.constexpr,
    LINES: gl.constexpr,
    ELEM: gl.constexpr,
    RCEIL: gl.constexpr,
):
    CHUNKS: gl.constexpr = ROWS // 4 * NUM_WARPS * REPS
    SPLIT: gl.constexpr = 4 // NUM_SUB  # programs per tile column
    pid = gl.program_id(0)
    pid_k = gl.program_id(1)
    t = pid // SPLIT  # tile column of the scale buffer
    part = pid % SPLIT  # which 32 * NUM_SUB of its 128 rows

    tile_start, group_tiles, row_start, row_end = _tile_column_group(
        offs_ptr, t, M, num_groups, max_tile_cols, GROUPS_POW2, NUM_WARPS * WARPS_M, PACKED
    )
    tile = t - tile_start  # tile column inside the group
    row0 = row_start + tile * 128
    if SPLIT > 1:  # (SPLIT 1: no `+ 0`, which would fold away with the multiple_of hint on it)
        row0 += part * (32 * NUM_SUB)
    row0 = gl.multiple_of(row0, 32)  # group starts are rounded down to 32 rows above

    # Programs with no row of their group (past its end, or in the buffer's tail) run the tile with every
    # row masked: no memory traffic, and their zero scales are stored below.
    padded_k = (K + 127) >> 7 << 7
    group_base = padded_k.to(gl.int64) * 4 * tile_start  # the group's first byte
    # bytes left in the buffer from the group's base (bounds the stores for invalid offs), in int32
    left = padded_k.to(gl.int64) * 4 * max_tile_cols - group_base
    left = gl.maximum(gl.minimum(left, 2**31 - 1), 0).to(gl.int32)
    if LINES:
        _lines_tile(
            x_ptr, q_ptr, s_ptr + group_base, M, K, stride_xm, stride_xk, row0, row_end, pid_k, tile, group_tiles,
            left, NUM_SUB, ROWS, NUM_WARPS, REPS, WARPS_M, OFFS64, ELEM, RCEIL,
        )  # fmt: skip
    else:
        s = dim1_tile(
            x_ptr, q_ptr, M, K, stride_xm, stride_xk, row0, row_end, pid_k,
            NUM_SUB, ROWS, NUM_WARPS, REPS, MASK_COLS, OFFS64, ELEM, RCEIL,
        )  # fmt: skip

        # this program's [NUM_SUB, BLOCK_K] scales: rows k of the group's tile column `tile`, NUM_SUB contiguous
        # bytes per k
        S1L: gl.constexpr = dim1_scale_layout(NUM_SUB, ROWS, NUM_WARPS, REPS)
        r = (pid_k * CHUNKS + arange_along(CHUNKS, 1, 3, S1L)) * 32 + arange_along(32, 2, 3, S1L)  # [1, CHUNKS, 32]
        sub = arange_along(NUM_SUB, 0, 3, S1L)  # [NUM_SUB, 1, 1]
        valid = row0 + sub * 32 < row_end
        if MASK_COLS:
            valid = valid & (r < K)
        s_offs = blocked_scale_offset(wide(r, OFFS64), tile * 4 + part * NUM_SUB + sub, group_tiles)
        in_buffer = s_offs < left
        if MASK_COLS:
            in_buffer = in_buffer & (r < padded_k)
        gl.store(s_ptr + group_base + s_offs, gl.where(valid, s, 0), mask=in_buffer)


@gluon.jit
def _lines_tile(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_xk, row0, row_end, pid_k, tile, group_tiles, left,
    NUM_SUB: gl.constexpr, ROWS: gl.constexpr, NUM_WARPS: gl.constexpr, REPS: gl.constexpr, WARPS_M: gl.constexpr,
    OFFS64: gl.constexpr, ELEM: gl.constexpr, RCEIL: gl.constexpr,
):  # fmt: skip
    """LINES: rows [row0, row0 + 128) (those >= row_end masked) x columns [pid_k * 128, +128) of x, quantized
    along M; q stored as whole lines of [K, M], the scales as blocked tile (pid_k, tile) of the group's
    [K, group_tiles * 4] scale matrix at s_ptr (the group's base), 16 bytes a lane, zeros where invalid."""
    CHUNKS: gl.constexpr = ROWS // 4 * NUM_WARPS * REPS
    L: gl.constexpr = tile_layout(NUM_SUB, ROWS, NUM_WARPS, WARPS_M)
    rows = row0 + arange_along(NUM_SUB, 0, 4, L) * 32 + arange_along(32, 1, 4, L)  # [NUM_SUB, 32, 1, 1]
    cols = (pid_k * CHUNKS + arange_along(CHUNKS, 2, 4, L)) * 32 + arange_along(32, 3, 4, L)  # [1, 1, CHUNKS, 32]
    x_ptrs = x_ptr + wide(rows, OFFS64) * stride_xm + cols * stride_xk
    x = gl.load(x_ptrs, mask=(rows < row_end) & (cols < K), other=0.0)
    T: gl.constexpr = transposed_layout(NUM_SUB, ROWS, NUM_WARPS, REPS, WARPS_M)
    xt = gl.convert_layout(x.to(gl.float32), T, assert_trivial=True)
    q, s = quantize(xt, 1, NUM_SUB, ROWS, NUM_WARPS, REPS, ELEM, RCEIL, WARPS_M)
    store_lines(q_ptr, q, row0 // 32, pid_k * CHUNKS, M, K, row_end, True, NUM_WARPS * WARPS_M, OFFS64, False)
    # [S, CHUNKS, 32 k] -> [32, CHUNKS * S]: k-row i of each 32-row block holds its bytes chunk * 4 + sub
    SB: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [NUM_WARPS * WARPS_M, 1], [1, 0])
    s = gl.convert_layout(gl.reshape(gl.permute(s, [2, 1, 0]), [32, CHUNKS * NUM_SUB]), SB)
    i = arange_along(32, 0, 2, SB)
    j = arange_along(16, 1, 2, SB)
    valid = (pid_k * (CHUNKS * 32) + (j >> 2) * 32 + i < K) & (row0 + (j & 3) * 32 < row_end)
    row_offs = (wide(pid_k, OFFS64) * group_tiles + tile) * 512 + i * 16  # [32, 1]: one mask per 16 bytes
    gl.store(s_ptr + row_offs + j, gl.where(valid, s, 0), mask=row_offs + 16 <= left)


_LAUNCHES = LaunchCache(_gluon_cast_groups_dim1_kernel)


def tile_for(m: int, num_groups: int) -> dict:
    """The tile for M_total ``m`` rows in ``num_groups`` groups: LINES_TILE from LINES_MIN_ROWS rows a group on
    average, else SMALL_TILE."""
    return LINES_TILE if m >= LINES_MIN_ROWS * max(num_groups, 1) else SMALL_TILE


def kernel_launch(
    x: torch.Tensor, offs: torch.Tensor, q: torch.Tensor, s: torch.Tensor, elem: str, mode: str, tile: dict
) -> tuple[tuple[int, int], dict]:
    """(grid, keyword arguments) of one launch (x [M, K] with K > 0; q, s uint8); also used to compile
    ahead of time (``compile_for_target``)."""
    m, k = x.shape
    num_groups = offs.numel()
    block_k = 8 * tile["ROWS"] * tile["NUM_WARPS"] * tile["REPS"]
    max_tile_cols = cdiv(m // 32, 4) + num_groups  # as scale_layout.blocked_groups_numel
    padded_k = cdiv(k, 128) * 128
    grid = (max_tile_cols * (4 // tile["NUM_SUB"]), cdiv(padded_k, block_k))
    k_cover = grid[1] * block_k
    # largest offsets any lane forms (masked ones included; invalid offs: rows up to M + 128 per tile column)
    row_bound = m + TILE_ROWS * max_tile_cols
    span = max(
        row_bound * abs(x.stride(0)) + k_cover * abs(x.stride(1)), k_cover * m + row_bound, padded_k * 4 * max_tile_cols
    )
    kwargs = dict(
        x_ptr=x, offs_ptr=offs, q_ptr=q, s_ptr=s, M=m, K=k, num_groups=num_groups, max_tile_cols=max_tile_cols,
        stride_xm=x.stride(0), stride_xk=x.stride(1), GROUPS_POW2=triton.next_power_of_2(num_groups),
        PACKED=max(m >> 5, max_tile_cols) <= PACKED_MAX, MASK_COLS=k_cover != k, OFFS64=span >= 2**31, **tile,
        ELEM=elem, RCEIL=mode == "rceil", num_warps=tile["NUM_WARPS"] * tile["WARPS_M"],
    )  # fmt: skip
    return grid, kwargs


def cast_groups_dim1(x: torch.Tensor, offs: torch.Tensor, elem: str, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M_total, K] (bf16/fp32, any strides), offs int32 [G] group ends on x's device -> (qdata [K, M_total]
    fp8, per-group blocked scales e8m0, 1D): ``mx_kernels.mx.cast_groups_dim1.cast_groups_dim1``, bit for bit.
    The caller validates the values of ``offs`` (``common.check_offs``): read here, they would sync."""
    check_cast(x, elem, mode, ndims=(2,), qdim=0, op="gluon cast_groups_dim1")
    check_offs(offs, x.shape[0], check_values=False)
    require_gpu(x, "gluon cast_groups_dim1")
    if offs.device != x.device:
        raise ValueError(f"gluon cast_groups_dim1: offs is on {offs.device}, x on {x.device}")
    q_shape, s_shape = groups_dim1_shapes(x.shape, offs.numel(), blocked=True)
    qdata = torch.empty(q_shape, dtype=fp8_dtype(elem), device=x.device)
    scale = torch.empty(s_shape, dtype=torch.float8_e8m0fnu, device=x.device)
    m, k = x.shape
    if k and not m:  # no rows: the buffer (G tile columns of padding) is zeros, as the Triton kernel writes it
        scale.view(torch.uint8).zero_()
    elif k:
        key = (x.shape, x.stride(), x.dtype, offs.numel(), elem, mode)
        _LAUNCHES.launch_keyed(
            key,
            lambda: kernel_launch(
                x, offs, qdata.view(torch.uint8), scale.view(torch.uint8), elem, mode, tile_for(m, offs.numel())
            ),
            x_ptr=x, offs_ptr=offs, q_ptr=qdata, s_ptr=scale,
        )  # fmt: skip
    return qdata, scale


def compile_for_target(
    shape: tuple[int, int], num_groups: int, dtype: torch.dtype = torch.bfloat16, elem: str = "e4m3",
    mode: str = "floor", tile: dict | None = None, arch: int = 90,
):  # fmt: skip
    """Compile the kernel for CUDA ``arch`` without a GPU: the CompiledKernel (``.asm["ptx"]``, ``["cubin"]``),
    specialized as a launch on a contiguous x of ``shape`` with ``num_groups`` groups would be."""
    x = torch.empty(shape, dtype=dtype, device="meta")
    offs = torch.empty(num_groups, dtype=torch.int32, device="meta")
    u8 = torch.empty(16, dtype=torch.uint8, device="meta")
    _, kwargs = kernel_launch(x, offs, u8, u8, elem, mode, tile or tile_for(shape[0], num_groups))
    return compile_for_arch(_gluon_cast_groups_dim1_kernel, kwargs, arch)
