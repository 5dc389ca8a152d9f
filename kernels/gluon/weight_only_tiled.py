"""Weight-only GEMM for decode on Hopper's tensor cores (Gluon), over MXFP4, NVFP4 and MXFP8 weights packed in tiles
for it.

out [M, N] = x [M, K] (bf16) @ dequantize(w).T, computed transposed (out^T = w x^T): the upcast weights are the
MMA's A operand in registers, 16 rows an instruction, x^T its B operand. Up to 4 rows of x: mma.sync m16n8k16,
x in registers too (8 rows an instruction: one row costs what eight do), 16 rows a program and K split over its
warps (below); from 5 to MAX_M rows: wgmma, a warpgroup per 64 rows, x^T through shared memory (``config``).
A stays in registers, though each step then waits for its wgmma before the next upcast: through shared memory,
with a wgmma left in flight over the next upcast, a step's A (32 KB for 128 weight rows) would be stored and read
back on top of x^T, which on an H200 costs more than the wait on every Llama 3 8B GEMM from 8 to 128 rows. The loop
takes two K steps an iteration, the second step's loads issued before the first's upcast and the next iteration's
first step's before the second's: with one step an iteration ptxas sinks the next step's loads, carried round the
loop, to the end of the body behind the MMA, and the upcast at the loop's head waits on them uncovered. K is split
over programs as the other weight-only kernels split it: each split stores its fp32 partial and the last to
arrive sums them in split order, so the result does not depend on timing. Asked for ``partials``, each split stores
its sum and the kernel ends: its consumer adds them in split order (a decode step's wo and w2, whose output goes to
the add + RMSNorm kernel, mx_kernels.decode_fused), the same bits without the counter and the read-back on the
GEMM's tail. On mma.sync a program's warps split K
instead (``KW``, up to 16: each reads the same 16 rows over its part of K, into its own accumulator) and add their
sums through shared memory in warp order: no partials through memory, no counter, and the GEMM's last sum is the
program's own. In the Llama 3 8B decode step on an H200 (2026-11-30), each GEMM's warps splitting K took
24-53 us off the step against the same split over programs, for MXFP4 and NVFP4 alike.

The layout (``pack``), made once when a model is loaded for decode (mx_recipe.infer.weights.tile_weights):

* Tiles: rows in blocks of 16, K in steps of 128; a block's step is 1 KB of codes (2 KB of e4m3), contiguous, in the
  order the lanes of its warp read it: lane 4g + q holds rows g and g + 8, elements 32q to 32q + 31 of each, and the
  step is rows 0-7 then rows 8-15, each as 16-byte runs in lane order (an e4m3 lane-row's two runs 512 bytes apart), so
  each of the warp's 16-byte loads reads 512 contiguous bytes and uses every sector it touches. Its scales follow in
  lane order, a lane's rows g and g + 8 side by side (64 bytes; 128 for NVFP4's scales per 16). In the formats' own
  layout each lane's 16-byte runs sit a row (K/2 bytes) apart.
* K order: the MMA's k (16j + 8h + 2q + e: lane q holds 2q, 2q + 1, 2q + 8, 2q + 9 of each 16) is element
  32q + 4j + 2h + e of the step, so that a lane's A and B registers hold its own 32 contiguous elements: x is read
  as 64 contiguous bytes a lane, each code byte is one bf16x2 register, and nothing moves between lanes.
* Bits: each 32-bit word of 8 codes has its bits permuted (``stored_bit``) so that each of its 4 code pairs becomes
  a bf16x2 register in one or two integer operations and a mask (pair 0 in place, pairs 1 and 2 one rotation away,
  pair 3 two): the codes as sign | exponent and mantissa at the bottom of a bf16 exponent, their values times
  2**-126 (0.5 a subnormal). One bf16x2 multiply then applies the scale and 2**126: MXFP4 2**(s - 1), exact for
  s <= 128 (a weight with larger scales or a NaN one takes a second multiply, ``wide_scales``), NVFP4 the e4m3
  scale's value times 2**118, the fp32 sum times 2**8 and the tensor scale at the end. Each factor is one integer
  multiply-add of the scale's bits: the e8m0 ones where no scale is wide, NVFP4's where every scale of the weight is
  positive and normal (what a quantizer writes for blocks that are not all zero), else the hardware's e4m3 pair to
  f16 pair conversion, two fp32 multiplies and two packs: about 8 instructions a pair of scales. Each product is
  rounded once, as ``dequantize`` rounds it. Compiled for sm_90a, about 2.5 instructions an element on mma.sync (the
  small-M FMA kernel on the formats' layout: 4.4) and 3.3 on wgmma (the Gluon tile's: 4.4).
* MXFP8: a step is 2 KB, a lane's 32 elements 32 bytes a row, a word 4 codes (two pairs of the MMA's k). Each code
  becomes the bf16 bits sign << 15 | magnitude << 4, its value times 2**-120: pair 0 is stored there (a mask), pair
  1 where left rotations by 4 (signs, magnitude bit 3) and 8 bring it (``stored_bit_e4m3``); one bf16x2 multiply by
  2**(s - 7) applies the e8m0 scale (a second, by 2**120 first, where a scale is past 2**7). A NaN code would become
  a number, so ``pack`` refuses weights with NaN codes. 180 instructions a step on mma.sync (MXFP4: 173 a 1 KB
  step). At one row the GEMV over the formats' layout (mx_kernels.decode_gemv) stays faster, so MXFP8 weights are
  tiled only for decode past one row (mx_recipe.infer.weights.tile_weights). Its words are loaded evict-first (in L1
  and L2), as data read once a step, as the GEMV loads its codes: Llama 3 8B's decode step on one H200 at 8
  sequences 3.188 -> 3.139 ms, at 32 4.229 -> 4.119. 4-bit words load plainly, which is faster for them.

What the layout takes off a decode step against the formats' own, per format and batch: docs/DESIGN.md
(Architecture), from ``benchmarks/bench_decode.py --layout``.

``SWIGLU``: the weight is w1 and w3 concatenated along N, packed with each 16-row tile as 8 gate rows then the same
8 hidden units' up rows: a lane's accumulator holds rows g and g + 8, a unit's gate and up, and the epilogue writes
silu(gate) * up with ``silu_mul``'s roundings (mx_kernels.decode_fused.swiglu).

Grouped (``tiled_weight_only_grouped_mm``: an MoE's experts at decode): E experts, each packed as its own weight
(N a multiple of 16, w1/w3 in SwiGLU's order per expert), stacked. The grid's third axis is row-tile slots of
GROUPED_BLOCK_M rows over the groups, as mx_kernels.mx.weight_only's grouped slots: each program waits for the
routing kernel (PDL), finds its expert and rows in ``offs`` (or reads them in place through ``rows``), and runs the
mma.sync path with its warps splitting K; where they do not divide K's steps (the MoE 16B's w2: 11) each warp takes
ceil(steps / KW) and the steps past K read zero words and x. A token's rows of the MoE 16B's experts on an H200
(8 of 66 groups, 2026-12-02): w1/w3 with SwiGLU 11.2 us MXFP4, 12.2 NVFP4, against 16.0 and 16.9 in the weight-only
kernel's grouped FMA path; w2 7.9 and 8.0 against 12.8 (bf16's grouped GEMV: 26.9 and 13.8).
Shared experts folded in as groups of every token (``early``: mx_recipe.infer.weights.QuantizedExperts.fold_shared)
need nothing from the routing: where x was written before the routing's launch (a decode step's w1/w3), their
tiles take the first slots and run without the wait, while the routing kernel still runs, and read x's rows in
token order instead of ``rows``. MoE 16B dims, one token, MXFP4, one H200 (2026-12-03): w1/w3 12.7 -> 10.6 us a
layer, the routing beside them 4.5 -> 5.1; the step 1.280 -> 1.236 ms.

``dequantize`` reads the tiles directly (a prefill hands its output to cuBLAS), each word's pairs brought to bf16x2
bits by the upcast's rotations and masks, then to fp32 values: on an H200 3.3-3.4 TB/s read and written (a Llama 3
8B prefill of 2048 tokens with tiled weights 67-68 ms; bf16 61); ``unpack`` gives back the formats' bytes (torch
ops).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.experimental.gluon.language as gl
import triton.language as tl
from mx_kernels.common import arrival_counters, check_early
from mx_kernels.gluon.common import permute_k, split_k_sum
from mx_kernels.launch_cache import LaunchCache
from mx_kernels.mx.weight_only import _e4m3, _e8m0, row_slots, tensor_scales
from triton.experimental import gluon
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

BLOCK_K = gl.constexpr(128)  # elements of K a step: 32 a lane, one MXFP4 scale block
MAX_M = 128  # rows of x a launch takes (wgmma's N); 64 on mma.sync
COUNTERS = 1 << 14  # split-K tiles a launch may have
FORMATS = ("mxfp4", "nvfp4", "mxfp8")

# the bf16x2 bits of a code pair (even k in the low half): mantissa, exponent bits 0 and 1, sign of each code
_TARGETS = (6, 7, 8, 15, 22, 23, 24, 31)
_MAG = "0x81C081C0"


def _rotation(pair: int, bit: int) -> int:
    """Where ``bit`` (0-7: the even code's 4 bits, then the odd code's) of word pair ``pair`` is stored, as the
    right-rotation that brings it to its bf16x2 bit (``_TARGETS``)."""
    if pair < 3:
        return (0, 4, 10)[pair]
    return 14 if bit in (0, 4) else 6


def stored_bit(pair: int, bit: int) -> int:
    return (_TARGETS[bit] + _rotation(pair, bit)) % 32


# e4m3 codes: a word of 4, two pairs; each code's magnitude to bits 4-10 of a bf16 (its exponent's low 4 bits and the
# top 3 of the mantissa: the value times 2**-120), its sign to bit 15. Pair 0 is stored there, pair 1's bits where a
# left rotation by 4 (signs) or 8 (magnitudes) brings them.
_E4M3_TARGET = 0x87F087F0
_E4M3_ROTATIONS = ((4, 0x80808080), (8, 0x07700770))


def stored_bit_e4m3(code: int, bit: int) -> int:
    """Where bit ``bit`` (0-7) of e4m3 code ``code`` (0-3, the word's byte) is stored."""
    target = (bit + 4 if bit < 7 else 15) + 16 * (code % 2)
    if code < 2:
        return target
    rotation = next(r for r, mask in _E4M3_ROTATIONS if mask >> target & 1)
    return (target - rotation) % 32


def codes_per_word(fmt: str) -> int:
    """Codes in a tiled word: 4 e4m3 (MXFP8), 8 e2m1 (MXFP4, NVFP4); a lane-row's 32 elements are 32 / that words."""
    return 4 if fmt == "mxfp8" else 8


def has_nan_codes(codes: torch.Tensor) -> bool:
    """Whether e4m3 codes (bytes) hold a NaN (0x7F, 0xFF): the tile's upcast has none, so such a weight is not tiled."""
    return bool(((codes.view(torch.uint8) & 0x7F) == 0x7F).any())


# A word of 8 codes ($8) and a bf16x2 factor ($9) -> 8 bf16 (each pair: even code, odd code)
_UPCAST = (
    "{ .reg .b32 r, t, u;\n"
    f"and.b32 r, $8, {_MAG}; mul.rn.bf16x2 r, r, $9; mov.b32 {{$0, $1}}, r;\n"
    f"shf.r.wrap.b32 t, $8, $8, 4; and.b32 r, t, {_MAG}; mul.rn.bf16x2 r, r, $9; mov.b32 {{$2, $3}}, r;\n"
    f"shf.r.wrap.b32 t, $8, $8, 10; and.b32 r, t, {_MAG}; mul.rn.bf16x2 r, r, $9; mov.b32 {{$4, $5}}, r;\n"
    "shf.r.wrap.b32 t, $8, $8, 14; and.b32 u, t, 0x00400040; shf.r.wrap.b32 t, $8, $8, 6;\n"
    "lop3.b32 r, t, 0x81808180, u, 0xEA; mul.rn.bf16x2 r, r, $9; mov.b32 {$6, $7}, r;\n"
    "}"
)


def _first_times(upcast: str, factor: str, first: int) -> str:
    """``upcast`` with each pair first multiplied by the bf16x2 ``first``, then by its ``factor`` operand: a scale
    past what one multiply holds."""
    return upcast.replace(".reg .b32 r, t, u;", f".reg .b32 r, t, u, c; mov.b32 c, {first:#010x};").replace(
        f"mul.rn.bf16x2 r, r, {factor};", f"mul.rn.bf16x2 r, r, c; mul.rn.bf16x2 r, r, {factor};"
    )


def _e8m0_factor(bias: int) -> str:
    """e8m0 s -> bf16x2 2**(s - 127 + bias) in both halves ((s + bias) << 7), one multiply-add: for a weight whose
    scales are not ``wide_scales`` (s + bias < 255; NaN's 0xFF is a wide scale)."""
    add = (bias << 7) * 0x00010001
    return f"mad.lo.u32 $0, $1, 0x00800080, {add:#010x};"


_UPCAST_ONE = gl.constexpr(_UPCAST)
_UPCAST_TWO = gl.constexpr(_first_times(_UPCAST, "$9", 0x7E807E80))  # 2**126 first: MXFP4 scales past 2**1
_F_E8M0_ONE = gl.constexpr(_e8m0_factor(126))  # 2**(s - 1): the e2m1 codes' 2**-126 undone
# e8m0 s -> 2**(s - 127): s << 7, 2**-127 (a subnormal) for 0, NaN for 0xFF
_F_E8M0_TWO = gl.constexpr(
    "{ .reg .pred p; mul.lo.u32 $0, $1, 0x00800080; setp.eq.u32 p, $1, 0; @p mov.b32 $0, 0x00400040;"
    " setp.eq.u32 p, $1, 255; @p mov.b32 $0, 0x7FC07FC0; }"
)
# two e4m3 scales c0, c1 (a byte each) -> their values times 2**118, each in both halves: the hardware's e4m3 pair to
# f16 pair (exact, subnormals and NaN too), fp32, times 2**118 (exact), back to bf16 (exact: 4 significant bits)
_F_E4M3 = gl.constexpr(
    "{ .reg .b32 t, h; .reg .b16 p, lo, hi; .reg .f32 a, b;"
    " prmt.b32 t, $2, $3, 0x0040; cvt.u16.u32 p, t; cvt.rn.f16x2.e4m3x2 h, p; mov.b32 {lo, hi}, h;"
    " cvt.f32.f16 a, lo; cvt.f32.f16 b, hi; mul.rn.f32 a, a, 0f7A800000; mul.rn.f32 b, b, 0f7A800000;"
    " cvt.rn.bf16x2.f32 $0, a, a; cvt.rn.bf16x2.f32 $1, b, b; }"
)
# a positive normal e4m3 scale c -> its value times 2**118 in both halves, one instruction: the bf16 bits of
# 2**(e - 7) (1 + m / 8) 2**118 are (e + 238) << 7 | m << 4, c << 4 plus 238 << 7 (no carry out of a half: c < 0x7F)
_F_E4M3_NORMAL = gl.constexpr("mad.lo.u32 $0, $1, 0x00100010, 0x77007700;")
# A word of 4 e4m3 codes ($4) and a bf16x2 factor ($5) -> 4 bf16 (pair 0's codes, then pair 1's)
_UPCAST_E4M3 = (
    "{ .reg .b32 r, t, u;\n"
    f"and.b32 r, $4, {_E4M3_TARGET:#010x}; mul.rn.bf16x2 r, r, $5; mov.b32 {{$0, $1}}, r;\n"
    f"shf.l.wrap.b32 t, $4, $4, {_E4M3_ROTATIONS[0][0]}; and.b32 u, t, {_E4M3_ROTATIONS[0][1]:#010x};\n"
    f"shf.l.wrap.b32 t, $4, $4, {_E4M3_ROTATIONS[1][0]}; lop3.b32 r, t, {_E4M3_ROTATIONS[1][1]:#010x}, u, 0xEA;\n"
    "mul.rn.bf16x2 r, r, $5; mov.b32 {$2, $3}, r;\n"
    "}"
)
_UPCAST_E4M3_ONE = gl.constexpr(_UPCAST_E4M3)
_UPCAST_E4M3_TWO = gl.constexpr(_first_times(_UPCAST_E4M3, "$5", 0x7B807B80))  # 2**120 first: scales past 2**7
_F_E8M0_E4M3 = gl.constexpr(_e8m0_factor(120))  # 2**(s - 7): the e4m3 codes' 2**-120 undone
NVFP4_SHIFT = gl.constexpr(256.0)  # NVFP4's products come out times 2**-8 (module doc)


@gluon.constexpr_function
def _word_layout(T, W, NV):
    """Code words [16 T W rows, q 4, b 2, v NV] of a step: lane 4g + q holds rows g and g + 8 of each tile (a warp
    per 16 rows, its T tiles W * 16 rows apart) and the 2 NV words (b, v) of its 32 elements (NV = 2 for e2m1
    codes, 4 for e4m3)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1 << i] for i in range(NV.bit_length() - 1)]
        + [[0, 0, 1, 0], [8, 0, 0, 0]]
        + [[16 * W << i, 0, 0, 0] for i in range(T.bit_length() - 1)],
        lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[16 << i, 0, 0, 0] for i in range(W.bit_length() - 1)],
        block_bases=[],
        shape=[16 * T * W, 4, 2, NV],
    )


@gluon.constexpr_function
def _word_load_layout(T, W, NV):
    """``_word_layout`` with (b, v) as one dimension of 2 NV contiguous words, the layout a lane-row's words are loaded
    in: a load is only as wide as the last dimension's contiguous registers, and ``_word_layout``'s holds NV words,
    8 bytes of e2m1 codes; merged, every format reads 16 bytes a load."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1 << i] for i in range((2 * NV).bit_length() - 1)]
        + [[8, 0, 0]]
        + [[16 * W << i, 0, 0] for i in range(T.bit_length() - 1)],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16 << i, 0, 0] for i in range(W.bit_length() - 1)],
        block_bases=[],
        shape=[16 * T * W, 4, 2 * NV],
    )


