"""Timing for the benchmarks that compare bf16 against MX: every variant of one comparison is timed
in interleaved rounds, so that a drift of the GPU clock or of the allocator between two back-to-back
measurements lands on both sides instead of on whichever ran first.

Two figures per variant:
- wall: the median over all rounds of ``triton.testing.do_bench`` samples (CUDA events around each
  call, L2 flushed before each), and the spread of the per-round medians;
- kernel: the GPU time of the kernels one call launches, summed (torch.profiler), which leaves out
  launch gaps and idle time; the two together show where a ratio comes from.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench


@dataclass
class Timing:
    wall_us: float  # median of every sample of every round
    round_us: list[float]  # the median of each round, in round order
    kernel_us: float  # summed GPU kernel time of one call

    @property
    def spread(self) -> float:
        """(slowest - fastest round median) / wall_us."""
        return (max(self.round_us) - min(self.round_us)) / self.wall_us


def kernel_us(step: Callable[[], None], calls: int = 5, grad_to_none: list[torch.Tensor] | None = None) -> float:
    """Summed device time of the CUDA kernels of one call of ``step`` (mean over ``calls``)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            for t in grad_to_none or []:
                t.grad = None
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    return sum(e.device_time_total for e in events) / calls


def interleaved(
    steps: dict[str, Callable[[], None]],
    rounds: int = 5,
    rep_ms: float = 200.0,
    grad_to_none: list[torch.Tensor] | None = None,
) -> dict[str, Timing]:
    """Times each step in ``rounds`` rounds; each round runs every step for about ``rep_ms``, in an
    order rotated by one each round. Every step is warmed (compiled) before the first round."""
    if rounds < 1 or rep_ms <= 0:
        raise ValueError(f"rounds must be >= 1 and rep_ms > 0, got rounds={rounds}, rep_ms={rep_ms}")
    names = list(steps)
    for name in names:
        do_bench(steps[name], warmup=50, rep=50, grad_to_none=grad_to_none)
    samples: dict[str, list[float]] = {name: [] for name in names}
    round_us: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            ms = do_bench(steps[name], warmup=10, rep=rep_ms, grad_to_none=grad_to_none, return_mode="all")
            us = [t * 1e3 for t in ms]
            samples[name] += us
            round_us[name].append(statistics.median(us))
    kernels = {name: kernel_us(steps[name], grad_to_none=grad_to_none) for name in names}
    return {name: Timing(statistics.median(samples[name]), round_us[name], kernels[name]) for name in names}
