"""Mixed precision on one device without FSDP2: fp32 master weights, compute copies in bf16.

On one device FSDP2 has nothing to shard, but it still runs its all-gather and reduce-scatter
machinery: every step it casts each weight into an all-gather buffer, copies it out, and in backward
copies each gradient into a reduce-scatter buffer in fp32 and out again, twice over for blocks that
reshard after forward. On a 2-billion-parameter MoE that is about 70 GB of copies a step (17 ms on
an H200). ``mixed_precision`` does only what the arithmetic needs, with the same numerics as FSDP2's
MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32) at world size 1:

- the parameters stay the model's own fp32 tensors (same names, state dict, checkpoints and optimizer
  as the FSDP2 run: a checkpoint moves between the two);
- ``compute_weights()`` casts them into persistent ``param_dtype`` copies (one foreach copy) and puts
  the copies in their place for forward and backward;
- ``accumulate_grads(first)`` after each microbatch's backward moves the copies' gradients into the
  masters' fp32 ``.grad``: copied for the first microbatch, added after (as FSDP2 accumulates
  unsynchronized microbatches in its reduce dtype).

As ``fully_shard`` does, it changes the model's class (``MixedPrecisionModule`` is a mixin), so the
loop asks ``isinstance(model, MixedPrecisionModule)``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator

import torch
from torch import nn


class MixedPrecisionModule:
    """The mixin that ``mixed_precision`` adds to a model's class."""

    _mp_slots: list[tuple[nn.Module, str, int]]  # (module, parameter name, index into the lists below)
    _mp_masters: list[nn.Parameter]  # fp32, unique
    _mp_compute: list[nn.Parameter]  # param_dtype copies, one per master

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
        microbatch, overwrites them (a master with no ``.grad`` gets one); later ones add to them."""
        pairs = [(m, c) for m, c in zip(self._mp_masters, self._mp_compute, strict=True) if c.grad is not None]
        if first:
            for m, _ in pairs:
                if m.grad is None:
                    m.grad = torch.empty_like(m)
            torch._foreach_copy_([m.grad for m, _ in pairs], [c.grad for _, c in pairs])
        else:
            for m, _ in pairs:
                if m.grad is None:  # a parameter that got no gradient from the earlier microbatches
                    m.grad = torch.zeros_like(m)
            torch._foreach_add_([m.grad for m, _ in pairs], [c.grad for _, c in pairs])
        for _, c in pairs:
            c.grad = None


def mixed_precision(model: nn.Module, param_dtype: torch.dtype, blocks: Iterable[nn.Module] = ()) -> nn.Module:
    """``model`` (parameters materialized in fp32 on their device) computing in ``param_dtype`` over its fp32
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
    cls = model.__class__
    model.__class__ = type(f"MixedPrecision{cls.__name__}", (MixedPrecisionModule, cls), {})
    model._mp_slots, model._mp_masters, model._mp_compute = slots, masters, compute
    return model


def _cast_inputs(dtype: torch.dtype, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def compute_weights(model: nn.Module) -> contextlib.AbstractContextManager:
    """The context forward and backward run in: a ``mixed_precision`` model's compute copies, else nothing."""
    return model.compute_weights() if isinstance(model, MixedPrecisionModule) else contextlib.nullcontext()
