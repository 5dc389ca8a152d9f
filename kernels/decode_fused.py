"""The elementwise work of a decode step, fused: one launch where eager PyTorch takes a dozen.

At decode a step's tensors are a few rows, so each eager kernel costs its launch and a few microseconds of
latency, not its bytes: RoPE alone is about ten kernels (fp32 casts, the rotation's products, a stack, the casts
back), the KV-cache write two scatters, RMSNorm several more. Two kernels replace them:

* ``rope_cache_write``: one program per (sequence, KV head) rotates that KV head's key and the R query heads that
  share it (grouped-query attention), writes the key and the value into the cache at the step's position, and
  writes the queries stacked per KV head, [B, Hkv, R, D], the layout decode attention reads. The position is
  read from a device tensor, and the cos / sin rows from the model's whole tables, so a CUDA graph captured
  once replays at every position. The rotation is the model's ``apply_rope``: pairs (x[2i], x[2i+1]) in fp32,
  rounded once to the cache's dtype.
* ``add_rms_norm``: one program per row adds the residual branch's output to the residual stream (rounded to its
  dtype, as the eager add) and writes the stream and its RMSNorm (fp32 sum of squares, x * rsqrt(mean + eps) *
  weight in fp32, rounded once).
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
def _rotate(src, cos, sin, i, dst):
    """Rotate the pairs of one head at ``src`` (pair i: elements 2i, 2i+1) and store them at ``dst``."""
    even = tl.load(src + 2 * i).to(tl.float32)
    odd = tl.load(src + 2 * i + 1).to(tl.float32)
    tl.store(dst + 2 * i, (even * cos - odd * sin).to(dst.dtype.element_ty))
    tl.store(dst + 2 * i + 1, (even * sin + odd * cos).to(dst.dtype.element_ty))


@triton.jit
def _rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    stride_qb, stride_kb, stride_vb, stride_cb, stride_ch, stride_cl, stride_ob, stride_oh, stride_or,
    R: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr)
    i = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * HALF + i)
    sin = tl.load(sin_ptr + pos * HALF + i)
    at = b * stride_cb + h * stride_ch + pos * stride_cl
    _rotate(k_ptr + b * stride_kb + h * 2 * HALF, cos, sin, i, k_cache_ptr + at)
    d = tl.arange(0, 2 * HALF)
    v = tl.load(v_ptr + b * stride_vb + h * 2 * HALF + d)
    tl.store(v_cache_ptr + at + d, v.to(v_cache_ptr.dtype.element_ty))
    for r in tl.static_range(R):
        _rotate(q_ptr + b * stride_qb + (h * R + r) * 2 * HALF, cos, sin, i,
                q_out_ptr + b * stride_ob + h * stride_oh + r * stride_or)  # fmt: skip


@triton.jit
def _add_rms_norm_kernel(
    h_ptr, delta_ptr, w_ptr, h_out_ptr, out_ptr, stride_h, stride_d, stride_ho, stride_o, D, eps,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < D
    h = tl.load(h_ptr + row * stride_h + c, mask=ok, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_d + c, mask=ok, other=0.0)
        h = (h.to(tl.float32) + delta.to(tl.float32)).to(h_out_ptr.dtype.element_ty)
    tl.store(h_out_ptr + row * stride_ho + c, h, mask=ok)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, 0) / D + eps)
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, (hf * rstd * w).to(out_ptr.dtype.element_ty), mask=ok)


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
    silu = (h1 / (1.0 + tl.exp(-h1))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, (silu * h3).to(out_ptr.dtype.element_ty), mask=ok)


_ROPE = LaunchCache(_rope_cache_kernel)
_NORM = LaunchCache(_add_rms_norm_kernel)
_SILU_MUL = LaunchCache(_silu_mul_kernel)


def rope_cache_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     position: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One decode position: q [B, H * D], k and v [B, Hkv * D] (rows may be strided, the last dim contiguous),
    the model's RoPE tables cos, sin [max_len, D / 2] (fp32), ``position`` an int tensor [1]. Writes the rotated k
    and v into k_cache, v_cache [B, Hkv, L, D] at the position; returns the rotated queries [B, Hkv, R, D], the
    heads that share a KV head stacked, in q's dtype."""
    op = "rope_cache_write"
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"{op}: k_cache and v_cache must be [B, Hkv, L, D] alike, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")  # fmt: skip
    b, hkv, _, d = k_cache.shape
    if q.dim() != 2 or k.shape != (b, hkv * d) or v.shape != k.shape or q.shape[0] != b or q.shape[1] % (hkv * d):
        raise ValueError(f"{op}: q [B, H * D], k and v [B, Hkv * D] for a cache {tuple(k_cache.shape)}; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")  # fmt: skip
    if d % 2 or d & (d - 1) or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != d // 2:
        raise ValueError(f"{op}: head dim {d} must be a power of 2 and cos, sin [max_len, {d // 2}]; got "
                         f"{tuple(cos.shape)}")  # fmt: skip
    if position.numel() != 1:
        raise ValueError(f"{op}: position must hold one position, got {tuple(position.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k, v, k_cache)) or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"{op}: the last dims of q, k, v and the caches, and cos and sin, must be contiguous")
    repeats = q.shape[1] // (hkv * d)
    q_out = torch.empty((b, hkv, repeats, d), dtype=q.dtype, device=q.device)
    _ROPE.launch(
        (b, hkv),
        dict(q_ptr=q, k_ptr=k, v_ptr=v, cos_ptr=cos, sin_ptr=sin, pos_ptr=position, q_out_ptr=q_out,
             k_cache_ptr=k_cache, v_cache_ptr=v_cache, stride_qb=q.stride(0), stride_kb=k.stride(0),
             stride_vb=v.stride(0), stride_cb=k_cache.stride(0), stride_ch=k_cache.stride(1),
             stride_cl=k_cache.stride(2), stride_ob=q_out.stride(0), stride_oh=q_out.stride(1),
             stride_or=q_out.stride(2), R=repeats, HALF=d // 2, num_warps=1, **pdl.options(q.device)),
    )  # fmt: skip
    return q_out


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(h + delta, RMSNorm(h + delta) * weight) for rows h, delta [T, D] (delta None: a copy of h and its norm);
    the sum rounded to h's dtype, the norm in fp32 rounded once to h's dtype. Both outputs are new tensors."""
    op = "add_rms_norm"
    if h.dim() != 2 or weight.shape != (h.shape[1],) or (delta is not None and delta.shape != h.shape):
        raise ValueError(f"{op}: h and delta [T, D], weight [D]; got h {tuple(h.shape)}, delta "
                         f"{None if delta is None else tuple(delta.shape)}, weight {tuple(weight.shape)}")  # fmt: skip
    if h.stride(1) != 1 or (delta is not None and delta.stride(1) != 1) or not weight.is_contiguous():
        raise ValueError(f"{op}: rows must be contiguous")
    t, d = h.shape
    h_out, out = torch.empty_like(h), torch.empty_like(h)
    if t == 0:
        return h_out, out
    block = triton.next_power_of_2(d)
    _NORM.launch(
        (t,),
        dict(h_ptr=h, delta_ptr=delta if delta is not None else h, w_ptr=weight, h_out_ptr=h_out, out_ptr=out,
             stride_h=h.stride(0), stride_d=delta.stride(0) if delta is not None else 0, stride_ho=h_out.stride(0),
             stride_o=out.stride(0), D=d, eps=eps, HAS_DELTA=delta is not None, BLOCK=block,
             num_warps=min(16, max(1, block // 256)), **pdl.options(h.device)),
    )  # fmt: skip
    return h_out, out


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
