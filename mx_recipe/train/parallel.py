"""Process group, device and FSDP2.

Every run, one process included, goes through FSDP2 on a 1-D mesh: the numerics of one GPU
and of N GPUs then differ only in the order of the gradient reduction. bf16 compute with fp32
master weights and fp32 gradient reduction, through FSDP2's MixedPrecisionPolicy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> DistInfo:
    """NCCL on CUDA, gloo on CPU. Under torchrun from its environment, else a 1-process group."""
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    if "RANK" in os.environ:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(backend, device_id=device if use_cuda else None)
    else:
        rank, local_rank, world_size = 0, 0, 1
        device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistInfo(rank, local_rank, world_size, device)


def destroy_distributed(barrier: bool = True) -> None:
    if dist.is_initialized():
        # Without a barrier a fast rank tears gloo down under a slow one ("terminate called
        # without an active exception"). After an error there is none: the others may be gone.
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


@torch.no_grad()
def materialize_and_shard(model: nn.Module, info: DistInfo, param_dtype: torch.dtype = torch.bfloat16) -> DeviceMesh:
    """Turn a model built on the meta device into an FSDP2 model on ``info.device``.

    Each block is materialized in full, initialized, then sharded with ``fully_shard``, one at a
    time; then the root (embeddings, final norm, output). Every rank draws the same full values
    from the same seed, so the initial weights do not depend on the world size, and no rank ever
    holds more than one full block.
    """
    mesh = init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("dp_shard",))
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    layers = list(model.layers.values())
    for i, block in enumerate(layers):
        block.to_empty(device=info.device)
        block.init_weights()
        # The last block's parameters are gathered again at once by backward: keep them.
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=i < len(layers) - 1)
    for name, child in model.named_children():
        if name != "layers":
            child.to_empty(device=info.device)
    model.to_empty(device=info.device, recurse=False)
    model.init_root_weights()
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return mesh


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)  # gloo has no AVG
    return value / dist.get_world_size()
