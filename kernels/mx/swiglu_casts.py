"""The MoE experts' SwiGLU fused with the fake-quants of its result: one kernel where there were two.

An MX expert computes h = silu(y1) * y3 (y1 = x @ w1.T, y3 = x @ w3.T, token groups of M rows) and the w2
GEMM quantizes h along K (its forward operand) and along M inside the token groups (its grad-weight
operand); backward computes g1 and g3, the gradients of y1 and y3, from h's gradient g, and the w1/w3 GEMMs
quantize each of them along N and along M. Unfused, h and g1, g3 are written in bf16 and read back by the
casts (``fake_quant_2d.fake_quant_groups``). Here one program loads a tile of y1, y3 (and g), computes the
SwiGLU or its gradient in registers and quantizes the result both ways, as ``fake_quant_groups`` does: the
bf16 h, g1 and g3 are never written. Bytes, for [M, N] tensors: forward 4 MN-sized transfers instead of 6,
backward 7 instead of 11.

The arithmetic is PyTorch's eager CUDA kernels', operation by operation, so that the results are bit for bit
those of ``F.silu(y1) * y3`` (and its autograd backward) followed by the casts:

* silu(y) = y / (1 + exp(-y)) in fp32 (IEEE division, libdevice's expf: ATen's ``silu_kernel``), rounded to
  bf16 (silu's output, which the product and the backward read), h = bf16(silu * y3);
* backward of the product: g3 = bf16(g * silu), gs = bf16(g * y3); of silu (ATen's ``silu_backward_kernel``,
  whose ``1 + y * (1 - s)`` nvcc contracts to one FMA): s = 1 / (1 + exp(-y)), g1 = bf16(gs * s * fma(y, 1 - s,
  1)).

bf16 rounding is done on the fp32 bits (ties to even, NaN kept), which the interpreter computes exactly too;
there (TRITON_INTERPRET=1) exp is numpy's, so the interpreter checks the indexing, not the last bit of exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from mx_kernels.common import check_cast, groups_along_m_rows, software_round
from mx_kernels.launch_cache import LaunchCache
from mx_kernels.quantize import column_blocks, fake_quant_blocks, tile_rows, to_fp32
from mx_kernels.spec import cdiv
from triton.language.extra import libdevice

# (BLOCK_M, BLOCK_K, num_warps) of the forward and the backward kernels
TILES = {False: (32, 64, 4), True: (32, 64, 4)}


@triton.jit
def _round_bf16(v):
    """fp32 -> the fp32 value of its nearest bf16 (ties to even; NaN kept), as a bf16 store would round it."""
    bits = v.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(v != v, v, rounded)


@triton.jit
def _one_plus_exp_neg(y, SOFTWARE_ROUND: tl.constexpr):
    if SOFTWARE_ROUND:  # the interpreter has no libdevice
        return 1.0 + tl.exp(-y)
    return 1.0 + libdevice.exp(-y)  # expf, as ATen's kernels call it (tl.exp would be ex2.approx)


@triton.jit
def _quantize_both(
    v, out_k, out_m, x_rows, has_data, cols, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ELEM: tl.constexpr,
    RCEIL: tl.constexpr, SOFTWARE_ROUND: tl.constexpr,
):  # fmt: skip
    """Fake-quant the fp32 tile v of gathered rows along K and along M (blocks of 32 laid-out rows), each result
    row stored to its own row of the [M, K] outputs, as fake_quant_2d's kernel does with GATHER."""
    mask = has_data[:, None] & (cols < K)[None, :]
    offs = x_rows[:, None] * K + cols[None, :]
    along_k = tl.reshape(v, (BLOCK_M * BLOCK_K // 32, 32))
    along_k = fake_quant_blocks(along_k, 1, ELEM, RCEIL, SOFTWARE_ROUND, SOFTWARE_ROUND, 0.0, False)
    tl.store(out_k + offs, tl.reshape(along_k, (BLOCK_M, BLOCK_K)), mask=mask)
    along_m = fake_quant_blocks(column_blocks(v, 32), 1, ELEM, RCEIL, SOFTWARE_ROUND, SOFTWARE_ROUND, 0.0, False)
    tl.store(out_m + offs, tl.reshape(along_m, (BLOCK_M, BLOCK_K)), mask=mask)


@triton.jit
def _swiglu_casts_kernel(
    y1_ptr, y3_ptr, g_ptr, src_ptr, h_k, h_m, g1_k, g1_m, R, K,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BACKWARD: tl.constexpr, ELEM: tl.constexpr, RCEIL: tl.constexpr,
    SOFTWARE_ROUND: tl.constexpr,
):  # fmt: skip
    """Forward: (h_k, h_m) = the casts of h. BACKWARD: (h_k, h_m) = g3's casts, (g1_k, g1_m) = g1's."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    x_rows, has_data = tile_rows(rows, src_ptr, R, True)
    mask = has_data[:, None] & (cols < K)[None, :]
    offs = x_rows[:, None] * K + cols[None, :]
    y1 = to_fp32(tl.load(y1_ptr + offs, mask=mask, other=0.0), SOFTWARE_ROUND)
    y3 = to_fp32(tl.load(y3_ptr + offs, mask=mask, other=0.0), SOFTWARE_ROUND)
    denominator = _one_plus_exp_neg(y1, SOFTWARE_ROUND)
    silu = _round_bf16(tl.math.div_rn(y1, denominator))
    if BACKWARD:
        g = to_fp32(tl.load(g_ptr + offs, mask=mask, other=0.0), SOFTWARE_ROUND)
        g3 = _round_bf16(g * silu)
        sigmoid = tl.math.div_rn(1.0, denominator)
        g1 = _round_bf16(_round_bf16(g * y3) * sigmoid * tl.fma(y1, 1.0 - sigmoid, 1.0))
        _quantize_both(g3, h_k, h_m, x_rows, has_data, cols, K, BLOCK_M, BLOCK_K, ELEM, RCEIL, SOFTWARE_ROUND)
        _quantize_both(g1, g1_k, g1_m, x_rows, has_data, cols, K, BLOCK_M, BLOCK_K, ELEM, RCEIL, SOFTWARE_ROUND)
    else:
        h = _round_bf16(silu * y3)
        _quantize_both(h, h_k, h_m, x_rows, has_data, cols, K, BLOCK_M, BLOCK_K, ELEM, RCEIL, SOFTWARE_ROUND)


_LAUNCHES = LaunchCache(_swiglu_casts_kernel)


def _check(tensors: tuple[torch.Tensor, ...], row_src: torch.Tensor, elem: str, mode: str, op: str) -> int:
    """The laid-out rows; raises on operands that differ in shape or dtype, or that are not contiguous bf16."""
    first = tensors[0]
    check_cast(first, elem, mode, ndims=(2,), qdim=-1, op=op, fp4=True)
    for t in tensors:
        if t.shape != first.shape or t.dtype != torch.bfloat16 or not t.is_contiguous():
            got = ", ".join(f"{tuple(u.shape)} {u.dtype}" for u in tensors)
            raise ValueError(f"{op}: expects contiguous bf16 operands of one shape, got {got}")
    return groups_along_m_rows(row_src)


def _launch(y1, y3, g, row_src, outs, elem: str, mode: str, rows: int) -> None:
    software = software_round(y1, "swiglu_casts")
    bits = software  # the interpreter: bf16 results stored as their bits (its bf16 store is not trusted)
    outs = [o.view(torch.int16) if bits else o for o in outs]
    if len(outs) == 2:
        outs += [outs[0], outs[1]]
    backward = g is not None
    block_m, block_k, num_warps = TILES[backward]
    k = y1.shape[1]
    key = (y1.shape, backward, elem, mode, rows, software)
    grid = (cdiv(rows, block_m), cdiv(k, block_k))
    _LAUNCHES.launch_keyed(
        key,
        lambda: (grid, dict(
            y1_ptr=y1, y3_ptr=y3, g_ptr=g if backward else y1, src_ptr=row_src, h_k=outs[0], h_m=outs[1],
            g1_k=outs[2], g1_m=outs[3], R=rows, K=k, BLOCK_M=block_m, BLOCK_K=block_k, BACKWARD=backward, ELEM=elem,
            RCEIL=mode == "rceil", SOFTWARE_ROUND=software, num_warps=num_warps,
        )),
        y1_ptr=y1, y3_ptr=y3, g_ptr=g if backward else y1, src_ptr=row_src, h_k=outs[0], h_m=outs[1], g1_k=outs[2],
        g1_m=outs[3],
    )  # fmt: skip


def swiglu_fake_quant_groups(
    y1: torch.Tensor, y3: torch.Tensor, row_src: torch.Tensor, elem: str, mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """y1, y3 [M, N] bf16 (contiguous), row_src int32 [R] (``fake_quant_groups``'s) -> the two fake-quants of
    h = silu(y1) * y3: along N, and along M inside the token groups, each [M, N] bf16 in h's layout."""
    rows = _check((y1, y3), row_src, elem, mode, "swiglu_fake_quant_groups")
    outs = [torch.empty_like(y1) for _ in range(2)]
    if y1.numel():
        _launch(y1, y3, None, row_src, outs, elem, mode, rows)
    return outs[0], outs[1]


def swiglu_grad_fake_quant_groups(
    g: torch.Tensor, y1: torch.Tensor, y3: torch.Tensor, row_src: torch.Tensor, elem: str, mode: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """g (h's gradient), y1, y3 [M, N] bf16 -> the fake-quants along N and along M in token groups of g1 and g3,
    the gradients of y1 and y3: (g1 along N, g1 along M, g3 along N, g3 along M)."""
    rows = _check((g, y1, y3), row_src, elem, mode, "swiglu_grad_fake_quant_groups")
    outs = [torch.empty_like(y1) for _ in range(4)]
    if y1.numel():
        # the kernel's outputs are (g3's, g1's): h's places hold g3, the product's other side
        _launch(y1, y3, g, row_src, [outs[2], outs[3], outs[0], outs[1]], elem, mode, rows)
    return outs[0], outs[1], outs[2], outs[3]
