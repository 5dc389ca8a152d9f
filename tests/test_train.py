"""train.py end to end on the CPU: one process, and two processes with FSDP2 over gloo."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--training.seq_len", "64", "--data.max_bytes", "2000000", "--metrics.log_freq", "1"]


def _run(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_single_process_mxfp8_run_logs_metrics(tmp_path):
    out = tmp_path / "run"
    proc = _run(
        [
            sys.executable,
            "train.py",
            "--config",
            "debug_mxfp8",
            "--training.steps",
            "4",
            "--job.output_dir",
            str(out),
            *SMALL,
        ]
    )
    assert "28 of 29 layers converted" in proc.stdout
    records = _metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert {"step", "loss", "tokens_per_sec", "tflops", "mfu", "memory_gib", "time"} <= set(r)
        assert r["tokens_per_sec"] > 0 and r["mfu"] is None  # no peak for a CPU
    assert records[-1]["loss"] < records[0]["loss"]
    assert (out / "config.toml").read_text().count('recipe = "mxfp8"') == 1


@pytest.mark.slow
def test_two_process_fsdp2_gloo_matches_one_process_first_step(tmp_path):
    """Equal global batch: same initial weights and tokens, so the first step's loss differs only
    by fp32 rounding of the loss average (a mean of per-rank means); later steps also by the
    order of the gradient reduction."""
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["--config", "debug_mxfp8", "--training.steps", "3", *SMALL]
    _run([sys.executable, "train.py", *common, "--training.local_batch_size", "4", "--job.output_dir", str(one)])
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "train.py",
            *common,
            "--training.local_batch_size",
            "2",
            "--job.output_dir",
            str(two),
        ]
    )
    a, b = _metrics(one), _metrics(two)
    assert abs(a[0]["loss"] - b[0]["loss"]) <= 1e-6 * a[0]["loss"]
    for ra, rb in zip(a, b, strict=True):
        assert abs(ra["loss"] - rb["loss"]) <= 1e-3 * ra["loss"]


def test_moe_mxfp8_run_trains_experts_in_mx(tmp_path):
    out = tmp_path / "moe"
    proc = _run(
        [
            sys.executable,
            "train.py",
            "--config",
            "debug_moe_mxfp8",
            "--training.steps",
            "4",
            "--job.output_dir",
            str(out),
            *SMALL,
        ]
    )
    assert "layers.1.moe.experts" in proc.stdout and "31 of 35 layers converted" in proc.stdout
    records = _metrics(out)
    assert records[-1]["loss"] < records[0]["loss"]
