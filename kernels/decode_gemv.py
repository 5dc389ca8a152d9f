"""A decode step's dense GEMV: out [1, N] = x [1, K] @ w [N, K].T, the weight read as it is stored (bf16 in a
decode step; any float dtype of x's), fp32 sums, out in x's dtype. Optionally SwiGLU in the epilogue.

Why not cuBLAS: at one row a GEMM is a read of the weight, and cuBLAS's kernels read it well (Llama 3 8B's
projections at 3.3-4.0 TB/s on an H200), but they launch plainly: between two of them, and between them and the
step's norm and attention kernels, the GPU drains one kernel before it starts the next. This kernel launches
with PDL (mx_kernels.pdl) like the step's other kernels, and its SwiGLU epilogue saves the silu * mul launch.
us per GEMM on one H200, one row, in a PDL chain of one shape, weights read from memory, cuBLAS -> this kernel:
Llama 3 8B's fused QKV 15.2 -> 14.5, wo 13.3 -> 10.6, fused gate/up with silu * mul 58.4 -> 57.1, w2 32.1 ->
30.2, output layer 247.1 -> 237.2; the MoE 16B's QKV 6.3 -> 5.5. At two rows and more cuBLAS is faster (the
fused gate/up at 2 rows 59.1 against 69.5, at 4 rows 58.9 against 100.7), so the kernel takes one row (MAX_M).

The kernel: a program owns BLOCK_N rows of w (output columns) and all of K, walking it in tiles of BLOCK_K; each
thread loads 8 contiguous elements of a row (16 bytes of a 16-bit weight) and the same of x, multiplies in fp32
and keeps a running fp32 sum per element of its tile, reduced over K once after the loop (in registers, then
across the threads). No split of K: the grid is cdiv(N, BLOCK_N) programs, at least 512 at the shapes above,
several an SM. Products of 16-bit values are exact in fp32, so the result differs from cuBLAS's only by the
order of the fp32 sums, then one rounding.

SwiGLU (``swiglu``): w is w1 and w3 concatenated along N; a program takes BLOCK_N / 2 rows of each, the same
hidden units, rounds both sums to the output dtype (as the unfused GEMM's output) and writes silu(gate) * up
with ``silu_mul``'s roundings (mx_kernels.decode_fused.swiglu): out [1, N / 2].

Configs (``config``): (BLOCK_N, BLOCK_K, num_warps) from a sweep of 36 per Llama 3 8B shape on an H200: where
BLOCK_N 8 makes 8 programs an SM or more, short programs (the output layer, the fused gate/up), else long ones
(wo, w2); the fused QKV its own (CHOSEN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from mx_kernels import pdl
from mx_kernels.decode_fused import swiglu as swiglu_of
from mx_kernels.launch_cache import LaunchCache

MAX_M = 1  # rows past which a GEMM is cuBLAS's (mx_recipe.infer.gemv; module doc)

# (N, K, swiglu) -> (BLOCK_N, BLOCK_K, num_warps) at one row: Llama 3 8B's fused QKV (the others follow the rule)
CHOSEN = {(6144, 4096, False): (4, 512, 2)}


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, SWIGLU: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    pid = tl.program_id(0)
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
    k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn_in[:, None] * stride_wn + k[None, :]
    x_ptrs = x_ptr + k
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs)
        else:
            in_k = k0 + k < K
            w = tl.load(w_ptrs, mask=in_k[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=in_k, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.sum(acc, 1)  # [BLOCK_N]
    if SWIGLU:
        h = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        gate, up_h = tl.split(tl.permute(tl.reshape(h, (2, HALF)), (1, 0)))
        cols, _ = tl.split(tl.permute(tl.reshape(rn, (2, HALF)), (1, 0)))  # the gate rows: the output columns
        tl.store(out_ptr + cols, swiglu_of(gate, up_h, out_ptr.dtype.element_ty), mask=cols < N)
    else:
        tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=rn < N)


_GEMV = LaunchCache(_gemv_kernel)


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def config(n: int, k: int, swiglu: bool, sms: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an N x K weight (module doc): CHOSEN, else BLOCK_N 8 and, where that
    makes at least 8 programs an SM, short programs (256 elements of K, one warp; the output layer, a fused
    gate/up), else long ones (1024, four warps; wo, w2). A thread keeps 64 running sums either way."""
    if (n, k, swiglu) in CHOSEN:
        return CHOSEN[(n, k, swiglu)]
    return (8, 256, 1) if triton.cdiv(n, 8) >= 8 * sms else (8, 1024, 4)


def gemv(x: torch.Tensor, w: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
    """x [M, K] @ w [N, K].T -> [M, N] in x's dtype, M at most MAX_M (module doc); ``swiglu``: w is [w1; w3] and
    the output [M, N / 2] is silu(x w1^T) * (x w3^T). Rows of w contiguous, and x's."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or x.dtype != w.dtype:
        raise ValueError(f"gemv: x [M, K] and w [N, K] of one dtype, got x {x.dtype} {tuple(x.shape)} and w "
                         f"{w.dtype} {tuple(w.shape)}")  # fmt: skip
    if x.shape[0] > MAX_M:
        raise ValueError(f"gemv: x has {x.shape[0]} rows, at most {MAX_M}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("gemv: rows of x and w must be contiguous")
    if swiglu and w.shape[0] % 2:
        raise ValueError(f"gemv: swiglu needs w1 and w3 of one size, got {w.shape[0]} rows")
    (m, k), n = x.shape, w.shape[0]
    out = torch.empty((m, n // 2 if swiglu else n), dtype=x.dtype, device=x.device)
    if m == 0 or out.shape[1] == 0:
        return out
    if k == 0:
        return out.zero_()  # empty sums; silu(0) * 0 with swiglu
    block_n, block_k, warps = config(n, k, swiglu, _sm_count(x.device))
    grid = (triton.cdiv(n // 2, block_n // 2) if swiglu else triton.cdiv(n, block_n),)
    _GEMV.launch(
        grid,
        dict(x_ptr=x, w_ptr=w, out_ptr=out, N=n, K=k, stride_wn=w.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
             EVEN_K=k % block_k == 0, SWIGLU=swiglu, num_warps=warps, **pdl.options(x.device)),
    )  # fmt: skip
    return out
