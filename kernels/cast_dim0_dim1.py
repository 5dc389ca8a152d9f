"""Triton fused MX cast along both dims: one read of x [M, K], both the dim0 and the dim1 outputs.

Every operand of the MX linear is needed in both orientations (docs/DESIGN.md, The MX linear); reading the
bf16 tensor once instead of twice saves a third of the bytes of two separate casts. A program quantizes its
tile along rows (dim0, stored row-major) and along columns (dim1, stored transposed) from the same registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from mx_kernels.common import check_cast, dim0_shapes, dim1_shapes, fp8_dtype, software_round, tile_grid
from mx_kernels.launch_cache import LaunchCache
from mx_kernels.mx_quantize import quantize_blocks, store_scales, to_fp32

BLOCK_K, NUM_SUB, NUM_WARPS = 64, 2, 1  # one warp per program and 32-row sub-tiles, as in cast_dim1.py


@triton.jit
def _cast_dim0_dim1_kernel(
    x_ptr,
    q0_ptr,
    s0_ptr,
    q1_ptr,
    s1_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    BLOCK_K: tl.constexpr,
    NUM_SUB: tl.constexpr,
    BLOCKED: tl.constexpr,
    ELEM: tl.constexpr,
    RCEIL: tl.constexpr,
    SOFTWARE_ROUND: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    s0_cols = pid_k * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    sub = tl.arange(0, NUM_SUB)
    s1_tile = tl.zeros((BLOCK_K, NUM_SUB), dtype=tl.uint8)
    for i in tl.static_range(NUM_SUB):
        rows = (pid_m * NUM_SUB + i) * 32 + tl.arange(0, 32)
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        x_offs = rows.to(tl.int64)[:, None] * stride_xm + cols[None, :] * stride_xk
        x = to_fp32(tl.load(x_ptr + x_offs, mask=mask, other=0.0), SOFTWARE_ROUND)

        # dim0: blocks of 32 along K, row-major [M, K] output, scales [M, K/32]
        q0, s0 = quantize_blocks(tl.reshape(x, (BLOCK_K, 32)), 1, ELEM, RCEIL, SOFTWARE_ROUND)
        tl.store(q0_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], tl.reshape(q0, (32, BLOCK_K)), mask=mask)
        store_scales(s0_ptr, tl.reshape(s0, (32, BLOCK_K // 32)), rows, s0_cols, M, K >> 5, BLOCKED)

        # dim1: one block of 32 along M per column, transposed [K, M] output, scales [K, M/32]
        q1, s1 = quantize_blocks(x, 0, ELEM, RCEIL, SOFTWARE_ROUND)
        tl.store(q1_ptr + cols.to(tl.int64)[None, :] * M + rows[:, None], q1, mask=mask)
        s1_tile = tl.where(sub[None, :] == i, s1[:, None], s1_tile)
    store_scales(s1_ptr, s1_tile, cols, pid_m * NUM_SUB + sub, K, M >> 5, BLOCKED)


_LAUNCHES = LaunchCache(_cast_dim0_dim1_kernel)


def cast_dim0_dim1(
    x: torch.Tensor, elem: str, mode: str, blocked: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp32, any strides) -> (q0 [M, K], s0, q1 [K, M], s1), as ``cast_dim0`` and ``cast_dim1``."""
    check_cast(x, elem, mode, ndims=(2,), qdim=0, op="cast_dim0_dim1")
    check_cast(x, elem, mode, ndims=(2,), qdim=1, op="cast_dim0_dim1")
    q0_shape, s0_shape = dim0_shapes(x.shape, blocked)
    q1_shape, s1_shape = dim1_shapes(x.shape, blocked)
    q0 = torch.empty(q0_shape, dtype=fp8_dtype(elem), device=x.device)
    s0 = torch.empty(s0_shape, dtype=torch.float8_e8m0fnu, device=x.device)
    q1 = torch.empty(q1_shape, dtype=fp8_dtype(elem), device=x.device)
    s1 = torch.empty(s1_shape, dtype=torch.float8_e8m0fnu, device=x.device)
    m, k = x.shape
    if m == 0 or k == 0:
        return q0, s0, q1, s1
    grid = tile_grid(m, k, 32 * NUM_SUB, BLOCK_K, 128 if blocked else 1)
    _LAUNCHES.launch(
        grid,
        dict(
            x_ptr=x, q0_ptr=q0.view(torch.uint8), s0_ptr=s0.view(torch.uint8), q1_ptr=q1.view(torch.uint8),
            s1_ptr=s1.view(torch.uint8), M=m, K=k, stride_xm=x.stride(0), stride_xk=x.stride(1), BLOCK_K=BLOCK_K,
            NUM_SUB=NUM_SUB, BLOCKED=blocked, ELEM=elem, RCEIL=mode == "rceil",
            SOFTWARE_ROUND=software_round(x, "cast_dim0_dim1"), num_warps=NUM_WARPS,
        ),
    )  # fmt: skip
    return q0, s0, q1, s1
