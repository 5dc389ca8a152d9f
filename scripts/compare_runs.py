"""Compare training runs against a bf16 baseline over seeds: loss bands, a paired confidence interval, a verdict.

    python scripts/compare_runs.py outputs/parity_sweep/parity_llama1b --out outputs/compare
    python scripts/compare_runs.py DIR [DIR ...] --out OUT [--baseline DIR] [--threshold 0.005]
                                   [--warmup-steps N] [--smooth N]

Each DIR is a train.py output directory (metrics.jsonl: training records with "loss", validation records
with "val_loss", the last record of a step winning, so resumed runs read right; config.toml), or a folder
of them, such as a sweep's output (<recipe>/seed<k>/ from scripts/parity_sweep.py, or <recipe>/), or a
torchtitan run, one reader per source:
- its log file (what torchtitan prints; under torchrun rank 0's lines): the "step: N  loss: X  ...  tps: T  ...
  mfu: M%" lines, "validate step:" lines, and the job config it prints with job.print_config;
- its dump folder: the scalars of its tensorboard event files (<save_tb_folder>/<date-time>/) and the job
  config it saves with job.save_config_file (a JSON file in the dump folder).
A torchtitan run's recipe is the mx converter's (model.converters "mx", mx.recipe), bf16 without converters;
its seed debug.seed, its warm-up lr_scheduler.warmup_steps, and its label "<model> <flavor> <recipe>".

Arms and pairs. Runs whose config.toml agree in everything but [job], [checkpoint] and [metrics] form
an arm (one recipe, label "<model flavor> <recipe>", bf16 for recipe "none"); within an arm each run has
its own job.seed. The baseline arm is --baseline (a run or a folder of runs), else the bf16 arm, else the
first. A seed gives every recipe the same initial weights and batches, so arm and baseline are compared
seed by seed (a paired comparison).

Statistics, per arm against the baseline, at the last validation step every run of both arms logged:
- the paired differences of the final validation loss, d_k = L_arm(k) / L_base(k) - 1 (and L_arm(k) -
  L_base(k)) for each seed k in both arms; their mean and its 95% confidence interval, a paired
  t-interval: mean +- t(0.975, n - 1) * sd / sqrt(n), sd the sample standard deviation (n - 1) of the
  n differences. It covers the seed-to-seed variation (initial weights, data order, summation order);
  the validation set is fixed, large enough for its own sampling error to be small (docs/RESULTS.md).
- every arm's seed-to-seed spread: std (n - 1), min and max of its final validation losses.
- max deviation: the largest |relative difference| of the mean smoothed train loss after the warm-up.
- tokens/s: the median of the per-GPU tokens/s records of each run (leaving out the first record of each
  launch: it includes start-up), averaged over the arm's runs; its ratio to the baseline's.

Verdict, per arm: PASS when the whole confidence interval lies within +-threshold (relative), FAIL when
it lies wholly outside, INCONCLUSIVE when it crosses a bound; FAIL too for a non-finite final validation
loss of the arm alone (it diverged). No verdict (INCONCLUSIVE with the reason) without a validation loss
common to the runs, when that step (or, without validation, the last common step) is not past
training.warmup_steps (--warmup-steps overrides the configs), when a run stopped before its
training.steps, or with fewer than two seeds in both arms. Over several arms: FAIL if one fails, else
INCONCLUSIVE if one is, else PASS.

Writes OUT/loss.png (train loss and validation as bands, mean and min-max over seeds; the paired
difference to the baseline, banded, with the confidence interval of the final validation loss;
tokens/s per GPU), OUT/summary.md and OUT/summary.json: the same fields as printed. Printed: the two
tables, then the one-line verdict "PARITY PASS|FAIL|INCONCLUSIVE: ...", the last line, once. Exit
status 0 whatever the verdict (this is a report); 2 with a message for unusable inputs.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIDENCE = 0.95
NOT_THE_ARM = ("job", "checkpoint", "metrics")  # config sections in which runs of one arm may differ
SEED_DIR = re.compile(r"seed(\d+)")
METHOD = (
    "paired by seed: d = arm / baseline - 1 of the final validation loss for each seed in both arms; "
    "mean and 95% t-interval over seeds, mean +- t(0.975, n-1) * sd / sqrt(n); PASS when the interval "
    "lies within +-threshold, FAIL when wholly outside, else INCONCLUSIVE"
)


class CompareError(Exception):
    """A problem with the inputs; its message is printed as one line."""


@dataclass
class Run:
    path: Path
    label: str
    recipe: str | None  # None without a config.toml
    warmup_steps: int | None
    steps: int | None  # training.steps: where the run ends when it finishes
    seed: int | None  # job.seed, else from a seed<k> folder name
    arm_key: str  # runs with equal keys form one arm
    arm_dir: Path  # the arm's folder: the run's own, or its parent for a seed<k> folder
    train: dict[int, dict[str, Any]]  # step -> the last training record of that step, in step order
    val: dict[int, float]  # step -> the last validation loss of that step, in step order
    launch_starts: set[int] = field(default_factory=set)  # steps whose record includes a launch's start-up


@dataclass
class Arm:
    label: str
    recipe: str | None
    runs: dict[int | None, Run]  # by seed, in seed order
    is_baseline: bool = False


# ----------------------------------------------------------------------------- reading runs


def read_metrics(path: Path) -> tuple[dict[int, dict[str, Any]], dict[int, float], set[int]]:
    """Training records, validation losses and launch-start steps of one metrics.jsonl."""
    if not path.is_file():
        raise CompareError(
            f"{path}: no such file (is {path.parent} a train.py output directory? A torchtitan run is its log file "
            "or its dump folder with tensorboard event files)"
        )
    train: dict[int, dict[str, Any]] = {}
    val: dict[int, float] = {}
    launch_starts: set[int] = set()
    last_elapsed = math.inf
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            # A run killed mid-write leaves a partial line; the records around it still count.
            print(f"warning: {path}:{lineno}: skipping an unreadable line", file=sys.stderr)
            continue
        if record.get("val_loss") is not None:
            val[step] = float(record["val_loss"])
        if record.get("loss") is not None:
            # elapsed_s restarts from zero in every launch (a resume appends to the same file).
            elapsed = record.get("elapsed_s")
            if not train or (elapsed is not None and elapsed < last_elapsed):
                launch_starts.add(step)
            else:
                launch_starts.discard(step)  # a later record of this step replaces the earlier one
            last_elapsed = elapsed if elapsed is not None else last_elapsed
            train[step] = record
    if not train:
        raise CompareError(f"{path}: no training records (empty metrics file?)")
    return dict(sorted(train.items())), dict(sorted(val.items())), launch_starts


def read_train_py_run(run_dir: Path) -> Run:
    train, val, launch_starts = read_metrics(run_dir / "metrics.jsonl")
    seed_dir = SEED_DIR.fullmatch(run_dir.name)
    arm_dir = run_dir.parent if seed_dir else run_dir
    label, recipe, warmup, steps, seed = arm_dir.name, None, None, None, int(seed_dir[1]) if seed_dir else None
    arm_key = f"folder {arm_dir.name}"
    config_path = run_dir / "config.toml"
    if config_path.is_file():
        with open(config_path, "rb") as f:
            config = tomllib.load(f)
        recipe = config.get("mx", {}).get("recipe")
        flavor = config.get("model", {}).get("flavor")
        warmup = config.get("training", {}).get("warmup_steps")
        steps = config.get("training", {}).get("steps")
        seed = config.get("job", {}).get("seed", seed)
        arm_key = json.dumps({k: v for k, v in config.items() if k not in NOT_THE_ARM}, sort_keys=True, default=str)
        if flavor and recipe:
            label = f"{flavor} {'bf16' if recipe == 'none' else recipe}"
        elif config.get("job", {}).get("description"):
            label = config["job"]["description"]
    return Run(run_dir, label, recipe, warmup, steps, seed, arm_key, arm_dir, train, val, launch_starts)


def read_run(path: Path) -> Run:
    """A train.py output directory, a torchtitan dump folder (its tensorboard events) or a torchtitan log file."""
    if path.is_file():
        return read_torchtitan_log(path)
    if not (path / "metrics.jsonl").is_file() and torchtitan_event_files(path):
        return read_torchtitan_tensorboard(path)
    return read_train_py_run(path)


def run_dirs(path: Path) -> list[Path]:
    """``path`` if it is a run (or missing: reading it says so), else the runs one or two folders below it."""
    if (path / "metrics.jsonl").is_file() or not path.is_dir() or torchtitan_event_files(path):
        return [path]
    found = sorted({p.parent for pattern in ("*/metrics.jsonl", "*/*/metrics.jsonl") for p in path.glob(pattern)})
    if not found:
        raise CompareError(f"{path}: no metrics.jsonl in it or in its subfolders (not a run or a sweep's output)")
    return found


# ----------------------------------------------------------------------------- reading torchtitan runs

ANSI = re.compile(r"\x1b\[[0-9;]*m")
RANK_PREFIX = re.compile(r"\[[a-z]*(\d+)\]:")  # torchrun's "[rank0]:" or "[default0]:" before each line
NUMBER = r"([-+]?(?:\d[\d,]*(?:\.\d*)?(?:[eE][-+]?\d+)?|nan|inf))"
TORCHTITAN_STEP = re.compile(rf"(?<!validate )step:\s*(\d+)\s+loss:\s*{NUMBER}")
TORCHTITAN_VAL = re.compile(rf"validate step:\s*(\d+)\s+loss:\s*{NUMBER}")
TORCHTITAN_FIELDS = {  # a training record's key: its figure in torchtitan's log line
    "memory_gib": re.compile(rf"memory:\s*{NUMBER}GiB"),
    "tokens_per_sec": re.compile(rf"tps:\s*{NUMBER}"),
    "tflops": re.compile(rf"tflops:\s*{NUMBER}"),
    "mfu": re.compile(rf"mfu:\s*{NUMBER}%"),
}
TORCHTITAN_TAGS = {  # a training record's key: its torchtitan tensorboard tag
    "loss": "loss_metrics/global_avg_loss",
    "memory_gib": "memory/max_reserved(GiB)",
    "tokens_per_sec": "throughput(tps)",
    "tflops": "tflops",
    "mfu": "mfu(%)",
}
TORCHTITAN_VAL_TAG = "validation_metrics/loss"
TB_SUBFOLDER = re.compile(r"(replica|rank)_\d+")


def number(text: str) -> float:
    return float(text.replace(",", ""))


def torchtitan_event_files(folder: Path) -> list[Path]:
    """The tensorboard event files of a torchtitan dump folder, oldest first: in
    ``<save_tb_folder>/<date-time>/[replica_<i>/][rank_<k>/]`` (rank 0's where each rank saved its own)."""
    files = []
    for path in folder.glob("*/*/**/events.out.tfevents.*"):
        below = path.relative_to(folder).parts[2:-1]
        ranks = [part for part in below if part.startswith("rank_")]
        if all(TB_SUBFOLDER.fullmatch(part) for part in below) and ranks in ([], ["rank_0"]):
            files.append(path)
    return sorted(files, key=lambda p: (p.parent.relative_to(folder).parts, p.name))


def torchtitan_run(path: Path, config: dict[str, Any] | None, train: dict[int, dict[str, Any]], val: dict[int, float],
                   launch_starts: set[int]) -> Run:  # fmt: skip
    """A torchtitan run from its records and its job config (torchtitan's JobConfig as a dict, when known)."""
    if not train:
        raise CompareError(f"{path}: no torchtitan training records (log lines 'step: N  loss: X ...' or the "
                           f"{TORCHTITAN_TAGS['loss']} scalars)")  # fmt: skip
    label, recipe, warmup, steps, seed = path.name, None, None, None, None
    arm_key = f"torchtitan {path.resolve()}"
    if config:
        model = config.get("model", {})
        converters = model.get("converters") or []
        # the mx converter's recipe (mx_recipe.integrations.torchtitan.registered), another converter by its name
        recipe = config.get("mx", {}).get("recipe") if "mx" in converters else "+".join(converters) or "none"
        label = f"{model.get('name')} {model.get('flavor')} {'bf16' if recipe == 'none' else recipe}"
        warmup = config.get("lr_scheduler", {}).get("warmup_steps")
        steps = config.get("training", {}).get("steps")
        seed = config.get("debug", {}).get("seed")
        arm_key = json.dumps({k: v for k, v in config.items() if k not in NOT_THE_ARM}, sort_keys=True, default=str)
    train, val = dict(sorted(train.items())), dict(sorted(val.items()))
    return Run(path, label, recipe, warmup, steps, seed, arm_key, path, train, val, launch_starts)


def read_torchtitan_log(path: Path) -> Run:
    """A torchtitan run from its log (what it prints; under torchrun, rank 0's lines): the training records of its
    'step:' lines, the validation losses of its 'validate step:' lines, and the job config where it printed it
    (job.print_config). A record after 'Starting job:' is a launch's first, its figures include start-up."""
    lines = []
    for raw in path.read_text(errors="replace").splitlines():
        line = ANSI.sub("", raw)
        rank = RANK_PREFIX.match(line)
        if rank:
            if rank[1] != "0":
                continue
            line = line[rank.end() :]
        lines.append(line)
    text = "\n".join(lines)
    config = None
    if (at := text.find("Running with configs: {")) >= 0:
        try:
            config, _ = json.JSONDecoder().raw_decode(text, text.index("{", at))
        except ValueError:
            print(f"warning: {path}: its job config did not parse; reading it without", file=sys.stderr)
    train: dict[int, dict[str, Any]] = {}
    val: dict[int, float] = {}
    launch_starts: set[int] = set()
    new_launch = True
    for line in lines:
        if "Starting job:" in line:
            new_launch = True
        elif m := TORCHTITAN_VAL.search(line):
            val[int(m[1])] = number(m[2])
        elif m := TORCHTITAN_STEP.search(line):
            step = int(m[1])
            record: dict[str, Any] = {"step": step, "loss": number(m[2])}
            record |= {key: number(f[1]) for key, regex in TORCHTITAN_FIELDS.items() if (f := regex.search(line))}
            train[step] = record
            if new_launch:
                launch_starts.add(step)
            else:
                launch_starts.discard(step)  # a later record of this step replaces the earlier one
            new_launch = False
    return torchtitan_run(path, config, train, val, launch_starts)


def read_torchtitan_tensorboard(folder: Path) -> Run:
    """A torchtitan run from its dump folder: the scalars of its tensorboard event files (metrics.enable_tensorboard;
    each launch writes a file, whose first record includes start-up) and the job config torchtitan saved there
    (job.save_config_file, a JSON file)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise CompareError(f"{folder}: reading tensorboard event files needs the tensorboard package (or give the "
                           "run's log file)") from None  # fmt: skip
    train: dict[int, dict[str, Any]] = {}
    val: dict[int, float] = {}
    launch_starts: set[int] = set()
    for path in torchtitan_event_files(folder):
        events = EventAccumulator(str(path), size_guidance={"scalars": 0})
        events.Reload()
        tags = set(events.Tags()["scalars"])
        file_steps: dict[int, dict[str, Any]] = {}
        for key, tag in TORCHTITAN_TAGS.items():
            for event in events.Scalars(tag) if tag in tags else []:
                file_steps.setdefault(event.step, {"step": event.step})[key] = event.value
        for event in events.Scalars(TORCHTITAN_VAL_TAG) if TORCHTITAN_VAL_TAG in tags else []:
            val[event.step] = event.value
        records = {step: r for step, r in sorted(file_steps.items()) if "loss" in r}
        launch_starts -= set(records)
        launch_starts |= {next(iter(records))} if records else set()
        train.update(records)
    config = None
    for path in sorted(folder.glob("*.json")):
        try:
            candidate = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(candidate, dict) and {"job", "model", "training"} <= set(candidate):
            config = candidate
            break
    return torchtitan_run(folder, config, train, val, launch_starts)


def group_arms(runs: list[Run]) -> list[Arm]:
    """Runs of one config form an arm, in order of first appearance; one seed twice splits it by folder."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.arm_key, []).append(run)
    arms = []
    for group in groups.values():
        seeds = [r.seed for r in group]
        parts = [group]
        if len(set(seeds)) < len(seeds):  # e.g. a rerun of one seed in its own folder
            by_dir: dict[Path, list[Run]] = {}
            for run in group:
                by_dir.setdefault(run.arm_dir.resolve(), []).append(run)
            parts = list(by_dir.values())
        for part in parts:
            by_seed: dict[int | None, Run] = {}
            for run in part:
                if run.seed in by_seed:
                    first = by_seed[run.seed].path
                    raise CompareError(f"{first} and {run.path}: two runs of one arm with seed {run.seed}")
                by_seed[run.seed] = run
            ordered = dict(sorted(by_seed.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))
            arms.append(Arm(part[0].label, part[0].recipe, ordered))
    # Arms that would read alike: add their folder names (and their parents' where those alike too).
    folders = {id(arm): next(iter(arm.runs.values())).arm_dir for arm in arms}
    twins = [arm for arm in arms if sum(a.label == arm.label for a in arms) > 1]
    names = [folders[id(arm)].name for arm in twins]
    for arm in twins:
        folder = folders[id(arm)]
        arm.label += f" ({folder.name if names.count(folder.name) == 1 else f'{folder.parent.name}/{folder.name}'})"
    return arms


# ----------------------------------------------------------------------------- statistics


def t_quantile(p: float, df: int) -> float:
    """The p quantile (p > 0.5) of Student's t with ``df`` degrees of freedom (an integer >= 1).

    Inverts P(|T| <= t), which for integer df is a finite sum (Abramowitz and Stegun 26.7.3-4), by
    bisection: exact to 1e-12, no scipy needed."""
    if df < 1 or not 0.5 < p < 1:
        raise ValueError(f"t_quantile needs df >= 1 and 0.5 < p < 1, got df {df}, p {p}")

    def central(t: float) -> float:  # P(|T| <= t)
        theta = math.atan(t / math.sqrt(df))
        c2, s = math.cos(theta) ** 2, math.sin(theta)
        if df % 2 == 0:
            term, total = 1.0, 1.0
            for k in range(2, df - 1, 2):  # (1*3*...*(k-1)) / (2*4*...*k) * cos^k
                term *= c2 * (k - 1) / k
                total += term
            return s * total
        if df == 1:
            return 2 * theta / math.pi
        term, total = 1.0, 1.0
        for k in range(3, df - 1, 2):  # (2*4*...*(k-1)) / (3*5*...*k) * cos^(k-1)
            term *= c2 * (k - 1) / k
            total += term
        return 2 / math.pi * (theta + s * math.cos(theta) * total)

    target, lo, hi = 2 * p - 1, 0.0, 1.0
    while central(hi) < target:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if central(mid) < target else (lo, mid)
        if hi - lo < 1e-13 * hi:
            break
    return (lo + hi) / 2


def sample_sd(values: list[float]) -> float | None:
    """The sample standard deviation (n - 1); None for fewer than two values, NaN with a NaN among them."""
    if len(values) < 2:
        return None
    mean = math.fsum(values) / len(values)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))


