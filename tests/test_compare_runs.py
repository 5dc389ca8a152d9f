"""scripts/compare_runs.py on metrics files written here, with known answers, and scripts/parity.sh on the CPU.

Made-up arms: every seed k has its own bf16 curve (a seed-level offset); an MX arm is that curve times
(1 + shift) times (1 + noise_k), so the paired differences are exactly (1 + shift)(1 + noise_k) - 1.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "compare_runs.py"
_spec = importlib.util.spec_from_file_location("compare_runs", SCRIPT)
compare_runs = importlib.util.module_from_spec(_spec)
sys.modules["compare_runs"] = compare_runs  # dataclasses look their module up there
_spec.loader.exec_module(compare_runs)

SEED_OFFSET = [0.0, 0.004, -0.003, 0.006, -0.005]  # bf16 seed-to-seed spread: about half a percent
SMALL_NOISE = [0.0003, -0.0002, 0.0001, -0.0004, 0.0002]  # mean 0: the paired differences average to the shift
VERDICT_WORDS = ("PASS", "FAIL", "INCONCLUSIVE")


def loss_curve(step: int, scale: float = 1.0) -> float:
    # A falling curve with a deterministic wiggle, so that smoothing has something to do.
    return scale * (2.0 + 4.0 * math.exp(-step / 40) + 0.05 * math.sin(step))


def write_run(
    run_dir: Path,
    recipe: str,
    scale: float = 1.0,
    seed: int | None = 0,
    tokens_per_sec: float = 1000.0,
    steps: int = 200,
    val: bool = True,
    memory: float = 1.0,
    config: bool = True,
    warmup: int = 10,
    extra_config: str = "",
) -> Path:
    """A train.py-like run directory: config.toml and metrics.jsonl logged every 5 steps, val every 50."""
    run_dir.mkdir(parents=True)
    if config:
        job = f'[job]\ndescription = "debug Llama, {recipe}"\noutput_dir = "{run_dir}"\n'
        job += "" if seed is None else f"seed = {seed}\n"
        (run_dir / "config.toml").write_text(
            f'# written 2026-11-27\n{job}\n[model]\nname = "llama"\nflavor = "debug"\n\n'
            f'[training]\nwarmup_steps = {warmup}\n{extra_config}\n[mx]\nrecipe = "{recipe}"\n'
        )
    lines = []
    for i, step in enumerate([1, *range(5, steps + 1, 5)]):
        tps = tokens_per_sec / 10 if step == 1 else tokens_per_sec * (1 + 0.01 * (i % 3))  # step 1: start-up
        lines.append(train_record(step, loss_curve(step, scale), tps, memory, elapsed=float(step)))
        if val and step % 50 == 0:
            lines.append({"step": step, "val_loss": (loss_curve(step) + 0.1) * scale, "time": 0.0})
    with open(run_dir / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in lines)
    return run_dir


def train_record(step: int, loss: float, tps: float, memory: float = 1.0, elapsed: float = 0.0) -> dict:
    return {
        "step": step,
        "loss": loss,
        "tokens_per_sec": tps,
        "tflops": 1.0,
        "mfu": None,
        "memory_gib": memory,
        "time": 0.0,
        "elapsed_s": elapsed,
        "lr": 1e-3,
        "grad_norm": 1.0,
    }


def write_sweep(out: Path, arms: dict[str, tuple[str, float, list[float]]], seeds: int = 5, **kw) -> Path:
    """A parity_sweep layout, out/<name>/seed<k>/: arm name -> (recipe, shift, per-seed noise)."""
    for name, (recipe, shift, noise) in arms.items():
        for k in range(seeds):
            scale = (1 + SEED_OFFSET[k]) * (1 + shift) * (1 + noise[k])
            write_run(out / name / f"seed{k}", recipe, scale=scale, seed=k, **kw)
    return out


def run_main(capsys, *argv: object) -> tuple[int, list[str], str]:
    rc = compare_runs.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out.splitlines(), captured.err


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def verdict_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if any(word in line for word in VERDICT_WORDS)]


# --- the t quantile ---

# Two-sided 95%: t(0.975, df), df = 1..30, from the standard tables.
T975 = [12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788, 2.1604,
        2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555,
        2.0518, 2.0484, 2.0452, 2.0423]  # fmt: skip


def test_t_quantile_matches_the_tables():
    for df, value in enumerate(T975, 1):
        assert compare_runs.t_quantile(0.975, df) == pytest.approx(value, abs=1e-4), df
    assert compare_runs.t_quantile(0.95, 1) == pytest.approx(6.3138, abs=1e-4)
    assert compare_runs.t_quantile(0.995, 4) == pytest.approx(4.6041, abs=1e-4)
    with pytest.raises(ValueError, match="df >= 1"):
        compare_runs.t_quantile(0.975, 0)


def test_t_quantile_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in range(1, 61):
        for p in (0.6, 0.9, 0.975, 0.999):
            assert compare_runs.t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), abs=1e-9)


# --- verdicts on made-up curves with a known answer ---


def test_shifted_copy_inside_the_threshold_passes_with_its_interval(tmp_path, capsys):
    sweep = write_sweep(tmp_path / "sweep", {"bf16": ("none", 0.0, [0.0] * 5), "mxfp8": ("mxfp8", 0.002, SMALL_NOISE)})
    out = tmp_path / "cmp"
    rc, lines, _ = run_main(capsys, sweep, "--out", out)
    assert rc == 0
    arm = summary(out)["arms"][1]
    deltas = [1.002 * (1 + e) - 1 for e in SMALL_NOISE]  # exactly, since every seed's bf16 curve cancels
    half = 2.7764451052 * statistics.stdev(deltas) / math.sqrt(5)  # t(0.975, 4)
    assert arm["pairs"] == 5 and arm["compared_at_step"] == 200
    assert arm["delta_rel_mean"] == pytest.approx(statistics.fmean(deltas), abs=1e-12)
    assert arm["delta_rel_ci"] == pytest.approx([arm["delta_rel_mean"] - half, arm["delta_rel_mean"] + half], abs=1e-9)
    assert arm["verdict"] == "PASS" and summary(out)["verdict"] == "PASS"
    assert lines[-1].startswith("PARITY PASS: debug mxfp8 vs debug bf16: final val loss +0.20%, 95% CI +0.1")
    assert "(5 seeds, step 200); the interval lies within +-0.50%" in lines[-1]
    assert verdict_lines(lines) == [lines[-1]]  # printed once


def test_shifted_copy_well_outside_the_threshold_fails(tmp_path, capsys):
    sweep = write_sweep(tmp_path / "sweep", {"bf16": ("none", 0.0, [0.0] * 5), "mxfp4": ("mxfp4", 0.02, SMALL_NOISE)})
    rc, lines, _ = run_main(capsys, sweep, "--out", tmp_path / "cmp")
    arm = summary(tmp_path / "cmp")["arms"][1]
    assert rc == 0 and arm["verdict"] == "FAIL" and arm["delta_rel_ci"][0] > 0.005
    assert lines[-1].startswith("PARITY FAIL: debug mxfp4 vs debug bf16: final val loss +2.00%")
    assert lines[-1].endswith("the interval lies outside +-0.50%") and verdict_lines(lines) == [lines[-1]]


def test_pure_noise_with_a_large_spread_is_inconclusive(tmp_path, capsys):
    noise = [0.02, -0.015, 0.01, -0.02, 0.005]  # mean 0, sd 1.6%: the interval spans about +-2%
    sweep = write_sweep(tmp_path / "sweep", {"bf16": ("none", 0.0, [0.0] * 5), "mxfp8": ("mxfp8", 0.0, noise)})
    rc, lines, _ = run_main(capsys, sweep, "--out", tmp_path / "cmp")
    arm = summary(tmp_path / "cmp")["arms"][1]
    assert rc == 0 and arm["verdict"] == "INCONCLUSIVE"
    lo, hi = arm["delta_rel_ci"]
    assert lo < -0.005 and hi > 0.005 and abs(arm["delta_rel_mean"]) < 0.005
    assert lines[-1].startswith("PARITY INCONCLUSIVE: debug mxfp8 vs debug bf16: final val loss")
    assert "the interval crosses" in lines[-1] and verdict_lines(lines) == [lines[-1]]


def test_a_shift_the_seed_noise_cannot_resolve_is_inconclusive_not_pass(tmp_path, capsys):
    """+0.3% with 1% seed noise on three seeds: inside the threshold on average, but not shown to be."""
    noise = [0.01, -0.01, 0.0, 0.0, 0.0]
    sweep = write_sweep(tmp_path / "s", {"bf16": ("none", 0.0, [0.0] * 5), "mxfp8": ("mxfp8", 0.003, noise)}, seeds=3)
    run_main(capsys, sweep, "--out", tmp_path / "cmp")
    arm = summary(tmp_path / "cmp")["arms"][1]
    assert arm["delta_rel_mean"] == pytest.approx(0.003, abs=1e-9) and arm["verdict"] == "INCONCLUSIVE"


def test_single_run_per_arm_gives_no_verdict(tmp_path, capsys):
    bf16 = write_run(tmp_path / "bf16", "none")
    mx = write_run(tmp_path / "mx", "mxfp8", scale=1.001)  # would have been "PARITY PASS" once
    rc, lines, _ = run_main(capsys, bf16, mx, "--out", tmp_path / "cmp")
    assert rc == 0
    assert lines[-1] == (
        "PARITY INCONCLUSIVE: debug mxfp8 vs debug bf16: final val loss +0.10% (1 seed, step 200); no verdict: "
        "one run per arm: a confidence interval needs two or more seeds of each"
    )
    assert verdict_lines(lines) == [lines[-1]]
    arm = summary(tmp_path / "cmp")["arms"][1]
    assert arm["delta_rel_ci"] is None and arm["delta_rel_sd"] is None and arm["pairs"] == 1


def test_no_validation_loss_gives_no_verdict(tmp_path, capsys):
    sweep = write_sweep(
        tmp_path / "s", {"bf16": ("none", 0.0, [0.0] * 5), "mxfp8": ("mxfp8", 0.0, SMALL_NOISE)}, val=False
    )
    rc, lines, _ = run_main(capsys, sweep, "--out", tmp_path / "cmp")
    assert rc == 0
    assert lines[-1] == (
        "PARITY INCONCLUSIVE: debug mxfp8 vs debug bf16: no verdict: no validation loss at a step every run "
        "logged (set validation.enable true)"
    )
    arm = summary(tmp_path / "cmp")["arms"][1]
    assert arm["compared_at_step"] is None and arm["delta_rel_mean"] is None and arm["max_rel_deviation_after_warmup"]


def test_before_the_warmup_ends_gives_no_verdict(tmp_path, capsys):
    arms = {"bf16": ("none", 0.0, [0.0] * 5), "mxfp8": ("mxfp8", 0.0, SMALL_NOISE)}
    sweep = write_sweep(tmp_path / "s", arms, steps=100, warmup=100)
    rc, lines, _ = run_main(capsys, sweep, "--out", tmp_path / "cmp")
    assert rc == 0 and lines[-1].startswith("PARITY INCONCLUSIVE: debug mxfp8 vs debug bf16: final val loss")
    assert lines[-1].endswith(
        "no verdict: the final validation, step 100, is not past the warm-up (training.warmup_steps 100)"
    )
    # --warmup-steps overrides the configs.
    run_main(capsys, sweep, "--out", tmp_path / "cmp2", "--warmup-steps", "50")
    assert summary(tmp_path / "cmp2")["arms"][1]["verdict"] == "PASS"


def test_a_run_cut_short_gives_no_verdict(tmp_path, capsys):
    """A run stopped by a time limit logged fewer steps than its config asks: its last loss is not the final one."""
    arms = {"bf16": ("none", 0.0, [0.0] * 5), "mxfp8": ("mxfp8", 0.0, SMALL_NOISE)}
    sweep = write_sweep(tmp_path / "s", arms, seeds=2, extra_config="steps = 200\n")
    (sweep / "mxfp8" / "seed1").rename(tmp_path / "full")
    write_run(sweep / "mxfp8" / "seed1", "mxfp8", seed=1, steps=150, extra_config="steps = 200\n")
    rc, lines, _ = run_main(capsys, sweep, "--out", tmp_path / "cmp")
    assert rc == 0 and lines[-1].startswith("PARITY INCONCLUSIVE: debug mxfp8 vs debug bf16: final val loss")
    assert lines[-1].endswith("no verdict: not every run finished (debug mxfp8 seed 1 stopped at step 150 of 200)")


def test_two_short_runs_without_validation_name_every_reason(tmp_path, capsys):
    """What a new user tries first: two 40-step runs, no validation, warm-up 50."""
    bf16 = write_run(tmp_path / "bf16", "none", steps=40, val=False, warmup=50)
    mx = write_run(tmp_path / "mx", "mxfp8", scale=1.003, steps=40, val=False, warmup=50)
    rc, lines, _ = run_main(capsys, bf16, mx, "--out", tmp_path / "cmp")
    assert rc == 0 and verdict_lines(lines) == [lines[-1]]
    assert lines[-1] == (
        "PARITY INCONCLUSIVE: debug mxfp8 vs debug bf16: no verdict: no validation loss at a step every run logged "
        "(set validation.enable true); the last common step, step 40, is not past the warm-up "
        "(training.warmup_steps 50); one run per arm: a confidence interval needs two or more seeds of each"
    )


def test_a_diverged_arm_fails(tmp_path, capsys):
    sweep = write_sweep(
        tmp_path / "s", {"bf16": ("none", 0.0, [0.0] * 5), "mxfp4": ("mxfp4", 0.0, SMALL_NOISE)}, seeds=2
    )
    with open(sweep / "mxfp4" / "seed1" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 200, "val_loss": float("nan")}) + "\n")  # json writes NaN
    rc, lines, _ = run_main(capsys, sweep, "--out", tmp_path / "cmp")
    assert rc == 0 and lines[-1].endswith("non-finite final validation loss (seeds [1])")
    assert lines[-1].startswith("PARITY FAIL") and summary(tmp_path / "cmp")["arms"][1]["delta_rel_mean"] is None


# --- the report: one verdict, the same fields printed and in JSON ---


def test_several_arms_one_verdict_line_and_the_same_fields_as_json(tmp_path, capsys):
    arms = {
        "bf16": ("none", 0.0, [0.0] * 5),
        "mxfp8": ("mxfp8", 0.001, SMALL_NOISE),
        "mxfp4": ("mxfp4", 0.03, SMALL_NOISE),
    }
    sweep = write_sweep(tmp_path / "sweep", arms, seeds=3)
    out = tmp_path / "cmp"
    rc, lines, _ = run_main(capsys, sweep, "--out", out)
    assert rc == 0 and verdict_lines(lines) == [lines[-1]]
    assert lines[-1].startswith("PARITY FAIL: debug mxfp4 vs debug bf16 [FAIL]: final val loss +3.0")
    assert " | debug mxfp8 vs debug bf16 [PASS]: final val loss +0.1" in lines[-1]
    data = summary(out)
    assert data["verdict"] == "FAIL" and data["verdict_line"] == lines[-1] and data["baseline"] == "debug bf16"
    assert "t(0.975, n-1)" in data["method"] and data["confidence"] == 0.95
    printed = "\n".join(lines)
    base = data["arms"][0]
    assert base["is_baseline"] and base["seeds"] == [0, 1, 2] and base["final_val_step"] == 200
    values = [(loss_curve(200) + 0.1) * (1 + SEED_OFFSET[k]) for k in range(3)]
    assert base["final_val_loss_std"] == pytest.approx(statistics.stdev(values))
    assert (base["final_val_loss_min"], base["final_val_loss_max"]) == pytest.approx((min(values), max(values)))
    row = f"| debug bf16 (baseline) | 0, 1, 2 | 200 | {base['final_val_loss_mean']:.4f} | "
    row += f"{base['final_val_loss_std']:.4f} | {min(values):.4f} | {max(values):.4f} | "
    assert row in printed
    for arm in data["arms"][1:]:
        lo, hi = arm["delta_rel_ci"]
        alo, ahi = arm["delta_abs_ci"]
        assert (
            f"| {arm['label']} | 0, 1, 2 | 200 | {arm['delta_rel_mean']:+.2%} | [{lo:+.2%}, {hi:+.2%}] | "
            f"{arm['delta_rel_sd']:.2%} | {arm['delta_abs_mean']:+.4f} | [{alo:+.4f}, {ahi:+.4f}] | "
            f"{arm['max_rel_deviation_after_warmup']:.2%} |"
        ) in printed
        assert f"{arm['label']} vs debug bf16 [{arm['verdict']}]" in lines[-1] and arm["reason"] in lines[-1]
    md = (out / "summary.md").read_text()
    assert lines[-1] in md and all(line in md for line in lines if line.startswith("|"))
    png = (out / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG") and 1000 < len(png) < 300_000
    # One record per run, for tables of single runs.
    runs = data["runs"]
    assert len(runs) == 9 and runs[3]["label"] == "debug mxfp4 seed 0"
    assert runs[3]["rel_delta"] == pytest.approx(1.03 * (1 + SMALL_NOISE[0]) - 1)


def test_a_sweep_folder_reads_as_its_runs_listed_one_by_one(tmp_path, capsys):
    sweep = write_sweep(tmp_path / "sweep", {"bf16": ("none", 0.0, [0.0] * 5), "mxfp8": ("mxfp8", 0.002, SMALL_NOISE)})
    run_main(capsys, sweep, "--out", tmp_path / "a")
    dirs = sorted(sweep.glob("*/seed*"), key=lambda p: (p.name, p.parent.name))  # any order
    run_main(capsys, *dirs, "--out", tmp_path / "b")
    a, b = summary(tmp_path / "a"), summary(tmp_path / "b")
    assert a["arms"][1]["delta_rel_ci"] == b["arms"][1]["delta_rel_ci"] and a["verdict"] == b["verdict"] == "PASS"
    assert b["arms"][0]["label"] == "debug bf16" and b["arms"][0]["seeds"] == [0, 1, 2, 3, 4]


def test_tokens_per_sec_and_memory(tmp_path, capsys):
    bf16 = write_run(tmp_path / "bf16", "none", memory=2.0)
    mx = write_run(tmp_path / "mx", "mxfp8", tokens_per_sec=930.0, memory=2.5)
    run_main(capsys, bf16, mx, "--out", tmp_path / "cmp")
    base, arm = summary(tmp_path / "cmp")["arms"]
    assert arm["tokens_per_sec_ratio"] == pytest.approx(0.93)  # the start-up record at step 1 left out
    assert base["peak_memory_gib"] == 2.0 and arm["peak_memory_gib"] == 2.5


def test_resumed_run_last_record_of_a_step_wins(tmp_path, capsys):
    bf16 = write_run(tmp_path / "bf16", "none")
    mx = write_run(tmp_path / "mx", "mxfp8", tokens_per_sec=900.0)
    # A first launch logged steps 1..120 and was stopped; the resume from the step-100 checkpoint
    # logged steps 105..200 again: the file holds 105..120 twice, the first time with other numbers.
    good = [json.loads(line) for line in (mx / "metrics.jsonl").read_text().splitlines()]
    first = [r for r in good if r["step"] <= 100] + [train_record(s, 50.0, 1.0, elapsed=s) for s in range(105, 121, 5)]
    resumed = [r for r in good if r["step"] > 100]
    resumed[0]["tokens_per_sec"] = 1.0  # the first record of a launch includes its start-up
    resumed[0]["elapsed_s"] = 0.5
    with open(mx / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in [*first, *resumed])
    rc, _, _ = run_main(capsys, bf16, mx, "--out", tmp_path / "cmp", "--warmup-steps", "100")
    arm = summary(tmp_path / "cmp")["arms"][1]
    assert rc == 0 and arm["delta_rel_mean"] == pytest.approx(0.0)
    assert arm["max_rel_deviation_after_warmup"] == pytest.approx(0.0)
    assert arm["tokens_per_sec_ratio"] == pytest.approx(0.9)  # neither launch's first record counted


def test_baseline_selection(tmp_path, capsys):
    arms = {
        "mxfp8": ("mxfp8", 0.01, SMALL_NOISE),
        "bf16": ("none", 0.0, [0.0] * 5),
        "rceil": ("mxfp8_rceil", 0, [0] * 5),
    }
    sweep = write_sweep(tmp_path / "s", arms, seeds=2)
    # The bf16 arm is the baseline wherever it stands.
    run_main(capsys, sweep / "mxfp8", sweep / "bf16", "--out", tmp_path / "a")
    assert summary(tmp_path / "a")["baseline"] == "debug bf16"
    # --baseline (a folder of runs) wins, and need not be in the list.
    rc, lines, _ = run_main(capsys, sweep / "mxfp8", "--baseline", sweep / "rceil", "--out", tmp_path / "b")
    assert rc == 0 and lines[-1].startswith("PARITY FAIL: debug mxfp8 vs debug mxfp8_rceil: final val loss +1.0")
    # No bf16 arm and no --baseline: the first.
    run_main(capsys, sweep / "rceil", sweep / "mxfp8", "--out", tmp_path / "c")
    assert summary(tmp_path / "c")["baseline"] == "debug mxfp8_rceil"


def test_arms_are_configs_and_one_seed_twice_splits_by_folder(tmp_path, capsys):
    """A rerun of one seed in its own folder (a noise-floor run) is its own arm, labelled by its folder;
    runs without a config are told apart by folder, their seed read from a seed<k> name."""
    one = write_run(tmp_path / "bf16", "none")
    two = write_run(tmp_path / "bf16_2gpu", "none", scale=1.001)
    other = write_run(tmp_path / "bf16_lr", "none", extra_config="lr = 1e-3\n")
    bare = write_run(tmp_path / "bare" / "seed3", "mxfp8", config=False)
    rerun = write_run(tmp_path / "again" / "bf16", "none")  # the same folder name elsewhere
    run_main(capsys, one, two, other, bare, rerun, "--out", tmp_path / "cmp")
    arms = summary(tmp_path / "cmp")["arms"]
    labels = [a["label"] for a in arms]
    assert labels[1:] == ["debug bf16 (bf16_2gpu)", "debug bf16 (again/bf16)", "debug bf16 (bf16_lr)", "bare"]
    assert labels[0] == f"debug bf16 ({tmp_path.name}/bf16)"
    assert arms[4]["seeds"] == [3] and arms[4]["pairs"] == 0 and "no seed in both arms" in arms[4]["reason"]


def test_errors_exit_nonzero_with_a_message(tmp_path, capsys):
    bf16 = write_run(tmp_path / "bf16", "none")
    rc, _, err = run_main(capsys, bf16, tmp_path / "nowhere", "--out", tmp_path / "cmp")
    assert rc == 2 and "nowhere/metrics.jsonl: no such file" in err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    rc, _, err = run_main(capsys, bf16, tmp_path / "empty", "--out", tmp_path / "cmp")
    assert rc == 2 and "no training records" in err
    (tmp_path / "folder").mkdir()
    rc, _, err = run_main(capsys, bf16, tmp_path / "folder", "--out", tmp_path / "cmp")
    assert rc == 2 and "folder: no metrics.jsonl in it or in its subfolders" in err
    rc, _, err = run_main(capsys, bf16, "--out", tmp_path / "cmp")
    assert rc == 2 and "need at least two arms" in err
    write_run(tmp_path / "arm" / "seed0", "none", seed=0)
    write_run(tmp_path / "arm" / "seed1", "none", seed=0)  # a seed override that contradicts the folder
    rc, _, err = run_main(capsys, bf16, tmp_path / "arm", "--out", tmp_path / "cmp")
    assert rc == 2 and "two runs of one arm with seed 0" in err
    rc, _, err = run_main(capsys, bf16, tmp_path / "arm", "--out", tmp_path / "cmp", "--threshold", "0.5")
    assert rc == 2 and "--threshold is a fraction (0.005 is 0.5%), got 0.5" in err
    assert not (tmp_path / "cmp").exists()


def test_a_partial_line_is_skipped(tmp_path, capsys):
    bf16 = write_run(tmp_path / "bf16", "none")
    mx = write_run(tmp_path / "mx", "mxfp8")
    with open(mx / "metrics.jsonl", "a") as f:
        f.write('{"step": 205, "loss": 2.')  # killed mid-write
    rc, lines, err = run_main(capsys, bf16, mx, "--out", tmp_path / "cmp")
    assert rc == 0 and "skipping an unreadable line" in err and lines[-1].startswith("PARITY INCONCLUSIVE")


def test_cli_verdict_is_the_last_stdout_line_and_printed_once(tmp_path):
    sweep = write_sweep(tmp_path / "sweep", {"bf16": ("none", 0.0, [0.0] * 5), "mxfp8": ("mxfp8", 0.001, SMALL_NOISE)})
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(sweep), "--out", str(tmp_path / "cmp")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("PARITY PASS: debug mxfp8 vs debug bf16: final val loss +0.10%, 95% CI ")
    assert verdict_lines(lines) == [lines[-1]]


def test_parity_sh_on_cpu_writes_a_summary(tmp_path):
    """debug_bf16 against debug_mxfp8 for 6 steps: the same seed and data, so the first losses agree."""
    out = tmp_path / "parity"
    cmd = ["bash", "scripts/parity.sh", "debug_bf16", "debug_mxfp8", "--out", str(out), "--training.steps", "6"]
    cmd += ["--training.seq_len", "64", "--data.max_bytes", "2000000", "--metrics.log_freq", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.splitlines()[-1]
    assert last.startswith("PARITY INCONCLUSIVE: debug mxfp8 vs debug bf16: no verdict: no validation loss")
    assert "one run per arm" in last and verdict_lines(proc.stdout.splitlines()) == [last]
    assert (out / "summary.md").is_file() and (out / "loss.png").stat().st_size > 0
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert [r["label"] for r in runs] == ["debug bf16", "debug mxfp8"]
    assert [Path(r["run_dir"]).relative_to(out).as_posix() for r in runs] == ["debug_bf16/seed0", "debug_mxfp8/seed0"]
    first = [json.loads((Path(r["run_dir"]) / "metrics.jsonl").read_text().splitlines()[0]) for r in runs]
    assert first[0]["step"] == first[1]["step"] == 1
    assert first[0]["loss"] == pytest.approx(first[1]["loss"], rel=0.01)  # one init, one batch; MX rounding only
