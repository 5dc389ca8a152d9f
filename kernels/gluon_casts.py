"""Gluon kernel of the dim0, dim1 and fused dim0+dim1 MX casts, 2D and per expert of 3D, with explicit layouts.

On a Hopper GPU (compute capability 9.x) ``mx_kernels.cast_dim0.cast_dim0``, ``mx_kernels.cast_dim1.cast_dim1``
and ``mx_kernels.cast_dim0_dim1.cast_dim0_dim1`` run it for bf16 input unless the caller passes a Triton config
(``mx_kernels.common.use_gluon``; ``MX_RECIPE_GLUON=0`` turns it off). ``DIM0`` and ``DIM1`` say which halves a
launch computes; ``BATCHED``: x [E, M, K] with the expert on grid axis 2, each expert's outputs (dim1: its [K, M]
written column-major directly, no transpose copy, seed 003; blocked scales per expert) at its own base.

Triton 3.6's default layouts put a program's warps along M, which splits a 32-row MX block
across warps (shared-memory reductions), so the `tl` kernels run one warp per program and
keep too little memory in flight (docs/notes_cast_kernels.md). Here the layout is chosen by
hand. A program's tile is [NUM_SUB, 32 rows, CHUNKS, 32 cols] (NUM_SUB 32-row sub-tiles,
BLOCK_K = 32 * CHUNKS columns) in

    size_per_thread [NUM_SUB, ROWS, 1, 8], threads_per_warp [1, 32 / ROWS, ROWS / 4, 4],
    warps_per_cta [1, 1, NUM_WARPS, 1]

(ROWS = 4: the [4, 8] x [8, 4] layout). A thread loads ROWS rows x 8 contiguous elements
(16-byte loads for bf16); a 32-row block (dim1) lives in one warp (ROWS values in a thread,
then log2(32 / ROWS) shuffle steps), and so does a 32-column block (dim0: 8 values in a
thread, 2 shuffle steps); warps split K, so no reduction touches shared memory. For dim1 the
tile is relabelled with its registers listed rows first (a register permutation: every
convert_layout here is asserted trivial at compile time), so that cvt packs fp8 pairs along M
and each thread stores ROWS contiguous bytes of [K, M] per column.

Numerics are mx_quantize.quantize_blocks itself: Gluon kernels can call the @triton.jit helpers
(elementwise ops and a reduce, lowered in the caller's layout). ``LEAN`` swaps in a variant
with fewer instructions per element (see gluon_common.quantize_blocks_lean), shown bit-identical to the
reference on an H200 (tests/test_gluon_casts.py). Gluon kernels do not run in the Triton interpreter (3.6):
these need a GPU; ``compile_for_target`` compiles them for inspection without one.
"""

from __future__ import annotations

import functools

import mx_recipe.formats  # noqa: F401  (first: importing mx_kernels.common before mx_recipe is circular)

# isort: split
import torch
import triton.experimental.gluon.language as gl
from mx_kernels.common import check_cast, dim0_shapes, dim1_shapes, fp8_dtype, tile_grid
from mx_kernels.gluon_common import (  # the tile pieces are shared with the per-group and fake-quant kernels
    _linear,
    arange_along,
    check_tile_config,
    compile_for_arch,
    dim0_scale_layout,
    dim1_scale_layout,
    quantize,
    require_gpu,
    store_scales,
    tile_launch_args,
    tile_layout,
    transposed_layout,
    wide,
)
from mx_kernels.launch_cache import LaunchCache
from mx_kernels.unblock_scales import unblock_scales
from triton.experimental import gluon

from mx_recipe.scale_layout import blocked_shape

