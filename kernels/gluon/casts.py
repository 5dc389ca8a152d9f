"""Gluon kernel of the dim0, dim1 and fused dim0+dim1 MX casts, 2D and per expert of 3D, with explicit layouts.

The Hopper implementation of ``cast_dim0``, ``cast_dim1`` and ``cast_dim0_dim1`` (mx_recipe.ops.dispatch picks it
for bf16 input on compute capability 9.x); the same outputs as the Triton kernels, bit for bit. ``DIM0`` and
``DIM1`` say which halves a launch computes; ``BATCHED``: x [E, M, K] with the expert on grid axis 2, each
expert's outputs (dim1: its [K, M] written column-major directly, no transpose copy; blocked scales per expert)
at its own base.

One tile for every cast (docs/DESIGN.md, Kernels: why each is shaped as it is): 128 x 128 (4 sub-tiles of
32 rows x 128 columns), 8 rows a thread, 2 warps along K and 4 along M, block maxima by reduce-scatter
(``gluon_common.quantize``), and whole-line stores (``gluon_common.store_lines``: a program owns 128 contiguous
bytes of each q0 row and q1 k-row and exactly one 512-byte tile of each blocked scale matrix). Scales are
always written in the blocked layout; plain scales are unblocked after (``unblock_scales``), which costs less
than storing them plain from this tile.

Measured against the Triton kernels, e4m3, kernel time: fused 286.7 against 304.7 us at 16384^2 (H200),
dim1 198.6 against 201.1 us, dim0 192.1 against 205.4 us. The fused kernel's speed rests on ptxas's instruction
schedule: with x's row stride read from stride_xm instead of K (``CONTIG`` off) it compiles to the same
instructions in another order and takes 313 against 292 us (H200).
"""

from __future__ import annotations

import functools

import torch
import triton.experimental.gluon.language as gl
from mx_kernels.common import check_cast, dim0_shapes, dim1_shapes, empty_outputs, tile_grid
from mx_kernels.gluon import e2m1_casts as gluon_e2m1_casts
from mx_kernels.gluon.common import (
    arange_along,
    compile_for_arch,
    quantize,
    require_gpu,
    store_lines,
    store_scale_tile,
    tile_layout,
    transposed_layout,
    wide,
)
from mx_kernels.launch_cache import LaunchCache
from mx_kernels.mx.unblock_scales import plain_scales
from mx_kernels.spec import blocked_shape
from triton.experimental import gluon

# The tile's constexprs: 4 sub-tiles of 32 rows, 8 rows a thread, 2 warps along K and 4 along M, BLOCK_K 128.
TILE = dict(NUM_SUB=4, ROWS=8, NUM_WARPS=2, REPS=1, WARPS_M=4)
BLOCK_M, BLOCK_K = 128, 128
# Programs run along K first (the grid is (K tiles, M tiles)) for dim0 and the fused cast, which then read x and
# write q0 in order (dim0: 192 against 207-209 us at 16384^2, H200); dim1 runs along M first, except for 3D
# expert weights on an H100, where K first is 1.7-1.9% faster at E=1 (and 0.5-1.1% slower on an H200).
DIM1_3D_K_FIRST_DEVICES = ("H100",)
# The fused cast loads x with evict_last from this many bytes of x on: 1-2% faster from 256 MiB (H200 16384^2:
# 278.3 against 284.1 us; H100 1-1.1%), 1.1-1.5% slower at 128 MiB.
EVICT_LAST_MIN_BYTES = 256 * 2**20


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
    WARPS_M: gl.constexpr,
    DIM0: gl.constexpr,
    DIM1: gl.constexpr,
    BATCHED: gl.constexpr,
    EVEN: gl.constexpr,  # the grid tiles x exactly: no bounds masks
    OFFS64: gl.constexpr,
    K_FIRST: gl.constexpr,  # programs run along K first: the grid is (K tiles, M tiles)
    CONTIG: gl.constexpr,  # x is row-major: its row stride is K, not stride_xm (a faster schedule)
    X_EVICT: gl.constexpr,  # eviction policy of the loads of x ("" or "evict_last")
    ELEM: gl.constexpr,
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

    # dim1 first (0.4-1.5% faster than dim0 first, H200). Blocks of 32 along M (axis 1): transposed [K, M]
    # output, quantized in the rows-first register order, so that cvt packs fp8 pairs along M.
    if DIM1:
        T: gl.constexpr = transposed_layout(NUM_SUB, ROWS, NUM_WARPS, REPS, WARPS_M)
        xt = gl.convert_layout(x, T, assert_trivial=True)
        q1, s1 = quantize(xt, 1, NUM_SUB, ROWS, NUM_WARPS, REPS, ELEM, RCEIL, WARPS_M)
        store_lines(q1_ptr, q1, m0, pid_k * CHUNKS, M, K, M, True, NUM_WARPS * WARPS_M, OFFS64, EVEN)
        # [S, CHUNKS, 32 k] -> [32, CHUNKS * S]: k-row c of the tile holds its bytes chunk * 4 + sub
        s1 = gl.convert_layout(gl.reshape(gl.permute(s1, [2, 1, 0]), [32, CHUNKS * NUM_SUB]), SB)
        store_scale_tile(s1_ptr, s1, pid_k, pid_m, K, S1_COLS, EVEN)

    if DIM0:  # blocks of 32 along K (axis 3): row-major [M, K] output
        q0, s0 = quantize(x, 3, NUM_SUB, ROWS, NUM_WARPS, REPS, ELEM, RCEIL, WARPS_M)
        store_lines(q0_ptr, q0, m0, pid_k * CHUNKS, M, K, M, False, NUM_WARPS * WARPS_M, OFFS64, EVEN)
        # [S, 32 rows, CHUNKS] -> [32, S * CHUNKS]: row r of the tile holds its bytes sub * 4 + chunk
        s0 = gl.convert_layout(gl.reshape(gl.permute(s0, [1, 0, 2]), [32, NUM_SUB * CHUNKS]), SB)
        store_scale_tile(s0_ptr, s0, pid_m, pid_k, M, S0_COLS, EVEN)


