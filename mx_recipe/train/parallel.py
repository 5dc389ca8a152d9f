"""Process group, device mesh, activation checkpointing, compile, FSDP2 and its one-device alternative.

Sharded runs train through FSDP2 (HSDP with parallel.dp_replicate). Where a shard group is one rank (one process,
or dp_replicate = world size) each rank holds the whole model (``materialize_unsharded``): the same mixed precision
and gradient averaging without FSDP2's copies, unless parallel.fsdp_on_one_device keeps FSDP2 there too. The
numerics of one GPU and of N GPUs differ only in the order of the gradient reduction. Compute in bf16
(fp32 on a CPU without native bf16 matmul: ``resolve_compute_dtype``) with fp32 master weights and fp32
gradient reduction, through FSDP2's MixedPrecisionPolicy or ``mixed_precision``. The order per block
is torchtitan's: activation checkpointing, then torch.compile, then fully_shard.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from mx_recipe.train.mixed_precision import mixed_precision


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
    """Tear the process group down. With ``barrier`` (a normal end), every rank first waits for the
    others to arrive, then, after destroying its group, for the others to have destroyed theirs: a
    rank that exits closes its gloo sockets, and a peer still inside destroy_process_group could
    abort ("terminate called without an active exception"). After an error there is no barrier:
    the others may be gone."""
    if not dist.is_initialized():
        return
    world_size = dist.get_world_size()
    store = dist.distributed_c10d._get_default_store() if barrier and world_size > 1 else None
    if barrier:
        dist.barrier()
    dist.destroy_process_group()
    if store is not None:
        _wait_for_all(store, "mx_recipe/process_group_destroyed", world_size)


def _wait_for_all(store: dist.Store, key: str, world_size: int, timeout_s: float = 60.0) -> None:
    """A barrier on the rendezvous store (which outlives the process group): count in, wait for
    ``world_size``. The store may be gone once the last rank is through (rank 0 hosts it outside
    torchrun): that, or the timeout, ends the wait, as every rank had counted in by then or is dead."""
    try:
        store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while store.add(key, 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.005)
    except (RuntimeError, dist.DistError):
        pass


def mesh_shape(world_size: int, dp_replicate: int) -> tuple[int, ...]:
    """(shard,) for FSDP; (replicate, shard) for HSDP. Raises ValueError on a bad split."""
    if world_size % dp_replicate:
        raise ValueError(
            f"parallel.dp_replicate = {dp_replicate} does not divide the world size {world_size}: "
            f"HSDP needs world_size = dp_replicate x shard group size"
        )
    return (world_size,) if dp_replicate == 1 else (dp_replicate, world_size // dp_replicate)


def build_mesh(info: DistInfo, dp_replicate: int = 1) -> DeviceMesh:
    """A 1-D ("dp_shard",) mesh, or a 2-D ("dp_replicate", "dp_shard") mesh for HSDP: parameters
    sharded inside each group of world_size / dp_replicate ranks, replicated across groups."""
    shape = mesh_shape(info.world_size, dp_replicate)
    names = ("dp_shard",) if len(shape) == 1 else ("dp_replicate", "dp_shard")
    return init_device_mesh(info.device.type, shape, mesh_dim_names=names)


# Selective AC keeps the outputs of the expensive ops (GEMMs, grouped GEMMs, attention) and
# recomputes the cheap elementwise ones (norms, activations, MX casts) in backward. Ops missing
# from an older torch are left out.
_AC_SAVE_OPS = [
    getattr(torch.ops.aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "_grouped_mm",
        "_scaled_mm",
        "_scaled_grouped_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(torch.ops.aten, name)
]


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Checkpoint every block of ``model.layers``: ``full`` recomputes the whole block in
    backward, ``selective`` recomputes all but the ops of _AC_SAVE_OPS, ``none`` does nothing.

    The block's ``forward`` is replaced in place (no wrapper module), so parameter names and
    checkpoints are the same for every mode.
    """
    if mode == "none":
        return
    if mode not in ("selective", "full"):
        raise ValueError(f"unknown activation checkpointing mode {mode!r}; known: none, selective, full")
    if mode == "selective":
        context_fn = functools.partial(create_selective_checkpoint_contexts, _AC_SAVE_OPS)
    else:
        context_fn = noop_context_fn
    for block in model.layers.values():
        block.forward = _checkpointed(block.forward, context_fn)


