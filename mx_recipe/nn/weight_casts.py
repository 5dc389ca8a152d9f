"""MX weight casts made once per optimizer step (``training.cast_weights_once``).

Within a step the weights do not change, yet every use casts them again: each gradient-accumulation
microbatch's forward (w along K) and backward (w along N), and each forward that activation checkpointing
recomputes. ``weight_casts_once(model)`` casts every MX layer's weights in both orientations when the step begins
(one read of each weight where both are one format) and hands those casts to every GEMM of the step, which then
casts no weight; they are dropped when the step ends. They are the casts each GEMM makes on its own, so the step
computes the same bits.

The weights the step computes with must exist before its forward: a model that each rank holds whole
(``mixed_precision``'s compute copies, made once a step). Under FSDP2 the unsharded weights exist only inside
each block's forward and backward, and keeping their casts for the step would hold every layer unsharded.
The cost is memory: the casts of every MX weight stay alive for the whole step (on the emulated backend two
bf16 copies of each weight; fp8 data and scales on the hardware backends).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mx_recipe.nn.convert import MXGroupedExperts
from mx_recipe.nn.linear import MXLinear
from mx_recipe.ops.backends import default_backend


@dataclass(frozen=True)
class WeightCasts:
    """One weight's casts for a step: the operands of its forward (along K) and grad-input (along N) GEMMs, as the
    layer's backend makes them (None for a GEMM in high precision), for inputs of ``dtype``."""

    operands: tuple[Any, Any]
    dtype: torch.dtype


def _casts(layer: nn.Module, w: torch.Tensor, grouped: bool) -> WeightCasts:
    backend = layer.backend or default_backend(layer.recipe, w.device, grouped=grouped)
    return WeightCasts(backend.weight_casts(w, layer.recipe, w.dtype), w.dtype)


def mx_layers(model: nn.Module) -> list[nn.Module]:
    """The MX linears and MX expert groups of ``model``."""
    return [m for m in model.modules() if isinstance(m, MXLinear | MXGroupedExperts)]


@contextlib.contextmanager
def weight_casts_once(model: nn.Module) -> Iterator[None]:
    """Forward and backward inside this block read the weights' casts made when it is entered (the weights must
    not change inside it: the optimizer steps after). Casts are made for the weights' own dtype, which the
    compute dtype inputs share; an input of another dtype casts as usual."""
    layers = mx_layers(model)
    with torch.no_grad():
        for layer in layers:
            if isinstance(layer, MXLinear):
                layer.weight_casts = _casts(layer, layer.weight, grouped=False)
            else:
                layer.weight_casts = {name: _casts(layer, getattr(layer, name), True) for name in ("w1", "w2", "w3")}
    try:
        yield
    finally:
        for layer in layers:
            layer.weight_casts = None
