"""Weight-only GEMM on Hopper's wgmma with the upcast weights as its register operand (Gluon).

out [M, N] = x [M, K] (bf16) @ dequantize(w).T for M up to 64, w packed as mx_recipe.formats packs MXFP8, MXFP4
and NVFP4 (e4m3 codes [N, K], or e2m1 codes [N, K/2] with element 2j in the low nibble of byte j; e8m0 scales
[N, K/32], or e4m3 scales [N, K/16] and an fp32 tensor scale), in its natural layout.

The product is computed transposed, out^T = w x^T: the weight tile [64 rows, 128 of K] is wgmma's A operand, held
in registers, and x^T [128, BLOCK_M] its B operand in shared memory, so the upcast weights never pass through
shared memory (what a ``tl.dot`` with the weight as second operand costs), and M as wgmma's N dimension pads to
8, not 64.

Each thread loads, per row it owns, the codes of 32 consecutive elements of K (16 bytes of e2m1, 32 of e4m3): one
scale block. K is a contracted dimension, so the order in which those elements meet wgmma's A layout is free,
provided x^T's rows follow the same order: a word of 8 e2m1 codes gives its pairs (nibbles 0 and 4, 1 and 5, 2 and
6, 3 and 7), a word of 4 e4m3 codes its pairs (bytes 0 and 2, 1 and 3), each a bf16x2 register, with no moves but a
shift of the word; ``permute_k`` places them, and x to match. Each pair is built on both halves
at once: e2m1 as sign | magnitude >> 6 (the value times 2**-126, a bf16 subnormal for 0.5) times 2**126, e4m3 as
sign | magnitude >> 4 (times 2**-120) times 2**120, NaN for its codes 0x7F and 0xFF; then times the block's scale
in bf16: for the MX formats 2**(s - 127) (2**-127 a bf16 subnormal; NaN for 0xFF), each product rounded once as
``dequantize`` rounds it; for NVFP4 the e4m3 scale's value (NaN for 0x7F, 0xFF), e2m1 * e4m3 exact in bf16, and the
tensor scale multiplies the fp32 sum once, as the Triton kernel does (tests/test_weight_only_gemm.py: the bound).
"""

from __future__ import annotations

import torch
import triton
import triton.experimental.gluon.language as gl
from mx_kernels.common import arrival_counters
from mx_kernels.gluon.common import permute_k, split_k_sum
from mx_kernels.mx.weight_only import FORMATS, tensor_scales
from triton.experimental import gluon
from triton.experimental.gluon.language.nvidia import hopper

BLOCK_K = gl.constexpr(128)  # elements of K a step: 16 code bytes a row for each of a warp's 4 lanes along K
COUNTERS = 1 << 12  # split-K tiles a launch may have
MAX_M = 64  # rows of x a launch takes: wgmma's N

