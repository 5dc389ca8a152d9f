"""A decode step's fused elementwise kernels as custom ops (mx_kernels.decode_fused, whose docstring gives what
each fuses and its numerics): ``torch.ops.mx_recipe.add_rms_norm`` and ``silu_mul``. Fake implementations give
the shapes, so torch.compile and CUDA-graph capture take each kernel as one opaque node; Triton is imported on
the first call only.

A decode step takes them where it takes the decode-attention kernel (``mx_recipe.infer.attention.use_kernel``);
elsewhere it runs the model's own modules (RMSNorm, F.silu).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mx_recipe.library import define


def _norm(h: Tensor, delta: Tensor | None, weight: Tensor, eps: float, delta_scale: Tensor | None = None
          ) -> tuple[Tensor, Tensor]:  # fmt: skip
    from mx_kernels.decode_fused import add_rms_norm

    return add_rms_norm(h, delta, weight, eps, delta_scale)


def _norm_fake(h: Tensor, delta: Tensor | None, weight: Tensor, eps: float, delta_scale: Tensor | None = None
               ) -> tuple[Tensor, Tensor]:  # fmt: skip
    return torch.empty_like(h), torch.empty_like(h)


define("add_rms_norm(Tensor h, Tensor? delta, Tensor weight, float eps, Tensor? delta_scale=None) -> (Tensor, Tensor)",
       _norm, _norm_fake)  # fmt: skip


def _silu_mul(h1: Tensor, h3: Tensor) -> Tensor:
    from mx_kernels.decode_fused import silu_mul

    return silu_mul(h1, h3)


def _silu_mul_fake(h1: Tensor, h3: Tensor) -> Tensor:
    return h1.new_empty(h1.shape)


define("silu_mul(Tensor h1, Tensor h3) -> Tensor", _silu_mul, _silu_mul_fake)


def add_rms_norm(h: Tensor, delta: Tensor | None, weight: Tensor, eps: float, delta_scale: Tensor | None = None
                 ) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(h + delta, RMSNorm(h + delta) * weight) for rows [T, D]; delta None: (a copy of h, RMSNorm(h) * weight).
    delta may be a GEMM's fp32 split-K partials [S, T, D], summed here (``delta_scale``: times it after the sum;
    mx_kernels.decode_fused)."""
    return torch.ops.mx_recipe.add_rms_norm(h, delta, weight, eps, delta_scale)


def silu_mul(h1: Tensor, h3: Tensor) -> Tensor:
    """``F.silu(h1) * h3`` for rows [T, H] (the eager expression's two roundings), a new tensor."""
    return torch.ops.mx_recipe.silu_mul(h1, h3)
