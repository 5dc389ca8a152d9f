"""Throughput, MFU and memory: one stdout line and one metrics.jsonl object per log step."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch

# Dense bf16 peak FLOP/s (no sparsity), from the vendors' datasheets; the B200 figure is the
# one the MX performance tracker (shared/seeds/002) quotes.
BF16_PEAK_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "B200": 2250e12}


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in BF16_PEAK_FLOPS.items():
        if key in name:
            return flops
    return None


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory on CUDA; the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss_kib * (1 if sys.platform != "darwin" else 1 / 1024) / 2**20


class MetricsLogger:
    """Times the steps between log points; rank 0 prints and appends to metrics.jsonl."""

    def __init__(self, output_dir: Path, device: torch.device, flops_per_token: float, is_main: bool):
        self.path = output_dir / "metrics.jsonl"
        self.device, self.flops_per_token, self.is_main = device, flops_per_token, is_main
        self.peak_flops = device_peak_flops(device)
        self.start = self.last_time = time.perf_counter()
        self.tokens_since_last = 0
        if is_main:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")  # a fresh run starts a fresh file

    def add_tokens(self, n: int) -> None:
        self.tokens_since_last += n

    def log(self, step: int, loss: float, extra: dict[str, float]) -> dict[str, float | int | None]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        tokens_per_sec = self.tokens_since_last / max(now - self.last_time, 1e-9)
        tflops = tokens_per_sec * self.flops_per_token / 1e12
        record = {
            "step": step,
            "loss": loss,
            "tokens_per_sec": tokens_per_sec,
            "tflops": tflops,
            "mfu": None if self.peak_flops is None else 100 * tflops * 1e12 / self.peak_flops,
            "memory_gib": peak_memory_gib(self.device),
            "time": time.time(),
            "elapsed_s": now - self.start,
            **extra,
        }
        self.last_time, self.tokens_since_last = now, 0
        if self.is_main:
            mfu = "n/a" if record["mfu"] is None else f"{record['mfu']:.1f}%"
            print(
                f"step {step:6d}  loss {loss:8.4f}  tokens/s/device {tokens_per_sec:10.0f}  "
                f"TFLOP/s {tflops:7.2f}  MFU {mfu:>6}  memory {record['memory_gib']:6.2f} GiB",
                flush=True,
            )
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return record
