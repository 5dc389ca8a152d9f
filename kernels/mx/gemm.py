"""MX GEMM on ``tl.dot_scaled``: out [M, N] = a [M, K] @ b [N, K].T, both quantized along K.

Operands, as bytes (the kernel reads them as uint8 and ``dot_scaled`` bitcasts):

* a_q [M, K] float8_e4m3fn / float8_e5m2, or e2m1 packed two per byte [M, K/2] uint8 (first
  element in the low nibble, which is also ``dot_scaled``'s packing); b_q [N, K] the same way;
* a_scale [M, K/32], b_scale [N, K/32]: plain (not blocked) E8M0 bytes, float8_e8m0fnu or uint8.

fp32 accumulation, bf16 / fp16 / fp32 output. ``dot_scaled`` takes rhs as [K, N] with its scales
as [N, K/32] (not transposed), so one program loads a b tile [BLOCK_N, BLOCK_K] K-contiguous and
passes its transpose (a view, no data movement).

What ``dot_scaled`` compiles to depends on the GPU:

* sm_100: native block-scaled MMA (tcgen05.mma kind::mxf8f6f4 / mxf4). SM100_CONFIGS is untested.
* sm_90 and sm_89: Triton decomposes it (DecomposeScaledBlocked): each tile is upcast to bf16,
  multiplied by its scale as a bf16 2**e, NaN where the scale byte is 0xFF, then a bf16 MMA with
  fp32 accumulation. element * 2**e is exact in bf16 unless it leaves bf16's normal range (scale
  byte 0, 2**-127, becomes 0 there; 448 * 2**127 overflows), so the result equals the emulated
  backend up to summation order. On an H200 it ran at 120-200 TFLOP/s at 8192^3 (docs/DESIGN.md, Hardware facts):
  slower than a bf16 GEMM, which is why ``auto`` never picks it.

Rows of a past M and of b past N wrap around (``% M``) so the main loop has no row masks; their
results are never stored. K must be a multiple of 32; a K tail shorter than BLOCK_K is masked
(EVEN_K skips the masks when there is none).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from mx_kernels.common import interpreting
from mx_kernels.launch_cache import LaunchCache
from mx_kernels.spec import BLOCK_SIZE, cdiv, elem_format

GEMM_ELEMS = ("e4m3", "e5m2", "e2m1")
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# sm_90 default (no autotune: one compile per format pair), chosen from compiler output without a
# GPU (ptxas -v for sm_90a, 16-byte aligned operands): the fp8 / fp4 loads pipeline through shared
# memory (cp.async, num_stages deep) and nothing spills (179 registers). BLOCK_K = 128 fits too
# (242); 128 x 256 tiles with 8 warps, or 4 warps at 64 x 128 x 128, spill.
SM90_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)
# sm_100, UNTESTED on hardware (no such GPU at hand): the tile shapes of Triton's block-scaled
# matmul tutorial. They compile to tcgen05 scaled MMA without spills (ptxas, sm_100a), with ~200 KB
# of shared memory for fp8; fp4 x fp4 takes a longer K tile (the same bytes per stage).
SM100_CONFIGS = {
    "fp8": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
    "fp4": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=256, GROUP_M=8, num_warps=4, num_stages=4),
}


@triton.jit
def _mx_gemm_kernel(
    a_ptr,
    a_s_ptr,
    b_ptr,
    b_s_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_bn,
    stride_bk,
    stride_bsn,
    stride_bsk,
    stride_cm,
    stride_cn,
    A_FORMAT: tl.constexpr,
    B_FORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    A_PACK: tl.constexpr = 2 if A_FORMAT == "e2m1" else 1  # elements per byte along K
    B_PACK: tl.constexpr = 2 if B_FORMAT == "e2m1" else 1

    # Grouped order: GROUP_M row tiles share each column tile while it is in L2.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    rm = ((pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M).to(tl.int64)  # M * K can pass 2**31
    rn = ((pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N).to(tl.int64)
    ka = tl.arange(0, BLOCK_K // A_PACK)
    kb = tl.arange(0, BLOCK_K // B_PACK)
    ks = tl.arange(0, BLOCK_K // 32)
    a_ptrs = a_ptr + rm[:, None] * stride_am + ka[None, :] * stride_ak
    b_ptrs = b_ptr + rn[:, None] * stride_bn + kb[None, :] * stride_bk
    a_s_ptrs = a_s_ptr + rm[:, None] * stride_asm + ks[None, :] * stride_ask
    b_s_ptrs = b_s_ptr + rn[:, None] * stride_bsn + ks[None, :] * stride_bsk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
            a_s = tl.load(a_s_ptrs)
            b_s = tl.load(b_s_ptrs)
        else:
            # The tail's missing elements load as 0 with scale byte 0: products of zero.
            left = K - k0
            a = tl.load(a_ptrs, mask=ka[None, :] < left // A_PACK, other=0)
            b = tl.load(b_ptrs, mask=kb[None, :] < left // B_PACK, other=0)
            a_s = tl.load(a_s_ptrs, mask=ks[None, :] < left // 32, other=0)
            b_s = tl.load(b_s_ptrs, mask=ks[None, :] < left // 32, other=0)
        # tl.constexpr(...) is a no-op when compiled; the interpreter passes constexpr arguments
        # as plain str, which dot_scaled cannot read.
        acc = tl.dot_scaled(a, a_s, tl.constexpr(A_FORMAT), b.T, b_s, tl.constexpr(B_FORMAT), acc)
        a_ptrs += (BLOCK_K // A_PACK) * stride_ak
        b_ptrs += (BLOCK_K // B_PACK) * stride_bk
        a_s_ptrs += (BLOCK_K // 32) * stride_ask
        b_s_ptrs += (BLOCK_K // 32) * stride_bsk

    cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + cm.to(tl.int64)[:, None] * stride_cm + cn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(cm[:, None] < M) & (cn[None, :] < N))


def default_config(device: torch.device, a_elem: str, b_elem: str) -> dict:
    """Tiles for ``device``: SM100_CONFIGS on sm_100 (untested), SM90_CONFIG elsewhere."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 10:
        return SM100_CONFIGS["fp4" if a_elem == b_elem == "e2m1" else "fp8"]
    return SM90_CONFIG


