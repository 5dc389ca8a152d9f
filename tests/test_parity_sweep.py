"""scripts/parity_sweep.py: runs per recipe and seed, one per GPU slot, the time limit, going on later,
config errors, and the comparison.

A stand-in trainer (MX_TRAIN_SCRIPT) logs a few steps and a validation loss like train.py and records the
devices and seed it was given; one real CPU sweep of debug_mxfp8 checks the whole path end to end.
"""

from __future__ import annotations

import json
import os
import re
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
seed = int(args[args.index("--job.seed") + 1])
out.mkdir(parents=True, exist_ok=True)
config = f'[job]\nseed = {seed}\n[model]\nflavor = "debug"\n[mx]\nrecipe = "{recipe}"\n[training]\nwarmup_steps = 0\n'
(out / "config.toml").write_text(config)
(out / "env.json").write_text(json.dumps({"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": time.time()}))
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
sleep = float(os.environ.get(f"FAKE_SLEEP_{recipe}", "0"))
loss = {"none": 2.0, "mxfp8": 2.004, "mxfp4": 2.2}[recipe] * (1 + 0.01 * seed)  # each seed its own level
with open(out / "metrics.jsonl", "a") as f:
    for step in range(1, 11):
        f.write(json.dumps({"step": step, "loss": loss, "tokens_per_sec": 100.0, "memory_gib": 1.0}) + "\n")
        if step == 10:
            f.write(json.dumps({"step": step, "val_loss": loss}) + "\n")
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


def launched(proc: subprocess.CompletedProcess) -> list[str]:
    """The runs the sweep started, in order."""
    return re.findall(r"^parity_sweep: (\S+ seed \d+) on ", proc.stdout, re.M)


def test_runs_per_recipe_and_seed_one_per_slot_then_a_paired_comparison(tmp_path):
    out = tmp_path / "out"
    proc = sweep(tmp_path, "--config", "debug_mxfp8", "--recipes", "none", "mxfp8", "mxfp4", "--seeds", "0", "1",
                 "--gpus", "3,5", "--out", str(out), FAKE_SLEEP_none="0.05")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    devices = {
        f"{d.parent.name}/{d.name}": json.loads((d / "env.json").read_text())["cuda"] for d in out.glob("*/seed*")
    }
    assert sorted(devices) == [f"{r}/seed{k}" for r in ("bf16", "mxfp4", "mxfp8") for k in (0, 1)]
    assert devices["bf16/seed0"] == "3" and devices["mxfp8/seed0"] == "5"  # the third run waits for a free slot
    assert set(devices.values()) == {"3", "5"}
    # Seed by seed: every recipe of seed 0 starts before any of seed 1; each run gets its seed.
    assert launched(proc)[:3] == ["bf16 seed 0", "mxfp8 seed 0", "mxfp4 seed 0"]
    assert "--mx.recipe mxfp4 --job.seed 1 --job.output_dir" in proc.stdout
    # +0.20% and +10% in both seeds, whatever each seed's own level: a pass and a failure.
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("PARITY FAIL: debug mxfp8 vs debug bf16 [PASS]: final val loss +0.20%, 95% CI +0.20% to")
    assert " | debug mxfp4 vs debug bf16 [FAIL]: final val loss +10.00%, 95% CI +10.00% to +10.00% (2 seeds" in last
    summary = json.loads((out / "summary.json").read_text())
    assert summary["baseline"] == "debug bf16" and (out / "loss.png").is_file()
    assert [a["seeds"] for a in summary["arms"]] == [[0, 1]] * 3
    invocation = json.loads((out / "sweep.json").read_text())["invocations"][0]
    assert invocation["command"].startswith("python scripts/parity_sweep.py --config debug_mxfp8 --recipes none")
    assert {"date", "commit", "torch", "device"} <= set(invocation)


