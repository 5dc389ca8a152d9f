"""Decoding with a static KV cache: prefill the prompts, then one token per sequence a step.

The cache holds every layer's keys and values for ``max_len`` positions, allocated once; each step writes its
positions and attends over the whole cache with a mask that hides the positions not yet written, so every step
after the prefill has the same shapes (one compiled graph). The block's computation is the model's own modules,
called in the order of ``TransformerBlock.forward`` and ``MoEBlock.forward``: attention with the cache in place of
SDPA's causal mask, then the feed-forward or MoE.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mx_recipe.models.llama import Attention, Transformer, apply_rope, project


class KVCache(nn.Module):
    """Keys and values [layers, batch, max_len, kv heads, head dim] in ``dtype``."""

    def __init__(self, model: Transformer, batch: int, max_len: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        args = model.args
        if max_len > args.max_seq_len:
            raise ValueError(f"KVCache: {max_len} positions, past the model's RoPE tables ({args.max_seq_len})")
        shape = (args.n_layers, batch, max_len, args.n_kv_heads, args.head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device))
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device))
        self.max_len = max_len


def _attend(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``attn`` on x [B, S, dim] at ``positions`` [S], writing its keys and values into the layer's cache."""
    bs, seq_len, _ = x.shape
    q, k, v = project(x, attn.wq, attn.wk, attn.wv)
    q = apply_rope(q.view(bs, seq_len, attn.n_heads, attn.head_dim), cos, sin)
    k = apply_rope(k.view(bs, seq_len, attn.n_kv_heads, attn.head_dim), cos, sin)
    k_cache[:, positions] = k.to(k_cache.dtype)
    v_cache[:, positions] = v.view(bs, seq_len, attn.n_kv_heads, attn.head_dim).to(v_cache.dtype)
    repeats = attn.n_heads // attn.n_kv_heads
    keys, values = (c.repeat_interleave(repeats, dim=2).transpose(1, 2) for c in (k_cache, v_cache))
    visible = torch.arange(k_cache.shape[1], device=x.device)[None, :] <= positions[:, None]  # [S, max_len]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype), attn_mask=visible)
    return attn.wo(out.transpose(1, 2).reshape(bs, seq_len, -1))


def forward(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits [B, S, vocab] of ``tokens`` [B, S] at ``positions`` [S] (consecutive), reading and filling ``cache``."""
    h = model.tok_embeddings(tokens)
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    for i, layer in enumerate(model.layers.values()):
        h = h + _attend(layer.attention, layer.attention_norm(h), cos, sin, cache.k[i], cache.v[i], positions)
        ffn = layer.moe if getattr(layer, "moe_enabled", False) else layer.feed_forward
        h = h + ffn(layer.ffn_norm(h))
    return model.output(model.norm(h))


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
) -> tuple[torch.Tensor, Timing]:
    """Continue ``prompts`` [B, P] (one length for all) by ``max_new_tokens``; returns the new tokens [B, N] and the
    timing. ``step_fn``: the decode step (``forward`` by default; e.g. its compiled form)."""
    batch, prompt_len = prompts.shape
    device = prompts.device
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    cache = KVCache(model, batch, prompt_len + max_new_tokens, dtype, device)
    step_fn = step_fn or forward
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    logits = forward(model, prompts, torch.arange(prompt_len, device=device), cache)
    out = [sample(logits[:, -1], temperature, top_k, generator)]
    sync()
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for n in range(1, max_new_tokens):
        if n == 2:  # the first decode step compiled the step function, if compiled: the timing starts after it
            sync()
            start = time.perf_counter()
        position = torch.tensor([prompt_len + n - 1], device=device)
        logits = step_fn(model, out[-1][:, None], position, cache)
        out.append(sample(logits[:, -1], temperature, top_k, generator))
    sync()
    timed = max(max_new_tokens - 2, 0)
    return torch.stack(out, dim=1), Timing(prefill, time.perf_counter() - start if timed else 0.0, timed)
