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


def test_cast_section_renders_the_kernel_columns(tmp_path):
    """bench_cast runs since the kernel-time columns: both figures per row, both copy rates in the title."""
    import json

    row = dict(name="dim1", shape=[64, 64], mode="floor", us=10.0, gbs=100.0, pct_copy=50.0)
    row |= dict(kernel_us=8.0, kernel_gbs=125.0, kernel_pct_copy=60.0, speedup_vs_compiled_ref=2.0)
    meta = dict(elem="e4m3", copy_gbs=200.0, copy_kernel_gbs=210.0, device="GPU", torch="2.11", date="2026-11-21")
    meta["commit"] = "abc1234"
    path = tmp_path / "2026-11-21_gpu_bench_cast.json"
    path.write_text(json.dumps(dict(meta=meta, results=[row], targets=["t"])))
    lines = _perf_report().cast_section(path)
    assert "200 GB/s (events), 210 GB/s (kernel)" in lines[0]
    assert "| dim1 | 64x64 | floor | 10.0 | 100 | 50.0% | 8.0 | 60.0% | 2.00x |" in lines
    assert not any("Host time" in line for line in lines)  # runs before the host-time section: no table


def test_cast_section_renders_the_host_times(tmp_path):
    import json

    row = dict(name="dim1", shape=[64, 64], mode="floor", us=10.0, gbs=100.0, pct_copy=50.0)
    row |= dict(kernel_us=8.0, kernel_gbs=125.0, kernel_pct_copy=60.0, speedup_vs_compiled_ref=None)
    meta = dict(elem="e4m3", copy_gbs=200.0, copy_kernel_gbs=210.0, device="GPU", torch="2.11", date="2026-11-21")
    meta["commit"] = "abc1234"
    host = [dict(name="3d dim1", host_us=60.0, host_us_no_launch_cache=80.0, torch_fp8_us=8.0)]
    path = tmp_path / "2026-11-21_gpu_bench_cast.json"
    path.write_text(json.dumps(dict(meta=meta, results=[row], targets=["t"], host=host)))
    lines = _perf_report().cast_section(path)
    assert "| 3d dim1 | 60.0 | 80.0 | 8.0 | 7.5x |" in lines
