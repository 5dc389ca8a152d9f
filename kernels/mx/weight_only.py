"""Weight-only GEMM for Hopper: out [M, N] = x [M, K] (bf16) @ dequantize(w) [N, K].T, bf16 out, fp32
accumulation, with w packed as mx_recipe.formats packs it and upcast in registers. Also grouped, for MoE experts.

Formats (``fmt``) and the bytes the kernel reads, all in the formats' natural layout, along K:

* ``mxfp8``: codes [N, K] e4m3 bytes, scales [N, K/32] e8m0 bytes;
* ``mxfp4``: codes [N, K/2] bytes, two e2m1 codes each (element 2j in the low nibble), scales [N, K/32] e8m0;
* ``nvfp4``: codes as mxfp4, scales [N, K/16] e4m3 bytes, and a fp32 tensor scale applied to the accumulator.

Why the natural layout: a program reads a [BLOCK_N, BLOCK_K] tile of codes as BLOCK_N contiguous runs of
BLOCK_K bytes (BLOCK_K/2 for e2m1), at least 32 at the configs below: whole 32-byte sectors. Its scales are
BLOCK_N runs of BLOCK_K/32 (/16) bytes, 1/32 (1/16) of the code bytes, whose sectors the program's next K tiles
read again from cache. Interleaving the scales with the codes or pre-tiling K-major saves no bytes: it could
only trade address arithmetic, and it would make the packed weight differ from the formats' (checkpoints,
``dequantize``). So the kernel reads the weights as they are stored.

In the register tile (NVFP4's tensor-core path, and the MX formats' under a config without SCALED) the upcast is
integer bit operations, exact, with no fp8 conversion instruction (so Triton's CPU interpreter, whose fp8
conversions are wrong, checks the kernel too):

* an e4m3 code c as fp32 bits ``(c & 0x7F) << 20 | (c & 0x80) << 24`` is its value times 2**-120 (subnormal
  codes land on fp32 subnormals, which fp32 multiplies keep: Triton flushes none); 0x7F / 0xFF give NaN;
* an e2m1 code c as fp32 bits ``(c & 7) << 22 | (c & 8) << 28`` is its value times 2**-126;
* an e8m0 scale byte e is 2**(e - 127) as fp32 bits ``e << 23`` (e = 0: 2**-127, a subnormal), NaN for 0xFF.

There each weight is then ``(bits * 2**120 or 2**126) * scale`` in fp32, exact while it stays in
bf16's normal range, as ``dequantize`` computes it, cast to bf16 (exact: at most 6 significant bits) for a bf16
``tl.dot``. For nvfp4, ``e2m1 * e4m3`` is exact and the tensor scale multiplies the fp32 sum once, as the
hardware's NVFP4 GEMM does; ``dequantize(bf16)`` rounds every weight after that product instead, so the two
differ by one bf16 rounding per weight on top of the summation order.

Every path keeps e2m1 weights in their packed order (``tl.dot_scaled``'s too). In the register tile the low
nibbles (even k) and high nibbles (odd k) of a tile are two [BLOCK_N, BLOCK_K/2] operands, and x is read as its
even and odd columns to match (two dots, no interleave of the weight in registers).

Small M (decode, up to FMA_MAX_M rows per group): no tl.dot, whose 16-row tile would be mostly padding and whose
operand layout would cost the upcast weights a trip through shared memory; CUDA-core FMAs instead. x and w are
read as pairs of consecutive K elements: x as int32 (two bf16), w as a byte of two e2m1 codes or a uint16 of
two e4m3 codes, K contiguous in both. A program owns BLOCK_N rows of w (output columns) and its split's range of
K. Each thread reads a unit of UNIT (4 or 8) pairs of each row of x (16 or 32 bytes) and the same pairs of each
of its w rows (UNIT or 2 * UNIT bytes a row; a warp reads 32 * that contiguous bytes of a row), so that x's and w's
tiles take one register layout (hence BLOCK_K a multiple of 64 * UNIT * num_warps) and each upcast x pair serves
all the program's w rows. For e2m1 weights x is read in that layout by inline PTX, 16 bytes a load (X_VEC: where
x's rows and the weight's are 16-byte aligned, which is where Triton gives a thread its unit's pairs together): a
tl.load takes a coalesced layout of 4 pairs a thread, and x then passes through shared memory, with barriers, every
K step. One H200, Llama 3 8B, batch 1 step with PDL: MXFP4 2.402 -> 2.275 ms, NVFP4 2.387 -> 2.272; MXFP8 2.642 ->
2.782, slower, so e4m3 weights keep the tl.load.
Each pair takes few instructions to two exact fp32 values (about a tenth of a batch-1 step; the loop is not bound by
them, docs/DESIGN.md): an e4m3 pair by the hardware conversion to f16x2 (``cvt.rn.f16x2.e4m3x2``, sm_89+; every e4m3
value, NaN included, is an f16), then each f16 to fp32; e2m1 by inline PTX on a word of 4 pairs, as f16 bits
``(c & 7) << 9 | (c & 8) << 12`` (the value times 2**-14, all in the f16's top byte: masks and shifts build 4 such
bytes at once, a byte permute moves each into an f16), then fp32. Under the interpreter the integer bit operations
above give the same values.
x's bf16 -> fp32 is done once per x element, for all the program's w rows. Per unit (8 or 16 elements, inside one
scale block) a thread sums the products in fp32 in K order, one chain of FMAs, one instruction a product (each
product exact: 8 by at most 4 significant bits, none below 2**-149), multiplies the sum by 2**14 for e2m1, then by
the block's scale, and accumulates; the units are summed across threads once, after the K loop. The scale multiply
is exact for e8m0 (fp32 bits ``max(e << 23, 0x400000)``, bit 22 set for 0xFF: NaN), one fp32 rounding per unit for
nvfp4's e4m3 scales. The
scale bytes are read by inline PTX, in the unit sums' register layout: a tl.load takes Triton's coalesced layout,
and converting it cost a trip through shared memory every K step. Its configs are per weight shape (FMA_CANDIDATES;
FMA_CHOSEN from ``benchmarks/bench_decode.py --sweep``); K is split over programs until the GEMM has
FMA_PROGRAMS_PER_SM programs an SM, or as the config says.

Larger M (up to mx_recipe.infer.weight_only's LARGE_M): a tensor-core tile, configs by M. For the MX formats it
is ``tl.dot_scaled`` (``SCALED``: x as a bf16 operand without scales, the codes as e4m3 or e2m1 with their e8m0
scales), which Triton compiles on Hopper to an upcast of each weight tile to bf16 (element times 2**e, NaN for
the 0xFF scale) ahead of a bf16 wgmma, pipelined STAGES deep (SCALED_CANDIDATES); K split to
SCALED_PROGRAMS_PER_SM programs an SM. With a K tail (K not a multiple of BLOCK_K) e2m1 tiles run unpipelined:
with Triton 3.6 on an H100 the pipelined loop over a masked e2m1 tile gave wrong sums at almost every output
(2026-11-28; e4m3 and whole tiles were right). Its upcast is exact where element * 2**e is a bf16 normal or zero: a
scale byte of 0 or 1 (2**-127, 2**-126) can push a weight below bf16's normal range, where it may flush to 0
instead of the reference's bf16 subnormal (weights under 2**-120 or so: none a trained model has). Against
the upcast written here (integer bit operations in registers, the tile then shared with the MMA through shared
memory), on an H100 (2026-11-28), us per GEMM of Llama 3 8B's fused w1/w3 (28672 x 4096) at M = 8 / 32 / 128:
MXFP4 136 / 423 / 939 -> 70 / 73 / 102, MXFP8 116 / 131 / 217 -> 69 / 74 / 115, cuBLAS on the bf16 weight 97 /
85 / 90. NVFP4 (e4m3 scales per 16 and a tensor scale, which ``tl.dot_scaled`` does not take) keeps the upcast
written here, x the dot's first operand, BLOCK_M at least 16, the tile's scales multiplied in by block
(CANDIDATES), K split to PROGRAMS_PER_SM.

Hopper (sm_90), 5 to GLUON_MAX_M rows, dense, K a multiple of 128: the Gluon kernel
(mx_kernels.gluon.weight_only_mma), which keeps the upcast weights in registers as wgmma's A operand
(out^T = w x^T) instead of passing them through shared memory as both tiles above do. It is the default there
(``gluon_config``), and the tuner times GLUON_CANDIDATES beside the tiles above. On an H200
(2026-11-29), us per GEMM at M = 32, Gluon against the best tile above and cuBLAS on the bf16 weight: MXFP4
fused w1/w3 43.9 / 69.7 / 59.0, w2 (4096 x 14336) 24.7 / 39.3 / 33.9; NVFP4 w1/w3 47.7 / 219.7; MXFP8 54.3 / 68.8.

Split K, every path: each split stores its fp32 partial; the last split of a tile to finish (an atomic counter
per tile) sums the partials in split order, so the result does not depend on timing, writes bf16 and resets
the counter. The counters are one zeroed buffer per device, shared: two split GEMMs must not run at once on
different streams.

SwiGLU (``swiglu``): the weight is w1 and w3 concatenated along N. On the small-M path a program takes
BLOCK_N / 2 rows of each, the same hidden units, and its epilogue rounds both halves to bf16 (as the unfused
GEMM's output) and writes silu(gate) * up with ``silu_mul``'s roundings (mx_kernels.decode_fused.swiglu): the
decode step's silu * mul launch folded into the GEMM, bit for bit the unfused GEMM then ``silu_mul`` on the same
tiles and split. The tensor-core path runs the GEMM, then ``silu_mul``: there the halved tile cost more than the
launch it saves.

NVFP4's tensor scale is one fp32 value, or one per row of N: weights concatenated along N (fused projections)
keep each part's own scale, and each output column is multiplied by its row's. Grouped, also one per group and
row ([E, N, 1]): experts with shared experts of their own scale folded in after them.

Grouped (MoE): x [M_total, K] sorted by expert, ``offs`` [E] int32 cumulative row ends, w [E, N, K]. The grid
has as many row-tile slots as any ``offs`` can need, (M_total + min(E, M_total) * (BLOCK_M - 1)) // BLOCK_M
(``row_slots``: M_total at decode, not M_total + E); each program finds its expert and rows from ``offs`` and a
program without rows returns at once, so an expert without tokens costs no weight bytes (decode: only the top-k
experts' weights are read). With ``rows`` (int32 [M_total]) the groups' rows are x[rows], x the tokens [T, K]:
each program reads its rows' indices, then the rows in place, where an MoE would first copy x[rows] (two
launches a step). Under PDL (mx_kernels.pdl) a dense small-M program reads its first K step's weights before it
waits for the kernel before. A grouped one waits before any read, but where ``offs`` and ``rows`` come from an
earlier kernel than that one (``offs_ready``: an MoE's w2, after w1/w3 on the same rows): that kernel is then
complete, since the kernel before released this one only after its own wait, and the program finds its rows and
expert before the wait. Its weights it reads after the wait, where they do not take the bandwidth of the kernel
before (an MoE's w1/w3).

Large M (prefill) is compute-bound: ``dequantize`` writes the bf16 weight in one pass, bit for bit the
reference's, for cuBLAS (mx_recipe.infer.weight_only decides).

Under the interpreter (TRITON_INTERPRET=1) the dot runs in fp32 on the same exact values (the interpreter's
bf16 is raw uint16), and its fp32 -> bf16 output cast truncates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl
from mx_kernels import pdl
from mx_kernels.common import arrival_counters, cuda_capability, interpreting
from mx_kernels.decode_fused import silu_mul, swiglu
from mx_kernels.launch_cache import LaunchCache
from mx_kernels.spec import cdiv

# fmt -> (elements per scale, elements per code byte)
FORMATS = {"mxfp8": (32, 1), "mxfp4": (32, 2), "nvfp4": (16, 2)}


# The register tile's configs (NVFP4's tensor-core path), by M bucket: the first whose max_m >= M (per group, for the
# grouped GEMM); the last takes the rest. BLOCK_K counts the elements of fp8 weights; e2m1 tiles take twice as many
# elements, the same bytes. The first candidate of a bucket is its default; ``set_tuning(True)`` times them all once
# per shape and keeps the fastest (with split K off and as the SM count asks). The upcast weights take registers (fp32
# values, then bf16 in the dot's layout): compiled for sm_90a, 16 x 32 x 64 fp8 tiles take about 60 registers a thread
# and 64 x 64 x 64 about 125; 128 columns wide, a tile needs 8 warps not to spill. The 128-wide tiles, pipelined, lead
# up to 32 rows: on one H200 (2026-11-29), NVFP4, us per GEMM of Llama 3 8B's fused w1/w3 and w2 at M = 32, 393 -> 222
# and 190 -> 107 (M = 8: 104 -> 89 and 49 -> 45), against the fastest 64-wide tile. Past M = 128 a GEMM is compute-
# bound and ``dequantize_bf16`` + cuBLAS serves it better (mx_recipe.infer.weight_only).
CANDIDATES = (
    (16, [
        dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, num_warps=8, PREFETCH=False, num_stages=3),
        dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, PREFETCH=False),
        dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, PREFETCH=True),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, PREFETCH=False),
        dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, num_warps=4, PREFETCH=False),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=8, PREFETCH=False),
    ]),
    (32, [
        dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=8, PREFETCH=False, num_stages=3),
        dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=8, PREFETCH=False),
        dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, num_warps=4, PREFETCH=False),
        dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, num_warps=4, PREFETCH=True),
    ]),
    (64, [
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32, num_warps=8, PREFETCH=False),
        dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=8, PREFETCH=False),
        dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, num_warps=4, PREFETCH=False),
    ]),
    (None, [
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32, num_warps=8, PREFETCH=False),
        dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, num_warps=8, PREFETCH=False),
        dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=8, PREFETCH=False),
    ]),
)  # fmt: skip


def _scaled(block_m: int, block_n: int, block_k: int, num_warps: int, stages: int = 3) -> dict:
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, STAGES=stages, SCALED=True)


# The tl.dot_scaled path's configs (the MX formats), by M bucket as CANDIDATES; BLOCK_K counts elements, for e4m3
# and e2m1 alike. Compiled for sm_90a none spills (dense; 2026-11-28: 128 x 64 x 128 tiles did). The first of a
# bucket is its default: at M = 8 and 32 the fastest on an H100 for Llama 3 8B's fused w1/w3; at M = 128 the
# fastest there that does not spill; the 64-row bucket's is untimed. ``set_tuning(True)`` times them all, and split
# K 1, 2 and 4.
SCALED_CANDIDATES = (
    (16, [_scaled(16, 64, 128, 4), _scaled(16, 128, 64, 4), _scaled(16, 64, 64, 4)]),
    (32, [_scaled(32, 64, 128, 4), _scaled(32, 128, 64, 8), _scaled(32, 64, 64, 4)]),
    (64, [_scaled(64, 64, 128, 8), _scaled(64, 64, 64, 4), _scaled(64, 128, 64, 8)]),
    (None, [_scaled(128, 128, 64, 8), _scaled(64, 64, 128, 8), _scaled(128, 64, 64, 4)]),
)
# The small-M (decode) path, for up to FMA_MAX_M rows (per group). Its configs by weight shape (N, K): Llama 3
# 8B's projections, alone and fused (wq/wo, wk/wv, w1/w3, w2, qkv, w1w3); None: any other shape. BLOCK_K counts
# elements, a multiple of 64 * UNIT * num_warps so that x's and w's tiles take one layout (module doc); BLOCK_N is for
# one row of x and halves as the rows double; SPLIT_K None: from the SM count (FMA_PROGRAMS_PER_SM). The first
# candidate of a shape is its default; FMA_CHOSEN names the one to use per (format, N, K): what tuning picks in
# the decode step (``benchmarks/bench_decode.py``; ``--sweep`` times each config alone).
FMA_MAX_M = 4
FMA_PROGRAMS_PER_SM = 4


def _fma(block_n: int, block_k: int, split_k: int | None, num_warps: int, num_stages: int = 1, unit: int = 4
         ) -> dict:  # fmt: skip
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=num_warps, num_stages=num_stages,
                UNIT=unit)  # fmt: skip


def _fma_grid(splits: tuple[int | None, ...]) -> list[dict]:
    """BLOCK_N 4, 8 and 16 by (warps, BLOCK_K, UNIT) (2, 1024, 8), (4, 2048, 8), (1, 512, 8), (1, 256, 4), by
    ``splits``. Units of 8 pairs a thread (twice the bytes a load, one scale load and one scale multiply per 16
    elements): compiled for sm_90a 13-15% fewer instructions an element in the loop at M = 1 than units of 4
    (``scripts/sass_loop_count.py``), and faster in the step: Llama 3 8B dims, batch 1, one H200, tuned over units
    of 8 only against units of 4 only, MXFP8 2.874 against 2.913 ms, MXFP4 2.607 against 2.807, NVFP4 2.725
    against 3.316. One warp over 256 elements of K (units of 4): the MoE experts' short K (1408 at MoE 16B dims),
    whose many short programs hide each other's latency."""
    tiles = ((2, 1024, 8), (4, 2048, 8), (1, 512, 8), (1, 256, 4))
    return [_fma(bn, bk, split, warps, unit=unit) for warps, bk, unit in tiles for bn in (8, 4, 16) for split in splits]


