"""The 4-bit fake-quant kernels (the operands of the emulated MXFP4 and NVFP4 GEMMs) and packed casts against a copy.

    python benchmarks/bench_fp4_cast.py [--m 16384 --k 16384] [--out FILE]

For each operand the recipes form, on bf16 x [M, K]: the GPU time of each kernel one call launches
(torch.profiler, L2 flushed) and its bandwidth counting the bytes it moves, as a percentage of a
device-to-device copy measured in the same run (docs/DESIGN.md, Performance targets: >= 85% for the
4-bit casts, judged per kernel).

An NVFP4 call launches two kernels: the per-tensor maxima, which reads x, and the fake-quant, which reads
x again and writes its outputs; the scale of the first block needs the maximum of the whole tensor, so the
format reads its input twice. The last column is the share of a copy's speed over the whole call, counting
x once: for a one-sided NVFP4 cast at most two thirds, whatever its kernels do. On Hopper the packed MXFP4
cast along M is two kernels too: the cast writes its scales blocked, and ``_unblock_kernel`` makes them plain
(counted by the scales it reads and writes).

Rows: MXFP4 (e2m1, blocks of 32, both scale rules) along K, along M and both from one read; NVFP4 x along
K (a frozen weight's forward), x along K and along M with the random Hadamard transform (the nvfp4 linear's
forward, one read; also g's cast rounded to nearest), w along K in 16x16 tiles, g along N and along M with
the transform and stochastic rounding (the gradient, one read), the same without the transform (recipe
nvfp4_no_rht), x along M with the transform alone (the MoE grad-weight input). Then the packed casts that the
sm_100 GEMMs read (codes two a byte and their scales, plain): MXFP4 along K, along M (written transposed)
and both from one read, to nearest and stochastically (the mxfp4_sr gradient, one side a call), and NVFP4 x
and g as the nvfp4 linear's cublas path casts them.
"""

from __future__ import annotations

import json

import torch
from timing import copy_gbs, kernel_us_by_name, require_cuda, run_meta

from mx_recipe.cli import ArgumentParser, output_file
from mx_recipe.formats.nvfp4 import random_signs
from mx_recipe.ops.mx_cast import (
    cast_dim0,
    cast_dim0_dim1,
    cast_dim1,
    fake_quant_along_m,
    fake_quant_dim0,
    fake_quant_dim0_dim1,
)
from mx_recipe.ops.nvfp4_cast import cast_nvfp4
from mx_recipe.ops.nvfp4_fake_quant import fake_quant_nvfp4

TARGET = 0.85


def kernel_ms(fn) -> dict[str, float]:
    return {name: us / 1e3 for name, us in kernel_us_by_name(fn, calls=10, flush_l2=True).items()}


def outputs_bytes(result) -> int:
    """The bytes of a call's 2D outputs (operands, codes and plain scales; not the decode scales), through the
    tensor classes (MXTensor, NVFP4Tensor) and tuples of them."""
    if isinstance(result, torch.Tensor):
        return result.numel() * result.element_size() if result.dim() == 2 else 0
    if isinstance(result, tuple | list):
        return sum(outputs_bytes(r) for r in result)
    if hasattr(result, "qdata"):
        return outputs_bytes(result.qdata) + outputs_bytes(result.scale)
    return 0


def scale_bytes(result) -> int:
    """The bytes of a call's 2D scales: what ``unblock_scales`` reads (blocked) and writes (plain)."""
    if isinstance(result, tuple | list):
        return sum(scale_bytes(r) for r in result)
    return outputs_bytes(result.scale) if hasattr(result, "scale") else 0


