"""benchmarks/bench_decode.py on the CPU: a debug model end to end, bf16 and the three formats in one run, and the
bytes a step reads (its timings only mean something on a GPU)."""

import json
import subprocess
import sys

import pytest
from script_module import BENCHMARKS, REPO, load_benchmark

SMOKE = ["--flavor", "debug", "--device", "cpu", "--context", "32", "--prefill", "16", "--steps", "1", "--rounds", "1"]


def test_decode_and_prefill_rows_from_one_run(tmp_path):
    out = tmp_path / "decode.json"
    cmd = [sys.executable, str(BENCHMARKS / "bench_decode.py"), *SMOKE, "--batch", "1,2", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "device: cpu" in done.stdout and "mxfp4 batch 1:" in done.stdout
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["mode"], r["batch"], r["weights"]) for r in rows[:4]] == [
        ("decode", 1, w) for w in ("bf16", "mxfp8", "mxfp4", "nvfp4")
    ]
    assert len(rows) == 12 and rows[-1]["mode"] == "prefill" and rows[-1]["tokens"] == 16
    assert rows[0]["vs_bf16"] == 1.0 and all(r["tokens_per_s"] > 0 for r in rows)
    assert rows[2]["bytes"] < rows[0]["bytes"] and rows[0]["pct_of_bound"] > 0
    assert data["meta"]["command"].startswith("python benchmarks/bench_decode.py --flavor debug")


def test_moe_gemms_only_with_fewer_layers():
    cmd = [sys.executable, str(BENCHMARKS / "bench_decode.py"), *SMOKE, "--model", "moe", "--flavor", "debug_moe"]
    cmd += ["--layers", "2", "--gemms-only", "--weights", "mxfp4"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2 layers" in done.stdout and "gemms batch    1  mxfp4" in done.stdout


def test_layout_and_output_layer_are_recorded(tmp_path):
    out = tmp_path / "decode.json"
    cmd = [sys.executable, str(BENCHMARKS / "bench_decode.py"), *SMOKE, "--prefill", "0", "--weights", "mxfp4"]
    cmd += ["--layout", "formats", "--quantize-output", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "formats layout" in done.stdout and "output layer quantized" in done.stdout
    meta = json.loads(out.read_text())["meta"]
    assert meta["layout"] == "formats" and meta["quantized_output"] is True


def test_step_bytes_count_the_experts_a_batch_reaches():
    bench = load_benchmark("bench_decode")
    import torch

    assert bench.active_experts(64, 6, 1) == pytest.approx(6)
    assert bench.active_experts(64, 6, 1000) == pytest.approx(64)
    model = bench.build("moe", "debug_moe", 2, "bf16", 32, torch.device("cpu"), reference=False)
    moe = model.layers["1"].moe
    assert moe.experts.shared == 1  # the shared expert folded in as a ninth group, read at every batch
    experts = sum(p.numel() * 4 for p in moe.experts.parameters()) * 8 / 9
    one, many = bench.step_bytes(model, 1, None), bench.step_bytes(model, 1000, None)
    assert many - one == pytest.approx(experts * (1 - 2 / 8) + 999 * model.args.dim * 4, rel=1e-6)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layers", "9"], "--layers 9: the flavor has 4 blocks"),
        (["--flavor", "70"], "unknown llama flavor"),
        (["--profile-top", "3"], "--profile-top lists a decode step's GPU kernels"),
        (["--flavor", "70B"], "--flavor debug runs a smoke test"),  # 560 GB in fp32: no CPU holds it
    ],
)
def test_bad_arguments_are_one_line(args, message):
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_decode.py"), *SMOKE, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_step_kernels_report_what_each_adds_and_a_layer(monkeypatch, capsys):
    """--profile-top's report from kernel spans (made up here, as the profiler gives them): by kernel name what each
    adds to the step's end, ms a step, then per kernel of the repeated layer, us a layer."""
    bench = load_benchmark("bench_decode")
    # embedding, two layers of (norm 0-2, gemv 1-11: starts under the norm, attention 11-16), output 16-30
    spans = [("emb", 0.0, 1.0)]
    for t in (1.0, 16.0):
        spans += [("norm", t, t + 2.0), ("gemv", t + 1.0, t + 11.0), ("attention", t + 10.0, t + 15.0)]
    spans.append(("gemv", 31.0, 45.0))
    monkeypatch.setattr(bench, "kernel_spans", lambda step: spans)
    bench.print_step_kernels("decode batch 1 mxfp8", lambda: None, 45e-6, top=2)
    lines = capsys.readouterr().out.splitlines()
    assert "first start to last end 0.045 ms of a 0.045 ms step" in lines[0]
    # gemv: 9 + 9 in the layers and 14 (with the gap before it) at the end; norm 2 each; attention 4 each
    assert lines[1].split()[:2] == ["0.032", "gemv"] and lines[2].split()[:2] == ["0.008", "attention"]
    assert "3 kernels, 2 layers" in lines[3]
    assert [line.split()[:2] for line in lines[4:]] == [["2.00", "norm"], ["9.00", "gemv"], ["4.00", "attention"]]


@pytest.mark.gpu
def test_gpu_sweep_times_the_gemv_beside_the_configs():
    """--sweep at one row: cuBLAS and the GEMV for bf16, the GEMV and every small-M config for MXFP8, each timed;
    the GEMV's MXFP8 rows stay out of the FMA_CHOSEN suggestion (the decode step runs the GEMV there)."""
    import torch

    bench = load_benchmark("bench_decode")
    rows = bench.sweep(("bf16", "mxfp8"), (1, 2), torch.device("cuda"), 4e12, shapes=[(256, 1024)])
    configs = {(r["weights"], r["m"], r["config"]) for r in rows}
    assert {("bf16", 1, "cuBLAS"), ("bf16", 1, "GEMV"), ("mxfp8", 1, "GEMV")} <= configs
    assert ("mxfp8", 2, "GEMV") not in configs and ("bf16", 2, "GEMV") not in configs
    assert sum(r["weights"] == "mxfp8" and r["m"] == 1 for r in rows) > 3 and all(r["us"] > 0 for r in rows)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("layout", "batch", "tiled"),
    [("auto", 1, {"mxfp4"}), ("auto", 2, {"mxfp4", "mxfp8"}), ("formats", 2, set()), ("tiled", 1, {"mxfp4", "mxfp8"})],
)
def test_gpu_layout_tiles_what_it_says(layout, batch, tiled):
    """--layout on an H100 or H200: auto tiles as a decode step of the batch would (MXFP8 past one row), formats
    nothing, tiled every dense weight the tile takes."""
    import torch

    from mx_recipe.infer.weights import PackedWeight

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the tiled layout is Hopper's (sm_90)")
    bench = load_benchmark("bench_decode")
    got = set()
    for fmt in ("mxfp4", "mxfp8"):
        model = bench.build("llama", "debug", 1, fmt, 32, torch.device("cuda"), False, layout=layout)
        packed = [m for m in bench.tile(model, batch, layout).modules() if isinstance(m, PackedWeight)]
        if any(p.tiled for p in packed):
            got.add(fmt)
    assert got == tiled
