"""An MoE block's routing at decode, fused: the few tokens of a decode step routed in one launch (the router's GEMM
included), and their experts' outputs weighed and summed in another.

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
* ``moe_gate_route``: the same from the router's input x [T, D] and its linear's weight [E, D] (a step of up to
  GATE_MAX_TOKENS tokens), in one launch where the router's GEMM took its own: program e computes expert e's
  logits (an fp32 sum rounded to x's dtype, as the linear's output; its summation order is not cuBLAS's), stores
  them and counts itself in on an arrival counter; the last program to arrive routes them as ``moe_route``.
* ``moe_combine_add_rms_norm``: the block's output added to the residual stream and normed for the next block,
  one launch: one program per token sums its k rows of the experts' output, each times its weight, and the shared
  experts' output, in fp32 in expert order, rounds the sum once to the output's dtype (the MoE block's output),
  then adds it to the residual stream and norms it as ``add_rms_norm`` does (mx_kernels.decode_fused), whose kernel
  boundary it saves. Under PDL the norm's weight is read before the wait for the kernel before, and with
  ``routed_early`` (a decode step: the routing kernel ran at least two launches earlier, and each kernel between
  released the next only after its own wait, so it has completed) the token's slots and weights too: only the
  experts' rows and the stream follow the wait. The rows' lines are requested together first (``_prefetch``):
  the compiler issues each row's load only after the sum of the one before it. MoE 16B dims, batch 1, one H200,
  what the combine, the norm and the QKV GEMM after them add to a step, us a layer: MXFP4 6.9 -> 5.7, bf16 11.8
  -> 10.5 (a separate combine whose loads each waited out their trip to L2, then the norm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from mx_kernels import pdl
from mx_kernels.common import arrival_counters, interpreting
from mx_kernels.decode_fused import norm_block, store_norm
from mx_kernels.launch_cache import LaunchCache

MAX_ROUTED = 16384  # T * E (padded to powers of 2) one routing program takes: a decode step's tokens
GATE_MAX_TOKENS = 16  # tokens up to which moe_gate_route computes the router's logits itself
GATE_TILE = 4096  # x elements a gate program holds at once: tokens * D, D cut to fit
GATE_WARPS = 1  # the last program routes alone: its reductions over the experts stay in one warp


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, offs_ptr, rows_ptr, slots_ptr, weights_ptr, T, E, stride_l,
    K: tl.constexpr, SHARED: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    _route(logits_ptr, bias_ptr, offs_ptr, rows_ptr, slots_ptr, weights_ptr, T, E, stride_l, K, SHARED, SOFTMAX,
           HAS_BIAS, NORM, BLOCK_T, BLOCK_E, "")  # fmt: skip


@triton.jit
def _gate_route_kernel(
    x_ptr, gate_ptr, ws_ptr, cnt_ptr, bias_ptr, offs_ptr, rows_ptr, slots_ptr, weights_ptr, T, E, D, stride_x,
    stride_g, K: tl.constexpr, SHARED: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program e: expert e's logits of the T tokens, x [T, D] @ gate[e] in fp32 rounded to x's dtype (the router
    linear's output), into the workspace [T, E]; the last program to arrive routes them all (``_route``). The
    first tile of the router's weight, which no kernel writes, is read before the PDL wait."""
    e = tl.program_id(0)
    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    gate_row = gate_ptr + e.to(tl.int64) * stride_g
    w = tl.load(gate_row + d, mask=d < D, other=0.0).to(tl.float32)
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        if d0 > 0:
            w = tl.load(gate_row + d, mask=d < D, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + t[:, None] * stride_x + d[None, :], mask=(t[:, None] < T) & (d[None, :] < D), other=0.0)
        acc += tl.sum(x.to(tl.float32) * w[None, :], 1)
    logit = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(ws_ptr + t * E + e, logit, mask=t < T)
    tl.debug_barrier()  # every thread's stores, then one release by the counter's atomic
    if tl.atomic_add(cnt_ptr, 1, sem="acq_rel") == E - 1:  # the last expert's program: route
        _route(ws_ptr, bias_ptr, offs_ptr, rows_ptr, slots_ptr, weights_ptr, T, E, E, K, SHARED, SOFTMAX,
               HAS_BIAS, NORM, BLOCK_T, BLOCK_E, ".cg")  # fmt: skip
        tl.atomic_xchg(cnt_ptr, 0)  # ready for the next launch