def mean_ci(values: list[float]) -> tuple[float, float | None, tuple[float, float] | None]:
    """Mean, sample sd and 95% t-interval of ``values`` (sd and interval None for fewer than two)."""
    mean, sd = math.fsum(values) / len(values), sample_sd(values)
    if sd is None:
        return mean, None, None
    half = t_quantile((1 + CONFIDENCE) / 2, len(values) - 1) * sd / math.sqrt(len(values))
    return mean, sd, (mean - half, mean + half)


def smooth(steps: list[int], values: list[float], window: int) -> list[float]:
    """Trailing moving average over the steps in (s - window, s]; a NaN spoils only its own windows."""
    out = []
    for hi, step in enumerate(steps):
        lo = bisect.bisect_right(steps, step - window)
        out.append(sum(values[lo : hi + 1]) / (hi + 1 - lo))
    return out


def smoothed_loss(run: Run, window: int) -> dict[int, float]:
    steps = list(run.train)
    return dict(zip(steps, smooth(steps, [float(r["loss"]) for r in run.train.values()], window), strict=True))


def common_steps(curves: list[dict[int, float]]) -> list[int]:
    steps = set(curves[0]).intersection(*curves[1:]) if curves else set()
    return sorted(steps)


def band(curves: list[dict[int, float]]) -> dict[int, tuple[float, float, float]]:
    """step -> (mean, min, max) over ``curves``, at their common steps."""
    return {s: (statistics.fmean(v), min(v), max(v)) for s in common_steps(curves) for v in [[c[s] for c in curves]]}


