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


# --- torchtitan runs: its log lines and its tensorboard scalars ---


def torchtitan_config(recipe: str, steps: int = 100) -> dict:
    """The part of torchtitan 0.2's job config (JobConfig.to_dict()) compare_runs reads, and a few more fields."""
    config = {
        "job": {"dump_folder": f"outputs/torchtitan/llama3_8b_{recipe}", "print_config": True},
        "metrics": {"log_freq": 10, "enable_tensorboard": True, "save_tb_folder": "tb"},
        "model": {"name": "llama3", "flavor": "8B", "converters": [] if recipe == "bf16" else ["mx"]},
        "lr_scheduler": {"warmup_steps": 20},
        "training": {"steps": steps, "seq_len": 8192, "local_batch_size": 2},
        "debug": {"seed": 0},
        "checkpoint": {"enable": False},
    }
    if recipe != "bf16":
        config["mx"] = {"recipe": recipe, "skip": ["lm_head", "output", "*router.gate"]}
    return config


def torchtitan_records(scale: float, tps: float, mfu: float, steps: int = 100) -> list[dict]:
    """Records as torchtitan logs them with metrics.log_freq 10: step 1 (start-up, compile) and every tenth step."""
    records = []
    for step in [1, *range(10, steps + 1, 10)]:
        slow = 20 if step == 1 else 1 + 0.01 * (step % 3)
        records.append({"step": step, "loss": loss_curve(step, scale), "tps": tps / slow, "mfu": mfu / slow,
                        "memory": 60.5, "grad_norm": 1.5})  # fmt: skip
    return records


def torchtitan_log_line(r: dict, rank: int | None = None, color: bool = False) -> str:
    """torchtitan 0.2.2's step line (MetricsProcessor.log), as its logger prints it; under torchrun "[rankN]:" first."""
    red, reset = ("\x1b[31m", "\x1b[39m") if color else ("", "")
    tflops = r["mfu"] * 9.89
    line = (
        f"[titan] 2026-11-27 10:00:00,000 - root - INFO - {red}step: {r['step']:2}  loss: {r['loss']:8.5f}  "
        f"grad_norm: {r['grad_norm']:7.4f}  memory: {r['memory']:5.2f}GiB({r['memory'] / 1.4:.2f}%)  "
        f"tps: {round(r['tps']):,}  tflops: {tflops:,.2f}  mfu: {r['mfu']:.2f}%{reset}"
    )
    return line if rank is None else f"[rank{rank}]:{line}"


def write_torchtitan_log(path: Path, recipe: str, records: list[dict], ranks: int = 1, color: bool = False) -> Path:
    """A torchtitan log as torchrun --local-ranks-filter 0 (ranks 1) or all ranks (ranks > 1) writes it."""
    prefix = [None] if ranks == 1 else list(range(ranks))
    lines = []
    for rank in prefix:
        tag = "" if rank is None else f"[rank{rank}]:"
        lines.append(f"{tag}[titan] 2026-11-27 10:00:00,000 - root - INFO - Starting job: Llama 3 8B dims, {recipe}")
        body = "Running with configs: " + json.dumps(torchtitan_config(recipe), indent=2)
        lines += [f"{tag}[titan] 2026-11-27 10:00:00,000 - root - INFO - {x}" if i == 0 else f"{tag}{x}"
                  for i, x in enumerate(body.splitlines())]  # fmt: skip
    for r in records:
        for rank in prefix:
            other = dict(r, tps=r["tps"] * (1 if not rank else 0.5))  # other ranks' figures differ
            lines.append(torchtitan_log_line(other, rank, color))
    lines.append("[titan] 2026-11-27 10:01:00,000 - root - INFO - Training completed")
    path.write_text("\n".join(lines) + "\n")
    return path


def write_torchtitan_events(dump_folder: Path, recipe: str, records: list[dict], launches: int = 1) -> Path:
    """A torchtitan dump folder: the scalars its TensorBoardLogger writes, <dump>/tb/<date-time>/ for each launch,
    and the job config of job.save_config_file."""
    from torch.utils.tensorboard import SummaryWriter

    dump_folder.mkdir(parents=True)
    (dump_folder / "config.json").write_text(json.dumps(torchtitan_config(recipe), indent=2))
    cut = len(records) // launches
    for i in range(launches):
        writer = SummaryWriter(str(dump_folder / "tb" / f"20261127-10{i:02d}"))
        for r in records[i * cut : None if i == launches - 1 else (i + 1) * cut]:
            scalars = {"loss_metrics/global_avg_loss": r["loss"], "loss_metrics/global_max_loss": r["loss"] + 0.1,
                       "grad_norm": r["grad_norm"], "throughput(tps)": r["tps"], "tflops": r["mfu"] * 9.89,
                       "mfu(%)": r["mfu"], "memory/max_reserved(GiB)": r["memory"]}  # fmt: skip
            for tag, value in scalars.items():
                writer.add_scalar(tag, value, r["step"])
        writer.close()
    return dump_folder