# The base every config is checked against and completed from: 128 columns x 64 rows per program,
# 4 rows per thread (16 KB of bf16 in flight per program).
# PLAIN_VIA_BLOCKED: plain scales are written in the blocked layout and then permuted to [rows, cols]
# (unblock_scales, one Triton pass over the scales): the kernel's plain dim1 scale stores, NUM_SUB
# bytes per row of [K, M/32], cost 14% (dim1 plain 81% of copy against blocked 94%, H200).
# SCATTER: block maxima by reduce-scatter across a block's 4 lanes (gluon_common.quantize_scatter; needs
# ROWS 8 and LEAN).
# WARPS_M: warps along M (a program runs NUM_WARPS * WARPS_M warps). LINES: 16-byte stores of whole lines from
# 128 x 128 tiles (store_lines, store_scale_tile). K_FIRST: the grid runs along K first.
GLUON_CONFIG = dict(
    BLOCK_K=128, NUM_WARPS=4, NUM_SUB=2, ROWS=4, LEAN=False, PLAIN_VIA_BLOCKED=False, SCATTER=False, WARPS_M=1,
    LINES=False, K_FIRST=False,
)  # fmt: skip
# What a call without a config runs. dim1 and fused: 128 x 128 tiles with whole-line stores (LINES), 8 warps
# (2 along K, 4 along M); the fused cast's programs run along K first (K_FIRST). Events time against the
# 32-row-tile configs before them (dim1: BLOCK_K 256, NUM_SUB 2; fused: BLOCK_K 256, NUM_SUB 1; both SCATTER),
# e4m3 floor, blocked scales (docs/profiles/2026-11-21_h200_cast_lines_schedule.txt):
#   fused, H200: 286.7 against 304.7 us at 16384^2, 5-6% faster at [8192, 5120] and [16384, 4096], both rules
#   and formats; H100: 383.8 against 407.7 us at 16384^2, 4-5% faster at [8192, 5120] and [16640, 5120].
#   dim1, H200: 198.6 against 201.1 us at 16384^2, 36.0 against 38.7 at [8192, 5120], 67.6 against 70.1 at
#   [16640, 5120]; H100: 285.0/286.6, 49.3/50.7, 93.9/95.7 (K_FIRST is no faster for dim1: 205.9 us at 16384^2).
# The fused LINES kernel's speed rests on ptxas's instruction schedule: with x's row stride read from stride_xm
# instead of K (CONTIG off) it compiles to the same instructions in another order and takes 313 us (programs
# along M first; 292 us with CONTIG on).
DIM1_CONFIG = dict(
    BLOCK_K=128, NUM_WARPS=2, WARPS_M=4, NUM_SUB=4, ROWS=8, LEAN=True, PLAIN_VIA_BLOCKED=True, SCATTER=True,
    LINES=True,
)  # fmt: skip
DIM0_DIM1_CONFIG = {**DIM1_CONFIG, "K_FIRST": True}
# dim0 alone: the same tile along K first, which reads x and writes q0 in order (kernel time, e4m3, H200, against the
# Triton dim0 kernel, 32 x 512: 192.1 against 205.4 us at 16384^2 with blocked scales, 197.8 against 209.8 (floor) and
# 213.6 (rceil) with plain ones; 33.9 against 36.6 at [8192, 5120]; 121.2 against 130.1 at [4, 8192, 5120]; along M
# first 207-209 us at 16384^2; docs/profiles/2026-11-21_h200_cast_dim0_3d_lines.txt).
DIM0_CONFIG = DIM0_DIM1_CONFIG
# 3D dim1 (expert weights) on an H100 runs its programs along K first: kernel time against along M, [E, 8192, 5120],
# e4m3, both rules: 1.7-1.9% faster at E=1, 0.8-0.9% at E=4, 16, 64; on an H200 0.5-1.1% slower, so it keeps
# DIM1_CONFIG there (docs/profiles/2026-11-22_h200_h100_groups_lookup_3d_order.txt).
DIM1_3D_K_FIRST_DEVICES = ("H100",)
DIM1_3D_CONFIG_K_FIRST = {**DIM1_CONFIG, "K_FIRST": True}
# The fused LINES kernel loads x with evict_last from this many bytes of x on: events time 1-2% faster from 256 MiB
# on (H200 16384^2: 278.3 against 284.1 us; H100 1-1.1% at 448-512 MiB), 1.1-1.5% slower at 128 MiB; dim1 within
# 1.5% either way, so it keeps the default policy (docs/profiles/2026-11-21_h200_cast_lines_schedule.txt).
EVICT_LAST_MIN_BYTES = 256 * 2**20