def median_of(run: Run, key: str) -> float | None:
    """The median of a training record's ``key`` over the run, leaving out the records of a launch's start-up."""
    records = {s: r[key] for s, r in run.train.items() if r.get(key) is not None}
    steady = [v for s, v in records.items() if s not in run.launch_starts]
    values = steady or list(records.values())  # a run with one record per launch has nothing else
    return statistics.median(values) if values else None


def median_tokens_per_sec(run: Run) -> float | None:
    return median_of(run, "tokens_per_sec")


def peak_memory_gib(run: Run) -> float | None:
    values = [r["memory_gib"] for r in run.train.values() if r.get("memory_gib") is not None]
    return max(values) if values else None


def arm_tokens_per_sec(arm: Arm) -> float | None:
    values = [v for r in arm.runs.values() if (v := median_tokens_per_sec(r)) is not None]
    return statistics.fmean(values) if values else None


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def final_val_spread(arm: Arm) -> dict[str, Any]:
    """The arm's final validation losses over its seeds, at the last validation step all its runs logged."""
    steps = common_steps([r.val for r in arm.runs.values()])
    if not steps:
        return {"final_val_step": None, "final_val_loss_mean": None, "final_val_loss_std": None,
                "final_val_loss_min": None, "final_val_loss_max": None}  # fmt: skip
    values = [r.val[steps[-1]] for r in arm.runs.values()]
    return {
        "final_val_step": steps[-1],
        "final_val_loss_mean": math.fsum(values) / len(values),
        "final_val_loss_std": sample_sd(values),
        "final_val_loss_min": min(values),
        "final_val_loss_max": max(values),
    }


