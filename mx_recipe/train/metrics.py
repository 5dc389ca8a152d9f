"""Throughput, MFU, memory and validation loss: one stdout line and one metrics.jsonl object per log
step, mirrored to TensorBoard and wandb when the config asks. Only rank 0 writes."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

# Dense bf16 peak FLOP/s (no sparsity), from the vendors' datasheets.
BF16_PEAK_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "B200": 2250e12}
TENSORBOARD_HINT = "pip install tensorboard (it is in the project's dev extra: pip install -e '.[dev]')"
WANDB_HINT = "pip install -e '.[wandb]' (the wandb extra), or pip install wandb"
WANDB_RUN_ID_FILE = "wandb_run_id"  # under output_dir: a resumed run continues the same wandb run
REDONE_FILE = "metrics.redone.jsonl"  # beside metrics.jsonl: the records of steps a resumed run trained again


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


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def check_metrics_config(metrics) -> tuple[str, str] | None:
    """(key, message) when a logging backend the config asks for is not installed, else None;
    cheap (looks for the packages, imports nothing), so a config check can call it up front."""
    import importlib.util

    if metrics.tensorboard and importlib.util.find_spec("tensorboard") is None:
        return "metrics.tensorboard", f"needs the tensorboard package: {TENSORBOARD_HINT}"
    if metrics.wandb and importlib.util.find_spec("wandb") is None:
        return "metrics.wandb", f"needs the wandb package: {WANDB_HINT}"
    return None


def _tensorboard_writer(log_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError(f"metrics.tensorboard = true needs the tensorboard package: {TENSORBOARD_HINT}") from None
    return SummaryWriter(log_dir=str(log_dir))


def wandb_mode() -> str:
    """Online with an API key in the environment, else offline (the run is kept on disk for ``wandb sync``)."""
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def _wandb_run(output_dir: Path, project: str, append: bool):
    """A wandb run named after output_dir; offline without WANDB_API_KEY; a resumed run (append)
    continues the run whose id output_dir keeps."""
    try:
        import wandb
    except ImportError:
        raise ImportError(f"metrics.wandb = true needs the wandb package: {WANDB_HINT}") from None
    id_file = output_dir / WANDB_RUN_ID_FILE
    # our own id (wandb.util.generate_id is gone from wandb 0.31): 8 lowercase hex digits, as wandb's are
    run_id = id_file.read_text().strip() if append and id_file.is_file() else uuid.uuid4().hex[:8]
    id_file.write_text(run_id + "\n")
    return wandb.init(
        project=project,
        name=output_dir.resolve().name,
        id=run_id,
        resume="allow",
        dir=str(output_dir),
        mode=wandb_mode(),
    )


def set_aside_records_after(path: Path, step: int) -> int:
    """Move the records of ``path`` (a metrics.jsonl) logged after ``step`` to REDONE_FILE beside it, appended
    there; returns how many moved. A run resumed from its checkpoint of ``step`` logs those steps again, so each
    step appears once in metrics.jsonl and nothing is deleted. A line a crash cut short moves too."""
    if not path.is_file():
        return 0
    keep, moved = [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            logged_at = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            logged_at = None
        (keep if isinstance(logged_at, int) and logged_at <= step else moved).append(line + "\n")
    if moved:
        with open(path.with_name(REDONE_FILE), "a") as f:  # first, so that a crash in between loses nothing
            f.writelines(moved)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)
    return len(moved)


class MetricsLogger:
    """Times the steps between log points; rank 0 prints, appends to metrics.jsonl, and mirrors
    the numbers to TensorBoard (output_dir/tb) and wandb when ``metrics_config`` asks.

    ``append``: a resumed run appends to metrics.jsonl instead of starting a fresh file; with ``resumed_step``
    (the step of the checkpoint it resumed from), the records logged after that step move to REDONE_FILE first.
    ``total_steps``: the stdout line shows step/total and an ETA from the average step time so far
    (a resumed run's first line has no ETA: the steps before it were not timed here).
    """

    def __init__(
        self,
        output_dir: Path,
        device: torch.device,
        flops_per_token: float,
        is_main: bool,
        append: bool = False,
        *,
        total_steps: int | None = None,
        metrics_config: Any = None,
        resumed_step: int | None = None,
    ):
        output_dir = Path(output_dir)
        self.path = output_dir / "metrics.jsonl"
        self.device, self.flops_per_token, self.is_main = device, flops_per_token, is_main
        self.total_steps = total_steps
        self.peak_flops = device_peak_flops(device)
        self.start = self.last_time = time.perf_counter()
        self.tokens_since_last = 0
        # (step, time) the ETA measures from: step 0 at start for a fresh run; unknown when resumed.
        self.eta_origin: tuple[int, float] | None = None if append else (0, self.start)
        self.tensorboard = self.wandb = None
        if not is_main:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not append:
            self.path.write_text("")  # a fresh run starts a fresh file
        elif resumed_step is not None and (moved := set_aside_records_after(self.path, resumed_step)):
            print(f"moved {moved} records logged after step {resumed_step} to {REDONE_FILE}: the steps run again")
        if metrics_config is not None and metrics_config.tensorboard:
            self.tensorboard = _tensorboard_writer(output_dir / "tb")
        if metrics_config is not None and metrics_config.wandb:
            self.wandb = _wandb_run(output_dir, metrics_config.wandb_project, append)

    def add_tokens(self, n: int) -> None:
        self.tokens_since_last += n

    def _progress(self, step: int, now: float) -> str:
        if self.total_steps is None:
            return f"step {step:6d}"
        text = f"step {step:6d}/{self.total_steps} ({100 * step / self.total_steps:3.0f}%)"
        if self.eta_origin is None:
            self.eta_origin = (step, now)
        elif step > self.eta_origin[0]:
            per_step = (now - self.eta_origin[1]) / (step - self.eta_origin[0])
            text += f"  eta {format_duration(per_step * max(self.total_steps - step, 0))}"
        return text

    def _write(self, record: dict[str, Any], scalars: dict[str, Any], step: int) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        numbers = {k: v for k, v in scalars.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tensorboard is not None:
            for key, value in numbers.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)

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
        progress = self._progress(step, now)
        if self.is_main:
            mfu = "n/a" if record["mfu"] is None else f"{record['mfu']:.1f}%"
            print(
                f"{progress}  loss {loss:8.4f}  tokens/s/device {tokens_per_sec:10.0f}  "
                f"TFLOP/s {tflops:7.2f}  MFU {mfu:>6}  memory {record['memory_gib']:6.2f} GiB",
                flush=True,
            )
            skip = ("step", "time", "elapsed_s")
            self._write(record, {f"train/{k}": v for k, v in record.items() if k not in skip}, step)
        return record

    def log_validation(self, step: int, loss: float) -> dict[str, float | int]:
        """One {"step", "val_loss", "time"} object in metrics.jsonl and a stdout line."""
        record = {"step": step, "val_loss": loss, "time": time.time()}
        if self.is_main:
            print(f"step {step:6d}  validation loss {loss:8.4f}", flush=True)
            self._write(record, {"val/loss": loss}, step)
        return record

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
