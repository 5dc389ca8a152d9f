"""Llama 3, torchtitan-style: RMSNorm, RoPE, grouped-query attention through SDPA, SwiGLU.

Plain nn.Modules with torchtitan's parameter names (tok_embeddings, layers.N.attention.wq,
layers.N.feed_forward.w1, norm, output). Nothing here knows about MX: convert_to_mx swaps
the linears afterwards; ``project`` lets linears that read one input share work on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    multiple_of: int  # the FFN hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    vocab_size: int = -1  # set from the tokenizer when the model is built
    max_seq_len: int = 8192

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        # Llama's rule: 2/3 of 4*dim, scaled, rounded up to multiple_of.
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


# Public Llama 3 dims (Llama 3.2 1B, Llama 3.1 8B and 70B); "debug" is a tiny CPU-friendly model.
LLAMA_FLAVORS: dict[str, LlamaArgs] = {
    "debug": LlamaArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, multiple_of=64),
    "1B": LlamaArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, multiple_of=256, ffn_dim_multiplier=1.5),
    "8B": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, multiple_of=1024, ffn_dim_multiplier=1.3),
    "70B": LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, multiple_of=4096, ffn_dim_multiplier=1.3),
}


def rope_tables(head_dim: int, seq_len: int, theta: float, device: torch.device | None = None):
    """cos and sin of the rotation angles, [seq_len, head_dim // 2], in fp32."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of each head, as Meta's complex-number form. x: [B, S, H, D];
    cos, sin: [S', D / 2] (S' >= S: the first S rows, every sequence), or [B, S, D / 2] (a row per sequence)."""
    seq_len = x.shape[1]
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    if cos.dim() == 2:
        cos, sin = cos[:seq_len, None, :], sin[:seq_len, None, :]
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


def project(x: torch.Tensor, *linears: nn.Module) -> list[torch.Tensor]:
    """Each of ``linears`` applied to x. Linears that share work on a common input say how through a static
    ``apply_to_shared_input(x, linears)`` (mx_recipe's MXLinear casts x once for all of them)."""
    shared = getattr(linears[0], "apply_to_shared_input", None)
    if shared is not None and all(type(lin) is type(linears[0]) for lin in linears):
        return shared(x, linears)
    return [lin(x) for lin in linears]


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bs, seq_len, _ = x.shape
        q, k, v = project(x, self.wq, self.wk, self.wv)
        q = q.view(bs, seq_len, self.n_heads, self.head_dim)
        k = k.view(bs, seq_len, self.n_kv_heads, self.head_dim)
        v = v.view(bs, seq_len, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        repeats = self.n_heads // self.n_kv_heads  # grouped-query attention: share each kv head
        k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seq_len, -1))

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1, h3 = project(x, self.w1, self.w3)
        return self.w2(F.silu(h1) * h3)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        # Depth-scaled init of the output projections, as torchtitan.
        self.init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        self.feed_forward.init_weights(self.init_std)


class Transformer(nn.Module):
    """Llama 3 decoder. ``layers`` is a ModuleDict keyed "0".."L-1" (fqns layers.N...), as torchtitan.
    ``block_cls`` builds each layer (the MoE model passes its own)."""

    def __init__(self, args: LlamaArgs, block_cls: type[nn.Module] = TransformerBlock):
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError("LlamaArgs.vocab_size must be set (from the tokenizer) before building the model")
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): block_cls(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialize every parameter and buffer: blocks first, then the rest."""
        for layer in self.layers.values():
            layer.init_weights()
        self.init_root_weights()

    @torch.no_grad()
    def init_rope(self) -> None:
        """Fill the RoPE tables (buffers left out of the state dict: a model materialized from the meta device and
        loaded from a checkpoint needs this too)."""
        cos, sin = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    @torch.no_grad()
    def init_root_weights(self) -> None:
        """Everything outside ``layers``: embeddings, final norm, output and the RoPE tables."""
        self.init_rope()
        nn.init.normal_(self.tok_embeddings.weight)
        self.norm.reset_parameters()
        final_std = self.args.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=final_std, a=-3 * final_std, b=3 * final_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [B, S] int64 -> logits [B, S, vocab]."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))
