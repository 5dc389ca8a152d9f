"""Compare training runs against a baseline: loss curves, throughput, and a parity verdict.

    python scripts/compare_runs.py outputs/debug_bf16 outputs/debug_mxfp8 --out outputs/compare
    python scripts/compare_runs.py RUN_DIR [RUN_DIR ...] --out DIR [--baseline RUN_DIR] [--threshold 0.005]
                                   [--warmup-steps N] [--smooth N]

Each RUN_DIR is a train.py output directory: metrics.jsonl (training records with "loss", validation
records with "val_loss"; the last record of a step wins, so resumed runs read right) and config.toml
(for the label "<model flavor> <mx recipe>", bf16 for recipe "none").

Writes DIR/loss.png (train loss raw and smoothed, validation points, the relative difference of the
smoothed loss to the baseline, tokens/s per GPU), DIR/summary.md and DIR/summary.json.

- Baseline: --baseline, else the run whose mx recipe is "none" (bf16), else the first.
- Smoothed train loss at step s: the mean of the losses logged in the window (s - N, s], N = --smooth
  steps (default: 5% of the baseline's last step). Windows are in steps, so runs logged at different
  frequencies are smoothed alike.
- Parity: |final loss / baseline final loss - 1| <= --threshold, on the final validation loss when both
  runs have one at a common step, else on the smoothed train loss at the last common step.
- Max deviation: the largest |relative difference| of the smoothed train loss after --warmup-steps
  (default: the baseline's training.warmup_steps).
- Tokens/s: the median of the per-GPU tokens/s records, leaving out the first record of each launch
  (it includes start-up); its ratio to the baseline's.

The last line printed is the one-line verdict, "PARITY PASS: ..." or "PARITY FAIL: ...". Exit status 0
either way (this is a report); 2 with a message for a missing or empty metrics file or no common steps.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class CompareError(Exception):
    """A problem with the inputs; its message is printed as one line."""


@dataclass
class Run:
    path: Path
    label: str
    recipe: str | None  # None without a config.toml
    warmup_steps: int | None
    train: dict[int, dict[str, Any]]  # step -> the last training record of that step, in step order
    val: dict[int, float]  # step -> the last validation loss of that step, in step order
    launch_starts: set[int] = field(default_factory=set)  # steps whose record includes a launch's start-up


def read_metrics(path: Path) -> tuple[dict[int, dict[str, Any]], dict[int, float], set[int]]:
    """Training records, validation losses and launch-start steps of one metrics.jsonl."""
    if not path.is_file():
        raise CompareError(f"{path}: no such file (is {path.parent} a train.py output directory?)")
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


def read_run(run_dir: Path) -> Run:
    train, val, launch_starts = read_metrics(run_dir / "metrics.jsonl")
    label, recipe, warmup = run_dir.name, None, None
    config_path = run_dir / "config.toml"
    if config_path.is_file():
        with open(config_path, "rb") as f:
            config = tomllib.load(f)
        recipe = config.get("mx", {}).get("recipe")
        flavor = config.get("model", {}).get("flavor")
        warmup = config.get("training", {}).get("warmup_steps")
        if flavor and recipe:
            label = f"{flavor} {'bf16' if recipe == 'none' else recipe}"
        elif config.get("job", {}).get("description"):
            label = config["job"]["description"]
    return Run(run_dir, label, recipe, warmup, train, val, launch_starts)


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


def median_tokens_per_sec(run: Run) -> float | None:
    records = {s: r["tokens_per_sec"] for s, r in run.train.items() if r.get("tokens_per_sec") is not None}
    steady = [v for s, v in records.items() if s not in run.launch_starts]
    values = steady or list(records.values())  # a run with one record per launch has nothing else
    return statistics.median(values) if values else None


def peak_memory_gib(run: Run) -> float | None:
    values = [r["memory_gib"] for r in run.train.values() if r.get("memory_gib") is not None]
    return max(values) if values else None


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def rel(a: float, b: float) -> float:
    return a / b - 1.0


def compare(run: Run, base: Run, window: int, warmup: int, threshold: float) -> dict[str, Any]:
    """One run's figures, against ``base`` unless it is the baseline."""
    smoothed = smoothed_loss(run, window)
    last_step = next(reversed(run.train))
    tps = median_tokens_per_sec(run)
    result: dict[str, Any] = {
        "label": run.label,
        "run_dir": str(run.path),
        "mx_recipe": run.recipe,
        "is_baseline": run is base,
        "last_step": last_step,
        "final_train_loss_smoothed": smoothed[last_step],
        "final_val_loss": next(reversed(run.val.values())) if run.val else None,
        "final_val_step": next(reversed(run.val)) if run.val else None,
        "median_tokens_per_sec": tps,
        "peak_memory_gib": peak_memory_gib(run),
    }
    if run is base:
        return result
    base_smoothed = smoothed_loss(base, window)
    common = [s for s in smoothed if s in base_smoothed]
    if not common:
        raise CompareError(f"{run.path} and the baseline {base.path} have no common logged step")
    after_warmup = [abs(rel(smoothed[s], base_smoothed[s])) for s in common if s > warmup]
    common_val = [s for s in run.val if s in base.val]
    if common_val:
        metric, step = "val_loss", common_val[-1]
        delta = rel(run.val[step], base.val[step])
    else:
        metric, step = "train_loss_smoothed", common[-1]
        delta = rel(smoothed[step], base_smoothed[step])
    base_tps = median_tokens_per_sec(base)
    result.update(
        {
            "compared_on": metric,
            "compared_at_step": step,
            "rel_delta": delta,
            "max_rel_deviation_after_warmup": max(after_warmup) if after_warmup else None,
            "tokens_per_sec_ratio": tps / base_tps if tps is not None and base_tps else None,
            "parity": "PASS" if abs(delta) <= threshold else "FAIL",  # NaN fails too
        }
    )
    return result