def _checkpointed(forward: Callable, context_fn: Callable) -> Callable:
    # A plain function of this file, not a functools.partial of checkpoint: torch.compile starts
    # tracing at this frame and turns checkpoint into its graph op (it does not trace into
    # checkpoint when that is the outermost frame).
    def checkpointed_forward(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return checkpointed_forward


def apply_compile(model: nn.Module, mode: str = "default") -> None:
    """torch.compile each block in place (``nn.Module.compile``: same names, same state dict) in ``mode``."""
    for block in model.layers.values():
        block.compile(mode=None if mode == "default" else mode)


COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively: ATen's vector capability is AVX512 and the CPU has
    AVX512-BF16 or AMX. Without them (AVX2, ARM, others) a bf16 matmul has no native kernel and runs
    16-33x slower than in fp32. Decided from the CPU's flags, not by timing, so every run on one machine
    decides alike; ``ATEN_CPU_CAPABILITY=avx2`` lowers the capability and so gives False."""
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith("AVX512"):
        return False
    flags = (getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return any(flag is not None and flag() for flag in flags)


def resolve_compute_dtype(name: str, device: torch.device) -> str:
    """``training.compute_dtype`` on ``device``, "bf16" or "fp32" (a key of COMPUTE_DTYPES): as named, and
    "auto" is bf16 on CUDA and on a CPU with native bf16 matmul (``cpu_has_native_bf16``), else fp32."""
    if name == "auto":
        return "bf16" if device.type == "cuda" or cpu_has_native_bf16() else "fp32"
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"unknown compute dtype {name!r}; known: auto, {', '.join(COMPUTE_DTYPES)}")
    return name


def _materialize(model: nn.Module, device: torch.device, shard_block: Callable[[int, nn.Module], None]) -> None:
    """Materialize a model built on the meta device on ``device`` and initialize it, block by block and then the
    root, in one order whatever happens to each block after (``shard_block``), so that every rank and every
    world size draws the same initial weights from the same seed."""
    for i, block in enumerate(model.layers.values()):
        block.to_empty(device=device)
        block.init_weights()
        shard_block(i, block)
    for name, child in model.named_children():
        if name != "layers":
            child.to_empty(device=device)
    model.to_empty(device=device, recurse=False)
    model.init_root_weights()


@torch.no_grad()
def materialize_unsharded(model: nn.Module, info: DistInfo, param_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A model built on the meta device on ``info.device``, whole on every rank, computing in ``param_dtype`` over
    fp32 master weights (``mixed_precision``). The same initial weights and numerics as ``materialize_and_shard``
    with shard groups of one rank (one device, or HSDP with dp_replicate = world size), without FSDP2's copies."""
    _materialize(model, info.device, lambda i, block: None)
    return mixed_precision(model, param_dtype, model.layers.values())


@torch.no_grad()
def materialize_and_shard(
    model: nn.Module,
    info: DistInfo,
    mesh: DeviceMesh | None = None,
    param_dtype: torch.dtype = torch.bfloat16,
    reshard_after_forward: bool = True,
) -> DeviceMesh:
    """Turn a model built on the meta device into an FSDP2 model on ``info.device`` that computes in
    ``param_dtype`` (``resolve_compute_dtype``) over fp32 master weights.

    Each block is materialized in full, initialized, then sharded with ``fully_shard``, one at a
    time; then the root (embeddings, final norm, output). Every rank draws the same full values
    from the same seed, so the initial weights do not depend on the world size, and no rank ever
    holds more than one full block. ``mesh`` defaults to a 1-D mesh over all ranks; a 2-D mesh
    (build_mesh with dp_replicate > 1) gives HSDP.
    """
    mesh = mesh if mesh is not None else build_mesh(info)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    n_blocks = len(model.layers)

    def shard_block(i: int, block: nn.Module) -> None:
        # The last block's parameters are gathered again at once by backward: keep them.
        reshard = reshard_after_forward and i < n_blocks - 1
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard)

    _materialize(model, info.device, shard_block)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    return mesh


def reshard(model: nn.Module) -> None:
    """Free every FSDP module's gathered parameters (a forward without backward, as in
    evaluation, leaves some gathered)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)  # gloo has no AVG
    return value / dist.get_world_size()
