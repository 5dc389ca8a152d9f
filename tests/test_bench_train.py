"""benchmarks/bench_train.py on the CPU: every variant trains on the same batches from the same weights, and the
result file holds one row per recipe with bf16 first (its timings only mean something on a GPU)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from script_module import BENCHMARKS, REPO, load_benchmark

from mx_recipe.train.parallel import cpu_has_native_bf16


def test_bf16_and_mx_rows_from_one_run(tmp_path):
    out = tmp_path / "train.json"
    cmd = [sys.executable, str(BENCHMARKS / "bench_train.py"), "--config", "debug_bf16", "--recipes", "mxfp8"]
    cmd += ["--steps", "1", "--warmup", "1", "--rounds", "2", "--out", str(out), "--compile.enable", "false"]
    cmd += ["--training.seq_len", "64", "--training.local_batch_size", "2", "--model.flavor", "debug"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "device: cpu" in done.stdout and "x bf16" in done.stdout
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [r["recipe"] for r in rows] == ["bf16", "mxfp8"]
    assert rows[0]["ratio"] == 1.0 and rows[1]["tokens_per_sec"] > 0
    assert rows[0]["peak_gib"] is None  # CUDA only
    # same weights and batches, three steps each: close losses, but MX rounding makes them differ
    bf16, mx = rows[0]["last_loss"], rows[1]["last_loss"]
    assert bf16 != mx and abs(bf16 - mx) < 0.05 * bf16
    assert data["meta"]["command"].startswith("python benchmarks/bench_train.py --config debug_bf16")
    assert data["meta"]["layers"] == 4


def test_two_processes_time_the_bf16_and_the_mx_all_gather(tmp_path):
    """Under torchrun (FSDP2 over gloo), --all-gather both times the recipe with each all-gather: the same losses,
    and the log says which all-gather each variant runs and the bytes it moves."""
    out = tmp_path / "train.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(BENCHMARKS / "bench_train.py"), "--config", "debug_moe_bf16", "--recipes", "mxfp8", "--skip-bf16"]
    cmd += ["--all-gather", "both", "--steps", "1", "--warmup", "1", "--rounds", "1", "--out", str(out)]
    cmd += ["--training.seq_len", "64", "--training.local_batch_size", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    dtype = "bf16" if cpu_has_native_bf16() else "fp32"  # the config's compute dtype "auto" on this CPU
    assert "device: 2 x cpu" in done.stdout and f"FSDP2 mesh (2,), all-gather {dtype}" in done.stdout
    assert "mxfp8 MX all-gather: FSDP2 mesh (2,), MX all-gather for" in done.stdout
    assert "mxfp8 MX all-gather: all-gather bytes: layers.1" in done.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["recipe"] for r in rows] == ["mxfp8 bf16 all-gather", "mxfp8 MX all-gather"]
    assert rows[0]["last_loss"] == rows[1]["last_loss"]


def test_layers_keeps_the_first_blocks_and_refuses_more_than_the_flavor_has():
    bench = load_benchmark("bench_train")
    from mx_recipe.models import model_args

    dims = model_args("llama", "debug", 256, 64)
    assert bench.with_layers(dims, None) is dims and bench.with_layers(dims, 2).n_layers == 2
    with pytest.raises(ValueError, match="--layers 5: the flavor has 4 blocks"):
        bench.with_layers(dims, 5)


def test_no_warmup_steps_run_nothing():
    bench = load_benchmark("bench_train")
    from mx_recipe.train.step import TrainStep

    model = torch.nn.Linear(2, 2)
    step = TrainStep(model, torch.optim.AdamW(model.parameters()), torch.device("cpu"), max_norm=1.0)
    v = bench.Variant("none", "bf16", model, step, 1.0)
    assert bench.run_steps(v, [], torch.device("cpu")) == 0.0 and v.losses == []


def test_kernel_kinds_of_the_kernels_a_step_launches():
    kind = load_benchmark("bench_train").kernel_kind
    assert kind("_gluon_fake_quant_kernel") == kind("_cast_kernel") == kind("_amax_kernel") == "MX cast"  # NVFP4 maxima
    assert kind("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == kind("sm90_xmma_gemm_bf16bf16") == "GEMM"
    assert kind("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<cutlass::bfloat16_t>>") == "attention"
    assert kind("void at::native::multi_tensor_apply_kernel<...>") == "optimizer"
    assert kind("triton_poi_fused_add_mul_silu_0") == kind("triton_red_fused__to_copy_1") == "fused elementwise"
    assert kind("Memcpy HtoD (Pageable -> Device)") == "copy/collective"
    assert kind("void at::native::vectorized_elementwise_kernel<...>") == "other"