# a pair register from a word v of 8 codes: both nibbles at the top of a bf16 half, sign | magnitude >> 6,
# times 2**126 (the subnormal code 0.5 made normal) and the scale factor f
_PAIRS = "".join(
    f"shl.b32 q, $8, {shift}; shr.b32 m, q, 6; and.b32 m, m, 0x01C001C0; lop3.b32 r, q, 0x80008000, m, 0xEA;\n"
    f"mul.rn.bf16x2 r, r, b; mul.rn.bf16x2 r, r, f; mov.b32 {{${2 * i}, ${2 * i + 1}}}, r;\n"
    for i, shift in enumerate((12, 8, 4, 0))
)
# f from the scale byte $9, in both bf16 halves. e8m0: 2**(s - 127) as bf16 bits s << 7 (2**-127, a subnormal,
# for 0), NaN for 0xFF. e4m3: (c & 0x7F) << 4 is the value times 2**-120 (a subnormal code a bf16 subnormal),
# times 2**120, the sign from bit 7, NaN for 0x7F and 0xFF.
_SCALE = {
    "mxfp4": "shl.b32 f, $9, 7; setp.eq.u32 p, $9, 255; selp.b32 f, 0x7FC0, f, p; setp.eq.u32 p, $9, 0;\n"
    "selp.b32 f, 0x0040, f, p; prmt.b32 f, f, f, 0x1010;\n",
    "nvfp4": "and.b32 m, $9, 0x7F; shl.b32 f, m, 4; and.b32 q, $9, 0x80; shl.b32 q, q, 8; or.b32 f, f, q;\n"
    "prmt.b32 f, f, f, 0x1010; mov.b32 r, 0x7B807B80; mul.rn.bf16x2 f, f, r; setp.eq.u32 p, m, 0x7F;\n"
    "selp.b32 f, 0x7FC07FC0, f, p;\n",
}
_UPCAST = {
    fmt: gl.constexpr("{ .reg .b32 q, m, r, f, b; .reg .pred p;\n" + scale + "mov.b32 b, 0x7E807E80;\n" + _PAIRS + "}")
    for fmt, scale in _SCALE.items()
}
_UPCAST_MXFP4 = _UPCAST["mxfp4"]
_UPCAST_NVFP4 = _UPCAST["nvfp4"]
# e4m3: a word of 4 codes ($4, scale byte $5) -> the pairs (bytes 0, 2) and (1, 3). A byte at the top of a bf16 half:
# sign | (magnitude >> 4) is its value times 2**-120 (a subnormal code a bf16 subnormal), times 2**120, times the
# scale; codes 0x7F and 0xFF (NaN) set their half to NaN: their low 7 bits + 1 carry into the byte's top bit,
# which prmt replicates over the half.
_E4M3_PAIR = (
    "shr.b32 m, q, 4; and.b32 m, m, 0x07F007F0; lop3.b32 r, q, 0x80008000, m, 0xEA;\n"
    "mul.rn.bf16x2 r, r, b; mul.rn.bf16x2 r, r, f; prmt.b32 n, t, 0, {sel}; lop3.b32 r, r, n, 0x7FC07FC0, 0xF8;\n"
    "mov.b32 {{{lo}, {hi}}}, r;\n"
)
_UPCAST_MXFP8 = gl.constexpr(
    "{ .reg .b32 q, m, r, f, b, t, n; .reg .pred p;\n"
    + _SCALE["mxfp4"].replace("$9", "$5")
    + "mov.b32 b, 0x7B807B80; and.b32 t, $4, 0x7F7F7F7F; add.u32 t, t, 0x01010101;\n"
    + "shl.b32 q, $4, 8;\n"
    + _E4M3_PAIR.format(sel="0xAA88", lo="$0", hi="$1")
    + "mov.b32 q, $4;\n"
    + _E4M3_PAIR.format(sel="0xBB99", lo="$2", hi="$3")
    + "}"
)


@gluon.constexpr_function
def _word_layout(num_warps, words):
    """The codes as int32 words [16 num_warps rows, ``words`` a step]: lane l of warp w holds rows 16w + l // 4 and
    that + 8, a quarter of the words from (l % 4) words / 4 (16 contiguous bytes a row for e2m1, 32 for e4m3: one
    scale block), the rows of wgmma's A fragment for that lane (a warpgroup's 4 warps take 64 rows)."""
    per_lane = words // 4
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1 << i] for i in range(per_lane.bit_length() - 1)] + [[8, 0]],
        lane_bases=[[0, per_lane], [0, 2 * per_lane], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16 << i, 0] for i in range(num_warps.bit_length() - 1)],
        block_bases=[],
        shape=[16 * num_warps, words],
    )


@gluon.jit
def _upcast_e2m1(words, scales, FMT: gl.constexpr):
    """8 bf16 tensors [BLOCK_N, words] per word of e2m1 codes, the pairs (nibbles 0, 4), (1, 5), (2, 6), (3, 7),
    each times its scale (an e8m0 per 32 elements, or an e4m3 per 16)."""
    if FMT == "nvfp4":
        asm: gl.constexpr = _UPCAST_NVFP4
    else:
        asm: gl.constexpr = _UPCAST_MXFP4
    return gl.inline_asm_elementwise(
        asm, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, scales], dtype=[gl.bfloat16] * 8, is_pure=True, pack=1
    )


