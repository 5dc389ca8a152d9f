"""A token-choice mixture-of-experts decoder beside Llama: top-k router (softmax or sigmoid),
optional shared experts, routed experts as 3D weights run through ``torch._grouped_mm``,
auxiliary-loss-free load balancing (DeepSeek-V3's expert bias), dense and MoE layers
interleaved as configured.

Expert weights follow the grouped-GEMM convention of docs/DESIGN.md (MoE grouped GEMMs): w1, w3: [E, hidden, dim] and
w2: [E, dim, hidden]; group e computes x_e @ w[e].T. Nothing here knows about MX: the
converter swaps ``GroupedExperts`` for its MX version.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mx_recipe.models.llama import Attention, FeedForward, LlamaArgs


@dataclass(frozen=True)
class MoEArgs(LlamaArgs):
    n_routed_experts: int = 8
    top_k: int = 2
    n_shared_experts: int = 0
    moe_hidden_dim: int = 256  # hidden size of each routed (and shared) expert
    dense_hidden_dim: int = 0  # hidden size of the dense layers' FFN (0: Llama's rule)
    n_dense_layers: int = 0  # the first layers are dense
    moe_every: int = 1  # after those, every n-th layer is MoE
    score_func: str = "softmax"  # or "sigmoid"
    route_norm: bool = False  # renormalize the top-k scores to sum to 1
    bias_update_speed: float = 1e-3  # auxiliary-loss-free balancing; 0 turns it off

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.n_dense_layers and (layer_id - self.n_dense_layers) % self.moe_every == 0

    @property
    def ffn_hidden_dim(self) -> int:
        return self.dense_hidden_dim or LlamaArgs.ffn_hidden_dim.fget(self)


# Public configs: DeepSeek-MoE 16B (deepseek-ai/deepseek-moe-16b-base) and a Llama 4 Scout-like
# model (meta-llama/Llama-4-Scout-17B-16E: its dims, without chunked attention, NoPE or QK norm).
MOE_FLAVORS: dict[str, MoEArgs] = {
    "debug_moe": MoEArgs(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, multiple_of=64, n_routed_experts=8, top_k=2,
        n_shared_experts=1, moe_hidden_dim=128, n_dense_layers=1,
    ),
    # About 0.9B parameters (0.2B active): 16 routed experts top-2 and a shared one, for parity runs
    # that fit one GPU (configs/parity_moe1b.toml).
    "moe_1B": MoEArgs(
        dim=1024, n_layers=16, n_heads=16, n_kv_heads=8, multiple_of=64, n_routed_experts=16, top_k=2,
        n_shared_experts=1, moe_hidden_dim=1024, n_dense_layers=1,
    ),
    "moe_16B": MoEArgs(
        dim=2048, n_layers=28, n_heads=16, n_kv_heads=16, multiple_of=64, rope_theta=10000.0, norm_eps=1e-6,
        n_routed_experts=64, top_k=6, n_shared_experts=2, moe_hidden_dim=1408, dense_hidden_dim=10944,
        n_dense_layers=1,
    ),
    "moe_scout": MoEArgs(
        dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, multiple_of=64, rope_theta=500000.0,
        n_routed_experts=16, top_k=1, n_shared_experts=1, moe_hidden_dim=8192, dense_hidden_dim=16384,
        score_func="sigmoid",
    ),
}  # fmt: skip


class GroupedExperts(nn.Module):
    """E SwiGLU experts as 3D weights; tokens arrive sorted by expert with cumulative ends ``offs``."""

    def __init__(self, n_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))

    def grouped_mm(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """x [M_total, K] by w [E, N, K] per group -> [M_total, N]. MX experts override this."""
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    def grouped_mm_on_one_input(
        self, x: torch.Tensor, ws: tuple[torch.Tensor, ...], offs: torch.Tensor, routed: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """``[grouped_mm(x[routed], w, offs) for w in ws]`` (x itself where ``routed`` is None): MX experts override it
        to cast the routed rows once for all, from x."""
        if routed is not None:
            x = x[routed]
        return [self.grouped_mm(x, w, offs) for w in ws]

    def gate_up(self, x: torch.Tensor, offs: torch.Tensor, routed: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The gate and up projections (w1, w3) of the groups, x or x[routed] as ``forward`` takes them."""
        y1, y3 = self.grouped_mm_on_one_input(x, (self.w1, self.w3), offs, routed)
        return y1, y3

    def down(self, h: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """The down projection (w2) of the groups' hidden rows h [M_total, hidden]."""
        return self.grouped_mm(h, self.w2, offs)

    def forward(self, x: torch.Tensor, offs: torch.Tensor, routed: torch.Tensor | None = None) -> torch.Tensor:
        """x [M_total, dim] sorted by expert; or the tokens [T, dim] and ``routed`` [M_total], the token of each row
        of the groups (the groups are x[routed])."""
        y1, y3 = self.gate_up(x, offs, routed)
        return self.down(F.silu(y1) * y3, offs)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w, mean=0.0, std=init_std)


