"""Train one config under several MX recipes and seeds, one run per GPU, then compare them.

    python scripts/parity_sweep.py --config parity_llama1b --recipes none mxfp8 mxfp8_rceil nvfp4 \
        --seeds 0 1 2 --gpus 0,1 [--out DIR] [--time-limit SECONDS] [--threshold X] [--smooth N] \
        [--section.key value ...]

Each recipe R and seed K runs `python train.py --config CONFIG --mx.recipe R --job.seed K
--job.output_dir DIR/R/seedK ...` (R = none is the bf16 baseline, in DIR/bf16/seedK). A seed sets the
initial weights and the order of the training batches, and the same seed gives every recipe the same
weights and batches, so compare_runs pairs the recipes seed by seed; the validation batches are the same
for every seed. Without --seeds: the config's job.seed, one run per recipe (compare_runs then gives no
verdict: it needs two or more seeds). Runs go seed by seed (every recipe of seed 0 first), each pinned by
CUDA_VISIBLE_DEVICES to one entry of --gpus ("0,1" gives one GPU each; "0+1,2+3" gives two GPUs to each
run, through torchrun), and start as GPUs free up. Without --gpus the runs go one after the other on
whatever train.py finds (the CPU here). Every run's output goes to its folder's train.log.

Going on later: a run whose folder holds DONE is not run again, and a stopped one resumes from its
checkpoint (train.py's own resume), so the same command (or one with more --seeds or --recipes) into
the same DIR adds what is missing. DIR/sweep.json records the config and overrides; a sweep into DIR
with other ones is refused (exit 2). It also records the command, commit, torch version and GPU, which
`scripts/results_report.py --add` copies into the result set's meta.json.

--time-limit: SIGTERM to every run still going after that many seconds from the start; train.py stops
at the next step boundary (with a checkpoint), so what was logged is kept and compared, and the next
sweep resumes it. The comparison (scripts/compare_runs.py over DIR/<recipe>/, the bf16 arm as the
baseline where there is one) goes to DIR/summary.md, summary.json and loss.png; its verdict is the last
line printed. Exit status: 1 if a run failed, else 0. Configs and overrides are checked before anything
starts (exit 2).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import shlex
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
    seed: int
    run_dir: Path
    proc: subprocess.Popen | None = None
    gpus: str | None = None
    returncode: int | None = None
    stopped: bool = False


def run_name(recipe: str) -> str:
    return "bf16" if recipe == "none" else recipe


def describe(run: Run) -> str:
    return f"{run_name(run.recipe)} seed {run.seed}"


def launch(run: Run, config: str, overrides: list[str], gpus: str | None) -> None:
    """Start ``run`` on ``gpus`` ("0" or "0+1"; None: the environment's devices, one process)."""
    train = os.environ.get("MX_TRAIN_SCRIPT", str(REPO / "train.py"))
    nproc = 1 if gpus is None else len(gpus.split("+"))
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    if nproc > 1:
        launcher.append(f"--nproc_per_node={nproc}")
    cmd = [*launcher, train, "--config", config, "--mx.recipe", run.recipe, "--job.seed", str(run.seed)]
    cmd += ["--job.output_dir", str(run.run_dir)]
    env = dict(os.environ)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus.replace("+", ",")
    run.run_dir.mkdir(parents=True, exist_ok=True)
    where = f"GPU {gpus}" if gpus is not None else "default device"
    print(f"parity_sweep: {describe(run)} on {where}: {' '.join(cmd + overrides)}", flush=True)
    with open(run.run_dir / "train.log", "a") as log:  # appended: a resumed run keeps its earlier log
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
                print(f"parity_sweep: {describe(run)} ended, exit {run.returncode}", flush=True)
        if deadline is not None and time.monotonic() > deadline and (running or pending):
            for run in running:
                print(f"parity_sweep: time limit: SIGTERM to {describe(run)}", flush=True)
                run.proc.send_signal(signal.SIGTERM)
                run.stopped = True
            for run in pending:
                print(f"parity_sweep: time limit: {describe(run)} not started", flush=True)
            pending.clear()
            deadline = None  # signal once; the runs stop at their next step boundary


def provenance(argv: list[str]) -> dict[str, str]:
    """What results_report.py --add puts in a result set's meta.json: the command and where it ran."""

    def output(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except OSError:
            return ""

    commit = output("git", "-C", str(REPO), "rev-parse", "--short", "HEAD") or "unknown"
    if output("git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"):
        commit += " (with uncommitted changes)"
    gpus = output("nvidia-smi", "--query-gpu=name", "--format=csv,noheader").splitlines()
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "unknown"
    return {
        "command": "python scripts/parity_sweep.py " + shlex.join(argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "torch": torch_version,
        "device": f"{len(gpus)} x {gpus[0]}" if gpus else "cpu",
    }


def record_sweep(out: Path, config: str, overrides: list[str], argv: list[str]) -> str | None:
    """Add this invocation to out/sweep.json; a message instead when out holds a sweep of other settings."""
    path, settings = out / "sweep.json", {"config": config, "overrides": overrides}
    record = json.loads(path.read_text()) if path.is_file() else {**settings, "invocations": []}
    if {k: record.get(k) for k in settings} != settings:
        return (
            f"{out} holds a sweep of --config {record.get('config')} with overrides {record.get('overrides')}; "
            f"this one is --config {config} with {overrides}: use another --out"
        )
    record["invocations"].append(provenance(argv))
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--recipes", nargs="+", required=True, help="MX recipe names; none is bf16")
    parser.add_argument("--seeds", nargs="+", type=int, help="job.seed of each run (default: the config's)")
    parser.add_argument("--gpus", help="comma-separated slots, each a GPU index or indices joined by +")
    parser.add_argument("--out", help="default: outputs/parity_sweep/<config name>")
    parser.add_argument("--time-limit", type=float, help="seconds; SIGTERM to runs still going then")
    parser.add_argument("--threshold", help="passed to compare_runs.py")
    parser.add_argument("--smooth", help="passed to compare_runs.py")
    argv = sys.argv[1:]
    args, overrides = parser.parse_known_args(argv)
    name = Path(args.config).name.removesuffix(".toml")
    out = Path(args.out or f"outputs/parity_sweep/{name}")
    if len(set(args.recipes)) != len(args.recipes):
        parser.error(f"--recipes names a recipe twice: {args.recipes}")
    if args.seeds is not None and len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds names a seed twice: {args.seeds}")
    try:
        parsed = parse_overrides(overrides)
        if args.seeds is not None and any(key == "job.seed" for key, _ in parsed):
            parser.error("give the seeds with --seeds, not --job.seed")
        for recipe in args.recipes:  # a bad recipe or override stops here, before any run
            config = load_config(args.config, [*parsed, ("mx.recipe", recipe)])
    except ConfigError as e:
        print(f"parity_sweep: config error: {e}", file=sys.stderr)
        return 2
    seeds = args.seeds if args.seeds is not None else [config.job.seed]
    if config.data.dataset == "hf" and len(seeds) > 1:
        print("parity_sweep: note: a streamed (hf) dataset is read in its own order: seeds change the initial "
              "weights, not the data order", flush=True)  # fmt: skip
    slots: list[str | None] = [None]
    if args.gpus:
        slots = args.gpus.split(",")
        if any(not s or not all(p.isdigit() for p in s.split("+")) for s in slots):
            parser.error(f"--gpus {args.gpus!r}: expected slots like 0,1 or 0+1,2+3")
    problem = record_sweep(out, args.config, overrides, argv)
    if problem:
        print(f"parity_sweep: {problem}", file=sys.stderr)
        return 2

    # Seed by seed, so that runs stopped by --time-limit leave whole pairs behind.
    runs = [Run(r, seed, out / run_name(r) / f"seed{seed}") for seed in seeds for r in args.recipes]
    todo = [r for r in runs if not (r.run_dir / "DONE").exists()]
    for run in runs:
        if run not in todo:
            print(f"parity_sweep: {describe(run)}: {run.run_dir} is DONE; not run again", flush=True)
    deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
    sweep(todo, args.config, overrides, slots, deadline)

    failed = [describe(r) for r in todo if r.returncode not in (0, None) and not r.stopped]
    arms = [out / run_name(r) for r in args.recipes]
    arms = [a for a in arms if any(a.glob("seed*/metrics.jsonl"))]
    silent = [describe(r) for r in runs if not (r.run_dir / "metrics.jsonl").exists()]
    if silent:
        print(f"parity_sweep: logged nothing: {', '.join(silent)}", file=sys.stderr)
    if len(arms) >= 2:
        compare = [sys.executable, str(REPO / "scripts" / "compare_runs.py"), *map(str, arms), "--out", str(out)]
        if out / "bf16" in arms:
            compare += ["--baseline", str(out / "bf16")]
        for flag in ("threshold", "smooth"):
            if getattr(args, flag) is not None:
                compare += [f"--{flag}", getattr(args, flag)]
        subprocess.run(compare, check=False)
    else:
        print("parity_sweep: no comparison: fewer than two recipes logged anything", file=sys.stderr)
    if failed:
        print(f"parity_sweep: failed: {', '.join(failed)} (see their train.log)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
