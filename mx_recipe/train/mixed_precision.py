"""Mixed precision without FSDP2, for a model that each rank holds whole: fp32 master weights, compute copies in
the compute dtype, gradients averaged over the ranks by one all-reduce.

On one device FSDP2 has nothing to shard, and with every rank holding the whole model (HSDP with shard groups of
one rank) nothing to gather, but it still runs its all-gather and reduce-scatter machinery: every step it casts
each weight into an all-gather buffer, copies it out, and in backward copies each gradient into a reduce-scatter
buffer in fp32 and out again, twice over for blocks that reshard after forward: 17 ms of a 78 ms step of the
4-block MoE 16B on an H200, and its hooks keep the step on the host, out of a CUDA graph. ``mixed_precision``
does only what the arithmetic needs, with the numerics of FSDP2's MixedPrecisionPolicy(param_dtype,
reduce_dtype=fp32):

- the parameters stay the model's own fp32 tensors (same names, state dict, checkpoints and optimizer
  as the FSDP2 run: a checkpoint moves between the two);
- ``compute_weights()`` casts them into persistent ``param_dtype`` copies (one foreach copy) and puts
  the copies in their place for forward and backward;
- ``accumulate_grads(first)`` after each microbatch's backward moves the copies' gradients into the
  masters' fp32 ``.grad``: copied for the first microbatch, added after (as FSDP2 accumulates
  unsynchronized microbatches in its reduce dtype);
- the masters' gradients are views of one flat fp32 buffer, allocated once, so that ``all_reduce_grads``
  averages them over the ranks in one collective, and a CUDA graph finds them at the same address each step.

As ``fully_shard`` does, it changes the model's class (``MixedPrecisionModule`` is a mixin), so the
loop asks ``isinstance(model, MixedPrecisionModule)``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn


class MixedPrecisionModule:
    """The mixin that ``mixed_precision`` adds to a model's class."""

    _mp_slots: list[tuple[nn.Module, str, int]]  # (module, parameter name, index into the lists below)
    _mp_masters: list[nn.Parameter]  # fp32, unique
    _mp_compute: list[nn.Parameter]  # param_dtype copies, one per master
    _mp_grads: list[torch.Tensor]  # the masters' gradients: views of _mp_flat_grads
    _mp_flat_grads: torch.Tensor  # fp32

    @contextlib.contextmanager
    def compute_weights(self) -> Iterator[None]:
        """Forward and backward inside this block see the compute copies, freshly cast from the masters."""
        with torch.no_grad():
            torch._foreach_copy_(self._mp_compute, self._mp_masters)
        self._mp_swap(self._mp_compute)
        try:
            yield
        finally:
            self._mp_swap(self._mp_masters)

    def _mp_swap(self, tensors: list[nn.Parameter]) -> None:
        for module, name, i in self._mp_slots:
            module._parameters[name] = tensors[i]

    @torch.no_grad()
    def accumulate_grads(self, first: bool) -> None:
        """Move the compute copies' gradients into the masters' ``.grad`` (fp32): ``first``, a step's first
        microbatch, overwrites them (a parameter without a gradient this microbatch gets zeros); later ones add."""
        masters, compute, grads = self._mp_masters, self._mp_compute, self._mp_grads
        for m, g in zip(masters, grads, strict=True):
            if m.grad is None:  # dropped by zero_grad: the same view again
                m.grad = g
        have = [i for i, c in enumerate(compute) if c.grad is not None]
        if first:
            if len(have) < len(compute):
                self._mp_flat_grads.zero_()
            torch._foreach_copy_([grads[i] for i in have], [compute[i].grad for i in have])
        else:
            torch._foreach_add_([grads[i] for i in have], [compute[i].grad for i in have])
        for i in have:
            compute[i].grad = None

    @torch.no_grad()
    def all_reduce_grads(self) -> None:
        """Average the gradients over the ranks of the default process group (each holds the whole model)."""
        if dist.get_backend() == "nccl":
            dist.all_reduce(self._mp_flat_grads, op=dist.ReduceOp.AVG)
        else:  # gloo has no AVG
            dist.all_reduce(self._mp_flat_grads)
            self._mp_flat_grads.div_(dist.get_world_size())


def mixed_precision(model: nn.Module, param_dtype: torch.dtype, blocks: Iterable[nn.Module] = ()) -> nn.Module:
    """``model`` (parameters materialized in fp32 on one device) computing in ``param_dtype`` over its fp32
    parameters; returned for convenience, changed in place. A parameter shared by two modules gets one copy.
    Each of ``blocks`` gets its floating-point inputs cast to ``param_dtype``, as FSDP2 casts those of each module
    it shards (MixedPrecisionPolicy.cast_forward_inputs): the rotary cos/sin tables reach the blocks in bf16."""
    for block in blocks:
        block.register_forward_pre_hook(functools.partial(_cast_inputs, param_dtype), with_kwargs=True)
    slots, masters, index = [], [], {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            if p.dtype != torch.float32:
                raise ValueError(f"mixed_precision: parameter {name} of {type(module).__name__} is {p.dtype}, not fp32")
            if id(p) not in index:
                index[id(p)] = len(masters)
                masters.append(p)
            slots.append((module, name, index[id(p)]))
    compute = [nn.Parameter(m.detach().to(param_dtype), requires_grad=m.requires_grad) for m in masters]
    flat = torch.zeros(sum(m.numel() for m in masters), dtype=torch.float32, device=masters[0].device)
    grads = [g.view_as(m) for g, m in zip(flat.split([m.numel() for m in masters]), masters, strict=True)]
    cls = model.__class__
    model.__class__ = type(f"MixedPrecision{cls.__name__}", (MixedPrecisionModule, cls), {})
    model._mp_slots, model._mp_masters, model._mp_compute = slots, masters, compute
    model._mp_grads, model._mp_flat_grads = grads, flat
    return model


def _cast_inputs(dtype: torch.dtype, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def compute_weights(model: nn.Module) -> contextlib.AbstractContextManager:
    """The context forward and backward run in: a ``mixed_precision`` model's compute copies, else nothing."""
    return model.compute_weights() if isinstance(model, MixedPrecisionModule) else contextlib.nullcontext()
