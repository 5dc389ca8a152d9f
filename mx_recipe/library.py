"""The ``mx_recipe`` op namespace: the one ``torch.library.Library`` and ``define``, through which every custom op
of the project is made (``torch.ops.mx_recipe.<name>``: the MX and NVFP4 casts, ``mx_gemm``, ``uniform_like``).

It imports only torch, so that ``formats`` defines its op here without importing ``ops``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# torch.library.Library rather than torch.library.custom_op: the same dispatcher op, but custom_op's wrappers
# (autograd checks, alias checks) cost about 28 us a call on an H200 host, more than a kernel launch.
LIB = torch.library.Library("mx_recipe", "FRAGMENT")

# The kernels' dispatch keys. CPU: the Triton interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors in
# tests; the launchers refuse them otherwise.
KERNEL_KEYS = ("CUDA", "CPU")


def define(
    schema: str,
    kernel: Callable,
    fake: Callable,
    keys: Sequence[str] = KERNEL_KEYS,
    tags: Sequence[torch.Tag] = (),
) -> None:
    """Define ``torch.ops.mx_recipe.<name>`` from ``schema`` ("name(args) -> outputs"): ``kernel`` under each
    dispatch key of ``keys``, ``fake`` (shapes only) for tracing, so that torch.compile traces the op as an opaque
    node without Triton or a GPU. Every op is tagged pt2-compliant; ``tags`` adds to that."""
    name = schema.split("(")[0]
    LIB.define(schema, tags=(torch.Tag.pt2_compliant_tag, *tags))
    for key in keys:
        LIB.impl(name, kernel, key)
    torch.library.register_fake(f"mx_recipe::{name}", fake, lib=LIB)
