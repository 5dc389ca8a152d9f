"""What the Gluon kernels (``gluon_casts``, ``gluon_cast_groups``, ``gluon_fake_quant``) share: the tile
layout, the one quantize routine of the casts, the dim1 tile and the whole-line stores.

A program's tile is [NUM_SUB, 32 rows, CHUNKS, 32 cols] (NUM_SUB 32-row sub-tiles, BLOCK_K = 32 *
CHUNKS columns) in

    size_per_thread [NUM_SUB / WARPS_M, ROWS, 1, 8], threads_per_warp [1, 32 / ROWS, ROWS / 4, 4],
    warps_per_cta [WARPS_M, 1, NUM_WARPS, 1]

A thread loads ROWS rows x 8 contiguous elements (16-byte loads for bf16); a block of 32 along K
is 8 values in a thread then 4 lanes, a block of 32 along M is ROWS values in a thread then
32 / ROWS lanes of one warp; NUM_WARPS warps split K and WARPS_M warps split the sub-tiles, so no
reduction touches shared memory (docs/DESIGN.md, Kernels: why each is shaped as it is).
For dim1 the tile is relabelled with its registers listed rows first (``transposed_layout``: a
register permutation, every convert_layout asserted trivial at compile time), so that cvt packs fp8
pairs along M and each thread stores ROWS contiguous bytes of [K, M] per column.
Gluon kernels do not run in the Triton interpreter (3.6): they need a GPU, and
``compile_for_arch`` compiles them on the CPU for inspection and tests.
"""

from __future__ import annotations

import torch
import triton
import triton.experimental.gluon.language as gl
import triton.language as tl
from mx_kernels.common import interpreting
from mx_kernels.quantize import scale_exponent
from triton.experimental import gluon