FMA_CANDIDATES: dict[tuple[int, int] | None, list[dict]] = {
    (4096, 4096): _fma_grid((None, 1, 2)),  # wq, wo
    (1024, 4096): _fma_grid((None, 2, 4, 8)),  # wk, wv
    (14336, 4096): _fma_grid((None, 1)),  # w1, w3
    (4096, 14336): _fma_grid((None, 1, 2, 4)),  # w2
    (6144, 4096): _fma_grid((None, 1, 2)),  # wq wk wv fused
    (28672, 4096): _fma_grid((None, 1)),  # w1 w3 fused
    None: _fma_grid((None,)),
}
# chosen on one NVIDIA H200 (torch 2.11.0+cu130, 2026-11-29) by tuning the Llama 3 8B decode step at batch 1 (MXFP8
# at one row takes mx_kernels.decode_gemv there)
FMA_CHOSEN: dict[tuple[str, int, int], dict] = {
    ("mxfp4", 6144, 4096): _fma(4, 1024, 1, 2, unit=8),
    ("mxfp4", 4096, 4096): _fma(8, 2048, 1, 4, unit=8),
    ("mxfp4", 28672, 4096): _fma(8, 512, 1, 1, unit=8),
    ("mxfp4", 4096, 14336): _fma(8, 2048, 1, 4, unit=8),
    ("nvfp4", 6144, 4096): _fma(4, 1024, 1, 2, unit=8),
    ("nvfp4", 4096, 4096): _fma(8, 2048, None, 4, unit=8),
    ("nvfp4", 28672, 4096): _fma(8, 512, None, 1, unit=8),
    ("nvfp4", 4096, 14336): _fma(8, 2048, 1, 4, unit=8),
}
# The Gluon wgmma kernel's configs (mx_kernels.gluon.weight_only_mma): dense GEMMs of 5 to GLUON_MAX_M rows
# and K a multiple of 128; tuning candidates beside the tensor-core tiles (``gluon_ok``), SPLIT_K as given. A
# launch takes at most 64 rows (wgmma's N), so 65-128 rows are two launches, each reading the weight: still
# NVFP4's fastest there (us, one H200, fused w1/w3 at M = 128: register tile 949, Gluon 2 x 76).
GLUON_MAX_M = 128
GLUON_PROGRAMS_PER_SM = 4  # gluon_config's split K: at most this many programs an SM
GLUON_CANDIDATES = [dict(GLUON=True, num_warps=w, SPLIT_K=s) for w in (4, 8) for s in (1, 2, 4, 8)]
PROGRAMS_PER_SM = 8  # split K until a GEMM has this many programs per SM: small tiles, several programs an SM
SCALED_PROGRAMS_PER_SM = 2  # the tl.dot_scaled tiles': pipelined, large
MAX_SPLIT_K = 16
MAX_COLD_COPIES = 64  # weight copies a tuning run cycles through (cold_copies)
COUNTERS = 1 << 16  # split-K tiles a launch may have


