"""Benchmark the Gluon fake-quant kernel (mx_kernels.gluon_fake_quant) against the Triton one and a copy.

    python scripts/bench_gluon_fake_quant.py [--modes floor,rceil] [--elem e4m3] [--out r.json]

Cases (bf16): x [16384, 4096] both results and along M alone; expert weights w [16, 8192, 5120] and
[64, 8192, 5120], both results and along M alone (what the MoE grad-input path runs by default);
the MoE grad-weight g [16640, 8192] in 64 token groups along M (``fake_quant_groups_along_m``). For
each: median time (triton.testing.do_bench) of the Triton kernel with its default tile (forced by
passing that tile: on Hopper ``fake_quant_2d`` would otherwise dispatch to Gluon), then of the Gluon
kernel over a small config sweep, its default marked; GB/s counts bytes read + written, % of a
1 GiB device-to-device copy timed in the same run. Each Gluon config is first checked byte for byte
against the Triton output; a config that differs is reported, not timed, and the script exits 1.
A minute or two of GPU time (mostly compiles); ~30 GB of GPU memory for the E = 64 cases.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import mx_recipe.formats  # noqa: F401  (before mx_kernels: see kernels/gluon_casts.py)

# isort: split
import torch
import triton
import triton.testing
from mx_kernels.fake_quant_2d import ALONG_M_CONFIG, FAKE_QUANT_2D_CONFIG, fake_quant_2d, fake_quant_groups_along_m
from mx_kernels.gluon_fake_quant import (
    GLUON_FAKE_QUANT_CONFIG,
    gluon_fake_quant_2d,
    gluon_fake_quant_groups_along_m,
)

# (ROWS rows a thread, BLOCK_K, NUM_WARPS, NUM_SUB, LEAN)
SWEEP = [
    (4, 128, 4, 1, False),  # the Triton kernel's 32 x 128 tile
    (4, 64, 2, 1, False),  # the Triton along-M tile
    (8, 256, 4, 1, False),
    (16, 512, 4, 1, False),
    (4, 128, 4, 1, True),
    (4, 128, 4, 2, True),
    (8, 128, 2, 1, True),  # GLUON_FAKE_QUANT_CONFIG
    (8, 256, 4, 1, True),
    (16, 512, 4, 1, True),
]


def config(rows: int, block_k: int, warps: int, sub: int, lean: bool) -> dict:
    return dict(ROWS=rows, BLOCK_K=block_k, NUM_WARPS=warps, NUM_SUB=sub, LEAN=lean)


def bench_ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def as_tuple(out: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def same_bytes(a, b) -> bool:
    pairs = zip(as_tuple(a), as_tuple(b), strict=True)
    return all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in pairs)


def bench_input(shape: tuple[int, ...]) -> torch.Tensor:
    """randn with NaN, infinities, a negative NaN payload, zero and subnormal blocks, saturating values
    planted in the first slice (they change nothing in the timing; the bit check sees them)."""
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    s = x if x.dim() == 2 else x[0]
    s[0, 0], s[1, 33], s[2, 34] = float("nan"), float("inf"), -float("inf")
    s[40, 100] = torch.tensor(-63, dtype=torch.int16).view(torch.bfloat16)
    s[32:64, 64] = 0.0
    s[64:96, 65] = torch.linspace(-3e-39, 5e-39, 32)
    s[3, 64:96] = 1e30
    return x


def group_row_src(sizes: list[int]) -> torch.Tensor:
    """row_src of token groups padded to multiples of 32 (-1 for padding rows)."""
    src, start = [], 0
    for size in sizes:
        src += list(range(start, start + size)) + [-1] * (-size % 32)
        start += size
    return torch.tensor(src, dtype=torch.int32, device="cuda")


class Table:
    def __init__(self, device: str, copy_gbs: float):
        self.device, self.copy_gbs = device, copy_gbs
        self.rows: list[dict] = []
        self.mismatches: list[str] = []

    def add(self, case: str, kernel: str, ms: float, moved: int, cfg: dict | None = None) -> None:
        gbs = moved / ms / 1e6
        row = dict(case=case, kernel=kernel, config=cfg, us=ms * 1e3, gbs=gbs, pct_copy=100 * gbs / self.copy_gbs)
        self.rows.append(row)
        cfg_s = "" if cfg is None else " ".join(f"{k}={v}" for k, v in cfg.items())
        cfg_s += "  (default)" if cfg == GLUON_FAKE_QUANT_CONFIG else ""
        print(f"{case:34s} {kernel:7s} {ms * 1e3:9.1f} us {gbs:6.0f} GB/s {row['pct_copy']:5.1f}%  {cfg_s}", flush=True)


def bench_case(table: Table, case: str, inputs: tuple[torch.Tensor, ...], triton_fn, gluon_fn) -> None:
    """``triton_fn()`` and ``gluon_fn(cfg)`` return the output tensor(s); bytes moved = inputs + outputs."""
    ref = triton_fn()
    moved = nbytes(*inputs) + nbytes(*as_tuple(ref))
    table.add(case, "triton", bench_ms(triton_fn), moved)
    for c in SWEEP:
        cfg = config(*c)
        out = gluon_fn(cfg)
        ok = same_bytes(out, ref)
        del out
        if not ok:
            table.mismatches.append(f"{case} {cfg}")
            print(f"MISMATCH {case} {cfg}: not timed", flush=True)
            continue
        table.add(case, "gluon", bench_ms(lambda cfg=cfg: gluon_fn(cfg)), moved, cfg)
    del ref
    torch.cuda.empty_cache()


def run_2d(table: Table, x: torch.Tensor, name: str, elem: str, mode: str) -> None:
    """Both results, then along M alone; the Triton kernel forced by its own default tiles."""
    bench_case(table, f"{name} {tuple(x.shape)} both {mode}", (x,),
               lambda: fake_quant_2d(x, elem, mode, True, True, FAKE_QUANT_2D_CONFIG),
               lambda c: gluon_fake_quant_2d(x, elem, mode, True, True, c))  # fmt: skip
    bench_case(table, f"{name} {tuple(x.shape)} along M {mode}", (x,),
               lambda: fake_quant_2d(x, elem, mode, False, True, ALONG_M_CONFIG)[1],
               lambda c: gluon_fake_quant_2d(x, elem, mode, False, True, c)[1])  # fmt: skip


def run_groups(table: Table, elem: str, mode: str) -> None:
    g = bench_input((16640, 8192))
    src = group_row_src([200, 320] * 32)  # 64 groups, 16640 tokens, 17408 padded rows
    bench_case(table, f"g {tuple(g.shape)} 64 groups {mode}", (g, src),
               lambda: fake_quant_groups_along_m(g, src, elem, mode, ALONG_M_CONFIG),
               lambda c: gluon_fake_quant_groups_along_m(g, src, elem, mode, c))  # fmt: skip


def copy_gbs() -> float:
    src = torch.empty(2**29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    gbs = 2 * nbytes(src) / ms / 1e6
    print(f"copy 1 GiB: {ms * 1e3:.1f} us, {gbs:.0f} GB/s (read + write)")
    return gbs


def summary(table: Table) -> None:
    print(f"\n=== Gluon (default config; best of the sweep) vs the Triton kernel: {table.device}; "
          f"copy {table.copy_gbs:.0f} GB/s ===")  # fmt: skip
    for case in dict.fromkeys(r["case"] for r in table.rows):
        t = next(r for r in table.rows if r["case"] == case and r["kernel"] == "triton")
        line = f"{case:34s} triton {t['us']:8.1f} us {t['pct_copy']:5.1f}%"
        gl = [r for r in table.rows if r["case"] == case and r["kernel"] == "gluon"]
        d = next((r for r in gl if r["config"] == GLUON_FAKE_QUANT_CONFIG), None)
        if d is None:
            line += " | gluon default: failed the bit check"
        else:
            line += f" | gluon default {d['us']:8.1f} us {d['pct_copy']:5.1f}% ({t['us'] / d['us']:.3f}x)"
        if gl:
            b = min(gl, key=lambda r: r["us"])
            line += f" | best {b['us']:8.1f} us ({t['us'] / b['us']:.3f}x) {b['config']}"
        print(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="floor")
    p.add_argument("--elem", default="e4m3")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gluon_fake_quant.py needs a CUDA GPU")
    device = torch.cuda.get_device_name()
    print(f"device: {device}; torch {torch.__version__}; triton {triton.__version__}; {args.elem}, bf16 input")
    table = Table(device, copy_gbs())
    for mode in args.modes.split(","):
        x = bench_input((16384, 4096))
        run_2d(table, x, "x", args.elem, mode)
        del x
        for num_experts in (16, 64):
            w = bench_input((num_experts, 8192, 5120))
            run_2d(table, w, "w", args.elem, mode)
            del w
            torch.cuda.empty_cache()
        run_groups(table, args.elem, mode)
    summary(table)
    if args.out:
        with open(args.out, "w") as f:
            result = dict(
                device=device,
                torch=torch.__version__,
                triton=triton.__version__,
                elem=args.elem,
                copy_gbs=table.copy_gbs,
                default_config=GLUON_FAKE_QUANT_CONFIG,
                rows=table.rows,
                mismatches=table.mismatches,
            )
            json.dump(result, f, indent=1)
    if table.mismatches:
        print("\nbit mismatches against the Triton kernel:\n  " + "\n  ".join(table.mismatches))
        sys.exit(1)


if __name__ == "__main__":
    main()
