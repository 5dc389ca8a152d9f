"""Triton MX cast along the first dim ("dim1"), written transposed: x [M, K] -> qdata [K, M] + scales [K, M/32].

The result is ``to_mx(x.t().contiguous(), dim=-1)`` without the transpose copy: a program loads [32, BLOCK_K]
sub-tiles contiguous along K, reduces each column (one block of 32 along M) and stores rows of the [K, M]
output contiguous along M. 3D expert weights [E, N, K] take the same path per expert (grid axis 2): each
expert's [K, N] slice is written directly, so the cost does not grow with E.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from mx_kernels.common import check_cast, dim1_shapes, fp8_dtype, software_round, tile_grid
from mx_kernels.launch_cache import LaunchCache
from mx_kernels.mx_quantize import quantize_blocks, store_scales, to_fp32

# One warp per program: Triton spreads warps along M, and a 32-row block split across warps needs a
# shared-memory reduction with barriers (40% of copy bandwidth on an H200); in one warp a block reduces in
# registers and shuffles. NUM_SUB 32-row sub-tiles per program store NUM_SUB contiguous scale bytes per row
# of [K, M/32] instead of one (scattered one-byte stores cost ~30%); 2 beat 4 and 8 (registers, occupancy).
BLOCK_K, NUM_SUB, NUM_WARPS = 64, 2, 1


@triton.jit
def _cast_dim1_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xb, stride_xm, stride_xk, stride_qb, stride_sb,
    BLOCK_K: tl.constexpr, NUM_SUB: tl.constexpr, BLOCKED: tl.constexpr, ELEM: tl.constexpr, RCEIL: tl.constexpr,
    SOFTWARE_ROUND: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)  # E * M * K can pass 2**31
    x_ptr += pid_b * stride_xb
    q_ptr += pid_b * stride_qb
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    sub = tl.arange(0, NUM_SUB)
    scales = tl.zeros((BLOCK_K, NUM_SUB), dtype=tl.uint8)
    for i in tl.static_range(NUM_SUB):
        # a [32, BLOCK_K] sub-tile: one MX block per column
        rows = (pid_m * NUM_SUB + i) * 32 + tl.arange(0, 32)
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        x_offs = rows.to(tl.int64)[:, None] * stride_xm + cols[None, :] * stride_xk
        x = to_fp32(tl.load(x_ptr + x_offs, mask=mask, other=0.0), SOFTWARE_ROUND)
        q, scale = quantize_blocks(x, 0, ELEM, RCEIL, SOFTWARE_ROUND)
        # transposed store: out[k, m], 32 contiguous elements per k
        tl.store(q_ptr + cols.to(tl.int64)[None, :] * M + rows[:, None], q, mask=mask)
        scales = tl.where(sub[None, :] == i, scale[:, None], scales)
    store_scales(s_ptr + pid_b * stride_sb, scales, cols, pid_m * NUM_SUB + sub, K, M >> 5, BLOCKED)


_LAUNCHES = LaunchCache(_cast_dim1_kernel)


def cast_dim1(x: torch.Tensor, elem: str, mode: str, blocked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] or [E, M, K] (bf16/fp32, any strides) -> (qdata [.., K, M] fp8, scales e8m0).

    Scales are [.., K, M/32], or with ``blocked`` the blocked layout of that matrix (1D, or [E, padded] per
    expert). Bit-identical to ``to_mx(x.transpose(-2, -1).contiguous(), elem, mode, dim=-1)``.
    """
    check_cast(x, elem, mode, ndims=(2, 3), qdim=-2, op="cast_dim1")
    q_shape, s_shape = dim1_shapes(x.shape, blocked)
    qdata = torch.empty(q_shape, dtype=fp8_dtype(elem), device=x.device)
    scale = torch.empty(s_shape, dtype=torch.float8_e8m0fnu, device=x.device)
    if not (qdata.numel() or scale.numel()):
        return qdata, scale
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    num_batch, m, k = x3.shape
    grid = (*tile_grid(m, k, 32 * NUM_SUB, BLOCK_K, 128 if blocked else 1), num_batch)
    _LAUNCHES.launch(
        grid,
        dict(
            x_ptr=x3, q_ptr=qdata.view(torch.uint8), s_ptr=scale.view(torch.uint8), M=m, K=k,
            stride_xb=x3.stride(0), stride_xm=x3.stride(1), stride_xk=x3.stride(2), stride_qb=m * k,
            stride_sb=scale[0].numel() if x.dim() == 3 else 0, BLOCK_K=BLOCK_K, NUM_SUB=NUM_SUB, BLOCKED=blocked,
            ELEM=elem, RCEIL=mode == "rceil", SOFTWARE_ROUND=software_round(x, "cast_dim1"), num_warps=NUM_WARPS,
        ),
    )  # fmt: skip
    return qdata, scale
