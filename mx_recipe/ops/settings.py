"""How the ops use the kernels: one process-wide ``KernelSettings``, read from a module-level object at each call
(no environment variable), set with ``set_kernel_settings`` or, for a block, ``kernel_settings``::

    with mx_recipe.ops.kernel_settings(gluon=False):  # the Triton kernels on Hopper too
        y = cast_dim0(x)
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class KernelSettings:
    """gluon: the Gluon kernels on Hopper (False: the Triton kernels there too, the same bits; for benchmarks and
    bisection). launch_cache: launches go through ``mx_kernels.launch_cache`` (False: every launch through
    Triton's JIT). pdl: a decode step may launch its kernels with programmatic dependent launch on sm_90+ where it
    pays (``mx_recipe.infer.decode.pdl_pays``; False: plain launches, for measuring with and without).
    check_offs: ``mx_grouped_mm`` checks its group ends on the host for GPU tensors too (a device sync per call;
    for debugging)."""

    gluon: bool = True
    launch_cache: bool = True
    pdl: bool = True
    check_offs: bool = False


_settings = KernelSettings()


def get_kernel_settings() -> KernelSettings:
    """The settings in force."""
    return _settings


def set_kernel_settings(settings: KernelSettings) -> KernelSettings:
    """Put ``settings`` in force for the whole process; returns the previous ones."""
    global _settings
    previous = _settings
    if settings.launch_cache != previous.launch_cache:
        _switch_launch_cache(settings.launch_cache)
    _settings = settings
    return previous


@contextlib.contextmanager
def kernel_settings(**changes: bool) -> Iterator[KernelSettings]:
    """The settings in force with ``changes`` (``KernelSettings``' fields by name) inside the block, the previous
    ones restored after it."""
    previous = set_kernel_settings(dataclasses.replace(_settings, **changes))
    try:
        yield _settings
    finally:
        set_kernel_settings(previous)


def _switch_launch_cache(on: bool) -> None:
    # mx_kernels never imports mx_recipe, so the switch is launch_cache's own. Importing it imports Triton: only a
    # change of this setting does that, and without Triton no kernel launches.
    if importlib.util.find_spec("triton") is None:
        return
    from mx_kernels import launch_cache

    launch_cache.set_enabled(on)