class TokenChoiceRouter(nn.Module):
    """Scores every expert for every token and keeps the top k. The gate runs in the compute dtype (bf16 or
    fp32; mx.skip keeps it out of MX by default), the scores in fp32."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.gate = nn.Linear(args.dim, args.n_routed_experts, bias=False)
        self.top_k, self.score_func, self.route_norm = args.top_k, args.score_func, args.route_norm

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None):
        """x [T, dim] -> (scores [T, k] fp32, expert indices [T, k])."""
        logits = self.gate(x).float()
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        # The balancing bias steers which experts are chosen, never how much they weigh.
        choice = scores if expert_bias is None else scores + expert_bias
        _, idx = choice.topk(self.top_k, dim=-1)
        top_scores = scores.gather(-1, idx)
        if self.route_norm:
            top_scores = top_scores / top_scores.sum(dim=-1, keepdim=True)
        return top_scores, idx


class MoE(nn.Module):
    def __init__(self, args: MoEArgs):
        super().__init__()
        self.n_experts, self.top_k = args.n_routed_experts, args.top_k
        self.router = TokenChoiceRouter(args)
        self.experts = GroupedExperts(args.n_routed_experts, args.dim, args.moe_hidden_dim)
        self.shared_experts = (
            FeedForward(args.dim, args.moe_hidden_dim * args.n_shared_experts) if args.n_shared_experts else None
        )
        self.bias_update_speed = args.bias_update_speed
        self.register_buffer("expert_bias", torch.zeros(args.n_routed_experts), persistent=True)
        # Tokens each expert received since the last bias update (summed over microbatches).
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_routed_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores, idx = self.router(x, self.expert_bias if self.bias_update_speed > 0 else None)
        flat_idx = idx.flatten()
        # A fixed-size count (bincount's size depends on the data, which breaks torch.compile graphs).
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat_idx, torch.ones_like(flat_idx)
        )
        with torch.no_grad():
            self.tokens_per_expert.add_(counts.to(self.tokens_per_expert.dtype))
        # Sort the (token, choice) pairs by expert: a stable sort keeps token order inside a group.
        order = flat_idx.argsort(stable=True)
        token_ids = order // self.top_k
        offs = counts.cumsum(0).to(torch.int32)
        routed = self.experts(x, offs, token_ids)  # the groups are x[token_ids]
        routed = routed * scores.flatten()[order].unsqueeze(-1).to(routed.dtype)
        out = torch.zeros_like(x).index_add_(0, token_ids, routed)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.reshape(shape)

    @torch.no_grad()
    def update_expert_bias(self, global_tokens_per_expert: torch.Tensor) -> None:
        """Auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower the others'."""
        load = global_tokens_per_expert.float()
        self.expert_bias.add_(self.bias_update_speed * torch.sign(load.mean() - load))
        self.expert_bias.sub_(self.expert_bias.mean())
        self.tokens_per_expert.zero_()

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.router.gate.weight, mean=0.0, std=init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()


class MoEBlock(nn.Module):
    def __init__(self, layer_id: int, args: MoEArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = args.is_moe_layer(layer_id)
        if self.moe_enabled:
            self.moe = MoE(args)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        (self.moe if self.moe_enabled else self.feed_forward).init_weights(self.init_std)
