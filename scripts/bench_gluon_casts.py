"""Benchmark the Gluon casts (mx_kernels.gluon_casts) against the Triton kernels and a copy.

    python scripts/bench_gluon_casts.py [--shapes 16384x16384,16384x4096] [--modes floor,rceil] [--out r.json]

For each bf16 shape and scale rule (e4m3): median time (triton.testing.do_bench) of a
device-to-device copy of the input, ``cast_dim1``, ``gluon_cast_dim1`` over a small config sweep,
then ``cast_dim0_dim1`` vs ``gluon_cast_dim0_dim1`` (sweep) vs ``cast_dim0`` + ``cast_dim1``; time,
GB/s counting bytes read + written, % of the copy's GB/s. Every Gluon config is first checked
bit for bit against the Triton kernel on an input with NaN, infinities, zeros and subnormals
planted; a config that differs is reported and not timed, and the script exits 1 at the end.
About a minute of GPU time (most of it compiling).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import mx_recipe.formats  # noqa: F401  (before mx_kernels: see kernels/gluon_casts.py)

# isort: split
import torch
import triton.testing
from mx_kernels.cast_dim0 import cast_dim0
from mx_kernels.cast_dim0_dim1 import DIM0_DIM1_CONFIG as TRITON_FUSED
from mx_kernels.cast_dim0_dim1 import cast_dim0_dim1
from mx_kernels.cast_dim1 import DIM1_CONFIG as TRITON_DIM1
from mx_kernels.cast_dim1 import cast_dim1
from mx_kernels.gluon_casts import gluon_cast_dim0_dim1, gluon_cast_dim1

# (ROWS rows per thread, BLOCK_K, NUM_WARPS, NUM_SUB, LEAN, PLAIN_VIA_BLOCKED); registers from the sm_90
# compile in brackets. Wider sweeps: docs/profiles/2026-11-21_h200_gluon_casts_via_blocked.txt.
DIM1_SWEEP = [
    (4, 128, 4, 2, False),  # [70] the base config
    (8, 256, 4, 1, True, True),  # [56]
    (8, 256, 4, 2, True, True),  # [92] the default: plain scales written blocked, then permuted
    (16, 512, 4, 1, True, True),  # [108]
]
FUSED_SWEEP = [
    (4, 128, 4, 2, True, True),  # [156]
    (8, 256, 4, 1, True, True),  # [127] the default
    (8, 512, 8, 1, True, True),  # [128] the default's threads, 8 warps a program
    (16, 512, 4, 1, True, True),  # [251] 2 lanes per dim1 block: fewer shuffles and scale copies
]


def config(rows: int, block_k: int, warps: int, sub: int, lean: bool, via_blocked: bool = False) -> dict:
    return dict(ROWS=rows, BLOCK_K=block_k, NUM_WARPS=warps, NUM_SUB=sub, LEAN=lean, PLAIN_VIA_BLOCKED=via_blocked)


def bench_ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def same_bytes(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True))


def bench_input(m: int, k: int) -> torch.Tensor:
    """randn with the special values planted (they do not change the timing)."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if m < 96 or k < 128:
        return x
    x[0, 0], x[1, 33], x[2, 34] = float("nan"), float("inf"), -float("inf")
    x[40, 100] = torch.tensor(-63, dtype=torch.int16).view(torch.bfloat16)  # a negative NaN with a payload
    x[32:64, 64] = 0.0  # an all-zero dim1 block
    x[64:96, 65] = torch.linspace(-3e-39, 5e-39, 32)  # bf16 subnormals
    x[3, 64:96] = 1e30  # saturation under floor
    return x


class Table:
    def __init__(self, device: str):
        self.device = device
        self.rows: list[dict] = []
        self.mismatches: list[str] = []

    def add(self, name: str, shape, mode: str, ms: float, moved: int, copy_gbs: float, cfg: dict | None = None):
        gbs = moved / ms / 1e6
        row = dict(
            name=name, shape=list(shape), mode=mode, config=cfg, us=ms * 1e3, gbs=gbs, pct_copy=100 * gbs / copy_gbs
        )
        self.rows.append(row)
        cfg_s = "" if cfg is None else " ".join(f"{k}={v}" for k, v in cfg.items())
        shape_s = str(tuple(shape))
        print(f"{name:24s} {shape_s:16s} {mode:6s} {ms * 1e3:8.1f} us {gbs:6.0f} GB/s {row['pct_copy']:5.1f}%  {cfg_s}")
        return row

    def best(self, name: str, shape, mode: str) -> dict:
        return min((r for r in self.rows if r["name"] == name and r["shape"] == list(shape) and r["mode"] == mode),
                   key=lambda r: r["us"])  # fmt: skip


def sweep(table: Table, name: str, cast, configs, x: torch.Tensor, elem: str, mode: str, ref, copy_gbs: float) -> None:
    """Time ``cast`` (plain scales) for each config whose bytes equal ``ref``'s; a mismatch is recorded, not timed."""
    for c in configs:
        cfg = config(*c)
        out = cast(x, elem, mode, False, cfg)
        if not same_bytes(out, ref):
            table.mismatches.append(f"{name} {tuple(x.shape)} {mode} {cfg}")
            print(f"MISMATCH {name} {tuple(x.shape)} {mode} {cfg}: not timed")
            continue
        ms = bench_ms(lambda cfg=cfg: cast(x, elem, mode, False, cfg))
        table.add(name, x.shape, mode, ms, nbytes(x, *out), copy_gbs, cfg)