TORCHTITAN_VERDICT = (
    "PARITY INCONCLUSIVE: llama3 8B mxfp8 vs llama3 8B bf16: no verdict: no validation loss at a step every run "
    "logged (set validation.enable true); one run per arm: a confidence interval needs two or more seeds of each"
)


def test_torchtitan_logs_compare_as_our_runs(tmp_path, capsys):
    bf16 = write_torchtitan_log(tmp_path / "llama3_8b_bf16.log", "bf16", torchtitan_records(1.0, 9000, 40.0))
    mx = write_torchtitan_log(tmp_path / "llama3_8b_mxfp8.log", "mxfp8", torchtitan_records(1.002, 6000, 27.0))
    rc, lines, err = run_main(capsys, mx, bf16, "--out", tmp_path / "cmp")  # the bf16 run is the baseline
    assert rc == 0, err
    assert lines[-1] == TORCHTITAN_VERDICT and verdict_lines(lines) == [lines[-1]]
    result = summary(tmp_path / "cmp")
    base, arm = sorted(result["arms"], key=lambda a: not a["is_baseline"])
    assert base["label"] == "llama3 8B bf16" and arm["label"] == "llama3 8B mxfp8" and arm["mx_recipe"] == "mxfp8"
    # medians over steps 10..100: step 1's record, start-up and compile, is left out
    tps = [round(9000 / (1 + 0.01 * (s % 3))) for s in range(10, 101, 10)]
    assert base["median_tokens_per_sec"] == statistics.median(tps)
    mfu = [round(40 / (1 + 0.01 * (s % 3)), 2) for s in range(10, 101, 10)]
    assert compare_runs.median_of(compare_runs.read_run(bf16), "mfu") == pytest.approx(statistics.median(mfu))
    assert arm["max_rel_deviation_after_warmup"] == pytest.approx(0.002, rel=1e-3)
    assert arm["peak_memory_gib"] == 60.5
    assert any(line.startswith("| llama3 8B mxfp8 |") and "| 5,941 | 0.667x | 60.50 |" in line for line in lines)


def test_a_torchtitan_log_of_every_rank_with_colors_reads_rank_0(tmp_path, capsys):
    records = torchtitan_records(1.0, 9000, 40.0)
    one = compare_runs.read_run(write_torchtitan_log(tmp_path / "a.log", "bf16", records))
    every = compare_runs.read_run(write_torchtitan_log(tmp_path / "b.log", "bf16", records, ranks=2, color=True))
    assert every.train == one.train and list(one.train) == [1, *range(10, 101, 10)]
    mfu = 40 / 1.02
    assert one.train[20] == {"step": 20, "loss": round(loss_curve(20), 5), "tokens_per_sec": round(9000 / 1.02),
                             "memory_gib": 60.5, "tflops": round(mfu * 9.89, 2), "mfu": round(mfu, 2)}  # fmt: skip
    assert one.launch_starts == {1} and one.seed == 0 and one.warmup_steps == 20 and one.steps == 100


def test_torchtitan_tensorboard_events_read_as_its_log(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    bf16, mx = torchtitan_records(1.0, 9000, 40.0), torchtitan_records(1.002, 6000, 27.0)
    dumps = [write_torchtitan_events(tmp_path / "llama3_8b_bf16", "bf16", bf16),
             write_torchtitan_events(tmp_path / "llama3_8b_mxfp8", "mxfp8", mx, launches=2)]  # fmt: skip
    logs = [write_torchtitan_log(tmp_path / "bf16.log", "bf16", bf16),
            write_torchtitan_log(tmp_path / "mx.log", "mxfp8", mx)]  # fmt: skip
    from_tb = compare_runs.read_run(dumps[0])
    assert from_tb.label == "llama3 8B bf16" and from_tb.recipe == "none" and from_tb.launch_starts == {1}
    assert compare_runs.read_run(dumps[1]).launch_starts == {1, 50}  # a second launch: its first record's start-up
    from_log = compare_runs.read_run(logs[0])
    assert list(from_tb.train) == list(from_log.train)
    for step, record in from_tb.train.items():  # the log rounds what the events hold
        assert record == pytest.approx(from_log.train[step], rel=1e-3)
    rc, lines, err = run_main(capsys, *dumps, "--out", tmp_path / "cmp")
    assert rc == 0 and lines[-1] == TORCHTITAN_VERDICT, err
    rc, lines, err = run_main(capsys, dumps[0], logs[1], "--out", tmp_path / "cmp2")  # a folder and a log
    assert rc == 0 and lines[-1] == TORCHTITAN_VERDICT, err


def test_a_torchtitan_log_without_step_lines_is_an_error(tmp_path, capsys):
    bf16 = write_torchtitan_log(tmp_path / "bf16.log", "bf16", torchtitan_records(1.0, 9000, 40.0))
    empty = tmp_path / "crashed.log"
    empty.write_text("[titan] 2026-11-27 10:00:00,000 - root - INFO - Starting job: x\nTraceback (most recent ...\n")
    rc, _, err = run_main(capsys, bf16, empty, "--out", tmp_path / "cmp")
    assert rc == 2 and "crashed.log: no torchtitan training records" in err