# ---------------------------------------------------------------------------------------
# LINES: stores of whole 128-byte lines from 128 x 128 tiles (NUM_SUB 4, BLOCK_K 128)
#
# The quantize layouts store 32 bytes of q1 per k-row and 64 of q0 per row in each warp instruction, and
# scale bytes one at a time (4 of every 16-byte row of a blocked scale tile per program): the fused cast
# made 20 M L2 write requests for 16384^2 where a copy of the same bytes makes 6 M, and ran 18% slower
# than the copy on an H200 (docs/notes_cast_kernels.md). On a 128 x 128 tile (warps along M as well as K)
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
    return _linear([4, 32, 4, 32], reg + rest[w:], lane, rest[:w])


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
def _gluon_cast_kernel(
    x_ptr,
    q0_ptr,
    s0_ptr,
    q1_ptr,
    s1_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    S0_COLS,  # K // 32 (dim0 scale columns), an argument so that it is specialized like M and K
    S1_COLS,  # M // 32
    stride_xb,  # BATCHED: x [E, M, K] and per-expert outputs, expert = grid axis 2 (else unused)
    stride_q0b,
    stride_s0b,
    stride_q1b,
    stride_s1b,
    NUM_SUB: gl.constexpr,
    ROWS: gl.constexpr,
    NUM_WARPS: gl.constexpr,
    REPS: gl.constexpr,
    DIM0: gl.constexpr,
    DIM1: gl.constexpr,
    BATCHED: gl.constexpr,
    BLOCKED: gl.constexpr,
    EVEN: gl.constexpr,  # the grid tiles x exactly: no bounds masks
    OFFS64: gl.constexpr,
    LEAN: gl.constexpr,
    SCATTER: gl.constexpr,
    WARPS_M: gl.constexpr,
    LINES: gl.constexpr,
    K_FIRST: gl.constexpr,  # programs run along K first: the grid is (K tiles, M tiles)
    CONTIG: gl.constexpr,  # x is row-major: its row stride is K, not stride_xm (a faster schedule for LINES)
    X_EVICT: gl.constexpr,  # eviction policy of the loads of x ("" or "evict_last")
    EMAX: gl.constexpr,
    MAX_MANT: gl.constexpr,
    MAX_NORMAL: gl.constexpr,
    MBITS: gl.constexpr,
    EMIN: gl.constexpr,
    IS_E4M3: gl.constexpr,
    RCEIL: gl.constexpr,
):
    CHUNKS: gl.constexpr = ROWS // 4 * NUM_WARPS * REPS
    L: gl.constexpr = tile_layout(NUM_SUB, ROWS, NUM_WARPS, WARPS_M)
    SB: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [NUM_WARPS * WARPS_M, 1], [1, 0])  # a blocked scale tile
    pid_m = gl.program_id(1 if K_FIRST else 0)
    pid_k = gl.program_id(0 if K_FIRST else 1)
    m0 = pid_m * NUM_SUB  # first 32-row block of this program
    if BATCHED:  # E * M * K can pass 2**31: the expert's bases are int64, the offsets inside it as OFFS64 says
        pid_b = gl.program_id(2).to(gl.int64)
        x_ptr += pid_b * stride_xb
        q0_ptr += pid_b * stride_q0b
        s0_ptr += pid_b * stride_s0b
        q1_ptr += pid_b * stride_q1b
        s1_ptr += pid_b * stride_s1b
    rows = (m0 + arange_along(NUM_SUB, 0, 4, L)) * 32 + arange_along(32, 1, 4, L)  # [NUM_SUB, 32, 1, 1]
    cols = (pid_k * CHUNKS + arange_along(CHUNKS, 2, 4, L)) * 32 + arange_along(32, 3, 4, L)  # [1, 1, CHUNKS, 32]
    if CONTIG:
        x_ptrs = x_ptr + wide(rows, OFFS64) * K + cols
    else:
        x_ptrs = x_ptr + wide(rows, OFFS64) * stride_xm + cols * stride_xk
    if EVEN:
        x = gl.load(x_ptrs, eviction_policy=X_EVICT).to(gl.float32)
    else:
        x = gl.load(x_ptrs, mask=(rows < M) & (cols < K), other=0.0, eviction_policy=X_EVICT).to(gl.float32)

    # dim1 first (H200, LINES: 0.4-1.5% faster than dim0 first, docs/profiles/2026-11-21_h200_cast_lines_schedule.txt).
    # Blocks of 32 along M (axis 1): transposed [K, M] output. Quantized in the rows-first register
    # order, so that cvt packs fp8 pairs along M, as the store wants them.
    if DIM1:
        T: gl.constexpr = transposed_layout(NUM_SUB, ROWS, NUM_WARPS, REPS, WARPS_M)
        xt = gl.convert_layout(x, T, assert_trivial=True)
        q1, s1 = quantize(
            xt, 1, NUM_SUB, ROWS, NUM_WARPS, REPS, EMAX, MAX_MANT, MAX_NORMAL, MBITS, EMIN, IS_E4M3, RCEIL, LEAN,
            SCATTER, WARPS_M,
        )  # fmt: skip
        if LINES:
            store_lines(q1_ptr, q1, m0, pid_k * CHUNKS, M, K, M, True, NUM_WARPS * WARPS_M, OFFS64, EVEN)
            # [S, CHUNKS, 32 k] -> [32, CHUNKS * S]: k-row c of the tile holds its bytes chunk * 4 + sub
            s1 = gl.convert_layout(gl.reshape(gl.permute(s1, [2, 1, 0]), [32, CHUNKS * NUM_SUB]), SB)
            store_scale_tile(s1_ptr, s1, pid_k, pid_m, K, S1_COLS, EVEN)
        else:
            t_rows = (m0 + arange_along(NUM_SUB, 0, 4, T)) * 32 + arange_along(32, 1, 4, T)
            t_cols = (pid_k * CHUNKS + arange_along(CHUNKS, 2, 4, T)) * 32 + arange_along(32, 3, 4, T)
            q1_ptrs = q1_ptr + wide(t_cols, OFFS64) * M + t_rows
            if EVEN:
                gl.store(q1_ptrs, q1)
            else:
                gl.store(q1_ptrs, q1, mask=(t_rows < M) & (t_cols < K))
            # scales [K, M/32]: this program's NUM_SUB scale columns of each k are contiguous
            S1L: gl.constexpr = dim1_scale_layout(NUM_SUB, ROWS, NUM_WARPS, REPS, SCATTER, WARPS_M)
            s1 = gl.convert_layout(s1, S1L, assert_trivial=True)
            s1_rows = (pid_k * CHUNKS + arange_along(CHUNKS, 1, 3, S1L)) * 32 + arange_along(32, 2, 3, S1L)
            store_scales(s1_ptr, s1, s1_rows, m0 + arange_along(NUM_SUB, 0, 3, S1L), K, S1_COLS, BLOCKED, EVEN)

    if DIM0:
        # blocks of 32 along K (axis 3): row-major [M, K] output (8 contiguous bytes per thread)
        q0, s0 = quantize(
            x, 3, NUM_SUB, ROWS, NUM_WARPS, REPS, EMAX, MAX_MANT, MAX_NORMAL, MBITS, EMIN, IS_E4M3, RCEIL, LEAN,
            SCATTER, WARPS_M,
        )  # fmt: skip
        if LINES:
            store_lines(q0_ptr, q0, m0, pid_k * CHUNKS, M, K, M, False, NUM_WARPS * WARPS_M, OFFS64, EVEN)
            # [S, 32 rows, CHUNKS] -> [32, S * CHUNKS]: row r of the tile holds its bytes sub * 4 + chunk
            s0 = gl.convert_layout(gl.reshape(gl.permute(s0, [1, 0, 2]), [32, NUM_SUB * CHUNKS]), SB)
            store_scale_tile(s0_ptr, s0, pid_m, pid_k, M, S0_COLS, EVEN)
        else:
            q0_ptrs = q0_ptr + wide(rows, OFFS64) * K + cols
            if EVEN:
                gl.store(q0_ptrs, q0)
            else:
                gl.store(q0_ptrs, q0, mask=(rows < M) & (cols < K))
            S0L: gl.constexpr = dim0_scale_layout(NUM_SUB, ROWS, NUM_WARPS, REPS, SCATTER, WARPS_M)
            s0 = gl.convert_layout(s0, S0L, assert_trivial=True)
            s0_rows = (m0 + arange_along(NUM_SUB, 0, 3, S0L)) * 32 + arange_along(32, 1, 3, S0L)
            s0_cols = pid_k * CHUNKS + arange_along(CHUNKS, 2, 3, S0L)
            store_scales(s0_ptr, s0, s0_rows, s0_cols, M, S0_COLS, BLOCKED, EVEN)


