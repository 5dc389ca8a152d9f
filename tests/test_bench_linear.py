"""benchmarks/bench_linear.py's activation-memory measure, on the CPU (the benchmark itself needs CUDA)."""

import dataclasses

import torch
from script_module import load_benchmark

from mx_recipe import MXLinear, MXRecipe


def _bench_linear():
    return load_benchmark("bench_linear")


def test_saved_bytes_of_bf16_mx_and_saved_mx():
    bench = _bench_linear()
    m, k, n = 96, 128, 64
    bf16 = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    recipe = MXRecipe.from_name("mxfp8")
    x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    assert bench.saved_bytes(bf16, x) == m * k * 2  # x in bf16; the weight is a parameter
    assert bench.saved_bytes(MXLinear.from_linear(bf16, recipe), x) == m * k * 2
    save = MXLinear.from_linear(bf16, dataclasses.replace(recipe, save_mx_input=True))
    assert bench.saved_bytes(save, x) == m * k + m * k // 32  # fp8 data + one e8m0 scale per 32
