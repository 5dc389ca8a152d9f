"""Programmatic dependent launch (PDL) for the decode step's kernels, on sm_90 and newer.

A decode step at small batch is a few hundred kernels of a few microseconds each, replayed from a CUDA graph.
Between two of them the GPU drains the first kernel, then launches the second, whose programs start with their
setup and the latency of their first loads. A kernel launched with PDL (``launch_pdl=True``, the CUDA launch
attribute for programmatic stream serialization, kept as a programmatic edge when a CUDA graph captures it) may
start while the kernel before it in the stream still runs, once that one lets it:

* ``wait_prior`` (``griddepcontrol.wait``) comes before a kernel's first read of anything an earlier kernel wrote:
  it returns once every prerequisite grid has completed and its writes are visible. Every program executes it,
  those that return early included, so that a kernel never completes before the kernels it depends on, and
  the ones after it may rely on that too (their own wait covers every grid in flight before them).
* ``release_next`` (``griddepcontrol.launch_dependents``) lets the next kernel launch once every program of this
  one has executed it (or exited). Kernels call it right after their wait. Then the next kernel launches once
  every program of this one has started, and its programs take the slots this one's leave free as they exit:
  they set up, read what does not depend on this kernel (a GEMM's first weights) and wait, while this one
  drains. And at most two kernels are resident: the next one's own release follows its wait, which returns
  only once this one has completed, so waiting kernels never crowd out a running one.

Kernels take it as a ``PDL`` constexpr (both instructions compiled out without it); ``options(device)`` gives the
launch keywords. Off unless a caller turns it on (``launching(True)``: mx_recipe's decode step, where it was
measured to pay), and always under the interpreter, on CPUs and on GPUs before sm_90 (the instructions need sm_90).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from mx_kernels.common import cuda_capability, interpreting
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_enabled = False


@contextlib.contextmanager
def launching(enabled: bool) -> Iterator[None]:
    """Inside the block the kernels launch with PDL where the GPU takes it (``enabled``), else plainly."""
    global _enabled
    previous, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = previous


def enabled(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` take PDL (module doc)."""
    return _enabled and device.type == "cuda" and not interpreting() and cuda_capability(device) >= (9, 0)


def options(device: torch.device) -> dict:
    """The launch keywords of a kernel with a ``PDL`` constexpr, for a launch on ``device``."""
    return dict(PDL=True, launch_pdl=True) if enabled(device) else dict(PDL=False)


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """Wait until the kernels before this one have completed and their writes are visible (module doc)."""
    if PDL:
        gdc_wait()


@triton.jit
def release_next(PDL: tl.constexpr):
    """Let the next kernel in the stream launch once every program of this one got here (module doc)."""
    if PDL:
        gdc_launch_dependents()
