"""scripts/compare_runs.py on metrics files written here, and scripts/parity.sh end to end on the CPU."""

from __future__ import annotations

import importlib.util
import json
import math
import os
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


def loss_curve(step: int, scale: float = 1.0) -> float:
    # A falling curve with a deterministic wiggle, so that smoothing has something to do.
    return scale * (2.0 + 4.0 * math.exp(-step / 40) + 0.05 * math.sin(step))


def write_run(
    run_dir: Path,
    recipe: str,
    scale: float = 1.0,
    tokens_per_sec: float = 1000.0,
    steps: int = 200,
    val: bool = True,
    memory: float = 1.0,
    config: bool = True,
) -> Path:
    """A train.py-like run directory: config.toml and metrics.jsonl logged every 5 steps, val every 50."""
    run_dir.mkdir(parents=True)
    if config:
        (run_dir / "config.toml").write_text(
            f'[job]\ndescription = "debug Llama, {recipe}"\noutput_dir = "{run_dir}"\n\n'
            f'[model]\nname = "llama"\nflavor = "debug"\n\n[training]\nwarmup_steps = 10\n\n[mx]\nrecipe = "{recipe}"\n'
        )
    lines = []
    for i, step in enumerate([1, *range(5, steps + 1, 5)]):
        tps = tokens_per_sec / 10 if step == 1 else tokens_per_sec * (1 + 0.01 * (i % 3))  # step 1: start-up
        lines.append(train_record(step, loss_curve(step, scale), tps, memory, elapsed=float(step)))
        if val and step % 50 == 0:
            lines.append({"step": step, "val_loss": loss_curve(step, scale) + 0.1, "time": 0.0})
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


def run_main(capsys, *argv: object) -> tuple[int, list[str], str]:
    rc = compare_runs.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out.splitlines(), captured.err


