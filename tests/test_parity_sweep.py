"""scripts/parity_sweep.py: one run per GPU slot, the time limit, config errors, and the comparison.

A stand-in trainer (MX_TRAIN_SCRIPT) logs a few steps like train.py and records the devices it was
given; one real CPU sweep of debug_mxfp8 checks the whole path end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SWEEP = [sys.executable, str(REPO / "scripts" / "parity_sweep.py")]

# Writes config.toml and metrics.jsonl like train.py; FAKE_SLEEP_<recipe> makes that run slow, and
# SIGTERM ends it early (exit 0, like train.py's stop at a step boundary).
FAKE_TRAINER = r"""
import json, os, signal, sys, time
from pathlib import Path

args = sys.argv[1:]
out = Path(args[args.index("--job.output_dir") + 1])
recipe = args[args.index("--mx.recipe") + 1]
out.mkdir(parents=True, exist_ok=True)
config = f'[model]\nflavor = "debug"\n[mx]\nrecipe = "{recipe}"\n[training]\nwarmup_steps = 0\n'
(out / "config.toml").write_text(config)
(out / "env.json").write_text(json.dumps({"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": time.time()}))
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
sleep = float(os.environ.get(f"FAKE_SLEEP_{recipe}", "0"))
loss = {"none": 2.0, "mxfp8": 2.004, "mxfp4": 2.2}[recipe]
with open(out / "metrics.jsonl", "a") as f:
    for step in range(1, 11):
        f.write(json.dumps({"step": step, "loss": loss, "tokens_per_sec": 100.0, "memory_gib": 1.0}) + "\n")
        f.flush()
        deadline = time.time() + sleep
        while time.time() < deadline and not stop:
            time.sleep(0.01)
        if stop:
            sys.exit(0)
(out / "DONE").write_text("10 steps\n")
"""


def sweep(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    trainer = tmp_path / "fake_train.py"
    trainer.write_text(FAKE_TRAINER)
    full_env = {**os.environ, "MX_TRAIN_SCRIPT": str(trainer), **env}
    return subprocess.run([*SWEEP, *args], capture_output=True, text=True, env=full_env, timeout=120, cwd=tmp_path)


def test_one_run_per_slot_then_a_comparison_against_bf16(tmp_path):
    out = tmp_path / "out"
    proc = sweep(tmp_path, "--config", "debug_mxfp8", "--recipes", "none", "mxfp8", "mxfp4", "--gpus", "3,5",
                 "--out", str(out), FAKE_SLEEP_none="0.05")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    devices = {d.name: json.loads((d / "env.json").read_text())["cuda"] for d in out.iterdir() if d.is_dir()}
    assert devices["bf16"] == "3" and devices["mxfp8"] == "5"
    assert devices["mxfp4"] in ("3", "5")  # the third run waits for a free slot
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("PARITY INCONCLUSIVE (no verdict: no validation loss at a step every run logged")
    assert "one run per arm" in last and last.endswith("debug mxfp8 vs debug bf16 | debug mxfp4 vs debug bf16")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["baseline"] == "debug bf16" and (out / "loss.png").is_file()


def test_time_limit_stops_the_runs_and_keeps_what_they_logged(tmp_path):
    out = tmp_path / "out"
    proc = sweep(tmp_path, "--config", "debug_mxfp8", "--recipes", "none", "mxfp8", "--gpus", "0,1",
                 "--out", str(out), "--time-limit", "1", FAKE_SLEEP_mxfp8="5")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "time limit: SIGTERM to mxfp8" in proc.stdout
    assert not (out / "mxfp8" / "DONE").exists() and (out / "bf16" / "DONE").exists()
    steps = [json.loads(line)["step"] for line in (out / "mxfp8" / "metrics.jsonl").read_text().splitlines()]
    assert steps and max(steps) < 10
    assert proc.stdout.strip().splitlines()[-1].startswith("PARITY")


def test_bad_recipe_or_override_stops_before_any_run(tmp_path):
    out = tmp_path / "out"
    proc = sweep(tmp_path, "--config", "debug_mxfp8", "--recipes", "none", "mxfp9", "--out", str(out))
    assert proc.returncode == 2 and "mx.recipe" in proc.stderr and "mxfp9" in proc.stderr
    proc = sweep(tmp_path, "--config", "debug_mxfp8", "--recipes", "none", "--out", str(out), "--training.stepz", "3")
    assert proc.returncode == 2 and "training.stepz" in proc.stderr
    assert not out.exists()


def test_real_cpu_sweep_of_debug_mxfp8(tmp_path):
    out = tmp_path / "out"
    small = ["--training.steps", "4", "--training.local_batch_size", "2", "--training.seq_len", "64"]
    small += ["--data.max_bytes", "2000000"]
    proc = subprocess.run([*SWEEP, "--config", "debug_mxfp8", "--recipes", "none", "mxfp8", "--out", str(out),
                           *small, "--metrics.log_freq", "1"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert (out / "bf16" / "DONE").exists() and (out / "mxfp8" / "DONE").exists()
    assert "--mx.recipe mxfp8" in proc.stdout and proc.stdout.strip().splitlines()[-1].startswith("PARITY")
