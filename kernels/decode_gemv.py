"""A decode step's one-row GEMV: out [1, N] = x [1, K] @ w [N, K].T with w as it is stored, a 16-bit weight (bf16
in a decode step; any float dtype of x's) or an MXFP8 one (e4m3 codes, e8m0 scales per 32 along K); fp32 sums,
out in x's dtype. Optionally SwiGLU in the epilogue. Grouped (below): the same over an MoE step's rows sorted by
expert, each row by its expert's weight.

Why, for bf16 weights, not cuBLAS: at one row a GEMM is a read of the weight, and cuBLAS's kernels read it well
(Llama 3 8B's projections at 3.3-4.0 TB/s on an H200), but they launch plainly: between two of them, and between
them and the step's norm and attention kernels, the GPU drains one kernel before it starts the next. This kernel
launches with PDL (mx_kernels.pdl) like the step's other kernels, and its SwiGLU epilogue saves the silu * mul
launch. us per GEMM on one H200, one row, in a PDL chain of one shape, weights read from memory, cuBLAS -> this
kernel: Llama 3 8B's fused QKV 15.2 -> 14.5, wo 13.3 -> 10.6, fused gate/up with silu * mul 58.4 -> 57.1, w2 32.1
-> 30.2, output layer 247.1 -> 237.2; the MoE 16B's QKV 6.3 -> 5.5. From two rows cuBLAS is faster, so the kernel
takes one row (MAX_M).
For MXFP8 weights it is faster at one row than the weight-only kernel's small-M path (mx_kernels.mx.weight_only),
which splits K and reads each scale in its unit sums' layout: a Llama 3 8B layer's four GEMMs 65.5 -> 59.4 us.

The kernel: a program owns BLOCK_N rows of w (output columns) and all of K, walking it in tiles of BLOCK_K, and
each thread loads 8 (16-bit) or 16 (MXFP8) contiguous elements of a row, 16 bytes, and the same of x. A 16-bit
weight's products go into a running fp32 sum per element of the thread's tile. An MXFP8 code becomes fp32 by the
hardware's conversion (e4m3 pairs to f16 pairs, sm_89+; before it and under the interpreter, integer bit
operations), its product with x is exact, each 32-element block's products are summed (in the thread, then with
the one neighbour that holds the block's other half) and the sum times the block's scale (exact, a power of 2)
goes into a running sum per block. After the loop the sums are reduced over K (in registers, then across the
threads). No split of K: the grid is cdiv(N, BLOCK_N) programs, at least 512 at the shapes above, several an SM.
The result differs from cuBLAS's on the dequantized weight only by the order of the fp32 sums, then one rounding.
A program reads its first step's weights before it waits for the kernel before it (PDL): they do not depend on
it, and the read overlaps that kernel's tail. One H200, Llama 3 8B's decode step at one sequence, without -> with:
bf16 4.00 -> 3.96-3.97 ms, MXFP8 2.47 -> 2.42-2.43. MXFP8 codes are loaded evict-first (in L1 and L2), as data
read once a step (that step on one H200: 2.375 -> 2.333 ms); bf16 weights load plainly, which is faster for them.

SwiGLU (``swiglu``): w is w1 and w3 concatenated along N; a program takes BLOCK_N / 2 rows of each, the same
hidden units, rounds both sums to the output dtype (as the unfused GEMM's output) and writes silu(gate) * up
with ``silu_mul``'s roundings (mx_kernels.decode_fused.swiglu): out [1, N / 2].

Grouped (``grouped_gemv``): an MoE decode step's experts, w [E, N, K], the rows sorted by expert with the groups'
cumulative ends ``offs`` (as ``torch._grouped_mm`` takes them), read from the tokens in place through ``rows`` where
the router hands them over. The grid's second axis is the rows, at most GROUPED_MAX_M (a token's top-k): each
program finds its row's expert in ``offs`` and reads that expert's rows of w, so only the chosen experts' weights
are read, once a row. Past a few rows experts share rows and a grouped GEMM, which reads each expert once for all of
them, takes over. The expert comes from the routing kernel, so where that is the kernel before, a grouped program
waits for it before its first read. Where it ran earlier (``offs_ready``: an MoE's w2, after w1/w3 on the same
rows), it has completed by the time this kernel's programs start, since the kernel before released them only after
its own wait (mx_kernels.pdl): the programs then read ``offs``, ``rows`` and their first weights before the wait, as
a dense GEMV does, and only x after it. At one token of the MoE 16B (6 of 64 experts), us per GEMM on one H200 in a
PDL chain over cold copies: bf16 fused w1/w3 with SwiGLU 42.0 (the rows' gather, ``torch._grouped_mm``,
``silu_mul``) -> 22.7, w2 26.7 -> 14.5; MXFP8 experts against the weight-only kernel's grouped small-M path 16.6 ->
14.7 and 12.9 -> 9.9. Shared experts folded in as groups of every token (``early``) need nothing from the routing:
where x came before the routing's launch (a decode step's w1/w3), their rows take the grid's first programs and run
without the wait, while the routing kernel still runs (MoE 16B dims, one token, MXFP8, one H200: the step 1.425 ->
1.379 ms).

Configs (``config``): (BLOCK_N, BLOCK_K, num_warps) per Llama 3 8B shape from sweeps on an H200 of 27-36 configs
in a chain of one shape, then of 4-7 in the decode step (each shape's with the others fixed: the bf16 fused gate/up
at (4, 256, 1) takes 0.047 ms off a step against the chain's choice); the MoE 16B's for MXFP8's default. Its
experts' (GROUPED_CHOSEN) from a chain of 7-12 configs at one token's 6 rows: MXFP8's; bf16's default comes within
2% of the best there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from mx_kernels import pdl
from mx_kernels.common import check_early, cuda_capability, interpreting
from mx_kernels.decode_fused import swiglu as swiglu_of
from mx_kernels.launch_cache import LaunchCache
from mx_kernels.mx.weight_only import _e4m3, _e8m0, _sm_count

MAX_M = 1  # rows past which a GEMM is cuBLAS's or the weight-only kernel's (mx_recipe.infer.gemv; module doc)
GROUPED_MAX_M = 8  # grouped rows past which experts' GEMMs are grouped GEMMs (module doc, Grouped)
MX_BLOCK = 32  # MXFP8's elements per scale

# (scaled, N, K, swiglu) -> (BLOCK_N, BLOCK_K, num_warps), from the sweeps of the module doc; others by ``config``
CHOSEN = {
    (False, 6144, 4096, False): (4, 512, 2),  # Llama 3 8B's fused QKV, bf16
    (False, 4096, 4096, False): (4, 1024, 2),  # its wo, bf16
    (False, 28672, 4096, True): (4, 256, 1),  # its fused gate/up, bf16
    (False, 4096, 14336, False): (4, 2048, 4),  # its w2, bf16
    (False, 128256, 4096, False): (4, 256, 1),  # its output layer, bf16
    (True, 4096, 4096, False): (4, 2048, 4),  # its wo, MXFP8
    (True, 28672, 4096, True): (4, 1024, 2),  # its fused gate/up, MXFP8
    (True, 4096, 14336, False): (4, 2048, 4),  # its w2, MXFP8
}
# the same for experts [E, N, K], from a sweep of 7 configs at 6 rows (one token's) on an H200
GROUPED_CHOSEN = {
    (True, 2816, 2048, True): (4, 1024, 2),  # the MoE 16B's fused w1/w3, MXFP8
    (True, 2048, 1408, False): (8, 512, 2),  # its w2, MXFP8
}


@triton.jit
def _load_tile(w_ptrs, s_ptrs, k0, K, k, kb, EVEN_K: tl.constexpr, SCALED: tl.constexpr):
    """A step's weight tile and, for MXFP8, its scale bytes (else w again); zeros past K (scales 127: 1). MXFP8
    codes are read evict-first (module doc)."""
    EVICT: tl.constexpr = "evict_first" if SCALED else ""
    if EVEN_K:
        w = tl.load(w_ptrs, eviction_policy=EVICT)
    else:
        w = tl.load(w_ptrs, mask=(k0 + k < K)[None, :], other=0, eviction_policy=EVICT)
    s = w
    if SCALED:
        if EVEN_K:
            s = tl.load(s_ptrs)
        else:
            s = tl.load(s_ptrs, mask=(k0 + 32 * kb < K)[None, :], other=127)
    return w, s


@triton.jit
def _accumulate(acc, w, s, x_ptrs, k0, K, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                SCALED: tl.constexpr, HW_FP8: tl.constexpr):  # fmt: skip
    """acc plus a step's products (module doc)."""
    if EVEN_K:
        x = tl.load(x_ptrs).to(tl.float32)
    else:
        x = tl.load(x_ptrs, mask=k0 + k < K, other=0.0).to(tl.float32)
    if SCALED:
        if HW_FP8:
            wf = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            wf = _e4m3(w.to(tl.int32)) * 1.329227995784916e36  # integer bit operations, times 2**120
        block_sums = tl.sum(tl.reshape(wf * x[None, :], (BLOCK_N, BLOCK_K // 32, 32)), 2)
        acc += block_sums * _e8m0(s.to(tl.int32))
    else:
        acc += w.to(tl.float32) * x[None, :]
    return acc


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, offs_ptr, rows_ptr, N, K, E, TOKENS, stride_xm, stride_om, stride_we,
                 stride_wn, stride_se, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 SCALED: tl.constexpr, HW_FP8: tl.constexpr, SWIGLU: tl.constexpr, GROUPED: tl.constexpr,
                 GATHER: tl.constexpr, E_POW2: tl.constexpr, OFFS_READY: tl.constexpr, EARLY: tl.constexpr,
                 PDL: tl.constexpr):  # fmt: skip
    """``EARLY`` (grouped, gathered): the last EARLY groups are every one of the TOKENS rows of x in order (folded
    shared experts): their rows take the grid's first programs and run without the PDL wait (module doc)."""
    pid = tl.program_id(0)
    row = tl.program_id(1)  # the output row: 0 but for grouped rows
    if EARLY > 0:  # the shared groups' rows (the last EARLY * TOKENS) first
        first_shared = tl.num_programs(1) - EARLY * TOKENS
        row = (row + first_shared) % tl.num_programs(1)
        shared = row >= first_shared
    j = tl.arange(0, BLOCK_N)
    if SWIGLU:  # the first half of the program's rows are gate rows (w1), the second the same rows of w3
        HALF: tl.constexpr = BLOCK_N // 2
        col = pid * HALF + j % HALF
        up = (j // HALF) * (N // 2)
        rn = tl.where(col < N // 2, col + up, N)
        rn_in = (col % (N // 2) + up).to(tl.int64)
    else:
        rn = pid * BLOCK_N + j
        rn_in = (rn % N).to(tl.int64)  # rows past N read a real row; their outputs are not stored
    in_group = row >= 0
    if GROUPED:  # the row's expert and x row come from the routing kernel: wait for it first unless it ran earlier
        routed = True
        if EARLY > 0:
            routed = not shared
            if shared:  # a shared group's row: its expert and token need nothing from the kernel before
                pdl.release_next(PDL)
            else:
                pdl.wait_prior(PDL)
                pdl.release_next(PDL)
        elif not OFFS_READY:
            pdl.wait_prior(PDL)
            pdl.release_next(PDL)
        g = tl.arange(0, E_POW2)
        ends = tl.load(offs_ptr + g, mask=(g < E) & routed, other=0x7FFFFFFF, cache_modifier=".cg")
        expert = tl.sum((ends <= row).to(tl.int32))
        in_group = expert < E  # rows past the last group's end are written as zeros
        expert = tl.minimum(expert, E - 1).to(tl.int64)
        x_row = row
        if GATHER:
            x_row = tl.load(rows_ptr + row, mask=routed, other=0, cache_modifier=".cg")
        if EARLY > 0:
            expert = tl.where(shared, E - EARLY + (row - first_shared) // TOKENS, expert).to(tl.int64)
            x_row = tl.where(shared, (row - first_shared) % TOKENS, x_row)
        w_ptr += expert * stride_we
        s_ptr += expert * stride_se
        x_ptr += x_row.to(tl.int64) * stride_xm
        out_ptr += row.to(tl.int64) * stride_om
    k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn_in[:, None] * stride_wn + k[None, :]
    x_ptrs = x_ptr + k
    kb = tl.arange(0, BLOCK_K // 32)
    s_ptrs = s_ptr + rn_in[:, None] * stride_sn + kb[None, :]
    if SCALED:  # a running sum per scale block: each block's sum times its scale
        acc = tl.zeros((BLOCK_N, BLOCK_K // 32), dtype=tl.float32)
    else:  # a running sum per element
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    w, s = _load_tile(w_ptrs, s_ptrs, 0, K, k, kb, EVEN_K, SCALED)
    if not GROUPED or OFFS_READY:  # the first step's weights do not depend on the kernel before: read them first
        pdl.wait_prior(PDL)
        pdl.release_next(PDL)
    acc = _accumulate(acc, w, s, x_ptrs, 0, K, k, BLOCK_N, BLOCK_K, EVEN_K, SCALED, HW_FP8)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        s_ptrs += BLOCK_K // 32
        w, s = _load_tile(w_ptrs, s_ptrs, k0, K, k, kb, EVEN_K, SCALED)
        acc = _accumulate(acc, w, s, x_ptrs, k0, K, k, BLOCK_N, BLOCK_K, EVEN_K, SCALED, HW_FP8)
    y = tl.where(in_group, tl.sum(acc, 1), 0.0)  # [BLOCK_N]
    if SWIGLU:
        h = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        gate, up_h = tl.split(tl.permute(tl.reshape(h, (2, HALF)), (1, 0)))
        cols, _ = tl.split(tl.permute(tl.reshape(rn, (2, HALF)), (1, 0)))  # the gate rows: the output columns
        tl.store(out_ptr + cols, swiglu_of(gate, up_h, out_ptr.dtype.element_ty), mask=cols < N)
    else:
        tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=rn < N)


_GEMV = LaunchCache(_gemv_kernel)


def _hw_fp8(device: torch.device) -> bool:
    """Whether e4m3 codes convert by the hardware's instruction (sm_89+; not under the interpreter)."""
    return not interpreting() and device.type == "cuda" and cuda_capability(device) >= (8, 9)


def config(scaled: bool, n: int, k: int, swiglu: bool, sms: int, rows: int = 1, grouped: bool = False
           ) -> tuple[int, int, int]:  # fmt: skip
    """(BLOCK_N, BLOCK_K, num_warps) for an N x K weight read for ``rows`` rows (module doc): CHOSEN (GROUPED_CHOSEN
    for an expert's), else for MXFP8 (``scaled``) 4 rows of 1024 elements a program, four warps; for 16-bit weights
    BLOCK_N 8 and, where that makes at least 8 programs an SM, short programs (256 elements of K, one warp: the
    output layer, a fused gate/up), else long ones (1024, four warps: wo, w2). A thread keeps 64 running sums of
    16-bit weights."""
    chosen = GROUPED_CHOSEN if grouped else CHOSEN
    if (scaled, n, k, swiglu) in chosen:
        return chosen[(scaled, n, k, swiglu)]
    if scaled:
        return 4, 1024, 4
    return (8, 256, 1) if triton.cdiv(n, 8) * rows >= 8 * sms else (8, 1024, 4)


def _check_weight(name: str, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, swiglu: bool) -> None:
    """One-line errors for a weight w [..., N, K] (and MXFP8 scales [..., N, K / 32]) that x [M, K] cannot take."""
    n, k = w.shape[-2:]
    if scale is None and w.dtype != x.dtype:
        raise ValueError(f"{name}: x and w of one dtype, got {x.dtype} and {w.dtype}")
    if scale is not None and (
        w.element_size() != 1
        or scale.element_size() != 1
        or scale.shape != (*w.shape[:-1], k // MX_BLOCK)
        or k % MX_BLOCK
    ):
        got = f"{w.dtype} {tuple(w.shape)} and {scale.dtype} {tuple(scale.shape)}"
        raise ValueError(f"{name}: MXFP8 codes [N, K] and scales [N, K / {MX_BLOCK}] of bytes, K a multiple of "
                         f"{MX_BLOCK}; got {got}")  # fmt: skip
    if x.stride(1) != 1 or w.stride(-1) != 1 or (scale is not None and scale.stride(-1) != 1):
        raise ValueError(f"{name}: rows of x, w and scale must be contiguous")
    if swiglu and n % 2:
        raise ValueError(f"{name}: swiglu needs w1 and w3 of one size, got {n} rows")


def _launch(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, swiglu: bool, m: int,
            offs: torch.Tensor | None = None, rows: torch.Tensor | None = None, offs_ready: bool = False,
            early: int = 0) -> torch.Tensor:  # fmt: skip
    """out [m, N (N / 2 with swiglu)]: the GEMV of each of x's m rows, or with ``offs`` of each grouped row."""
    n, k = w.shape[-2:]
    out = torch.empty((m, n // 2 if swiglu else n), dtype=x.dtype, device=x.device)
    if m == 0 or out.shape[1] == 0:
        return out
    if k == 0:
        return out.zero_()  # empty sums; silu(0) * 0 with swiglu
    scaled, grouped = scale is not None, offs is not None
    block_n, block_k, warps = config(scaled, n, k, swiglu, _sm_count(x.device), m if grouped else 1, grouped)
    grid = (triton.cdiv(n // 2, block_n // 2) if swiglu else triton.cdiv(n, block_n), m)
    experts = w.shape[0] if grouped else 1
    _GEMV.launch(
        grid,
        dict(x_ptr=x, w_ptr=w.view(torch.uint8) if scaled else w, s_ptr=scale.view(torch.uint8) if scaled else w,
             out_ptr=out, offs_ptr=offs if grouped else out, rows_ptr=rows if rows is not None else out, N=n, K=k,
             E=experts, TOKENS=x.shape[0] if early else 0, stride_xm=x.stride(0), stride_om=out.stride(0),
             stride_we=w.stride(0) if grouped else 0, stride_wn=w.stride(-2),
             stride_se=scale.stride(0) if scaled and grouped else 0, stride_sn=scale.stride(-2) if scaled else 0,
             BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
             SCALED=scaled, HW_FP8=_hw_fp8(x.device), SWIGLU=swiglu, GROUPED=grouped, GATHER=rows is not None,
             E_POW2=triton.next_power_of_2(experts), OFFS_READY=offs_ready, EARLY=early, num_warps=warps,
             **pdl.options(x.device)),
    )  # fmt: skip
    return out


def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
    """x [M, K] @ w [N, K].T -> [M, N] in x's dtype, M at most MAX_M (module doc). ``scale``: w is MXFP8, e4m3 codes
    [N, K] with e8m0 scales [N, K / 32] (bytes, or torch's float8 dtypes), else w is x's dtype. ``swiglu``: w is
    [w1; w3] and the output [M, N / 2] is silu(x w1^T) * (x w3^T). Rows of w contiguous, and x's."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemv: x [M, K] and w [N, K], got x {tuple(x.shape)} and w {tuple(w.shape)}")
    _check_weight("gemv", x, w, scale, swiglu)
    if x.shape[0] > MAX_M:
        raise ValueError(f"gemv: x has {x.shape[0]} rows, at most {MAX_M}")
    return _launch(x, w, scale, swiglu, x.shape[0])


def grouped_gemv(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, rows: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None, swiglu: bool = False, offs_ready: bool = False, early: int = 0
                 ) -> torch.Tensor:  # fmt: skip
    """Per group, its rows of x @ w[e].T -> [M, N] (module doc, Grouped): w [E, N, K] (MXFP8 with ``scale`` [E, N,
    K / 32]), ``offs`` [E] int32 the groups' cumulative row ends, M at most GROUPED_MAX_M; the rows are x [M, K], or
    with ``rows`` [M] int32 x[rows] of the tokens x [T, K]. Rows past ``offs[-1]`` are zeros. ``swiglu`` as
    ``gemv``'s. ``offs_ready``: ``offs`` and ``rows`` were written before the launch right before this one (module
    doc, Grouped). ``early`` (with ``rows``): the last ``early`` groups are every token of x in order (folded
    shared experts), and x was written before the launch right before this one: their rows run without the wait."""
    m = x.shape[0] if rows is None else rows.shape[0]
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"grouped_gemv: x [M, K] and w [E, N, K], got x {tuple(x.shape)} and w {tuple(w.shape)}")
    if offs.shape != (w.shape[0],) or offs.dtype != torch.int32 or (rows is not None and rows.dtype != torch.int32):
        got = f"offs {offs.dtype} {tuple(offs.shape)}" + ("" if rows is None else f" and rows {rows.dtype}")
        raise ValueError(f"grouped_gemv: offs int32 [E] (E = {w.shape[0]}) and rows int32; got {got}")
    _check_weight("grouped_gemv", x, w, scale, swiglu)
    if m > GROUPED_MAX_M:
        raise ValueError(f"grouped_gemv: {m} rows, at most {GROUPED_MAX_M}")
    check_early("grouped_gemv", early, rows, w.shape[0], m, x.shape[0])
    if early and offs_ready:
        raise ValueError("grouped_gemv: early groups run before the routing's outputs, offs_ready after: not both")
    rows = None if rows is None else rows.contiguous()
    return _launch(x, w, scale, swiglu, m, offs.contiguous(), rows, offs_ready, early)