def verdict_of(ci: tuple[float, float], threshold: float) -> tuple[str, str]:
    lo, hi = ci
    if -threshold <= lo and hi <= threshold:
        return "PASS", f"the interval lies within +-{threshold:.2%}"
    if lo > threshold or hi < -threshold:
        return "FAIL", f"the interval lies outside +-{threshold:.2%}"
    return "INCONCLUSIVE", f"the interval crosses {'+' if hi > threshold else '-'}{threshold:.2%}"


def compare_arm(arm: Arm, base: Arm, window: int, warmup: int | None, threshold: float) -> dict[str, Any]:
    """An arm's figures: its spread and speed, and unless it is the baseline its paired difference and verdict."""
    tps, base_tps = arm_tokens_per_sec(arm), arm_tokens_per_sec(base)
    result: dict[str, Any] = {
        "label": arm.label,
        "mx_recipe": arm.recipe,
        "is_baseline": arm.is_baseline,
        "seeds": list(arm.runs),
        "run_dirs": [str(r.path) for r in arm.runs.values()],
        **final_val_spread(arm),
        "median_tokens_per_sec": tps,
        "tokens_per_sec_ratio": tps / base_tps if tps is not None and base_tps else None,
        "peak_memory_gib": max((m for r in arm.runs.values() if (m := peak_memory_gib(r)) is not None), default=None),
    }
    if arm.is_baseline:
        return result
    seeds = [s for s in arm.runs if s in base.runs]
    pairs = [(arm.runs[s], base.runs[s]) for s in seeds]
    runs = [r for pair in pairs for r in pair]
    val_steps = common_steps([r.val for r in runs])
    step = val_steps[-1] if val_steps else None
    if warmup is None:
        warmup = max((r.warmup_steps or 0 for r in [*arm.runs.values(), *base.runs.values()]), default=0)

    # Max deviation: the mean smoothed train curves of the paired runs, after the warm-up.
    mine = band([smoothed_loss(a, window) for a, _ in pairs])
    theirs = band([smoothed_loss(b, window) for _, b in pairs])
    after = [abs(mine[s][0] / theirs[s][0] - 1) for s in mine if s in theirs and s > warmup]

    reasons = []
    if not seeds:
        reasons.append(f"no seed in both arms (seeds {list(arm.runs)} and {list(base.runs)})")
    elif step is None:
        reasons.append("no validation loss at a step every run logged (set validation.enable true)")
    last = step if step is not None else (common_steps([r.train for r in runs]) or [None])[-1]
    if last is not None and last <= warmup:
        what = "final validation" if step is not None else "last common step"
        reasons.append(f"the {what}, step {last}, is not past the warm-up (training.warmup_steps {warmup})")
    unfinished = [
        f"{label} seed {s} stopped at step {next(reversed(r.train))} of {r.steps}"
        for s, pair in zip(seeds, pairs, strict=True)
        for label, r in zip((arm.label, base.label), pair, strict=True)
        if r.steps and next(reversed(r.train)) < r.steps
    ]
    if unfinished:  # the final loss of a run cut short is another quantity: resume it first
        reasons.append("not every run finished (" + ", ".join(unfinished) + ")")
    if len(seeds) == 1:
        one = len(arm.runs) == len(base.runs) == 1
        reasons.append(
            f"{'one run per arm' if one else f'only seed {seeds[0]} is in both arms'}: "
            "a confidence interval needs two or more seeds of each"
        )

    rel = [a.val[step] / b.val[step] - 1 for a, b in pairs] if step is not None else []
    absolute = [a.val[step] - b.val[step] for a, b in pairs] if step is not None else []
    finite = all(math.isfinite(v) for v in absolute)
    rel_mean, rel_sd, rel_ci = mean_ci(rel) if rel and finite else (None, None, None)
    abs_mean, _, abs_ci = mean_ci(absolute) if absolute and finite else (None, None, None)
    bad = [s for s, v in zip(seeds, absolute, strict=False) if not math.isfinite(v)]  # none without validation
    if bad and all(math.isfinite(b.val[step]) for _, b in pairs):  # this arm diverged: a failure at any length
        verdict, reason = "FAIL", f"non-finite final validation loss (seeds {bad})"
    elif bad or reasons:
        reasons += [f"non-finite final validation loss of the baseline (seeds {bad})"] if bad else []
        verdict, reason = "INCONCLUSIVE", "no verdict: " + "; ".join(reasons)
    else:
        verdict, reason = verdict_of(rel_ci, threshold)
    result.update(
        {
            "compared_at_step": step,
            "pairs": len(seeds),
            "paired_seeds": seeds,
            "delta_rel_mean": rel_mean,
            "delta_rel_ci": list(rel_ci) if rel_ci else None,
            "delta_rel_sd": rel_sd,
            "delta_abs_mean": abs_mean,
            "delta_abs_ci": list(abs_ci) if abs_ci else None,
            "max_rel_deviation_after_warmup": max(after) if after else None,
            "verdict": verdict,
            "reason": reason,
        }
    )
    return result


