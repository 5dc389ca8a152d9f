"""How many bytes autograd saves for backward: the activation memory an MX option changes."""

from __future__ import annotations

import torch
from torch import nn


def saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd saves for backward in one forward of ``module``, its parameters not counted
    (a saved weight is the parameter itself, no extra memory). Run it eagerly: under torch.compile
    AOTAutograd decides what to save."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if t.untyped_storage().data_ptr() not in params:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return total