@triton.jit
def _route(logits_ptr, bias_ptr, offs_ptr, rows_ptr, slots_ptr, weights_ptr, T, E, stride_l, K: tl.constexpr,
           SHARED: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
           BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, CACHE: tl.constexpr):  # fmt: skip
    """Route the logits [T, E] (module doc); ``CACHE``: the logits' load cache modifier (".cg": another program
    wrote them, read them from L2)."""
    t = tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    ok = (t[:, None] < T) & (e[None, :] < E)
    logits = tl.load(logits_ptr + t[:, None] * stride_l + e[None, :], mask=ok, other=float("-inf"),
                     cache_modifier=CACHE).to(tl.float32)  # fmt: skip
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
def _combine_norm_kernel(
    h_ptr, y_ptr, slots_ptr, weights_ptr, shared_ptr, w_ptr, h_out_ptr, out_ptr, D, eps, stride_h, stride_y,
    stride_s, stride_ho, stride_o, K: tl.constexpr, HAS_SHARED: tl.constexpr, ROUTED_EARLY: tl.constexpr,
    PREFETCH: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program t: token t's k expert rows times their weights (+ its shared row), summed in slot order and rounded,
    added to its residual row and normed (module doc). PREFETCH: a GPU's compile, not the interpreter's
    (``_prefetch``)."""
    tok = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < D
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)  # no kernel of a step writes the norm's weight
    if not ROUTED_EARLY:
        pdl.wait_prior(PDL)
        pdl.release_next(PDL)
    rows = ()
    weights = ()
    for j in tl.static_range(K):  # written by the routing kernel: from L2
        rows = rows + (tl.load(slots_ptr + tok * K + j, cache_modifier=".cg").to(tl.int64),)
        weights = weights + (tl.load(weights_ptr + tok * K + j, cache_modifier=".cg"),)
    if ROUTED_EARLY:
        pdl.wait_prior(PDL)
        pdl.release_next(PDL)
    if PREFETCH:
        chunk = tl.arange(0, BLOCK // 8) * 8  # a thread's 16 bytes of a row
        for j in tl.static_range(K):
            _prefetch(y_ptr + rows[j] * stride_y + chunk, chunk < D)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(K):
        acc += weights[j] * tl.load(y_ptr + rows[j] * stride_y + c, mask=ok, other=0.0).to(tl.float32)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + tok * stride_s + c, mask=ok, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + tok * stride_h + c, mask=ok, other=0.0)
    block_out = acc.to(y_ptr.dtype.element_ty)  # the MoE block's output, as a separate combine would write it
    h = (h.to(tl.float32) + block_out.to(tl.float32)).to(h_out_ptr.dtype.element_ty)
    store_norm(h, w, h_out_ptr + tok * stride_ho + c, out_ptr + tok * stride_o + c, ok, D, eps)


@triton.jit
def _prefetch(ptrs, mask):
    """Fetch the lines at ``ptrs`` into L1, nothing waiting on them: the combine's loads, which the compiler issues
    each after the sum of the one before it, then find their rows there or in flight (``_combine_norm_kernel``)."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L1 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


_ROUTE = LaunchCache(_route_kernel)
_GATE_ROUTE = LaunchCache(_gate_route_kernel)
_COMBINE_NORM = LaunchCache(_combine_norm_kernel)


def fits(tokens: int, experts: int) -> bool:
    """Whether one routing program takes ``tokens`` tokens over ``experts`` experts (a decode step's)."""
    return triton.next_power_of_2(max(tokens, 1)) * triton.next_power_of_2(experts) <= MAX_ROUTED


def _check_route(t: int, e: int, bias: torch.Tensor | None, top_k: int, shared: int, op: str) -> None:
    if shared < 0:
        raise ValueError(f"{op}: shared must be at least 0, got {shared}")
    if not 1 <= top_k <= e:
        raise ValueError(f"{op}: top_k must be in 1..{e} (the experts), got {top_k}")
    if bias is not None and (bias.shape != (e,) or bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError(f"{op}: bias must be fp32 [{e}], got {bias.dtype} {tuple(bias.shape)}")
    if not fits(t, e):
        raise ValueError(f"{op}: {t} tokens over {e} experts exceed one program ({MAX_ROUTED} padded elements)")


def _route_outputs(t: int, e: int, top_k: int, shared: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(offs, rows, slots, weights), empty."""
    return (torch.empty(e + shared, dtype=torch.int32, device=device),
            torch.empty(t * (top_k + shared), dtype=torch.int32, device=device),
            torch.empty((t, top_k + shared), dtype=torch.int32, device=device),
            torch.empty((t, top_k + shared), dtype=torch.float32, device=device))  # fmt: skip


def _route_args(bias: torch.Tensor | None, outputs: tuple[torch.Tensor, ...], t: int, e: int, top_k: int,
                shared: int, softmax: bool, norm: bool, like: torch.Tensor) -> dict:  # fmt: skip
    offs, rows, slots, weights = outputs
    return dict(bias_ptr=bias if bias is not None else like, offs_ptr=offs, rows_ptr=rows, slots_ptr=slots,
                weights_ptr=weights, T=t, E=e, K=top_k, SHARED=shared, SOFTMAX=softmax, HAS_BIAS=bias is not None,
                NORM=norm, BLOCK_T=triton.next_power_of_2(t), BLOCK_E=triton.next_power_of_2(e),
                **pdl.options(like.device))  # fmt: skip


def moe_route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, softmax: bool, norm: bool, shared: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The router's logits [T, E] (any float dtype; bias [E] fp32 or None) -> (offs [E] int32, rows [T * k]
    int32, slots [T, k] int32, weights [T, k] fp32), as the module doc describes. ``shared``: S shared experts as
    groups E .. E + S - 1 after the routed ones, each every token's with weight 1: offs [E + S], rows
    [T * (k + S)], slots and weights [T, k + S]."""
    op = "moe_route"
    if logits.dim() != 2 or logits.stride(1) != 1 or not logits.is_floating_point():
        raise ValueError(f"{op}: logits must be [T, E] floats with contiguous rows, got {logits.dtype} "
                         f"{tuple(logits.shape)}")  # fmt: skip
    t, e = logits.shape
    _check_route(t, e, bias, top_k, shared, op)
    outputs = _route_outputs(t, e, top_k, shared, logits.device)
    if t == 0:
        return outputs[0].zero_(), *outputs[1:]
    args = _route_args(bias, outputs, t, e, top_k, shared, softmax, norm, logits)
    warps = min(8, max(1, args["BLOCK_T"] * args["BLOCK_E"] // 1024))
    _ROUTE.launch((1,), dict(args, logits_ptr=logits, stride_l=logits.stride(0), num_warps=warps))
    return outputs


def moe_gate_route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None, top_k: int, softmax: bool,
                   norm: bool, shared: int = 0) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """``moe_route`` of the router linear's logits x [T, D] @ gate [E, D]^T, in one launch: one program per
    expert (fp32 sums rounded to x's dtype, the linear's output), the last to finish routes (module doc). Up to
    GATE_MAX_TOKENS tokens."""
    op = "moe_gate_route"
    if x.dim() != 2 or gate.dim() != 2 or x.shape[1] != gate.shape[1] or x.dtype != gate.dtype:
        raise ValueError(f"{op}: x [T, D] and gate [E, D] of one float dtype, got {x.dtype} {tuple(x.shape)} and "
                         f"{gate.dtype} {tuple(gate.shape)}")  # fmt: skip
    if x.stride(1) != 1 or gate.stride(1) != 1 or not x.is_floating_point():
        raise ValueError(f"{op}: x and gate must be floats with contiguous rows")
    (t, d), e = x.shape, gate.shape[0]
    if t > GATE_MAX_TOKENS:
        raise ValueError(f"{op}: at most {GATE_MAX_TOKENS} tokens, got {t} (moe_route takes more)")
    _check_route(t, e, bias, top_k, shared, op)
    outputs = _route_outputs(t, e, top_k, shared, x.device)
    if t == 0:
        return outputs[0].zero_(), *outputs[1:]
    logits = torch.empty((t, e), dtype=torch.float32, device=x.device)
    block_t = triton.next_power_of_2(t)
    block_d = min(triton.next_power_of_2(max(d, 1)), GATE_TILE // block_t)
    _GATE_ROUTE.launch(
        (e,),
        dict(_route_args(bias, outputs, t, e, top_k, shared, softmax, norm, x), x_ptr=x, gate_ptr=gate,
             ws_ptr=logits, cnt_ptr=arrival_counters("moe_gate_route", x.device, 1), D=d, stride_x=x.stride(0),
             stride_g=gate.stride(0), BLOCK_D=block_d, num_warps=GATE_WARPS),
    )  # fmt: skip
    return outputs


def moe_combine_add_rms_norm(h: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                             shared: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                             routed_early: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``add_rms_norm(h, out, norm_weight, eps)`` (mx_kernels.decode_fused) of the residual rows h [T, D] and the MoE
    block's output out [T, D] = sum over k of weights[t, k] * y[slots[t, k]] (+ shared[t]) for the experts' rows
    y [T * k, D], summed in fp32 and rounded once to y's dtype: (h + out, its RMSNorm). ``routed_early``: slots and
    weights were written at least two PDL launches before this one (module doc)."""
    op = "moe_combine_add_rms_norm"
    if slots.dim() != 2 or weights.shape != slots.shape or slots.dtype != torch.int32 or weights.dtype != torch.float32:
        raise ValueError(f"{op}: slots int32 and weights fp32 [T, k], got {slots.dtype} {tuple(slots.shape)} and "
                         f"{weights.dtype} {tuple(weights.shape)}")  # fmt: skip
    t, k = slots.shape
    if y.dim() != 2 or y.shape[0] != t * k or y.stride(1) != 1:
        raise ValueError(f"{op}: y must be [T * k, D] = [{t * k}, D] with contiguous rows, got {tuple(y.shape)}")
    d = y.shape[1]
    if shared is not None and (shared.shape != (t, d) or shared.stride(1) != 1):
        raise ValueError(f"{op}: shared must be [T, D] = [{t}, {d}], got {tuple(shared.shape)}")
    if h.shape != (t, d) or h.stride(1) != 1 or norm_weight.shape != (d,) or not norm_weight.is_contiguous():
        raise ValueError(f"{op}: h [T, D] = [{t}, {d}] with contiguous rows and norm_weight [{d}], got h "
                         f"{tuple(h.shape)} and norm_weight {tuple(norm_weight.shape)}")  # fmt: skip
    h_out, out = torch.empty_like(h), torch.empty_like(h)
    if t == 0 or d == 0:
        return h_out, out
    block, warps = norm_block(d)
    _COMBINE_NORM.launch(
        (t,),
        dict(h_ptr=h, y_ptr=y, slots_ptr=slots.contiguous(), weights_ptr=weights.contiguous(),
             shared_ptr=shared if shared is not None else y, w_ptr=norm_weight, h_out_ptr=h_out, out_ptr=out, D=d,
             eps=eps, stride_h=h.stride(0), stride_y=y.stride(0),
             stride_s=shared.stride(0) if shared is not None else 0, stride_ho=h_out.stride(0),
             stride_o=out.stride(0), K=k, HAS_SHARED=shared is not None, ROUTED_EARLY=routed_early, BLOCK=block,
             PREFETCH=y.is_cuda and not interpreting(), num_warps=warps, **pdl.options(y.device)),
    )  # fmt: skip
    return h_out, out