_LAUNCHES = LaunchCache(_gluon_cast_kernel)


def kernel_launch(
    x: torch.Tensor, outs: tuple[torch.Tensor, ...], elem: str, mode: str, dim0: bool, dim1: bool, k_first: bool
) -> tuple[tuple[int, ...], dict]:
    """(grid, keyword arguments) of one launch on x [M, K] or [E, M, K] (expert = grid axis 2); ``outs`` =
    (q0, s0, q1, s1) as uint8 views, scales blocked, the unused pair of a one-sided cast standing in for the
    other. Also used to compile the kernel ahead of time (``compile_for_target``)."""
    grid, scalars = _launch_scalars(tuple(x.shape), x.stride(), x.element_size(), elem, mode, dim0, dim1, k_first)
    q0, s0, q1, s1 = outs
    return grid, dict(x_ptr=x, q0_ptr=q0, s0_ptr=s0, q1_ptr=q1, s1_ptr=s1, **scalars)


@functools.lru_cache(maxsize=1024)
def _launch_scalars(
    shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, elem: str, mode: str, dim0: bool, dim1: bool,
    k_first: bool,
) -> tuple[tuple[int, ...], dict]:  # fmt: skip
    """kernel_launch's grid and non-tensor arguments, which depend on x's shape, strides and element size only
    (memoized: 16 us of host time a call on an H200 host). Callers must not change the dict."""
    batched = len(shape) == 3
    num_batch, m, k = shape if batched else (1, *shape)
    stride_m, stride_k = strides[-2:]
    grid = tile_grid(m, k, BLOCK_M, BLOCK_K, 128)  # the grid covers the scales' padding too, to zero it
    m_cover, k_cover = grid[0] * BLOCK_M, grid[1] * BLOCK_K  # rows and columns the grid's tiles span
    span = max((m_cover - 1) * abs(stride_m) + (k_cover - 1) * abs(stride_k), m_cover * k_cover)
    s0_rows, s0_cols = blocked_shape(m, k // 32)
    s1_rows, s1_cols = blocked_shape(k, m // 32)
    x_bytes = num_batch * m * k * itemsize
    scalars = dict(
        M=m, K=k, stride_xm=stride_m, stride_xk=stride_k, S0_COLS=k // 32, S1_COLS=m // 32,
        stride_xb=strides[0] if batched else 0, stride_q0b=m * k if batched else 0,
        stride_s0b=s0_rows * s0_cols if batched else 0, stride_q1b=m * k if batched else 0,
        stride_s1b=s1_rows * s1_cols if batched else 0, **TILE, DIM0=dim0, DIM1=dim1, BATCHED=batched,
        EVEN=(m_cover, k_cover) == (m, k), OFFS64=span >= 2**31, K_FIRST=k_first,
        CONTIG=stride_k == 1 and (stride_m == k or m == 1),
        X_EVICT="evict_last" if dim0 and dim1 and x_bytes >= EVICT_LAST_MIN_BYTES else "", ELEM=elem,
        RCEIL=mode == "rceil", num_warps=TILE["NUM_WARPS"] * TILE["WARPS_M"],
    )  # fmt: skip
    if k_first:
        grid = grid[::-1]
    if grid[1] > 65535:  # CUDA's limit on a grid's y dimension
        along = "M" if k_first else "K"
        raise ValueError(f"Gluon cast of x {shape}: {grid[1]} tiles along {along}, more than a grid's 65535")
    if batched:
        if num_batch > 65535:  # and on its z dimension
            raise ValueError(f"Gluon cast of x {shape}: {num_batch} experts, more than a grid's 65535")
        grid = (*grid, num_batch)
    return grid, scalars


def compile_for_target(
    shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16, elem: str = "e4m3", mode: str = "floor",
    dim0: bool = True, dim1: bool = True, k_first: bool = True, arch: int = 90,
):  # fmt: skip
    """Compile the kernel for CUDA ``arch`` without a GPU (inspection and CPU tests): the CompiledKernel, with
    ``.asm["ttgir"]``, ``["ptx"]`` and ``["cubin"]``, its arguments specialized as a launch on a contiguous x
    of ``shape`` ([M, K], or [E, M, K]) would specialize them (16-divisible ints, stride 1)."""
    x = torch.empty(shape, dtype=dtype, device="meta")
    u8 = torch.empty(16, dtype=torch.uint8, device="meta")  # stands in for every output (dtype and alignment)
    _, kwargs = kernel_launch(x, (u8, u8, u8, u8), elem, mode, dim0, dim1, k_first)
    return compile_for_arch(_gluon_cast_kernel, kwargs, arch)


@functools.lru_cache(maxsize=64)
def _dim1_3d_k_first(index: int | None) -> bool:
    name = torch.cuda.get_device_name(index)
    return any(tag in name for tag in DIM1_3D_K_FIRST_DEVICES)


def _cast(
    x: torch.Tensor, elem: str, mode: str, blocked: bool, dim0: bool, dim1: bool, k_first: bool, op: str
) -> tuple[torch.Tensor, ...]:
    require_gpu(x, op)
    outs = (empty_outputs(x, elem, dim0_shapes(x.shape, True)) if dim0 else []) + (
        empty_outputs(x, elem, dim1_shapes(x.shape, True)) if dim1 else []
    )
    if x.numel():
        q0, s0, q1, s1 = outs * (2 if len(outs) == 2 else 1)  # a one-sided cast: its pair stands in for the other

        def build() -> tuple[tuple[int, ...], dict]:
            views = tuple(t.view(torch.uint8) for t in (q0, s0, q1, s1))
            return kernel_launch(x, views, elem, mode, dim0, dim1, k_first)

        key = (x.shape, x.stride(), x.dtype, elem, mode, dim0, dim1, k_first)
        _LAUNCHES.launch_keyed(key, build, x_ptr=x, q0_ptr=q0, s0_ptr=s0, q1_ptr=q1, s1_ptr=s1)
    if not blocked:  # [E, n] blocked -> [E, rows, cols] for 3D x, all experts in one launch
        m, k = x.shape[-2:]
        if dim0:
            outs[1] = plain_scales(outs[1], x, m, k // 32)
        if dim1:
            outs[-1] = plain_scales(outs[-1], x, k, m // 32)
    return tuple(outs)


def cast_dim0(x: torch.Tensor, elem: str, mode: str, blocked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] or [E, M, K] (bf16/fp32, K % 32 == 0) -> (qdata fp8 of x's shape, scales e8m0 [.., M, K/32], or
    blocked: 1D for 2D x, [E, blocked_numel(M, K/32)] for 3D): ``mx_kernels.mx.casts.cast_dim0``, bit for bit."""
    check_cast(x, elem, mode, ndims=(2, 3), qdim=-1, op="gluon cast_dim0")
    return _cast(x, elem, mode, blocked, dim0=True, dim1=False, k_first=True, op="gluon cast_dim0")


def cast_dim1(x: torch.Tensor, elem: str, mode: str, blocked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] or [E, M, K] (bf16/fp32, M % 32 == 0) -> (qdata [.., K, M] fp8, scales e8m0 [.., K, M/32], or
    blocked): ``mx_kernels.mx.casts.cast_dim1``, bit for bit; 3D x: each expert's [K, M] written directly.
    e2m1 (bf16): ``gluon_e2m1_casts.cast_dim1``."""
    if elem == "e2m1":
        return gluon_e2m1_casts.cast_dim1(x, mode, blocked)
    check_cast(x, elem, mode, ndims=(2, 3), qdim=-2, op="gluon cast_dim1")
    k_first = x.dim() == 3 and x.is_cuda and _dim1_3d_k_first(x.device.index)
    return _cast(x, elem, mode, blocked, dim0=False, dim1=True, k_first=k_first, op="gluon cast_dim1")


def cast_dim0_dim1(
    x: torch.Tensor, elem: str, mode: str, blocked: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp32, M and K multiples of 32) -> (q0 [M, K], s0, q1 [K, M], s1) from one read of x:
    ``mx_kernels.mx.casts.cast_dim0_dim1``, bit for bit."""
    check_cast(x, elem, mode, ndims=(2,), qdim=0, op="gluon cast_dim0_dim1")
    check_cast(x, elem, mode, ndims=(2,), qdim=1, op="gluon cast_dim0_dim1")
    return _cast(x, elem, mode, blocked, dim0=True, dim1=True, k_first=True, op="gluon cast_dim0_dim1")