def verdict_part(r: dict[str, Any], base: dict[str, Any], threshold: float) -> str:
    what = "final val loss" if r["compared_on"] == "val_loss" else "final smoothed train loss"
    at = "" if r["compared_at_step"] in (r["last_step"], base["last_step"]) else f" at step {r['compared_at_step']}"
    ratio = "n/a" if r["tokens_per_sec_ratio"] is None else f"{r['tokens_per_sec_ratio']:.3f}x"
    return (
        f"{r['label']} {what} {r['rel_delta']:+.2%}{at} vs {base['label']} "
        f"(threshold {threshold:.2%}), {ratio} tokens/s"
    )


def verdict_line(results: list[dict[str, Any]], threshold: float) -> str:
    base = next(r for r in results if r["is_baseline"])
    others = [r for r in results if not r["is_baseline"]]
    ok = all(r["parity"] == "PASS" for r in others)
    parts = [verdict_part(r, base, threshold) for r in others]
    if len(others) > 1:  # say which of several runs failed
        parts = [f"{p} [{r['parity']}]" for p, r in zip(parts, others, strict=True)]
    return f"PARITY {'PASS' if ok else 'FAIL'}: " + "; ".join(parts)


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def summary_markdown(results: list[dict[str, Any]], meta: dict[str, Any], verdict: str) -> str:
    lines = [
        "# Run comparison",
        "",
        f"**{verdict}**",
        "",
        f"Baseline: {meta['baseline']}. Train loss smoothed over {plural(meta['smooth_steps'], 'step')}; max deviation "
        f"counted after step {meta['warmup_steps']}; parity threshold {meta['threshold']:.2%} on the final "
        "validation loss where both runs have one, else on the final smoothed train loss.",
        "",
        "| run | last step | final train loss (smoothed) | final val loss | delta vs baseline | "
        "max deviation after warmup | median tokens/s/GPU | tokens/s ratio | peak memory (GiB) | parity |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results:
        baseline = r["is_baseline"]
        delta = "baseline" if baseline else fmt(r["rel_delta"], "+.2%")
        if not baseline:
            delta += " (val)" if r["compared_on"] == "val_loss" else " (train)"
        lines.append(
            f"| {r['label']} | {r['last_step']} | {fmt(r['final_train_loss_smoothed'], '.4f')} | "
            f"{fmt(r['final_val_loss'], '.4f')} | {delta} | "
            f"{'' if baseline else fmt(r['max_rel_deviation_after_warmup'], '.2%')} | "
            f"{fmt(r['median_tokens_per_sec'], ',.0f')} | "
            f"{'1.000x' if baseline else fmt(r['tokens_per_sec_ratio'], '.3f', 'x')} | "
            f"{fmt(r['peak_memory_gib'], '.2f')} | {'' if baseline else r['parity']} |"
        )
    lines += ["", "Run directories:", ""]
    lines += [f"- {r['label']}: `{r['run_dir']}`" for r in results]
    lines += ["", "![loss curves](loss.png)", ""]
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


def plot(runs: list[Run], base: Run, window: int, warmup: int, threshold: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_rel, ax_tps) = plt.subplots(
        3, 1, figsize=(8, 9), sharex=True, gridspec_kw={"height_ratios": [3, 1.5, 1.5]}
    )
    colors = ["black"] + [plt.get_cmap("tab10")(i % 10) for i in range(len(runs))]
    ordered = [base] + [r for r in runs if r is not base]
    base_smoothed = smoothed_loss(base, window)
    top, deviations = [], [threshold]
    for run, color in zip(ordered, colors, strict=False):
        steps = list(run.train)
        smoothed = smoothed_loss(run, window)
        ax_loss.plot(steps, [r["loss"] for r in run.train.values()], color=color, lw=0.5, alpha=0.35)
        ax_loss.plot(steps, list(smoothed.values()), color=color, lw=1.5, label=f"{run.label} (train, smoothed)")
        if run.val:
            ax_loss.plot(list(run.val), list(run.val.values()), "o", ms=4, color=color, label=f"{run.label} (val)")
        # Zoom past the initial drop, so that small differences show.
        late = [v for s, v in [*smoothed.items(), *run.val.items()] if s > steps[-1] * 0.1]
        top += late or list(smoothed.values())
        if run is not base:
            common = [s for s in smoothed if s in base_smoothed]
            diff = [100 * rel(smoothed[s], base_smoothed[s]) for s in common]
            ax_rel.plot(common, diff, color=color, lw=1.2, label=run.label)
            deviations += [abs(d) / 100 for s, d in zip(common, diff, strict=True) if s > warmup]
        tps = [(s, r["tokens_per_sec"]) for s, r in run.train.items() if s not in run.launch_starts]
        tps = [(s, v) for s, v in tps if v is not None]
        if tps:
            ax_tps.plot(*zip(*tps, strict=True), color=color, lw=1, label=run.label)
    finite = [v for v in top if math.isfinite(v)]
    if finite:
        lo, hi = min(finite), max(finite)
        ax_loss.set_ylim(lo - 0.05 * (hi - lo + 1e-9), hi + 0.1 * (hi - lo + 1e-9))
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(f"vs {base.label}; train loss smoothed over {plural(window, 'step')}", fontsize=10)
    ax_loss.legend(fontsize=7, ncol=2)
    ax_rel.axhspan(-100 * threshold, 100 * threshold, color="tab:green", alpha=0.12, lw=0)
    ax_rel.axhline(0, color="black", lw=0.8)
    finite = [d for d in deviations if math.isfinite(d)]
    ax_rel.set_ylim(-120 * max(finite), 120 * max(finite))  # early-training gaps would hide the rest
    ax_rel.set_ylabel(f"% vs {base.label}\n(smoothed train)", fontsize=8)
    ax_tps.set_ylabel("tokens/s per GPU", fontsize=8)
    ax_tps.set_xlabel("step")
    ax_tps.set_ylim(bottom=0)
    for ax in (ax_loss, ax_rel, ax_tps):
        ax.grid(alpha=0.3)
    if len(ordered) > 1:
        ax_rel.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def choose_baseline(runs: list[Run], baseline_dir: Path | None) -> Run:
    if baseline_dir is not None:
        return next(r for r in runs if r.path.resolve() == baseline_dir.resolve())
    return next((r for r in runs if r.recipe == "none"), runs[0])


def unique_labels(runs: list[Run]) -> None:
    """Two runs of one config would read alike: add their directory names."""
    twins = [run for run in runs if sum(r.label == run.label for r in runs) > 1]
    for run in twins:
        run.label = f"{run.label} ({run.path.name})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, required=True, help="directory for loss.png, summary.md, summary.json")
    parser.add_argument("--baseline", type=Path, help="the run to compare against (default: the bf16 run)")
    parser.add_argument("--threshold", type=float, default=0.005, help="parity: max |relative delta| (0.005)")
    parser.add_argument("--warmup-steps", type=int, help="max deviation counts after this step (default: config)")
    parser.add_argument("--smooth", type=int, help="moving-average window in steps (default: 5%% of the steps)")
    args = parser.parse_args(argv)

    dirs = list(dict.fromkeys(args.runs))  # the same directory twice is one run
    if args.baseline is not None and all(d.resolve() != args.baseline.resolve() for d in dirs):
        dirs.insert(0, args.baseline)
    try:
        if len(dirs) < 2:
            raise CompareError("need at least two runs: a baseline and one to compare")
        if args.smooth is not None and args.smooth < 1:
            raise CompareError(f"--smooth must be at least 1, got {args.smooth}")
        runs = [read_run(d) for d in dirs]
        unique_labels(runs)
        base = choose_baseline(runs, args.baseline)
        window = args.smooth or max(1, round(0.05 * next(reversed(base.train))))
        warmup = args.warmup_steps if args.warmup_steps is not None else (base.warmup_steps or 0)
        results = [compare(r, base, window, warmup, args.threshold) for r in runs]
    except CompareError as e:
        print(f"compare_runs: error: {e}", file=sys.stderr)
        return 2

    verdict = verdict_line(results, args.threshold)
    meta = {
        "baseline": base.label,
        "threshold": args.threshold,
        "smooth_steps": window,
        "warmup_steps": warmup,
        "verdict": verdict,
        "parity": verdict.startswith("PARITY PASS"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    plot(runs, base, window, warmup, args.threshold, args.out / "loss.png")
    (args.out / "summary.md").write_text(summary_markdown(results, meta, verdict))
    (args.out / "summary.json").write_text(json.dumps(json_safe({**meta, "runs": results}), indent=2) + "\n")

    print(f"wrote {args.out / 'loss.png'}, {args.out / 'summary.md'}, {args.out / 'summary.json'}")
    for r in results:
        if not r["is_baseline"]:
            print(f"{r['parity']}: {verdict_part(r, results[runs.index(base)], args.threshold)}")
    print(verdict)  # the last line: the one-line verdict
    return 0


if __name__ == "__main__":
    sys.exit(main())
