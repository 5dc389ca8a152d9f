"""Train one config under several MX recipes side by side, one run per GPU, then compare them.

    python scripts/parity_sweep.py --config parity_llama1b --recipes none mxfp8 mxfp8_rceil mxfp4 \
        --gpus 0,1,2,3 [--out DIR] [--time-limit SECONDS] [--threshold X] [--smooth N] [--section.key value ...]

Each recipe R runs `python train.py --config CONFIG --mx.recipe R --job.output_dir DIR/R ...` (R = none
is the bf16 baseline, in DIR/bf16) with the same seed and data order, pinned by CUDA_VISIBLE_DEVICES to
one entry of --gpus ("0,1" gives one GPU each; "0+1,2+3" gives two GPUs to each run, through torchrun).
Runs start as GPUs free up, so four recipes on two GPUs take two rounds. Without --gpus the runs go one
after the other on whatever train.py finds (the CPU here). Every run's output goes to DIR/R/train.log.

--time-limit: SIGTERM to every run still going after that many seconds from the start; train.py stops
at the next step boundary (and checkpoints, with checkpoint.enable), so what was logged is kept and
compared. The comparison (scripts/compare_runs.py, the bf16 run as the baseline where there is one)
goes to DIR/summary.md, summary.json and loss.png; its verdict is the last line printed. Exit status:
1 if a run failed, else 0. Configs and overrides are checked before anything starts (exit 2).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mx_recipe.train.config import ConfigError, load_config, parse_overrides  # noqa: E402


@dataclass
class Run:
    recipe: str
    run_dir: Path
    proc: subprocess.Popen | None = None
    gpus: str | None = None
    returncode: int | None = None
    stopped: bool = False


def run_name(recipe: str) -> str:
    return "bf16" if recipe == "none" else recipe


def launch(run: Run, config: str, overrides: list[str], gpus: str | None) -> None:
    """Start ``run`` on ``gpus`` ("0" or "0+1"; None: the environment's devices, one process)."""
    train = os.environ.get("MX_TRAIN_SCRIPT", str(REPO / "train.py"))
    nproc = 1 if gpus is None else len(gpus.split("+"))
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    if nproc > 1:
        launcher.append(f"--nproc_per_node={nproc}")
    cmd = [*launcher, train, "--config", config, "--mx.recipe", run.recipe, "--job.output_dir", str(run.run_dir)]
    env = dict(os.environ)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus.replace("+", ",")
    run.run_dir.mkdir(parents=True, exist_ok=True)
    where = f"GPU {gpus}" if gpus is not None else "default device"
    print(f"parity_sweep: {run_name(run.recipe)} on {where}: {' '.join(cmd + overrides)}", flush=True)
    with open(run.run_dir / "train.log", "w") as log:  # the child keeps its own copy of the descriptor
        run.proc = subprocess.Popen(cmd + overrides, env=env, stdout=log, stderr=subprocess.STDOUT)
    run.gpus = gpus


def sweep(runs: list[Run], config: str, overrides: list[str], slots: list[str | None], deadline: float | None):
    """Run everything, at most one run per slot at a time; SIGTERM what is left at the deadline."""
    pending, running = list(runs), []
    free = list(slots)
    while pending or running:
        while pending and free:
            run = pending.pop(0)
            launch(run, config, overrides, free.pop(0))
            running.append(run)
        time.sleep(0.2)
        for run in list(running):
            if run.proc.poll() is not None:
                run.returncode = run.proc.returncode
                running.remove(run)
                free.append(run.gpus)
                print(f"parity_sweep: {run_name(run.recipe)} ended, exit {run.returncode}", flush=True)
        if deadline is not None and time.monotonic() > deadline and (running or pending):
            for run in running:
                print(f"parity_sweep: time limit: SIGTERM to {run_name(run.recipe)}", flush=True)
                run.proc.send_signal(signal.SIGTERM)
                run.stopped = True
            for run in pending:
                print(f"parity_sweep: time limit: {run_name(run.recipe)} not started", flush=True)
            pending.clear()
            deadline = None  # signal once; the runs stop at their next step boundary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--recipes", nargs="+", required=True, help="MX recipe names; none is bf16")
    parser.add_argument("--gpus", help="comma-separated slots, each a GPU index or indices joined by +")
    parser.add_argument("--out", help="default: outputs/parity_sweep/<config name>")
    parser.add_argument("--time-limit", type=float, help="seconds; SIGTERM to runs still going then")
    parser.add_argument("--threshold", help="passed to compare_runs.py")
    parser.add_argument("--smooth", help="passed to compare_runs.py")
    args, overrides = parser.parse_known_args()
    name = Path(args.config).name.removesuffix(".toml")
    out = Path(args.out or f"outputs/parity_sweep/{name}")
    if len(set(args.recipes)) != len(args.recipes):
        parser.error(f"--recipes names a recipe twice: {args.recipes}")
    try:
        parsed = parse_overrides(overrides)
        for recipe in args.recipes:  # a bad recipe or override stops here, before any run
            load_config(args.config, [*parsed, ("mx.recipe", recipe)])
    except ConfigError as e:
        print(f"parity_sweep: config error: {e}", file=sys.stderr)
        return 2
    slots: list[str | None] = [None]
    if args.gpus:
        slots = args.gpus.split(",")
        if any(not s or not all(p.isdigit() for p in s.split("+")) for s in slots):
            parser.error(f"--gpus {args.gpus!r}: expected slots like 0,1 or 0+1,2+3")
    runs = [Run(recipe, out / run_name(recipe)) for recipe in args.recipes]
    deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
    sweep(runs, args.config, overrides, slots, deadline)

    compare = [sys.executable, str(REPO / "scripts" / "compare_runs.py"), *(str(r.run_dir) for r in runs)]
    compare += ["--out", str(out)]
    if "none" in args.recipes:
        compare += ["--baseline", str(out / "bf16")]
    for flag in ("threshold", "smooth"):
        if getattr(args, flag) is not None:
            compare += [f"--{flag}", getattr(args, flag)]
    failed = [run_name(r.recipe) for r in runs if r.returncode not in (0, None) and not r.stopped]
    logged = [r for r in runs if (r.run_dir / "metrics.jsonl").exists()]
    if len(logged) == len(runs):
        subprocess.run(compare, check=False)
    else:
        print(f"parity_sweep: no comparison: {len(runs) - len(logged)} run(s) logged nothing", file=sys.stderr)
    if failed:
        print(f"parity_sweep: failed: {', '.join(failed)} (see their train.log)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
