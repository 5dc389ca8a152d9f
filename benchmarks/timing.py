"""Timing and run metadata shared by every benchmark of this folder.

``interleaved``: the benchmarks that compare bf16 against MX time every variant of one comparison
in interleaved rounds, so that a drift of the GPU clock or of the allocator between two back-to-back
measurements lands on both sides instead of on whichever ran first.

Two figures per variant:
- wall: the median over all rounds of ``triton.testing.do_bench`` samples (CUDA events around each
  call, L2 flushed before each), and the spread of the per-round medians;
- kernel: the GPU time of the kernels one call launches, summed (torch.profiler), which leaves out
  launch gaps and idle time; the two together show where a ratio comes from.

``median_ms``, ``kernel_us`` and ``host_us`` time a single call: its events time, the GPU time of
its kernels, and the host time of launching it.

``run_meta``: the provenance written with every result file (device, torch, date, commit).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from mx_recipe.cli import output_file


@dataclass
class Timing:
    wall_us: float  # median of every sample of every round
    round_us: list[float]  # the median of each round, in round order
    kernel_us: float  # summed GPU kernel time of one call

    @property
    def spread(self) -> float:
        """(slowest - fastest round median) / wall_us."""
        return (max(self.round_us) - min(self.round_us)) / self.wall_us


def add_run_args(parser: argparse.ArgumentParser, rounds: bool = True) -> argparse.ArgumentParser:
    """The options every benchmark shares: --eager (no torch.compile), --rounds (interleaved), --out (JSON)."""
    parser.add_argument("--eager", action="store_true", help="do not torch.compile either side")
    if rounds:
        parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (timing.py)")
    parser.add_argument("--out", type=output_file, help="write the rows as JSON here, with provenance (run_meta)")
    return parser


def require_cuda(script: str) -> None:
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU")


def median_ms(fn: Callable[[], object]) -> float:
    """Median time of one call (``triton.testing.do_bench``: CUDA events around each call, L2 flushed before each)."""
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def kernel_us_by_name(
    step: Callable[[], object],
    calls: int = 5,
    grad_to_none: list[torch.Tensor] | None = None,
    flush_l2: bool = False,
) -> dict[str, float]:
    """Device time of each CUDA kernel (and memcpy) one call of ``step`` launches, by kernel name, mean over
    ``calls``. ``flush_l2``: L2 flushed before each call as do_bench does; the flush's fill kernels,
    and with them any fill of ``step`` itself, are left out."""
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda") if flush_l2 else None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            for t in grad_to_none or []:
                t.grad = None
            if flush is not None:
                flush.zero_()
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    if flush_l2:
        events = [e for e in events if "FillFunctor" not in e.key]
    times = {e.key: e.device_time_total / calls for e in events}
    if sum(times.values()) <= 0:
        raise RuntimeError(f"the profiler saw no GPU work in {calls} calls")
    return times


def kernel_spans(step: Callable[[], object]) -> list[tuple[str, float, float]]:
    """The CUDA kernels (and copies) of one call of ``step`` as (name, start us, end us), in start order."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    spans = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                    if e.device_type.name == "CUDA"), key=lambda span: span[1])  # fmt: skip
    if not spans:
        raise RuntimeError("the profiler saw no GPU work")
    return spans


def end_increments(spans: list[tuple[str, float, float]]) -> list[float]:
    """What each span (start order) adds to the end of the work before it: how far its end passes every earlier
    span's, 0 where it ends inside them. They add up to the first start to the last end. Where kernels overlap
    (programmatic dependent launch) a kernel's own duration counts its wait for the one before; this does not."""
    increments, end = [], None
    for _, start, stop in spans:
        end = start if end is None else end
        increments.append(max(0.0, stop - end))
        end = max(end, stop)
    return increments


def repeated_run(names: list[str]) -> tuple[int, int, int]:
    """(first index, period, repeats) of the run of one sequence repeated back to back that covers the most of
    ``names`` (the smaller period on a tie): a model's layers in the kernels of a step. Repeats 1: none found."""
    best = (0, 1, 1)
    for period in range(1, len(names) // 2 + 1):
        run = start = 0
        for i in range(len(names) - period + 1):
            match = i + period < len(names) and names[i] == names[i + period]
            run = run + 1 if match else 0
            if match and run == 1:
                start = i
            repeats = (run + period) // period
            if repeats > 1 and repeats * period > best[1] * best[2]:
                best = (start, period, repeats)
    return best


def kernel_us(
    step: Callable[[], object],
    calls: int = 5,
    grad_to_none: list[torch.Tensor] | None = None,
    flush_l2: bool = False,
) -> float:
    """Summed device time of the CUDA kernels (and memcpys) one call of ``step`` launches (``kernel_us_by_name``)."""
    return sum(kernel_us_by_name(step, calls, grad_to_none, flush_l2).values())


def copy_gbs(device: torch.device | str = "cuda") -> float:
    """GB/s of a device-to-device copy, bytes read + written: 1 GiB over the copy kernel's time on a GPU (L2 flushed),
    64 MiB over the wall time on a CPU. What the memory-bound benchmarks measure their kernels against."""
    device = torch.device(device)
    size = 2**30 if device.type == "cuda" else 2**26
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        return 2 * size / kernel_us(lambda: dst.copy_(src), calls=10, flush_l2=True) / 1e3
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    return 2 * size * 10 / (time.perf_counter() - start) / 1e9


def host_us(fn: Callable[[], object], calls: int = 500) -> float:
    """Host time of one call (median of 5 rounds after a warm-up round), the GPU idle enough that it
    never holds the host back."""
    rounds = []
    for _ in range(6):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls // 5):
            fn()
        rounds.append((time.perf_counter() - start) / (calls // 5) * 1e6)
    torch.cuda.synchronize()
    return sorted(rounds[1:])[2]


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


def git_commit() -> str:
    """MX_GIT_COMMIT when set (a tree copied to a GPU machine may carry a stale .git), else the checkout's."""
    if os.environ.get("MX_GIT_COMMIT"):
        return os.environ["MX_GIT_COMMIT"]
    try:
        root = Path(__file__).resolve().parents[1]
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=root).stdout
        return out.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command_line() -> str:
    """The command that ran this benchmark, as a user would type it from the repository root (``--out``
    left out: where the result was written is not part of what was measured)."""
    args, skip = [], False
    for arg in sys.argv[1:]:
        if skip or arg == "--out":
            skip = not skip
            continue
        if not arg.startswith("--out="):
            args.append(arg)
    script = Path(sys.argv[0]).resolve()
    root = Path(__file__).resolve().parents[1]
    name = script.relative_to(root) if script.is_relative_to(root) else script.name
    world = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun
    launcher = ["torchrun", "--standalone", f"--nproc_per_node={world}"] if world > 1 else ["python"]
    return " ".join([*launcher, str(name), *args])


def run_meta(**extra: object) -> dict:
    """Provenance of a benchmark run, plus ``extra``: the ``meta`` object of every result file."""
    return dict(
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        torch=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=git_commit(),
        command=command_line(),
        **extra,
    )
