"""Triton MX casts along the last dim (dim0), the first (dim1, written transposed) or both from one read of x.

x [M, K] or [E, M, K] -> dim0: qdata of x's shape + scales [.., M, K/32]; dim1: qdata [.., K, M] + scales
[.., K, M/32], equal to ``to_mx(x.transpose(-2, -1).contiguous())`` without the transpose copy. 3D expert
weights take the same path per expert (grid axis 2), each expert's outputs written at its own base, so the
cost does not grow with E. The portable implementation: every CUDA GPU but Hopper, where the Gluon kernel of
``gluon_casts`` runs (docs/DESIGN.md, Kernel dispatch), and the Triton interpreter on the CPU (tests).

A program walks NUM_SUB sub-tiles of [32, BLOCK_K]: along K each row holds BLOCK_K / 32 blocks; along M each
column is one block, stored transposed (rows of the [K, M] output contiguous along M). The e2m1 casts of bf16 to
nearest read x as int32 words of two elements and take the whole [NUM_SUB * 32, BLOCK_K] tile at once (WORDS).
With ``blocked`` the scales go straight to the blocked layout; the grid then also covers the padding, whose bytes
it writes as zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from mx_kernels.common import (
    check_cast,
    check_stochastic,
    dim0_shapes,
    dim1_shapes,
    e2m1_reads_words,
    empty_outputs,
    software_round,
    tile_grid,
)
from mx_kernels.launch_cache import LaunchCache
from mx_kernels.quantize import (
    draws_tile,
    e2m1_words_along_k,
    e2m1_words_along_m,
    pack_pairs,
    pack_pairs_along_rows,
    quantize_blocks,
    store_scales,
    to_fp32,
)

# (NUM_SUB, BLOCK_K, num_warps). dim0: 32 x 512 with 8 warps, 2-3% faster than 32 x 256 with 4 warps on an
# H200 with blocked scales. dim1 and both: one warp per program, since Triton spreads warps along M and a
# 32-row block split across warps reduces through shared memory with barriers (40% of copy bandwidth on an
# H200); two 32-row sub-tiles store 2 contiguous scale bytes per row of [K, M/32] (one-byte scattered stores
# cost ~30%; 4 and 8 sub-tiles cost registers and occupancy).
DIM0_TILE = (1, 512, 8)
DIM1_TILE = (2, 64, 1)
# The e2m1 casts of bf16 read as words (H200, 16384 x 16384, % of copy). Along M, one warp over 64 x 128: each lane
# loads 8 bytes of every row (LANE_WORDS), so that it holds whole columns of both blocks and stores 32 contiguous
# bytes of each (81%; 128 x 64 with the columns moved through shared memory 71%, 32-row tiles and their 16-byte
# pieces 49-51%, the same two pieces of 32 rows in one program 48%, 64-row tiles in a loop of 2 to 8 spill, the fp32
# path 51%). Both from one read: 64 x 128 with 2 warps, the columns moved (59%, fp32 30%).
WORDS_DIM1_TILE = (2, 128, 1)
LANE_WORDS = 2
WORDS_FUSED_TILE = (2, 128, 2)
# Along K stochastically (DIM0_TILE, 8 warps), Philox's wide multiplies (``mx_quantize.philox``) take 88 registers, 2
# programs an SM; capped at 80 (a 16-byte spill), 3: 439.6 -> 378.3 us against 381.7 with tl.philox (H200, 16384^2)
STOCHASTIC_DIM0_MAX_REGISTERS = 80


@triton.jit
def _cast_kernel(
    x_ptr, q0_ptr, s0_ptr, q1_ptr, s1_ptr, seed_ptr, M, K, stride_xb, stride_xm, stride_xk, stride_qb, stride_s0b,
    stride_s1b, DIM0: tl.constexpr, DIM1: tl.constexpr, NUM_SUB: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCKED: tl.constexpr, ELEM: tl.constexpr, RCEIL: tl.constexpr, SOFTWARE_ROUND: tl.constexpr,
    STOCHASTIC: tl.constexpr, WORDS: tl.constexpr, LANE_WORDS: tl.constexpr,
):  # fmt: skip
    """WORDS: x_ptr is bf16 x read as int32 words (strides in words), cast to e2m1 to nearest without widening it
    (``mx_quantize.e2m1_words_along_k`` and ``e2m1_words_along_m``), the whole NUM_SUB * 32-row tile at once.
    LANE_WORDS (along M alone): the words each lane loads from a row, BLOCK_K / 2 over a warp's lanes, so that a
    thread holds whole columns as loaded; 0: the columns are moved into threads through shared memory."""
    tl.static_assert(not WORDS or not STOCHASTIC, "the word path rounds to nearest")
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)  # E * M * K can pass 2**31
    x_ptr += pid_b * stride_xb
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    s0_cols = pid_k * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    sub = tl.arange(0, NUM_SUB)
    s1_tile = tl.zeros((BLOCK_K, NUM_SUB), dtype=tl.uint8)
    seed = tl.load(seed_ptr) if STOCHASTIC else 0
    half_k = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)  # word columns, and byte columns along K
    if WORDS:
        rows = pid_m * NUM_SUB * 32 + tl.arange(0, NUM_SUB * 32)
        w_mask = (rows < M)[:, None] & (half_k < K // 2)[None, :]
        w_cols = half_k
        if LANE_WORDS:  # Triton lays a load out by its contiguity: LANE_WORDS words a lane, lanes along the row
            w_cols = tl.max_contiguous(tl.multiple_of(half_k, LANE_WORDS), LANE_WORDS)
        w = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + w_cols[None, :], mask=w_mask, other=0)
        if DIM0:
            q0, s0 = e2m1_words_along_k(w, RCEIL)
            tl.store(q0_ptr + pid_b * stride_qb + rows.to(tl.int64)[:, None] * (K // 2) + half_k[None, :], q0,
                     mask=w_mask)  # fmt: skip
            store_scales(s0_ptr + pid_b * stride_s0b, s0, rows, s0_cols, M, K >> 5, BLOCKED)
        if DIM1:  # row c of the [K, M / 2] output: NUM_SUB * 16 contiguous bytes of column c's codes
            q1, s1_tile = e2m1_words_along_m(w, RCEIL, LANE_WORDS == 0)
            half = pid_m * NUM_SUB * 16 + tl.arange(0, NUM_SUB * 16)
            q1_rows = cols.to(tl.int64) * (M // 2)
            half_end = M // 2
            if LANE_WORDS:  # M is a multiple of 32: so written, the offsets show whole 16-byte pieces (STG.128 for
                # STG.64: 1 point of copy on the H200). Not when fused (16 more barriers) or per group (registers)
                q1_rows = tl.multiple_of(q1_rows, 16)
                half_end = M >> 5 << 4
            tl.store(q1_ptr + pid_b * stride_qb + q1_rows[:, None] + half[None, :], q1,
                     mask=(cols < K)[:, None] & (half < half_end)[None, :])  # fmt: skip
    for i in tl.static_range(0 if WORDS else NUM_SUB):
        rows = (pid_m * NUM_SUB + i) * 32 + tl.arange(0, 32)
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        x_offs = rows.to(tl.int64)[:, None] * stride_xm + cols[None, :] * stride_xk
        x = to_fp32(tl.load(x_ptr + x_offs, mask=mask, other=0.0), SOFTWARE_ROUND)
        if DIM0:  # blocks of 32 along K: row-major [M, K] output, scales [M, K/32]
            u = 0.0
            if STOCHASTIC:  # each element by its row-major index in x (stream 0), as fake_quant_2d along K
                u = draws_tile(seed, 0, pid_b * M + rows, pid_k * BLOCK_K, K, 32, BLOCK_K, not SOFTWARE_ROUND)
                u = tl.reshape(u, (BLOCK_K, 32))
            q0, s0 = quantize_blocks(tl.reshape(x, (BLOCK_K, 32)), 1, ELEM, RCEIL, SOFTWARE_ROUND, u, STOCHASTIC)
            q0 = tl.reshape(q0, (32, BLOCK_K))
            if ELEM == "e2m1":  # two codes a byte along K: [M, K/2]
                q0_offs = pid_b * stride_qb + rows.to(tl.int64)[:, None] * (K // 2) + half_k[None, :]
                tl.store(q0_ptr + q0_offs, pack_pairs(q0), mask=(rows < M)[:, None] & (half_k < K // 2)[None, :])
            else:
                q0_offs = pid_b * stride_qb + rows.to(tl.int64)[:, None] * K + cols[None, :]
                tl.store(q0_ptr + q0_offs, q0, mask=mask)
            s0 = tl.reshape(s0, (32, BLOCK_K // 32))
            store_scales(s0_ptr + pid_b * stride_s0b, s0, rows, s0_cols, M, K >> 5, BLOCKED)
        if DIM1:  # one block of 32 along M per column: transposed [K, M] output, scales [K, M/32]
            u = 0.0
            if STOCHASTIC:  # each element by its row-major index in x (stream 1), as fake_quant_2d along M
                u = draws_tile(seed, 1, pid_b * M + rows, pid_k * BLOCK_K, K, 32, BLOCK_K, not SOFTWARE_ROUND)
            q1, s1 = quantize_blocks(x, 0, ELEM, RCEIL, SOFTWARE_ROUND, u, STOCHASTIC)
            if ELEM == "e2m1":  # two codes a byte along M: [K, M/2]
                half = (pid_m * NUM_SUB + i) * 16 + tl.arange(0, 16)
                q1_offs = pid_b * stride_qb + cols.to(tl.int64)[None, :] * (M // 2) + half[:, None]
                tl.store(
                    q1_ptr + q1_offs, pack_pairs_along_rows(q1), mask=(half < M // 2)[:, None] & (cols < K)[None, :]
                )
            else:
                tl.store(q1_ptr + pid_b * stride_qb + cols.to(tl.int64)[None, :] * M + rows[:, None], q1, mask=mask)
            s1_tile = tl.where(sub[None, :] == i, s1[:, None], s1_tile)
    if DIM1:
        store_scales(s1_ptr + pid_b * stride_s1b, s1_tile, cols, pid_m * NUM_SUB + sub, K, M >> 5, BLOCKED)


_LAUNCHES = LaunchCache(_cast_kernel)


def _cast(
    x: torch.Tensor, elem: str, mode: str, blocked: bool, dim0: bool, dim1: bool, op: str,
    seed: torch.Tensor | None = None,
) -> list[torch.Tensor]:  # fmt: skip
    """The outputs [q0, s0] + [q1, s1] of the halves asked for, from one launch over x [M, K] or [E, M, K].
    ``seed``: int64 [1] on x's device, e2m1 rounded stochastically (``common.check_stochastic``)."""
    check_stochastic(x, elem, seed, op)
    outs = (empty_outputs(x, elem, dim0_shapes(x.shape, blocked)) if dim0 else []) + (
        empty_outputs(x, elem, dim1_shapes(x.shape, blocked)) if dim1 else []
    )
    if not any(t.numel() for t in outs):
        return outs
    q0, s0, q1, s1 = outs * (1 if dim0 and dim1 else 2)  # a missing half: stand-ins
    software = software_round(x, op)
    stochastic = seed is not None
    # bf16 read as words of two: along K 90% of copy against 61% widened to fp32 (H200, 16384 x 16384), along M and
    # both at once above (the tiles). The word path (inline PTX: the GPU only) needs x's last dim contiguous and even.
    words = e2m1_reads_words(x, elem, software, stochastic)
    xw = x.view(torch.int32) if words else x

    def build() -> tuple[tuple[int, ...], dict]:
        x3 = xw if xw.dim() == 3 else xw.unsqueeze(0)
        num_batch, m, k = x.shape if x.dim() == 3 else (1, *x.shape)  # elements, also where x3 holds words
        num_sub, block_k, num_warps = DIM0_TILE
        if dim1:
            num_sub, block_k, num_warps = (WORDS_FUSED_TILE if dim0 else WORDS_DIM1_TILE) if words else DIM1_TILE
        grid = (*tile_grid(m, k, 32 * num_sub, block_k, 128 if blocked else 1), num_batch)
        u8 = [t.view(torch.uint8) for t in (q0, s0, q1, s1)]
        return grid, dict(
            x_ptr=x3, q0_ptr=u8[0], s0_ptr=u8[1], q1_ptr=u8[2], s1_ptr=u8[3], seed_ptr=seed if stochastic else x3,
            M=m, K=k, stride_xb=x3.stride(0), stride_xm=x3.stride(1), stride_xk=x3.stride(2),
            stride_qb=m * k // (2 if elem == "e2m1" else 1), stride_s0b=s0[0].numel() if x.dim() == 3 and dim0 else 0,
            stride_s1b=s1[0].numel() if x.dim() == 3 and dim1 else 0, DIM0=dim0, DIM1=dim1, NUM_SUB=num_sub,
            BLOCK_K=block_k, BLOCKED=blocked, ELEM=elem, RCEIL=mode == "rceil", SOFTWARE_ROUND=software,
            STOCHASTIC=stochastic, WORDS=words, LANE_WORDS=LANE_WORDS if words and dim1 and not dim0 else 0,
            num_warps=num_warps, **({"maxnreg": STOCHASTIC_DIM0_MAX_REGISTERS} if stochastic and dim0 else {}),
        )  # fmt: skip

    key = (x.shape, x.stride(), x.dtype, elem, mode, blocked, dim0, dim1, software, stochastic, words)
    _LAUNCHES.launch_keyed(
        key, build, x_ptr=xw, q0_ptr=q0, s0_ptr=s0, q1_ptr=q1, s1_ptr=s1, seed_ptr=seed if stochastic else x
    )
    return outs


