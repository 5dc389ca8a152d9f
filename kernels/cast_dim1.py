"""MX cast along the first dim ("dim1"), written transposed: x [M, K] -> qdata [K, M] + scales [K, M/32].

The result is ``to_mx(x.t().contiguous(), dim=-1)`` without the transpose copy: a program
loads a [BLOCK_M, BLOCK_K] tile contiguous along K, transposes it in registers / shared
memory, reduces blocks of 32 along M and stores rows of the [K, M] output contiguous along M.
3D expert weights [E, N, K] take the same path per expert (grid axis 2): each expert's
[K, N] slice is written directly, so the cost does not grow with E (seed 003).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from mx_kernels.common import check_cast, dim1_shapes, format_constexprs, fp8_dtype, software_round
from mx_kernels.mx_quantize import quantize_blocks, store_scales, to_fp32

# One warp per program: Triton spreads warps along M, and a 32-row block split across warps
# needs a shared-memory reduction with barriers (40% of copy BW on an H200). With one warp
# the block reduces in registers and shuffles (docs/notes_cast_kernels.md).
DIM1_CONFIG = dict(BLOCK_M=32, BLOCK_K=64, num_warps=1)


@triton.jit
def _cast_dim1_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xb,
    stride_xm,
    stride_xk,
    stride_qb,
    stride_sb,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCKED: tl.constexpr,
    EMAX: tl.constexpr,
    MAX_MANT: tl.constexpr,
    MAX_NORMAL: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    IS_E4M3: tl.constexpr,
    RCEIL: tl.constexpr,
    SOFTWARE_ROUND: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)  # E * M * K can pass 2**31
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x_offs = pid_b * stride_xb + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :] * stride_xk
    x = to_fp32(tl.load(x_ptr + x_offs, mask=mask, other=0.0), SOFTWARE_ROUND)

    # [BLOCK_K, BLOCK_M]: each row of the transposed tile holds BLOCK_M / 32 blocks along M
    blocks = tl.reshape(tl.trans(x), (BLOCK_K * BLOCK_M // 32, 32))
    q, scale = quantize_blocks(blocks, EMAX, MAX_MANT, MAX_NORMAL, MBITS, EMIN, IS_E4M3, RCEIL, SOFTWARE_ROUND)

    q_offs = pid_b * stride_qb + cols.to(tl.int64)[:, None] * M + rows[None, :]
    tl.store(q_ptr + q_offs, tl.reshape(q, (BLOCK_K, BLOCK_M)), mask=tl.trans(mask))

    scale = tl.reshape(scale, (BLOCK_K, BLOCK_M // 32))
    scale_cols = M >> 5
    s_cols = pid_m * (BLOCK_M // 32) + tl.arange(0, BLOCK_M // 32)
    store_scales(s_ptr + pid_b * stride_sb, scale, cols, s_cols, K, scale_cols, BLOCKED)


def cast_dim1(
    x: torch.Tensor, elem: str, mode: str, blocked: bool = False, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] or [E, M, K] (bf16/fp32, any strides) -> (qdata [.., K, M] fp8, scales e8m0).

    Scales are [.., K, M/32], or with ``blocked`` the blocked layout of that matrix (1D, or
    [E, padded] per expert). Bit-identical to ``to_mx(x.transpose(-2, -1).contiguous(), elem, mode, dim=-1)``.
    """
    check_cast(x, elem, mode, ndims=(2, 3), qdim=-2, op="cast_dim1")
    q_shape, s_shape = dim1_shapes(x.shape, blocked)
    qdata = torch.empty(q_shape, dtype=fp8_dtype(elem), device=x.device)
    scale = torch.empty(s_shape, dtype=torch.float8_e8m0fnu, device=x.device)
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    num_batch, m, k = x3.shape
    if qdata.numel() == 0 and scale.numel() == 0:
        return qdata, scale
    cfg = {**DIM1_CONFIG, **(config or {})}
    block_m, block_k = cfg["BLOCK_M"], cfg["BLOCK_K"]
    pad = 128 if blocked else 1  # blocked: the grid covers the padding too, to zero it
    grid = (triton.cdiv(triton.cdiv(m, pad) * pad, block_m), triton.cdiv(triton.cdiv(k, pad) * pad, block_k), num_batch)
    _cast_dim1_kernel[grid](
        x3,
        qdata.view(torch.uint8),
        scale.view(torch.uint8),
        m,
        k,
        x3.stride(0),
        x3.stride(1),
        x3.stride(2),
        m * k,
        scale[0].numel() if x.dim() == 3 else 0,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        BLOCKED=blocked,
        SOFTWARE_ROUND=software_round(x, "cast_dim1"),
        num_warps=cfg["num_warps"],
        **format_constexprs(elem, mode),
    )
    return qdata, scale
