"""Gluon kernel of the packed MXFP4 cast along M (``cast_dim1``, e2m1 to nearest) of bf16, 2D and per expert of 3D.

The Hopper implementation of ``cast_dim1`` for e2m1 (mx_recipe.ops.dispatch picks it for bf16 on compute capability
9.x): the outputs of the Triton word kernel (``triton_casts``), bit for bit. Along K and both ways at once the
Triton kernels stay (docs/DESIGN.md, Performance targets: the packed casts).

x is read as int32 words of two bf16 on the fp8 casts' tile (``gluon_casts``): 128 x 128 elements, 8 warps, each
thread 8 rows x 4 words. A block of 32 along M is a thread's 8 rows on 4 lanes, so each block, and the codes of rows
2i and 2i + 1 that share a byte, are in registers as loaded. The block maxima, the scaling and the rounding run on
packed bf16 pairs (``mx_quantize.e2m1_words_along_m``'s steps): a word's two columns at once. The codes then go
through shared memory so that each thread stores 16 contiguous bytes of a column and 4 lanes a column's 64 bytes
of the tile. Scales are written in the blocked layout, one 512-byte tile a program; plain scales are unblocked
after (``unblock_scales``), as the fp8 casts do.
"""

from __future__ import annotations

import functools

import torch
import triton.experimental.gluon.language as gl
from mx_kernels.common import check_cast, dim1_shapes, e2m1_reads_words, empty_outputs, tile_grid
from mx_kernels.gluon.common import (
    arange_along,
    compile_for_arch,
    linear,
    require_gpu,
    store_scale_tile,
    wide,
)
from mx_kernels.launch_cache import LaunchCache
from mx_kernels.mx.unblock_scales import plain_scales
from mx_kernels.quantize import WORD_CODES_PTX, bf16_block_scales, max_u16x2
from mx_kernels.spec import blocked_shape
from triton.experimental import gluon

BLOCK_M, BLOCK_K = 128, 128  # elements; a tile is [4 sub-tiles, 32 rows, 4 chunks, 16 words]
NUM_WARPS = gl.constexpr(8)