def test_without_seeds_one_run_per_recipe_and_no_verdict(tmp_path):
    out = tmp_path / "out"
    proc = sweep(tmp_path, "--config", "debug_mxfp8", "--recipes", "none", "mxfp8", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.relative_to(out).as_posix() for p in out.glob("*/seed*")) == ["bf16/seed0", "mxfp8/seed0"]
    assert (
        proc.stdout.strip()
        .splitlines()[-1]
        .endswith("no verdict: one run per arm: a confidence interval needs two or more seeds of each")
    )


def test_time_limit_stops_the_runs_and_the_same_sweep_goes_on_later(tmp_path):
    out = tmp_path / "out"
    args = ["--config", "debug_mxfp8", "--recipes", "none", "mxfp8", "--gpus", "0,1", "--out", str(out)]
    proc = sweep(tmp_path, *args, "--time-limit", "1", FAKE_SLEEP_mxfp8="5")
    assert proc.returncode == 0, proc.stderr
    assert "time limit: SIGTERM to mxfp8 seed 0" in proc.stdout
    assert not (out / "mxfp8" / "seed0" / "DONE").exists() and (out / "bf16" / "seed0" / "DONE").exists()
    steps = [json.loads(line)["step"] for line in (out / "mxfp8" / "seed0" / "metrics.jsonl").read_text().splitlines()]
    assert steps and max(steps) < 10
    assert proc.stdout.strip().splitlines()[-1].startswith("PARITY INCONCLUSIVE")
    # Later, with another seed: the finished run is not run again, the stopped one goes on, seed 1 is added.
    proc = sweep(tmp_path, *args, "--seeds", "0", "1")
    assert proc.returncode == 0, proc.stderr
    assert "bf16 seed 0: " in proc.stdout and "is DONE; not run again" in proc.stdout
    assert launched(proc) == ["mxfp8 seed 0", "bf16 seed 1", "mxfp8 seed 1"]
    assert proc.stdout.strip().splitlines()[-1].startswith("PARITY PASS: debug mxfp8 vs debug bf16")
    assert len(json.loads((out / "sweep.json").read_text())["invocations"]) == 2
    # Other settings into the same folder: refused, naming both.
    proc = sweep(tmp_path, *args, "--training.lr", "1e-3")
    assert proc.returncode == 2 and f"{out} holds a sweep of --config debug_mxfp8 with overrides []" in proc.stderr


def test_bad_recipe_override_or_seeds_stop_before_any_run(tmp_path):
    out = tmp_path / "out"
    proc = sweep(tmp_path, "--config", "debug_mxfp8", "--recipes", "none", "mxfp9", "--out", str(out))
    assert proc.returncode == 2 and "mx.recipe" in proc.stderr and "mxfp9" in proc.stderr
    proc = sweep(tmp_path, "--config", "debug_mxfp8", "--recipes", "none", "--out", str(out), "--training.stepz", "3")
    assert proc.returncode == 2 and "training.stepz" in proc.stderr
    proc = sweep(tmp_path, "--config", "debug_mxfp8", "--recipes", "none", "--seeds", "0", "--job.seed", "3")
    assert proc.returncode == 2 and "give the seeds with --seeds, not --job.seed" in proc.stderr
    proc = sweep(tmp_path, "--config", "debug_mxfp8", "--recipes", "none", "--seeds", "1", "1")
    assert proc.returncode == 2 and "--seeds names a seed twice" in proc.stderr
    assert not out.exists()


def test_real_cpu_sweep_of_debug_mxfp8(tmp_path):
    out = tmp_path / "out"
    small = ["--training.steps", "4", "--training.local_batch_size", "2", "--training.seq_len", "64"]
    small += ["--data.max_bytes", "2000000"]
    proc = subprocess.run([*SWEEP, "--config", "debug_mxfp8", "--recipes", "none", "mxfp8", "--seeds", "1",
                           "--out", str(out), *small, "--metrics.log_freq", "1"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert (out / "bf16" / "seed1" / "DONE").exists() and (out / "mxfp8" / "seed1" / "DONE").exists()
    assert "--mx.recipe mxfp8 --job.seed 1" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("PARITY INCONCLUSIVE")
    assert "seed = 1" in (out / "mxfp8" / "seed1" / "config.toml").read_text()
