"""Decoding with a static KV cache: prefill the prompts, then one token per sequence a step.

The cache holds every layer's keys and values for ``max_len`` positions, allocated once; each step writes its
positions and attends over the whole cache with a mask that hides the positions not yet written, so every step
after the prefill has the same shapes (one compiled graph, one CUDA graph). The block's computation is the
model's own modules, called in the order of ``TransformerBlock.forward`` and ``MoEBlock.forward``: attention with
the cache in place of SDPA's causal mask, then the feed-forward or MoE.

The cache is laid out per KV head, [batch, kv heads, max_len, head dim], and the query heads that share a KV head
attend as one head with their queries stacked (grouped-query attention): SDPA reads each layer's cache once, in
place, where repeating it per query head would copy it n_heads / n_kv_heads times a step.

A decode step (one position) on a GPU runs the same computation in few launches (``_kernel_step``): the residual add
with RMSNorm and SwiGLU's silu * mul as fused kernels (``mx_recipe.infer.fused``; silu * mul in the gate/up GEMM's
epilogue where w1 and w3 are packed, fused and on the weight-only kernel), attention by the split-KV kernel of
``mx_recipe.infer.attention`` with RoPE and the cache write in it, which reads only the positions written so far and
spreads them over the SMs (at batch 1 SDPA runs one program per KV head and waits on its loads), and an MoE block's
routing and combine by the kernels of ``mx_recipe.infer.routing`` (one launch each, where eager routing takes some
twenty; up to ``gate_fits`` tokens the router's GEMM runs in the routing launch too; the combine runs in the next
add + norm launch, ``ExpertRows``). At one sequence the bf16 projections (bf16 models, and every model's output
layer) are the GEMV of ``mx_recipe.infer.gemv``, SwiGLU in its epilogue for a fused w1/w3; at more, cuBLAS. A
residual branch's last projection (wo, w2) on a tiled quantized weight whose GEMM splits K over programs hands its
splits' fp32 sums to the add + norm kernel, which adds them (``QuantizedLinear.partials``): the GEMM ends without a
sum of its own. The fused QKV GEMM hands its sums to the attention kernel the same way (``FusedLinear.partials``).
The position is a device tensor, so one CUDA graph serves every step.
A prefill (``prefill``: prompts into an empty cache from position 0) on such a GPU runs the same fused kernels with
the prompt's positions as rows, its attention by ``prefill_attention`` of ``mx_recipe.infer.attention`` (RoPE and
the cache write in one kernel, then causal SDPA over the prompt's own positions), and the output layer on each
prompt's last row only, the one sampled. ``forward`` (any positions), and every step on the CPU, run the model's
modules with SDPA and the mask. The fused MoE step leaves the block's ``tokens_per_expert`` (a training statistic
for the balancing bias) untouched.

``DecodeGraph`` captures one decode step in a CUDA graph and replays it: a step launches a few hundred small
kernels, whose launch time would otherwise exceed their run time at small batch.

On sm_90 and newer a kernel step whose projections are the project's kernels (the weight-only kernels of
quantized weights, the GEMV of bf16 ones) launches its Triton and Gluon kernels with programmatic dependent launch
(``mx_kernels.pdl``): each kernel starts while the one before it drains, its setup and first weight reads
overlapping that kernel's tail. For quantized weights it pays up to ``PDL_MAX_BATCH`` sequences, and up to
``PDL_MAX_BATCH_TILED`` where every quantized weight is tiled 4-bit (``tile_weights``: Hopper's tensor-core
kernel); past them the other kernels' larger tiles lose by it. A bf16 step takes it where its projections are the
GEMV (one sequence); with cuBLAS's GEMMs it gains nothing. One H200, Llama 3 8B dims, context 1024, 2026-11-30,
ms a step with / without (``bench_decode.py --pdl both``): batch 1 bf16 3.88 / 4.16, MXFP8 2.43 / 2.64, MXFP4
2.01 / 2.28, NVFP4 2.11 / 2.36; batch 8 MXFP4 2.90 / 2.97, NVFP4 2.98 / 3.04; batch 32 MXFP4 4.19 / 4.22, NVFP4
4.30 / 4.31. With the caps raised, MXFP8 weights (tiled past one sequence) lost at batch 8 (3.64 / 3.52) and were
even at 32 (4.78 / 4.79), and 4-bit weights at 128 were mixed (MXFP4 11.74 / 11.76, NVFP4 12.06 / 12.07). In such
a step the attention kernel takes PDL only where its chunks of the cache are one tile (mx_kernels.decode_attention:
at Llama 3 8B dims and 1024 positions, one or two sequences). Nothing else launches with PDL; ``KernelSettings.pdl``
off turns it off in the step too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mx_recipe.infer.attention import decode_attention_append, prefill_attention, use_kernel
from mx_recipe.infer.fused import add_rms_norm, silu_mul
from mx_recipe.infer.gemv import MAX_M as GEMV_MAX_M
from mx_recipe.infer.gemv import apply_linear
from mx_recipe.infer.routing import fits, gate_fits, moe_combine_add_rms_norm, moe_gate_route, moe_route
from mx_recipe.infer.weights import FusedPart, PackedWeight, QuantizedLinear
from mx_recipe.models.llama import Attention, FeedForward, Transformer, apply_rope, project
from mx_recipe.models.moe import MoE
from mx_recipe.ops import get_kernel_settings

PDL_MAX_BATCH = 4  # the kernel step's sequences up to which quantized weights take PDL (module doc)
PDL_MAX_BATCH_TILED = 32  # and up to which tiled 4-bit weights do (mx_recipe.infer.weights.tile_weights)
STOP_CHECK = 8  # generate's decode steps between checks that every sequence has ended (each waits for the GPU)


@dataclass
class ExpertRows:
    """An MoE block's output before its combine: the experts' rows y [T * k, D], each token's ``slots`` [T, k] and
    ``weights``, and the unfolded shared experts' output (or None). The next add + RMSNorm sums them per token
    (``moe_combine_add_rms_norm``), one launch for both."""

    y: torch.Tensor
    slots: torch.Tensor
    weights: torch.Tensor
    shared: torch.Tensor | None


# a residual branch's output for the next add + RMSNorm: [T, D], or its GEMM's fp32 split-K partials [S, T, D] and
# their scale; or an MoE block's expert rows
Branch = tuple[torch.Tensor | None, torch.Tensor | None] | ExpertRows


class KVCache(nn.Module):
    """Keys and values [layers, batch, kv heads, max_len, head dim] in ``dtype``."""

    def __init__(self, model: Transformer, batch: int, max_len: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        args = model.args
        if max_len > args.max_seq_len:
            raise ValueError(f"KVCache: {max_len} positions, past the model's RoPE tables ({args.max_seq_len})")
        shape = (args.n_layers, batch, args.n_kv_heads, max_len, args.head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device))
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device))
        self.max_len = max_len


def _attend(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``attn`` on x [B, S, dim] at ``positions`` ([S], or [B, S]: each sequence's own), writing its keys and
    values into the layer's cache; ``visible`` [(B,) repeats * S, max_len]: the cache positions each stacked query
    sees."""
    bs, seq_len, _ = x.shape
    q, k, v = project(x, attn.wq, attn.wk, attn.wv)
    q = apply_rope(q.view(bs, seq_len, attn.n_heads, attn.head_dim), cos, sin)
    k = apply_rope(k.view(bs, seq_len, attn.n_kv_heads, attn.head_dim), cos, sin)
    v = v.view(bs, seq_len, attn.n_kv_heads, attn.head_dim)
    if positions.dim() == 1:
        k_cache[:, :, positions] = k.transpose(1, 2).to(k_cache.dtype)
        v_cache[:, :, positions] = v.transpose(1, 2).to(v_cache.dtype)
    else:  # [B, S] indices on dims 0 and 2 around a slice: the indexed view is [B, S, kv heads, head dim]
        rows = torch.arange(bs, device=x.device)[:, None]
        k_cache[rows, :, positions] = k.to(k_cache.dtype)
        v_cache[rows, :, positions] = v.to(v_cache.dtype)
    # query head h uses KV head h // repeats: each KV head's queries, [repeats * S] of them, as one head
    repeats = attn.n_heads // attn.n_kv_heads
    q = q.view(bs, seq_len, attn.n_kv_heads, repeats, attn.head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(bs, attn.n_kv_heads, repeats * seq_len, attn.head_dim)
    mask = visible if visible.dim() == 2 else visible[:, None]  # per sequence: broadcast over the KV heads
    out = F.scaled_dot_product_attention(q, k_cache.to(q.dtype), v_cache.to(q.dtype), attn_mask=mask)
    out = out.view(bs, attn.n_kv_heads, repeats, seq_len, attn.head_dim).permute(0, 3, 1, 2, 4)
    return attn.wo(out.reshape(bs, seq_len, -1))


def _ffn(layer: nn.Module) -> nn.Module:
    return layer.moe if getattr(layer, "moe_enabled", False) else layer.feed_forward


def _eps(norm: nn.RMSNorm, dtype: torch.dtype) -> float:
    return norm.eps if norm.eps is not None else torch.finfo(dtype).eps  # nn.RMSNorm's default


def _add_norm(h: torch.Tensor, branch: Branch, norm: nn.RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + the branch's output, its RMSNorm): ``add_rms_norm``, or for an MoE block's expert rows the combine in
    the same launch, which reads their slots before its PDL wait (``routed_early``: the routing kernel ran before
    the experts' GEMMs)."""
    eps = _eps(norm, h.dtype)
    if isinstance(branch, ExpertRows):
        b = branch
        return moe_combine_add_rms_norm(h, b.y, b.slots, b.weights, b.shared, norm.weight, eps, routed_early=True)
    delta, scale = branch
    return add_rms_norm(h, delta, norm.weight, eps, scale)


def _branch(module: nn.Module, x: torch.Tensor) -> Branch:
    """A residual branch's last projection of rows x [T, K], for ``add_rms_norm``: its output, or its GEMM's
    split-K partials and their scale (``QuantizedLinear.partials``)."""
    if isinstance(module, QuantizedLinear):
        return module.partials(x)
    return apply_linear(module, x), None


def _qkv(attn: Attention, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """q, k and v of rows x [T, dim] and None; or, where wq, wk and wv are one fused GEMM that splits K over
    programs, each one's slice of its split-K partials [S, T, N] and their scale (``FusedLinear.partials``), for the
    attention kernel to add."""
    fused = getattr(attn.wq, "fused", None)
    parts = (attn.wq, attn.wk, attn.wv)
    whole = [(fused, i) for i in range(3)]  # wq, wk and wv are parts 0, 1 and 2 of one fused GEMM
    if fused is None or [(getattr(p, "fused", None), getattr(p, "index", None)) for p in parts] != whole:
        return project(x, *parts), None
    y, scale = fused.partials(x)  # the output [T, N] (scale None) where the GEMM does not split K over programs
    return list(y.split(fused.sizes, dim=-1)), scale


def _swiglu_hidden(ffn: FeedForward, x: torch.Tensor) -> torch.Tensor:
    """silu(x w1^T) * (x w3^T): in the gate/up GEMM's epilogue where it takes it, else by ``silu_mul``."""
    fused = ffn.w1.fused if isinstance(ffn.w1, FusedPart) else None
    if fused is not None and getattr(ffn.w3, "fused", None) is fused and fused.swiglu_in_epilogue(x):
        return fused.swiglu(x)
    return silu_mul(*project(x, ffn.w1, ffn.w3))


def _moe_step(moe: MoE, x: torch.Tensor) -> ExpertRows:
    """``moe`` on a decode step's tokens x [T, dim], routed and combined by the fused kernels; shared experts
    folded into the quantized experts (mx_recipe.infer.weights.fuse_projections) run as groups of every token."""
    router = moe.router
    bias = moe.expert_bias.float() if moe.bias_update_speed > 0 else None
    folded = getattr(moe.experts, "shared", 0)
    softmax, gate = router.score_func == "softmax", router.gate
    if type(gate) is nn.Linear and gate.bias is None and gate.weight.dtype == x.dtype and gate_fits(x.shape[0]):
        route = moe_gate_route(x, gate.weight, bias, moe.top_k, softmax, router.route_norm, folded)
    else:
        route = moe_route(gate(x), bias, moe.top_k, softmax, router.route_norm, folded)
    offs, rows, slots, weights = route
    if getattr(moe.experts, "fuses_swiglu", False):
        h = moe.experts.swiglu(x, offs, rows, x_ready=True)  # x came before the routing's launch
    else:
        h = silu_mul(*moe.experts.gate_up(x, offs, rows))
    y = moe.experts.down(h, offs)
    shared = None
    if moe.shared_experts is not None and not folded:
        shared = apply_linear(moe.shared_experts.w2, _swiglu_hidden(moe.shared_experts, x))
    return ExpertRows(y, slots, weights, shared)


def _ffn_step(layer: nn.Module, x: torch.Tensor) -> Branch:
    """The block's feed-forward or MoE on rows x [T, dim] with the fused kernels, where they take it."""
    ffn = _ffn(layer)
    if isinstance(ffn, FeedForward):
        return _branch(ffn.w2, _swiglu_hidden(ffn, x))
    if isinstance(ffn, MoE) and fits(x.shape[0], ffn.n_experts):
        return _moe_step(ffn, x)
    return ffn(x[:, None]).view(x.shape), None


def pdl_pays(model: Transformer, batch: int) -> bool:
    """Whether a kernel step of ``batch`` sequences launches with PDL (module doc): quantized projections, at most
    PDL_MAX_BATCH sequences (PDL_MAX_BATCH_TILED where every one is tiled 4-bit); bf16 ones, at most the GEMV's rows
    (``mx_recipe.infer.gemv.MAX_M``; cuBLAS past them); and ``KernelSettings.pdl`` on."""
    packed = [m for m in model.modules() if isinstance(m, PackedWeight)]
    if not packed:
        most = GEMV_MAX_M
    else:
        most = PDL_MAX_BATCH_TILED if all(p.tiled and p.fmt != "mxfp8" for p in packed) else PDL_MAX_BATCH
    return batch <= most and get_kernel_settings().pdl


def _kernel_step(model: Transformer, tokens: torch.Tensor, position: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """One decode position [B, 1] on a GPU: the same computation as ``forward``'s, its elementwise work and
    attention in the fused kernels (module doc), launched with PDL where ``pdl_pays``."""
    from mx_kernels.pdl import launching  # Triton: the kernel step runs on a GPU only

    with launching(pdl_pays(model, tokens.shape[0])):
        return _layers_step(model, tokens, position, cache)


def _layers_step(model: Transformer, tokens: torch.Tensor, position: torch.Tensor, cache: KVCache) -> torch.Tensor:
    batch = tokens.shape[0]
    h = model.tok_embeddings(tokens).view(batch, -1)
    length = position.view(-1) + 1  # [1], or [B]: each sequence's own
    branch: Branch = (None, None)
    for i, layer in enumerate(model.layers.values()):
        attn = layer.attention
        h, x = _add_norm(h, branch, layer.attention_norm)
        (q, k, v), qkv_scale = _qkv(attn, x)
        heads = (attn.n_kv_heads, attn.n_heads // attn.n_kv_heads, attn.head_dim)
        q = q.view(*q.shape[:-2], batch, *heads)  # no copy: heads split (after the splits of K, if any)
        out = decode_attention_append(q, k, v, model.rope_cos, model.rope_sin, cache.k[i], cache.v[i], length,
                                      qkv_scale=qkv_scale)  # fmt: skip
        h, x = _add_norm(h, _branch(attn.wo, out.view(batch, -1)), layer.ffn_norm)
        branch = _ffn_step(layer, x)
    _, x = _add_norm(h, branch, model.norm)
    return apply_linear(model.output, x).view(batch, 1, -1)


def forward(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
            last: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Logits [B, S, vocab] of ``tokens`` [B, S] at ``positions``, reading and filling ``cache``: [S] (consecutive,
    every sequence), or [B, 1] for one position a sequence, each its own (prompts of different lengths). ``last``
    [B]: only each sequence's row ``last[b]`` of S takes the output layer, [B, 1, vocab] (what sampling reads)."""
    if positions.dim() == 2 and (positions.shape != (tokens.shape[0], 1) or tokens.shape[1] != 1):
        raise ValueError(f"forward: per-sequence positions are [B, 1] for tokens [B, 1], got {tuple(positions.shape)} "
                         f"for {tuple(tokens.shape)}")  # fmt: skip
    if tokens.shape[1] == 1 and use_kernel(tokens.device, model.args.head_dim):
        return _kernel_step(model, tokens, positions, cache)  # S = 1: each sequence's one row is its ``last``
    h = model.tok_embeddings(tokens)
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    # the cache positions each query sees, for the query heads of a KV head stacked: made once for every layer
    visible = torch.arange(cache.max_len, device=tokens.device) <= positions[..., None]
    repeats = model.args.n_heads // model.args.n_kv_heads
    visible = visible.repeat(repeats, 1) if positions.dim() == 1 else visible.repeat(1, repeats, 1)
    for i, layer in enumerate(model.layers.values()):
        x = layer.attention_norm(h)
        h = h + _attend(layer.attention, x, cos, sin, cache.k[i], cache.v[i], positions, visible)
        h = h + _ffn(layer)(layer.ffn_norm(h))
    if last is not None:
        h = h[torch.arange(h.shape[0], device=h.device), last][:, None]
    return model.output(model.norm(h))


def prefill(model: Transformer, prompts: torch.Tensor, cache: KVCache, lengths: torch.Tensor | None = None
            ) -> torch.Tensor:  # fmt: skip
    """Prompts [B, P] into an empty ``cache`` from position 0; the logits [B, vocab] of each one's last token
    (``lengths`` [B]: prompts right-padded to P, each its own length; None: P). Where the decode step takes its
    kernels (``use_kernel``), the prompt's rows go through the step's fused kernels (module doc), its attention
    through ``prefill_attention``; elsewhere ``forward``."""
    batch, length = prompts.shape
    last = torch.full((batch,), length - 1, device=prompts.device) if lengths is None else lengths - 1
    if not use_kernel(prompts.device, model.args.head_dim):
        return forward(model, prompts, torch.arange(length, device=prompts.device), cache, last)[:, 0]
    x = _prefill_rows(model, prompts, cache).view(batch, length, -1)
    return apply_linear(model.output, x[torch.arange(batch, device=x.device), last])


def _prefill_rows(model: Transformer, prompts: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """The final norm's output [B * P, dim] of every prompt position, the caches filled: ``_layers_step``'s
    kernels over every position of the prompts, attention by ``prefill_attention``."""
    batch, length = prompts.shape
    h = model.tok_embeddings(prompts).view(batch * length, -1)
    branch: Branch = (None, None)
    for i, layer in enumerate(model.layers.values()):
        attn = layer.attention
        h, x = _add_norm(h, branch, layer.attention_norm)
        q, k, v = project(x, attn.wq, attn.wk, attn.wv)
        q = q.view(batch, length, attn.n_heads, attn.head_dim)
        k, v = (t.view(batch, length, attn.n_kv_heads, attn.head_dim) for t in (k, v))
        out = prefill_attention(q, k, v, model.rope_cos, model.rope_sin, cache.k[i], cache.v[i])
        h, x = _add_norm(h, _branch(attn.wo, out.view(batch * length, -1)), layer.ffn_norm)
        branch = _ffn_step(layer, x)
    return _add_norm(h, branch, model.norm)[1]


def sample(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
           ) -> torch.Tensor:  # fmt: skip
    """Next tokens [B] from the last position's logits [B, vocab]: greedy at temperature 0, else softmax sampling
    over the ``top_k`` largest (None: all)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class DecodeGraph:
    """One decode step of ``step_fn`` (``forward`` or its compiled form) for ``batch`` sequences, captured in a
    CUDA graph; calling it copies the tokens [B, 1] and position [1] in and replays the graph. Its logits are one
    tensor, overwritten by each replay.

    Building it runs the step on (tokens, position) a few times on a side stream (compiling kernels, allocating
    their buffers, which capture must not do), then captures it: the captured step only rewrites what those runs
    wrote (the cache at ``position``), so calling it on the same inputs next gives that step's logits. It holds the
    model and the cache: the graph reads and writes their memory, which must not go back to the allocator first."""

    def __init__(self, model: Transformer, cache: KVCache, tokens: torch.Tensor, position: torch.Tensor,
                 step_fn: Callable | None = None, warmup: int = 2):  # fmt: skip
        if tokens.device.type != "cuda":
            raise ValueError(f"DecodeGraph: CUDA graphs need CUDA tensors, got {tokens.device}")
        step_fn = step_fn or forward
        self.model, self.cache = model, cache
        self.tokens, self.position = tokens.clone(), position.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step_fn(model, self.tokens, self.position, cache)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = step_fn(model, self.tokens, self.position, cache)

    def __call__(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.position.copy_(position)
        self.graph.replay()
        return self.logits


@dataclass
class Timing:
    prefill_s: float
    decode_s: float
    decode_steps: int  # the timed decode steps: all but the first (compilation, first launches)

    def tokens_per_second(self, batch: int) -> float:
        """Decode tokens/s, all sequences together (0 when no step was timed)."""
        return batch * self.decode_steps / self.decode_s if self.decode_steps else 0.0


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    step_fn: Callable | None = None,
    cuda_graph: bool = False,
    lengths: torch.Tensor | None = None,
    stop_token: int | None = None,
) -> tuple[torch.Tensor, Timing]:
    """Continue ``prompts`` [B, P] by ``max_new_tokens``; returns the new tokens [B, N] and the timing.
    ``lengths`` [B]: prompts of different lengths, each right-padded to P (the padding's tokens are never seen:
    attention is causal, and each sequence's decode overwrites their cache entries before reading them), each
    continued from its own last token as if alone; None: every prompt is P tokens. ``stop_token`` (an EOS): a
    sequence that samples it has ended, and its later tokens are that token too; decoding stops once every sequence
    has ended (checked every STOP_CHECK steps: the check waits for the GPU), so fewer than N tokens may come back.
    ``step_fn``: the decode step (``forward`` by default; e.g. its compiled form); ``cuda_graph``: replay it from a
    CUDA graph (``DecodeGraph``, captured at the first decode step; CUDA only)."""
    batch, prompt_len = prompts.shape
    device = prompts.device
    if lengths is not None and (lengths.shape != (batch,) or not 1 <= lengths.min() <= lengths.max() <= prompt_len):
        raise ValueError(f"generate: lengths must be [B] = [{batch}] values in 1..{prompt_len}, got {lengths.tolist()}")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    cache = KVCache(model, batch, prompt_len + max_new_tokens, dtype, device)
    step_fn = step_fn or forward
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    if lengths is None:
        next_position = torch.tensor([prompt_len], device=device)
    else:
        lengths = lengths.to(device)
        next_position = lengths[:, None]
    out = [sample(prefill(model, prompts, cache, lengths), temperature, top_k, generator)]
    ended = None if stop_token is None else out[-1] == stop_token
    sync()
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    for n in range(1, max_new_tokens):
        if ended is not None and n % STOP_CHECK == 0 and bool(ended.all()):
            break
        if n == 2:  # the first decode step compiled the step function or captured the graph: timed after it
            sync()
            start = time.perf_counter()
        position = next_position + (n - 1)
        if cuda_graph:
            if n == 1:
                graph = DecodeGraph(model, cache, out[-1][:, None], position, step_fn)
            logits = graph(out[-1][:, None], position)
        else:
            logits = step_fn(model, out[-1][:, None], position, cache)
        token = sample(logits[:, -1], temperature, top_k, generator)
        if ended is not None:
            token = token.masked_fill(ended, stop_token)
            ended = ended | (token == stop_token)
        out.append(token)
    sync()
    timed = max(len(out) - 2, 0)
    return torch.stack(out, dim=1), Timing(prefill_s, time.perf_counter() - start if timed else 0.0, timed)