def cast_dim0(
    x: torch.Tensor, elem: str, mode: str, blocked: bool = False, seed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] or [E, M, K] (bf16/fp32, any strides) -> (qdata fp8 of x's shape, scales e8m0 [.., M, K/32] or,
    with ``blocked``, blocked: 1D for 2D x, [E, padded] per expert). Bit-identical to ``to_mx(x, elem, mode)``.
    ``seed`` (e2m1): rounded stochastically, each element with the draw of its row-major index in x, stream 0
    (``mx_quantize.draws_tile``): the draws of ``fake_quant_2d`` along K."""
    check_cast(x, elem, mode, ndims=(2, 3), qdim=-1, op="cast_dim0", fp4=True)
    return tuple(_cast(x, elem, mode, blocked, True, False, "cast_dim0", seed))


def cast_dim1(
    x: torch.Tensor, elem: str, mode: str, blocked: bool = False, seed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] or [E, M, K] (bf16/fp32, any strides) -> (qdata [.., K, M] fp8, scales e8m0 [.., K, M/32] or
    blocked). Bit-identical to ``to_mx(x.transpose(-2, -1).contiguous(), elem, mode)``. ``seed`` (e2m1): rounded
    stochastically, each element with the draw of its row-major index in x, stream 1: the draws of
    ``fake_quant_2d`` along M."""
    check_cast(x, elem, mode, ndims=(2, 3), qdim=-2, op="cast_dim1", fp4=True)
    return tuple(_cast(x, elem, mode, blocked, False, True, "cast_dim1", seed))


def cast_dim0_dim1(
    x: torch.Tensor, elem: str, mode: str, blocked: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp32, any strides) -> (q0 [M, K], s0, q1 [K, M], s1) from one read of x, as ``cast_dim0``
    and ``cast_dim1``: every operand of the MX linear is needed in both orientations, and one read instead of two
    saves a third of the bytes. To nearest only: with both sides' draws its one-warp programs ran slower than
    the two stochastic casts apart."""
    check_cast(x, elem, mode, ndims=(2,), qdim=0, op="cast_dim0_dim1", fp4=True)
    check_cast(x, elem, mode, ndims=(2,), qdim=1, op="cast_dim0_dim1", fp4=True)
    return tuple(_cast(x, elem, mode, blocked, True, True, "cast_dim0_dim1"))