@gluon.jit
def _load_words(ptrs, WL: gl.constexpr, EVICT: gl.constexpr, mask=None):
    """A step's words [rows, q, 2 NV] (``_word_load_layout``) as [rows, q, b, v] in ``WL``: the same registers.
    ``mask``: the rows' warps whose part of K holds the step (ragged K; zero words elsewhere). ``EVICT``: the
    loads' eviction policy (module doc, MXFP8)."""
    if mask is None:
        w = gl.load(ptrs, eviction_policy=EVICT)
    else:
        w = gl.load(ptrs, mask=mask, other=0, eviction_policy=EVICT)
    w = gl.reshape(w, [w.shape[0], 4, 2, w.shape[2] // 2])
    return gl.convert_layout(w, WL, assert_trivial=True)


@gluon.constexpr_function
def _x_layout(BLOCK_M, W):
    """x as int32 pairs [BLOCK_M rows, 64]: lane 4g + q holds row g of each 8 and pairs 16q .. 16q + 15; warps
    share it."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8]] + [[8 << i, 0] for i in range((BLOCK_M // 8).bit_length() - 1)],
        lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[0, 0] for _ in range(W.bit_length() - 1)],
        block_bases=[],
        shape=[BLOCK_M, 64],
    )


# Element 32q + 4j + 2h + e of a step is the MMA's k = 16j + 8h + 2q + e. The upcast pairs join to [R, q1 q0 b v e h
# j0] (word 2b + v of lane q holds j = 2(2b + v) + j0), x to [R, q1 q0 j2 j1 j0 h e]; both go to [R, j2 j1 j0 h q1 q0
# e], the MMA's order.
_W_ORDER = gl.constexpr((0, 3, 4, 7, 6, 1, 2, 5))
_X_ORDER = gl.constexpr((0, 3, 4, 5, 6, 1, 2, 7))
# e4m3: word 4b + v of lane q holds j = 4b + v, its pairs h = 0, 1; the upcast joins to [R, q1 q0 b v1 v0 e h]
_W8_ORDER = gl.constexpr((0, 3, 4, 5, 7, 1, 2, 6))


@gluon.jit
def _a_operand(w, f, A: gl.constexpr, UPCAST: gl.constexpr, E4M3: gl.constexpr):
    """The step's upcast words w (factors f, per word) as the MMA's A operand [R, 128], in its logical K order."""
    R: gl.constexpr = w.shape[0]
    if E4M3:
        o0, o1, o2, o3 = gl.inline_asm_elementwise(
            UPCAST, "=h,=h,=h,=h,r,r", [w, f], dtype=[gl.bfloat16] * 4, is_pure=True, pack=1
        )
        pairs = gl.join(gl.join(o0, o1), gl.join(o2, o3))
        a = permute_k(gl.reshape(pairs, [R, BLOCK_K]), _W8_ORDER)
    else:
        o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
            UPCAST, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w, f], dtype=[gl.bfloat16] * 8, is_pure=True, pack=1
        )
        pairs = gl.join(gl.join(gl.join(o0, o1), gl.join(o2, o3)), gl.join(gl.join(o4, o5), gl.join(o6, o7)))
        a = permute_k(gl.reshape(pairs, [R, BLOCK_K]), _W_ORDER)
    return gl.convert_layout(a, A, assert_trivial=True)


@gluon.jit
def _b_operand(x, B: gl.constexpr):
    """The step's x pairs (int32 [BLOCK_M, 64]) as mma.sync's B operand [128, BLOCK_M], in its logical K order."""
    lo, hi = gl.inline_asm_elementwise(
        "mov.b32 {$0, $1}, $2;", "=h,=h,r", [x], dtype=[gl.bfloat16] * 2, is_pure=True, pack=1
    )
    xk = permute_k(gl.reshape(gl.join(lo, hi), [x.shape[0], BLOCK_K]), _X_ORDER)
    return gl.convert_layout(gl.permute(xk, (1, 0)), B, assert_trivial=True)


@gluon.jit
def _factors(s, WL: gl.constexpr, FMT: gl.constexpr, WIDE: gl.constexpr, NV: gl.constexpr):
    """bf16x2 factors [R, 4, 2, NV] (one per code word) from the step's scale bytes (int32)."""
    if FMT == "nvfp4":  # [R, 4, 2]: a scale per 16 elements, two words each
        if WIDE:
            f = gl.inline_asm_elementwise(_F_E4M3, "=r,=r,r,r", [s], dtype=gl.int32, is_pure=True, pack=2)
        else:
            f = gl.inline_asm_elementwise(_F_E4M3_NORMAL, "=r,r", [s], dtype=gl.int32, is_pure=True, pack=1)
        f = gl.expand_dims(f, 3)
    else:  # [R, 4]: a scale per 32 elements, 2 NV words
        if WIDE:
            f = gl.inline_asm_elementwise(_F_E8M0_TWO, "=r,r", [s], dtype=gl.int32, is_pure=True, pack=1)
        elif FMT == "mxfp8":
            f = gl.inline_asm_elementwise(_F_E8M0_E4M3, "=r,r", [s], dtype=gl.int32, is_pure=True, pack=1)
        else:
            f = gl.inline_asm_elementwise(_F_E8M0_ONE, "=r,r", [s], dtype=gl.int32, is_pure=True, pack=1)
        f = gl.expand_dims(gl.expand_dims(f, 2), 3)
    return gl.broadcast(f, gl.full([f.shape[0], 4, 2, NV], 0, gl.int32, WL))[0]


@gluon.jit
def _x_at(x_rows, xk, k, XD: gl.constexpr):
    """Pointers to x's step at element ``k`` of K (``XD``: x's elements a loaded element, 2 for int32 pairs)."""
    return x_rows + gl.expand_dims(gl.multiple_of(k // XD, 64) + xk, 0)


@gluon.jit
def _load_step(w_tiles, s_tiles, k, k_rel, w_left, s_left, WL: gl.constexpr, NV: gl.constexpr, SB: gl.constexpr,
               RAGGED: gl.constexpr, EVICT: gl.constexpr):  # fmt: skip
    """A step's words and scale bytes at element ``k`` of K (``k_rel`` past the warps' start): ``RAGGED``, zeros
    for the rows whose warp's part of K (``w_left``, ``s_left`` elements) ends before it."""
    w_at = w_tiles + gl.multiple_of(NV * k, 256)
    s_at = s_tiles + gl.multiple_of(k // 2 * SB, 64)
    if RAGGED:
        return _load_words(w_at, WL, EVICT, k_rel < w_left), gl.load(s_at, mask=k_rel < s_left, other=0)
    return _load_words(w_at, WL, EVICT), gl.load(s_at)


@gluon.jit
def _x_mask(x_in, k_rel, x_left, RAGGED: gl.constexpr):
    """x's load mask at a step ``k_rel`` past the warps' start: its rows (``x_in``), and ``RAGGED``, the step
    within the warp's part of K (``x_left`` elements)."""
    if RAGGED:
        return x_in & (k_rel < x_left)
    return x_in


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _group_tile(offs_ptr, slot, E, E_POW2: gl.constexpr, BLOCK_M: gl.constexpr, W: gl.constexpr):
    """Row-tile slot ``slot`` of a grouped GEMM: (its first row, its rows (at most BLOCK_M), its expert; -1 for a
    slot without rows). The slots are the groups' tiles in order, each group cut in BLOCK_M rows, as
    mx_kernels.mx.weight_only's grouped slots."""
    L: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    e = gl.arange(0, E_POW2, layout=L)
    ends = gl.load(offs_ptr + e, mask=e < E, other=0)
    starts = gl.load(offs_ptr + e - 1, mask=(e > 0) & (e < E), other=0)
    tiles = gl.where(e < E, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    after = gl.associative_scan(tiles, 0, _add)
    hit = (slot >= after - tiles) & (slot < after)
    expert = gl.max(gl.where(hit, e, -1), 0)
    row0 = gl.sum(gl.where(hit, starts + (slot - (after - tiles)) * BLOCK_M, 0), 0)
    row_end = gl.sum(gl.where(hit, ends, 0), 0)
    return row0, gl.minimum(row_end - row0, BLOCK_M), expert


@gluon.jit
def _mma_step(a, x, acc, x_next, x_in, x_buf, B: gl.constexpr, WGMMA: gl.constexpr):
    """acc + a x^T (a: the step's upcast weights, x: its rows of x), and the next step's x loaded from ``x_next``
    while the MMA runs. wgmma: x^T through ``x_buf``, one of two buffers taken in turn, so that one warpgroup's store
    of the next step's x cannot overwrite a tile the other's wgmma still reads (8 warps); the wgmma is waited for
    here, before the next upcast, which may take this step's A registers. mma.sync: x in registers (``x_in``: its
    rows below M)."""
    if WGMMA:
        x_buf.store(permute_k(x, _X_ORDER))
        hopper.fence_async_shared()
        x = gl.load(x_next)
        acc = hopper.warpgroup_mma(a, x_buf.permute((1, 0)), acc, is_async=True)
        acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc, x_buf])[0]
    else:
        xb = _b_operand(x, B)
        x = gl.load(x_next, mask=x_in, other=0)
        acc = mma_v2(a, xb, acc)
    return acc, x


@gluon.jit
def tiled_weight_only_kernel(
    x_ptr, w_ptr, s_ptr, ts_ptr, out_ptr, ws_ptr, cnt_ptr, offs_ptr, rows_ptr, M, N, K, K_SPLIT, SPLIT_K, stride_xm,
    stride_om, stride_tn, E, stride_we, stride_se, stride_te, TOKENS,
    FMT: gl.constexpr, BLOCK_M: gl.constexpr, T: gl.constexpr, W: gl.constexpr, SPLIT: gl.constexpr,
    WIDE: gl.constexpr, SWIGLU: gl.constexpr, PDL: gl.constexpr, WGMMA: gl.constexpr, UNROLL: gl.constexpr,
    KW: gl.constexpr = 1, PARTIALS: gl.constexpr = False, GROUPED: gl.constexpr = False,
    GATHER: gl.constexpr = False, E_POW2: gl.constexpr = 2, RAGGED: gl.constexpr = False, EARLY: gl.constexpr = 0,
):  # fmt: skip
    """One program: 16 T W weight rows (16 T with KW = W warps splitting its K), every row of x (M <= BLOCK_M), its
    split of K (K_SPLIT, a multiple of 128). w_ptr: the tiled words (int32), s_ptr the tiled scale bytes (module
    doc); N: the weight's rows. ``PARTIALS`` (K split): each split stores its fp32 sum and nothing sums them here.
    ``GROUPED`` (mma.sync, K not split over programs): the grid's third axis is row-tile slots over the groups
    (``offs``: int32 [E] cumulative row ends), each program its slot's expert's weight (E stacked tiled weights,
    ``stride_we`` words and ``stride_se`` scale bytes apart) and rows; ``GATHER``: those rows are x[rows].
    ``RAGGED``: the KW warps take ceil(steps / KW) steps each, the steps past K masked (zero words and x).
    ``EARLY`` (grouped, gathered): the last EARLY groups are every one of the TOKENS rows of x in order (an MoE's
    folded shared experts), their tiles the first slots, run without the PDL wait (x came before the kernel before)."""
    BLOCK_N: gl.constexpr = 16 * T * W
    R: gl.constexpr = BLOCK_N // KW  # weight rows a program; KW > 1: the warps split its K (mma.sync, T = 1)
    SB: gl.constexpr = 2 if FMT == "nvfp4" else 1
    E4M3: gl.constexpr = FMT == "mxfp8"
    # a lane-row's words of a step are 2 NV (16 or 32 bytes); a 16-row tile holds NV words an element of K
    NV: gl.constexpr = 4 if E4M3 else 2
    EVICT: gl.constexpr = "evict_first" if E4M3 else ""  # MXFP8's words (module doc)
    if WGMMA:  # a warpgroup's wgmma per 64 rows (T = 1), x^T from shared memory
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                      instr_shape=[16, BLOCK_M, 16])  # fmt: skip
        XL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
        XS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
    else:
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])
        XL: gl.constexpr = _x_layout(BLOCK_M, W)
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    WL: gl.constexpr = _word_layout(T, W, NV)
    if FMT == "nvfp4":
        SL: gl.constexpr = gl.SliceLayout(3, WL)
    else:
        SL: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, WL))
    if E4M3:
        if WIDE:
            UPCAST: gl.constexpr = _UPCAST_E4M3_TWO
        else:
            UPCAST: gl.constexpr = _UPCAST_E4M3_ONE
    elif WIDE and FMT == "mxfp4":  # NVFP4's wide scales take the longer factor, not a second multiply
        UPCAST: gl.constexpr = _UPCAST_TWO
    else:
        UPCAST: gl.constexpr = _UPCAST_ONE
    pid = gl.program_id(0)
    pid_k = gl.program_id(1)
    if GROUPED:
        slot = gl.program_id(2)
        if EARLY > 0:
            per_group = gl.cdiv(TOKENS, BLOCK_M)
            if slot < EARLY * per_group:  # a shared group's tile: its rows need nothing from the kernel before
                if PDL:
                    gdc_launch_dependents()
                group = slot // per_group
                token0 = (slot - group * per_group) * BLOCK_M  # its first token; -1 for a routed tile
                row0 = M - (EARLY - group) * TOKENS + token0
                tile_m = gl.minimum(TOKENS - token0, BLOCK_M)
                expert = E - EARLY + group
            else:  # a routed tile: its expert comes from the kernel before, waited for before any read (PDL)
                if PDL:
                    gdc_wait()
                    gdc_launch_dependents()
                row0, tile_m, expert = _group_tile(offs_ptr, slot - EARLY * per_group, E - EARLY, E_POW2, BLOCK_M,
                                                   W)  # fmt: skip
                token0 = slot * 0 - 1
        else:  # the rows' experts come from the kernel before: wait for it before any read (PDL)
            if PDL:
                gdc_wait()
                gdc_launch_dependents()
            row0, tile_m, expert = _group_tile(offs_ptr, slot, E, E_POW2, BLOCK_M, W)
        M = tile_m
        if expert < 0:
            return
        w_ptr += expert.to(gl.int64) * stride_we
        s_ptr += expert.to(gl.int64) * stride_se
        ts_ptr += expert * stride_te
        out_ptr += row0.to(gl.int64) * stride_om
        rows_ptr += row0
        if not GATHER:
            x_ptr += row0.to(gl.int64) * stride_xm
    k_start = pid_k * K_SPLIT
    k_total = gl.minimum(k_start + K_SPLIT, K) - k_start
    if RAGGED:  # a warp's steps: ceil(steps / KW), those past k_total masked
        k_len = gl.cdiv(k_total, KW * BLOCK_K) * BLOCK_K
    else:
        k_len = k_total // (KW * BLOCK_K) * BLOCK_K  # a warp's: whole steps
    k_end = k_start + k_len
    w_left, s_left, x_left = 0, 0, 0  # RAGGED's masks (below)
    # the program's words: [rows, q, b v] -> tile (row // 16) * NV K + half * 64 NV + 16-byte chunk (NV b + v) // 4 *
    # 128 + lane (4 (row % 8) + q) * 4 + (NV b + v) % 4
    WF: gl.constexpr = _word_load_layout(T, W, NV)
    L2: gl.constexpr = gl.SliceLayout(2, WF)
    vrows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L2))  # KW > 1: warp vrows // R reads k_len more on
    rows = pid * R + vrows % R
    rows = gl.where(rows < N, rows, 0)  # rows past N (a partial tile) read row 0 and are not stored
    q = gl.arange(0, 4, layout=gl.SliceLayout(0, L2))
    tile_row = (rows // 16) * NV * K + ((rows % 16) // 8) * 64 * NV + (rows % 8) * 16
    if KW > 1:
        tile_row += (vrows // R) * NV * k_len
    if RAGGED:  # the elements of K past each row's warp's start that the step may reach
        w_left = gl.expand_dims(gl.expand_dims(k_total - (vrows // R) * k_len, 1), 2)
    lane_row = gl.expand_dims(tile_row, 1) + gl.expand_dims(q * 4, 0)
    bv = gl.arange(0, 2 * NV, layout=gl.SliceLayout(0, gl.SliceLayout(1, WF)))
    bv = (bv // 4) * 128 + bv % 4
    w_tiles = w_ptr + (gl.expand_dims(lane_row, 2) + gl.expand_dims(gl.expand_dims(bv, 0), 1))
    # scales: tile (row // 16) * K / 2 * SB + (lane * 2 + half) * SB + block
    if SB == 2:
        SR: gl.constexpr = gl.SliceLayout(2, SL)
    else:
        SR: gl.constexpr = SL
    svrow = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SR))
    srow = pid * R + svrow % R
    srow = gl.where(srow < N, srow, 0)
    sq = gl.arange(0, 4, layout=gl.SliceLayout(0, SR))
    s_row = (srow // 16) * (K // 2) * SB + ((srow % 8) * 8 + (srow % 16) // 8) * SB
    if KW > 1:
        s_row += (svrow // R) * (k_len // 2) * SB
    if RAGGED:
        s_left = gl.expand_dims(k_total - (svrow // R) * k_len, 1)
        if SB == 2:
            s_left = gl.expand_dims(s_left, 2)
    s_lane = gl.expand_dims(s_row, 1)
    s_lane = s_lane + gl.expand_dims(sq * 2 * SB, 0)
    if SB == 2:
        blk = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, SL)))
        s_tiles = s_ptr + (gl.expand_dims(s_lane, 2) + gl.expand_dims(gl.expand_dims(blk, 0), 1))
    else:
        s_tiles = s_ptr + s_lane
    xm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, XL))
    xrow = gl.minimum(xm, M - 1)  # rows past M: never stored
    if GATHER:
        if EARLY > 0:  # a shared group's rows are its tokens in order: rows_ptr, which the routing writes, unread
            routed = token0 < 0
            xrow = gl.where(routed, gl.load(rows_ptr + xrow, mask=(xrow >= 0) & routed, other=0), token0 + xrow)
        else:
            xrow = gl.load(rows_ptr + xrow)
    xrow = gl.expand_dims(xrow * stride_xm, 1)
    if WGMMA:
        xk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, XL))
        x_rows = x_ptr + xrow
    else:  # int32 pairs; rows past M are not read (zeros): at 2-4 rows 1-5% off a step (against row M - 1 again)
        xk = gl.arange(0, 64, layout=gl.SliceLayout(0, XL))
        x_in = gl.expand_dims(xm < M, 1)
        x_rows = x_ptr.to(gl.pointer_type(gl.int32)) + xrow // 2
        if KW > 1:  # x's layout repeats it in every warp; each reads its own part of K (its warp index by PTX)
            zeros = gl.full([BLOCK_M], 0, gl.int32, gl.SliceLayout(1, XL))
            warp = gl.inline_asm_elementwise("{ .reg .u32 t; mov.u32 t, %tid.x; shr.u32 $0, t, 5; }", "=r,r", [zeros],
                                             dtype=gl.int32, is_pure=True, pack=1)  # fmt: skip
            x_rows = x_rows + gl.expand_dims(warp * (k_len // 2), 1)  # [BLOCK_M, 1]: x stays contiguous along K
            if RAGGED:
                x_left = gl.expand_dims(k_total - warp * k_len, 1)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
    # the first step's weights do not depend on the kernel before (PDL): read them before waiting for it (dense)
    w, s = _load_step(w_tiles, s_tiles, k_start, 0, w_left, s_left, WL, NV, SB, RAGGED, EVICT)
    if PDL:
        if not GROUPED:
            gdc_wait()
            gdc_launch_dependents()
    if WGMMA:  # rows past M read row M - 1
        XD: gl.constexpr = 1
        x = gl.load(_x_at(x_rows, xk, k_start, XD))
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, BLOCK_K], XS)
        bufs = (x_smem.index(0), x_smem.index(1))
        x_in = 0  # unread
    else:
        XD: gl.constexpr = 2  # int32 pairs
        x = gl.load(_x_at(x_rows, xk, k_start, XD), mask=_x_mask(x_in, 0, x_left, RAGGED), other=0)
        bufs = (0, 0)  # unread
    # two steps an iteration, each step's loads issued before the step ahead of it is upcast (module doc)
    n_steps = (k_end - k_start) // BLOCK_K
    for p in range(n_steps // 2):
        k1 = k_start + (2 * p + 1) * BLOCK_K
        k2 = gl.minimum(k1 + BLOCK_K, k_end - BLOCK_K)  # the last step's again after it: unmasked loads
        w1, s1 = _load_step(w_tiles, s_tiles, k1, k1 - k_start, w_left, s_left, WL, NV, SB, RAGGED, EVICT)
        a = _a_operand(w, _factors(s.to(gl.int32), WL, FMT, WIDE, NV), A, UPCAST, E4M3)
        x_next = _x_at(x_rows, xk, k1, XD)
        acc, x = _mma_step(a, x, acc, x_next, _x_mask(x_in, k1 - k_start, x_left, RAGGED), bufs[0], B, WGMMA)
        w, s = _load_step(w_tiles, s_tiles, k2, k2 - k_start, w_left, s_left, WL, NV, SB, RAGGED, EVICT)
        a = _a_operand(w1, _factors(s1.to(gl.int32), WL, FMT, WIDE, NV), A, UPCAST, E4M3)
        x_next = _x_at(x_rows, xk, k2, XD)
        acc, x = _mma_step(a, x, acc, x_next, _x_mask(x_in, k2 - k_start, x_left, RAGGED), bufs[1], B, WGMMA)
    if n_steps % 2 == 1:  # an odd count's last step, loaded by the last pair (or before the loop)
        a = _a_operand(w, _factors(s.to(gl.int32), WL, FMT, WIDE, NV), A, UPCAST, E4M3)
        x_mask = _x_mask(x_in, k_len - BLOCK_K, x_left, RAGGED)
        acc, x = _mma_step(a, x, acc, _x_at(x_rows, xk, k_end - BLOCK_K, XD), x_mask, bufs[0], B, WGMMA)
    if KW > 1:  # the warps' sums of the same rows, added in warp order through shared memory
        parts = gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        parts.store(acc)
        gl.thread_barrier()
        acc = parts.slice(0, R, dim=0).load(MMA)  # [R, BLOCK_M]: every warp holds the sums
        for i in gl.static_range(1, KW):
            acc += parts.slice(i * R, R, dim=0).load(MMA)
    on = pid * R + gl.arange(0, R, layout=gl.SliceLayout(1, MMA))
    om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    if PARTIALS:  # K split: the consumer sums the splits (module doc)
        mask = gl.expand_dims(om < M, 0) & gl.expand_dims(on < N, 1)
        gl.store(ws_ptr + pid_k * M * N + gl.expand_dims(om, 0) * N + gl.expand_dims(on, 1), acc, mask=mask)
        return
    last = True
    if SPLIT:
        acc, last = split_k_sum(acc, on, om, ws_ptr, cnt_ptr, pid, pid_k, M, N, SPLIT_K, UNROLL)
    if last:
        if FMT == "nvfp4":  # 2**8 and the tensor scale on the fp32 sum (one, or one per packed row)
            acc = acc * gl.expand_dims(gl.load(ts_ptr + gl.where(on < N, on, 0) * stride_tn) * NVFP4_SHIFT, 1)
        if SWIGLU:
            h = acc.to(gl.bfloat16).to(gl.float32)  # each GEMM output rounded, as the unfused GEMM's
            h = gl.permute(gl.reshape(h, [R // 16, 2, 8, BLOCK_M]), (0, 2, 3, 1))
            gate, up = gl.split(h)
            silu = (gate / (1.0 + gl.exp(-gate))).to(gl.bfloat16).to(gl.float32)
            y = gl.reshape((silu * up).to(gl.bfloat16), [R // 2, BLOCK_M])
            YL: gl.constexpr = y.type.layout
            un = pid * (R // 2) + gl.arange(0, R // 2, layout=gl.SliceLayout(1, YL))
            um = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, YL))
            ptrs = out_ptr + gl.expand_dims(um, 0) * stride_om + gl.expand_dims(un, 1)
            gl.store(ptrs, y, mask=gl.expand_dims(um < M, 0) & gl.expand_dims(un < N // 2, 1))
        else:
            ptrs = out_ptr + gl.expand_dims(om, 0) * stride_om + gl.expand_dims(on, 1)
            gl.store(ptrs, acc.to(gl.bfloat16), mask=gl.expand_dims(om < M, 0) & gl.expand_dims(on < N, 1))


# ------------------------------------------------------------------------------------------------------------------
# Packing (torch ops: once per weight, on its device)


def _stored(fmt: str) -> dict[int, int]:
    """A word's natural bit (8 byte + bit) -> where it is stored, for the format's codes (module doc)."""
    if fmt == "mxfp8":
        return {8 * p + bit: stored_bit_e4m3(p, bit) for p in range(4) for bit in range(8)}
    return {8 * p + bit: stored_bit(p, bit) for p in range(4) for bit in range(8)}


def _bit_tables(device: torch.device, fmt: str) -> torch.Tensor:
    """[4, 256] int64: a word's byte p = value -> that byte's bits at their stored positions."""
    stored = _stored(fmt)
    tables = torch.zeros(4, 256, dtype=torch.int64)
    values = torch.arange(256)
    for p in range(4):
        for bit in range(8):
            tables[p] |= ((values >> bit) & 1) << stored[8 * p + bit]
    return tables.to(device)


def _permute_bits(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """Code bytes [..., 4 j] -> int32 words [..., j] with each word's bits permuted (module doc)."""
    tables = _bit_tables(codes.device, fmt)
    b = codes.view(*codes.shape[:-1], -1, 4).long()
    words = tables[0][b[..., 0]] | tables[1][b[..., 1]] | tables[2][b[..., 2]] | tables[3][b[..., 3]]
    return (words - ((words >> 31) << 32)).to(torch.int32)


def _unpermute_bits(words: torch.Tensor, fmt: str) -> torch.Tensor:
    """The inverse of ``_permute_bits``: int32 words [..., j] -> code bytes [..., 4 j]."""
    natural = {v: k for k, v in _stored(fmt).items()}
    tables = torch.zeros(4, 256, dtype=torch.int64)
    values = torch.arange(256)
    for i in range(4):  # stored byte i's bits at their natural positions
        for bit in range(8):
            tables[i] |= ((values >> bit) & 1) << natural[8 * i + bit]
    tables = tables.to(words.device)
    b = words.contiguous().view(torch.uint8).view(*words.shape, 4).long()
    codes = tables[0][b[..., 0]] | tables[1][b[..., 1]] | tables[2][b[..., 2]] | tables[3][b[..., 3]]
    return (codes - ((codes >> 31) << 32)).to(torch.int32).view(torch.uint8).view(*words.shape[:-1], -1)


def swiglu_rows(n: int) -> torch.Tensor:
    """The packed row order of SwiGLU's w1 and w3 concatenated along N (n rows): each 16 rows are 8 gate rows, then
    the same 8 units' up rows."""
    half = n // 2
    unit = torch.arange(half).view(-1, 8)
    return torch.cat([unit, unit + half], dim=1).flatten()


def pack(qdata: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor | None, fmt: str, swiglu: bool = False
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """(codes [N, K/2] uint8 (e2m1) or [N, K] (e4m3), scales [N, K/32] e8m0 or [N, K/16] e4m3, NVFP4's tensor scale:
    one or one per row) -> (words int32 [N16, K/8 or K/4], scale bytes [N16, K/32 or K/16], the tensor scale: one,
    or one per packed row) in the tiled layout (module doc), N16 = N rounded up to 16 (padding rows are zero codes).
    MXFP8 codes must not be NaN (0x7F, 0xFF): the upcast has no NaN code. Experts (codes [E, N, K/2 or K], N a
    multiple of 16; NVFP4's tensor scale one, or one per expert and row): each packed as its own weight, stacked
    (words [E, N, ...], scales [E, N, ...], the tensor scale flat, in each expert's packed row order)."""
    if qdata.dim() == 3:
        return _pack_experts(qdata, scale, tensor_scale, fmt, swiglu)
    n, row_bytes = qdata.shape
    per_word = codes_per_word(fmt)
    k = row_bytes * per_word // 4
    if fmt not in FORMATS or k % BLOCK_K.value or (swiglu and n % 16):
        raise ValueError(f"pack: mxfp4, nvfp4 or mxfp8 codes with K a multiple of {BLOCK_K.value} (and N of 16 for "
                         f"swiglu), got {fmt} [{n}, {k}]")  # fmt: skip
    codes = qdata.view(torch.uint8)
    if fmt == "mxfp8" and has_nan_codes(codes):
        raise ValueError("pack: MXFP8 codes with NaN (0x7F, 0xFF) stay in the formats' layout")
    s = scale.view(torch.uint8)
    ts = None if tensor_scale is None else tensor_scale.float().reshape(-1)
    if swiglu:
        order = swiglu_rows(n).to(codes.device)
        codes, s = codes[order], s[order]
        ts = ts if ts is None or ts.numel() == 1 else ts[order]
    n16 = triton.cdiv(n, 16) * 16
    if n16 != n:
        codes = torch.cat([codes, codes.new_zeros(n16 - n, row_bytes)])
        s = torch.cat([s, s.new_zeros(n16 - n, s.shape[1])])
    words = _permute_bits(codes, fmt)  # [n16, K/8 or K/4]
    sb = s.shape[1] * 32 // k  # scales a lane-row a step: 1 (e8m0 per 32) or 2 (e4m3 per 16)
    lane_words = 32 // per_word  # a lane-row's words a step
    # row = 16 t + 8 half + g, word = 4 lane_words step + lane_words q + 4 chunk + w -> [t, step, half, chunk, g, q,
    # w]: each 16 bytes of a lane-row beside the next lane's (module doc)
    chunks = lane_words // 4
    words = words.view(n16 // 16, 2, 8, k // BLOCK_K.value, 4, chunks, 4).permute(0, 3, 1, 5, 2, 4, 6)
    s = s.view(n16 // 16, 2, 8, k // BLOCK_K.value, 4, sb).permute(0, 3, 2, 4, 1, 5)
    return words.contiguous().view(n16, -1), s.contiguous().view(n16, -1), ts


def _pack_experts(qdata: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor | None, fmt: str,
                  swiglu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``pack`` of E experts [E, N, ...]: each expert's rows in SwiGLU's order, then all of them as one weight of
    E N rows, whose 16-row tiles are each expert's."""
    e, n = qdata.shape[:2]
    if n % 16:
        raise ValueError(f"pack: experts' rows in whole 16-row tiles, got N = {n}")
    ts = None if tensor_scale is None else tensor_scale.float().reshape(-1)
    if ts is not None and ts.numel() not in (1, e * n):
        raise ValueError(f"pack: an NVFP4 tensor scale of one, or one per expert and row ({e} x {n}); got {ts.numel()}")
    if swiglu:
        order = swiglu_rows(n).to(qdata.device)
        qdata, scale = qdata[:, order], scale[:, order]
        ts = ts if ts is None or ts.numel() == 1 else ts.view(e, n)[:, order.to(ts.device)].reshape(-1)
    words, scales, _ = pack(qdata.reshape(e * n, -1), scale.reshape(e * n, -1), None, fmt)
    return words.view(e, n, -1), scales.view(e, n, -1), ts


_E4M3_TARGET_BITS = tl.constexpr(_E4M3_TARGET)
_E4M3_SIGN_ROTATION = tl.constexpr(_E4M3_ROTATIONS[0][0])  # left, bits 3 and 7 of each code (module doc)
_E4M3_SIGN_BITS = tl.constexpr(_E4M3_ROTATIONS[0][1])
_E4M3_MAGNITUDE_ROTATION = tl.constexpr(_E4M3_ROTATIONS[1][0])
_E4M3_MAGNITUDE_BITS = tl.constexpr(_E4M3_ROTATIONS[1][1])


@triton.jit
def _rotate_right(w, r: tl.constexpr):
    return (w >> r) | (w << (32 - r))


@triton.jit
def _bf16_pair(bits, undo, factor):
    """A bf16x2 code pair's bits (uint32; the codes' values times 1 / ``undo``) -> each code's value times
    ``factor`` in fp32, the value first (the product in ``dequantize``'s order): the low half's, then the high's."""
    lo = (bits << 16).to(tl.float32, bitcast=True) * undo * factor
    hi = (bits & 0xFFFF0000).to(tl.float32, bitcast=True) * undo * factor
    return tl.join(lo, hi)


@triton.jit
def _dequantize_tiled_kernel(w_ptr, s_ptr, ts_ptr, out_ptr, N, K, stride_tn, FMT: tl.constexpr, SWIGLU: tl.constexpr):
    """One 16-row tile's step of a tiled weight to values [16, 128] in out's dtype, in the formats' row order: each
    word's code pairs brought to bf16x2 bits by the GEMM's rotations and masks (module doc), each code's fp32 value
    (as ``_e2m1`` / ``_e4m3`` give it) times its scale (then the tensor scale, NVFP4) as mx_kernels.mx.weight_only's
    ``dequantize`` computes it, one rounding."""
    SB: tl.constexpr = 2 if FMT == "nvfp4" else 1
    LW: tl.constexpr = 8 if FMT == "mxfp8" else 4  # a lane-row's words: 32 elements
    C: tl.constexpr = 4 * LW  # a row's words in the step
    t = tl.program_id(0)
    step = tl.program_id(1)
    r = tl.arange(0, 16)[:, None]  # the row in the tile: 8 half + g
    c = tl.arange(0, C)[None, :]  # the word in the row's step: LW q + its word in the lane's
    base = t.to(tl.int64) * (K // 128) + step
    lane = (r % 8) * 4 + c // LW
    # words: half r // 8, then 16-byte runs in lane order (module doc); scales: lane-rows in lane order
    w = tl.load(w_ptr + base * 64 * LW + (r // 8) * 32 * LW + ((c % LW) // 4) * 128 + lane * 4 + c % 4)
    w = w.to(tl.uint32, bitcast=True)
    place = lane * 2 + r // 8  # the lane-row in the tile's step
    blk = ((c % LW) * 2 // LW) * (SB - 1)  # NVFP4: the lane's first or second 16 elements
    s = tl.load(s_ptr + base * 64 * SB + place * SB + blk).to(tl.int32)
    if FMT == "nvfp4":
        factor = _e4m3(s) * 1.329227995784916e36  # 2**120: the e4m3 scale's value
    else:
        factor = _e8m0(s)
    if FMT == "mxfp8":  # 4 codes a word: pairs (0, 1), (2, 3)
        undo = 1.329227995784916e36  # 2**120
        p0 = _bf16_pair(w & _E4M3_TARGET_BITS, undo, factor)
        p1 = _bf16_pair((_rotate_right(w, 32 - _E4M3_SIGN_ROTATION) & _E4M3_SIGN_BITS)
                        | (_rotate_right(w, 32 - _E4M3_MAGNITUDE_ROTATION) & _E4M3_MAGNITUDE_BITS),
                        undo, factor)  # fmt: skip
        value = tl.reshape(tl.permute(tl.join(p0, p1), (0, 1, 3, 2)), (16, 128))  # [r, c, e, pair]
    else:  # 8 codes a word: pairs 0-3 (module doc)
        undo = 8.507059173023462e37  # 2**126
        p0 = _bf16_pair(w & 0x81C081C0, undo, factor)
        p1 = _bf16_pair(_rotate_right(w, 4) & 0x81C081C0, undo, factor)
        p2 = _bf16_pair(_rotate_right(w, 10) & 0x81C081C0, undo, factor)
        p3 = _bf16_pair((_rotate_right(w, 6) & 0x81808180) | (_rotate_right(w, 14) & 0x00400040), undo, factor)
        pairs = tl.join(tl.join(p0, p1), tl.join(p2, p3))  # [r, c, e, pair % 2, pair // 2]
        value = tl.reshape(tl.permute(pairs, (0, 1, 4, 3, 2)), (16, 128))
    if SWIGLU:
        row = 8 * t + r % 8 + (r // 8) * (N // 2)
    else:
        row = 16 * t + r
    if FMT == "nvfp4":
        value = value * tl.load(ts_ptr + row * stride_tn, mask=row < N, other=1.0)
    col = step * 128 + tl.arange(0, 128)[None, :]
    tl.store(out_ptr + row.to(tl.int64) * K + col, value.to(out_ptr.dtype.element_ty), mask=row < N)


_DEQUANTIZE = LaunchCache(_dequantize_tiled_kernel)  # a prefill's launches recur (host time: mx_kernels.launch_cache)


def dequantize(words: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor | None, n: int, fmt: str,
               swiglu: bool = False, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:  # fmt: skip
    """``pack``'s weight (n rows; NVFP4's tensor scale one or one per row in the formats' row order) in ``dtype``, in
    the formats' row order, bit for bit mx_kernels.mx.weight_only's ``dequantize`` of the unpacked weight: what a
    prefill hands to cuBLAS, in one kernel (GPU, or the Triton interpreter)."""
    k = words.shape[1] * codes_per_word(fmt)
    out = torch.empty((n, k), dtype=dtype, device=words.device)
    stride_tn = int(tensor_scale is not None and tensor_scale.numel() > 1)
    ts = tensor_scale.float().reshape(-1) if tensor_scale is not None else out
    _DEQUANTIZE.launch(
        (words.shape[0] // 16, k // BLOCK_K.value),
        dict(w_ptr=words, s_ptr=scales, ts_ptr=ts, out_ptr=out, N=n, K=k, stride_tn=stride_tn, FMT=fmt, SWIGLU=swiglu,
             num_warps=4),
    )  # fmt: skip
    return out


def unpack(words: torch.Tensor, scales: torch.Tensor, n: int, fmt: str, swiglu: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The inverse of ``pack``: (codes [n, K/2] or [n, K] uint8, scale bytes [n, K/32 or K/16]), by torch ops (the
    reference on a CPU; ``dequantize`` reads the tiled weight directly)."""
    n16, kw = words.shape
    k = kw * codes_per_word(fmt)
    sb = scales.shape[1] * 32 // k
    s = scales.view(n16 // 16, k // BLOCK_K.value, 8, 4, 2, sb).permute(0, 4, 2, 1, 3, 5).reshape(n16, -1)[:n]
    inverse = None
    if swiglu:
        inverse = torch.empty(n, dtype=torch.long)
        inverse[swiglu_rows(n)] = torch.arange(n)
        s = s[inverse.to(s.device)]
    chunks = 8 // codes_per_word(fmt)  # 16-byte runs a lane-row
    w = words.view(n16 // 16, k // BLOCK_K.value, 2, chunks, 8, 4, 4).permute(0, 2, 4, 1, 5, 3, 6)
    codes = _unpermute_bits(w.reshape(n16, kw), fmt)[:n]
    return (codes if inverse is None else codes[inverse]), s


def wide_scales(scales: torch.Tensor, fmt: str) -> bool:
    """Whether a weight's scale bytes need the kernel's longer factor (module doc): e8m0 scales past 2**1 (MXFP4) or
    2**7 (MXFP8), NaN's 0xFF among them, take a second multiply; e4m3 scales other than positive normal ones (zero,
    subnormal, negative, NaN) the hardware's conversion."""
    s = scales.view(torch.uint8)
    if fmt == "nvfp4":
        return bool(((s & 0x78) == 0).any() | (s >= 0x80).any() | (s == 0x7F).any())
    most = {"mxfp4": 128, "mxfp8": 134}.get(fmt)
    return most is not None and bool((s > most).any())


def _nearest_power_of_2(v: float, most: int) -> int:
    return min(most, 1 << max(0, round(math.log2(v))))


def config(m: int, n: int, sm_count: int) -> dict:
    """The launch of an M-row GEMM over n weight rows, by M: up to 4 rows mma.sync, a program per 16 rows, K split
    by its warps (``kw``, module doc) so that the GEMM has about 24 warps an SM (short, many in flight); 5 to 16 rows
    wgmma, 64 rows a program (4 warps), about 4 an SM; past that 128 rows a program (8 warps), about 2 an SM to 32
    rows and 1 past 32 (the power of 2 nearest each). Chosen on one H200 against the best of T, W and the split a
    shape, Llama 3 8B's projections at M = 1 to 128 (2026-11-30); at 17 to 32 rows the 8 warps take a layer's four
    GEMMs 6-9% under 4 warps (MXFP4 M = 32: 82.7 against 87.8 us, NVFP4 88.1 against 96.2), at 12 and 16 rows 6-7%
    over."""
    if m <= 4:
        split = _nearest_power_of_2(24 * sm_count / triton.cdiv(n, 16), 16)
        return dict(t=1, w=split, kw=split, split_k=1, wgmma=False)
    if m <= 16:
        return dict(t=1, w=4, split_k=_nearest_power_of_2(4 * sm_count / triton.cdiv(n, 64), 8), wgmma=True)
    per_sm = 2 if m <= 32 else 1
    return dict(t=1, w=8, split_k=_nearest_power_of_2(per_sm * sm_count / triton.cdiv(n, 128), 8), wgmma=True)


def tiled_weight_only_mm(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor | None,
                         n: int, fmt: str, wide: bool, swiglu: bool = False, cfg: dict | None = None,
                         pdl: bool = False, partials: bool = False) -> torch.Tensor:  # fmt: skip
    """x [M, K] bf16 @ dequantize(w).T -> [M, n] bf16 ([M, n / 2] with ``swiglu``) from ``pack``'s output for the
    weight's n rows (``tensor_scale``: pack's, in its row order); ``wide``: ``wide_scales`` of the scales. More than
    MAX_M rows run as launches of MAX_M. ``cfg``: t, w, split_k, wgmma and optionally kw (default ``config``; kw
    warps split K on mma.sync: kw = w, t = 1, each split's steps a multiple of kw); ``pdl``: launched
    with programmatic dependent launch (mx_kernels.pdl). ``partials`` (no ``swiglu``): where one launch splits K over
    programs, its splits' fp32 sums [splits, M, n] instead, for the consumer to add in split order and round
    (``mx_kernels.decode_fused.add_rms_norm``, ``mx_kernels.decode_attention``; NVFP4's tensor scale not applied:
    ``partials_scale``)."""
    op = "tiled_weight_only_mm"
    if fmt not in FORMATS or x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1 or x.stride(0) % 8:
        raise ValueError(f"{op}: mxfp4, nvfp4 or mxfp8 and x bf16 [M, K] with rows 16-byte aligned, got {fmt} "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")  # fmt: skip
    m, k = x.shape
    n16 = triton.cdiv(n, 16) * 16
    sb = 2 if fmt == "nvfp4" else 1
    row_words = k // codes_per_word(fmt)
    shapes = (n16, row_words), (n16, k // 32 * sb)
    if k % BLOCK_K.value or (words.shape, scales.shape) != shapes or (swiglu and n % 16):
        raise ValueError(f"{op}: pack's words [{n16}, {row_words}] and scales [{n16}, {k // 32 * sb}] for n = {n}, "
                         f"K = {k} (a multiple of {BLOCK_K.value}), got {tuple(words.shape)} and "
                         f"{tuple(scales.shape)}")  # fmt: skip
    if (tensor_scale is None) != (fmt != "nvfp4"):
        raise ValueError(f"{op}: nvfp4 takes a tensor scale, mxfp4 none")
    if partials and swiglu:
        raise ValueError(f"{op}: partials are a plain GEMM's, not the SwiGLU epilogue's")
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    if partials:
        launch, splits = _partials_launch(m, n, k, sms, cfg)
        if splits > 1:
            ws = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
            _launch(x, words, scales, tensor_scale, ws, n, fmt, wide, False, launch, pdl, True)
            return ws
    out = torch.empty((m, n // 2 if swiglu else n), dtype=torch.bfloat16, device=x.device)
    r0 = 0
    while r0 < m:
        launch = _launch_config(min(m - r0, MAX_M), k, n, sms, cfg)
        rows = _launch_rows(m - r0, launch)
        _launch(x[r0 : r0 + rows], words, scales, tensor_scale, out[r0 : r0 + rows], n, fmt, wide, swiglu, launch, pdl)
        r0 += rows
    return out


def _launch_config(m: int, k: int, n: int, sms: int, cfg: dict | None) -> dict:
    """The launch of up to MAX_M rows: ``cfg``, else ``config``'s with K split over programs where its warps
    cannot split K's steps evenly."""
    if cfg is not None:
        return cfg
    launch = config(m, n, sms)
    if (k // BLOCK_K.value) % launch.get("kw", 1):
        launch = dict(launch, w=1, kw=1, split_k=launch["kw"])
    return launch


def _launch_rows(m: int, launch: dict) -> int:
    return min(m, MAX_M if launch["wgmma"] else 64)


def _splits(k: int, split_k: int) -> tuple[int, int]:
    """(steps of K a split, splits) for a launch asking for ``split_k``."""
    steps = k // BLOCK_K.value
    k_split = triton.cdiv(steps, min(split_k, steps))
    return k_split, triton.cdiv(steps, k_split)


def _partials_launch(m: int, n: int, k: int, sms: int, cfg: dict | None) -> tuple[dict | None, int]:
    """The one launch of an M-row GEMM and its splits of K over programs; (None, 1) where it takes several."""
    if m == 0 or m > MAX_M:
        return None, 1
    launch = _launch_config(m, k, n, sms, cfg)
    return (launch, _splits(k, launch["split_k"])[1]) if _launch_rows(m, launch) == m else (None, 1)


def partial_splits(m: int, n: int, k: int, sms: int, cfg: dict | None = None) -> int:
    """The splits whose sums ``tiled_weight_only_mm(partials=True)`` returns for an M-row GEMM on ``sms`` SMs: those
    of its one launch; 1 where it returns the output (K not split over programs, or more rows than a launch's)."""
    return _partials_launch(m, n, k, sms, cfg)[1]


def partials_scale(tensor_scale: torch.Tensor | None) -> torch.Tensor | None:
    """What a consumer multiplies the summed partials by: NVFP4's tensor scale (``pack``'s, one or one per row)
    times 2**8 (fp32, as the kernel's epilogue computes it); None for the MX formats."""
    return None if tensor_scale is None else tensor_scale * NVFP4_SHIFT.value


def _launch(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor | None,
            out: torch.Tensor, n: int, fmt: str, wide: bool, swiglu: bool, cfg: dict, pdl: bool,
            partials: bool = False) -> None:  # fmt: skip
    """One launch; ``partials``: ``out`` is the splits' fp32 sums [splits, M, n] (K split over programs)."""
    m, k = x.shape
    t, w, wgmma, kw = cfg["t"], cfg["w"], cfg["wgmma"], cfg.get("kw", 1)
    steps = k // BLOCK_K.value
    k_split, split_k = _splits(k, cfg["split_k"])
    if kw > 1 and (wgmma or t != 1 or w != kw or k_split * split_k != steps or k_split % kw):
        raise ValueError(f"tiled_weight_only_mm: {kw} warps split K only on mma.sync, one tile a program, and each "
                         f"split's {k_split} steps of {steps} in whole steps a warp: {cfg}")  # fmt: skip
    n_tiles = triton.cdiv(n, 16 * t * w // kw)
    split = split_k > 1
    if partials:
        ws, counters = out, out
    else:
        ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split else out
        counters = arrival_counters("weight_only_tiled", x.device, COUNTERS) if split else out
    if n_tiles > COUNTERS:
        raise ValueError(f"tiled_weight_only_mm: {n_tiles} tiles, past the {COUNTERS} counters")
    ts = tensor_scale if tensor_scale is not None else out
    stride_tn = int(tensor_scale is not None and tensor_scale.numel() > 1)
    tiled_weight_only_kernel[(n_tiles, split_k)](
        x, words, scales, ts, out, ws, counters, out, out, m, n, k, k_split * BLOCK_K.value, split_k, x.stride(0),
        out.stride(-2), stride_tn, 1, 0, 0, 0, 0, FMT=fmt, BLOCK_M=max(8, triton.next_power_of_2(m)), T=t, W=w,
        SPLIT=split, WIDE=wide, SWIGLU=swiglu, PDL=pdl, WGMMA=wgmma,
        UNROLL=triton.next_power_of_2(split_k) if split else 0, KW=kw, PARTIALS=partials, num_warps=w,
        launch_pdl=pdl,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------------------------
# Grouped (MoE experts at decode)

GROUPED_BLOCK_M = 8  # a grouped program's rows (mma.sync's 8): a token's top-k rows make one tile a group


def grouped_kw(m: int, n: int, k: int, n_groups: int, sms: int) -> int:
    """The warps splitting K in a grouped launch of m rows over ``n_groups`` experts of n x k: about 16 warps an SM
    over the programs with rows (at most min(m, groups) row tiles, n / 16 weight tiles each), at most K's steps.
    On one H200, a token's rows of the MoE 16B's experts (8 groups, 2026-12-02), 2 warps: w1/w3 with SwiGLU (N =
    2816, K = 2048) 11.2 us MXFP4 and 12.2 NVFP4, w2 (2048, 1408) 7.9 and 8.0; 4 warps 12.2, 13.3, 8.8 and 9.0; 1
    warp 12.9, 13.6, 9.0 and 9.3; 8 warps 12-17 us."""
    busy = n // 16 * min(m, n_groups)
    kw = _nearest_power_of_2(16 * sms / max(busy, 1), 16)
    while kw > 1 and kw > k // BLOCK_K.value:
        kw //= 2
    return kw


def tiled_weight_only_grouped_mm(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor,
                                 tensor_scale: torch.Tensor | None, fmt: str, wide: bool, offs: torch.Tensor,
                                 rows: torch.Tensor | None = None, swiglu: bool = False, kw: int | None = None,
                                 pdl: bool = False, early: int = 0) -> torch.Tensor:  # fmt: skip
    """The grouped GEMM over E experts tiled by ``pack`` (words [E, N, K/8 or K/4], scales [E, N, K/32 or K/16],
    N a multiple of 16; NVFP4's tensor scale one, or one per expert and packed row): x [M, K] bf16 sorted by
    expert, ``offs`` [E] int32 the groups' cumulative row ends, each group's rows @ dequantize(w[e]).T -> [M, N]
    ([M, N / 2] with ``swiglu``, each expert's rows packed in SwiGLU's order). ``rows``: int32 [M], the groups' rows
    are x[rows] (x the tokens), read in place. A program per 16 weight rows and row tile of a group
    (GROUPED_BLOCK_M rows), its ``kw`` warps splitting K (default ``grouped_kw``; the last ones' steps masked where
    they do not divide K's); slots without rows return at once, so only the experts with rows are read. Under
    ``pdl`` a program waits for the kernel before it (which wrote ``offs``) before any read. Rows past ``offs[-1]``
    are not written. ``early`` (with ``rows``): the last ``early`` groups are every token of x in order (an MoE's
    folded shared experts, as ``moe_route`` lays them out), their tiles launched first and run without the wait:
    a decode step's w1/w3, whose x (the normed tokens) came before the routing kernel right before it, compute the
    shared experts while the routing runs."""
    op = "tiled_weight_only_grouped_mm"
    if fmt not in FORMATS or x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1 or x.stride(0) % 8:
        raise ValueError(f"{op}: mxfp4, nvfp4 or mxfp8 and x bf16 [M, K] with rows 16-byte aligned, got {fmt} "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")  # fmt: skip
    e, n = words.shape[:2] if words.dim() == 3 else (0, 0)
    k, sb = x.shape[1], 2 if fmt == "nvfp4" else 1
    shapes = (e, n, k // codes_per_word(fmt)), (e, n, k // 32 * sb)
    if words.dim() != 3 or n % 16 or k % BLOCK_K.value or (tuple(words.shape), tuple(scales.shape)) != shapes:
        raise ValueError(f"{op}: pack's words [E, N, {k // codes_per_word(fmt)}] and scales [E, N, {k // 32 * sb}], "
                         f"N a multiple of 16 and K = {k} of {BLOCK_K.value}; got {tuple(words.shape)} and "
                         f"{tuple(scales.shape)}")  # fmt: skip
    if offs.dim() != 1 or offs.dtype != torch.int32 or offs.shape[0] != e:
        raise ValueError(f"{op}: offs must be int32 [E] for E = {e} experts, got {offs.dtype} {tuple(offs.shape)}")
    if rows is not None and (rows.dim() != 1 or rows.dtype != torch.int32 or rows.device != x.device):
        raise ValueError(f"{op}: rows must be an int32 [M] tensor on x's device, got {rows.dtype} "
                         f"{tuple(rows.shape)} on {rows.device}")  # fmt: skip
    if (tensor_scale is None) != (fmt != "nvfp4"):
        raise ValueError(f"{op}: nvfp4 takes a tensor scale, mxfp4 and mxfp8 none")
    m = x.shape[0] if rows is None else rows.shape[0]
    tokens = x.shape[0]
    check_early(op, early, rows, e, m, tokens)
    out = torch.empty((m, n // 2 if swiglu else n), dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return out
    steps = k // BLOCK_K.value
    if kw is None:
        kw = grouped_kw(m, n, k, e, torch.cuda.get_device_properties(x.device).multi_processor_count)
    if kw not in (1, 2, 4, 8, 16):
        raise ValueError(f"{op}: kw is the warps splitting K, a power of 2 up to 16; got {kw}")
    ts, stride_te, stride_tn = tensor_scales(tensor_scale, n, out)
    offs, rows = offs.contiguous(), None if rows is None else rows.contiguous()
    slots = row_slots(m, GROUPED_BLOCK_M, e)
    if early:  # each shared group's tiles, then the routed rows' slots over the routed groups
        slots = early * triton.cdiv(tokens, GROUPED_BLOCK_M) + row_slots(m - early * tokens, GROUPED_BLOCK_M, e - early)
    tiled_weight_only_kernel[(n // 16, 1, slots)](
        x, words, scales, ts, out, out, out, offs, rows if rows is not None else out, m, n, k, k, 1, x.stride(0),
        out.stride(0), stride_tn, e, words.stride(0), scales.stride(0), stride_te, tokens if early else 0, FMT=fmt,
        BLOCK_M=GROUPED_BLOCK_M, T=1, W=kw, SPLIT=False, WIDE=wide, SWIGLU=swiglu, PDL=pdl, WGMMA=False, UNROLL=0,
        KW=kw, GROUPED=True, GATHER=rows is not None, E_POW2=max(2, triton.next_power_of_2(e)),
        RAGGED=steps % kw != 0, EARLY=early, num_warps=kw, launch_pdl=pdl,
    )  # fmt: skip
    return out