@gluon.jit
def _cast_dim1_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, S_COLS, stride_xb, stride_qb, stride_sb, BATCHED: gl.constexpr,
    EVEN: gl.constexpr, OFFS64: gl.constexpr, RCEIL: gl.constexpr,
):  # fmt: skip
    """x_ptr: x as int32 words (row stride stride_xm words); q_ptr: the codes [K, M / 2] as int32 words [K, M / 8];
    s_ptr: blocked scales. M and K count elements."""
    # [sub-tile, row, chunk, word]: a thread 8 rows x 4 words, lanes 4 along the words, 2 along the chunks, 4 along
    # the rows; warps 2 along the chunks, 4 along the sub-tiles
    L: gl.constexpr = gl.BlockedLayout([1, 8, 1, 4], [1, 4, 2, 4], [4, 1, 2, 1], [3, 2, 1, 0])
    # the codes [sub-tile, row lane, chunk, word, column of the word] for the stores: a thread 4 consecutive words of
    # a column, 4 lanes its 64 bytes of the tile, 8 lanes 8 columns
    Q: gl.constexpr = linear([4, 4, 4, 16, 2], [(1, 1), (1, 2), (3, 8)], [(0, 1), (0, 2), (4, 1), (3, 1), (3, 2)],
                             [(3, 4), (2, 1), (2, 2)])  # fmt: skip
    SB: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [NUM_WARPS, 1], [1, 0])  # a blocked scale tile
    pid_m = gl.program_id(0)
    pid_k = gl.program_id(1)
    m0 = pid_m * 4  # first 32-row block of this program
    if BATCHED:  # E * M * K can pass 2**31: the expert's bases are int64, the offsets inside it as OFFS64 says
        pid_b = gl.program_id(2).to(gl.int64)
        x_ptr += pid_b * stride_xb
        q_ptr += pid_b * stride_qb
        s_ptr += pid_b * stride_sb
    rows = (m0 + arange_along(4, 0, 4, L)) * 32 + arange_along(32, 1, 4, L)  # [4, 32, 1, 1]
    words = (pid_k * 4 + arange_along(4, 2, 4, L)) * 16 + arange_along(16, 3, 4, L)  # [1, 1, 4, 16]
    x_ptrs = x_ptr + wide(rows, OFFS64) * stride_xm + words
    if EVEN:
        w = gl.load(x_ptrs)
    else:
        w = gl.load(x_ptrs, mask=(rows < M) & (words < K // 2), other=0)

    # blocks of 32 along M (axis 1), a word's two columns at once
    m = gl.reduce(w & 0x7FFF7FFF, 1, max_u16x2)  # [4, 4, 16]: column 2j's max |x| in the low half, 2j + 1's high
    nan_lo, inv_lo, s_lo = bf16_block_scales(m & 0xFFFF, RCEIL)
    nan_hi, inv_hi, s_hi = bf16_block_scales(m >> 16, RCEIL)
    keep = gl.where(nan_lo, 0, 0xFFFF) | gl.where(nan_hi, 0, -65536)  # a NaN block's codes are 0
    codes = gl.inline_asm_elementwise(WORD_CODES_PTX, "=r,r,r", [w, gl.expand_dims(inv_lo | (inv_hi << 16), 1)],
                                      dtype=gl.int32, is_pure=True, pack=1)  # fmt: skip
    codes = codes & gl.expand_dims(keep, 1)
    # rows 2i and 2i + 1 meet in one byte per column: rows [4 lanes, 4 pairs, 2] of a thread's 8
    even, odd = gl.split(gl.permute(gl.reshape(codes, [4, 4, 4, 2, 4, 16]), [0, 1, 2, 4, 5, 3]))
    pairs = even | (odd << 4)  # [4, 4, 4 pairs, 4, 16]: column 2j's byte in bits 0-7, 2j + 1's in bits 16-23
    # a thread's 4 pairs of a column -> one word of 4 bytes: pairs 2a and 2a + 1 side by side, then a = 0 and 1
    p0, p1 = gl.split(gl.permute(gl.reshape(pairs, [4, 4, 2, 2, 4, 16]), [0, 1, 2, 4, 5, 3]))
    t = p0 | (p1 << 8)  # [4, 4, 2, 4, 16]: column 2j's two bytes in bits 0-15, 2j + 1's in bits 16-31
    t0, t1 = gl.split(gl.permute(t, [0, 1, 3, 4, 2]))
    q = gl.join((t0 & 0xFFFF) | (t1 << 16), ((t0 >> 16) & 0xFFFF) | (t1 & -65536))
    # [4 sub, 4 row lanes, 4 chunks, 16 words, 2]: word sub * 4 + lane of the tile's 16 in column 2 * word + last
    # index. Through shared memory into Q: 16-byte stores of whole 64-byte pieces (along M H200 61.5% -> 92.7% of
    # copy, 16384 x 16384, blocked scales)
    q = gl.convert_layout(q, Q)
    sub = arange_along(4, 0, 5, Q)
    lane = arange_along(4, 1, 5, Q)
    cols = ((pid_k * 4 + arange_along(4, 2, 5, Q)) * 16 + arange_along(16, 3, 5, Q)) * 2 + arange_along(2, 4, 5, Q)
    q_ptrs = q_ptr + wide(cols, OFFS64) * gl.multiple_of(M // 8, 4) + (m0 + sub) * 4 + lane  # M % 32 == 0
    if EVEN:
        gl.store(q_ptrs, q)
    else:
        gl.store(q_ptrs, q, mask=((m0 + sub) * 32 < M) & (cols < K))
    # [4 sub, 4 chunks, 16 words, 2] -> [4 sub, 4 chunks, 32 columns] -> [32, chunk * 4 + sub]
    s = gl.reshape(gl.join(s_lo, s_hi), [4, 4, 32])
    s = gl.convert_layout(gl.reshape(gl.permute(s, [2, 1, 0]), [32, 16]), SB)
    store_scale_tile(s_ptr, s, pid_k, pid_m, K, S_COLS, EVEN)


_LAUNCHES = LaunchCache(_cast_dim1_kernel)


def kernel_launch(
    x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, mode: str
) -> tuple[tuple[int, ...], dict]:  # fmt: skip
    """(grid, keyword arguments) of one launch on bf16 x [M, K] or [E, M, K] (expert = grid axis 2): q the codes as
    int32 words, s the blocked scales as bytes. Also used to compile the kernel on the CPU (``compile_for_target``)."""
    grid, scalars = _launch_scalars(tuple(x.shape), x.stride(), mode)
    return grid, dict(x_ptr=x.view(torch.int32), q_ptr=q, s_ptr=s, **scalars)


@functools.lru_cache(maxsize=1024)
def _launch_scalars(shape: tuple[int, ...], strides: tuple[int, ...], mode: str) -> tuple[tuple[int, ...], dict]:
    """kernel_launch's grid and non-tensor arguments, which depend on x's shape and strides only (memoized; callers
    must not change the dict)."""
    batched = len(shape) == 3
    num_batch, m, k = shape if batched else (1, *shape)
    grid = tile_grid(m, k, BLOCK_M, BLOCK_K, 128)  # the grid covers the scales' padding too, to zero it
    m_cover, k_cover = grid[0] * BLOCK_M, grid[1] * BLOCK_K
    span = max((m_cover - 1) * abs(strides[-2]) + k_cover, m_cover * k_cover)
    s_rows, s_cols = blocked_shape(k, m // 32)
    scalars = dict(
        M=m, K=k, stride_xm=strides[-2] // 2, S_COLS=m // 32, stride_xb=strides[0] // 2 if batched else 0,
        stride_qb=m * k // 8 if batched else 0, stride_sb=s_rows * s_cols if batched else 0, BATCHED=batched,
        EVEN=(m_cover, k_cover) == (m, k), OFFS64=span >= 2**31, RCEIL=mode == "rceil", num_warps=NUM_WARPS.value,
    )  # fmt: skip
    if grid[1] > 65535:  # CUDA's limits on a grid's y and z dimensions
        raise ValueError(f"Gluon e2m1 cast_dim1 of x {shape}: {grid[1]} tiles along K, more than a grid's 65535")
    if batched:
        if num_batch > 65535:
            raise ValueError(f"Gluon e2m1 cast_dim1 of x {shape}: {num_batch} experts, more than a grid's 65535")
        grid = (*grid, num_batch)
    return grid, scalars


def compile_for_target(shape: tuple[int, ...], mode: str = "floor", arch: int = 90):
    """Compile the kernel for CUDA ``arch`` without a GPU (inspection and CPU tests), specialized as a launch on a
    contiguous bf16 x of ``shape`` ([M, K] or [E, M, K]) would be: the CompiledKernel."""
    x = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    q, s = torch.empty(4, dtype=torch.int32, device="meta"), torch.empty(16, dtype=torch.uint8, device="meta")
    _, kwargs = kernel_launch(x, q, s, mode)
    return compile_for_arch(_cast_dim1_kernel, kwargs, arch)


def takes(x: torch.Tensor) -> bool:
    """Whether this kernel casts x: bf16 whose words of two elements never straddle a row (the Triton kernel takes
    any other x)."""
    return e2m1_reads_words(x, "e2m1", False, False)


def cast_dim1(x: torch.Tensor, mode: str, blocked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 x [M, K] or [E, M, K] (M % 32 == 0, ``takes(x)``) -> (codes uint8 [.., K, M / 2], scales e8m0 [.., K,
    M / 32] or blocked): ``triton_casts.cast_dim1`` for e2m1 to nearest, bit for bit; 3D x: each expert's [K, M / 2]
    written directly."""
    op = "gluon e2m1 cast_dim1"
    check_cast(x, "e2m1", mode, ndims=(2, 3), qdim=-2, op=op, fp4=True)
    require_gpu(x, op)
    if not takes(x):
        raise ValueError(f"{op}: x must be bf16 with its last dim contiguous and even, at even offsets and strides; "
                         f"got {x.dtype} {tuple(x.shape)} strides {x.stride()}")  # fmt: skip
    q, s = empty_outputs(x, "e2m1", dim1_shapes(x.shape, True))
    if x.numel():
        words = q.view(torch.int32)
        _LAUNCHES.launch_keyed(
            (x.shape, x.stride(), mode), lambda: kernel_launch(x, words, s.view(torch.uint8), mode), x_ptr=x,
            q_ptr=words, s_ptr=s,
        )  # fmt: skip
    m, k = x.shape[-2:]
    return q, s if blocked else plain_scales(s, x, k, m // 32)  # 3D x: [E, n] blocked -> [E, K, M / 32], one launch
