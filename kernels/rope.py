"""RoPE in the kernels: ``rotate`` (the pairs of a tile of heads, as the model's ``apply_rope``), which the decode
attention kernel applies at a step's position, and ``rope_cache_write``, a prompt's prefill: q and k rotated at
positions 0 .. S - 1 and k and v written into the KV cache there, in one launch.

Why a kernel for the prefill: the model's ``apply_rope`` is eager PyTorch, about nine kernels a tensor (the fp32
copy, four products, a sum and a difference, the stack, the rounding back), and the cache write two more with their
transposes. On a prompt those kernels move every q and k element a dozen times: on one H200, a 2048-token prefill of
8 Llama 3 8B blocks spent about 2 of its 18 ms of kernel time there.

Numerics: ``apply_rope``'s exactly. Each pair (x[2i], x[2i+1]) becomes (x[2i] cos - x[2i+1] sin, x[2i] sin +
x[2i+1] cos) in fp32, each product and the sum or difference rounded as eager rounds them (the launch turns off
the compiler's fusion of a multiply and an add into one FMA), then rounded once to x's dtype. The caches get k so
rotated and v, converted to their dtype, as the model's ``k.to(k_cache.dtype)``.

A program takes one token's heads: q [H, D] and k, v [Hkv, D] (heads padded to powers of 2, masked). q, k and v
may be strided views (the fused QKV GEMM's output split by columns), their last dim contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from mx_kernels.launch_cache import LaunchCache

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def rotate(x, cos, sin, dtype):
    """Heads x [R, D] with pairs (x[2i], x[2i+1]) rotated by (cos_i, sin_i) [1, D / 2] as the model's
    ``apply_rope``: in fp32, rounded once to ``dtype``; [R, D]."""
    even, odd = tl.split(tl.reshape(x.to(tl.float32), (x.shape[0], x.shape[1] // 2, 2)))
    pairs = tl.join((even * cos - odd * sin).to(dtype), (even * sin + odd * cos).to(dtype))
    return tl.reshape(pairs, (x.shape[0], x.shape[1]))


@triton.jit
def _heads(ptr, token_offset, stride_h, n, BLOCK_H: tl.constexpr, D: tl.constexpr):
    """(pointers to a token's n heads [BLOCK_H, D], their mask [BLOCK_H, 1])."""
    h = tl.arange(0, BLOCK_H)[:, None]
    return ptr + token_offset + h * stride_h + tl.arange(0, D)[None, :], h < n


@triton.jit
def _rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, kc_ptr, vc_ptr, S, H, HKV,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_cos, stride_sin, stride_cb, stride_ch, stride_cl, stride_vcb, stride_vch, stride_vcl,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    b = (token // S).to(tl.int64)
    s = (token % S).to(tl.int64)
    half = tl.arange(0, D // 2)[None, :]
    cos = tl.load(cos_ptr + s * stride_cos + half).to(tl.float32)
    sin = tl.load(sin_ptr + s * stride_sin + half).to(tl.float32)

    q_at, q_in = _heads(q_ptr, b * stride_qb + s * stride_qs, stride_qh, H, BLOCK_H, D)
    q = rotate(tl.load(q_at, mask=q_in, other=0.0), cos, sin, q_ptr.dtype.element_ty)
    out_at, _ = _heads(q_out_ptr, (b * S + s) * H * D, D, H, BLOCK_H, D)
    tl.store(out_at, q, mask=q_in)

    k_at, kv_in = _heads(k_ptr, b * stride_kb + s * stride_ks, stride_kh, HKV, BLOCK_KV, D)
    k = rotate(tl.load(k_at, mask=kv_in, other=0.0), cos, sin, k_ptr.dtype.element_ty)
    kc_at, _ = _heads(kc_ptr, b * stride_cb + s * stride_cl, stride_ch, HKV, BLOCK_KV, D)
    tl.store(kc_at, k.to(kc_ptr.dtype.element_ty), mask=kv_in)
    v_at, _ = _heads(v_ptr, b * stride_vb + s * stride_vs, stride_vh, HKV, BLOCK_KV, D)
    vc_at, _ = _heads(vc_ptr, b * stride_vcb + s * stride_vcl, stride_vch, HKV, BLOCK_KV, D)
    tl.store(vc_at, tl.load(v_at, mask=kv_in, other=0.0).to(vc_ptr.dtype.element_ty), mask=kv_in)


_ROPE_CACHE = LaunchCache(_rope_cache_kernel)


def rope_cache_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """A prompt's q [B, S, H, D] and k, v [B, S, Hkv, D] (unrotated, last dim contiguous; q, k and v one dtype):
    q and k rotated at positions 0 .. S - 1 by the tables cos, sin [>= S, D / 2], k and v written into k_cache,
    v_cache [B, Hkv, L >= S, D] there (module doc). Returns the rotated q, [B, S, H, D] contiguous."""
    op = "rope_cache_write"
    b, s, h, d = q.shape
    hkv = k.shape[2]
    if (
        q.dtype not in DTYPES
        or k.dtype != q.dtype
        or v.dtype != q.dtype
        or k.shape != (b, s, hkv, d)
        or v.shape != k.shape
        or d < 2
        or d & (d - 1)
    ):
        raise ValueError(f"{op}: q [B, S, H, D] and k, v [B, S, Hkv, D] of one dtype ({DTYPES}), D a power of 2; "
                         f"got q {q.dtype} {tuple(q.shape)}, k {k.dtype} {tuple(k.shape)}, v {v.dtype} "
                         f"{tuple(v.shape)}")  # fmt: skip
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[0] < s or t.shape[1] != d // 2 or t.stride(1) != 1:
            raise ValueError(f"{op}: {name} must be [>= {s}, {d // 2}] with rows contiguous, got {tuple(t.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4 or t.shape[0] != b or t.shape[1] != hkv or t.shape[2] < s or t.shape[3] != d:
            raise ValueError(f"{op}: {name} must be [{b}, {hkv}, >= {s}, {d}], got {tuple(t.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k, v, k_cache, v_cache)):
        raise ValueError(f"{op}: q, k, v and the caches need their last dim contiguous")
    if any(t.device != q.device for t in (k, v, cos, sin, k_cache, v_cache)):
        raise ValueError(f"{op}: every tensor must be on q's device ({q.device})")
    q_out = torch.empty((b, s, h, d), dtype=q.dtype, device=q.device)
    if q_out.numel() == 0:
        return q_out
    block_h = triton.next_power_of_2(h)
    _ROPE_CACHE.launch(
        (b * s,),
        dict(q_ptr=q, k_ptr=k, v_ptr=v, cos_ptr=cos, sin_ptr=sin, q_out_ptr=q_out, kc_ptr=k_cache, vc_ptr=v_cache,
             S=s, H=h, HKV=hkv, stride_qb=q.stride(0), stride_qs=q.stride(1), stride_qh=q.stride(2),
             stride_kb=k.stride(0), stride_ks=k.stride(1), stride_kh=k.stride(2), stride_vb=v.stride(0),
             stride_vs=v.stride(1), stride_vh=v.stride(2), stride_cos=cos.stride(0), stride_sin=sin.stride(0),
             stride_cb=k_cache.stride(0), stride_ch=k_cache.stride(1), stride_cl=k_cache.stride(2),
             stride_vcb=v_cache.stride(0), stride_vch=v_cache.stride(1), stride_vcl=v_cache.stride(2), D=d,
             BLOCK_H=block_h, BLOCK_KV=triton.next_power_of_2(hkv), num_warps=max(1, min(8, block_h * d // 512)),
             enable_fp_fusion=False),
    )  # fmt: skip
    return q_out