def run_records(arms: list[Arm], results: list[dict[str, Any]], window: int) -> list[dict[str, Any]]:
    """One record per run (tables of single runs read these): its figures against the baseline run of its seed."""
    base_arm = next(a for a in arms if a.is_baseline)
    base_tps = arm_tokens_per_sec(base_arm)
    out = []
    for arm, result in zip(arms, results, strict=True):
        step = result.get("compared_at_step")
        for seed, run in arm.runs.items():
            paired = base_arm.runs.get(seed)
            tps = median_tokens_per_sec(run)
            out.append(
                {
                    "label": arm.label if len(arm.runs) == 1 else f"{arm.label} seed {seed}",
                    "run_dir": str(run.path),
                    "seed": seed,
                    "mx_recipe": run.recipe,
                    "is_baseline": arm.is_baseline,
                    "last_step": next(reversed(run.train)),
                    "final_train_loss_smoothed": next(reversed(smoothed_loss(run, window).values())),
                    "final_val_loss": next(reversed(run.val.values())) if run.val else None,
                    "final_val_step": next(reversed(run.val)) if run.val else None,
                    "rel_delta": run.val[step] / paired.val[step] - 1
                    if step is not None and paired is not None and not arm.is_baseline
                    else None,
                    "median_tokens_per_sec": tps,
                    "tokens_per_sec_ratio": tps / base_tps if tps is not None and base_tps else None,
                    "peak_memory_gib": peak_memory_gib(run),
                }
            )
    return out


