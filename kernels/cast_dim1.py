"""MX cast along the first dim ("dim1"), written transposed: x [M, K] -> qdata [K, M] + scales [K, M/32].

The result is ``to_mx(x.t().contiguous(), dim=-1)`` without the transpose copy: a program
loads [32, BLOCK_K] sub-tiles contiguous along K, reduces each column (one block of 32
along M) and stores rows of the [K, M] output contiguous along M (the transpose happens in
registers / shared memory on the way to the store).
3D expert weights [E, N, K] take the same path per expert (grid axis 2): each expert's
[K, N] slice is written directly, so the cost does not grow with E (seed 003).
On Hopper, bf16 input goes to the Gluon kernel of ``gluon_casts``, for 2D and 3D (same bits;
``common.use_gluon``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from mx_kernels.common import (
    check_cast,
    dim1_shapes,
    format_constexprs,
    fp8_dtype,
    interpreting,
    software_round,
    tile_grid,
    use_gluon,
)
from mx_kernels.mx_quantize import bf16_bits_rne, dequantize_blocks, quantize_blocks, store_scales, to_fp32

# One warp per program: Triton spreads warps along M, and a 32-row block split across warps
# needs a shared-memory reduction with barriers (40% of copy BW on an H200). With one warp
# a block reduces in registers and shuffles. NUM_SUB 32-row sub-tiles per program, so each
# program stores NUM_SUB contiguous scale bytes per row of [K, M/32] instead of one byte
# (one-byte scattered stores cost ~30%: docs/notes_cast_kernels.md). More sub-tiles cost
# registers and occupancy: 2 beat 4 and 8 on an H200.
DIM1_CONFIG = dict(BLOCK_K=64, NUM_SUB=2, num_warps=1)  # best of the H200 sweep in the notes


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
    BLOCK_K: tl.constexpr,
    NUM_SUB: tl.constexpr,
    BLOCKED: tl.constexpr,
    EMAX: tl.constexpr,
    MAX_MANT: tl.constexpr,
    MAX_NORMAL: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    IS_E4M3: tl.constexpr,
    RCEIL: tl.constexpr,
    SOFTWARE_ROUND: tl.constexpr,
    DEQUANT: tl.constexpr,
    OUT_BF16_BITS: tl.constexpr,
):
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
        q, scale = quantize_blocks(x, 0, EMAX, MAX_MANT, MAX_NORMAL, MBITS, EMIN, IS_E4M3, RCEIL, SOFTWARE_ROUND)
        # transposed store: out[k, m], 32 contiguous elements per k
        out_offs = cols.to(tl.int64)[None, :] * M + rows[:, None]
        if DEQUANT:
            # fake quant: element * 2**e in the output's dtype, no qdata and no scales
            v = dequantize_blocks(q, scale, 0, MBITS, EMIN, IS_E4M3, SOFTWARE_ROUND)
            if OUT_BF16_BITS:
                v = bf16_bits_rne(v)
            tl.store(q_ptr + out_offs, v, mask=mask)
        else:
            tl.store(q_ptr + out_offs, q, mask=mask)
            scales = tl.where(sub[None, :] == i, scale[:, None], scales)
    if not DEQUANT:
        s_cols = pid_m * NUM_SUB + sub
        store_scales(s_ptr + pid_b * stride_sb, scales, cols, s_cols, K, M >> 5, BLOCKED)


def cast_dim1(
    x: torch.Tensor, elem: str, mode: str, blocked: bool = False, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] or [E, M, K] (bf16/fp32, any strides) -> (qdata [.., K, M] fp8, scales e8m0).

    Scales are [.., K, M/32], or with ``blocked`` the blocked layout of that matrix (1D, or
    [E, padded] per expert). Bit-identical to ``to_mx(x.transpose(-2, -1).contiguous(), elem, mode, dim=-1)``.
    """
    check_cast(x, elem, mode, ndims=(2, 3), qdim=-2, op="cast_dim1")
    if use_gluon(x, config):  # Hopper, H200: 2D 94-97% of copy, Triton 89%; 3D [E, 8192, 5120] 88-99.5%, Triton 70-90%
        from mx_kernels.gluon_casts import gluon_cast_dim1

        return gluon_cast_dim1(x, elem, mode, blocked)
    q_shape, s_shape = dim1_shapes(x.shape, blocked)
    qdata = torch.empty(q_shape, dtype=fp8_dtype(elem), device=x.device)
    scale = torch.empty(s_shape, dtype=torch.float8_e8m0fnu, device=x.device)
    if qdata.numel() or scale.numel():
        _launch(x, qdata.view(torch.uint8), scale.view(torch.uint8), elem, mode, blocked, False, config)
    return qdata, scale


def fake_quant_dim1(x: torch.Tensor, elem: str, mode: str, config: dict | None = None) -> torch.Tensor:
    """x [M, K] or [E, M, K] -> the dequantized MX form along M, written transposed ([.., K, M]),
    in x's dtype: ``to_mx(x.transpose(-2, -1).contiguous(), elem, mode).dequantize(x.dtype)`` in one pass."""
    check_cast(x, elem, mode, ndims=(2, 3), qdim=-2, op="fake_quant_dim1")
    if x.dtype != torch.bfloat16 and not interpreting():
        # On an H200 this kernel gave wrong values for fp32 input (exact in the interpreter and for
        # bf16 on the GPU); until that is understood, refuse rather than return wrong numbers.
        raise NotImplementedError(f"fake_quant_dim1: the GPU kernel takes bf16 input, got {x.dtype}")
    out = torch.empty((*x.shape[:-2], x.shape[-1], x.shape[-2]), dtype=x.dtype, device=x.device)
    if out.numel():
        bits = software_round(x, "fake_quant_dim1") and x.dtype == torch.bfloat16
        target = out.view(torch.int16) if bits else out
        _launch(x, target, target, elem, mode, False, True, config)
    return out


def _launch(
    x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, elem: str, mode: str, blocked: bool, dequant: bool,
    config: dict | None,
) -> None:  # fmt: skip
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    num_batch, m, k = x3.shape
    cfg = {**DIM1_CONFIG, **(config or {})}
    block_m, block_k = 32 * cfg["NUM_SUB"], cfg["BLOCK_K"]
    pad = 128 if blocked else 1  # blocked: the grid covers the padding too, to zero it
    grid = (*tile_grid(m, k, block_m, block_k, pad), num_batch)
    software = software_round(x, "cast_dim1")
    _cast_dim1_kernel[grid](
        x3,
        q,
        s,
        m,
        k,
        x3.stride(0),
        x3.stride(1),
        x3.stride(2),
        m * k,
        s[0].numel() if (x.dim() == 3 and not dequant) else 0,
        BLOCK_K=block_k,
        NUM_SUB=cfg["NUM_SUB"],
        BLOCKED=blocked,
        SOFTWARE_ROUND=software,
        DEQUANT=dequant,
        OUT_BF16_BITS=dequant and software and x.dtype == torch.bfloat16,
        num_warps=cfg["num_warps"],
        **format_constexprs(elem, mode),
    )