def main() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--m", type=int, default=16384)
    parser.add_argument("--k", type=int, default=16384)
    parser.add_argument("--out", type=output_file)
    args = parser.parse_args()
    require_cuda("bench_fp4_cast.py")
    copy = copy_gbs()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, x [{args.m}, {args.k}] bf16")
    print(f"copy: {copy:.0f} GB/s (read + write, kernel time)")
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    signs = random_signs(0, "cuda")
    calls = {
        "mxfp4 along K (floor)": lambda: fake_quant_dim0(x, "e2m1", "floor"),
        "mxfp4 along K (rceil)": lambda: fake_quant_dim0(x, "e2m1", "rceil"),
        "mxfp4 along M (floor)": lambda: fake_quant_along_m(x, "e2m1", "floor"),
        "mxfp4 along K + M, one read (floor)": lambda: fake_quant_dim0_dim1(x, "e2m1", "floor"),
        "nvfp4 x along K": lambda: fake_quant_nvfp4(x),
        "nvfp4 x along K + along M, RHT": lambda: fake_quant_nvfp4(x, True, True, signs=signs),
        "nvfp4 w along K, 16x16 tiles": lambda: fake_quant_nvfp4(x, tiles=True),
        "nvfp4 g along N + along M, RHT, SR": lambda: fake_quant_nvfp4(
            x, True, True, signs=signs, rounding="stochastic"
        ),
        "nvfp4 g along N + along M, SR": lambda: fake_quant_nvfp4(x, True, True, rounding="stochastic"),
        "nvfp4 x along M, RHT": lambda: fake_quant_nvfp4(x, False, True, signs=signs),
        "mxfp4 packed cast along K (floor)": lambda: cast_dim0(x, "e2m1", "floor"),
        "mxfp4 packed cast along M (floor)": lambda: cast_dim1(x, "e2m1", "floor"),
        "mxfp4 packed cast along K + M, one read": lambda: cast_dim0_dim1(x, "e2m1", "floor"),
        "mxfp4 packed cast along K, SR": lambda: cast_dim0(x, "e2m1", "floor", rounding="stochastic"),
        "mxfp4 packed cast along M, SR": lambda: cast_dim1(x, "e2m1", "floor", rounding="stochastic"),
        "nvfp4 packed x along K + along M, RHT": lambda: cast_nvfp4(x, True, True, signs=signs, pad_m=32),
        "nvfp4 packed g along N + along M, RHT, SR": lambda: cast_nvfp4(
            x, True, True, signs=signs, rounding="stochastic", pad_m=32
        ),
    }
    x_bytes = x.numel() * x.element_size()
    rows = []
    print(f"{'operand':<38} {'kernel':<26} {'GPU ms':>7} {'GB/s':>6} {'of copy':>8}   {'call, x once':>12}")
    for name, call in calls.items():
        result = call()
        out_bytes = outputs_bytes(result)
        kernels = kernel_ms(call)
        total_ms = sum(kernels.values())
        call_share = (x_bytes + out_bytes) / total_ms / 1e6 / copy
        # the call's own kernels: the stochastic calls' seed draw is in the call's time only
        own = sorted(((k, ms) for k, ms in kernels.items() if ms > 0.02 * total_ms), key=lambda kv: "amax" not in kv[0])
        for i, (kernel, ms) in enumerate(own):
            moved = x_bytes + out_bytes
            if "amax" in kernel:  # the maxima kernel only reads x
                moved = x_bytes
            elif "unblock" in kernel:  # plain scales from the blocked ones the cast wrote
                moved = 2 * scale_bytes(result)
            gbs = moved / ms / 1e6
            verdict = "meets" if gbs / copy >= TARGET else "misses"
            share = f"{call_share:>12.1%}" if i == len(own) - 1 else ""
            label = name if i == 0 else ""
            print(f"{label:<38} {kernel[:26]:<26} {ms:>7.3f} {gbs:>6.0f} {gbs / copy:>7.1%} {verdict:<6} {share}")
            rows.append(dict(name=name, kernel=kernel, M=args.m, K=args.k, gpu_ms=ms, gbs=gbs, of_copy=gbs / copy,
                             call_ms=total_ms, call_of_copy_x_once=call_share))  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": run_meta(copy_gbs=copy), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