# ----------------------------------------------------------------------------- the report


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:{spec}}{suffix}"


def fmt_ci(ci: list[float] | None, spec: str) -> str:
    return "n/a" if ci is None else f"[{ci[0]:{spec}}, {ci[1]:{spec}}]"


def verdict_line(results: list[dict[str, Any]]) -> tuple[str, str]:
    """(overall verdict, the one line that says it)."""
    base = next(r for r in results if r["is_baseline"])
    others = [r for r in results if not r["is_baseline"]]
    verdicts = {r["verdict"] for r in others}
    overall = "FAIL" if "FAIL" in verdicts else "INCONCLUSIVE" if "INCONCLUSIVE" in verdicts else "PASS"
    reasons = {r["reason"] for r in others}
    shared = len(others) > 1 and overall == "INCONCLUSIVE" and len(reasons) == 1 and verdicts == {"INCONCLUSIVE"}
    parts = []
    for r in others:
        tag = f" [{r['verdict']}]" if len(others) > 1 and not shared else ""
        figures = ""
        if r["delta_rel_mean"] is not None:
            ci = "" if r["delta_rel_ci"] is None else ", 95% CI {:+.2%} to {:+.2%}".format(*r["delta_rel_ci"])
            figures = (
                f"final val loss {r['delta_rel_mean']:+.2%}{ci} "
                f"({plural(r['pairs'], 'seed')}, step {r['compared_at_step']})"
            )
        body = "; ".join(x for x in (figures, "" if shared else r["reason"]) if x)
        parts.append(f"{r['label']} vs {base['label']}{tag}{': ' if body else ''}{body}")
    if shared:  # one reason for every arm (e.g. single runs): said once
        return overall, f"PARITY {overall} ({reasons.pop()}): " + " | ".join(parts)
    return overall, f"PARITY {overall}: " + " | ".join(parts)