# The orders along K, as permute_k permutations. e2m1: element e (nibbles 0, 4, 1, 5, 2, 6, 3, 7) of word 4q + t
# (q the lane's position along K) goes to logical k = e0 + 2 q + 8 e1 + 16 e2 + 32 t0 + 64 t1, wgmma's A layout
# (lane q holds k = 2q, 2q + 1, 2q + 8, 2q + 9 of each 16) as a register permutation of the loaded words'. The
# upcast pairs [R, 16 words, e0, e1, e2] read as q1 q0 t1 t0 e0 e1 e2, and x [R, 128] as q1 q0 t1 t0 e0 e2 e1 (its
# physical k = 32 q + 8 t + 4 e0 + 2 e2 + e1), both to t1 t0 e2 e1 q1 q0 e0. e4m3: element e (bytes 0, 2, 1, 3) of
# word 8q + t to logical k = e0 + 2 q + 8 e1 + 16 t; pairs and x both read as q1 q0 t2 t1 t0 e0 e1 (x's physical
# k = 32 q + 4 t + 2 e0 + e1) to t2 t1 t0 e1 q1 q0 e0.
_E2M1_PAIRS = gl.constexpr((0, 3, 4, 7, 6, 1, 2, 5))
_E2M1_X = gl.constexpr((0, 3, 4, 6, 7, 1, 2, 5))
_E4M3_ORDER = gl.constexpr((0, 3, 4, 5, 7, 1, 2, 6))


@gluon.jit
def _operands_e2m1(w, s, x, FMT: gl.constexpr, A: gl.constexpr):
    """A step's A operand (the upcast weights, in registers) and x in its logical order along K: e2m1 codes."""
    e0, e1, e2, e3, e4, e5, e6, e7 = _upcast_e2m1(w, s, FMT)
    pairs = gl.join(gl.join(gl.join(e0, e1), gl.join(e2, e3)), gl.join(gl.join(e4, e5), gl.join(e6, e7)))
    a = gl.convert_layout(permute_k(pairs, _E2M1_PAIRS), A, assert_trivial=True)
    return a, permute_k(x, _E2M1_X)


@gluon.jit
def _operands_e4m3(w, s, x, A: gl.constexpr):
    """As ``_operands_e2m1``, for e4m3 codes with e8m0 scales (the pairs of bytes 0, 2 and 1, 3 of a word)."""
    e0, e1, e2, e3 = gl.inline_asm_elementwise(
        _UPCAST_MXFP8, "=h,=h,=h,=h,r,r", [w, s], dtype=[gl.bfloat16] * 4, is_pure=True, pack=1
    )
    a = gl.convert_layout(permute_k(gl.join(gl.join(e0, e1), gl.join(e2, e3)), _E4M3_ORDER), A, assert_trivial=True)
    return a, permute_k(x, _E4M3_ORDER)


