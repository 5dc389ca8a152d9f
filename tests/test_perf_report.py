"""docs/PERFORMANCE.md's tables are exactly what scripts/perf_report.py renders from docs/results/."""

import importlib.util
from pathlib import Path

import pytest

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


def cast_file(tmp_path, host: list | None = None):
    import json

    rows = []
    for mode, us in (("floor", 8.0), ("rceil", 8.2)):
        row = dict(name="dim1", shape=[64, 64], mode=mode, us=10.0, gbs=100.0, pct_copy=50.0)
        rows.append(row | dict(kernel_us=us, kernel_gbs=125.0, kernel_pct_copy=60.0, speedup_vs_compiled_ref=None))
    meta = dict(elem="e4m3", copy_gbs=200.0, copy_kernel_gbs=210.0, device="GPU", torch="2.11", date="2026-11-21")
    meta |= dict(commit="abc1234", command="python benchmarks/bench_cast.py")
    path = tmp_path / "2026-11-21_gpu_bench_cast.json"
    targets = ["fake-quant fused speedup over separate floor: 1.30x", "rceil/floor time dim1: 1.02"]
    path.write_text(json.dumps(dict(meta=meta, results=rows, targets=targets, host=host or [])))
    return path


def test_cast_section_one_row_per_cast_a_column_per_run(tmp_path):
    lines = _perf_report().cast_section([cast_file(tmp_path)])
    assert "| cast | GPU, e4m3 |" in lines
    assert "| dim1 | 60.0% |" in lines  # kernel time, over shapes and both rules
    assert not any("rceil/floor time" in line or "Host time" in line for line in lines)
    assert lines[-2].startswith("- Source: `docs/results/2026-11-21_gpu_bench_cast.json`")
    assert lines[-2].endswith("`python benchmarks/bench_cast.py`")


def test_span_collapses_a_point():
    report = _perf_report()
    assert report.span([0.5, 0.5]) == "50.0%" and report.span([0.5, 0.6]) == "50.0%-60.0%"


def test_cast_targets_per_element_format(tmp_path):
    """The fp8 casts are judged against their own targets, the e2m1 casts (bench_cast.py --elem e2m1) against
    the 4-bit casts' 85% alone."""
    import json

    report = _perf_report()
    fp8 = report.cast_targets(cast_file(tmp_path))
    assert "MX casts >= 90% of copy bandwidth (kernel time)" in fp8 and "rceil within 3% of floor" in fp8
    path = cast_file(tmp_path)
    data = json.loads(path.read_text())
    data["meta"]["elem"] = "e2m1"
    path.write_text(json.dumps(data))
    assert report.cast_targets(path) == {
        "MXFP4 packed casts (dim0, dim1, fused, 3D, per group) >= 85% of copy (kernel time)": (
            "60.0% at the slowest (dim1 64x64 floor)"
        )
    }


def test_host_section_and_target(tmp_path):
    import json

    rows = [dict(name="fake-quant dim0", host_us=24.0, torch_us=12.0, torch_op="x.to(float8_e4m3fn)")]
    rows += [dict(name="op cast_dim0 (compiled code)", host_us=60.0, torch_us=12.0, torch_op="x.to(float8_e4m3fn)")]
    rows += [dict(name="nvfp4 fake-quant along K", host_us=50.0, torch_us=12.0, torch_op="x.to(float8_e4m3fn)")]
    rows += [dict(name="linear fwd+bwd", host_us=300.0, torch_us=100.0, torch_op="bf16")]
    path = tmp_path / "2026-11-25T1000_h200_bench_host.json"
    meta = dict(device="GPU", torch="2.11", date="2026-11-25", commit="abc1234", shape=[256, 256])
    path.write_text(json.dumps(dict(meta=meta, rows=rows)))
    report = _perf_report()
    lines = report.host_section([path])
    assert "| MX fake-quant | 1 | 24 | 12 (x.to(float8_e4m3fn)) |" in lines
    assert "| layer fwd+bwd | 1 | 300 | 100 (bf16) |" in lines
    # layers are not calls
    assert report.host_targets(path) == "MX fake-quant 24 us; MX cast, plain scales 60 us; NVFP4 fake-quant 50 us"


