"""train.py end to end on the CPU: one process, and two processes with FSDP2 over gloo.

The helpers here serve tests/test_checkpoint.py and tests/test_train_features.py too.
"""

import functools
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--training.seq_len", "64", "--data.max_bytes", "2000000", "--metrics.log_freq", "1"]
BF16_ARGS = ["--config", "debug_bf16", "--training.steps", "4", "--training.local_batch_size", "2", *SMALL]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str], timeout: int = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env={**ENV, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def last_losses(out: Path) -> dict[int, float]:
    """step -> the last training loss logged for it (a resumed run logs some steps again)."""
    return {r["step"]: r["loss"] for r in _metrics(out) if "loss" in r}


_spec = importlib.util.spec_from_file_location("train_script", REPO / "train.py")
train_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_script)


def run_in_process(argv: list[str]) -> tuple[int, str, str]:
    """train.py's main() in this process (no interpreter start-up): (exit code, stdout, stderr).
    One thread, as the subprocesses (OMP_NUM_THREADS=1), so that both give the same bits."""
    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = train_script.main(argv)
    finally:
        torch.set_num_threads(threads)
    return code, out.getvalue(), err.getvalue()


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
    _run([*TORCHRUN, *common, "--training.local_batch_size", "2", "--job.output_dir", str(two)])
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


@functools.cache
def bf16_reference() -> dict[int, float]:
    """Losses of an uninterrupted in-process run of BF16_ARGS, computed once for the tests that
    compare with it. With 10 warmup steps the LR of steps 1-4 does not depend on the total."""
    out = Path(tempfile.mkdtemp(prefix="bf16_reference_"))
    try:
        code, _, err = run_in_process([*BF16_ARGS, "--job.output_dir", str(out)])
        assert code == 0, err
        return last_losses(out)
    finally:
        shutil.rmtree(out, ignore_errors=True)
