"""A decode step's fused elementwise kernels as custom ops (mx_kernels.decode_fused, whose docstring gives what
each fuses and its numerics): ``torch.ops.mx_recipe.rope_cache_write``, ``add_rms_norm`` and ``silu_mul``. Fake
implementations give the shapes, so torch.compile and CUDA-graph capture take each kernel as one opaque node;
Triton is imported on the first call only. ``rope_cache_write`` mutates the caches (its schema says so).

A decode step takes them where it takes the decode-attention kernel (``mx_recipe.infer.attention.use_kernel``);
elsewhere it runs the model's own modules (RMSNorm, apply_rope, index_put, F.silu).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mx_recipe.library import define


def _rope(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, position: Tensor, k_cache: Tensor,
          v_cache: Tensor) -> Tensor:  # fmt: skip
    from mx_kernels.decode_fused import rope_cache_write

    return rope_cache_write(q, k, v, cos, sin, position, k_cache, v_cache)


def _rope_fake(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, position: Tensor, k_cache: Tensor,
               v_cache: Tensor) -> Tensor:  # fmt: skip
    b, hkv, _, d = k_cache.shape
    return q.new_empty((b, hkv, q.shape[1] // (hkv * d), d))


def _norm(h: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    from mx_kernels.decode_fused import add_rms_norm

    return add_rms_norm(h, delta, weight, eps)


def _norm_fake(h: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(h), torch.empty_like(h)


define(
    "rope_cache_write(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor position, Tensor(a!) k_cache, "
    "Tensor(b!) v_cache) -> Tensor",
    _rope,
    _rope_fake,
)
define("add_rms_norm(Tensor h, Tensor? delta, Tensor weight, float eps) -> (Tensor, Tensor)", _norm, _norm_fake)


def _silu_mul(h1: Tensor, h3: Tensor) -> Tensor:
    from mx_kernels.decode_fused import silu_mul

    return silu_mul(h1, h3)


def _silu_mul_fake(h1: Tensor, h3: Tensor) -> Tensor:
    return h1.new_empty(h1.shape)


define("silu_mul(Tensor h1, Tensor h3) -> Tensor", _silu_mul, _silu_mul_fake)


def rope_cache_write(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, position: Tensor, k_cache: Tensor,
                     v_cache: Tensor) -> Tensor:  # fmt: skip
    """Rotate q [B, H * D] and k [B, Hkv * D] at ``position`` ([1]) with the RoPE tables cos, sin [max_len, D / 2];
    write k and v into k_cache, v_cache [B, Hkv, L, D] there; return the queries stacked per KV head [B, Hkv, R, D]."""
    return torch.ops.mx_recipe.rope_cache_write(q, k, v, cos, sin, position, k_cache, v_cache)


def add_rms_norm(h: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(h + delta, RMSNorm(h + delta) * weight) for rows [T, D]; delta None: (a copy of h, RMSNorm(h) * weight)."""
    return torch.ops.mx_recipe.add_rms_norm(h, delta, weight, eps)


def silu_mul(h1: Tensor, h3: Tensor) -> Tensor:
    """``F.silu(h1) * h3`` for rows [T, H] (the eager expression's two roundings), a new tensor."""
    return torch.ops.mx_recipe.silu_mul(h1, h3)
