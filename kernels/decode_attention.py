"""Split-KV decode attention ("flash-decoding"): one query position per sequence (a decode step) over a KV cache,
the query heads that share a KV head (grouped-query attention) reading its keys and values once.

q [B, Hkv, R, D] (R query heads per KV head), k_cache and v_cache [B, Hkv, L, D] with the last dim contiguous
(read in place through their strides), and ``length``, an int tensor [1] or [B] on the device: positions
0 .. length - 1 are visible. Out [B, Hkv, R, D] in q's dtype: softmax(q k^T * scale) v over those positions.

Why split: a decode step's attention is B * Hkv heads (8 for Llama 3 8B at batch 1), too few programs to keep a
GPU's loads in flight; one program per head is latency-bound (SDPA takes about 24 us a layer on an H200, where
the cache's bytes take about 1). The cache is cut into SPLITS contiguous chunks instead, one program each, grid
(B * Hkv, SPLITS); the last chunk of a head to finish combines the chunks' partial softmaxes.

Why ``length`` is a tensor: the step is captured in a CUDA graph and replayed at every position. The launches
(grid, SPLITS, every argument but the addresses) depend only on the static shapes, so one capture serves every
length: a chunk wholly past ``length`` runs its loop zero times and writes an empty partial (m = -inf, l = 0,
acc = 0), which the combine weighs by zero. Positions at or past ``length`` are never read (masked loads).

Appending (``append``: a decode step's own position, length - 1): q and the step's key arrive unrotated, as the
QKV projection wrote them. Each program rotates its q rows at that position (the model's ``apply_rope``: pairs
(x[2i], x[2i+1]) by the cos / sin row of the model's tables, in fp32, rounded once to q's dtype; q is loaded
whole and its pairs split in registers: two stride-2 loads would take an address a 16-bit element) and reads the
cache below the position. The program whose chunk holds it rotates the key the same way, writes key and value
into the caches (rounded to their dtype), and merges that one position into its online softmax from registers
(fp32 products): nothing it wrote is read back, so no ordering between the write and the tile loads is needed.
A step then needs no launch of its own for RoPE and the cache write.
q, k and v may arrive as the QKV GEMM's split-K sums, fp32 [S, ...] (mx_kernels.gluon.weight_only_tiled,
``partials``): each program adds the splits of what it reads in split order from +0, times the scale (NVFP4's
tensor scale x 2**8: one, or one per column of the fused [q | k | v] row) and rounds to the caches' dtype, the
bits the GEMM's epilogue would have written, so the GEMM ends without its last split's counter and read-back. Every
program of a head reads its q rows' splits (L2-resident, S x 4 bytes an element against 2), the one that appends
the step's k and v theirs. One H200, Llama 3 8B dims, context 1024, ms a step with the sums in the GEMM / here:
MXFP4 batch 8 2.806 / 2.777, 32 3.719 / 3.634, 128 10.469 / 10.243; NVFP4 batch 32 3.859 / 3.787; MXFP8 batch 32
4.356 / 4.268.

The split kernel: a program loads q [R, D], padded with zero rows to BLOCK_R = max(16, next power of 2) for
``tl.dot``, and walks its chunk in tiles of BLOCK_L positions up to min(chunk end, length): scores q k^T, an
online softmax (running max m, sum l, accumulator acc [R, D] rescaled as m grows) and acc += p v. The softmax
is fp32. With 16-bit q and caches (bf16, fp16) on a GPU both dots run on tensor cores: q k^T from the 16-bit
values themselves (exact products, fp32 sums), and p v with p split into two 16-bit parts, p_hi = p rounded and
p_lo = p - p_hi rounded, two MMAs into one fp32 sum: 16 significant bits of p, where flash attention's one
16-bit P keeps 8. Otherwise (fp32 inputs, and under the interpreter) both dots take fp32 operands with
``input_precision="ieee"`` (no TF32), so fp32 inputs get fp32 attention; on CUDA cores, these tiles are 16
positions (BLOCK_L, tl.dot's least: compiled for sm_90 at 4 warps 72 registers a thread at D = 128 and at most
143 at D = 256, where 32 positions take 247 and some shapes spill); the 16-bit tiles are 64 positions at D <= 128
(BLOCK_L_MMA16), 32 past it (BLOCK_L_MMA16_WIDE).
A chunk of one tile (such a step's, at batch 1) takes no loop: its keys and values are one [2, BLOCK_L, D] load,
issued with the RoPE rows', q's and the step's own k's and v's before any arithmetic, so that the program waits
once for all of its bytes (a loop's pipelined loads issue after q's rotation, and two loads would each wait for
the other's move into the dot's layout). On an H200, Llama 3 8B and MoE 16B dims at batch 1, that saves about 0.7
us a layer. Appending under PDL (a decode step: ``mx_kernels.pdl``), the tile, the RoPE rows and ``length`` come
before the PDL wait, the tile moved into the dots' layouts there too, while the kernel before (the QKV projection)
finishes; q and the step's own k and v, that kernel's outputs, after it. None of the former is its output (the
cache below the step's position was written by earlier steps), so a caller must not write the caches or
``length`` in the launch right before an appending one. Llama 3 8B dims, batch 1, one H200: MXFP8 step 2.72 ->
2.65 ms. Chunks of several tiles have nothing to read before the wait, and launched early their programs take the
SMs the kernel before leaves free, unevenly, where launched after it they spread over all SMs: the kernel takes PDL
only where a chunk is one tile. One H200, Llama 3 8B dims, context 1024, MXFP4 weights, ms a step with / without
PDL for the attention alone: batch 2 (one-tile chunks) 2.033 / 2.158; batch 4, 8, 16, 32 (2-16 tiles) 2.292 /
2.258, 2.821 / 2.805, 3.139 / 3.112, 3.774 / 3.727.
The padding rows of q cost MMA work, not bytes. The partial (acc, m, l) goes to an fp32 workspace allocated per
call (torch's caching allocator: cheap, and graph-safe). With one split (many heads, or a cache of one tile) the program
writes acc / l as the output itself, and there is no workspace and no combine.

The combine: each chunk's program stores its partial, then counts itself in on the head's arrival counter (one
atomic, acquire-release); the program that arrives last reads the head's partials back (from L2) and writes its R
output rows, the splits in order, BLOCK_S at a time, as an online softmax over their partials: sum_s acc_s
2**(m_s - M) / sum_s l_s 2**(m_s - M), M the largest m. The tile is [BLOCK_RC rows, D, BLOCK_S splits]: each
thread holds every split of its row's few dims, so the sums over the splits stay in its registers (with the splits
across warps each sum would take shuffles and a barrier, on the last program's path: Llama 3 8B dims, batch 1,
context 1024, one H200, 8.6 against 7.0 us a layer). A fixed order and fixed reduction trees: the result does not
depend on timing, nor on which program combines. It resets the counter for the next launch (the counters are
one zeroed buffer per device, kept: two launches must not run at once on different streams). Against a second
kernel for the combine, this saves its launch and the wait between the two. Scores are in base 2, scaled by
scale * log2(e) (fp32 q once; the 16-bit path each tile's fp32 scores).

SPLITS: the chunks that make B * Hkv * SPLITS nearest PROGRAMS_PER_SM programs an SM (at least one), at most one a
tile; a chunk is a whole number of tiles. ``length`` must be at least 1 (0 gives NaN); past L it reads as L.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from mx_kernels import pdl
from mx_kernels.common import arrival_counters, interpreting
from mx_kernels.decode_fused import split_sum
from mx_kernels.launch_cache import LaunchCache
from mx_kernels.rope import rotate
from mx_kernels.spec import cdiv

PROGRAMS_PER_SM = 2  # split programs an SM: the loads of several programs in flight hide each other's latency
BLOCK_L = 16  # cache positions a tile of the fp32 path (module doc)
# The 16-bit path's tiles (MMAs) at D <= 128: half the loop trips of 32 positions, at 168 registers a thread (4
# warps, sm_90: 3 programs an SM; 32 positions take 126). With the chunks rounded to the nearest of PROGRAMS_PER_SM
# an SM (not up: 2 chunks of a head at batch 32 make 512 programs, two waves of 3 an SM), Llama 3 8B heads, context
# 1024, one H200 (2026-11-30), us per layer against 32 positions and chunks rounded up: batch 16 23.3 -> 23.0,
# 32 39.4 -> 37.1, 64 86.5 -> 80.9, 128 141.4 -> 134.5, 8 (4 chunks, not 5) 14.6 -> 14.6. Batch 1 and 8 took 64
# positions already (one H100: 5.8 against 7.1 us at 32, and 11.7 against 13.2).
BLOCK_L_MMA16 = 64
BLOCK_L_MMA16_WIDE = 32  # past D = 128
INTERPRET_BLOCK_L = 64  # under the interpreter, whose time goes by operation: fewer, larger tiles
BLOCK_S = 16  # splits the combine reads at once, at most
# and (split, query head) pairs at once: a [BLOCK_RC, D, BLOCK_S] fp32 tile, 64 registers a thread at D = 128
COMBINE_TILE = 64
COUNTERS = 1 << 16  # heads (B * Hkv) a split launch may have: one arrival counter each
NUM_WARPS = 4
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LOG2E = 1.4426950408889634


@triton.jit
def _tile(q, k, v, inside, m_i, l_i, acc, qk_scale, MMA16: tl.constexpr):
    """The online softmax's update (m_i, l_i, acc) by one tile of keys k and values v [BLOCK_L, D], positions
    ``inside`` visible."""
    if MMA16:  # 16-bit q, k, v on tensor cores: exact products, fp32 sums (module doc)
        s = tl.dot(q, tl.trans(k)) * qk_scale
    else:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    s = tl.where(inside[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds a visible position
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    if MMA16:  # p as the sum of two 16-bit parts: 16 significant bits, where one part would keep 8
        p_hi = p.to(v.dtype)
        p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p_lo, v, tl.dot(p_hi, v))
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _projected(ptrs, mask, stride_s, ps_ptr, ps_offs, dtype, PARTS: tl.constexpr, HAS_PS: tl.constexpr):
    """A projection's output at ``ptrs``: the values, or (PARTS > 0) the sum of PARTS fp32 split-K partials
    ``stride_s`` apart (``split_sum``), times the scale at ps_ptr + ps_offs (HAS_PS), rounded to ``dtype``: what the
    GEMM's own epilogue writes (mx_kernels.gluon.weight_only_tiled)."""
    if PARTS == 0:
        value = tl.load(ptrs, mask=mask, other=0.0)
    else:
        total = split_sum(ptrs, mask, stride_s, PARTS, True)
        if HAS_PS:
            total = total * tl.load(ps_ptr + ps_offs, mask=mask, other=0.0)
        value = total.to(dtype)
    return value


