"""MX cast along the last dim ("dim0"): x [M, K] or [E, M, K] -> qdata of x's shape + scales [.., M, K/32].

On Hopper, bf16 input goes to the Gluon kernel of ``gluon_casts`` (same bits; ``common.use_gluon``).

One program quantizes a [BLOCK_M, BLOCK_K] tile: BLOCK_K / 32 blocks per row, each reduced
inside a few threads. With ``blocked=True`` the scales go straight to the blocked layout
(per expert for 3D input); the grid then also covers the padding, whose bytes it writes as
zero, so the output needs no memset.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from mx_kernels.common import (
    check_cast,
    dim0_shapes,
    format_constexprs,
    fp8_dtype,
    interpreting,
    software_round,
    tile_grid,
    use_gluon,
)
from mx_kernels.mx_quantize import bf16_bits_rne, dequantize_blocks, quantize_blocks, store_scales, to_fp32

# Tuned on an H200 (docs/profiles/2026-11-21_h200_cast_tiles.txt): 32 x 512 with 8 warps against the earlier
# 32 x 256 with 4 warps, kernel time, interleaved A/B: floor with blocked scales 205.9 vs 211.6 us at 16384^2,
# 130.2 vs 134.1 us at [4, 8192, 5120]; rceil and plain scales within 1% either way. On an H100 within 1%, never slower.
DIM0_CONFIG = dict(BLOCK_M=32, BLOCK_K=512, num_warps=8)


@triton.jit
def _cast_dim0_kernel(
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
    DEQUANT: tl.constexpr,
    OUT_BF16_BITS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)  # E * M * K can pass 2**31
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x_offs = pid_b * stride_xb + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :] * stride_xk
    x = to_fp32(tl.load(x_ptr + x_offs, mask=mask, other=0.0), SOFTWARE_ROUND)

    blocks = tl.reshape(x, (BLOCK_M * BLOCK_K // 32, 32))
    q, scale = quantize_blocks(blocks, 1, EMAX, MAX_MANT, MAX_NORMAL, MBITS, EMIN, IS_E4M3, RCEIL, SOFTWARE_ROUND)

    q_offs = pid_b * stride_qb + rows.to(tl.int64)[:, None] * K + cols[None, :]
    if DEQUANT:
        # fake quant: store element * 2**e in the output's dtype, no qdata and no scales
        v = tl.reshape(dequantize_blocks(q, scale, 1, MBITS, EMIN, IS_E4M3, SOFTWARE_ROUND), (BLOCK_M, BLOCK_K))
        if OUT_BF16_BITS:
            v = bf16_bits_rne(v)
        tl.store(q_ptr + q_offs, v, mask=mask)
    else:
        tl.store(q_ptr + q_offs, tl.reshape(q, (BLOCK_M, BLOCK_K)), mask=mask)
        scale = tl.reshape(scale, (BLOCK_M, BLOCK_K // 32))
        scale_cols = K >> 5
        s_cols = pid_k * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
        store_scales(s_ptr + pid_b * stride_sb, scale, rows, s_cols, M, scale_cols, BLOCKED)


def cast_dim0(
    x: torch.Tensor, elem: str, mode: str, blocked: bool = False, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] or [E, M, K] (bf16/fp32, any strides) -> (qdata fp8 of x's shape, scales e8m0).

    Scales are [.., M, K/32], or with ``blocked`` the blocked layout: 1D for 2D x,
    [E, padded] for 3D x (blocked per expert). Bit-identical to ``to_mx(x, elem, mode, dim=-1)``.
    """
    check_cast(x, elem, mode, ndims=(2, 3), qdim=-1, op="cast_dim0")
    if use_gluon(x, config):  # Hopper: 192 against this kernel's 205 us at 16384^2, blocked scales (H200)
        from mx_kernels.gluon_casts import gluon_cast_dim0

        return gluon_cast_dim0(x, elem, mode, blocked)
    q_shape, s_shape = dim0_shapes(x.shape, blocked)
    qdata = torch.empty(q_shape, dtype=fp8_dtype(elem), device=x.device)
    scale = torch.empty(s_shape, dtype=torch.float8_e8m0fnu, device=x.device)
    if qdata.numel() or scale.numel():
        _launch(x, qdata.view(torch.uint8), scale.view(torch.uint8), elem, mode, blocked, False, config)
    return qdata, scale


def fake_quant_dim0(x: torch.Tensor, elem: str, mode: str, config: dict | None = None) -> torch.Tensor:
    """x [M, K] or [E, M, K] -> the dequantized MX form along K, in x's dtype:
    ``to_mx(x, elem, mode, dim=-1).dequantize(x.dtype)`` in one pass (read x, write the result)."""
    check_cast(x, elem, mode, ndims=(2, 3), qdim=-1, op="fake_quant_dim0")
    if x.dtype != torch.bfloat16 and not interpreting():
        # On an H200 this kernel gave wrong values for fp32 input (exact in the interpreter and for
        # bf16 on the GPU); until that is understood, refuse rather than return wrong numbers.
        raise NotImplementedError(f"fake_quant_dim0: the GPU kernel takes bf16 input, got {x.dtype}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        bits = software_round(x, "fake_quant_dim0") and x.dtype == torch.bfloat16
        target = out.view(torch.int16) if bits else out
        _launch(x, target, target, elem, mode, False, True, config)
    return out


def _launch(
    x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, elem: str, mode: str, blocked: bool, dequant: bool,
    config: dict | None,
) -> None:  # fmt: skip
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    num_batch, m, k = x3.shape
    cfg = {**DIM0_CONFIG, **(config or {})}
    block_m, block_k = cfg["BLOCK_M"], cfg["BLOCK_K"]
    pad = 128 if blocked else 1  # blocked: the grid covers the padding too, to zero it
    grid = (*tile_grid(m, k, block_m, block_k, pad), num_batch)
    software = software_round(x, "cast_dim0")
    _cast_dim0_kernel[grid](
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
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        BLOCKED=blocked,
        SOFTWARE_ROUND=software,
        DEQUANT=dequant,
        OUT_BF16_BITS=dequant and software and x.dtype == torch.bfloat16,
        num_warps=cfg["num_warps"],
        **format_constexprs(elem, mode),
    )
