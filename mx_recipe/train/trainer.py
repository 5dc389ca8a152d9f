"""The training loop: build, convert to MX, shard, train, log."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mx_recipe.convert import convert_to_mx, format_conversion_table
from mx_recipe.models import build_model, flops_per_token, model_args, moe_layers
from mx_recipe.recipe import MXRecipe
from mx_recipe.train.config import Config, config_to_toml
from mx_recipe.train.data import build_datasets
from mx_recipe.train.metrics import MetricsLogger
from mx_recipe.train.parallel import DistInfo, all_reduce_mean, materialize_and_shard


def lr_lambda(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at ``step`` (1-based): linear warmup, then cosine decay to min_lr_ratio."""
    if step <= warmup_steps:
        return step / max(warmup_steps, 1)
    progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


@torch.no_grad()
def update_expert_biases(model: torch.nn.Module) -> None:
    """Auxiliary-loss-free load balancing: one bias update per step from the global expert loads."""
    layers = [m for m in moe_layers(model) if m.bias_update_speed > 0]
    if not layers:
        return
    loads = torch.stack([m.tokens_per_expert for m in layers])
    torch.distributed.all_reduce(loads)  # every rank applies the same update
    for m, load in zip(layers, loads, strict=True):
        m.update_expert_bias(load)


def padded_vocab_size(vocab_size: int, multiple: int = 64) -> int:
    return multiple * math.ceil(vocab_size / multiple)


def train(config: Config, info: DistInfo) -> list[dict]:
    """Run ``config`` on this rank; returns the logged records (identical on every rank)."""
    log = print if info.is_main else (lambda *a, **k: None)
    t = config.training
    output_dir = Path(config.job.output_dir)
    if info.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.toml").write_text(config_to_toml(config))

    data = build_datasets(config, info.rank, info.world_size)
    tokenizer = data.tokenizer

    torch.manual_seed(config.job.seed)
    args = model_args(config.model.name, config.model.flavor, padded_vocab_size(tokenizer.vocab_size), t.seq_len)
    with torch.device("meta"):
        model = build_model(args)
    if config.mx.recipe != "none":
        recipe = MXRecipe.from_name(config.mx.recipe, backend=config.mx.backend)
        records = convert_to_mx(model, recipe, skip=config.mx.skip, log=False)
        log(format_conversion_table(records))
    num_params = sum(p.numel() for p in model.parameters())
    torch.manual_seed(config.job.seed)  # the same initial weights on every world size
    materialize_and_shard(model, info)
    log(
        f"model {config.model.name} {config.model.flavor}: {num_params / 1e6:.1f}M parameters, "
        f"mx recipe {config.mx.recipe}, {info.world_size} x {info.device.type}, "
        f"global batch {t.local_batch_size * info.world_size} x {t.seq_len} tokens"
    )

    optimizer = torch.optim.AdamW(
        model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: lr_lambda(i + 1, t.warmup_steps, t.steps, t.min_lr_ratio)
    )
    metrics = MetricsLogger(output_dir, info.device, flops_per_token(args, model, t.seq_len), info.is_main)
    records: list[dict] = []
    for step in range(1, t.steps + 1):
        inputs, targets = (b.to(info.device, non_blocking=True) for b in data.train.next_batch())
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())  # loss in fp32
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm if t.max_norm > 0 else math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        update_expert_biases(model)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        metrics.add_tokens(inputs.numel())
        if step % config.metrics.log_freq == 0 or step == 1 or step == t.steps:
            global_loss = all_reduce_mean(loss).item()
            if not math.isfinite(global_loss):
                raise FloatingPointError(f"loss is {global_loss} at step {step}")
            if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
                grad_norm = grad_norm.full_tensor()
            extra = {"lr": lr, "grad_norm": grad_norm.item()}
            records.append(metrics.log(step, global_loss, extra))
    log(f"done: {t.steps} steps in {time.perf_counter() - metrics.start:.1f} s, metrics in {metrics.path}")
    return records