@gluon.constexpr_function
def tile_layout(num_sub, rows, num_warps, warps_m=1):
    """[NUM_SUB, 32, CHUNKS, 32]: a thread holds ``rows`` rows x 8 contiguous columns; a warp's lanes
    cover the 32 rows of a block (32 / rows lanes) and rows / 4 chunks of 32 columns (4 lanes each);
    ``num_warps`` warps along the chunks, then ``warps_m`` along the sub-tiles."""
    return gl.BlockedLayout(
        [num_sub // warps_m, rows, 1, 8], [1, 32 // rows, rows // 4, 4], [warps_m, 1, num_warps, 1], [3, 2, 1, 0]
    )


@gluon.constexpr_function
def _axis_layout(layout, rank, dim):
    """The 1D layout whose arange, expanded along every other dim, has ``layout``."""
    for d in reversed(range(rank)):
        if d != dim:
            layout = gl.SliceLayout(d, layout)
    return layout


@gluon.constexpr_function
def _other_dims(rank, dim):
    return tuple(d for d in range(rank) if d != dim)


@gluon.jit
def arange_along(n: gl.constexpr, dim: gl.constexpr, rank: gl.constexpr, layout: gl.constexpr):
    """arange(n) along ``dim`` of a rank-``rank`` tensor in ``layout``, size 1 along the other dims."""
    return gl.expand_dims(gl.arange(0, n, layout=_axis_layout(layout, rank, dim)), _other_dims(rank, dim))


@gluon.jit
def wide(offsets, OFFS64: gl.constexpr):
    """int64 offsets only where a tensor passes 2**31 elements: int32 address math is cheaper."""
    if OFFS64:  # one return: Triton 3.6 compiles both returns and rejects their two types
        offsets = offsets.to(gl.int64)
    return offsets


@gluon.jit
def max_nan(a, b):
    """max that keeps NaN: a block holding NaN must get the NaN scale."""
    return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


# ---------------------------------------------------------------------------------------
# dim1: blocks of 32 along M, qdata stored transposed ([K, M]), scales [K, M/32]


@gluon.constexpr_function
def _pow2_below(n: int) -> list[int]:
    """1, 2, 4, .. < n (the linear-layout bases of a power-of-two extent n)."""
    return [1 << i for i in range(n.bit_length() - 1)]


@gluon.constexpr_function
def _sub_bases(num_sub, warps_m):
    """(register, warp) bases of the sub-tile axis (values along it): registers first, then warps."""
    regs = num_sub // warps_m
    return _pow2_below(regs), [regs * w for w in _pow2_below(warps_m)]


@gluon.constexpr_function
def _lanes_and_warps(rows, num_warps, dim_row, dim_chunk, dim_col, rank, dim_sub=0, num_sub=1, warps_m=1):
    """Lane and warp bases of tile_layout (or of a slice of it: dim_row None drops the row dim, whose
    lanes then hold copies). Lanes go columns first, then chunks, then rows; warps along chunks, then
    along the sub-tiles (dim_sub)."""

    def basis(dim, value):
        return [value if d == dim else 0 for d in range(rank)]

    lane = [basis(dim_col, 8), basis(dim_col, 16)] + [basis(dim_chunk, c) for c in _pow2_below(rows // 4)]
    lane += [basis(dim_row, rows * r) if dim_row is not None else [0] * rank for r in _pow2_below(32 // rows)]
    warp = [basis(dim_chunk, rows // 4 * w) for w in _pow2_below(num_warps)]
    warp += [basis(dim_sub, v) for v in _sub_bases(num_sub, warps_m)[1]]
    return lane, warp


@gluon.constexpr_function
def transposed_layout(num_sub, rows, num_warps, reps, warps_m=1):
    """tile_layout with each thread's registers listed rows first: same lanes and warps, so converting
    to it moves no data; its fp8 pairs and stores run along M (``rows`` contiguous bytes of [K, M])."""
    chunks = rows // 4 * num_warps * reps
    reg = [[0, r, 0, 0] for r in _pow2_below(rows)] + [[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]]
    reg += [[s, 0, 0, 0] for s in _sub_bases(num_sub, warps_m)[0]]
    reg += [[0, 0, rows // 4 * num_warps * r, 0] for r in _pow2_below(reps)]
    lane, warp = _lanes_and_warps(rows, num_warps, 1, 2, 3, 4, 0, num_sub, warps_m)
    return gl.DistributedLinearLayout(reg, lane, warp, [], [num_sub, 32, chunks, 32])


@gluon.constexpr_function
def dim1_scale_layout(num_sub, rows, num_warps, reps, warps_m=1):
    """The dim1 scales [NUM_SUB, CHUNKS, 32] as the reduce-scatter of block maxima leaves them
    (``scatter_layouts``: one copy, NUM_SUB contiguous scale bytes per column)."""
    return scatter_layouts(1, num_sub, rows, num_warps, reps, warps_m)[4]


# ---------------------------------------------------------------------------------------
# Block maxima by reduce-scatter (ROWS = 8)
#
# A block's 32 values lie on 4 lanes, 8 in each. A butterfly (two shuffle-and-max steps) leaves each
# of the 4 lanes every block's amax, so each lane then runs the scale math of all 8 blocks it touches,
# the same work 4 times over. Here the 4 partial maxima are reduce-scattered instead: two layout
# conversions, each swapping one register bit with one lane bit (a warp shuffle; Triton 3.6 lowers a
# conversion with two such swaps through shared memory), each followed by an in-register max, leave
# each lane the maxima of 2 of its 8 blocks. The scale math runs on those, and two more swaps gather
# the inverse scales back. The fused cast went from 1000 to 760 SASS instructions per thread (sm_90)
# with the same bytes out.


@gluon.constexpr_function
def linear(shape, reg, lane, warp):
    """A DistributedLinearLayout of ``shape`` from bases written as (dim, value), None for a broadcast."""

    def basis(b):
        return [0] * len(shape) if b is None else [b[1] if d == b[0] else 0 for d in range(len(shape))]

    return gl.DistributedLinearLayout(
        [basis(b) for b in reg], [basis(b) for b in lane], [basis(b) for b in warp], [], list(shape)
    )


@gluon.constexpr_function
def scatter_layouts(axis, num_sub, rows, num_warps, reps, warps_m=1):
    """The layouts of the reduce-scatter along ``axis`` (0: blocks along K on tile_layout, 1: blocks
    along M on transposed_layout), ROWS = 8:
    [0] |x| with the block's 32 values split into 4 lanes x 8 registers (a relabelling of the tile);
    [1] the 4 lanes' partial maxima, the 4 split into 2 x 2 (a relabelling of [0]'s reduction);
    [2] one register bit swapped with the low lane bit; [3] after reducing that lane bit, the second
    register bit swapped with the high one; [4] the maxima (no copies); [5] one bit gathered back."""
    assert rows == 8, "the reduce-scatter is written for 8 rows per thread"
    ch = rows // 4 * num_warps * reps
    sub_regs, sub_warps = _sub_bases(num_sub, warps_m)
    sub, sw = [(0, s) for s in sub_regs], [(0, s) for s in sub_warps]  # the sub-tile axis is dim 0 of every shape
    if axis == 0:  # tile [S, 32 rows, CH, 32 cols]; the 4 column lanes hold a block's 4 x 8 values
        rep5 = [(2, 2 * num_warps * r) for r in _pow2_below(reps)]
        warp5 = [(2, 2 * w) for w in _pow2_below(num_warps)] + sw
        lanes = [(2, 1), (1, 8), (1, 16)]  # chunk, rows 8 and 16 (the same for every rank below)
        x5 = linear([num_sub, 32, ch, 4, 8], [(4, 1), (4, 2), (4, 4), (1, 1), (1, 2), (1, 4)] + sub + rep5,
                    [(3, 1), (3, 2)] + lanes, warp5, )  # fmt: skip
        p0 = linear([num_sub, 32, ch, 2, 2], [(1, 1), (1, 2), (1, 4)] + sub + rep5, [(4, 1), (3, 1)] + lanes, warp5)
        p1 = linear([num_sub, 32, ch, 2, 2], [(4, 1), (1, 2), (1, 4)] + sub + rep5, [(1, 1), (3, 1)] + lanes, warp5)
        p2 = linear([num_sub, 32, ch, 2], [(3, 1), (1, 4)] + sub + rep5, [(1, 1), (1, 2)] + lanes, warp5)
        amax = linear([num_sub, 32, ch], [(1, 4)] + sub + rep5, [(1, 1), (1, 2)] + lanes, warp5)
        half = linear([num_sub, 32, ch], [(1, 2), (1, 4)] + sub + rep5, [(1, 1), None] + lanes, warp5)
        return x5, p0, p1, p2, amax, half
    # tile [S, 32 rows, CH, 32 cols] in transposed_layout; the 4 row lanes hold a block's 4 x 8 values
    cols = [(4, 8), (4, 16), (3, 1)]  # the column lanes and the chunk lane of the rank-5 shapes
    rep, warp = [(3, 2 * num_warps * r) for r in _pow2_below(reps)], [(3, 2 * w) for w in _pow2_below(num_warps)]
    x5 = linear([num_sub, 4, 8, ch, 32], [(2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4)] + sub + rep,
                cols + [(1, 1), (1, 2)], warp + sw)  # fmt: skip
    p0 = linear([num_sub, 2, 2, ch, 32], [(4, 1), (4, 2), (4, 4)] + sub + rep, cols + [(2, 1), (1, 1)], warp + sw)
    p1 = linear([num_sub, 2, 2, ch, 32], [(2, 1), (4, 2), (4, 4)] + sub + rep, cols + [(4, 1), (1, 1)], warp + sw)
    rep4, warp4 = [(2, b) for _, b in rep], [(2, b) for _, b in warp] + sw
    cols4 = [(3, 8), (3, 16), (2, 1)]
    p2 = linear([num_sub, 2, ch, 32], [(1, 1), (3, 4)] + sub + rep4, cols4 + [(3, 1), (3, 2)], warp4)
    rep3, warp3 = [(1, b) for _, b in rep], [(1, b) for _, b in warp] + sw
    cols3 = [(2, 8), (2, 16), (1, 1)]
    amax = linear([num_sub, ch, 32], [(2, 4)] + sub + rep3, cols3 + [(2, 1), (2, 2)], warp3)
    half = linear([num_sub, ch, 32], [(2, 2), (2, 4)] + sub + rep3, cols3 + [(2, 1), None], warp3)
    return x5, p0, p1, p2, amax, half


@gluon.constexpr_function
def scatter_layout(i, axis, num_sub, rows, num_warps, reps, warps_m=1):
    return scatter_layouts(axis, num_sub, rows, num_warps, reps, warps_m)[i]


@gluon.jit
def scatter_amax(ax, AXIS: gl.constexpr, NUM_SUB: gl.constexpr, ROWS: gl.constexpr, NUM_WARPS: gl.constexpr,
                 REPS: gl.constexpr, WARPS_M: gl.constexpr = 1):  # fmt: skip
    """Block maxima of |x| (``ax``: the tile in tile_layout for AXIS 3, transposed_layout for AXIS 1), each
    block's on one lane: [S, 32, CHUNKS] (AXIS 3) or [S, CHUNKS, 32] (AXIS 1) in scatter_layout 4."""
    CHUNKS: gl.constexpr = ROWS // 4 * NUM_WARPS * REPS
    A: gl.constexpr = 0 if AXIS == 3 else 1
    X5: gl.constexpr = scatter_layout(0, A, NUM_SUB, ROWS, NUM_WARPS, REPS, WARPS_M)
    P0: gl.constexpr = scatter_layout(1, A, NUM_SUB, ROWS, NUM_WARPS, REPS, WARPS_M)
    P1: gl.constexpr = scatter_layout(2, A, NUM_SUB, ROWS, NUM_WARPS, REPS, WARPS_M)
    P2: gl.constexpr = scatter_layout(3, A, NUM_SUB, ROWS, NUM_WARPS, REPS, WARPS_M)
    if AXIS == 3:
        a = gl.convert_layout(gl.reshape(ax, [NUM_SUB, 32, CHUNKS, 4, 8]), X5, assert_trivial=True)
        p = gl.reshape(gl.reduce(a, 4, max_nan), [NUM_SUB, 32, CHUNKS, 2, 2])
        p = gl.convert_layout(gl.convert_layout(p, P0, assert_trivial=True), P1)  # swap 1
        p = gl.convert_layout(gl.reduce(p, 4, max_nan), P2)  # swap 2
        amax = gl.reduce(p, 3, max_nan)
    else:
        a = gl.convert_layout(gl.reshape(ax, [NUM_SUB, 4, 8, CHUNKS, 32]), X5, assert_trivial=True)
        p = gl.reshape(gl.reduce(a, 2, max_nan), [NUM_SUB, 2, 2, CHUNKS, 32])
        p = gl.convert_layout(gl.convert_layout(p, P0, assert_trivial=True), P1)
        p = gl.convert_layout(gl.reduce(p, 2, max_nan), P2)
        amax = gl.reduce(p, 1, max_nan)
    return amax


@gluon.jit
def scale_from_amax(amax, ELEM: gl.constexpr, RCEIL: gl.constexpr):
    """(2**-e as fp32, NaN for a NaN block; the biased e8m0 byte) from block maxima."""
    amax_bits = amax.to(gl.int32, bitcast=True) & 0x7FFFFFFF
    is_nan = amax_bits > 0x7F800000
    e = scale_exponent(amax_bits, ELEM, RCEIL)
    inv_scale = gl.where(e < 127, (127 - e) << 23, 0x400000).to(gl.float32, bitcast=True)
    return gl.where(is_nan, float("nan"), inv_scale), gl.where(is_nan, 0xFF, e + 127).to(gl.uint8)


@gluon.jit
def to_fp8_bits(v, ELEM: gl.constexpr):
    """cvt.rn.satfinite to e4m3 / e5m2, as bytes."""
    if ELEM == "e4m3":
        q = v.to(gl.float8e4nv).to(gl.uint8, bitcast=True)
    else:
        q = v.to(gl.float8e5).to(gl.uint8, bitcast=True)
    return q


@gluon.jit
def quantize(
    x, AXIS: gl.constexpr, NUM_SUB: gl.constexpr, ROWS: gl.constexpr, NUM_WARPS: gl.constexpr, REPS: gl.constexpr,
    ELEM: gl.constexpr, RCEIL: gl.constexpr, WARPS_M: gl.constexpr = 1,
):  # fmt: skip
    """The Gluon casts' quantize: the fp32 tile x (AXIS 3: tile_layout, AXIS 1: transposed_layout) in blocks
    of 32 along AXIS, block maxima by reduce-scatter -> (fp8 bytes in x's layout, biased scales in
    ``scatter_layout(4, ...)``). Bit-identical to ``mx_quantize.quantize_blocks`` with fewer instructions:
    - no clamp to +-max_normal: cvt.rn.satfinite saturates the same way (PTX: |v| > MAX_NORM gives the
      signed MAX_NORM, inf included), and RNE below the bound rounds the same either way;
    - a NaN block through its scale, not by selecting 0x7F on the fp8 bytes: 2**-e is NaN there, so every
      product is NaN and cvt makes it fp8 NaN, 0x7F for both formats on the GPU (the GPU tests check it)."""
    A: gl.constexpr = 0 if AXIS == 3 else 1
    amax = scatter_amax(gl.abs(x), AXIS, NUM_SUB, ROWS, NUM_WARPS, REPS, WARPS_M)
    inv_scale, scale = scale_from_amax(amax, ELEM, RCEIL)
    HALF: gl.constexpr = scatter_layout(5, A, NUM_SUB, ROWS, NUM_WARPS, REPS, WARPS_M)
    # gather back in two swaps, to the layout of x reduced along AXIS (copies on the block's 4 lanes)
    inv_scale = gl.convert_layout(gl.convert_layout(inv_scale, HALF), gl.SliceLayout(AXIS, x.type.layout))
    return to_fp8_bits(x * gl.expand_dims(inv_scale, AXIS), ELEM), scale


@gluon.jit
def dim1_tile(
    x_ptr, q_ptr, M, K, stride_xm, stride_xk, row0, row_end, pid_k,
    NUM_SUB: gl.constexpr, ROWS: gl.constexpr, NUM_WARPS: gl.constexpr, REPS: gl.constexpr,
    MASK_COLS: gl.constexpr, OFFS64: gl.constexpr, ELEM: gl.constexpr, RCEIL: gl.constexpr,
):  # fmt: skip
    """Rows [row0, row0 + 32 * NUM_SUB) x columns [pid_k * BLOCK_K, +BLOCK_K) of x [M, K] (x_ptr, q_ptr: this
    slice's bases) quantized in blocks of 32 along M; qdata stored transposed into q [K, M]. Rows >= row_end
    and (MASK_COLS) columns >= K read as zeros and are not stored. row0 and row_end: multiples of 32. Returns
    the scales [NUM_SUB, CHUNKS, 32] (uint8, biased) in ``dim1_scale_layout``. The per-group cast's 32-row
    tiles use it."""
    CHUNKS: gl.constexpr = ROWS // 4 * NUM_WARPS * REPS
    L: gl.constexpr = tile_layout(NUM_SUB, ROWS, NUM_WARPS)
    rows = row0 + arange_along(NUM_SUB, 0, 4, L) * 32 + arange_along(32, 1, 4, L)  # [NUM_SUB, 32, 1, 1]
    cols = (pid_k * CHUNKS + arange_along(CHUNKS, 2, 4, L)) * 32 + arange_along(32, 3, 4, L)  # [1, 1, CHUNKS, 32]
    x_ptrs = x_ptr + wide(rows, OFFS64) * stride_xm + cols * stride_xk
    # masks stay full-shape ([NUM_SUB, 32, CHUNKS, 32]): a `>= 0` term stands in for the unmasked dim
    if MASK_COLS:
        x = gl.load(x_ptrs, mask=(rows < row_end) & (cols < K), other=0.0)
    else:
        x = gl.load(x_ptrs, mask=(rows < row_end) & (cols >= 0), other=0.0)

    # blocks of 32 along M (axis 1), quantized in the rows-first register order, so that cvt packs fp8
    # pairs along M, as the transposed [K, M] store wants them
    T: gl.constexpr = transposed_layout(NUM_SUB, ROWS, NUM_WARPS, REPS)
    xt = gl.convert_layout(x.to(gl.float32), T, assert_trivial=True)
    q, s = quantize(xt, 1, NUM_SUB, ROWS, NUM_WARPS, REPS, ELEM, RCEIL)
    t_rows = row0 + arange_along(NUM_SUB, 0, 4, T) * 32 + arange_along(32, 1, 4, T)
    t_cols = (pid_k * CHUNKS + arange_along(CHUNKS, 2, 4, T)) * 32 + arange_along(32, 3, 4, T)
    q_ptrs = q_ptr + wide(t_cols, OFFS64) * M + t_rows
    if MASK_COLS:
        gl.store(q_ptrs, q, mask=(t_rows < row_end) & (t_cols < K))
    else:
        gl.store(q_ptrs, q, mask=(t_rows < row_end) & (t_cols >= 0))
    return gl.convert_layout(s, dim1_scale_layout(NUM_SUB, ROWS, NUM_WARPS, REPS), assert_trivial=True)


# ---------------------------------------------------------------------------------------
# LINES: stores of whole 128-byte lines from 128 x 128 tiles (NUM_SUB 4, BLOCK_K 128)
#
# The quantize layouts store 32 bytes of q1 per k-row and 64 of q0 per row in each warp instruction, and
# scale bytes one at a time (4 of every 16-byte row of a blocked scale tile per program): the fused cast
# made 20 M L2 write requests for 16384^2 where a copy of the same bytes makes 6 M, and ran 18% slower
# than the copy on an H200. On a 128 x 128 tile (warps along M as well as K)
# a program owns 128 contiguous bytes of each q0 row and q1 k-row and exactly one 512-byte tile of each
# blocked scale matrix, so its outputs can leave as 16-byte stores that fill whole lines: a layout
# conversion (through shared memory) before each store.


@gluon.constexpr_function
def line_layout(num_warps, along_m):
    """[4, 32, 4, 32] bytes of a 128 x 128 tile laid out for 16-byte stores that fill 128-byte lines.
    ``along_m`` (q1, stored [K, M]): a thread holds 16 consecutive rows of one column, 8 lanes the 128 rows,
    4 lanes 4 consecutive columns; else (q0, [M, K]): 16 consecutive columns of one row, 8 lanes the 128
    columns, 4 lanes 4 consecutive rows. The other axis's remaining bits go to warps, then registers."""
    if along_m:
        reg, lane = [(1, 1), (1, 2), (1, 4), (1, 8)], [(1, 16), (0, 1), (0, 2), (3, 1), (3, 2)]
        rest = [(3, 4), (3, 8), (3, 16), (2, 1), (2, 2)]
    else:
        reg, lane = [(3, 1), (3, 2), (3, 4), (3, 8)], [(3, 16), (2, 1), (2, 2), (1, 1), (1, 2)]
        rest = [(1, 4), (1, 8), (1, 16), (0, 1), (0, 2)]
    w = num_warps.bit_length() - 1
    return linear([4, 32, 4, 32], reg + rest[w:], lane, rest[:w])


@gluon.jit
def store_lines(
    ptr, q, m0, c0, M, K, row_end, TRANSPOSED: gl.constexpr, WARPS: gl.constexpr, OFFS64: gl.constexpr,
    EVEN: gl.constexpr,
):  # fmt: skip
    """Store the 128 x 128 byte tile q ([4, 32, 4, 32]: 32-row block m0 + s, column block c0 + c) of [M, K]
    (TRANSPOSED: into [K, M]) as whole lines; unless EVEN, rows >= row_end and columns >= K are not stored."""
    LL: gl.constexpr = line_layout(WARPS, TRANSPOSED)
    q = gl.convert_layout(q, LL)
    rows = (m0 + arange_along(4, 0, 4, LL)) * 32 + arange_along(32, 1, 4, LL)
    cols = (c0 + arange_along(4, 2, 4, LL)) * 32 + arange_along(32, 3, 4, LL)
    if TRANSPOSED:
        ptrs = ptr + wide(cols, OFFS64) * M + rows
    else:
        ptrs = ptr + wide(rows, OFFS64) * K + cols
    if EVEN:
        gl.store(ptrs, q)
    else:
        gl.store(ptrs, q, mask=(rows < row_end) & (cols < K))


@gluon.jit
def store_scale_tile(ptr, s, tile_row, tile_col, n_rows, n_cols, EVEN: gl.constexpr):
    """Store blocked scale tile (tile_row, tile_col) of a [n_rows, n_cols] scale matrix from s [32, 16]
    (row r % 32, byte (r // 32 % 4) * 4 + c % 4: the tile's own byte order), 16 contiguous bytes a lane.
    The grid covers the padding (rows to 128, columns to 4), so every tile lies in the buffer; padding
    bytes are written as zeros."""
    L: gl.constexpr = s.type.layout
    i = arange_along(32, 0, 2, L)
    j = arange_along(16, 1, 2, L)
    offs = (tile_row * ((n_cols + 3) >> 2) + tile_col) * 512 + i * 16 + j
    if EVEN:
        gl.store(ptr + offs, s)
    else:
        valid = (tile_row * 128 + (j >> 2) * 32 + i < n_rows) & (tile_col * 4 + (j & 3) < n_cols)
        gl.store(ptr + offs, gl.where(valid, s, 0))


@gluon.jit
def permute_k(t, PERM: gl.constexpr):
    """t [R, 128] with the 7 bits of its K index permuted as PERM says (over [R, 2, 2, 2, 2, 2, 2, 2], most
    significant bit first): [R, 128] in the new order, a register permutation where the bits are a thread's."""
    R: gl.constexpr = t.shape[0]
    t = gl.reshape(t, [R, 2, 2, 2, 2, 2, 2, 2])
    t = gl.permute(t, (PERM[0], PERM[1], PERM[2], PERM[3], PERM[4], PERM[5], PERM[6], PERM[7]))
    return gl.reshape(t, [R, 128])


@gluon.jit
def split_k_sum(acc, on, om, ws_ptr, cnt_ptr, tile, pid_k, M, N, SPLIT_K, UNROLL: gl.constexpr):
    """Split K for a weight-only GEMM's tile acc [rows n ``on``, rows m ``om``] of out [M, N]: store this split's fp32
    partial in the workspace [SPLIT_K, M, N]; the last split of the tile to arrive (its counter) sums every partial
    in split order, so the result does not depend on timing, and resets the counter for the next launch. Returns
    (the sum where this program holds it, whether it does). The sum's loads are unrolled to UNROLL >= SPLIT_K, so
    that they are in flight together: the sum is on the kernel's path (one H200, Llama 3 8B's projections at one
    row, 0.2-1.5 us a GEMM against a loop)."""
    mask = gl.expand_dims(om < M, 0) & gl.expand_dims(on < N, 1)
    offs = gl.expand_dims(om, 0) * N + gl.expand_dims(on, 1)
    gl.store(ws_ptr + pid_k * M * N + offs, acc, mask=mask)
    gl.thread_barrier()  # every thread's stores, then one release by the counter's atomic
    last = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1
    if last:
        acc = gl.zeros_like(acc)
        for k in gl.static_range(UNROLL):
            part = gl.load(ws_ptr + k * M * N + offs, mask=mask & (k < SPLIT_K), other=0.0, cache_modifier=".cg")
            acc = gl.where(k < SPLIT_K, acc + part, acc)
        gl.atomic_xchg(cnt_ptr + tile, 0)
    return acc, last


def require_gpu(x: torch.Tensor, op: str) -> None:
    if interpreting():
        raise NotImplementedError(f"{op}: Gluon kernels do not run in the Triton interpreter (TRITON_INTERPRET=1)")
    if not x.is_cuda:
        raise RuntimeError(f"{op}: the Gluon kernels need a CUDA tensor, got {x.device}")


def compile_for_arch(kernel, kwargs: dict, arch: int):
    """Compile the Gluon (or Triton) ``kernel`` for CUDA ``arch`` without a GPU, its arguments (``kwargs``, by
    name, ``num_warps`` and any ``maxnreg`` included; a parameter with a default may be left out) specialized as a
    launch would specialize them (16-divisible ints, stride 1): the CompiledKernel, with ``.asm["ttgir"]``,
    ``["ptx"]`` and ``["cubin"]``."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        value = kwargs[p.name] if p.name in kwargs or not p.has_default else p.default
        ty, attr = (
            ("constexpr", None) if p.is_constexpr else native_specialize_impl(BaseBackend, value, False, True, True)
        )
        signature[p.name] = ty
        if ty == "constexpr":
            constexprs[p.name] = value
        elif attr:
            attrs[(i,)] = BaseBackend.parse_attr(attr)
    source = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource
    src = source(kernel, signature, constexprs, attrs)
    options = {name: kwargs[name] for name in ("num_warps", "maxnreg") if name in kwargs}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