def bench_shape(table: Table, m: int, k: int, mode: str, elem: str) -> None:
    x = bench_input(m, k)
    copy_dst = torch.empty_like(x)
    copy_ms = bench_ms(lambda: copy_dst.copy_(x))
    copy_gbs = 2 * nbytes(x) / copy_ms / 1e6
    table.add("copy", x.shape, mode, copy_ms, 2 * nbytes(x), copy_gbs)

    # the Triton kernels get their own tile passed explicitly: without a config, Hopper runs the Gluon ones
    ref1 = cast_dim1(x, elem, mode, False, TRITON_DIM1)
    ms = bench_ms(lambda: cast_dim1(x, elem, mode, False, TRITON_DIM1))
    table.add("triton cast_dim1", x.shape, mode, ms, nbytes(x, *ref1), copy_gbs)
    sweep(table, "gluon_cast_dim1", gluon_cast_dim1, DIM1_SWEEP, x, elem, mode, ref1, copy_gbs)
    # blocked scales, best plain config
    best = table.best("gluon_cast_dim1", x.shape, mode)["config"]
    ref_b = cast_dim1(x, elem, mode, True, TRITON_DIM1)
    table.add("triton cast_dim1 blocked", x.shape, mode, bench_ms(lambda: cast_dim1(x, elem, mode, True, TRITON_DIM1)),
              nbytes(x, *ref_b), copy_gbs)  # fmt: skip
    out = gluon_cast_dim1(x, elem, mode, True, best)
    if same_bytes(out, ref_b):
        ms = bench_ms(lambda: gluon_cast_dim1(x, elem, mode, True, best))
        table.add("gluon_cast_dim1 blocked", x.shape, mode, ms, nbytes(x, *out), copy_gbs, best)
    else:
        table.mismatches.append(f"gluon_cast_dim1 blocked {tuple(x.shape)} {mode} {best}")

    ref2 = cast_dim0_dim1(x, elem, mode, False, TRITON_FUSED)
    ms = bench_ms(lambda: cast_dim0_dim1(x, elem, mode, False, TRITON_FUSED))
    table.add("triton cast_dim0_dim1", x.shape, mode, ms, nbytes(x, *ref2), copy_gbs)
    sep = cast_dim0(x, elem, mode) + ref1
    ms = bench_ms(lambda: (cast_dim0(x, elem, mode), cast_dim1(x, elem, mode, False, TRITON_DIM1)))
    table.add("triton dim0 + dim1", x.shape, mode, ms, nbytes(x, x, *sep), copy_gbs)
    sweep(table, "gluon_cast_dim0_dim1", gluon_cast_dim0_dim1, FUSED_SWEEP, x, elem, mode, ref2, copy_gbs)


def summary(table: Table, shapes: list[tuple[int, int]], modes: list[str]) -> None:
    print(f"\n=== best Gluon configs vs the Triton kernels: {table.device} ===")
    for shape in shapes:
        for mode in modes:
            copy = table.best("copy", shape, mode)
            print(f"{str(shape):16s} {mode:6s} copy {copy['gbs']:.0f} GB/s")
            sep = table.best("triton dim0 + dim1", shape, mode)
            for gluon_name, triton_name in (
                ("gluon_cast_dim1", "triton cast_dim1"),
                ("gluon_cast_dim1 blocked", "triton cast_dim1 blocked"),
                ("gluon_cast_dim0_dim1", "triton cast_dim0_dim1"),
            ):
                t = table.best(triton_name, shape, mode)
                line = f"    {gluon_name:24s} triton {t['us']:7.1f} us {t['pct_copy']:5.1f}%"
                if not any(
                    r["name"] == gluon_name and r["shape"] == list(shape) and r["mode"] == mode for r in table.rows
                ):
                    print(line + "  gluon: no config passed the bit check")
                    continue
                g = table.best(gluon_name, shape, mode)
                line += f" | gluon {g['us']:7.1f} us {g['pct_copy']:5.1f}% ({t['us'] / g['us']:.2f}x)"
                if "dim0_dim1" in gluon_name:
                    line += f", {sep['us'] / g['us']:.2f}x over dim0 + dim1 separate"
                print(line + f"  {g['config']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="16384x16384,16384x4096")
    p.add_argument("--modes", default="floor,rceil")
    p.add_argument("--elem", default="e4m3")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gluon_casts.py needs a CUDA GPU")
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    modes = args.modes.split(",")
    device = torch.cuda.get_device_name()
    print(f"device: {device}; torch {torch.__version__}; triton {triton.__version__}; elem {args.elem}, bf16 input")
    table = Table(device)
    for m, k in shapes:
        for mode in modes:
            bench_shape(table, m, k, mode, args.elem)
    summary(table, shapes, modes)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=device, rows=table.rows, mismatches=table.mismatches), f, indent=1)
    if table.mismatches:
        print("\nbit mismatches against the Triton kernels:\n  " + "\n  ".join(table.mismatches))
        sys.exit(1)


if __name__ == "__main__":
    main()