def tables(results: list[dict[str, Any]]) -> list[str]:
    """The two markdown tables: every arm's final validation loss over seeds, and the paired differences."""
    lines = [
        "| arm | seeds | val step | final val loss (mean) | std | min | max | tokens/s/GPU | tokens/s ratio | "
        "peak memory (GiB) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r['label']}{' (baseline)' if r['is_baseline'] else ''} | {', '.join(map(str, r['seeds']))} | "
            f"{fmt(r['final_val_step'], 'd')} | {fmt(r['final_val_loss_mean'], '.4f')} | "
            f"{fmt(r['final_val_loss_std'], '.4f')} | {fmt(r['final_val_loss_min'], '.4f')} | "
            f"{fmt(r['final_val_loss_max'], '.4f')} | {fmt(r['median_tokens_per_sec'], ',.0f')} | "
            f"{fmt(r['tokens_per_sec_ratio'], '.3f', 'x')} | {fmt(r['peak_memory_gib'], '.2f')} |"
        )
    lines += [
        "",
        "| arm vs baseline | paired seeds | at step | delta (mean) | 95% CI | sd of delta | delta (abs) | "
        "95% CI (abs) | max deviation after warm-up |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        if r["is_baseline"]:
            continue
        lines.append(
            f"| {r['label']} | {', '.join(map(str, r['paired_seeds'])) or 'none'} | "
            f"{fmt(r['compared_at_step'], 'd')} | {fmt(r['delta_rel_mean'], '+.2%')} | "
            f"{fmt_ci(r['delta_rel_ci'], '+.2%')} | {fmt(r['delta_rel_sd'], '.2%')} | "
            f"{fmt(r['delta_abs_mean'], '+.4f')} | {fmt_ci(r['delta_abs_ci'], '+.4f')} | "
            f"{fmt(r['max_rel_deviation_after_warmup'], '.2%')} |"
        )
    return lines


def summary_markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Run comparison",
        "",
        f"**{meta['verdict_line']}**",
        "",
        f"Baseline: {meta['baseline']}. Method: {meta['method']}; threshold {meta['threshold']:.2%}. Train loss "
        f"smoothed over {plural(meta['smooth_steps'], 'step')}; bands are min-max over seeds.",
        "",
        *tables(results),
        "",
        "Run directories:",
        "",
        *(f"- {r['label']}: {', '.join(f'`{d}`' for d in r['run_dirs'])}" for r in results),
        "",
        "![loss curves](loss.png)",
        "",
    ]
    return "\n".join(lines)


