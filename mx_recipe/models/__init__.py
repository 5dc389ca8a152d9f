"""Model definitions (plain nn.Modules) and the flavor registry."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from mx_recipe.models.llama import LLAMA_FLAVORS, LlamaArgs, Transformer

MODEL_FLAVORS: dict[str, dict[str, LlamaArgs]] = {"llama": LLAMA_FLAVORS}


def model_args(name: str, flavor: str, vocab_size: int, max_seq_len: int) -> LlamaArgs:
    if name not in MODEL_FLAVORS:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(MODEL_FLAVORS)}")
    flavors = MODEL_FLAVORS[name]
    if flavor not in flavors:
        raise ValueError(f"unknown {name} flavor {flavor!r}; expected one of {sorted(flavors)}")
    return replace(flavors[flavor], vocab_size=vocab_size, max_seq_len=max_seq_len)


def build_model(args: LlamaArgs) -> nn.Module:
    return Transformer(args)


def flops_per_token(args: LlamaArgs, num_params: int, seq_len: int) -> float:
    """Training FLOPs per token, as torchtitan: 6 * non-embedding params + causal attention's 12*L*H*D*S."""
    embedding_params = args.vocab_size * args.dim
    return 6 * (num_params - embedding_params) + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
