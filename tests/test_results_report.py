"""docs/RESULTS.md and the parity summaries are exactly what scripts/results_report.py renders from
the committed run metrics (docs/results/*_parity_*/)."""

import importlib.util
import json
from pathlib import Path

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
