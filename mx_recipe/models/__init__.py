"""Model definitions (plain nn.Modules) and the flavor registry."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from mx_recipe.models.llama import LLAMA_FLAVORS, LlamaArgs, Transformer
from mx_recipe.models.moe import MOE_FLAVORS, GroupedExperts, MoE, MoEArgs, MoEBlock

MODEL_FLAVORS: dict[str, dict[str, LlamaArgs]] = {"llama": LLAMA_FLAVORS, "moe": MOE_FLAVORS}


def model_args(name: str, flavor: str, vocab_size: int, max_seq_len: int) -> LlamaArgs:
    if name not in MODEL_FLAVORS:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(MODEL_FLAVORS)}")
    flavors = MODEL_FLAVORS[name]
    if flavor not in flavors:
        raise ValueError(f"unknown {name} flavor {flavor!r}; expected one of {sorted(flavors)}")
    return replace(flavors[flavor], vocab_size=vocab_size, max_seq_len=max_seq_len)


def build_model(args: LlamaArgs) -> Transformer:
    return Transformer(args, block_cls=MoEBlock) if isinstance(args, MoEArgs) else Transformer(args)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def flops_per_token(args: LlamaArgs, model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token, as torchtitan: 6 x the parameters a token meets (embeddings
    excluded; of the routed experts only top_k of E) + causal attention's 12 * L * H * D * S."""
    params = sum(p.numel() for p in model.parameters()) - args.vocab_size * args.dim
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            n_experts = module.w2.shape[0]  # w1 and w3 may be fused (mx_recipe.infer.weights)
            routed = sum(p.numel() for p in module.parameters())
            params -= routed * (1 - args.top_k / n_experts)
    return 6 * params + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
