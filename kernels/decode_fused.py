"""The elementwise work of a decode step, fused: one launch where eager PyTorch takes a dozen.

At decode a step's tensors are a few rows, so each eager kernel costs its launch and a few microseconds of
latency, not its bytes: RMSNorm alone is several kernels, SwiGLU's product three. Two kernels replace them (RoPE
and the KV-cache write are in the decode-attention kernel, mx_kernels.decode_attention):

* ``add_rms_norm``: one program per row adds the residual branch's output to the residual stream (rounded to its
  dtype, as the eager add) and writes the stream and its RMSNorm (fp32 sum of squares, x * rsqrt(mean + eps) *
  weight in fp32, rounded once). The branch's output may come as the fp32 sums of a GEMM's splits of K
  (mx_kernels.gluon.weight_only_tiled, ``partials``): the norm adds them in split order, times a scale per column
  where given, and rounds, as the GEMM's own epilogue would. The GEMM then ends when its programs do: summing there
  takes the last split of each tile to arrive an acquire-release counter and a read of every split's partial after
  its own loop, on the step's path. Here the kernel boundary before the norm orders the partials, and each row's
  program reads its own, every split's loads issued before the first add (unmasked: with masked loads the compiler
  interleaved each load with its add, a few in flight at a time). Under PDL the norm's weight is loaded before the
  wait for the kernel before (no kernel of a step writes it), so that only the rows' loads follow the wait: Llama 3
  8B dims, batch 1, one H200, ms a step: MXFP8 2.427 -> 2.395, MXFP4 1.798 -> 1.784, bf16 3.879 -> 3.870.
* ``silu_mul``: SwiGLU's ``F.silu(h1) * h3`` for the gate and up projections' outputs (views of one fused GEMM's
  output, or two tensors), with the eager expression's two roundings: silu in fp32 rounded to the dtype, then
  the product in fp32 rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from mx_kernels import pdl
from mx_kernels.launch_cache import LaunchCache


@triton.jit
def _add_rms_norm_kernel(
    h_ptr, delta_ptr, scale_ptr, w_ptr, h_out_ptr, out_ptr, stride_h, stride_d, stride_ds, stride_sc, stride_ho,
    stride_o, D, eps, HAS_DELTA: tl.constexpr, SPLITS: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """SPLITS > 0: delta is that many fp32 partial sums (``stride_ds`` apart), added in order from 0 (then times the
    column's scale, HAS_SCALE) and rounded to h's dtype; every split loaded before the first add (module doc)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < D
    # the norm's weight before the wait: no kernel of a step writes it (module doc)
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    h = tl.load(h_ptr + row * stride_h + c, mask=ok, other=0.0)
    if HAS_DELTA:
        if SPLITS > 0:
            delta = split_sum(delta_ptr + row * stride_d + c, ok, stride_ds, SPLITS, BLOCK != D)
            if HAS_SCALE:
                delta = delta * tl.load(scale_ptr + c * stride_sc, mask=ok, other=0.0)
            delta = delta.to(h_out_ptr.dtype.element_ty)
        else:
            delta = tl.load(delta_ptr + row * stride_d + c, mask=ok, other=0.0)
        h = (h.to(tl.float32) + delta.to(tl.float32)).to(h_out_ptr.dtype.element_ty)
    store_norm(h, w, h_out_ptr + row * stride_ho + c, out_ptr + row * stride_o + c, ok, D, eps)


@triton.jit
def store_norm(h, w, h_out_ptrs, out_ptrs, mask, D, eps):
    """Store a row of the residual stream h and its RMSNorm times the norm's weight w (fp32): the sum of squares in
    fp32, h * rsqrt(mean + eps) * w in fp32, rounded once to the output's dtype."""
    tl.store(h_out_ptrs, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, 0) / D + eps)
    tl.store(out_ptrs, (hf * rstd * w).to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def split_sum(ptrs, mask, stride_s, SPLITS: tl.constexpr, MASKED: tl.constexpr):
    """The sum of SPLITS fp32 split-K partials at ``ptrs`` (``stride_s`` apart), added in split order from +0 as a
    split-K GEMM's own sum adds them (mx_kernels.gluon.common.split_k_sum), every split loaded before the first add;
    ``MASKED`` False: unmasked loads, which the compiler issues together (module doc)."""
    parts = ()
    for i in tl.static_range(SPLITS):
        if MASKED:
            part = tl.load(ptrs + i * stride_s, mask=mask, other=0.0)
        else:
            part = tl.load(ptrs + i * stride_s)
        parts = parts + (part,)
    total = tl.zeros_like(parts[0])
    for i in tl.static_range(SPLITS):
        total += parts[i]
    return total


@triton.jit
def _silu_mul_kernel(h1_ptr, h3_ptr, out_ptr, H, stride_1, stride_3, stride_o, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):  # fmt: skip
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < H
    h1 = tl.load(h1_ptr + row * stride_1 + c, mask=ok, other=0.0).to(tl.float32)
    h3 = tl.load(h3_ptr + row * stride_3 + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, swiglu(h1, h3, out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def swiglu(h1, h3, dtype: tl.constexpr):
    """``F.silu(h1) * h3`` in ``dtype`` from fp32 values of that dtype, with the eager expression's roundings:
    silu in fp32 rounded to ``dtype``, then the product in fp32 rounded again (also the weight-only GEMM's SwiGLU
    epilogue, mx_kernels.mx.weight_only)."""
    silu = (h1 / (1.0 + tl.exp(-h1))).to(dtype).to(tl.float32)
    return (silu * h3).to(dtype)


_NORM = LaunchCache(_add_rms_norm_kernel)
_SILU_MUL = LaunchCache(_silu_mul_kernel)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 delta_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(h + delta, RMSNorm(h + delta) * weight) for rows h, delta [T, D] (delta None: a copy of h and its norm);
    the sum rounded to h's dtype, the norm in fp32 rounded once to h's dtype. Both outputs are new tensors. Under
    PDL ``weight`` is read before the wait for the kernel before: that kernel must not write it.
    delta may be a GEMM's split-K partials, fp32 [splits, T, D] (module doc): their sum in split order, times
    ``delta_scale`` (fp32, one or one per column) if given, rounded to h's dtype, is the branch's output."""
    op = "add_rms_norm"
    splits = delta.shape[0] if delta is not None and delta.dim() == 3 else 0
    if (
        h.dim() != 2
        or weight.shape != (h.shape[1],)
        or (delta is not None and delta.shape[splits > 0 :] != h.shape)
        or (splits and (delta.dtype != torch.float32 or delta.stride(0) != delta[0].numel()))
    ):
        raise ValueError(f"{op}: h [T, D], delta [T, D] or fp32 split-K partials [S, T, D], weight [D]; got h "
                         f"{tuple(h.shape)}, delta {None if delta is None else f'{delta.dtype} {tuple(delta.shape)}'},"
                         f" weight {tuple(weight.shape)}")  # fmt: skip
    if delta_scale is not None and (
        not splits or delta_scale.dtype != torch.float32 or delta_scale.numel() not in (1, h.shape[1])
    ):
        raise ValueError(f"{op}: delta_scale is fp32, one or one per column, for split-K partials; got "
                         f"{delta_scale.dtype} {tuple(delta_scale.shape)} with delta "
                         f"{None if delta is None else tuple(delta.shape)}")  # fmt: skip
    if h.stride(1) != 1 or (delta is not None and delta.stride(-1) != 1) or not weight.is_contiguous():
        raise ValueError(f"{op}: rows must be contiguous")
    t, d = h.shape
    h_out, out = torch.empty_like(h), torch.empty_like(h)
    if t == 0:
        return h_out, out
    block, warps = norm_block(d)
    _NORM.launch(
        (t,),
        dict(h_ptr=h, delta_ptr=delta if delta is not None else h,
             scale_ptr=delta_scale if delta_scale is not None else weight, w_ptr=weight, h_out_ptr=h_out, out_ptr=out,
             stride_h=h.stride(0), stride_d=delta.stride(-2) if delta is not None else 0,
             stride_ds=delta.stride(0) if splits else 0,
             stride_sc=int(delta_scale is not None and delta_scale.numel() > 1), stride_ho=h_out.stride(0),
             stride_o=out.stride(0), D=d, eps=eps, HAS_DELTA=delta is not None, SPLITS=splits,
             HAS_SCALE=delta_scale is not None, BLOCK=block, num_warps=warps,
             **pdl.options(h.device)),
    )  # fmt: skip
    return h_out, out


def norm_block(width: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of a norm's one program a row: the whole row, 8 columns a thread (up to 16 warps)."""
    block = triton.next_power_of_2(width)
    return block, min(16, max(1, block // 256))


def row_block(width: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of a row-wise elementwise kernel over ``width`` columns: up to 2048 columns a program,
    8 a thread, so that a decode step's few rows still make several programs."""
    block = min(triton.next_power_of_2(width), 2048)
    return block, max(1, min(8, block // 256))


def silu_mul(h1: torch.Tensor, h3: torch.Tensor) -> torch.Tensor:
    """``F.silu(h1) * h3`` for rows h1, h3 [T, H] (rows may be strided, the last dim contiguous), in h1's dtype."""
    if h1.dim() != 2 or h1.shape != h3.shape or h1.dtype != h3.dtype:
        raise ValueError(f"silu_mul: h1 and h3 must be [T, H] alike, got {h1.dtype} {tuple(h1.shape)} and "
                         f"{h3.dtype} {tuple(h3.shape)}")  # fmt: skip
    if h1.stride(1) != 1 or h3.stride(1) != 1:
        raise ValueError("silu_mul: rows must be contiguous")
    t, h = h1.shape
    out = torch.empty((t, h), dtype=h1.dtype, device=h1.device)
    if t == 0 or h == 0:
        return out
    block, warps = row_block(h)
    _SILU_MUL.launch(
        (t, triton.cdiv(h, block)),
        dict(h1_ptr=h1, h3_ptr=h3, out_ptr=out, H=h, stride_1=h1.stride(0), stride_3=h3.stride(0),
             stride_o=out.stride(0), BLOCK=block, num_warps=warps, **pdl.options(h1.device)),
    )  # fmt: skip
    return out