def test_bench_train_section_with_its_profile(tmp_path):
    import json

    profile = {"MX cast": 0.0, "GEMM": 10.0, "GPU idle": 2.0}
    rows = [
        dict(recipe="bf16", tokens_per_sec=1000.0, ratio=1.0, mfu=50.0, peak_gib=10.0, rounds_spread=0.01,
             last_loss=3.0, profile_ms_per_step=profile),
        dict(recipe="mxfp8", tokens_per_sec=950.0, ratio=0.95, mfu=47.5, peak_gib=10.5, rounds_spread=0.02,
             last_loss=3.01, profile_ms_per_step=profile | {"MX cast": 1.5}),
    ]  # fmt: skip
    meta = dict(device="GPU", torch="2.11", date="2026-11-25", commit="abc1234", config="llama1b_bf16", layers=16)
    path = tmp_path / "2026-11-25T1000_h200_bench_train_llama1b.json"
    path.write_text(json.dumps(dict(meta=meta, rows=rows)))
    report = _perf_report()
    lines = report.bench_train_section([path])
    # the profile's MX casts, GPU idle and whole step per step, beside the throughput
    assert "| llama1b_bf16 (16 blocks) | mxfp8 | 950 | 0.950x | 47.5% | 10.50 | 2.0% | 1.5 | 2.0 | 13.5 |" in lines
    assert report.bench_train_targets(path) == "llama1b_bf16 (16 blocks) mxfp8 0.950x"


def test_cast_targets_judge_kernel_time(tmp_path):
    targets = _perf_report().cast_targets(cast_file(tmp_path))
    assert targets["MX casts >= 90% of copy bandwidth (kernel time)"] == "60.0% at the slowest (dim1 64x64 floor)"
    assert targets["rceil within 3% of floor"] == "rceil/floor 1.025-1.025"


def test_one_result_per_benchmark_and_device(tmp_path, monkeypatch):
    report = _perf_report()
    for name in ("2026-11-21T1000_h200_bench_moe.json", "2026-11-22T1000_h200_bench_moe.json"):
        (tmp_path / name).write_text("{}")
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    with pytest.raises(SystemExit, match="hold the same run kind; keep the latest"):
        report.check_one_per_kind(report.latest_results())


def test_a_seeded_parity_set_is_one_row_per_recipe_with_its_interval(tmp_path):
    import json

    folder = tmp_path / "2026-11-28_h200_parity_llama1b"
    folder.mkdir()
    meta = dict(device="NVIDIA H200", torch="2.11", date="2026-11-28", commit="abc1234")
    (folder / "meta.json").write_text(json.dumps(meta))
    base = dict(
        label="1B bf16",
        mx_recipe="none",
        is_baseline=True,
        seeds=[0, 1, 2],
        final_val_step=1000,
        median_tokens_per_sec=60000.0,
        tokens_per_sec_ratio=1.0,
        peak_memory_gib=21.3,
    )
    mx = base | dict(
        label="1B mxfp8",
        mx_recipe="mxfp8",
        is_baseline=False,
        median_tokens_per_sec=57000.0,
        tokens_per_sec_ratio=0.95,
        delta_rel_mean=0.001,
        delta_rel_ci=[-0.002, 0.004],
        verdict="PASS",
    )
    runs = [{"label": "one run per seed"}] * 6  # the per-run records stay out of the table
    (folder / "summary.json").write_text(json.dumps(dict(arms=[base, mx], runs=runs)))  # fmt: skip
    report = _perf_report()
    lines = report.runs_section([folder])
    rows = [line for line in lines if line.startswith("| llama1b ")]
    assert rows == [
        "| llama1b | H200 | 1B bf16 (3 seeds) | 1000 | 60,000 | 1.000x | 21.30 | baseline |",
        "| llama1b | H200 | 1B mxfp8 (3 seeds) | 1000 | 57,000 | 0.950x | 21.30 | +0.10% [-0.20%, +0.40%] PASS |",
    ]
    assert report.training_targets([folder]) == {"h200": ["llama1b mxfp8 0.950x"]}