def _check_operand(name: str, q: torch.Tensor, scale: torch.Tensor, elem: str) -> int:
    """Raise on a malformed operand; return its K (elements, not bytes)."""
    if elem not in GEMM_ELEMS:
        raise ValueError(f"mx_gemm: {name}_elem must be one of {GEMM_ELEMS}, got {elem!r}")
    want = torch.uint8 if elem == "e2m1" else elem_format(elem).torch_dtype
    if q.dtype != want:
        raise TypeError(f"mx_gemm: {name}_q for {elem} must be {want}, got {q.dtype}")
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(f"mx_gemm: {name}_scale must be float8_e8m0fnu (or its uint8 bytes), got {scale.dtype}")
    if q.dim() != 2:
        raise ValueError(f"mx_gemm: {name}_q must be 2D, got shape {tuple(q.shape)}")
    k = q.shape[1] * (2 if elem == "e2m1" else 1)
    if k % BLOCK_SIZE or tuple(scale.shape) != (q.shape[0], k // BLOCK_SIZE):
        raise ValueError(
            f"mx_gemm: {name} needs K a multiple of {BLOCK_SIZE} and scales [rows, K/32]; got {name}_q "
            f"{tuple(q.shape)} ({elem}, K = {k}) with scales {tuple(scale.shape)}"
        )
    return k


_LAUNCHES = LaunchCache(_mx_gemm_kernel)


def mx_gemm(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    a_elem: str,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    b_elem: str,
    out_dtype: torch.dtype,
    config: dict | None = None,
) -> torch.Tensor:
    """``a @ b.T`` for MX operands quantized along K (module doc): [M, N] in ``out_dtype``.

    Any strides. CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 (whose interpreter has no
    ``dot_scaled``: tests/test_gemm_triton.py supplies one). ``config`` overrides the tiles.
    """
    k = _check_operand("a", a_q, a_scale, a_elem)
    if _check_operand("b", b_q, b_scale, b_elem) != k:
        raise ValueError(f"mx_gemm: K differs: a_q {tuple(a_q.shape)} ({a_elem}), b_q {tuple(b_q.shape)} ({b_elem})")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"mx_gemm: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if len({t.device for t in (a_q, a_scale, b_q, b_scale)}) != 1:
        raise ValueError("mx_gemm: all operands must be on one device")
    cfg = {**default_config(a_q.device, a_elem, b_elem), **(config or {})}
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if block_k % 64:  # whole e2m1 bytes and a K >= 64 dot for every format pair
        raise ValueError(f"mx_gemm: BLOCK_K must be a multiple of 64, got {block_k}")
    if not a_q.is_cuda and not interpreting():
        raise RuntimeError(f"mx_gemm: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1), got {a_q.device}")
    m, n = a_q.shape[0], b_q.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    a_u8, b_u8 = a_q.view(torch.uint8), b_q.view(torch.uint8)
    a_s, b_s = a_scale.view(torch.uint8), b_scale.view(torch.uint8)
    grid = (cdiv(m, block_m) * cdiv(n, block_n),)
    _LAUNCHES.launch(
        grid,
        dict(
            a_ptr=a_u8, a_s_ptr=a_s, b_ptr=b_u8, b_s_ptr=b_s, c_ptr=out, M=m, N=n, K=k,
            stride_am=a_u8.stride(0), stride_ak=a_u8.stride(1), stride_asm=a_s.stride(0), stride_ask=a_s.stride(1),
            stride_bn=b_u8.stride(0), stride_bk=b_u8.stride(1), stride_bsn=b_s.stride(0), stride_bsk=b_s.stride(1),
            stride_cm=out.stride(0), stride_cn=out.stride(1), A_FORMAT=a_elem, B_FORMAT=b_elem, BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=cfg["GROUP_M"], EVEN_K=k % block_k == 0,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        ),
    )  # fmt: skip
    return out