@triton.jit
def _wait_then_release(PDL: tl.constexpr):
    pdl.wait_prior(PDL)
    # the next kernel (the output projection) may launch now: its programs are resident, set up and waiting when
    # this one ends (a short kernel at few programs an SM leaves it the room)
    pdl.release_next(PDL)


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, len_ptr, acc_ptr, m_ptr, l_ptr, cnt_ptr, out_ptr, kn_ptr, vn_ptr, cos_ptr, sin_ptr, ps_ptr,
    H, R, L, CHUNK, SPLITS, stride_len, qk_scale, stride_qb, stride_qh, stride_qr, stride_kb, stride_kh, stride_kl,
    stride_vb, stride_vh, stride_vl, stride_ob, stride_oh, stride_or, stride_knb, stride_vnb, stride_qs, stride_kns,
    stride_vns, stride_ps, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_RC: tl.constexpr, DIRECT: tl.constexpr, MMA16: tl.constexpr, APPEND: tl.constexpr, ONE_TILE: tl.constexpr,
    PARTS: tl.constexpr, HAS_PS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One chunk of the cache for the R query heads of one (b, head): its partial (acc [R, D], m [R], l [R]), and
    the head's output from all its chunks' partials where it is the last chunk to finish; ``DIRECT`` (one split):
    the output rows acc / l. ``APPEND``: q and the step's own k (kn) unrotated, rotated here at position
    length - 1, where the chunk holding it writes k and v (vn) into the caches (module doc). ``PARTS`` > 0: q, k
    and v are that many fp32 split-K sums of the QKV GEMM (``stride_*s`` apart), times the scale at ps_ptr (HAS_PS;
    one, or one per column of [q | k | v] with ``stride_ps`` 1), rounded to out's dtype."""
    EARLY: tl.constexpr = APPEND and ONE_TILE  # the cache tile read before the PDL wait (module doc)
    if not EARLY:
        _wait_then_release(PDL)
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    h = bh % H
    length = tl.minimum(tl.load(len_ptr + b * stride_len).to(tl.int32), L)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, length)  # <= start: an empty chunk, the loop runs zero times
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, D)
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + h * stride_qh + r[:, None] * stride_qr
    k_base = k_ptr + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    if APPEND:
        cur = length - 1
        end = tl.minimum(end, cur)  # the step's own position is merged after the loop, from registers
        # The chunk holding it also rotates the step's k and writes k and v into the caches, before its tiles (they
        # stop below it: no ordering needed). Every load first, then the arithmetic: one wait for all of them.
        holds = (cur >= start) & (cur < start + CHUNK)
        i = tl.arange(0, D // 2)
        cos = tl.load(cos_ptr + cur * (D // 2) + i)[None, :]
        sin = tl.load(sin_ptr + cur * (D // 2) + i)[None, :]
    if ONE_TILE:  # a chunk of one tile (a step of few heads): k and v loaded with q, one wait for all
        pos = start + tl.arange(0, BLOCK_L)
        inside = pos < end
        # k and v as one load [2, BLOCK_L, D], so that neither waits on the other's move into the dot's layout
        is_v = (tl.arange(0, 2) == 1)[:, None, None]
        rows = tl.where(is_v, (v_base + pos[:, None] * stride_vl)[None], (k_base + pos[:, None] * stride_kl)[None])
        kv = tl.load(rows + d[None, None, :], mask=inside[None, :, None], other=0.0)
        k, v = tl.split(tl.permute(kv, (1, 2, 0)))
    if EARLY:
        _wait_then_release(PDL)
    if APPEND:  # the previous kernel's outputs: after the wait
        dtype = out_ptr.dtype.element_ty  # q's, or the QKV GEMM's where its split sums come (PARTS)
        q_cols = (h * R + r[:, None]) * D + d[None, :]  # q's columns in [q | k | v] (the scale's)
        q_raw = _projected(q_rows + d[None, :], r[:, None] < R, stride_qs, ps_ptr, q_cols * stride_ps, dtype, PARTS,
                           HAS_PS)  # fmt: skip
        kv_cols = (H * R + h) * D + d  # k's columns in [q | k | v]; v's follow k's H * D
        k_raw = _projected(kn_ptr + b.to(tl.int64) * stride_knb + h * D + d[None, :], holds, stride_kns, ps_ptr,
                           kv_cols[None, :] * stride_ps, dtype, PARTS, HAS_PS)  # fmt: skip
        v_one = _projected(vn_ptr + b.to(tl.int64) * stride_vnb + h * D + d, holds, stride_vns, ps_ptr,
                           (kv_cols + H * D) * stride_ps, dtype, PARTS, HAS_PS)  # fmt: skip
    else:
        q = tl.load(q_rows + d[None, :], mask=r[:, None] < R, other=0.0)
    if APPEND:
        q = rotate(q_raw, cos, sin, dtype)
        k_one = tl.reshape(rotate(k_raw, cos, sin, k_ptr.dtype.element_ty), (D,))
        v_one = v_one.to(v_ptr.dtype.element_ty)
        tl.store(k_base + cur * stride_kl + d, k_one, mask=holds)
        tl.store(v_base + cur * stride_vl + d, v_one, mask=holds)
    if not MMA16:
        q = q.to(tl.float32) * qk_scale
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    if ONE_TILE:
        if start < end:
            m_i, l_i, acc = _tile(q, k, v, inside, m_i, l_i, acc, qk_scale, MMA16)
    else:
        for pos0 in range(start, end, BLOCK_L):
            pos = pos0 + tl.arange(0, BLOCK_L)
            inside = pos < end  # also keeps the next chunk's positions and those past length unread
            k = tl.load(k_base + pos[:, None] * stride_kl + d[None, :], mask=inside[:, None], other=0.0)
            v = tl.load(v_base + pos[:, None] * stride_vl + d[None, :], mask=inside[:, None], other=0.0)
            m_i, l_i, acc = _tile(q, k, v, inside, m_i, l_i, acc, qk_scale, MMA16)
    if APPEND:
        if holds:  # merge the step's own position, last, from registers
            if MMA16:
                s = tl.sum(q.to(tl.float32) * k_one.to(tl.float32)[None, :], 1) * qk_scale
            else:
                s = tl.sum(q * k_one.to(tl.float32)[None, :], 1)
            m_new = tl.maximum(m_i, s)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new)
            acc = acc * alpha[:, None] + p[:, None] * v_one.to(tl.float32)[None, :]
            l_i = l_i * alpha + p
            m_i = m_new
    out_rows = out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh
    if DIRECT:
        out = out_rows + r[:, None] * stride_or + d[None, :]
        tl.store(out, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=r[:, None] < R)
    else:
        row = (bh * SPLITS + split) * R + r  # the workspace [B * H, SPLITS, R, (D)]
        tl.store(acc_ptr + row[:, None].to(tl.int64) * D + d[None, :], acc, mask=r[:, None] < R)
        tl.store(m_ptr + row, m_i, mask=r < R)
        tl.store(l_ptr + row, l_i, mask=r < R)
        tl.debug_barrier()  # every thread's stores, then one release by the counter's atomic
        if tl.atomic_add(cnt_ptr + bh, 1, sem="acq_rel") == SPLITS - 1:  # the head's last chunk: combine
            _combine(acc_ptr, m_ptr, l_ptr, out_rows, bh, R, SPLITS, stride_or, D, BLOCK_S, BLOCK_RC)
            tl.atomic_xchg(cnt_ptr + bh, 0)  # ready for the next launch


@triton.jit
def _combine(acc_ptr, m_ptr, l_ptr, out_rows, bh, R, SPLITS, stride_or, D: tl.constexpr, BLOCK_S: tl.constexpr,
             BLOCK_RC: tl.constexpr):  # fmt: skip
    """The R output rows of head ``bh`` from its SPLITS partials, BLOCK_S splits at a time, in split order."""
    r = tl.arange(0, BLOCK_RC)[:, None, None]
    s = tl.arange(0, BLOCK_S)[None, None, :]
    d = tl.arange(0, D)[None, :, None]
    top = tl.full([BLOCK_RC, 1], float("-inf"), tl.float32)  # the largest m so far: num and den are relative to it
    num = tl.zeros([BLOCK_RC, D], tl.float32)
    den = tl.zeros([BLOCK_RC, 1], tl.float32)
    for s0 in range(0, SPLITS, BLOCK_S):
        ok = (s0 + s < SPLITS) & (r < R)
        rows = (bh * SPLITS + s0 + s) * R + r  # [BLOCK_RC, 1, BLOCK_S] of the workspace
        m = tl.load(m_ptr + rows, mask=ok, other=float("-inf"), cache_modifier=".cg")
        new_top = tl.maximum(top, tl.max(m, 2))  # finite for r < R: split 0 holds position 0
        alpha = tl.exp2(top - new_top)
        w = tl.exp2(m - new_top[:, :, None])  # 0 for empty splits
        acc = tl.load(acc_ptr + rows.to(tl.int64) * D + d, mask=ok, other=0.0, cache_modifier=".cg")
        num = num * alpha + tl.sum(acc * w, 2)
        den = den * alpha + tl.sum(tl.load(l_ptr + rows, mask=ok, other=0.0, cache_modifier=".cg") * w, 2)
        top = new_top
    rc = tl.arange(0, BLOCK_RC)[:, None]
    out = out_rows + rc * stride_or + tl.arange(0, D)[None, :]
    tl.store(out, (num / den).to(out_rows.dtype.element_ty), mask=rc < R)


_SPLIT = LaunchCache(_split_kernel)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: small tests still get a few splits, of one tile and of several
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_count(bh: int, cache_len: int, block_l: int, sms: int, splits: int | None = None) -> tuple[int, int]:
    """(SPLITS, positions a chunk) for ``bh`` = B * Hkv heads over ``cache_len`` positions in tiles of ``block_l``:
    ``splits`` chunks (None: the nearest count to PROGRAMS_PER_SM programs on each of ``sms`` SMs, at least one),
    at most one a tile, each a whole number of tiles, none empty at full length."""
    tiles = cdiv(cache_len, block_l)
    if splits is None:
        splits = max(1, (2 * PROGRAMS_PER_SM * sms + bh) // (2 * bh))  # the nearest, halves up
    chunk = cdiv(tiles, max(1, min(splits, tiles))) * block_l
    return cdiv(cache_len, chunk), chunk


def check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, length: torch.Tensor) -> None:
    """Raise a ValueError naming the argument on malformed operands."""
    op = "decode_attention"
    if q.dim() != 4 or q.dtype not in DTYPES:
        raise ValueError(f"{op}: q must be a 4D [B, Hkv, R, D] bf16, fp16 or fp32 tensor, got {q.dtype} "
                         f"{tuple(q.shape)}")  # fmt: skip
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4 or t.dtype not in DTYPES:
            raise ValueError(f"{op}: {name} must be a 4D [B, Hkv, L, D] bf16, fp16 or fp32 tensor, got {t.dtype} "
                             f"{tuple(t.shape)}")  # fmt: skip
        b, h, _, d = t.shape
        if (b, h, d) != (q.shape[0], q.shape[1], q.shape[3]):
            raise ValueError(f"{op}: {name} {tuple(t.shape)} does not match q {tuple(q.shape)}: they need the same "
                             "B, Hkv and D")  # fmt: skip
        if t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must have its last dim contiguous, got strides {t.stride()}")
        if t.shape[2] < 1:
            raise ValueError(f"{op}: {name} holds no positions (L = 0)")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{op}: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    d = q.shape[3]
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"{op}: the head dim D must be a power of 2 from 16 to 256, got {d}")
    if q.shape[0] * q.shape[1] > COUNTERS:
        raise ValueError(f"{op}: at most {COUNTERS} heads B * Hkv a launch, got {q.shape[0]} * {q.shape[1]}")
    if length.dtype not in (torch.int32, torch.int64) or length.dim() != 1 or length.numel() not in (1, q.shape[0]):
        raise ValueError(f"{op}: length must be an int32 or int64 tensor [1] or [B] (B = {q.shape[0]}), got "
                         f"{length.dtype} {tuple(length.shape)}")  # fmt: skip
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("length", length)):
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device}, q on {q.device}")
    if not q.is_cuda and not interpreting():
        raise ValueError(f"{op}: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1), got {q.device}")


def check_append(q: torch.Tensor, k_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> None:  # fmt: skip
    """Raise a ValueError naming the argument on malformed ``append`` operands (q, k and v as split sums with a
    leading split dim: ``check_split_sums`` first)."""
    op = "decode_attention"
    b, hkv, _, d = k_cache.shape
    lead = tuple(q.shape[:-4])  # (S,) for split sums
    for name, t in (("k", k), ("v", v)):
        if t.shape != (*lead, b, hkv * d) or t.stride(-1) != 1 or t.dtype not in DTYPES or t.device != q.device:
            raise ValueError(f"{op}: the appended {name} must be [B, Hkv * D] = [{b}, {hkv * d}] rows (with q's "
                             f"leading split dim, if any), the last dim contiguous, on q's device; got {t.dtype} "
                             f"{tuple(t.shape)} {t.stride()}")  # fmt: skip
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[1] != d // 2 or t.dtype not in DTYPES or not t.is_contiguous():
            raise ValueError(f"{op}: the RoPE table {name} must be a contiguous float [max_len, D / 2 = {d // 2}], "
                             f"got {t.dtype} {tuple(t.shape)}")  # fmt: skip
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device}, q on {q.device}")


def check_split_sums(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     qkv_scale: torch.Tensor | None) -> None:  # fmt: skip
    """Raise a ValueError naming the argument where q [S, B, Hkv, R, D], k, v [S, B, Hkv * D] are not fp32 split
    sums of one [q | k | v] GEMM output with ``qkv_scale`` one or one per column, or the caches are fp32."""
    op = "decode_attention"
    if q.dim() != 5 or q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32:
        raise ValueError(f"{op}: split sums are fp32 q [S, B, Hkv, R, D] and k, v [S, B, Hkv * D]; got q {q.dtype} "
                         f"{tuple(q.shape)}, k {k.dtype}, v {v.dtype}")  # fmt: skip
    _, _, heads, reps, d = q.shape
    if q.stride(3) != d or q.stride(2) != reps * d:
        raise ValueError(f"{op}: split sums' q heads must be consecutive columns of a row, got strides {q.stride()}")
    if k_cache.dtype == torch.float32:
        raise ValueError(f"{op}: split sums are rounded to the caches' dtype, a 16-bit one; got {k_cache.dtype}")
    columns = heads * (reps + 2) * d
    if qkv_scale is not None and (qkv_scale.dtype != torch.float32 or qkv_scale.numel() not in (1, columns)
                                  or qkv_scale.device != q.device or not qkv_scale.is_contiguous()):  # fmt: skip
        raise ValueError(f"{op}: qkv_scale is fp32, one or one per column of [q | k | v] ({columns}), on q's "
                         f"device; got {qkv_scale.dtype} {tuple(qkv_scale.shape)}")  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: torch.Tensor,
    scale: float | None = None,
    splits: int | None = None,
    block_l: int | None = None,
    append: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    qkv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k_cache^T * scale) v_cache over the cache positions below ``length`` -> [B, Hkv, R, D] in q's
    dtype (module doc). ``scale``: 1 / sqrt(D) by default, as SDPA's. ``splits`` overrides the number of chunks
    (None: from the SM count; at most one per tile), ``block_l`` the positions a tile (a power of 2, at least 16;
    None: BLOCK_L, INTERPRET_BLOCK_L under the interpreter). ``append`` = (k, v, cos, sin): the step's own key and
    value [B, Hkv * D] and the RoPE tables [max_len, D / 2] (the model's buffers, fp32 or its dtype; the rotation
    is fp32 either way): q and k unrotated, rotated at position length - 1, where k and v are written into the
    caches and attended over (module doc).
    With ``append``, q [S, B, Hkv, R, D] and k, v [S, B, Hkv * D] may be the fp32 sums of a QKV GEMM's S splits of
    K (mx_kernels.gluon.weight_only_tiled, ``partials``; q's heads consecutive columns of the [q | k | v] row): the
    kernel adds them in split order from 0, times ``qkv_scale`` (fp32, one or one per column of [q | k | v]; None:
    none) and rounds to the caches' dtype, as the GEMM's epilogue would; the output is in that dtype."""
    parts = q.shape[0] if q.dim() == 5 else 0
    if parts:
        if append is None:
            raise ValueError("decode_attention: split sums for q come with append (a decode step's QKV GEMM)")
        check_split_sums(q, append[0], append[1], k_cache, qkv_scale)
    elif qkv_scale is not None:
        raise ValueError("decode_attention: qkv_scale scales split sums; q is not one (4D)")
    check(q[0] if parts else q, k_cache, v_cache, length)
    if append is not None:
        check_append(q, k_cache, *append)
    bsz, heads, reps, d = q.shape[-4:]
    dtype = k_cache.dtype if parts else q.dtype
    out = torch.empty(q.shape[-4:], dtype=dtype, device=q.device)
    if out.numel() == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    mma16 = dtype == k_cache.dtype == v_cache.dtype != torch.float32 and not interpreting()
    if block_l is None:
        if interpreting():
            block_l = INTERPRET_BLOCK_L
        elif mma16:
            block_l = BLOCK_L_MMA16 if d <= 128 else BLOCK_L_MMA16_WIDE
        else:
            block_l = BLOCK_L
    if block_l < 16 or block_l & (block_l - 1):
        raise ValueError(f"decode_attention: block_l must be a power of 2, at least 16; got {block_l}")
    n_splits, chunk = split_count(bsz * heads, k_cache.shape[2], block_l, _sm_count(q.device), splits)
    direct = n_splits == 1
    rows = bsz * heads * n_splits * reps
    block_rc = triton.next_power_of_2(reps)
    if direct:  # the split kernel writes the output itself: no workspace (``out`` stands in for it), no combine
        acc = m = lse = counters = out
    else:
        counters = arrival_counters("decode_attention", q.device, COUNTERS)
        acc = torch.empty((rows * d,), dtype=torch.float32, device=q.device)
        m, lse = torch.empty((2, rows), dtype=torch.float32, device=q.device).unbind(0)
    qk_scale = (1.0 / math.sqrt(d) if scale is None else float(scale)) * LOG2E
    launch = pdl.options(q.device) if chunk == block_l else dict(PDL=False)  # PDL: one tile a chunk (module doc)
    kn, vn, cos, sin = append if append is not None else (q, q, q, q)  # unread stand-ins without ``append``
    ps = qkv_scale if qkv_scale is not None else q  # an unread stand-in
    stride_qs, stride_kns, stride_vns = (q.stride(0), kn.stride(0), vn.stride(0)) if parts else (0, 0, 0)

    def build_split() -> tuple[tuple[int, ...], dict]:
        return (bsz * heads, n_splits), dict(
            q_ptr=q, k_ptr=k_cache, v_ptr=v_cache, len_ptr=length, acc_ptr=acc, m_ptr=m, l_ptr=lse, cnt_ptr=counters,
            out_ptr=out, kn_ptr=kn, vn_ptr=vn, cos_ptr=cos, sin_ptr=sin, ps_ptr=ps, H=heads, R=reps,
            L=k_cache.shape[2], CHUNK=chunk, SPLITS=n_splits, stride_len=int(length.numel() > 1), qk_scale=qk_scale,
            stride_qb=q.stride(-4), stride_qh=q.stride(-3), stride_qr=q.stride(-2),
            stride_kb=k_cache.stride(0), stride_kh=k_cache.stride(1), stride_kl=k_cache.stride(2),
            stride_vb=v_cache.stride(0), stride_vh=v_cache.stride(1), stride_vl=v_cache.stride(2),
            stride_ob=out.stride(0), stride_oh=out.stride(1), stride_or=out.stride(2), stride_knb=kn.stride(-2),
            stride_vnb=vn.stride(-2), stride_qs=stride_qs, stride_kns=stride_kns, stride_vns=stride_vns,
            stride_ps=int(qkv_scale is not None and qkv_scale.numel() > 1), D=d,
            BLOCK_R=max(16, triton.next_power_of_2(reps)), BLOCK_L=block_l,
            BLOCK_S=min(BLOCK_S, triton.next_power_of_2(n_splits), max(1, COMBINE_TILE // block_rc)),
            BLOCK_RC=block_rc, DIRECT=direct, MMA16=mma16, APPEND=append is not None, ONE_TILE=chunk == block_l,
            PARTS=parts, HAS_PS=qkv_scale is not None, num_warps=NUM_WARPS, **launch,
        )  # fmt: skip

    key = (q.shape, q.stride(), q.dtype, k_cache.stride(), v_cache.stride(), k_cache.shape[2], k_cache.dtype,
           v_cache.dtype, length.shape, length.dtype, qk_scale, n_splits, chunk, block_l, launch["PDL"],
           append is not None, kn.stride(), kn.dtype, vn.stride(), vn.dtype, cos.dtype, sin.dtype,
           None if qkv_scale is None else qkv_scale.numel())  # fmt: skip
    _SPLIT.launch_keyed(key, build_split, q_ptr=q, k_ptr=k_cache, v_ptr=v_cache, len_ptr=length, acc_ptr=acc,
                        m_ptr=m, l_ptr=lse, cnt_ptr=counters, out_ptr=out, kn_ptr=kn, vn_ptr=vn, cos_ptr=cos,
                        sin_ptr=sin, ps_ptr=ps)  # fmt: skip
    return out
