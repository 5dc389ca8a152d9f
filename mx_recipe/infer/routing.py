"""An MoE block's decode-step routing as custom ops (mx_kernels.moe_routing, whose docstring gives the layout and
the numerics): ``torch.ops.mx_recipe.moe_route`` turns the router's logits into the grouped GEMM's rows sorted by
expert (``moe_gate_route``: from the router's input and weight, its GEMM in the same launch), and
``moe_combine_add_rms_norm`` weighs and sums each token's expert rows with its shared experts' output and adds the
sum to the residual stream and norms it for the next block. Fake implementations give the shapes,
so torch.compile and CUDA-graph capture take each kernel as one opaque node; Triton is imported on the first call
only.

A decode step takes them where it takes the other decode kernels (``mx_recipe.infer.attention.use_kernel``) and
``fits`` says one routing program holds the step's tokens; elsewhere it runs the ``MoE`` module.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mx_recipe.library import define


def fits(tokens: int, experts: int) -> bool:
    """Whether one routing program takes ``tokens`` tokens over ``experts`` experts (a decode step's)."""
    from mx_kernels.moe_routing import fits as kernel_fits

    return kernel_fits(tokens, experts)


def _route(logits: Tensor, bias: Tensor | None, top_k: int, softmax: bool, norm: bool, shared: int = 0
           ) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    from mx_kernels.moe_routing import moe_route

    return moe_route(logits, bias, top_k, softmax, norm, shared)


def _route_fake(logits: Tensor, bias: Tensor | None, top_k: int, softmax: bool, norm: bool, shared: int = 0
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    t, e = logits.shape
    i32, k = torch.int32, top_k + shared
    return (logits.new_empty(e + shared, dtype=i32), logits.new_empty(t * k, dtype=i32),
            logits.new_empty((t, k), dtype=i32), logits.new_empty((t, k), dtype=torch.float32))  # fmt: skip


def _gate_route(x: Tensor, gate: Tensor, bias: Tensor | None, top_k: int, softmax: bool, norm: bool, shared: int = 0
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    from mx_kernels.moe_routing import moe_gate_route

    return moe_gate_route(x, gate, bias, top_k, softmax, norm, shared)


def _gate_route_fake(x: Tensor, gate: Tensor, bias: Tensor | None, top_k: int, softmax: bool, norm: bool,
                     shared: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    return _route_fake(x.new_empty((x.shape[0], gate.shape[0])), bias, top_k, softmax, norm, shared)


def _combine_norm(h: Tensor, y: Tensor, slots: Tensor, weights: Tensor, shared: Tensor | None, norm_weight: Tensor,
                  eps: float, routed_early: bool = False) -> tuple[Tensor, Tensor]:  # fmt: skip
    from mx_kernels.moe_routing import moe_combine_add_rms_norm

    return moe_combine_add_rms_norm(h, y, slots, weights, shared, norm_weight, eps, routed_early)


def _combine_norm_fake(h: Tensor, y: Tensor, slots: Tensor, weights: Tensor, shared: Tensor | None,
                       norm_weight: Tensor, eps: float, routed_early: bool = False
                       ) -> tuple[Tensor, Tensor]:  # fmt: skip
    return torch.empty_like(h), torch.empty_like(h)


define("moe_route(Tensor logits, Tensor? bias, int top_k, bool softmax, bool norm, int shared=0) -> (Tensor, Tensor, "
       "Tensor, Tensor)", _route, _route_fake)  # fmt: skip
define("moe_gate_route(Tensor x, Tensor gate, Tensor? bias, int top_k, bool softmax, bool norm, int shared=0) -> "
       "(Tensor, Tensor, Tensor, Tensor)", _gate_route, _gate_route_fake)  # fmt: skip
define("moe_combine_add_rms_norm(Tensor h, Tensor y, Tensor slots, Tensor weights, Tensor? shared, Tensor norm_weight, "
       "float eps, bool routed_early=False) -> (Tensor, Tensor)", _combine_norm, _combine_norm_fake)  # fmt: skip


def moe_route(logits: Tensor, bias: Tensor | None, top_k: int, softmax: bool, norm: bool, shared: int = 0
              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The router's logits [T, E] -> (offs [E] int32 cumulative ends of the rows sorted by expert, rows [T * k]
    int32 the token of each, slots [T, k] int32 each token's rows in expert order, weights [T, k] fp32 their
    scores). ``bias``: the balancing bias [E] fp32, added to the scores to choose (None: none); ``softmax``:
    softmax scores, else sigmoid; ``norm``: the chosen scores renormalized to sum to 1. ``shared``: S shared
    experts folded into the grouped GEMM, groups E .. E + S - 1 of every token with weight 1 (k + S a token)."""
    return torch.ops.mx_recipe.moe_route(logits, bias, top_k, softmax, norm, shared)


def gate_fits(tokens: int) -> bool:
    """Whether ``moe_gate_route`` takes a step of ``tokens`` tokens (its router GEMM is for a few)."""
    from mx_kernels.moe_routing import GATE_MAX_TOKENS

    return tokens <= GATE_MAX_TOKENS


def moe_gate_route(x: Tensor, gate: Tensor, bias: Tensor | None, top_k: int, softmax: bool, norm: bool,
                   shared: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``moe_route`` of the router's logits x [T, D] @ gate [E, D]^T (rounded to x's dtype, as the router linear
    writes them), the GEMM in the routing launch (up to ``gate_fits`` tokens)."""
    return torch.ops.mx_recipe.moe_gate_route(x, gate, bias, top_k, softmax, norm, shared)


def moe_combine_add_rms_norm(h: Tensor, y: Tensor, slots: Tensor, weights: Tensor, shared: Tensor | None,
                             norm_weight: Tensor, eps: float, routed_early: bool = False
                             ) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(h + out, RMSNorm(h + out) * norm_weight) as ``mx_recipe.infer.fused.add_rms_norm`` gives them, for the
    residual rows h [T, D] and the MoE block's output out [T, D]: each token's rows of the experts' output y
    [T * k, D] (``slots`` [T, k] int32) times their ``weights`` [T, k] fp32, summed, plus its row of ``shared`` (the
    shared experts' output; None: none), in fp32, rounded once to y's dtype. ``routed_early``: slots and weights were
    written at least two PDL launches before this one (a decode step's routing), so they are read before the wait."""
    return torch.ops.mx_recipe.moe_combine_add_rms_norm(h, y, slots, weights, shared, norm_weight, eps, routed_early)