@gluon.jit
def _load_step(w_rows, s_rows, x_rows, words, xk, k0, GROUP: gl.constexpr, PER_WORD: gl.constexpr):
    """A step's code words (PER_WORD codes each), scale bytes (as int32, per word: GROUP elements a scale) and x."""
    w = gl.load(w_rows + gl.expand_dims(k0 // PER_WORD + words, 0))
    s = gl.load(s_rows + gl.expand_dims(k0 // GROUP + words // (GROUP // PER_WORD), 0)).to(gl.int32)
    x = gl.load(x_rows + gl.expand_dims(k0 + xk, 0))
    return w, s, x


@gluon.jit
def weight_only_wgmma_kernel(x_ptr, w_ptr, s_ptr, ts_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, K_SPLIT, SPLIT_K,
                             stride_xm, stride_wn, stride_sn, stride_tn, stride_om, FMT: gl.constexpr,
                             BLOCK_M: gl.constexpr, NUM_WARPS: gl.constexpr, SPLIT: gl.constexpr,
                             UNROLL: gl.constexpr):  # fmt: skip
    """One program: 16 NUM_WARPS weight rows (a warpgroup's wgmma per 64), every row of x (M <= BLOCK_M), its split
    of K (K_SPLIT, a multiple of 128). The next step's loads are issued before this step's wgmma, which runs while
    they land. The wgmma is waited for before the next step's upcast: that upcast may take the registers of this
    step's A operand, which wgmma reads until it completes (PTX: undefined behaviour otherwise). x^T is
    double-buffered, so one warpgroup's store of the next step's x cannot overwrite a tile the other warpgroup's
    wgmma still reads (8 warps: the CTA barrier before each wgmma orders them). SPLIT: each split stores its fp32
    partial and the last to arrive (a counter per tile) sums them in split order, so the result does not depend on
    timing."""
    BLOCK_N: gl.constexpr = 16 * NUM_WARPS
    GROUP: gl.constexpr = 16 if FMT == "nvfp4" else 32
    PER_WORD: gl.constexpr = 4 if FMT == "mxfp8" else 8  # codes an int32 word holds
    WL: gl.constexpr = _word_layout(NUM_WARPS, BLOCK_K // PER_WORD)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                  instr_shape=[16, BLOCK_M, 16])  # fmt: skip
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    XS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)  # x, K-major
    OL: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [NUM_WARPS, 1], [0, 1])
    pid = gl.program_id(0)
    pid_k = gl.program_id(1)
    k_start = pid_k * K_SPLIT
    k_end = gl.minimum(k_start + K_SPLIT, K)
    rows = pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, WL))
    rows = gl.where(rows < N, rows, 0)
    words = gl.arange(0, BLOCK_K // PER_WORD, layout=gl.SliceLayout(0, WL))
    w_rows = w_ptr.to(gl.pointer_type(gl.int32)) + gl.expand_dims(rows * (stride_wn // 4), 1)
    s_rows = s_ptr + gl.expand_dims(rows * stride_sn, 1)
    xm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, XL))
    xk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, XL))
    x_rows = x_ptr + gl.expand_dims(gl.where(xm < M, xm, 0) * stride_xm, 1)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, BLOCK_K], XS)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
    w, s, x = _load_step(w_rows, s_rows, x_rows, words, xk, k_start, GROUP, PER_WORD)
    i = 0
    for k0 in range(k_start, k_end, BLOCK_K):
        if FMT == "mxfp8":
            a, xl = _operands_e4m3(w, s, x, A)
        else:
            a, xl = _operands_e2m1(w, s, x, FMT, A)
        x_buf = x_smem.index(i % 2)
        x_buf.store(xl)
        hopper.fence_async_shared()
        # the next step's (the last step's again after it: unmasked loads, one redundant step's bytes)
        k_next = gl.multiple_of(gl.minimum(k0 + BLOCK_K, k_end - BLOCK_K), BLOCK_K)  # whole 16-byte runs
        w, s, x = _load_step(w_rows, s_rows, x_rows, words, xk, k_next, GROUP, PER_WORD)
        acc = hopper.warpgroup_mma(a, x_buf.permute((1, 0)), acc, is_async=True)  # x^T
        acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc, x_buf])[0]
        i += 1
    acc = gl.convert_layout(acc, OL)
    on = pid * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, OL))
    om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, OL))
    mask = gl.expand_dims(om < M, 0) & gl.expand_dims(on < N, 1)
    last = True
    if SPLIT:
        acc, last = split_k_sum(acc, on, om, ws_ptr, cnt_ptr, pid, pid_k, M, N, SPLIT_K, UNROLL)
    if last:
        if FMT == "nvfp4":  # the tensor scale on the fp32 sum, once (one, or one per row of N)
            acc = acc * gl.expand_dims(gl.load(ts_ptr + gl.where(on < N, on, 0) * stride_tn), 1)
        ptrs = out_ptr + gl.expand_dims(om, 0) * stride_om + gl.expand_dims(on, 1)
        gl.store(ptrs, acc.to(gl.bfloat16), mask=mask)


