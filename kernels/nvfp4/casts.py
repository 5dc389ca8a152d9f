"""NVFP4 fake-quant along K and/or along M in one read of x: the operands of the emulated NVFP4 GEMMs.

``mx_recipe.formats.nvfp4.nvfp4_operand`` is the contract: each output is e2m1 * float(e4m3 block scale) in x's
dtype (exact), the per-tensor decode scale s_dec left for the GEMM's output. Two kernels:

* ``_amax_kernel`` reduces max|x| (for along K) and max|RHT(x)| (for along M, after the random Hadamard
  transform along M when it is asked for) into two fp32 words by integer atomic max of their bits
  (non-negative floats order like their bits, and a NaN sorts above inf, so NaN wins as in the reference).
  Its last program to finish (an arrival counter) derives each side's per-tensor scales from them with
  correctly rounded divisions (``div_rn``: Triton's ``/`` is approximate) and writes them: once a call,
  instead of in every thread of the next kernel (four divisions a thread, a tenth of its instructions);
* ``_fake_quant_kernel`` quantizes its tile in blocks of 16 along K (or in 16x16 tiles, the recipe's
  weights) and in blocks of 16 along M, as the reference does, step for step in fp32.

Along M, rows past M read as zeros and the result has ceil(M / 16) * 16 rows (the zero-padded operand the
grad-weight GEMM uses), in x's layout (a bf16 GEMM takes it transposed for free).

``fake_quant_nvfp4_groups`` is the same pair over MoE token groups (GATHER): the kernels walk the rows of the
groups padded to multiples of 16, each reading the row of x that ``row_src`` names (none for a padding row,
nor for a row at or past the groups' end), so that along K comes back in x's rows and along M in the padded
groups, and no block, nor the transform, straddles two experts, with no padded copy of x.

``cast_nvfp4`` is the same pair of kernels writing the packed operands of the sm_100 GEMM instead
(``PACKED``): e2m1 codes two a byte and the e4m3 scale bits, along K row-major and along M transposed
([K, M_pad / 2], rows padded to 16 or 32), bit for bit ``to_nvfp4``.

Stochastic rounding draws from Philox4x32-10 keyed by a 64-bit seed read from device memory (so a
captured or compiled step draws a new one each time without a host sync), one call for eight elements,
each taking half of output word j div 2 for its place j in the eight (the high 16 bits for even j, the low
for odd j) as a 16-bit draw (``mx_quantize.round_e2m1`` adds it below the kept mantissa bit). Along K
(stream 0) the eight are consecutive in a row: element i of x (row-major index r * K + c) is place i mod 8
at counter (i div 8, i's high word, 0, 0). Along M (stream 1) they are consecutive in a column: element
(r, c) is place r mod 8 at counter (r div 8, c, 1, 0). Along M each thread holds columns of whole blocks,
after the Hadamard transform or after the same data movement without it (``blocks_along_m``), so the draws
are made in the thread that uses them and never move between threads.
``mx_recipe.formats.philox.philox_uniform`` is the same stream in PyTorch (``along_rows`` for along M), which the
tests hand to the reference as its ``uniform``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from mx_kernels.common import check_nvfp4, interpreting, software_round
from mx_kernels.launch_cache import LaunchCache
from mx_kernels.quantize import (
    bf16_bits_rne,
    block_amax_bits,
    butterfly_stage,
    column_blocks,
    draws_tile,
    draws_tile_along_rows,
    fp8_bits_to_fp32,
    max_abs,
    pack_pairs,
    pack_pairs_along_rows,
    round_e2m1,
    round_e2m1_codes,
    round_to_fp8_bits,
    tile_rows,
    to_fp32,
)
from mx_kernels.spec import NVFP4_BLOCK as BLOCK
from mx_kernels.spec import cdiv
from triton.language.extra import libdevice

TILE = (32, 128, 4)  # (BLOCK_M, BLOCK_K, num_warps)
AMAX_PROGRAMS = 1024  # about 8 per SM: the maximum kernel folds tiles until its grid is down to this
AMAX_MAX_ROW_TILES = 32
AMAX_PLAIN_WARPS = 8  # the maximum of x alone: 89% of copy on the H200 against 79% with 4 (more loads in flight)
# The fold unrolled (H200): x alone 3.72 -> 3.99 TB/s at 16384 x 16384, 3.0 -> 3.7 at 16384 x 8192, 2.2 -> 2.6 at
# 16384 x 2048. With the transform it stays a loop: unrolled, the tiles below spill registers.
# With the transform, one warp over 16 x 256: each thread loads all 16 rows of its 8 columns (16-byte loads), so the
# butterflies and the maxima stay in its registers. On TILE the rows lie across threads and each tile went through
# shared memory (4 barriers a tile): 13.0 SASS instructions an element and 70% of copy on the H200 at 16384 x 16384,
# against 8.6 and 91%.
AMAX_HADAMARD_TILE = (16, 256, 1)
# Along M alone to nearest (a 1x16-block weight along N, a gradient rounded to nearest), one warp over 16 x 128:
# each lane loads 4 columns of every row (ALONG_M_LANE_COLS), so that it holds whole blocks along M as loaded and the
# transform's butterflies need no shared memory. x along M with the transform, H200, 16384 x 16384: 86.6% of copy
# against 82.3% on TILE. Along K too the blocks of 16 span 4 lanes (shuffles), and so slower (73% against 82%), as
# was stochastic rounding (43% against 57%).
ALONG_M_TILE = (16, 128, 1)
ALONG_M_LANE_COLS = 4
# Along K and M to nearest, on TILE: at most 80 registers, 6 programs of 4 warps an SM instead of 5 (ptxas takes 84
# with the transform, 96 packed, and fits 80 without spills). H200, x along K and M with the transform: 83.5% -> 86.3%
# of copy in a same-run A/B (2 spilled registers without the transform: 88.2% -> 90.5%).
BOTH_SIDES_MAX_REGISTERS = 80
FP32_MAX = tl.constexpr(3.4028234663852886e38)
ONE_SIXTH = tl.constexpr(0.16666667163372040)  # fl(1/6), exact as an fp32 constant
TWO_TO_64, TWO_TO_MINUS_64 = tl.constexpr(2.0**64), tl.constexpr(2.0**-64)
EMPTY_S_DEC = 1 / 3.4028234663852886e38  # an empty tensor's amax is 0: s_enc is the fp32 max
# The int32 scratch of a call: the maxima's bits [0:2] (along K, along M) and the maxima kernel's arrival counter [2],
# zero when a call starts, then the fp32 bits its last program writes: s_enc [4:6] and s_dec [6:8], along K and along
# M. That program zeroes [0:3] again once it has read them, so one scratch per stream serves every call (``_scratch``).
COUNTER, S_ENC, S_DEC = tl.constexpr(2), tl.constexpr(4), tl.constexpr(6)
SCRATCH = 8


@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def blocks_along_m(
    x, signs, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HADAMARD: tl.constexpr, SCALED: tl.constexpr = True
):  # fmt: skip
    """x [BLOCK_M, BLOCK_K] fp32 -> its blocks of 16 rows, [BLOCK_M // 16, 16, BLOCK_K]. HADAMARD: each block v
    becomes v @ diag(signs) H16 / 4 (``mx_recipe.formats.nvfp4.hadamard_transform`` along M, the same fp32 operations;
    not SCALED, without the final / 4: exact, and monotonic where it rounds, so a maximum can take it last).
    Without it the values only travel the butterflies' paths (``column_blocks``): either way each thread ends
    up holding columns of whole blocks, so the blocks' maxima need no shuffles and the draws along rows stay in
    their thread."""
    if HADAMARD:
        v = tl.reshape(x, (BLOCK_M // 16, 16, BLOCK_K)) * signs[None, :, None]
        v = butterfly_stage(v, 1, True)
        v = butterfly_stage(v, 2, True)
        v = butterfly_stage(v, 4, True)
        v = butterfly_stage(v, 8, True)
        if SCALED:
            v = v * 0.25
    else:
        v = column_blocks(x, 16)
    return v


@triton.jit
def group_rows(rows, src_ptr, end_ptr, M, GATHER: tl.constexpr):
    """``mx_quantize.tile_rows``, and under GATHER a row of x at or past the groups' end (``end_ptr``: offs[-1])
    holds no data either: it belongs to no expert, so it reaches no per-tensor maximum."""
    x_rows, has_data = tile_rows(rows, src_ptr, M, GATHER)
    if GATHER:
        has_data = has_data & (x_rows < tl.load(end_ptr))
    return x_rows, has_data


@triton.jit
def per_tensor_scales(tensor_amax):
    """(s_enc, s_dec) from the tensor's max|x|: ``nvfp4.per_tensor_scales``, correctly rounded divisions."""
    s_enc = _min_nan(tl.math.div_rn(2688.0, tensor_amax), FP32_MAX)  # 448 * 6
    s_enc = tl.where(s_enc == 0.0, 1.0, s_enc)  # amax = inf
    return s_enc, tl.math.div_rn(1.0, s_enc)


@triton.jit
def _reciprocal(y, SOFTWARE_ROUND: tl.constexpr):
    """fl(1 / y), correctly rounded, for y in [0, 2**126) or NaN (a block scale times s_dec: below 448 * 2**117).
    libdevice's reciprocal (rcp.rn.ftz: no subnormal path, 12 registers fewer than div_rn in the K + M cast)
    flushes a subnormal y to 0, and y can come out subnormal once the tensor's maximum is below about 2**-105
    (s_dec below 2**-116, a small block's scale down to 2**-9); so a y under 2**-64 goes in times 2**64 and its
    reciprocal comes out times 2**64, exact both ways (a power of two, no result subnormal, an overflow where
    1 / y overflows too)."""
    if SOFTWARE_ROUND:
        return tl.math.div_rn(1.0, y)
    scale = tl.where(y < TWO_TO_MINUS_64, TWO_TO_64, 1.0)
    return libdevice.rcp_rn(y * scale) * scale


@triton.jit
def _write_scales(scratch_ptr, s_dec_ptr, amax_bits, SIDE: tl.constexpr):
    """Side SIDE's (0: along K, 1: along M) per-tensor scales from the bits of its final maximum: s_enc and
    s_dec into the scratch, and s_dec for the GEMM."""
    s_enc, s_dec = per_tensor_scales(amax_bits.to(tl.float32, bitcast=True))
    tl.store(scratch_ptr + S_ENC + SIDE, s_enc.to(tl.int32, bitcast=True))
    tl.store(scratch_ptr + S_DEC + SIDE, s_dec.to(tl.int32, bitcast=True))
    tl.store(s_dec_ptr + SIDE, s_dec)


@triton.jit
def quantize_nvfp4_blocks(
    v, block_amax, scales_ptr, u, STOCHASTIC: tl.constexpr, SOFTWARE_ROUND: tl.constexpr, CODES: tl.constexpr = False
):  # fmt: skip
    """fp32 values v, each block's max|.| ``block_amax`` (broadcast to v), the tensor's s_enc and s_dec at
    ``scales_ptr`` and ``scales_ptr + S_DEC - S_ENC`` (the scratch's, as int32 bits) ->
    (e2m1 values in fp32, or under CODES their 4-bit codes, v's shape, something in NaN blocks; e4m3 block scale
    bits, 0x7F for NaN blocks; float(block scale), NaN for NaN blocks): ``nvfp4._quantize`` with two-level
    scales."""
    s_enc = tl.load(scales_ptr).to(tl.float32, bitcast=True)
    s_dec = tl.load(scales_ptr + (S_DEC - S_ENC)).to(tl.float32, bitcast=True)
    d = _min_nan(_min_nan(block_amax * (s_enc * ONE_SIXTH), FP32_MAX), 448.0)  # d >= 0 or NaN
    if SOFTWARE_ROUND:
        s_bits = round_to_fp8_bits(tl.where(d == d, d, 0.0), "e4m3")
    else:
        s_bits = d.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    s = tl.where(d == d, fp8_bits_to_fp32(s_bits, "e4m3", SOFTWARE_ROUND), float("nan"))
    encode = _min_nan(_reciprocal(s * s_dec, SOFTWARE_ROUND), FP32_MAX)
    q = round_e2m1_codes(v * encode, u, STOCHASTIC) if CODES else round_e2m1(v * encode, u, STOCHASTIC)
    return q, tl.where(d == d, s_bits, 0x7F).to(tl.uint8), s


@triton.jit
def _fold_tile(
    plain, transformed, i, x_ptr, signs, src_ptr, end_ptr, cols, M, K, stride_xm, stride_xk,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ROW_TILES: tl.constexpr, HADAMARD: tl.constexpr,
    GATHER: tl.constexpr, SOFTWARE_ROUND: tl.constexpr,
):  # fmt: skip
    """Tile i of this program's strip folded into the elementwise maxima of |x| and, HADAMARD, |RHT_M(x)| * 4."""
    rows = (tl.program_id(0) * ROW_TILES + i) * BLOCK_M + tl.arange(0, BLOCK_M)
    x_rows, has_data = group_rows(rows, src_ptr, end_ptr, M, GATHER)
    in_x = has_data[:, None] & (cols < K)[None, :]
    x = to_fp32(tl.load(x_ptr + x_rows[:, None] * stride_xm + cols[None, :] * stride_xk,
                        mask=in_x, other=0.0), SOFTWARE_ROUND)  # fmt: skip
    if HADAMARD:  # on AMAX_HADAMARD_TILE a column's maxima are its thread's; the / 4 once, at the end
        plain = max_abs(plain, block_amax_bits(x, 0, SOFTWARE_ROUND).to(tl.float32, bitcast=True))
        h = tl.reshape(blocks_along_m(x, signs, BLOCK_M, BLOCK_K, True, False), (BLOCK_M, BLOCK_K))
        transformed = max_abs(transformed, block_amax_bits(h, 0, SOFTWARE_ROUND).to(tl.float32, bitcast=True))
    else:
        plain = max_abs(plain, x)
    return plain, transformed


@triton.jit
def _amax_kernel(
    x_ptr, amax_ptr, signs_ptr, src_ptr, end_ptr, s_dec_ptr, M, K, stride_xm, stride_xk,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ROW_TILES: tl.constexpr, HADAMARD: tl.constexpr,
    GATHER: tl.constexpr, SOFTWARE_ROUND: tl.constexpr,
):  # fmt: skip
    """amax_ptr: the scratch (SCRATCH int32, [0:3] zero): [0] = bits of max|x|, [1] = bits of max|RHT_M(x)|
    (HADAMARD) or of max|x| again; the last program to count itself in takes them and the count, leaving zeros
    for the next call, and writes the scales (``_write_scales``).
    Each program folds ROW_TILES tiles down a column strip into an elementwise maximum, reduces it once and
    adds it with one atomic per word (one atomic per tile was a queue on two addresses); with the transform the
    fold keeps a maximum per column. Without it the fold is unrolled, so that the tiles' loads are in flight
    together (a loop waits for each in turn); with it, it is a loop (unrolled, its tiles spill)."""
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    plain = tl.zeros((BLOCK_K,) if HADAMARD else (BLOCK_M, BLOCK_K), tl.float32)
    transformed = tl.zeros((BLOCK_K,), tl.float32)
    signs = tl.load(signs_ptr + tl.arange(0, 16)) if HADAMARD else 0.0
    if not HADAMARD:
        for i in tl.static_range(ROW_TILES):
            plain, transformed = _fold_tile(plain, transformed, i, x_ptr, signs, src_ptr, end_ptr, cols, M, K,
                                            stride_xm, stride_xk, BLOCK_M, BLOCK_K, ROW_TILES, HADAMARD, GATHER,
                                            SOFTWARE_ROUND)  # fmt: skip
    else:
        for i in range(ROW_TILES):
            plain, transformed = _fold_tile(plain, transformed, i, x_ptr, signs, src_ptr, end_ptr, cols, M, K,
                                            stride_xm, stride_xk, BLOCK_M, BLOCK_K, ROW_TILES, HADAMARD, GATHER,
                                            SOFTWARE_ROUND)  # fmt: skip
    plain_bits = block_amax_bits(tl.reshape(plain, (plain.numel,)), 0, SOFTWARE_ROUND)
    tl.atomic_max(amax_ptr, plain_bits, sem="relaxed")
    if HADAMARD:
        transformed = transformed * 0.25
        tl.atomic_max(amax_ptr + 1, block_amax_bits(transformed, 0, SOFTWARE_ROUND), sem="relaxed")
    else:
        tl.atomic_max(amax_ptr + 1, plain_bits, sem="relaxed")
    # acq_rel, from the thread that added the maxima (relaxed: the release orders them, and they need not wait
    # for each other): the program that counts last sees every program's maxima
    arrived = tl.atomic_add(amax_ptr + COUNTER, 1)
    if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:  # take the maxima where they went, both at once
        amax_k = tl.atomic_xchg(amax_ptr, 0, sem="relaxed")
        amax_m = tl.atomic_xchg(amax_ptr + 1, 0, sem="relaxed")
        tl.atomic_xchg(amax_ptr + COUNTER, 0, sem="relaxed")
        _write_scales(amax_ptr, s_dec_ptr, amax_k, 0)
        _write_scales(amax_ptr, s_dec_ptr, amax_m, 1)


@triton.jit
def _fake_quant_kernel(
    x_ptr, amax_ptr, signs_ptr, seed_ptr, src_ptr, end_ptr, k_ptr, m_ptr, k_scale_ptr, m_scale_ptr, M, M_PAD, K,
    stride_xm, stride_xk,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ALONG_K: tl.constexpr, ALONG_M: tl.constexpr,
    TILES: tl.constexpr, HADAMARD: tl.constexpr, STOCHASTIC: tl.constexpr, PACKED: tl.constexpr,
    GATHER: tl.constexpr, SOFTWARE_ROUND: tl.constexpr, OUT_BF16_BITS: tl.constexpr, LANE_COLS: tl.constexpr,
):  # fmt: skip
    """The fake-quant (e2m1 * block scale in x's dtype) or, PACKED, the cast: along K, codes [M, K / 2] and
    e4m3 scale bits [M, K / 16]; along M, transposed, codes [K, M_PAD / 2] and scale bits [K, M_PAD / 16].
    GATHER (fake-quant only): M = M_PAD rows of padded token groups (``group_rows``); along K goes to x's rows.
    amax_ptr: the scratch the maxima kernel filled (each side's per-tensor scales)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    x_rows, has_data = group_rows(rows, src_ptr, end_ptr, M, GATHER)
    in_x = has_data[:, None] & (cols < K)[None, :]
    x_cols = cols
    if LANE_COLS:  # Triton lays a load out by its contiguity: LANE_COLS columns a lane, lanes along the row
        x_cols = tl.max_contiguous(tl.multiple_of(cols, LANE_COLS), LANE_COLS)
    x = to_fp32(tl.load(x_ptr + x_rows[:, None] * stride_xm + x_cols[None, :] * stride_xk, mask=in_x,
                        other=0.0), SOFTWARE_ROUND)  # fmt: skip
    seed = tl.load(seed_ptr) if STOCHASTIC else 0
    if ALONG_K:  # in x's rows: each element draws by its index in the [M, K] output
        u = 0.0
        if STOCHASTIC:
            u = draws_tile(seed, 0, x_rows, tl.program_id(1) * BLOCK_K, K, BLOCK_M, BLOCK_K, not SOFTWARE_ROUND)
        if TILES:  # one scale per 16 x 16 tile: [BM / 16, 16, BK / 16, 16]
            v = tl.reshape(x, (BLOCK_M // 16, 16, BLOCK_K // 16, 16))
            b = tl.max(block_amax_bits(v, 3, SOFTWARE_ROUND), axis=1)  # bits order like values: max of maxima
            b = b.to(tl.float32, bitcast=True)[:, None, :, None]
            u = tl.reshape(u, (BLOCK_M // 16, 16, BLOCK_K // 16, 16)) if STOCHASTIC else u
        else:
            v = tl.reshape(x, (BLOCK_M * BLOCK_K // 16, 16))
            b = block_amax_bits(v, 1, SOFTWARE_ROUND).to(tl.float32, bitcast=True)[:, None]
            u = tl.reshape(u, (BLOCK_M * BLOCK_K // 16, 16)) if STOCHASTIC else u
        q, s_bits, s = quantize_nvfp4_blocks(v, b, amax_ptr + S_ENC, u, STOCHASTIC, SOFTWARE_ROUND, PACKED)
        if PACKED:  # row-major codes; one scale per row and block of 16 (a tile's repeated over its rows)
            pairs = pack_pairs(tl.reshape(tl.where(s == s, q, 0), (BLOCK_M, BLOCK_K)))
            pair_cols = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
            tl.store(k_ptr + rows.to(tl.int64)[:, None] * (K // 2) + pair_cols[None, :], pairs,
                     mask=(rows < M)[:, None] & (pair_cols < K // 2)[None, :])  # fmt: skip
            if TILES:
                s_bits = tl.broadcast_to(s_bits, (BLOCK_M // 16, 16, BLOCK_K // 16, 1))
            block_cols = tl.program_id(1) * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
            tl.store(k_scale_ptr + rows.to(tl.int64)[:, None] * (K // 16) + block_cols[None, :],
                     tl.reshape(s_bits, (BLOCK_M, BLOCK_K // 16)),
                     mask=(rows < M)[:, None] & (block_cols < K // 16)[None, :])  # fmt: skip
        else:
            q = tl.reshape(q * s, (BLOCK_M, BLOCK_K))
            if OUT_BF16_BITS:
                q = bf16_bits_rne(q)
            tl.store(k_ptr + x_rows[:, None] * K + cols[None, :], q, mask=in_x)
    if ALONG_M:  # blocks of 16 rows: [BM / 16, 16, BK], reduced over the middle dim
        signs = tl.load(signs_ptr + tl.arange(0, 16)) if HADAMARD else 0.0
        v = blocks_along_m(x, signs, BLOCK_M, BLOCK_K, HADAMARD)
        b = block_amax_bits(v, 1, SOFTWARE_ROUND).to(tl.float32, bitcast=True)[:, None, :]
        u = 0.0
        if STOCHASTIC:  # each thread holds columns: eight of a column's rows to a Philox call
            u = draws_tile_along_rows(seed, 1, tl.program_id(0) * BLOCK_M, cols, BLOCK_M, BLOCK_K, not SOFTWARE_ROUND)
            u = tl.reshape(u, (BLOCK_M // 16, 16, BLOCK_K))
        q, s_bits, s = quantize_nvfp4_blocks(v, b, amax_ptr + S_ENC + 1, u, STOCHASTIC, SOFTWARE_ROUND, PACKED)
        if PACKED:  # stored transposed: row c of the output holds column c's codes, paired along M
            codes = tl.reshape(tl.where(s == s, q, 0), (BLOCK_M, BLOCK_K))
            pairs = tl.trans(pack_pairs_along_rows(codes))
            pair_rows = tl.program_id(0) * (BLOCK_M // 2) + tl.arange(0, BLOCK_M // 2)
            tl.store(m_ptr + cols.to(tl.int64)[:, None] * (M_PAD // 2) + pair_rows[None, :], pairs,
                     mask=(cols < K)[:, None] & (pair_rows < M_PAD // 2)[None, :])  # fmt: skip
            block_rows = tl.program_id(0) * (BLOCK_M // 16) + tl.arange(0, BLOCK_M // 16)
            tl.store(m_scale_ptr + cols.to(tl.int64)[:, None] * (M_PAD // 16) + block_rows[None, :],
                     tl.trans(tl.reshape(s_bits, (BLOCK_M // 16, BLOCK_K))),
                     mask=(cols < K)[:, None] & (block_rows < M_PAD // 16)[None, :])  # fmt: skip
        else:
            q = tl.reshape(q * s, (BLOCK_M, BLOCK_K))
            if OUT_BF16_BITS:
                q = bf16_bits_rne(q)
            tl.store(m_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], q,
                     mask=(rows < M_PAD)[:, None] & (cols < K)[None, :])  # fmt: skip


_AMAX = LaunchCache(_amax_kernel)
_FAKE_QUANT = LaunchCache(_fake_quant_kernel)


def fake_quant_nvfp4(
    x: torch.Tensor, along_k: bool, along_m: bool, tiles: bool, signs: torch.Tensor | None, seed: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16; any strides; K a multiple of 16, M too with ``tiles``) -> (along K [M, K], along M
    [ceil16(M), K], s_dec fp32 [2]): NVFP4 operands e2m1 * block scale in x's dtype and the decode scales of
    the per-tensor maxima they were scaled by (max|x|, and max|RHT_M(x)| or max|x| for along M). ``tiles``: 16x16 scale
    tiles along K; ``signs``: fp32 [16], the random Hadamard transform along M before quantizing along M;
    ``seed``: int64 [1] on x's device for stochastic rounding, None to round to nearest. An output not asked
    for is empty. Bit for bit ``mx_recipe.formats.nvfp4`` (module docstring)."""
    check_nvfp4(x, along_k, along_m, tiles)
    m, k = x.shape
    m_pad = cdiv(m, BLOCK) * BLOCK
    out_k = x.new_empty((m, k) if along_k else (0,))
    out_m = x.new_empty((m_pad, k) if along_m else (0,))
    s_dec = _launch(x, along_k, along_m, tiles, signs, seed, (out_k, out_m, None, None), m_pad, "fake_quant_nvfp4")
    return out_k, out_m, s_dec


def fake_quant_nvfp4_groups(
    x: torch.Tensor, row_src: torch.Tensor, group_end: torch.Tensor, along_k: bool, along_m: bool,
    signs: torch.Tensor | None, seed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``fake_quant_nvfp4`` of x [M, K] (bf16, 1x16 blocks) over MoE token groups: row_src int32 [R] (R a
    multiple of 16) lays x's rows out in groups padded to multiples of 16, -1 for a padding row
    (``scale_layout.group_row_sources``); group_end int32 [1] is the groups' end, offs[-1]. Returns (along K
    [M, K], along M [R, K], s_dec fp32 [2]) of x with its rows at and past group_end zeroed: along K in x's rows
    (those rows left unwritten), along M in the padded groups. Neither is checked on the GPU (no host sync)."""
    check_nvfp4(x, along_k, along_m, False, "fake_quant_nvfp4_groups")
    if row_src.dtype != torch.int32 or row_src.dim() != 1 or row_src.numel() % BLOCK:
        raise ValueError(
            f"fake_quant_nvfp4_groups: row_src must be int32 [R] with R a multiple of {BLOCK}, got "
            f"{row_src.dtype} {tuple(row_src.shape)}"
        )
    if group_end.dtype != torch.int32 or group_end.numel() != 1:
        raise ValueError(
            f"fake_quant_nvfp4_groups: group_end must be one int32, got {group_end.dtype} {group_end.shape}"
        )
    m, k = x.shape
    rows = row_src.numel()
    out_k = x.new_empty((m, k) if along_k else (0,))
    out_m = x.new_empty((rows, k) if along_m else (0,))
    outputs = (out_k, out_m, None, None)
    s_dec = _launch(
        x, along_k, along_m, False, signs, seed, outputs, rows, "fake_quant_nvfp4_groups", (row_src, group_end)
    )
    return out_k, out_m, s_dec


def cast_nvfp4(
    x: torch.Tensor, along_k: bool, along_m: bool, tiles: bool, signs: torch.Tensor | None, seed: torch.Tensor | None,
    pad_m: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The packed NVFP4 cast of x [M, K], arguments as ``fake_quant_nvfp4``'s: (along K: codes uint8 [M, K / 2]
    and scales float8_e4m3fn [M, K / 16]; along M, transposed, rows zero-padded to a multiple of ``pad_m``
    (16 or 32): codes [K, M_pad / 2] and scales [K, M_pad / 16]; s_dec fp32 [2]). Codes are two e2m1 per byte,
    the first element in the low nibble: ``to_nvfp4(x, -1)`` and ``to_nvfp4(x_padded.t(), -1)``, bit for bit."""
    check_nvfp4(x, along_k, along_m, tiles, "cast_nvfp4", pad_m)
    m, k = x.shape
    m_pad = cdiv(m, pad_m) * pad_m
    u8 = dict(dtype=torch.uint8)
    q_k = x.new_empty((m, k // 2) if along_k else (0,), **u8)
    scale_k = x.new_empty((m, k // BLOCK) if along_k else (0,), **u8)
    q_m = x.new_empty((k, m_pad // 2) if along_m else (0,), **u8)
    scale_m = x.new_empty((k, m_pad // BLOCK) if along_m else (0,), **u8)
    s_dec = _launch(x, along_k, along_m, tiles, signs, seed, (q_k, q_m, scale_k, scale_m), m_pad, "cast_nvfp4")
    e4m3 = torch.float8_e4m3fn
    return q_k, scale_k.view(e4m3), q_m, scale_m.view(e4m3), s_dec


def _launch(
    x: torch.Tensor, along_k: bool, along_m: bool, tiles: bool, signs: torch.Tensor | None, seed: torch.Tensor | None,
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None], m_pad: int, op: str,
    groups: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """Both kernels into ``outputs`` (along K, along M, and for the packed cast their scales); returns s_dec.
    ``groups``: (row_src, group_end) of ``fake_quant_nvfp4_groups``; the kernels then walk m_pad rows."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{op} takes bf16 input, got {x.dtype}")
    if x.dtype != torch.bfloat16 and not interpreting():
        raise NotImplementedError(f"{op}: the GPU kernel takes bf16 input, got {x.dtype}")
    if not x.numel() or (groups is not None and not m_pad):
        if groups is not None and outputs[1].numel():
            outputs[1].zero_()
        return torch.full((2,), EMPTY_S_DEC, dtype=torch.float32, device=x.device)
    amax = _scratch(x)  # the maxima, and the scales derived from them
    s_dec = torch.empty(2, dtype=torch.float32, device=x.device)  # the maxima kernel's last program writes it
    software = software_round(x, op)
    hadamard = along_m and signs is not None
    signs_arg = signs if hadamard else amax
    packed = outputs[2] is not None
    stochastic = seed is not None
    src, end = groups if groups is not None else (amax, amax)  # no gather: any pointer stands in for them
    gather = groups is not None
    key = (x.shape, x.stride(), x.dtype, along_k, along_m, tiles, hadamard, stochastic, packed, m_pad, gather, software)
    _AMAX.launch_keyed(
        key, lambda: _amax_launch(x, amax, signs_arg, src, end, s_dec, m_pad, hadamard, gather, software), x_ptr=x,
        amax_ptr=amax, signs_ptr=signs_arg, src_ptr=src, end_ptr=end, s_dec_ptr=s_dec,
    )  # fmt: skip
    seed_arg = amax if seed is None else seed
    # the fake-quant writes no scales: any pointer stands in for them
    out_k, out_m, k_scale, m_scale = outputs if packed else (*outputs[:2], amax, amax)
    _FAKE_QUANT.launch_keyed(
        key,
        lambda: _fake_quant_launch(x, amax, signs_arg, seed_arg, src, end, out_k, out_m, k_scale, m_scale, along_k,
                                   along_m, tiles, hadamard, stochastic, packed, m_pad, gather, software),  # fmt: skip
        x_ptr=x, amax_ptr=amax, signs_ptr=signs_arg, seed_ptr=seed_arg, src_ptr=src, end_ptr=end,
        k_ptr=_bits(out_k, x, software), m_ptr=_bits(out_m, x, software), k_scale_ptr=k_scale, m_scale_ptr=m_scale,
    )  # fmt: skip
    return s_dec


# Each stream's scratch, kept: on one stream the calls run in order, and each leaves [0:3] zeroed for the next.
# A torch.zeros a call cost about 12 us of host time (H200 host): an MoE 1B step makes some 420 NVFP4 calls.
_SCRATCHES: dict[tuple[str, int, int], torch.Tensor] = {}


def _scratch(x: torch.Tensor) -> torch.Tensor:
    """The scratch for a call on x's device and its current stream. Under CUDA graph capture each call gets a
    fresh one (a kept tensor allocated there would live in the graph's private memory pool)."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return torch.zeros(SCRATCH, dtype=torch.int32, device=x.device)
    index = x.get_device()
    key = (x.device.type, index, torch._C._cuda_getCurrentRawStream(index) if x.is_cuda else 0)
    scratch = _SCRATCHES.get(key)
    if scratch is None:
        scratch = _SCRATCHES[key] = torch.zeros(SCRATCH, dtype=torch.int32, device=x.device)
    return scratch


def _bits(out: torch.Tensor, x: torch.Tensor, software: bool) -> torch.Tensor:
    """The interpreter stores bf16 as bits rounded by hand (its own bf16 store is not trusted)."""
    return out.view(torch.int16) if software and out.dtype == torch.bfloat16 else out


def amax_row_tiles(tiles_m: int, tiles_k: int) -> int:
    """How many tiles down its strip each program of the maxima kernel folds: a power of two (few compiled
    variants) up to AMAX_MAX_ROW_TILES, doubled while the grid stays above twice AMAX_PROGRAMS."""
    row_tiles = 1
    while row_tiles < AMAX_MAX_ROW_TILES and tiles_m * tiles_k >= 2 * row_tiles * AMAX_PROGRAMS:
        row_tiles *= 2
    return row_tiles


def _amax_launch(
    x: torch.Tensor, amax: torch.Tensor, signs: torch.Tensor, src: torch.Tensor, end: torch.Tensor,
    s_dec: torch.Tensor, m_pad: int, hadamard: bool, gather: bool, software: bool,
) -> tuple[tuple[int, int], dict]:  # fmt: skip
    block_m, block_k, num_warps = AMAX_HADAMARD_TILE if hadamard else TILE
    num_warps = num_warps if hadamard else AMAX_PLAIN_WARPS
    m = m_pad if gather else x.shape[0]
    tiles_m, tiles_k = cdiv(m, block_m), cdiv(x.shape[1], block_k)
    row_tiles = amax_row_tiles(tiles_m, tiles_k)
    grid = (cdiv(tiles_m, row_tiles), tiles_k)
    return grid, dict(
        x_ptr=x, amax_ptr=amax, signs_ptr=signs, src_ptr=src, end_ptr=end, s_dec_ptr=s_dec, M=m, K=x.shape[1],
        stride_xm=x.stride(0), stride_xk=x.stride(1), BLOCK_M=block_m, BLOCK_K=block_k, ROW_TILES=row_tiles,
        HADAMARD=hadamard, GATHER=gather, SOFTWARE_ROUND=software, num_warps=num_warps,
    )  # fmt: skip


def _fake_quant_launch(
    x: torch.Tensor, amax: torch.Tensor, signs: torch.Tensor, seed: torch.Tensor, src: torch.Tensor,
    end: torch.Tensor, out_k: torch.Tensor, out_m: torch.Tensor, k_scale: torch.Tensor, m_scale: torch.Tensor,
    along_k: bool, along_m: bool, tiles: bool, hadamard: bool, stochastic: bool, packed: bool, m_pad: int,
    gather: bool, software: bool,
) -> tuple[tuple[int, int], dict]:  # fmt: skip
    lanes = along_m and not along_k and not stochastic and not packed
    block_m, block_k, num_warps = ALONG_M_TILE if lanes else TILE
    m, k = x.shape
    grid = (cdiv(m_pad, block_m), cdiv(k, block_k))
    kwargs = dict(
        x_ptr=x, amax_ptr=amax, signs_ptr=signs, seed_ptr=seed, src_ptr=src, end_ptr=end,
        k_ptr=_bits(out_k, x, software), m_ptr=_bits(out_m, x, software), k_scale_ptr=k_scale, m_scale_ptr=m_scale,
        M=m_pad if gather else m, M_PAD=m_pad, K=k, stride_xm=x.stride(0), stride_xk=x.stride(1),
        BLOCK_M=block_m, BLOCK_K=block_k, ALONG_K=along_k, ALONG_M=along_m, TILES=tiles, HADAMARD=hadamard,
        STOCHASTIC=stochastic, PACKED=packed, GATHER=gather, SOFTWARE_ROUND=software,
        OUT_BF16_BITS=software and out_k.dtype == torch.bfloat16, LANE_COLS=ALONG_M_LANE_COLS if lanes else 0,
        num_warps=num_warps,
    )  # fmt: skip
    if along_k and along_m and not stochastic:
        kwargs["maxnreg"] = BOTH_SIDES_MAX_REGISTERS
    return grid, kwargs


def compile_for_target(
    shape: tuple[int, int], along_k: bool, along_m: bool, tiles: bool, hadamard: bool, stochastic: bool, arch: int,
    packed: bool = False, gather: bool = False,
):  # fmt: skip
    """Compile both kernels of one ``fake_quant_nvfp4`` (or, ``packed``, ``cast_nvfp4``; ``gather``,
    ``fake_quant_nvfp4_groups``) launch on a contiguous bf16 x of ``shape`` for CUDA ``arch`` without a GPU (CPU
    tests): (amax kernel, fake-quant kernel) as CompiledKernels."""
    from mx_kernels.gluon.common import compile_for_arch

    x = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    amax = torch.empty(SCRATCH, dtype=torch.int32, device="meta")
    signs, seed = torch.empty(16, device="meta"), torch.empty(1, dtype=torch.int64, device="meta")
    out = torch.empty(16, dtype=torch.uint8 if packed else torch.bfloat16, device="meta")
    scale = torch.empty(16, dtype=torch.uint8, device="meta") if packed else amax
    m_pad = cdiv(shape[0], 2 * BLOCK) * 2 * BLOCK
    src, end = torch.empty(m_pad, dtype=torch.int32, device="meta"), torch.empty(1, dtype=torch.int32, device="meta")
    _, amax_kwargs = _amax_launch(x, amax, signs, src, end, torch.empty(2, device="meta"), m_pad, hadamard, gather,
                                  False)  # fmt: skip
    _, kwargs = _fake_quant_launch(x, amax, signs, seed, src, end, out, out, scale, scale, along_k, along_m, tiles,
                                   hadamard, stochastic, packed, m_pad, gather, False)  # fmt: skip
    return compile_for_arch(_amax_kernel, amax_kwargs, arch), compile_for_arch(_fake_quant_kernel, kwargs, arch)
