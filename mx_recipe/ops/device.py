"""The one device probe: the compute capability of an NVIDIA GPU, by which the ops pick a kernel (``dispatch``), the
NVFP4 ops their Triton kernel, and ``gemm`` a GEMM backend; and the memory a device offers (``memory_bytes``), by
which train.py and generate.py refuse a model that cannot fit before building it.

``pretend_capability`` makes every CUDA device report a given capability: what would run on that GPU, on any
machine (the tests of the rule and of backend selection, and the README's device table).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

_CAPABILITIES: dict[int, tuple[int, int] | None] = {}
_PRETENDED: list[tuple[int, int] | None] = []  # pretend_capability's, innermost last


def capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of the NVIDIA GPU ``device``; None for anything else: CPU, meta, no CUDA, and ROCm, whose
    capabilities (MI300: 9.4) mean something else.

    Probed once per device and kept in a dict rather than a functools cache: Dynamo traces this inside compiled
    layers, and warns at every cache wrapper it steps through.
    """
    if device.type != "cuda":
        return None
    if _PRETENDED:
        return _PRETENDED[-1]
    index = device.index
    if index is None:
        if not torch.cuda.is_available():
            return None
        index = torch.cuda.current_device()
    if index not in _CAPABILITIES:
        cap = None
        if torch.cuda.is_available() and torch.version.hip is None:
            props = torch.cuda.get_device_properties(index)  # Dynamo constant-folds this one
            cap = (props.major, props.minor)
        _CAPABILITIES[index] = cap
    return _CAPABILITIES[index]


@contextlib.contextmanager
def pretend_capability(cap: tuple[int, int] | None) -> Iterator[None]:
    """Inside the block every CUDA device reports compute capability ``cap`` (None: not an NVIDIA GPU), whatever
    the machine holds: the GEMM backend ``backends.resolve_backend`` picks for a CUDA device, and the kernel the rule
    picks for a CUDA tensor, are what they would be on that GPU. Tensors keep their device: CPU ones still take
    the references. (``backends.default_backend`` keeps in its eager cache what it resolves inside the block.)"""
    _PRETENDED.append(cap)
    try:
        yield
    finally:
        _PRETENDED.pop()


def memory_bytes(device: torch.device) -> int:
    """The memory ``device`` offers: a CUDA GPU's total, else the host's physical memory (what every process of the
    host shares)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def shortfall(need: int, device: torch.device, what: str) -> str | None:
    """None where ``need`` bytes fit in ``device``'s memory (``memory_bytes``), else one line saying ``what`` needs
    them and how much there is."""
    have = memory_bytes(device)
    if need <= have:
        return None
    where = f"{torch.cuda.get_device_name(device)}'s" if device.type == "cuda" else "host's"
    return f"{what} needs at least {_size(need)}, more than this {where} {_size(have)}"


def _size(n: int) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"