def wgmma_weight_only(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor | None,
                      fmt: str, num_warps: int = 4, split_k: int = 1, out: torch.Tensor | None = None
                      ) -> torch.Tensor:  # fmt: skip
    """x [M, K] bf16 @ dequantize(fmt's codes qdata, [N, K] e4m3 (mxfp8) or [N, K/2] e2m1 pairs, and scales, [N, K/32]
    e8m0 (mxfp4, mxfp8) or [N, K/16] e4m3 with the fp32 ``tensor_scale``, one or one per row of N (nvfp4)).T ->
    [M, N] bf16, for M up to MAX_M and K a multiple of 128 (module doc); ``num_warps`` 4 or 8: 64 or 128 weight rows a
    program (8: two warpgroups share each x tile); K split ``split_k`` ways (at most one split a 128-element step).
    ``out``: a bf16 [M, N] tensor with unit column stride to write (rows of a larger output), else a new one."""
    group, pack = FORMATS.get(fmt, (None, None))
    if group is None or (tensor_scale is None) != (fmt != "nvfp4"):
        raise ValueError(f"wgmma_weight_only: fmt mxfp8 or mxfp4 (no tensor scale), or nvfp4 (with one), got {fmt!r}")
    if x.dtype != torch.bfloat16 or x.dim() != 2 or not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"wgmma_weight_only: x must be bf16 [M, K] with 1 <= M <= {MAX_M}, got {x.dtype} "
                         f"{tuple(x.shape)}")  # fmt: skip
    m, k = x.shape
    n = qdata.shape[0]
    if k % BLOCK_K.value or qdata.shape != (n, k // pack) or scale.shape != (n, k // group):
        raise ValueError(f"wgmma_weight_only: K a multiple of {BLOCK_K.value}, codes [N, K/{pack}] and scales "
                         f"[N, K/{group}]; got x {tuple(x.shape)}, codes {tuple(qdata.shape)}, scales "
                         f"{tuple(scale.shape)}")  # fmt: skip
    if num_warps not in (4, 8) or split_k < 1:
        raise ValueError(f"wgmma_weight_only: num_warps 4 or 8 and split_k >= 1, got {num_warps} and {split_k}")
    x = x if x.stride(1) == 1 else x.contiguous()
    w = qdata.view(torch.uint8).contiguous()
    s = scale.view(torch.uint8).contiguous()
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    elif out.shape != (m, n) or out.dtype != torch.bfloat16 or out.stride(1) != 1:
        raise ValueError(f"wgmma_weight_only: out must be bf16 [{m}, {n}] with unit column stride, got {out.dtype} "
                         f"{tuple(out.shape)} strides {out.stride()}")  # fmt: skip
    if tensor_scale is not None and tensor_scale.numel() not in (1, n):
        raise ValueError(f"wgmma_weight_only: nvfp4 takes one tensor scale or one per row of N ({n}), got "
                         f"{tensor_scale.numel()}")  # fmt: skip
    ts, _, stride_tn = tensor_scales(tensor_scale, n, out)
    steps = k // BLOCK_K.value
    k_split = triton.cdiv(steps, min(split_k, steps))  # steps a split: no split without one
    split_k = triton.cdiv(steps, k_split)
    n_tiles = triton.cdiv(n, 16 * num_warps)
    split = split_k > 1
    ws = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split else out
    counters = arrival_counters("weight_only_mma", x.device, COUNTERS) if split else out
    if n_tiles > COUNTERS:
        raise ValueError(f"wgmma_weight_only: {n_tiles} tiles, past the {COUNTERS} counters")
    weight_only_wgmma_kernel[(n_tiles, split_k)](
        x, w, s, ts, out, ws, counters, m, n, k, k_split * BLOCK_K.value, split_k, x.stride(0), w.stride(0),
        s.stride(0), stride_tn, out.stride(0), FMT=fmt, BLOCK_M=max(8, triton.next_power_of_2(m)),
        NUM_WARPS=num_warps, SPLIT=split, UNROLL=triton.next_power_of_2(split_k) if split else 0, num_warps=num_warps,
    )  # fmt: skip
    return out
