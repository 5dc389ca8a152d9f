"""An MoE block's routing at decode, fused: the few tokens of a decode step routed in one launch, and their
experts' outputs weighed and summed in another.

Eager PyTorch routes a step in about fifteen kernels (softmax, top-k, a gather, a count by scatter, a stable
argsort in two sorts, a cumsum, casts), and combines the experts' rows in five more (a gather of the weights, a
product, zeros, index_add, the shared experts' add); at decode each costs its launch, not its bytes.

* ``moe_route``: one program takes the router's logits [T, E] of all T tokens (T * E up to MAX_ROUTED
  elements): scores by softmax or sigmoid in fp32, the top k of each token's scores plus the balancing bias (the
  bias picks the experts, the scores weigh them; ties go to the lower expert index), optionally renormalized to
  sum to 1. It then lays the T * k (token, expert) rows out as the grouped GEMM reads them, sorted by expert and
  by token within an expert (what a stable argsort of the flattened choices gives): ``offs`` [E] int32
  cumulative row ends, ``rows`` [T * k] int32, the token of each row, and per token its k rows ``slots`` [T, k]
  int32 with their weights [T, k] fp32, both in expert order. A row's place is its expert's start plus the count
  of earlier tokens that chose that expert: a cumulative sum over the [T, E] choice matrix, no sort. Shared
  experts folded into the grouped GEMM (``shared``) follow as groups of every token, weight 1.
* ``moe_combine``: one program per token and block of columns sums its k rows of the experts' output, each times
  its weight, and the shared experts' output, in fp32 in expert order, rounded once to the output's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from mx_kernels import pdl
from mx_kernels.decode_fused import row_block
from mx_kernels.launch_cache import LaunchCache

MAX_ROUTED = 16384  # T * E (padded to powers of 2) one routing program takes: a decode step's tokens


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, offs_ptr, rows_ptr, slots_ptr, weights_ptr, T, E, stride_l,
    K: tl.constexpr, SHARED: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    t = tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    ok = (t[:, None] < T) & (e[None, :] < E)
    logits = tl.load(logits_ptr + t[:, None] * stride_l + e[None, :], mask=ok, other=float("-inf")).to(tl.float32)
    if SOFTMAX:
        p = tl.exp(logits - tl.max(logits, 1)[:, None])
        scores = p / tl.sum(p, 1)[:, None]
    else:
        scores = tl.sigmoid(logits)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + e, mask=e < E, other=0.0)[None, :]
    choice = tl.where(ok, choice, float("-inf"))
    chosen = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int32)
    for _ in tl.static_range(K):  # the largest left, the lowest expert index among equals
        best = tl.max(choice, 1)
        first = tl.min(tl.where(choice == best[:, None], e[None, :], BLOCK_E), 1)
        pick = e[None, :] == first[:, None]
        chosen = tl.where(pick, 1, chosen)
        choice = tl.where(pick, float("-inf"), choice)
    chosen = tl.where(ok, chosen, 0)
    weight = tl.where(chosen == 1, scores, 0.0)
    if NORM:
        weight = weight / tl.sum(weight, 1)[:, None]
    # rows sorted by expert, then token: row (t, e) = start of e + tokens before t that chose e
    counts = tl.sum(chosen, 0)
    ends = tl.cumsum(counts, 0)
    row = ends[None, :] - counts[None, :] + tl.cumsum(chosen, 0) - 1
    slot = tl.cumsum(chosen, 1) - 1  # the row's place among its token's k, in expert order
    picked = chosen == 1
    tl.store(offs_ptr + e, ends, mask=e < E)
    tl.store(rows_ptr + row, tl.broadcast_to(t[:, None], (BLOCK_T, BLOCK_E)), mask=picked)
    tl.store(slots_ptr + t[:, None] * (K + SHARED) + slot, row, mask=picked)
    tl.store(weights_ptr + t[:, None] * (K + SHARED) + slot, weight, mask=picked)
    for s in tl.static_range(SHARED):  # shared expert s: group E + s, every token in order, weight 1
        first = T * K + s * T
        tl.store(offs_ptr + E + s, first + T)
        tl.store(rows_ptr + first + t, t, mask=t < T)
        tl.store(slots_ptr + t * (K + SHARED) + K + s, first + t, mask=t < T)
        tl.store(weights_ptr + t * (K + SHARED) + K + s, tl.full([BLOCK_T], 1.0, tl.float32), mask=t < T)


@triton.jit
def _combine_kernel(
    y_ptr, slots_ptr, weights_ptr, shared_ptr, out_ptr, D, stride_y, stride_s, stride_o,
    K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    tok = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < D
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(slots_ptr + tok * K + j).to(tl.int64)
        wt = tl.load(weights_ptr + tok * K + j)
        acc += wt * tl.load(y_ptr + row * stride_y + c, mask=ok, other=0.0).to(tl.float32)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + tok * stride_s + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + tok * stride_o + c, acc.to(out_ptr.dtype.element_ty), mask=ok)


_ROUTE = LaunchCache(_route_kernel)
_COMBINE = LaunchCache(_combine_kernel)


def fits(tokens: int, experts: int) -> bool:
    """Whether one routing program takes ``tokens`` tokens over ``experts`` experts (a decode step's)."""
    return triton.next_power_of_2(max(tokens, 1)) * triton.next_power_of_2(experts) <= MAX_ROUTED


def moe_route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, softmax: bool, norm: bool, shared: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The router's logits [T, E] (any float dtype; bias [E] fp32 or None) -> (offs [E] int32, rows [T * k]
    int32, slots [T, k] int32, weights [T, k] fp32), as the module doc describes. ``shared``: S shared experts as
    groups E .. E + S - 1 after the routed ones, each every token's with weight 1: offs [E + S], rows
    [T * (k + S)], slots and weights [T, k + S]."""
    op = "moe_route"
    if shared < 0:
        raise ValueError(f"{op}: shared must be at least 0, got {shared}")
    if logits.dim() != 2 or logits.stride(1) != 1 or not logits.is_floating_point():
        raise ValueError(f"{op}: logits must be [T, E] floats with contiguous rows, got {logits.dtype} "
                         f"{tuple(logits.shape)}")  # fmt: skip
    t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"{op}: top_k must be in 1..{e} (the experts), got {top_k}")
    if bias is not None and (bias.shape != (e,) or bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError(f"{op}: bias must be fp32 [{e}], got {bias.dtype} {tuple(bias.shape)}")
    if not fits(t, e):
        raise ValueError(f"{op}: {t} tokens over {e} experts exceed one program ({MAX_ROUTED} padded elements)")
    dev = logits.device
    offs = torch.empty(e + shared, dtype=torch.int32, device=dev)
    rows = torch.empty(t * (top_k + shared), dtype=torch.int32, device=dev)
    slots = torch.empty((t, top_k + shared), dtype=torch.int32, device=dev)
    weights = torch.empty((t, top_k + shared), dtype=torch.float32, device=dev)
    if t == 0:
        return offs.zero_(), rows, slots, weights
    block_t, block_e = triton.next_power_of_2(t), triton.next_power_of_2(e)
    _ROUTE.launch(
        (1,),
        dict(logits_ptr=logits, bias_ptr=bias if bias is not None else logits, offs_ptr=offs, rows_ptr=rows,
             slots_ptr=slots, weights_ptr=weights, T=t, E=e, stride_l=logits.stride(0), K=top_k, SHARED=shared,
             SOFTMAX=softmax, HAS_BIAS=bias is not None, NORM=norm, BLOCK_T=block_t, BLOCK_E=block_e,
             num_warps=min(8, max(1, block_t * block_e // 1024)), **pdl.options(logits.device)),
    )  # fmt: skip
    return offs, rows, slots, weights


def moe_combine(y: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None
                ) -> torch.Tensor:  # fmt: skip
    """out [T, D] = sum over k of weights[t, k] * y[slots[t, k]] (+ shared[t]), for the experts' rows y [T * k, D]
    (in y's dtype)."""
    op = "moe_combine"
    if slots.dim() != 2 or weights.shape != slots.shape or slots.dtype != torch.int32 or weights.dtype != torch.float32:
        raise ValueError(f"{op}: slots int32 and weights fp32 [T, k], got {slots.dtype} {tuple(slots.shape)} and "
                         f"{weights.dtype} {tuple(weights.shape)}")  # fmt: skip
    t, k = slots.shape
    if y.dim() != 2 or y.shape[0] != t * k or y.stride(1) != 1:
        raise ValueError(f"{op}: y must be [T * k, D] = [{t * k}, D] with contiguous rows, got {tuple(y.shape)}")
    if shared is not None and (shared.shape != (t, y.shape[1]) or shared.stride(1) != 1):
        raise ValueError(f"{op}: shared must be [T, D] = [{t}, {y.shape[1]}], got {tuple(shared.shape)}")
    d = y.shape[1]
    out = torch.empty((t, d), dtype=y.dtype, device=y.device)
    if t == 0 or d == 0:
        return out
    block, warps = row_block(d)
    _COMBINE.launch(
        (t, triton.cdiv(d, block)),
        dict(y_ptr=y, slots_ptr=slots.contiguous(), weights_ptr=weights.contiguous(),
             shared_ptr=shared if shared is not None else y, out_ptr=out, D=d, stride_y=y.stride(0),
             stride_s=shared.stride(0) if shared is not None else 0, stride_o=out.stride(0), K=k,
             HAS_SHARED=shared is not None, BLOCK=block, num_warps=warps, **pdl.options(y.device)),
    )  # fmt: skip
    return out