def json_safe(value: Any) -> Any:
    """NaN and Inf as null: JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def plot(arms: list[Arm], results: list[dict[str, Any]], window: int, warmup: int, threshold: float, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_rel, ax_tps) = plt.subplots(
        3, 1, figsize=(8, 9), sharex=True, gridspec_kw={"height_ratios": [3, 1.5, 1.5]}
    )
    base = next(a for a in arms if a.is_baseline)
    ordered = [(base, next(r for r in results if r["is_baseline"]))]
    ordered += [(a, r) for a, r in zip(arms, results, strict=True) if not a.is_baseline]
    colors = ["black"] + [plt.get_cmap("tab10")(i % 10) for i in range(len(arms))]
    top, deviations = [], [threshold]
    last_step = max(next(reversed(r.train)) for a in arms for r in a.runs.values())
    for (arm, result), color in zip(ordered, colors, strict=False):
        runs = list(arm.runs.values())
        n = plural(len(runs), "seed")
        loss = band([smoothed_loss(r, window) for r in runs])
        steps = list(loss)
        ax_loss.plot(steps, [m for m, _, _ in loss.values()], color=color, lw=1.5, label=f"{arm.label} (train, {n})")
        ax_loss.fill_between(steps, [lo for _, lo, _ in loss.values()], [hi for _, _, hi in loss.values()],
                             color=color, alpha=0.2, lw=0)  # fmt: skip
        val = band([r.val for r in runs])
        if val:
            mean, lo, hi = zip(*val.values(), strict=True)
            err = [[m - a for m, a in zip(mean, lo, strict=True)], [b - m for m, b in zip(mean, hi, strict=True)]]
            ax_loss.errorbar(list(val), mean, yerr=err, fmt="o", ms=4, capsize=3, color=color, label=f"{arm.label} val")
        # Zoom past the initial drop, so that small differences show.
        late = [v for s, (m, lo, hi) in [*loss.items(), *val.items()] for v in (lo, hi) if s > last_step * 0.1]
        top += late or [m for m, _, _ in loss.values()]
        if not arm.is_baseline:
            pairs = [(arm.runs[s], base.runs[s]) for s in result["paired_seeds"]]
            diffs = [
                {s: 100 * (a[s] / b[s] - 1) for s in a if s in b}
                for a, b in ((smoothed_loss(x, window), smoothed_loss(y, window)) for x, y in pairs)
            ]
            diff = band(diffs)
            if diff:
                steps = list(diff)
                ax_rel.plot(steps, [m for m, _, _ in diff.values()], color=color, lw=1.2, label=arm.label)
                ax_rel.fill_between(steps, [lo for _, lo, _ in diff.values()], [hi for _, _, hi in diff.values()],
                                    color=color, alpha=0.2, lw=0)  # fmt: skip
                deviations += [max(abs(lo), abs(hi)) / 100 for s, (_, lo, hi) in diff.items() if s > warmup]
            if result["delta_rel_mean"] is not None:
                mean = 100 * result["delta_rel_mean"]
                lo, hi = [100 * v for v in result["delta_rel_ci"]] if result["delta_rel_ci"] else (mean, mean)
                ax_rel.errorbar([result["compared_at_step"]], [mean], yerr=[[mean - lo], [hi - mean]], fmt="D",
                                ms=5, capsize=4, color=color)  # fmt: skip
                deviations += [max(abs(lo), abs(hi)) / 100]
        for run in runs:
            tps = [(s, r["tokens_per_sec"]) for s, r in run.train.items() if s not in run.launch_starts]
            tps = [(s, v) for s, v in tps if v is not None]
            if tps:
                ax_tps.plot(*zip(*tps, strict=True), color=color, lw=1, alpha=0.7,
                            label=arm.label if run is runs[0] else None)  # fmt: skip
    finite = [v for v in top if math.isfinite(v)]
    if finite:
        lo, hi = min(finite), max(finite)
        ax_loss.set_ylim(lo - 0.05 * (hi - lo + 1e-9), hi + 0.1 * (hi - lo + 1e-9))
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(
        f"vs {base.label}; train loss smoothed over {plural(window, 'step')}; bands: min-max over seeds", fontsize=10
    )
    ax_loss.legend(fontsize=7, ncol=2)
    ax_rel.axhspan(-100 * threshold, 100 * threshold, color="tab:green", alpha=0.12, lw=0)
    ax_rel.axhline(0, color="black", lw=0.8)
    finite = [d for d in deviations if math.isfinite(d)]
    ax_rel.set_ylim(-120 * max(finite), 120 * max(finite))  # early-training gaps would hide the rest
    ax_rel.set_ylabel(f"% vs {base.label}, paired\n(train; val: 95% CI)", fontsize=8)
    ax_tps.set_ylabel("tokens/s per GPU", fontsize=8)
    ax_tps.set_xlabel("step")
    ax_tps.set_ylim(bottom=0)
    for ax in (ax_loss, ax_rel, ax_tps):
        ax.grid(alpha=0.3)
    if len(arms) > 1:
        ax_rel.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def choose_baseline(arms: list[Arm], baseline_runs: list[Run]) -> Arm:
    if baseline_runs:
        found = {id(a) for a in arms for r in baseline_runs if any(r is x for x in a.runs.values())}
        if len(found) > 1:
            raise CompareError(f"--baseline {baseline_runs[0].path.parent} holds runs of several arms")
        return next(a for a in arms if id(a) in found)
    return next((a for a in arms if a.recipe == "none"), arms[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, metavar="DIR",
                        help="run directories or folders of them; torchtitan dump folders or log files")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="directory for loss.png, summary.md, summary.json")
    parser.add_argument("--baseline", type=Path, help="the baseline's run(s) (default: the bf16 arm)")
    parser.add_argument("--threshold", type=float, default=0.005, help="parity: max |relative delta| (0.005)")
    parser.add_argument("--warmup-steps", type=int, help="warm-up length (default: training.warmup_steps)")
    parser.add_argument("--smooth", type=int, help="moving-average window in steps (default: 5%% of the steps)")
    args = parser.parse_args(argv)

    try:
        if args.smooth is not None and args.smooth < 1:
            raise CompareError(f"--smooth must be at least 1, got {args.smooth}")
        if not 0 < args.threshold < 0.1:
            raise CompareError(f"--threshold is a fraction (0.005 is 0.5%), got {args.threshold}")
        dirs = list(dict.fromkeys(d for path in args.runs for d in run_dirs(path)))  # the same run twice is one
        baseline_dirs = run_dirs(args.baseline) if args.baseline is not None else []
        dirs += [d for d in baseline_dirs if all(d.resolve() != x.resolve() for x in dirs)]
        runs = [read_run(d) for d in dirs]
        arms = group_arms(runs)
        if len(arms) < 2:
            raise CompareError(f"need at least two arms (a baseline and one to compare); found {len(arms)}")
        base_runs = [r for r in runs for d in baseline_dirs if r.path.resolve() == d.resolve()]
        base = choose_baseline(arms, base_runs)
        base.is_baseline = True
        window = args.smooth or max(1, round(0.05 * max(next(reversed(r.train)) for r in base.runs.values())))
        results = [compare_arm(a, base, window, args.warmup_steps, args.threshold) for a in arms]
    except CompareError as e:
        print(f"compare_runs: error: {e}", file=sys.stderr)
        return 2

    overall, line = verdict_line(results)
    warmup = args.warmup_steps
    if warmup is None:
        warmup = max((r.warmup_steps or 0 for r in runs), default=0)
    meta = {
        "verdict": overall,
        "verdict_line": line,
        "baseline": base.label,
        "threshold": args.threshold,
        "confidence": CONFIDENCE,
        "method": METHOD,
        "smooth_steps": window,
        "warmup_steps": warmup,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    plot(arms, results, window, warmup, args.threshold, args.out / "loss.png")
    (args.out / "summary.md").write_text(summary_markdown(results, meta))
    summary = {**meta, "arms": results, "runs": run_records(arms, results, window)}
    (args.out / "summary.json").write_text(json.dumps(json_safe(summary), indent=2) + "\n")

    print(f"wrote {args.out / 'loss.png'}, {args.out / 'summary.md'}, {args.out / 'summary.json'}")
    print("\n".join(tables(results)))
    print(line)  # the last line: the verdict, printed once
    return 0


if __name__ == "__main__":
    sys.exit(main())
