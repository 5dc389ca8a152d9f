"""docs/RESULTS.md and the parity summaries are exactly what scripts/results_report.py renders from
the committed run metrics (docs/results/*_parity_*/); a sweep's output becomes a set and its section."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _results_report():
    spec = importlib.util.spec_from_file_location("results_report", ROOT / "scripts" / "results_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_doc_and_summaries_match_the_run_metrics(tmp_path):
    report = _results_report()
    folders = report.parity_folders()
    assert folders, "no parity result folders under docs/results"
    out_of = {folder: tmp_path / folder.name for folder in folders}
    rendered = report.render(out_of)
    text = report.DOC.read_text()
    generated = text.split(report.BEGIN, 1)[1].split(report.END, 1)[0]
    assert generated == "\n" + rendered, "run: python scripts/results_report.py --write"
    for folder in folders:
        # PERFORMANCE.md's parity tables read the committed summary.json: it must be the fresh one.
        fresh = json.loads((out_of[folder] / "summary.json").read_text())
        assert json.loads((folder / "summary.json").read_text()) == fresh, folder.name
        assert (folder / "loss.png").stat().st_size < 1_000_000
        meta = json.loads((folder / "meta.json").read_text())
        assert meta["commit"] != "unknown" and meta["commands"]["all"].startswith("python scripts/parity_sweep.py")


def _synthetic_sweep(tmp_path: Path, commit: str = "abc1234") -> Path:
    """A parity_sweep.py output of made-up curves: bf16 and mxfp8 (+0.1%), three seeds each."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_compare_runs import SMALL_NOISE, write_sweep

    sweep = write_sweep(tmp_path / "sweep", {"bf16": ("none", 0.0, [0.0] * 5), "mxfp8": ("mxfp8", 0.001, SMALL_NOISE)},
                        seeds=3)  # fmt: skip
    for run in sweep.glob("*/seed*"):
        (run / "train.log").write_text("not kept\n")
    command = "python scripts/parity_sweep.py --config parity_llama1b --recipes none mxfp8 --seeds 0 1 2"
    invocation = {"command": command, "date": "2026-12-01T10:00:00+00:00", "commit": commit, "torch": "2.11.0"}
    invocation["device"] = "2 x NVIDIA H100"
    (sweep / "sweep.json").write_text(
        json.dumps({"config": "parity_llama1b", "overrides": [], "invocations": [invocation]})
    )
    return sweep


def test_a_sweep_becomes_a_set_and_its_section(tmp_path, capsys):
    report = _results_report()
    results = tmp_path / "repo" / "docs" / "results"
    results.mkdir(parents=True)
    folder = report.add_set(_synthetic_sweep(tmp_path), "llama1b", "three seeds on two GPUs", False, results)
    assert folder == results / "2026-12-01_h100_parity_llama1b"
    kept = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    runs = [f"{a}/seed{k}/{f}" for a in ("bf16", "mxfp8") for k in range(3) for f in ("config.toml", "metrics.jsonl")]
    assert kept == sorted([*runs, "meta.json"])
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["commands"]["all"].startswith("python scripts/parity_sweep.py") and meta["commit"] == "abc1234"
    rendered = report.render(results=results)
    assert rendered.startswith("### llama1b\n\nSource: `docs/results/2026-12-01_h100_parity_llama1b/`: 2 x NVIDIA H100")
    assert "three seeds on two GPUs." in rendered
    assert "**PARITY PASS: debug mxfp8 vs debug bf16: final val loss +0.1" in rendered
    assert "| debug bf16 (baseline) | 0, 1, 2 | 200 |" in rendered and "| debug mxfp8 | 0, 1, 2 | 200 |" in rendered
    assert "](results/2026-12-01_h100_parity_llama1b/loss.png)" in rendered and len(rendered) < 5000
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["arms"][1]["run_dirs"][0] == "docs/results/2026-12-01_h100_parity_llama1b/mxfp8/seed0"
    doc = tmp_path / "RESULTS.md"
    doc.write_text(f"# Results\n\n{report.BEGIN}\nold\n{report.END}\nafter\n")
    report.write_doc(rendered, doc)
    assert doc.read_text() == f"# Results\n\n{report.BEGIN}\n{rendered}{report.END}\nafter\n"
    # The same kind again: refused, or replaced.
    again = _synthetic_sweep(tmp_path / "again")
    with pytest.raises(SystemExit, match="holds a set of the same kind: pass --replace"):
        report.add_set(again, "llama1b", None, False, results)
    report.add_set(again, "llama1b", None, True, results)
    assert "removed" in capsys.readouterr().out and len(report.parity_folders(results)) == 1


def test_a_sweep_of_uncommitted_code_is_refused(tmp_path):
    report = _results_report()
    sweep = _synthetic_sweep(tmp_path, commit="abc1234 (with uncommitted changes)")
    with pytest.raises(SystemExit, match="results need a committed tree"):
        report.add_set(sweep, "llama1b", None, False, tmp_path)
