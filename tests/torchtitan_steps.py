"""A few training steps of a torchtitan debug model converted by our torchtitan converters, on the CPU, with
torchtitan's own activation checkpointing, per-block torch.compile and FSDP2 (``apply_fsdp_to_decoder``) over
a gloo group when started by torchrun. Rank 0 prints the losses as one JSON line. Used by
tests/test_torchtitan.py; torchtitan's Trainer itself needs CUDA (it calls torch.cuda.set_device).

    [torchrun --nproc_per_node 2] tests/torchtitan_steps.py CONFIG [--ac] [--compile] [--fsdp] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torchtitan.config import CompileConfig, ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder, disable_fsdp_gradient_division
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

from mx_recipe.integrations.torchtitan.converters import _replace

MODULE = "mx_recipe.integrations.torchtitan"
BATCH, SEQ = 4, 64


def cpu_model_config(config_name: str, n_layers: int = 2):
    """The model config of our registry's ``config_name``, first ``n_layers`` blocks, with SDPA for flex
    attention (flex attention has no backward on the CPU)."""
    trainer_config = ConfigManager().parse_args(["--module", MODULE, "--config", config_name])
    model_config = trainer_config.model_spec.model
    model_config.layers = model_config.layers[:n_layers]
    for _, _, parent, attr in list(model_config.traverse(FlexAttention.Config)):
        model_config = _replace(model_config, parent, attr, ScaledDotProductAttention.Config())
    return model_config


def build(model_config, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = model_config.build()
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=None)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--ac", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if args.fsdp:
        dist.init_process_group("gloo")
    model = build(cpu_model_config(args.config))
    if args.ac:
        SelectiveAC.Config().build().apply(model)
    if args.compile:
        parallel_dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, world_size=world)
        apply_compile(model, compile_config=CompileConfig(enable=True), parallel_dims=parallel_dims)
    if args.fsdp:
        mesh = dist.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        apply_fsdp_to_decoder(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, pp_enabled=False)
        disable_fsdp_gradient_division(model)  # as torchtitan's trainer does: gradients are summed over ranks
        for module in model.modules():  # gloo has no PREMUL_SUM, which FSDP2 would use for that sum
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab = model.tok_embeddings.weight.shape[0]
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(args.steps):
        tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=generator)
        shard = tokens.chunk(world)[rank]  # each rank its rows of the global batch
        logits = model(shard[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), shard[:, 1:].flatten())
        (loss / world).backward()  # summed over the ranks: the gradient of the global batch's mean loss
        optimizer.step()
        optimizer.zero_grad()
        if args.fsdp:
            dist.all_reduce(loss := loss.detach().clone())
            loss /= world
        losses.append(loss.item())
    if rank == 0:
        print(json.dumps({"losses": losses}))
    if args.fsdp:  # both ranks done before teardown: a gloo pair closed under its peer can abort the process
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
