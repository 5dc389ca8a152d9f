"""Decode attention as custom ops: ``torch.ops.mx_recipe.decode_attention``, the split-KV Triton kernel of
mx_kernels.decode_attention (its docstring gives the design) for a decode step's one query position over a KV
cache, grouped-query heads read together; and ``decode_attention_append``, the same with the step's own query and
key unrotated: the kernel applies RoPE at the step's position, writes the key and value into the caches there
(its schema says it mutates them) and attends over them too, so that a step needs no RoPE + cache-write launch.
``length`` is a device tensor, so that a CUDA graph captured once replays at every position. Fake
implementations give the shape, so torch.compile and CUDA-graph capture take the kernel as one opaque node;
Triton is imported on the first call only.

``prefill_attention`` is a prompt's causal attention from position 0: ``torch.ops.mx_recipe.rope_cache_write``
(mx_kernels.rope: q and k rotated and k and v written into the caches in one launch, where eager RoPE and the cache
write take about a dozen kernels) then SDPA, causal over the prompt's own positions with the grouped-query heads
taken by ``enable_gqa``: the caches are read in place, and a causal kernel skips the half of the scores a mask over
the whole cache would compute.

``use_kernel`` is the rule for a decode step (one position a sequence): this kernel, and the fused ones of
``mx_recipe.infer.fused``, on an NVIDIA GPU of compute capability 8.0 or newer, for the head dims it takes
(powers of 2 from 16 to 256); elsewhere SDPA with a mask over the cache and the model's modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mx_recipe.library import define
from mx_recipe.ops.device import capability


def _launch(q: Tensor, k_cache: Tensor, v_cache: Tensor, length: Tensor, scale: float | None = None) -> Tensor:
    from mx_kernels.decode_attention import decode_attention as launch

    return launch(q, k_cache, v_cache, length, scale)


def _fake(q: Tensor, k_cache: Tensor, v_cache: Tensor, length: Tensor, scale: float | None = None) -> Tensor:
    return q.new_empty(q.shape)


define(
    "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor length, float? scale=None) -> Tensor",
    _launch,
    _fake,
)


def _launch_append(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                   length: Tensor, scale: float | None = None, qkv_scale: Tensor | None = None) -> Tensor:  # fmt: skip
    from mx_kernels.decode_attention import decode_attention as launch

    return launch(q, k_cache, v_cache, length, scale, append=(k, v, cos, sin), qkv_scale=qkv_scale)


def _fake_append(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                 length: Tensor, scale: float | None = None, qkv_scale: Tensor | None = None) -> Tensor:  # fmt: skip
    return q.new_empty(q.shape[-4:], dtype=k_cache.dtype if q.dim() == 5 else q.dtype)


define(
    "decode_attention_append(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
    "Tensor(b!) v_cache, Tensor length, float? scale=None, Tensor? qkv_scale=None) -> Tensor",
    _launch_append,
    _fake_append,
)


def _launch_rope(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor
                 ) -> Tensor:  # fmt: skip
    from mx_kernels.rope import rope_cache_write

    return rope_cache_write(q, k, v, cos, sin, k_cache, v_cache)


def _fake_rope(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
    return q.new_empty(q.shape)


define(
    "rope_cache_write(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache)"
    " -> Tensor",
    _launch_rope,
    _fake_rope,
)


def use_kernel(device: torch.device, head_dim: int) -> bool:
    """Whether a decode step on ``device`` with heads of ``head_dim`` runs the kernel (module doc)."""
    cap = capability(device)
    return cap is not None and cap >= (8, 0) and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, length: Tensor, scale: float | None = None
                     ) -> Tensor:  # fmt: skip
    """q [B, Hkv, R, D] (R query heads per KV head) over k_cache, v_cache [B, Hkv, L, D] at the positions below
    ``length`` (int tensor [1] or [B] on q's device) -> [B, Hkv, R, D] in q's dtype. ``scale``: 1 / sqrt(D) by
    default, as SDPA's."""
    return torch.ops.mx_recipe.decode_attention(q, k_cache, v_cache, length, scale)


def decode_attention_append(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                            v_cache: Tensor, length: Tensor, scale: float | None = None,
                            qkv_scale: Tensor | None = None) -> Tensor:  # fmt: skip
    """A decode step's attention with its own position appended: q [B, Hkv, R, D] and k, v [B, Hkv * D] of the
    step, unrotated; cos, sin the model's RoPE tables [max_len, D / 2]. Rotates q and k at position
    length - 1 (as ``apply_rope``), writes k and v into k_cache, v_cache [B, Hkv, L, D] there and returns the
    attention over positions 0 .. length - 1, [B, Hkv, R, D] in q's dtype. q, k and v may instead be the fp32
    sums of the QKV GEMM's splits of K, [S, B, Hkv, R, D] and [S, B, Hkv * D], with their scale ``qkv_scale``
    (one or one per column of [q | k | v], or None): summed in split order and rounded to the caches' dtype in the
    kernel, as the GEMM would (mx_kernels.decode_attention)."""
    return torch.ops.mx_recipe.decode_attention_append(q, k, v, cos, sin, k_cache, v_cache, length, scale, qkv_scale)


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor
                      ) -> Tensor:  # fmt: skip
    """A prompt's attention from position 0 (module doc): q [B, S, H, D] and k, v [B, S, Hkv, D] unrotated (the QKV
    projection's outputs, as views); cos, sin the model's RoPE tables [max_len, D / 2]. Rotates q and k at positions
    0 .. S - 1 (as ``apply_rope``), writes k and v into k_cache, v_cache [B, Hkv, L, D] there and returns causal
    attention over those positions, [B, S, H * D] in q's dtype."""
    b, s = q.shape[:2]
    q = torch.ops.mx_recipe.rope_cache_write(q, k, v, cos, sin, k_cache, v_cache)
    keys, values = k_cache[:, :, :s].to(q.dtype), v_cache[:, :, :s].to(q.dtype)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2).reshape(b, s, -1)