def test_decode_targets_and_section(tmp_path):
    import json

    rows = [
        dict(mode="decode", weights=w, batch=b, tokens=b, ms=ms, tokens_per_s=b / ms * 1e3, vs_bf16=r, pct_of_bound=p)
        for w, b, ms, r, p in (("bf16", 1, 8.0, 1.0, 45.0), ("mxfp4", 1, 4.0, 2.0, 40.0), ("mxfp4", 32, 8.0, 1.0, 20.0))
    ]
    meta = dict(device="GPU", torch="2.11", date="2026-11-27", commit="abc1234", command="python bench_decode.py")
    meta |= dict(model="llama", flavor="8B", layers=32)
    path = tmp_path / "2026-11-27_gpu_bench_decode.json"
    path.write_text(json.dumps(dict(meta=meta, rows=rows)))
    report = _perf_report()
    assert report.decode_targets(path) == {
        "decode batch 1: bf16 >= 80% of the HBM bound": "45.0%",
        "decode batch 1: mxfp4 and nvfp4 weights >= 2.8x bf16 tokens/s": "mxfp4 2.000x",
        "decode batch 32: mxfp4 and nvfp4 weights >= 1.5x bf16 tokens/s": "mxfp4 1.000x",
    }
    lines = report.decode_section([path])
    assert "| llama 8B (32 layers) | GPU | 1 | 8.000 ms, 45.0% |  | 2.00x, 40.0% |  |" in lines
    assert "| llama 8B (32 layers) | GPU | 32 |  |  | 1.00x, 20.0% |  |" in lines
    # a run with the output layer quantized too: its ratios after the plain run's, in its cells and targets
    meta |= dict(quantized_output=True, date="2026-11-28")
    variant = tmp_path / "2026-11-28_gpu_bench_decode_output.json"
    variant.write_text(json.dumps(dict(meta=meta, rows=rows[1:])))
    assert report.decode_targets(variant) == {
        "decode batch 1: mxfp4 and nvfp4 weights >= 2.8x bf16 tokens/s": "output layer quantized: mxfp4 2.000x",
        "decode batch 32: mxfp4 and nvfp4 weights >= 1.5x bf16 tokens/s": "output layer quantized: mxfp4 1.000x",
    }
    lines = report.decode_section([variant, path])
    row = "| llama 8B (32 layers) | GPU | 1 | 8.000 ms, 45.0% |  | 2.00x, 40.0%; output layer too: 2.00x, 40.0% |  |"
    assert row in lines and sum(line.startswith("| llama") for line in lines) == 2
    target = "| decode batch 1: mxfp4 and nvfp4 weights >= 2.8x bf16 tokens/s | mxfp4 2.000x; output layer quantized: "
    for order in ([path, variant], [variant, path]):  # the plain run first in the cell, whichever ran first
        results = {kind: [] for kind in report.SECTIONS} | {"bench_decode": order}
        assert any(line.startswith(target + "mxfp4 2.000x |") for line in report.targets_section(results))


def test_a_serving_quality_set_is_a_source_line_under_the_decode_table(tmp_path):
    import json

    folder = tmp_path / "2026-11-28_h100_weight_quality"
    folder.mkdir()
    for name, recipe in (("bf16_trained", "none"), ("mxfp8_trained", "mxfp8")):
        meta = dict(device="GPU", torch="2.11", date="2026-11-28T00:00:00+00:00", commit="abc1234def", recipe=recipe)
        command = f"python scripts/weight_quality.py --checkpoint /tmp/q_{recipe}"
        meta |= dict(checkpoint=f"/tmp/q_{recipe}", command=command)
        (folder / f"{name}.json").write_text(json.dumps(dict(meta=meta, rows=[])))
    report = _perf_report()
    line = report.quality_source(folder)
    assert line.startswith("- Source: `docs/results/2026-11-28_h100_weight_quality`: GPU, torch 2.11, 2026-11-28, "
                           "commit abc1234. `python scripts/weight_quality.py --checkpoint RUN`: what")  # fmt: skip
    assert line.endswith("(RESULTS.md, Serving a trained model with MX weights).")
    decode = tmp_path / "2026-11-27_gpu_bench_decode.json"
    meta = dict(device="GPU", torch="2.11", date="2026-11-27", commit="abc1234", model="llama", flavor="8B", layers=1)
    decode.write_text(json.dumps(dict(meta=meta, rows=[])))
    lines = report.decode_section([decode], [folder])
    assert lines[-4:] == ["", report.source_line(meta, decode.name), line, ""]
    # without a decode run, the line keeps a heading of its own
    assert report.decode_section([], [folder])[2:] == [line, ""] and report.decode_section([], []) == []
