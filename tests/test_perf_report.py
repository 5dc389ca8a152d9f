"""docs/PERFORMANCE.md's tables are exactly what scripts/perf_report.py renders from docs/results/."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _perf_report():
    spec = importlib.util.spec_from_file_location("perf_report", ROOT / "scripts" / "perf_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_performance_doc_matches_result_files():
    report = _perf_report()
    text = report.DOC.read_text()
    generated = text.split(report.BEGIN, 1)[1].split(report.END, 1)[0]
    assert generated == "\n" + report.render(), "run: python scripts/perf_report.py --write"


def test_every_result_carries_its_provenance():
    report = _perf_report()
    rendered = report.render()
    assert rendered.count("Source: `docs/results/") == len(list(report.RESULTS.iterdir()))
    assert "commit unknown" not in rendered