def test_parity_pass_writes_plot_and_summaries(tmp_path, capsys):
    bf16 = write_run(tmp_path / "bf16", "none", memory=2.0)
    mx = write_run(tmp_path / "mx", "mxfp8", scale=1.002, tokens_per_sec=930.0, memory=2.5)
    out = tmp_path / "cmp"
    rc, lines, _ = run_main(capsys, bf16, mx, "--out", out)
    assert rc == 0
    assert lines[-1].startswith("PARITY PASS: debug mxfp8 final val loss +0.")
    assert "vs debug bf16 (threshold 0.50%), 0.930x tokens/s" in lines[-1]
    png = (out / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG") and 1000 < len(png) < 200_000
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parity"] is True and summary["baseline"] == "debug bf16" and summary["verdict"] == lines[-1]
    assert summary["smooth_steps"] == 10 and summary["warmup_steps"] == 10  # 5% of 200 steps; from config.toml
    base, run = summary["runs"]
    assert base["is_baseline"] and base["peak_memory_gib"] == 2.0 and base["final_val_loss"] is not None
    assert run["compared_on"] == "val_loss" and run["compared_at_step"] == 200
    assert run["rel_delta"] == pytest.approx(1.002 * (loss_curve(200) + 0.1 / 1.002) / (loss_curve(200) + 0.1) - 1)
    assert 0.001 < run["max_rel_deviation_after_warmup"] < 0.003
    assert run["tokens_per_sec_ratio"] == pytest.approx(0.93)  # the start-up record at step 1 left out
    assert run["peak_memory_gib"] == 2.5 and run["parity"] == "PASS"
    md = (out / "summary.md").read_text()
    assert lines[-1] in md and "| debug mxfp8 | 200 |" in md and "loss.png" in md


def test_parity_fail_reports_the_gap(tmp_path, capsys):
    bf16 = write_run(tmp_path / "bf16", "none")
    mx = write_run(tmp_path / "mx", "mxfp4", scale=1.02)
    rc, lines, _ = run_main(capsys, bf16, mx, "--out", tmp_path / "cmp", "--threshold", "0.01")
    assert rc == 0  # a report, not a test: failing parity still exits 0
    assert lines[-1].startswith("PARITY FAIL: debug mxfp4 final val loss +1.9")
    assert "(threshold 1.00%)" in lines[-1]
    assert json.loads((tmp_path / "cmp" / "summary.json").read_text())["runs"][1]["parity"] == "FAIL"


def test_several_runs_name_each_verdict(tmp_path, capsys):
    runs = [
        write_run(tmp_path / "bf16", "none"),
        write_run(tmp_path / "mxfp8", "mxfp8", scale=1.001),
        write_run(tmp_path / "mxfp4", "mxfp4", scale=1.03),
    ]
    rc, lines, _ = run_main(capsys, *runs, "--out", tmp_path / "cmp")
    assert rc == 0
    assert lines[-1].startswith("PARITY FAIL: debug mxfp8 final val loss")
    assert "[PASS]; debug mxfp4" in lines[-1] and lines[-1].endswith("[FAIL]")


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
    rc, lines, _ = run_main(capsys, bf16, mx, "--out", tmp_path / "cmp", "--warmup-steps", "100")
    assert rc == 0 and lines[-1].startswith("PARITY PASS"), lines[-1]
    run = json.loads((tmp_path / "cmp" / "summary.json").read_text())["runs"][1]
    assert run["rel_delta"] == pytest.approx(0.0)
    assert run["max_rel_deviation_after_warmup"] == pytest.approx(0.0)
    assert run["tokens_per_sec_ratio"] == pytest.approx(0.9)  # neither launch's first record counted


def test_missing_validation_falls_back_to_smoothed_train_loss(tmp_path, capsys):
    bf16 = write_run(tmp_path / "bf16", "none")
    mx = write_run(tmp_path / "mx", "mxfp8", scale=1.003, val=False)
    rc, lines, _ = run_main(capsys, bf16, mx, "--out", tmp_path / "cmp", "--smooth", "20")
    assert rc == 0
    assert lines[-1].startswith("PARITY PASS: debug mxfp8 final smoothed train loss +0.30% vs debug bf16")
    summary = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    assert summary["smooth_steps"] == 20
    assert summary["runs"][1]["final_val_loss"] is None and summary["runs"][1]["compared_on"] == "train_loss_smoothed"


def test_baseline_selection(tmp_path, capsys):
    bf16 = write_run(tmp_path / "bf16", "none")
    mx = write_run(tmp_path / "mx", "mxfp8", scale=1.01)
    rceil = write_run(tmp_path / "rceil", "mxfp8_rceil")
    # The bf16 run is the baseline wherever it stands in the list.
    run_main(capsys, mx, bf16, "--out", tmp_path / "a")
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["baseline"] == "debug bf16"
    # --baseline wins, and need not be in the list.
    rc, lines, _ = run_main(capsys, mx, "--baseline", rceil, "--out", tmp_path / "b")
    assert rc == 0 and lines[-1].startswith("PARITY FAIL: debug mxfp8 final val loss +0.9")
    assert "vs debug mxfp8_rceil" in lines[-1]
    # No bf16 run and no --baseline: the first run.
    run_main(capsys, rceil, mx, "--out", tmp_path / "c")
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["baseline"] == "debug mxfp8_rceil"


def test_labels_without_config_and_for_twin_runs(tmp_path, capsys):
    one = write_run(tmp_path / "seed0", "none")
    two = write_run(tmp_path / "seed1", "none", scale=1.001)
    bare = write_run(tmp_path / "bare", "mxfp8", config=False)
    run_main(capsys, one, two, bare, "--out", tmp_path / "cmp")
    labels = [r["label"] for r in json.loads((tmp_path / "cmp" / "summary.json").read_text())["runs"]]
    assert labels == ["debug bf16 (seed0)", "debug bf16 (seed1)", "bare"]


def test_errors_exit_nonzero_with_a_message(tmp_path, capsys):
    bf16 = write_run(tmp_path / "bf16", "none")
    rc, _, err = run_main(capsys, bf16, tmp_path / "nowhere", "--out", tmp_path / "cmp")
    assert rc == 2 and "nowhere/metrics.jsonl: no such file" in err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    rc, _, err = run_main(capsys, bf16, tmp_path / "empty", "--out", tmp_path / "cmp")
    assert rc == 2 and "no training records" in err
    late = tmp_path / "late"
    late.mkdir()
    (late / "metrics.jsonl").write_text(json.dumps(train_record(1001, 2.0, 1.0)) + "\n")
    rc, _, err = run_main(capsys, bf16, late, "--out", tmp_path / "cmp")
    assert rc == 2 and "no common logged step" in err
    rc, _, err = run_main(capsys, bf16, "--out", tmp_path / "cmp")
    assert rc == 2 and "at least two runs" in err
    assert not (tmp_path / "cmp").exists()


def test_a_partial_line_is_skipped(tmp_path, capsys):
    bf16 = write_run(tmp_path / "bf16", "none")
    mx = write_run(tmp_path / "mx", "mxfp8")
    with open(mx / "metrics.jsonl", "a") as f:
        f.write('{"step": 205, "loss": 2.')  # killed mid-write
    rc, lines, err = run_main(capsys, bf16, mx, "--out", tmp_path / "cmp")
    assert rc == 0 and "skipping an unreadable line" in err and lines[-1].startswith("PARITY PASS")


def test_cli_verdict_is_the_last_stdout_line(tmp_path):
    bf16 = write_run(tmp_path / "bf16", "none")
    mx = write_run(tmp_path / "mx", "mxfp8", scale=1.001)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(bf16), str(mx), "--out", str(tmp_path / "cmp")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("PARITY PASS: debug mxfp8 final val loss +0.")


def test_parity_sh_on_cpu_writes_a_summary(tmp_path):
    """debug_bf16 against debug_mxfp8 for 6 steps: the same seed and data, so the first losses agree."""
    out = tmp_path / "parity"
    cmd = ["bash", "scripts/parity.sh", "debug_bf16", "debug_mxfp8", "--out", str(out), "--training.steps", "6"]
    cmd += ["--training.seq_len", "64", "--data.max_bytes", "2000000", "--metrics.log_freq", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1].startswith("PARITY ")
    assert (out / "summary.md").is_file() and (out / "loss.png").stat().st_size > 0
    summary = json.loads((out / "summary.json").read_text())
    assert [r["label"] for r in summary["runs"]] == ["debug bf16", "debug mxfp8"]
    first = [json.loads((Path(r["run_dir"]) / "metrics.jsonl").read_text().splitlines()[0]) for r in summary["runs"]]
    assert first[0]["step"] == first[1]["step"] == 1
    assert first[0]["loss"] == pytest.approx(first[1]["loss"], rel=0.01)  # one init, one batch; MX rounding only