@triton.jit
def _e8m0(e):
    """e8m0 bytes (int32) -> 2**(e - 127) in fp32; NaN for 0xFF."""
    bits = tl.where(e == 0, 0x400000, e << 23)
    return tl.where(e == 0xFF, float("nan"), bits.to(tl.float32, bitcast=True))


@triton.jit
def _e4m3(c):
    """e4m3 bytes (int32) -> value * 2**-120 in fp32 (exact); NaN for 0x7F and 0xFF."""
    v = (((c & 0x7F) << 20) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)
    return tl.where((c & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def _e2m1(c):
    """e2m1 codes (int32, 0..15) -> value * 2**-126 in fp32 (exact)."""
    return (((c & 7) << 22) | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _whole_blocks(N: tl.constexpr, PER_BLOCK: tl.constexpr, BLOCK_ELEMS: tl.constexpr, left):
    """A K tail's mask over a tile's N loaded items, PER_BLOCK items a block of BLOCK_ELEMS elements of K: a block
    is in or out whole (K is a multiple of the block). Built from a plain arange, it is provably constant over a
    block, so the block's items stay one wide load; a mask from the tile's offsets (which carry contiguity hints)
    compiled to one load an item."""
    return (tl.arange(0, N) // PER_BLOCK) * BLOCK_ELEMS < left


@triton.jit
def _scaled(v, factor, GROUP: tl.constexpr):
    """v [BN, BK'] times its block's factor [BN, BK' / GROUP]."""
    BN: tl.constexpr = v.shape[0]
    BK: tl.constexpr = v.shape[1]
    v3 = tl.reshape(v, (BN, BK // GROUP, GROUP)) * factor[:, :, None]
    return tl.reshape(v3, (BN, BK))


@triton.jit
def _row_tile(offs_ptr, slot, M, E, GROUPED: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """The rows of row-tile slot ``slot``: (first row, end of the tile's group, expert; -1: a slot without rows).
    Grouped, the slot-th tile over the groups in order, each group cut in BLOCK_M rows."""
    if GROUPED:
        e_idx = tl.arange(0, E_POW2)
        ends = tl.load(offs_ptr + e_idx, mask=e_idx < E, other=0, cache_modifier=".cg")
        starts = tl.load(offs_ptr + e_idx - 1, mask=(e_idx > 0) & (e_idx < E), other=0, cache_modifier=".cg")
        tiles = tl.where(e_idx < E, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
        after = tl.cumsum(tiles, 0)
        hit = (slot >= after - tiles) & (slot < after)
        expert = tl.max(tl.where(hit, e_idx, -1), 0)
        row0 = tl.sum(tl.where(hit, starts + (slot - (after - tiles)) * BLOCK_M, 0), 0)
        row_end = tl.sum(tl.where(hit, ends, 0), 0)
        return row0, row_end, expert
    else:
        return slot * BLOCK_M, M, 0


@triton.jit
def _program_tile(
    offs_ptr, w_ptr, s_ptr, ts_ptr, stride_we, stride_se, stride_te, slot, pid_n, M, N, E, GROUPED: tl.constexpr,
    E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWIGLU: tl.constexpr,
):  # fmt: skip
    """A program's rows (rm; rm_in: those past its tile repeat its first, so loads need no masks), its tile's
    end, its expert (-1: a slot without rows, which the kernel returns on), its weight rows (rn, N where past the
    weight; rn_in wrapped into N) and its expert's weight, scale and tensor-scale pointers. SWIGLU: the first half
    of the rows are BLOCK_N / 2 gate rows (w1, the weight's first N / 2), the second the same rows of w3 (the second
    half)."""
    row0, row_end, expert = _row_tile(offs_ptr, slot, M, E, GROUPED, E_POW2, BLOCK_M)
    if GROUPED:
        w_ptr += tl.maximum(expert, 0).to(tl.int64) * stride_we
        s_ptr += tl.maximum(expert, 0).to(tl.int64) * stride_se
        ts_ptr += tl.maximum(expert, 0) * stride_te
    rm = row0 + tl.arange(0, BLOCK_M)
    rm_in = tl.where(rm < row_end, rm, row0).to(tl.int64)
    if SWIGLU:
        j = tl.arange(0, BLOCK_N)
        col = pid_n * (BLOCK_N // 2) + j % (BLOCK_N // 2)  # the output column: gate and up rows alike
        up = (j // (BLOCK_N // 2)) * (N // 2)
        rn = tl.where(col < N // 2, col + up, N)
        rn_in = (col % (N // 2) + up).to(tl.int64)
    else:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rn_in = (rn % N).to(tl.int64)
    return rm, rm_in, row_end, expert, rn, rn_in, w_ptr, s_ptr, ts_ptr


@triton.jit
def _x_rows(rows_ptr, rm_in, GATHER: tl.constexpr):
    """The rows of x that a program's rows ``rm_in`` read: the same, or ``rows_ptr[rm_in]`` (GATHER: the grouped
    GEMM's rows taken from the tokens by index, an MoE's x[routed] without the copy)."""
    if GATHER:
        return tl.load(rows_ptr + rm_in, cache_modifier=".cg").to(tl.int64)
    return rm_in


@triton.jit
def _finish(acc, rm, rm_in, rn, rn_in, row_end, tile, pid_k, M, N, ts_ptr, stride_tn, out_ptr, stride_om,
            stride_on, ws_ptr, cnt_ptr, SPLIT_K, FMT: tl.constexpr, SPLIT: tl.constexpr,
            SWIGLU: tl.constexpr):  # fmt: skip
    """Store the fp32 tile ``acc`` [BLOCK_M, BLOCK_N] as bf16, times the tensor scale for nvfp4. Split K: store
    this split's partial; the last split of the tile to arrive sums them all in split order, so the result does
    not depend on timing, and resets the tile's counter. SWIGLU: the tile's gate and up halves (``_program_tile``),
    each rounded to bf16 as the GEMM's output, make BLOCK_N / 2 columns of silu(gate) * up (``swiglu``)."""
    row_ok = rm < row_end
    col_ok = rn < N
    if SPLIT:
        ws_tile = ws_ptr + rm_in[:, None] * N + rn_in[None, :]
        tl.store(ws_tile + pid_k * M * N, acc, mask=row_ok[:, None] & col_ok[None, :])
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived != SPLIT_K - 1:
            return
        acc = tl.zeros(acc.shape, dtype=tl.float32)
        for k in range(SPLIT_K):
            acc += tl.load(ws_tile + k * M * N, cache_modifier=".cg")
        tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch
    if FMT == "nvfp4":
        acc = acc * tl.load(ts_ptr + rn_in * stride_tn)[None, :]
    if SWIGLU:
        BM: tl.constexpr = acc.shape[0]
        HALF: tl.constexpr = acc.shape[1] // 2
        h = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        gate, up = tl.split(tl.permute(tl.reshape(h, (BM, 2, HALF)), (0, 2, 1)))
        rn, _ = tl.split(tl.permute(tl.reshape(rn, (2, HALF)), (1, 0)))  # the gate rows: the output columns
        out_ptrs = out_ptr + rm_in[:, None] * stride_om + rn[None, :] * stride_on
        tl.store(out_ptrs, swiglu(gate, up, out_ptr.dtype.element_ty), mask=row_ok[:, None] & (rn < N)[None, :])
    else:
        out_ptrs = out_ptr + rm_in[:, None] * stride_om + rn[None, :] * stride_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _load_tile(w_ptrs, s_ptrs, x_ptrs, stride_xk, left, kb, ks, PACK: tl.constexpr, GROUP: tl.constexpr,
               EVEN_K: tl.constexpr):  # fmt: skip
    """The code bytes, scale bytes and x columns (even and odd ones for e2m1) of the tile with ``left`` elements of
    K still to go: the whole tile, its head (a K tail: codes and scales 0, x 0 past it), or nothing (left <= 0)."""
    if EVEN_K:
        ok = left > 0
        w = tl.load(w_ptrs, mask=ok, other=0)
        s = tl.load(s_ptrs, mask=ok, other=0)
        x0 = tl.load(x_ptrs, mask=ok, other=0.0)
        x1 = x0
        if PACK == 2:
            x1 = tl.load(x_ptrs + stride_xk, mask=ok, other=0.0)
    else:  # a K tail, masked by scale block
        in_k = _whole_blocks(kb.shape[0], GROUP // PACK, GROUP, left)[None, :]
        w = tl.load(w_ptrs, mask=in_k, other=0)
        s = tl.load(s_ptrs, mask=ks[None, :] < left // GROUP, other=0)
        x0 = tl.load(x_ptrs, mask=in_k, other=0.0)
        x1 = x0
        if PACK == 2:
            x1 = tl.load(x_ptrs + stride_xk, mask=in_k, other=0.0)
    return w, s, x0, x1


@triton.jit
def _register_tile_acc(x_ptr, w_ptr, s_ptr, xm_in, rn_in, k_start, k_end, stride_xm, stride_xk, stride_wn, stride_wk,
                       stride_sn, stride_sk, FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr,
                       DOT_BF16: tl.constexpr):  # fmt: skip
    """acc [BLOCK_M, BLOCK_N] over K in [k_start, k_end), x the dot's first operand (the e2m1 weights' path)."""
    GROUP: tl.constexpr = 16 if FMT == "nvfp4" else 32
    PACK: tl.constexpr = 1 if FMT == "mxfp8" else 2
    BKB: tl.constexpr = BLOCK_K // PACK  # code bytes per row of a tile
    kb = tl.arange(0, BKB)
    ks = tl.arange(0, BLOCK_K // GROUP)
    # x: whole columns (fp8 weights), or even and odd columns (e2m1 weights, in their packed order)
    x_ptrs = x_ptr + xm_in[:, None] * stride_xm + (k_start + PACK * kb[None, :]) * stride_xk
    w_ptrs = w_ptr + rn_in[:, None] * stride_wn + (k_start // PACK + kb[None, :]) * stride_wk
    s_ptrs = s_ptr + rn_in[:, None] * stride_sn + (k_start // GROUP + ks[None, :]) * stride_sk

    # PREFETCH: one tile ahead, the next tile's bytes in flight while this one is upcast and multiplied (more
    # registers a program: fewer programs an SM); else the SM's other programs hide the loads' latency.
    if PREFETCH:
        w, s, x0, x1 = _load_tile(w_ptrs, s_ptrs, x_ptrs, stride_xk, k_end - k_start, kb, ks, PACK, GROUP, EVEN_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if PREFETCH:
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BKB * stride_wk
            s_ptrs += (BLOCK_K // GROUP) * stride_sk
            left = k_end - k0 - BLOCK_K
            w_next, s_next, x0_next, x1_next = _load_tile(w_ptrs, s_ptrs, x_ptrs, stride_xk, left, kb, ks, PACK,
                                                          GROUP, EVEN_K)  # fmt: skip
        else:
            w, s, x0, x1 = _load_tile(w_ptrs, s_ptrs, x_ptrs, stride_xk, k_end - k0, kb, ks, PACK, GROUP, EVEN_K)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BKB * stride_wk
            s_ptrs += (BLOCK_K // GROUP) * stride_sk
        w, s = w.to(tl.int32), s.to(tl.int32)
        if FMT == "nvfp4":
            factor = _e4m3(s) * 1.329227995784916e36  # 2**120: the e4m3 scale's value
        else:
            factor = _e8m0(s)
        if PACK == 1:
            w0 = _scaled(_e4m3(w) * 1.329227995784916e36, factor, GROUP)
        else:
            w0 = _scaled(_e2m1(w & 0xF) * 8.507059173023462e37, factor, GROUP // 2)  # 2**126
            w1 = _scaled(_e2m1(w >> 4) * 8.507059173023462e37, factor, GROUP // 2)
        if DOT_BF16:
            acc = tl.dot(x0, tl.trans(w0.to(tl.bfloat16)), acc)
            if PACK == 2:
                acc = tl.dot(x1, tl.trans(w1.to(tl.bfloat16)), acc)
        else:
            acc = tl.dot(x0.to(tl.float32), tl.trans(w0), acc, input_precision="ieee")
            if PACK == 2:
                acc = tl.dot(x1.to(tl.float32), tl.trans(w1), acc, input_precision="ieee")
        if PREFETCH:
            w, s, x0, x1 = w_next, s_next, x0_next, x1_next
    return acc


@triton.jit
def _scaled_acc(x_ptr, w_ptr, s_ptr, xm_in, rn_in, k_start, k_end, stride_xm, stride_xk, stride_wn, stride_wk,
                stride_sn, stride_sk, FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """acc [BLOCK_M, BLOCK_N] over K in [k_start, k_end) by tl.dot_scaled (the MX formats' path)."""
    PACK: tl.constexpr = 1 if FMT == "mxfp8" else 2
    # tl.constexpr(...) is a no-op when compiled; the interpreter would pass a plain str, which dot_scaled cannot read
    ELEM: tl.constexpr = tl.constexpr("e4m3" if FMT == "mxfp8" else "e2m1")
    kx = tl.arange(0, BLOCK_K)
    kw = tl.arange(0, BLOCK_K // PACK)
    ks = tl.arange(0, BLOCK_K // 32)
    x_rows = x_ptr + xm_in[:, None] * stride_xm
    w_rows = w_ptr + rn_in[:, None] * stride_wn
    s_rows = s_ptr + rn_in[:, None] * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        x_at = x_rows + (k0 + kx)[None, :] * stride_xk
        w_at = w_rows + (k0 // PACK + kw)[None, :] * stride_wk
        s_at = s_rows + (k0 // 32 + ks)[None, :] * stride_sk
        if EVEN_K:
            x = tl.load(x_at)
            w = tl.load(w_at)
            s = tl.load(s_at)
        else:  # a K tail (K is a multiple of 32): codes and scales 0 past it, a zero product
            left = k_end - k0
            x = tl.load(x_at, mask=_whole_blocks(BLOCK_K, 32, 32, left)[None, :], other=0.0)
            w = tl.load(w_at, mask=_whole_blocks(BLOCK_K // PACK, 32 // PACK, 32, left)[None, :], other=0)
            s = tl.load(s_at, mask=(32 * ks < left)[None, :], other=0)
        acc = tl.dot_scaled(x, None, tl.constexpr("bf16"), w.T, s, ELEM, acc)
    return acc


@triton.jit
def _weight_only_kernel(
    x_ptr, w_ptr, s_ptr, ts_ptr, offs_ptr, rows_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, E, K_SPLIT, SPLIT_K,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_te, stride_tn,
    stride_om, stride_on,
    FMT: tl.constexpr, GROUPED: tl.constexpr, GATHER: tl.constexpr, E_POW2: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    SCALED: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr, DOT_BF16: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The tensor-core path: one program's [BLOCK_M, BLOCK_N] tile over its split of K; ``SCALED``: by
    tl.dot_scaled, else the upcast written here (module doc)."""
    pdl.wait_prior(PDL)  # every program, the grouped early return's too (mx_kernels.pdl)
    pdl.release_next(PDL)
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    pid_k = tl.program_id(2)

    rm, rm_in, row_end, expert, rn, rn_in, w_ptr, s_ptr, ts_ptr = _program_tile(
        offs_ptr, w_ptr, s_ptr, ts_ptr, stride_we, stride_se, stride_te, slot, pid_n, M, N, E, GROUPED, E_POW2, BLOCK_M,
        BLOCK_N, False,
    )  # fmt: skip
    if GROUPED:
        if expert < 0:
            return
    xm_in = _x_rows(rows_ptr, rm_in, GATHER)
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    if SCALED:
        acc = _scaled_acc(x_ptr, w_ptr, s_ptr, xm_in, rn_in, k_start, k_end, stride_xm, stride_xk, stride_wn,
                          stride_wk, stride_sn, stride_sk, FMT, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, STAGES)  # fmt: skip
    else:
        acc = _register_tile_acc(x_ptr, w_ptr, s_ptr, xm_in, rn_in, k_start, k_end, stride_xm, stride_xk,
                                 stride_wn, stride_wk, stride_sn, stride_sk, FMT, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                                 PREFETCH, DOT_BF16)  # fmt: skip
    # SPLIT: SPLIT_K > 1, a runtime value: one compiled kernel for every split
    _finish(acc, rm, rm_in, rn, rn_in, row_end, pid_n * tl.num_programs(1) + slot, pid_k, M, N, ts_ptr, stride_tn,
            out_ptr, stride_om, stride_on, ws_ptr, cnt_ptr, SPLIT_K, FMT, SPLIT, False)  # fmt: skip


# e4m3 pair (uint16, element 2j in the low byte) -> its two values in fp32, exact: the hardware conversion to f16x2
# (sm_89+: every e4m3 value, subnormals and NaN included, is an f16), then each f16 to fp32
_E4M3X2_PTX = tl.constexpr("""{ .reg .b32 h; .reg .b16 lo, hi;
cvt.rn.f16x2.e4m3x2 h, $2; mov.b32 {lo, hi}, h; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }""")
# 4 bytes of two e2m1 codes ($8: pairs j = 0..3, element 2j in the low nibble) -> their values * 2**-14 in fp32:
# $0-$3 the low nibbles', $4-$7 the high ones'. f16 bits (c & 7) << 9 | (c & 8) << 12 are code c's value * 2**-14
# (0.5: an f16 subnormal), all in the f16's top byte: built for 4 codes a word, moved into f16x2 halves, each to fp32.
_E2M1X8_PTX = tl.constexpr("""{ .reg .b32 t, m, s, lo, hi, p; .reg .b16 a, b;
and.b32 m, $8, 0x70707070; shr.b32 m, m, 3; and.b32 s, $8, 0x80808080; or.b32 hi, m, s;
shl.b32 t, $8, 4; and.b32 m, t, 0x70707070; shr.b32 m, m, 3; and.b32 s, t, 0x80808080; or.b32 lo, m, s;
prmt.b32 p, lo, 0, 0x1404; mov.b32 {a, b}, p; cvt.f32.f16 $0, a; cvt.f32.f16 $1, b;
prmt.b32 p, lo, 0, 0x3424; mov.b32 {a, b}, p; cvt.f32.f16 $2, a; cvt.f32.f16 $3, b;
prmt.b32 p, hi, 0, 0x1404; mov.b32 {a, b}, p; cvt.f32.f16 $4, a; cvt.f32.f16 $5, b;
prmt.b32 p, hi, 0, 0x3424; mov.b32 {a, b}, p; cvt.f32.f16 $6, a; cvt.f32.f16 $7, b; }""")


@triton.jit
def _pair_values(w, FMT: tl.constexpr, HW: tl.constexpr):
    """Pairs of codes (uint16 of two e4m3, or a byte of two e2m1; a thread's UNIT pairs consecutive) -> the values
    of their even and odd elements in fp32, exact: e4m3 values, e2m1 values * 2**-14. HW: the GPU's conversions
    (inline PTX); else integer bit operations (the interpreter, whose fp8 conversions are wrong)."""
    if HW:
        if FMT == "mxfp8":
            return tl.inline_asm_elementwise(_E4M3X2_PTX, "=r,=r,h", [w], dtype=(tl.float32, tl.float32),
                                             is_pure=True, pack=1)  # fmt: skip
        else:
            return tl.inline_asm_elementwise(_E2M1X8_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w],
                                             dtype=(tl.float32, tl.float32), is_pure=True, pack=4)  # fmt: skip
    w = w.to(tl.int32)
    if FMT == "mxfp8":
        return _e4m3(w & 0xFF) * 1.329227995784916e36, _e4m3(w >> 8) * 1.329227995784916e36  # 2**120
    else:
        return _e2m1(w & 0xF) * 5.192296858534828e33, _e2m1(w >> 4) * 5.192296858534828e33  # 2**112


@triton.jit
def _load_scales(ptrs, mask, HW: tl.constexpr, MASKED: tl.constexpr):
    """Scale bytes as int32 (0 where ``mask`` is off, if MASKED) in the layout of ``ptrs``. HW: by inline PTX,
    which Triton leaves in that layout (a tl.load takes its own coalesced layout, and the unit sums' would then
    pass through shared memory every K step)."""
    if HW:
        if MASKED:
            return tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.u32 $0, 0; @p ld.global.nc.u8 $0, [$1]; }", "=r,l,r",
                [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
        return tl.inline_asm_elementwise("ld.global.nc.u8 $0, [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=True,
                                         pack=1)  # fmt: skip
    return tl.load(ptrs, mask=mask if MASKED else None, other=0 if MASKED else None).to(tl.int32)


# x's pairs by 4, one 16-byte load each (X_VEC): a thread's 4 consecutive pairs of its unit, 16-byte aligned.
_X4_PTX = tl.constexpr("ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];")
_X4_MASKED_PTX = tl.constexpr(  # a 16-byte group lies in one unit, which is in or out whole: its first element's mask
    "{ .reg .pred p; setp.ne.b32 p, $8, 0; mov.u32 $0, 0; mov.u32 $1, 0; mov.u32 $2, 0; mov.u32 $3, 0; "
    "@p ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4]; }"
)


@triton.jit
def _load_x(ptrs, mask, X_VEC: tl.constexpr, MASKED: tl.constexpr):
    """x's pairs (int32) at ``ptrs``, 0 where ``mask`` is off (if MASKED). X_VEC: by inline PTX, 16 bytes a load,
    in the layout of ``ptrs`` (the unit sums'); a tl.load takes a coalesced layout of 4 pairs a thread where the
    unit sums hold 8, and the move between the two passes through shared memory, with barriers, every K step."""
    if X_VEC:
        if MASKED:
            return tl.inline_asm_elementwise(_X4_MASKED_PTX, "=r,=r,=r,=r,l,l,l,l,r,r,r,r", [ptrs, mask.to(tl.int32)],
                                             dtype=tl.int32, is_pure=True, pack=4)  # fmt: skip
        return tl.inline_asm_elementwise(_X4_PTX, "=r,=r,=r,=r,l,l,l,l", [ptrs], dtype=tl.int32, is_pure=True, pack=4)
    return tl.load(ptrs, mask=mask if MASKED else None, other=0 if MASKED else None)


@triton.jit
def _fma_weights(w_ptrs, s_ptrs, dk, k_unit, left, EVEN_K: tl.constexpr, PAIRS: tl.constexpr, UNIT: tl.constexpr,
                 GROUP: tl.constexpr, HW: tl.constexpr):  # fmt: skip
    """A K step's code pairs and unit scales, ``dk`` pairs in; with a K tail (``left`` elements of the split
    left) whole units, zeros past it."""
    if EVEN_K:
        w = tl.load(w_ptrs + dk)
        s = _load_scales(s_ptrs + dk // (GROUP // 2), None, HW, False)
    else:
        in_k = _whole_blocks(PAIRS, UNIT, 2 * UNIT, left)[None, None, :]  # by unit: loads a unit wide
        w = tl.load(w_ptrs + dk, mask=in_k, other=0)
        s = _load_scales(s_ptrs + dk // (GROUP // 2), k_unit < left, HW, True)
    return w, s


@triton.jit
def _fma_x(x_ptrs, dk, left, EVEN_K: tl.constexpr, PAIRS: tl.constexpr, UNIT: tl.constexpr, X_VEC: tl.constexpr):
    """A K step's pairs of x, as ``_fma_weights`` reads the weight's."""
    if EVEN_K:
        return _load_x(x_ptrs + dk, None, X_VEC, False)
    in_k = _whole_blocks(PAIRS, UNIT, 2 * UNIT, left)[None, None, :]
    return _load_x(x_ptrs + dk, tl.broadcast_to(in_k, x_ptrs.shape), X_VEC, True)


@triton.jit
def _fma_step(acc, xw, w, s, FMT: tl.constexpr, HW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              NU: tl.constexpr, UNIT: tl.constexpr):  # fmt: skip
    """acc [BLOCK_M, BLOCK_N, NU] plus a K step's unit sums times their scales (module doc)."""
    # bf16 -> fp32 once per element of x, shared by the program's w rows; products exact (module doc)
    x0 = (xw << 16).to(tl.float32, bitcast=True)
    x1 = (xw & -65536).to(tl.float32, bitcast=True)
    w0, w1 = _pair_values(w, FMT, HW)
    # the unit's products in K order, summed in a thread: one FMA chain, an instruction a product
    part = tl.sum(tl.reshape(tl.join(x0 * w0, x1 * w1), (BLOCK_M, BLOCK_N, NU, 2 * UNIT)), axis=3)
    if FMT != "mxfp8":
        part = part * 16384.0  # 2**14: back to the e2m1 values, exact
    if FMT == "nvfp4":
        if HW:
            factor = s.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)  # exact, NaN included
        else:
            factor = _e4m3(s) * 1.329227995784916e36  # 2**120: the e4m3 scale's value
    else:
        # 2**(s - 127) as fp32 bits (s = 0: 2**-127, a subnormal); 0xFF: bit 22 set on inf's bits, NaN
        factor = (tl.maximum(s << 23, 0x400000) | (((s + 1) << 14) & 0x400000)).to(tl.float32, bitcast=True)
    return acc + part * factor


@triton.jit
def _weight_only_fma_kernel(
    x_ptr, w_ptr, s_ptr, ts_ptr, offs_ptr, rows_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, E, K_SPLIT, SPLIT_K,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_te, stride_tn, stride_om,
    FMT: tl.constexpr, GROUPED: tl.constexpr, GATHER: tl.constexpr, E_POW2: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HW: tl.constexpr,
    UNIT: tl.constexpr, SWIGLU: tl.constexpr, OFFS_READY: tl.constexpr, PDL: tl.constexpr, X_VEC: tl.constexpr,
):  # fmt: skip
    """The small-M path (module doc): x [M, K/2] as int32 pairs of bf16, w [N, K/2] as pairs of codes (a byte of
    two e2m1 codes, or a uint16 of two e4m3 codes), K contiguous in both. HW: upcast w with the GPU's conversions
    (else integer bit operations, for the interpreter). Under PDL, dense, the first K step's weights are read
    before the wait for the kernel before; grouped, the rows' tile is found before it where ``offs`` and ``rows``
    come from an earlier kernel (OFFS_READY), and every other read comes after it."""
    GROUP: tl.constexpr = 16 if FMT == "nvfp4" else 32
    PAIRS: tl.constexpr = BLOCK_K // 2
    NU: tl.constexpr = PAIRS // UNIT
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    pid_k = tl.program_id(2)
    if GROUPED:
        if not OFFS_READY:  # the rows' experts come from the kernel before: wait for it before any read
            pdl.wait_prior(PDL)  # every program, the grouped early return's too (mx_kernels.pdl)
            pdl.release_next(PDL)
    rm, rm_in, row_end, expert, rn, rn_in, w_ptr, s_ptr, ts_ptr = _program_tile(
        offs_ptr, w_ptr, s_ptr, ts_ptr, stride_we, stride_se, stride_te, slot, pid_n, M, N, E, GROUPED, E_POW2, BLOCK_M,
        BLOCK_N, SWIGLU,
    )  # fmt: skip
    xm_in = _x_rows(rows_ptr, rm_in, GATHER)
    if GROUPED:
        if OFFS_READY:  # the weights after the wait: read before it, they take the kernel before's bandwidth
            pdl.wait_prior(PDL)
            pdl.release_next(PDL)
        if expert < 0:
            return
    kp = tl.max_contiguous(tl.arange(0, PAIRS), UNIT)  # UNIT-pair runs: x's and w's loads take one layout
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    # [rows of x, rows of w, pairs]: x broadcast over w's rows, w over x's
    x_ptrs = x_ptr + xm_in[:, None, None] * stride_xm + (pid_k * (K_SPLIT // 2) + kp)[None, None, :]
    w_ptrs = w_ptr + rn_in[None, :, None] * stride_wn + (pid_k * (K_SPLIT // 2) + kp)[None, None, :]
    # each unit's scale [rows of x, rows of w, units], indexed by a reduction over its pairs as the unit sums are,
    # so both take one register layout (_load_scales keeps it)
    k_pairs = tl.broadcast_to((2 * kp)[None, None, :], (BLOCK_M, BLOCK_N, PAIRS))
    k_unit = tl.min(tl.reshape(k_pairs, (BLOCK_M, BLOCK_N, NU, UNIT)), axis=3)  # a unit's first k in the tile
    s_ptrs = s_ptr + rn_in[None, :, None] * stride_sn + (k_start + k_unit) // GROUP
    # the first step (every split has one), then the rest; the tile's pointers are loop-invariant ones plus a
    # scalar step (fewer 64-bit adds than advancing them)
    w, s = _fma_weights(w_ptrs, s_ptrs, 0, k_unit, k_end - k_start, EVEN_K, PAIRS, UNIT, GROUP, HW)
    if not GROUPED:  # the first step's weights do not depend on the kernel before: read before waiting for it
        pdl.wait_prior(PDL)
        pdl.release_next(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N, NU), dtype=tl.float32)
    xw = _fma_x(x_ptrs, 0, k_end - k_start, EVEN_K, PAIRS, UNIT, X_VEC)
    acc = _fma_step(acc, xw, w, s, FMT, HW, BLOCK_M, BLOCK_N, NU, UNIT)
    for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
        dk = (k0 - k_start) // 2
        w, s = _fma_weights(w_ptrs, s_ptrs, dk, k_unit, k_end - k0, EVEN_K, PAIRS, UNIT, GROUP, HW)
        xw = _fma_x(x_ptrs, dk, k_end - k0, EVEN_K, PAIRS, UNIT, X_VEC)
        acc = _fma_step(acc, xw, w, s, FMT, HW, BLOCK_M, BLOCK_N, NU, UNIT)
    _finish(tl.sum(acc, axis=2), rm, rm_in, rn, rn_in, row_end, pid_n * tl.num_programs(1) + slot, pid_k, M, N,
            ts_ptr, stride_tn, out_ptr, stride_om, 1, ws_ptr, cnt_ptr, SPLIT_K, FMT, SPLIT, SWIGLU)  # fmt: skip


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, ts_ptr, out_ptr, R, K, N, stride_te, stride_tn, FMT: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """Rows [R, K] of packed codes (contiguous) to values in out's dtype: the reference's products, one rounding.
    Row r takes the tensor scale ``ts_ptr[(r // N) * stride_te + (r % N) * stride_tn]`` (nvfp4)."""
    GROUP: tl.constexpr = 16 if FMT == "nvfp4" else 32
    PACK: tl.constexpr = 1 if FMT == "mxfp8" else 2
    BKB: tl.constexpr = BLOCK_K // PACK
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    kb = tl.program_id(1) * BKB + tl.arange(0, BKB)
    ks = tl.program_id(1) * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)
    ok = (r[:, None] < R) & (kb[None, :] < K // PACK)
    w = tl.load(w_ptr + r[:, None] * (K // PACK) + kb[None, :], mask=ok, other=0).to(tl.int32)
    s_ok = (r[:, None] < R) & (ks[None, :] < K // GROUP)
    s = tl.load(s_ptr + r[:, None] * (K // GROUP) + ks[None, :], mask=s_ok, other=0).to(tl.int32)
    if FMT == "nvfp4":
        factor = _e4m3(s) * 1.329227995784916e36
    else:
        factor = _e8m0(s)
    if PACK == 1:
        out = out_ptr + r[:, None] * K + kb[None, :]
        tl.store(out, _scaled(_e4m3(w) * 1.329227995784916e36, factor, GROUP).to(out_ptr.dtype.element_ty), mask=ok)
    else:
        w0 = _scaled(_e2m1(w & 0xF) * 8.507059173023462e37, factor, GROUP // 2)
        w1 = _scaled(_e2m1(w >> 4) * 8.507059173023462e37, factor, GROUP // 2)
        if FMT == "nvfp4":
            ts = tl.load(ts_ptr + (r // N) * stride_te + (r % N) * stride_tn)[:, None]
            w0, w1 = w0 * ts, w1 * ts
        # elements 2j and 2j + 1 side by side, one contiguous store: two stores a stride of 2 apart move about a
        # twentieth of its bytes a second on an H200
        both = tl.reshape(tl.join(w0, w1), (BLOCK_R, BLOCK_K)).to(out_ptr.dtype.element_ty)
        col = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + r[:, None] * K + col[None, :], both, mask=(r[:, None] < R) & (col[None, :] < K))


_LAUNCHES = LaunchCache(_weight_only_kernel)
_FMA_LAUNCHES = LaunchCache(_weight_only_fma_kernel)
_DEQUANTIZE = LaunchCache(_dequantize_kernel)


def fma_path(rows: int, config: dict | None = None) -> bool:
    """Whether a GEMM of ``rows`` rows (per group) takes the small-M path: up to FMA_MAX_M rows, or a config
    without BLOCK_M (the tl.dot path's configs have one) that is not a Gluon one."""
    return "BLOCK_M" not in config and not config.get("GLUON") if config else rows <= FMA_MAX_M


def candidates(m: int, fmt: str, n: int | None = None, k: int | None = None, fma: bool | None = None,
               scaled: bool = True, gluon: bool = False) -> list[dict]:  # fmt: skip
    """The configs for M rows (per group) of ``fmt`` weights [N, K], the default first: the small-M path's for
    the shape (FMA_CANDIDATES, FMA_CHOSEN first where it names one), else the tensor-core path's by M
    (SCALED_CANDIDATES for the MX formats, CANDIDATES for NVFP4 and where ``scaled`` is off: a GPU without
    tl.dot_scaled's fp8 operands), then GLUON_CANDIDATES where ``gluon`` (``gluon_ok``) and M <= GLUON_MAX_M.
    ``fma``: that path whatever M (None: as ``fma_path`` says)."""
    if fma if fma is not None else fma_path(m):
        configs = FMA_CANDIDATES.get((n, k), FMA_CANDIDATES[None])
        chosen = FMA_CHOSEN.get((fmt, n, k))
        return [chosen, *[c for c in configs if c != chosen]] if chosen else list(configs)
    extra = list(GLUON_CANDIDATES) if gluon and m <= GLUON_MAX_M else []
    scaled = scaled and fmt != "nvfp4"
    for max_m, configs in SCALED_CANDIDATES if scaled else CANDIDATES:
        if max_m is None or m <= max_m:
            if scaled:
                return [dict(cfg, num_stages=cfg["STAGES"]) for cfg in configs] + extra
            return [
                dict(cfg, num_stages=cfg.get("num_stages", 1), BLOCK_K=cfg["BLOCK_K"] * FORMATS[fmt][1])
                for cfg in configs
            ] + extra
    raise AssertionError("unreachable")


def gluon_ok(fmt: str, k: int, grouped: bool, gathered: bool, device: torch.device) -> bool:
    """Whether a GEMM may take the Gluon wgmma kernel: dense, K a multiple of 128, on sm_90 (wgmma is Hopper's:
    sm_100 has no such instruction)."""
    return (
        fmt in FORMATS and k % 128 == 0 and not grouped and not gathered and device.type == "cuda"
        and not interpreting() and cuda_capability(device) == (9, 0)
    )  # fmt: skip


def gluon_config(n: int, sm_count: int) -> dict:
    """The Gluon kernel's config where nothing is tuned, for N output rows on ``sm_count`` SMs: 4 warps (64 rows a
    program), K split in powers of 2 up to 8 while the programs stay within GLUON_PROGRAMS_PER_SM an SM. On one
    H200 (132 SMs) it gives Llama 3 8B's fused w1/w3 1 split, fused wq/wk/wv 4, wo and w2 8: what tuning picks
    there at M = 8 and 32 (w1/w3 sometimes 8 warps or 4 splits)."""
    tiles, split = cdiv(n, 64), 1
    while split < 8 and tiles * split * 2 <= GLUON_PROGRAMS_PER_SM * sm_count:
        split *= 2
    return dict(GLUON=True, num_warps=4, SPLIT_K=split)


def config_for(m: int, fmt: str, n: int | None = None, k: int | None = None, fma: bool | None = None,
               scaled: bool = True) -> dict:  # fmt: skip
    """The default config for M rows (per group) of ``fmt`` weights [N, K] (``fma``, ``scaled`` as
    ``candidates``')."""
    return candidates(m, fmt, n, k, fma, scaled)[0]


def dot_scaled_ok(device: torch.device) -> bool:
    """Whether ``device`` runs the tl.dot_scaled path: fp8 operands from sm_89 on; the interpreter (tests)."""
    if device.type != "cuda":
        return interpreting()
    return cuda_capability(device) >= (8, 9)


_TUNE = False
_TUNED: dict[tuple, tuple[dict, int | None]] = {}


def set_tuning(enabled: bool) -> None:
    """Time every candidate config of each new GEMM shape on its first call and keep the fastest (off: the
    defaults). A call inside CUDA-graph capture never tunes: the shapes are tuned by the runs before capture."""
    global _TUNE
    _TUNE = enabled


def time_us(run: Callable[[], object] | Sequence[Callable[[], object]], calls: int = 20, rounds: int = 5) -> float:
    """Median microseconds a call of ``run()`` takes on the GPU: ``calls`` calls captured in one CUDA graph (no
    launch overhead), replayed ``rounds`` times. ``run`` may be a sequence of callables, called in turn (the
    same GEMM over ``cold_copies`` of its weight: each call then reads its weight from memory)."""
    runs = list(run) if isinstance(run, Sequence) else [run]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for r in runs:
            r()  # compiles, allocates
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            runs[i % len(runs)]()
    graph.replay()
    times = []
    for _ in range(rounds):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def cold_copies(tensors: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
    """``tensors`` and clones of them, enough that one pass over all reads twice the GPU's L2 (at most
    MAX_COLD_COPIES): timed in turn, each call reads its weight from memory, as each layer of a model does. Timed on
    one copy, a weight that fits in L2 (an H200's 50 MB holds a 4-bit 4096 x 14336) is read from L2 from the second
    call on, and tuning would rank configs by a speed that the model never sees."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    l2 = torch.cuda.get_device_properties(tensors[0].device).L2_cache_size
    copies = min(MAX_COLD_COPIES, max(1, cdiv(2 * l2, max(nbytes, 1))))
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(copies - 1)]


def _tuned(key: tuple, run: Callable[..., object], weights: tuple[torch.Tensor, ...]) -> tuple[dict, int | None]:
    """The fastest (config, split_k) of ``run(config, split_k, *weights)`` for ``key``, timed once over
    ``cold_copies`` of ``weights`` and kept."""
    if key in _TUNED:
        return _TUNED[key]
    fmt, m, n, k, _, grouped, gathered = key[:7]
    best, best_us = None, float("inf")
    gluon = gluon_ok(fmt, k, grouped, gathered, key[-1])
    copies = cold_copies(weights)
    for cfg in candidates(m, fmt, n, k, scaled=dot_scaled_ok(key[-1]), gluon=gluon):
        splits = (None, 1, 2, 4) if cfg.get("SCALED") else (None, 1)
        for split in (None,) if fma_path(m, cfg) or cfg.get("GLUON") else splits:
            runs = [lambda cfg=cfg, split=split, w=w: run(cfg, split, *w) for w in copies]
            try:
                us = time_us(runs, calls=max(10, len(runs)), rounds=1)
            except triton.runtime.errors.OutOfResources:  # too much shared memory or too many registers
                continue
            if us < best_us:
                best, best_us = (cfg, split), us
    _TUNED[key] = best
    return best


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, so that tests exercise split K
    return torch.cuda.get_device_properties(device).multi_processor_count


def check(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor | None, fmt: str,
          grouped: bool, op: str) -> tuple[int, int]:  # fmt: skip
    """Raise on malformed operands; return (N, K)."""
    if fmt not in FORMATS:
        raise ValueError(f"{op}: unknown format {fmt!r}; expected one of {sorted(FORMATS)}")
    group, pack = FORMATS[fmt]
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"{op}: x must be a 2D bf16 tensor, got {x.dtype} {tuple(x.shape)}")
    dims = 3 if grouped else 2
    if qdata.dim() != dims or scale.dim() != dims or qdata.element_size() != 1 or scale.element_size() != 1:
        raise ValueError(f"{op}: qdata and scale must be {dims}D tensors of bytes, got {qdata.dtype} "
                         f"{tuple(qdata.shape)} and {scale.dtype} {tuple(scale.shape)}")  # fmt: skip
    n, k = qdata.shape[-2], qdata.shape[-1] * pack
    if k != x.shape[1] or k % group or tuple(scale.shape) != (*qdata.shape[:-1], k // group):
        raise ValueError(f"{op}: {fmt} needs x [M, K], qdata [..., N, K/{pack}] and scale [..., N, K/{group}] with "
                         f"K a multiple of {group}; got x {tuple(x.shape)}, qdata {tuple(qdata.shape)}, "
                         f"scale {tuple(scale.shape)}")  # fmt: skip
    group_rows = qdata.shape[0] * n if grouped else n
    if (fmt == "nvfp4") != (tensor_scale is not None) or (
        tensor_scale is not None and tensor_scale.numel() not in (1, n, group_rows)
    ):
        raise ValueError(f"{op}: nvfp4 takes an fp32 tensor_scale of one element, one per row of N or (grouped) one "
                         "per group and row, the MX formats none")  # fmt: skip
    return n, k


def tensor_scales(tensor_scale: torch.Tensor | None, n: int, like: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(fp32 tensor scales, their strides along the groups and along N): one scale, one per row of N (every group
    alike), or one per group and row ([E, N, 1]: an MoE's experts folded with shared ones of their own scale)."""
    if tensor_scale is None:
        return like, 0, 0
    ts = tensor_scale.reshape(-1).to(torch.float32).contiguous()
    return ts, n if ts.numel() > n else 0, int(ts.numel() > 1)


def row_slots(m: int, block_m: int, n_groups: int) -> int:
    """Row-tile slots of the grid: as many tiles of ``block_m`` rows as M rows cut per group can make. A group
    of r rows makes cdiv(r, block_m) <= (r + block_m - 1) / block_m tiles, and at most min(E, M) groups have
    rows: at decode (M = batch * top-k rows over E experts) the grid has M slots, not M + E, so the programs
    of the groups without rows (each would start and return) are not launched."""
    return (m + min(n_groups, m) * (block_m - 1)) // block_m


def _n_tiles(n: int, block_n: int, swiglu: bool) -> int:
    """Program tiles along N: ``block_n`` rows of the weight each; with ``swiglu``, ``block_n`` / 2 gate rows and
    the same up rows, a pair for each of N / 2 output columns."""
    return cdiv(n // 2, block_n // 2) if swiglu else cdiv(n, block_n)


def _split(split_k: int | None, k_tiles: int, busy: int, per_sm: int, device: torch.device) -> int:
    """The split of K: ``split_k``, or enough that ``busy`` tiles make ``per_sm`` programs an SM; no empty split."""
    if split_k is None:
        split_k = max(1, min(MAX_SPLIT_K, k_tiles // 2, cdiv(per_sm * _sm_count(device), busy)))
    return cdiv(k_tiles, cdiv(k_tiles, max(1, min(split_k, k_tiles))))


def weight_only_mm(
    x: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    tensor_scale: torch.Tensor | None,
    fmt: str,
    offs: torch.Tensor | None = None,
    config: dict | None = None,
    split_k: int | None = None,
    rows: torch.Tensor | None = None,
    swiglu: bool = False,
    offs_ready: bool = False,
) -> torch.Tensor:
    """x [M, K] bf16 @ dequantize(qdata, scale, tensor_scale).T -> [M, N] bf16 (module doc). ``offs``: the
    grouped GEMM (qdata [E, N, K/pack], scale [E, N, K/group], x sorted by group, int32 cumulative row ends).
    ``rows`` (grouped only): int32 [M], the GEMM's rows are x[rows] (x [T, K]: an MoE's tokens), read in place.
    ``tensor_scale`` (nvfp4): one, or one per row of N (weights concatenated along N). ``swiglu``: the weight is
    SwiGLU's w1 and w3 concatenated along N; out [M, N / 2] = silu(x w1^T) * (x w3^T), each GEMM output rounded
    to bf16 and the product as ``silu_mul`` rounds it (mx_kernels.decode_fused.swiglu): in the small-M path's
    epilogue, after the tensor-core path's GEMM (module doc).
    ``offs_ready`` (grouped): ``offs`` and ``rows`` were written before the launch right before this one, so under
    PDL the small-M path reads them before its wait (module doc, Grouped).
    ``config`` overrides the tiles (one with BLOCK_M takes the tl.dot path, one without the small-M path) and
    ``split_k`` the split (None: the config's SPLIT_K, else from the SM count)."""
    grouped = offs is not None
    op = "weight_only_grouped_mm" if grouped else "weight_only_mm"
    n, k = check(x, qdata, scale, tensor_scale, fmt, grouped, op)
    if swiglu and n % 2:
        raise ValueError(f"{op}: swiglu takes w1 and w3 concatenated along N, an even N; got N = {n}")
    if not x.is_cuda and not interpreting():
        raise RuntimeError(f"{op}: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1), got {x.device}")
    if grouped and (offs.dim() != 1 or offs.dtype != torch.int32 or offs.shape[0] != qdata.shape[0]):
        raise ValueError(f"{op}: offs must be int32 [E] for E = {qdata.shape[0]} groups")
    if rows is not None and (not grouped or rows.dim() != 1 or rows.dtype != torch.int32 or rows.device != x.device):
        raise ValueError(f"{op}: rows must be an int32 [M] tensor on x's device, with offs (the grouped GEMM); got "
                         f"{rows.dtype} {tuple(rows.shape)} on {rows.device}")  # fmt: skip
    m = x.shape[0] if rows is None else rows.shape[0]
    out_shape = (m, n // 2 if swiglu else n)
    if m == 0 or n == 0 or k == 0:  # k = 0: a GEMM of zeros (silu(0) * 0 = 0 too)
        return torch.zeros(out_shape, dtype=torch.bfloat16, device=x.device)
    n_groups = qdata.shape[0] if grouped else 1
    per_group = cdiv(m, n_groups)
    if config is None and split_k is None and _TUNE and x.is_cuda:
        bucket = per_group if per_group <= 16 else triton.next_power_of_2(per_group)
        key = (fmt, bucket, n, k, n_groups, grouped, rows is not None, swiglu, x.device)
        if torch.cuda.is_current_stream_capturing():  # no timing inside capture: the runs before it tuned
            config, split_k = _TUNED.get(key, (None, None))
        else:
            config, split_k = _tuned(
                key,
                lambda c, s, q, sc: weight_only_mm(x, q, sc, tensor_scale, fmt, offs, c, s, rows, swiglu, offs_ready),
                (qdata, scale),
            )
    gluon = gluon_ok(fmt, k, grouped, rows is not None, x.device) and m <= GLUON_MAX_M
    if config is None and gluon and not fma_path(per_group):  # untuned on Hopper: the Gluon kernel (module doc)
        config = gluon_config(n, _sm_count(x.device))
    fma = fma_path(per_group, config)
    cfg = {**config_for(per_group, fmt, n, k, fma, dot_scaled_ok(x.device)), **(config or {})}
    if fma and per_group > 16:
        raise ValueError(f"{op}: the small-M path takes at most 16 rows per group, got {per_group} (config {config})")
    if fma:
        out = torch.empty(out_shape, dtype=torch.bfloat16, device=x.device)
        return _fma_mm(x, qdata, scale, tensor_scale, fmt, offs, rows, out, cfg, split_k, swiglu, offs_ready)
    if swiglu:  # the tensor-core tile's epilogue does not pay (module doc): the GEMM, then silu_mul
        y = weight_only_mm(x, qdata, scale, tensor_scale, fmt, offs, config, split_k, rows)
        return silu_mul(y[:, : n // 2], y[:, n // 2 :])
    if cfg.get("GLUON"):
        if not gluon:
            raise ValueError(f"{op}: the Gluon kernel takes dense GEMMs on sm_90 (wgmma), K a multiple of 128 and "
                             f"at most {GLUON_MAX_M} rows; got {fmt}, M = {m}, K = {k} (config {config})")  # fmt: skip
        from mx_kernels.gluon.weight_only_mma import MAX_M, wgmma_weight_only

        out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
        for i in range(0, m, MAX_M):
            rows_i = slice(i, i + MAX_M)
            wgmma_weight_only(x[rows_i], qdata, scale, tensor_scale, fmt, cfg["num_warps"], split_k or cfg["SPLIT_K"],
                              out=out[rows_i])  # fmt: skip
        return out
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if block_k % 32 or block_m < 16 or block_n < 16:
        raise ValueError(f"{op}: BLOCK_K must be a multiple of 32, BLOCK_M and BLOCK_N at least 16; got {cfg}")
    scaled = cfg.get("SCALED", False)
    if scaled and (fmt == "nvfp4" or block_k % 64):
        raise ValueError(f"{op}: the tl.dot_scaled path takes the MX formats (not {fmt}) and BLOCK_K a multiple of "
                         f"64; got {cfg}")  # fmt: skip
    slots = row_slots(m, block_m, n_groups)
    n_tiles = cdiv(n, block_n)
    tiles = n_tiles * slots
    k_tiles = cdiv(k, block_k)
    busy = n_tiles * (min(cdiv(m, block_m), n_groups) if grouped else slots)  # tiles with rows
    per_sm = SCALED_PROGRAMS_PER_SM if scaled else PROGRAMS_PER_SM
    if scaled and fmt == "mxfp4" and k % block_k:  # a masked e2m1 tile: unpipelined (module doc)
        cfg = dict(cfg, STAGES=1, num_stages=1)
    split_k = _split(split_k, k_tiles, busy, per_sm, x.device) if tiles <= COUNTERS else 1
    k_split = cdiv(k_tiles, split_k) * block_k
    ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    counters = arrival_counters("weight_only", x.device, COUNTERS) if split_k > 1 else out
    ts, stride_te, stride_tn = tensor_scales(tensor_scale, n, out)
    w, s = qdata.view(torch.uint8), scale.view(torch.uint8)
    if not grouped:
        w, s = w[None], s[None]
    args = dict(
        x_ptr=x, w_ptr=w, s_ptr=s, ts_ptr=ts, offs_ptr=offs if grouped else out,
        rows_ptr=rows if rows is not None else out, out_ptr=out, ws_ptr=ws,
        cnt_ptr=counters, M=m, N=n, K=k, E=n_groups, K_SPLIT=k_split, SPLIT_K=split_k, stride_xm=x.stride(0),
        stride_xk=x.stride(1), stride_we=w.stride(0), stride_wn=w.stride(1), stride_wk=w.stride(2),
        stride_se=s.stride(0), stride_sn=s.stride(1), stride_sk=s.stride(2), stride_te=stride_te, stride_tn=stride_tn,
        stride_om=out.stride(0), stride_on=out.stride(1), FMT=fmt,
        GROUPED=grouped, GATHER=rows is not None, E_POW2=max(2, triton.next_power_of_2(n_groups)),
        SPLIT=split_k > 1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        DOT_BF16=not interpreting(), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pdl.options(x.device),
    )  # fmt: skip
    _LAUNCHES.launch(
        (n_tiles, slots, split_k),
        dict(args, SCALED=scaled, PREFETCH=cfg.get("PREFETCH", False), STAGES=cfg.get("STAGES", 1)),
    )
    return out


def _fma_mm(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor | None, fmt: str,
            offs: torch.Tensor | None, rows: torch.Tensor | None, out: torch.Tensor, cfg: dict, split_k: int | None,
            swiglu: bool = False, offs_ready: bool = False) -> torch.Tensor:  # fmt: skip
    """The small-M path of ``weight_only_mm`` into ``out`` (module doc)."""
    grouped = offs is not None
    m, n, k = out.shape[0], qdata.shape[-2], x.shape[1]
    n_groups = qdata.shape[0] if grouped else 1
    block_m = triton.next_power_of_2(cdiv(m, n_groups))
    # swiglu: a program's rows are gate and up rows in pairs, at least one of each
    block_n = max(2 if swiglu else 1, cfg["BLOCK_N"] // block_m)
    block_k, warps = cfg["BLOCK_K"], cfg["num_warps"]
    unit = cfg.get("UNIT", 4)
    if unit not in (4, 8) or block_k % (2 * unit) or block_n & (block_n - 1):
        raise ValueError(f"weight_only_mm: the small-M path needs UNIT 4 or 8, BLOCK_K a multiple of 2 * UNIT and "
                         f"BLOCK_N a power of two; got {cfg}")  # fmt: skip
    # x as int32 pairs of bf16; w as pairs of codes (uint16 for e4m3), K contiguous in both
    if x.stride(1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:
        x = x.contiguous()
    w = qdata.view(torch.uint8)
    w = w if w.stride(-1) == 1 else w.contiguous()
    if fmt == "mxfp8":
        w = w.view(torch.uint16)
    s = scale.view(torch.uint8)
    if not grouped:
        w, s = w[None], s[None]
    slots = row_slots(m, block_m, n_groups)
    n_tiles = _n_tiles(n, block_n, swiglu)
    tiles = n_tiles * slots
    k_tiles = cdiv(k, block_k)
    busy = n_tiles * (min(cdiv(m, block_m), n_groups) if grouped else slots)
    split_k = split_k if split_k is not None else cfg.get("SPLIT_K")
    split_k = _split(split_k, k_tiles, busy, FMA_PROGRAMS_PER_SM, x.device) if tiles <= COUNTERS else 1
    k_split = cdiv(k_tiles, split_k) * block_k
    ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    counters = arrival_counters("weight_only", x.device, COUNTERS) if split_k > 1 else out
    ts, stride_te, stride_tn = tensor_scales(tensor_scale, n, out)
    # x's 16-byte loads for e2m1 weights (module doc), where x's rows are 16-byte aligned and Triton knows the
    # weight's rows 16-element aligned (it specializes on an address % 16 and an integer % 16): there it lays the
    # tile out as the unit sums are, UNIT consecutive pairs a thread; elsewhere one pair a thread, not 16 bytes
    x_vec = fmt != "mxfp8" and (x.data_ptr() | x.stride(0) * 2 | w.data_ptr()) % 16 == 0 and w.stride(-2) % 16 == 0
    if grouped:
        x_vec = x_vec and w.stride(0) % 16 == 0
    _FMA_LAUNCHES.launch(
        (n_tiles, slots, split_k),
        dict(
            x_ptr=x.view(torch.int32), w_ptr=w, s_ptr=s, ts_ptr=ts, offs_ptr=offs if grouped else out,
            rows_ptr=rows if rows is not None else out, out_ptr=out,
            ws_ptr=ws, cnt_ptr=counters, M=m, N=n, K=k, E=n_groups, K_SPLIT=k_split, SPLIT_K=split_k,
            stride_xm=x.stride(0) // 2, stride_we=w.stride(0), stride_wn=w.stride(1), stride_se=s.stride(0),
            stride_sn=s.stride(1), stride_te=stride_te, stride_tn=stride_tn, stride_om=out.stride(0), FMT=fmt,
            GROUPED=grouped, GATHER=rows is not None, E_POW2=max(2, triton.next_power_of_2(n_groups)),
            SPLIT=split_k > 1,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, HW=not interpreting(),
            UNIT=unit, SWIGLU=swiglu, OFFS_READY=offs_ready, X_VEC=x_vec and not interpreting(), num_warps=warps,
            num_stages=cfg.get("num_stages", 1), **pdl.options(x.device),
        ),
    )  # fmt: skip
    return out


def dequantize(qdata: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor | None, fmt: str,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:  # fmt: skip
    """The packed weight [..., N, K] in ``dtype`` (bf16 or fp32), bit for bit the reference's ``dequantize``
    (elements times scales in fp32, times the tensor scale for nvfp4 -- one, or one per row of N -- one rounding
    to ``dtype``): what a GEMM too large for the weight-only kernel hands to cuBLAS."""
    group, pack = FORMATS[fmt]
    k = qdata.shape[-1] * pack
    if qdata.element_size() != 1 or tuple(scale.shape) != (*qdata.shape[:-1], k // group):
        raise ValueError(f"dequantize: {fmt} needs qdata [..., N, K/{pack}] bytes and scale [..., N, K/{group}]; got "
                         f"{qdata.dtype} {tuple(qdata.shape)} and {tuple(scale.shape)}")  # fmt: skip
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dequantize: dtype must be bf16 or fp32, got {dtype}")
    out = torch.empty((*qdata.shape[:-1], k), dtype=dtype, device=qdata.device)
    rows = out.numel() // k if k else 0
    if rows == 0 or k == 0:
        return out
    w, s = qdata.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8)
    n = qdata.shape[-2]
    ts, stride_te, stride_tn = tensor_scales(tensor_scale, n, out)
    # 4 rows of up to 2048 elements a program: on an H200 0.84-0.95 of the copy bandwidth where 32 x 128 tiles
    # moved 0.66-0.76 (a DeepSeek-MoE 16B expert stack [64, 2816, 2048] and a Llama 3 8B fused gate/up)
    block_r, block_k = 4, min(2048, triton.next_power_of_2(k))
    _DEQUANTIZE.launch(
        (cdiv(rows, block_r), cdiv(k, block_k)),
        dict(w_ptr=w, s_ptr=s, ts_ptr=ts, out_ptr=out, R=rows, K=k, N=n, stride_te=stride_te, stride_tn=stride_tn,
             FMT=fmt, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4),
    )  # fmt: skip
    return out