_LAUNCHES = LaunchCache(_gluon_cast_kernel)


def kernel_launch(
    x: torch.Tensor, outs: tuple[torch.Tensor, ...], elem: str, mode: str, blocked: bool, dim0: bool,
    config: dict | None, dim1: bool = True,
) -> tuple[tuple[int, ...], dict]:  # fmt: skip
    """(grid, keyword arguments) of one launch of ``_gluon_cast_kernel`` on x [M, K] or [E, M, K] (each expert
    cast on its own, expert = grid axis 2); ``outs`` = (q0, s0, q1, s1) as uint8 views, the unused pair of a
    one-sided cast standing in for the other. Also used to compile the kernel ahead of time
    (tests/test_gluon_casts.py)."""
    config_items = None if config is None else tuple(config.items())
    grid, scalars = _launch_scalars(
        tuple(x.shape), x.stride(), x.element_size(), elem, mode, blocked, dim0, config_items, dim1
    )
    q0, s0, q1, s1 = outs
    return grid, dict(x_ptr=x, q0_ptr=q0, s0_ptr=s0, q1_ptr=q1, s1_ptr=s1, **scalars)


@functools.lru_cache(maxsize=1024)
def _launch_scalars(
    shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, elem: str, mode: str, blocked: bool, dim0: bool,
    config_items: tuple | None, dim1: bool,
) -> tuple[tuple[int, ...], dict]:  # fmt: skip
    """kernel_launch's grid and arguments other than the tensors, which depend on x's shape, strides and element
    size only (memoized: 16 us of host time a call on the H200 machine). Callers must not change the dict."""
    cfg = check_tile_config(None if config_items is None else dict(config_items), GLUON_CONFIG, "Gluon cast")
    if not (dim0 or dim1):
        raise ValueError("Gluon cast: neither dim0 nor dim1 asked for")
    batched = len(shape) == 3
    num_batch, m, k = shape if batched else (1, *shape)
    stride_m, stride_k = strides[-2:]
    block_m, block_k = 32 * cfg["NUM_SUB"], cfg["BLOCK_K"]
    pad = 128 if blocked else 1  # blocked: the grid covers the padding too, to zero it
    grid = tile_grid(m, k, block_m, block_k, pad)
    m_cover, k_cover = grid[0] * block_m, grid[1] * block_k  # rows and columns the grid's tiles span
    span = max((m_cover - 1) * abs(stride_m) + (k_cover - 1) * abs(stride_k), m_cover * k_cover)
    s0_rows, s0_cols = blocked_shape(m, k // 32) if blocked else (m, k // 32)
    s1_rows, s1_cols = blocked_shape(k, m // 32) if blocked else (k, m // 32)
    x_bytes = num_batch * m * k * itemsize
    scalars = dict(
        M=m,
        K=k,
        stride_xm=stride_m,
        stride_xk=stride_k,
        S0_COLS=k // 32,
        S1_COLS=m // 32,
        stride_xb=strides[0] if batched else 0,
        stride_q0b=m * k if batched else 0,
        stride_s0b=s0_rows * s0_cols if batched else 0,
        stride_q1b=m * k if batched else 0,
        stride_s1b=s1_rows * s1_cols if batched else 0,
        DIM0=dim0,
        DIM1=dim1,
        BATCHED=batched,
        BLOCKED=blocked,
        EVEN=(m_cover, k_cover) == (m, k),
        OFFS64=span >= 2**31,
        CONTIG=stride_k == 1 and (stride_m == k or m == 1),
        X_EVICT="evict_last" if dim0 and dim1 and cfg["LINES"] and x_bytes >= EVICT_LAST_MIN_BYTES else "",
        **tile_launch_args(cfg, elem, mode),
    )
    if cfg["K_FIRST"]:
        grid = grid[::-1]
    if grid[1] > 65535:  # CUDA's limit on a grid's y dimension
        along = "M" if cfg["K_FIRST"] else "K"
        raise ValueError(f"Gluon cast of x {shape}: {grid[1]} tiles along {along}, more than a grid's 65535")
    if batched:
        if num_batch > 65535:  # and on its z dimension
            raise ValueError(f"Gluon cast of x {shape}: {num_batch} experts, more than a grid's 65535")
        grid = (*grid, num_batch)
    return grid, scalars


def compile_for_target(
    shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16, elem: str = "e4m3", mode: str = "floor",
    blocked: bool = False, dim0: bool = False, config: dict | None = None, arch: int = 90, dim1: bool = True,
):  # fmt: skip
    """Compile the kernel for CUDA ``arch`` without a GPU (inspection and CPU tests): the
    CompiledKernel, with ``.asm["ttgir"]``, ``["ptx"]`` and ``["cubin"]``. Arguments are
    specialized as a launch on a contiguous x of ``shape`` ([M, K], or [E, M, K] for the batched
    kernel) would specialize them (16-divisible ints, stride 1). ``config``: None is GLUON_CONFIG."""
    x = torch.empty(shape, dtype=dtype)
    u8 = torch.empty(16, dtype=torch.uint8)  # stands in for every output (only its dtype and alignment matter)
    _, kwargs = kernel_launch(x, (u8, u8, u8, u8), elem, mode, blocked, dim0, config, dim1)
    return compile_for_arch(_gluon_cast_kernel, kwargs, arch)


def gluon_cast_dim0(
    x: torch.Tensor, elem: str, mode: str, blocked_scales: bool = False, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] or [E, M, K] (bf16/fp32, K % 32 == 0) -> (qdata fp8 of x's shape, scales e8m0 [.., M, K/32], or
    blocked: 1D for 2D x, [E, blocked_numel(M, K/32)] for 3D): the outputs of ``mx_kernels.cast_dim0.cast_dim0``,
    bit for bit. 3D x: each expert cast on its own (a batch grid axis)."""
    check_cast(x, elem, mode, ndims=(2, 3), qdim=-1, op="gluon_cast_dim0")
    return _cast_one_side(x, elem, mode, blocked_scales, DIM0_CONFIG if config is None else config, dim0=True)


def gluon_cast_dim1(
    x: torch.Tensor, elem: str, mode: str, blocked_scales: bool = False, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] or [E, M, K] (bf16/fp32, M % 32 == 0) -> (qdata [.., K, M] fp8, scales e8m0 [.., K, M/32], or
    blocked: 1D for 2D x, [E, blocked_numel(K, M/32)] for 3D): the outputs of ``mx_kernels.cast_dim1.cast_dim1``,
    bit for bit. 3D x (expert weights): each expert's [K, M] written column-major directly, no transpose copy
    (seed 003)."""
    check_cast(x, elem, mode, ndims=(2, 3), qdim=-2, op="gluon_cast_dim1")
    if config is None:
        config = dim1_3d_config(x.device) if x.dim() == 3 else DIM1_CONFIG
    return _cast_one_side(x, elem, mode, blocked_scales, config, dim0=False)


def dim1_3d_config(device: torch.device) -> dict:
    """The 3D dim1 cast's default on ``device``: DIM1_CONFIG, along K first on the DIM1_3D_K_FIRST_DEVICES."""
    k_first = device.type == "cuda" and _k_first_device(device.index)  # (a CPU tensor: the launcher refuses it)
    return DIM1_3D_CONFIG_K_FIRST if k_first else DIM1_CONFIG


@functools.lru_cache(maxsize=64)
def _k_first_device(index: int | None) -> bool:
    name = torch.cuda.get_device_name(index)
    return any(tag in name for tag in DIM1_3D_K_FIRST_DEVICES)


def _cast_one_side(
    x: torch.Tensor, elem: str, mode: str, blocked_scales: bool, config: dict, dim0: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = check_tile_config(config, GLUON_CONFIG, "Gluon cast")
    require_gpu(x, "gluon_cast_dim0" if dim0 else "gluon_cast_dim1")
    via_blocked = cfg["PLAIN_VIA_BLOCKED"] and not blocked_scales and x.numel() > 0
    blocked = blocked_scales or via_blocked
    q_shape, s_shape = (dim0_shapes if dim0 else dim1_shapes)(x.shape, blocked)
    qdata = torch.empty(q_shape, dtype=fp8_dtype(elem), device=x.device)
    scale = torch.empty(s_shape, dtype=torch.float8_e8m0fnu, device=x.device)
    if x.numel():
        q, s = qdata.view(torch.uint8), scale.view(torch.uint8)
        grid, kwargs = kernel_launch(x, (q, s, q, s), elem, mode, blocked, dim0, cfg, dim1=not dim0)
        _LAUNCHES.launch(grid, kwargs)
    if via_blocked:  # for 3D x, [E, n] blocked -> [E, rows, cols], all experts in one launch
        m, k = x.shape[-2:]
        scale = unblock_scales(scale, m, k // 32) if dim0 else unblock_scales(scale, k, m // 32)
    return qdata, scale


def gluon_cast_dim0_dim1(
    x: torch.Tensor, elem: str, mode: str, blocked_scales: bool = False, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp32, M and K multiples of 32) -> (q0 [M, K], s0, q1 [K, M], s1) from one read
    of x: the outputs of ``mx_kernels.cast_dim0_dim1.cast_dim0_dim1``, bit for bit."""
    check_cast(x, elem, mode, ndims=(2,), qdim=0, op="gluon_cast_dim0_dim1")
    check_cast(x, elem, mode, ndims=(2,), qdim=1, op="gluon_cast_dim0_dim1")
    cfg = check_tile_config(DIM0_DIM1_CONFIG if config is None else config, GLUON_CONFIG, "Gluon cast")
    require_gpu(x, "gluon_cast_dim0_dim1")
    # both plain scale matrices go via blocked: storing dim0's directly (8 bytes of a 512-byte row per
    # program) made the fused cast 27 us slower at 16384^2 than blocked + unblock (H200, cb5cfd2)
    via_blocked = cfg["PLAIN_VIA_BLOCKED"] and not blocked_scales and x.numel() > 0
    blocked = blocked_scales or via_blocked
    q0_shape, s0_shape = dim0_shapes(x.shape, blocked)
    q1_shape, s1_shape = dim1_shapes(x.shape, blocked)
    q0 = torch.empty(q0_shape, dtype=fp8_dtype(elem), device=x.device)
    s0 = torch.empty(s0_shape, dtype=torch.float8_e8m0fnu, device=x.device)
    q1 = torch.empty(q1_shape, dtype=fp8_dtype(elem), device=x.device)
    s1 = torch.empty(s1_shape, dtype=torch.float8_e8m0fnu, device=x.device)
    if x.numel():
        outs = tuple(t.view(torch.uint8) for t in (q0, s0, q1, s1))
        grid, kwargs = kernel_launch(x, outs, elem, mode, blocked, True, cfg)
        _LAUNCHES.launch(grid, kwargs)
    if via_blocked:
        m, k = x.shape
        s0, s1 = unblock_scales(s0, m, k // 32), unblock_scales(s1, k, m // 32)
    return q0, s0, q1, s1
