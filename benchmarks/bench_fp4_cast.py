"""The 4-bit fake-quant kernels (the operands of the emulated MXFP4 and NVFP4 GEMMs) against a copy.

    python benchmarks/bench_fp4_cast.py [--m 16384 --k 16384] [--out FILE]

For each operand the recipes form, on bf16 x [M, K]: the GPU time of the kernels one call launches
(torch.profiler, L2 flushed), GB/s counting x read once and every bf16 output written, and that as a
percentage of a device-to-device copy measured in the same run (docs/DESIGN.md, Performance targets:
>= 85% for the 4-bit casts). The NVFP4 calls launch two kernels: the per-tensor maxima (one more read
of x, counted in the time, not in the bytes) and the fake-quant itself.

Rows: MXFP4 (e2m1, blocks of 32, both scale rules) along K, along M and both from one read; NVFP4 x along
K (forward), w along K in 16x16 tiles, g along N and along M with the random Hadamard transform and
stochastic rounding (the gradient, one read), x along M with the transform (the grad-weight input).
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import kernel_us, require_cuda, run_meta

from mx_recipe.cast import fake_quant_along_m, fake_quant_dim0, fake_quant_dim0_dim1
from mx_recipe.nvfp4 import random_signs
from mx_recipe.nvfp4_fake_quant import fake_quant_nvfp4

TARGET = 0.85


def gpu_ms(fn) -> float:
    return kernel_us(fn, calls=10, flush_l2=True) / 1e3


def copy_bandwidth_gbs() -> float:
    """A device-to-device copy of 1 GiB, bytes read + written over its kernel time."""
    src = torch.randn(2**28, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / gpu_ms(lambda: dst.copy_(src)) / 1e6


def outputs_bytes(result) -> int:
    tensors = result if isinstance(result, tuple) else (result,)
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor) and t.dim() == 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, default=16384)
    parser.add_argument("--k", type=int, default=16384)
    parser.add_argument("--out")
    args = parser.parse_args()
    require_cuda("bench_fp4_cast.py")
    copy_gbs = copy_bandwidth_gbs()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, x [{args.m}, {args.k}] bf16")
    print(f"copy: {copy_gbs:.0f} GB/s (read + write, kernel time)")
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    signs = random_signs(0, "cuda")
    calls = {
        "mxfp4 along K (floor)": lambda: fake_quant_dim0(x, "e2m1", "floor"),
        "mxfp4 along K (rceil)": lambda: fake_quant_dim0(x, "e2m1", "rceil"),
        "mxfp4 along M (floor)": lambda: fake_quant_along_m(x, "e2m1", "floor"),
        "mxfp4 along K + M, one read (floor)": lambda: fake_quant_dim0_dim1(x, "e2m1", "floor"),
        "nvfp4 x along K": lambda: fake_quant_nvfp4(x),
        "nvfp4 w along K, 16x16 tiles": lambda: fake_quant_nvfp4(x, tiles=True),
        "nvfp4 g along N + along M, RHT, SR": lambda: fake_quant_nvfp4(
            x, True, True, signs=signs, rounding="stochastic"
        ),
        "nvfp4 x along M, RHT": lambda: fake_quant_nvfp4(x, False, True, signs=signs),
    }
    rows = []
    print(f"{'operand':<40} {'GPU ms':>8} {'GB/s':>7} {'of copy':>8}")
    for name, call in calls.items():
        moved = x.numel() * x.element_size() + outputs_bytes(call())
        ms = gpu_ms(call)
        gbs = moved / ms / 1e6
        rows.append(dict(name=name, M=args.m, K=args.k, gpu_ms=ms, gbs=gbs, of_copy=gbs / copy_gbs))
        verdict = "meets" if gbs / copy_gbs >= TARGET else "misses"
        print(f"{name:<40} {ms:>8.3f} {gbs:>7.0f} {gbs / copy_gbs:>7.1%}  ({verdict} >= {TARGET:.0%})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": run_meta(copy_gbs=copy_gbs), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
