"""Benchmark the Gluon 3D dim1 and per-group dim1 casts (mx_kernels.gluon_casts on [E, N, K], gluon_cast_groups)
against the Triton kernels.

    python3 scripts/bench_gluon_3d_groups.py [--experts 1,4,16,64] [--groups 16,64] [--modes floor]
                                             [--elem e4m3] [--no-sweep] [--out r.json]

Prints the device and the device-to-device copy bandwidth of this run (1 GiB, read + write: the
convention of scripts/bench_cast.py), then per case the Triton kernel (its own config passed
explicitly: without one, Hopper runs the Gluon kernel) and the Gluon kernel over a small config
sweep: median time (triton.testing.do_bench), GB/s counting bytes read + written (input, qdata,
scales with their padding), % of the copy's GB/s, and the Triton / Gluon time ratio. Every Gluon
output is first compared byte for byte with the Triton kernel's on the same input (NaN, infinities,
a zero block, subnormals and saturating values planted); a config that differs is reported and not
timed, and the script exits 1 at the end.

Cases (bf16 input): 3D dim1 with blocked scales, x [E, 8192, 5120] for each E of --experts, and with
plain scales for E = 16; per-group dim1 (blocked per group), x [16640, 5120] in G near-equal groups of
multiples of 32 rows, for each G of --groups. Peak GPU memory 12.7 GiB on an H200 (E = 64: x is 5 GiB,
plus its copy or the Triton and one Gluon output). ``scripts/bench_cast.py`` times the same casts
through the public API (on Hopper: the Gluon kernels with their defaults).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial

import mx_recipe.formats  # noqa: F401  (before mx_kernels: see kernels/gluon_casts.py)

# isort: split
import torch
import triton
import triton.testing
from mx_kernels.cast_dim1 import DIM1_CONFIG as TRITON_DIM1
from mx_kernels.cast_dim1 import cast_dim1
from mx_kernels.cast_groups_dim1 import GROUPS_DIM1_CONFIG as TRITON_GROUPS
from mx_kernels.cast_groups_dim1 import cast_groups_dim1
from mx_kernels.gluon_cast_groups import gluon_cast_groups_dim1
from mx_kernels.gluon_casts import gluon_cast_dim1

N3D, K3D = 8192, 5120
M_GROUPS, K_GROUPS = 16640, 5120


def cfg(rows: int, block_k: int, warps: int, sub: int, lean: bool = True, **extra) -> dict:
    return dict(ROWS=rows, BLOCK_K=block_k, NUM_WARPS=warps, NUM_SUB=sub, LEAN=lean, **extra)


# None: the default (gluon_casts.DIM1_CONFIG: 128 x 128 LINES tiles, as in 2D). The 32-row configs below were the
# 3D kernel's before (ROWS 8, BLOCK_K 256, 4 warps, 2 sub-tiles, SCATTER: the default until LINES); registers of
# that kernel (sm_90 compile, blocked, even shape) in brackets. The H200 run of this sweep then:
# docs/profiles/2026-11-21_h200_gluon_3d_groups.txt (then with the prototypes' MAXNREG / SKIP_IDLE).
SWEEP_3D = [
    None,
    cfg(8, 256, 4, 2, PLAIN_VIA_BLOCKED=True, SCATTER=True),  # [95] the 32-row default before LINES
    cfg(8, 256, 4, 1, PLAIN_VIA_BLOCKED=True),  # [56] one sub-tile: twice the programs
    cfg(4, 128, 4, 2, PLAIN_VIA_BLOCKED=True),  # [64] the base tile, LEAN
    cfg(16, 512, 4, 1, PLAIN_VIA_BLOCKED=True),  # [108] 16-byte qdata stores (16 rows of [K, N])
    cfg(8, 256, 4, 2, False, PLAIN_VIA_BLOCKED=True),  # [93] the default without LEAN
]
# plain scales: the default (blocked, then unblock_scales) against the kernel's own plain scale stores
SWEEP_3D_PLAIN = [
    None,
    cfg(8, 256, 4, 2, PLAIN_VIA_BLOCKED=False),  # [119]
    cfg(4, 128, 4, 2, PLAIN_VIA_BLOCKED=False),  # [70]
]
# None: the default (gluon_cast_groups.GLUON_GROUPS_CONFIG: ROWS 8, BLOCK_K 256, 4 warps, 1 sub-tile, LEAN:
# 4 programs per 128-row tile column [60-64]; GLUON_GROUPS_LINES_CONFIG where groups average >= 1024 rows)
SWEEP_GROUPS = [
    None,
    cfg(8, 256, 4, 2),  # [144] the 2D dim1 tile: the row masks cost registers
    cfg(4, 128, 4, 2),  # [80]
    cfg(4, 128, 4, 4),  # [188] one program per tile column (4 scale bytes per k)
    cfg(16, 512, 4, 1),
    cfg(8, 256, 4, 1, False),  # the default without LEAN
]


def bench_ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def same_bytes(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(
        x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True)
    )


def plant_specials(x: torch.Tensor) -> torch.Tensor:
    """NaN (and a negative NaN with a payload), +-inf, a zero block along M, subnormals, saturation under
    floor, in x [M, K] (a view: the caller's tensor changes). The timing does not depend on them."""
    x[0, 0], x[1, 33], x[2, 34] = float("nan"), float("inf"), -float("inf")
    x[40, 100] = torch.tensor(-63, dtype=torch.int16).view(torch.bfloat16)
    x[32:64, 64] = 0.0
    x[64:96, 65] = torch.linspace(-3e-39, 5e-39, 32)
    x[3, 64:96] = 1e30
    return x


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 1 GiB, counting bytes read + written (as scripts/bench_cast.py)."""
    src = torch.randn(2**28, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes(src) / ms / 1e6


class Table:
    def __init__(self, device: str, copy_gbs: float):
        self.device, self.copy_gbs = device, copy_gbs
        self.rows: list[dict] = []
        self.mismatches: list[str] = []

    def add(self, case: str, kernel: str, mode: str, ms: float, moved: int, config: dict | None = None) -> dict:
        gbs = moved / ms / 1e6
        row = dict(case=case, kernel=kernel, mode=mode, config=config, us=ms * 1e3, gbs=gbs,
                   pct_copy=100 * gbs / self.copy_gbs, bytes=moved)  # fmt: skip
        self.rows.append(row)
        cfg_s = "default" if config is None else " ".join(f"{k}={v}" for k, v in config.items())
        line = f"{case:34s} {mode:6s} {kernel:7s} {ms * 1e3:9.1f} us {gbs:6.0f} GB/s {row['pct_copy']:5.1f}%"
        print(line + (f"  {cfg_s}" if kernel == "gluon" else ""))
        return row

    def get(self, case: str, kernel: str, mode: str) -> list[dict]:
        return [r for r in self.rows if r["case"] == case and r["kernel"] == kernel and r["mode"] == mode]


def run_case(table: Table, case: str, mode: str, x_bytes: int, triton_fn, gluon_fn, configs: list) -> None:
    """Time the Triton kernel, then each Gluon config whose outputs equal Triton's byte for byte."""
    ref = triton_fn()
    moved = x_bytes + nbytes(*ref)
    table.add(case, "triton", mode, bench_ms(triton_fn), moved)
    for config in configs:
        out = gluon_fn(config)
        ok = same_bytes(out, ref)
        del out
        if not ok:
            table.mismatches.append(f"{case} {mode} {config}")
            print(f"MISMATCH {case} {mode} {config}: not timed")
            continue
        table.add(case, "gluon", mode, bench_ms(partial(gluon_fn, config)), moved, config)
    del ref
    torch.cuda.empty_cache()


def bench_3d(table: Table, experts: int, modes: list[str], elem: str, sweep: bool) -> None:
    """The 3D cases of one expert count (x lives until the return)."""
    x = torch.randn(experts, N3D, K3D, device="cuda", dtype=torch.bfloat16)
    plant_specials(x[0])
    copy_dst = torch.empty_like(x)
    copy_ms = bench_ms(partial(copy_dst.copy_, x))
    table.add(f"3d E={experts} (copy of x)", "copy", "-", copy_ms, 2 * nbytes(x))
    del copy_dst
    for mode in modes:
        for blocked in (True, False) if experts == 16 else (True,):
            name = "blocked" if blocked else "plain"
            run_case(
                table, f"3d dim1 {name} E={experts}", mode, nbytes(x),
                partial(cast_dim1, x, elem, mode, blocked, TRITON_DIM1),
                partial(gluon_cast_dim1, x, elem, mode, blocked),
                (SWEEP_3D if blocked else SWEEP_3D_PLAIN) if sweep else [None],
            )  # fmt: skip


def even_groups(m: int, num_groups: int) -> list[int]:
    """m rows in num_groups near-equal groups of multiples of 32 rows (the first ones one block larger)."""
    blocks, extra = divmod(m // 32, num_groups)
    return [32 * (blocks + (g < extra)) for g in range(num_groups)]


def bench_groups(table: Table, x: torch.Tensor, num_groups: int, modes: list[str], elem: str, sweep: bool) -> None:
    sizes = even_groups(x.shape[0], num_groups)
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    case = f"groups dim1 blocked G={num_groups}"
    print(f"{case}: group sizes {sorted(set(sizes))} rows")
    for mode in modes:
        run_case(
            table, case, mode, nbytes(x),
            partial(cast_groups_dim1, x, offs, elem, mode, TRITON_GROUPS),
            partial(gluon_cast_groups_dim1, x, offs, elem, mode),
            SWEEP_GROUPS if sweep else [None],
        )  # fmt: skip


def summary(table: Table) -> None:
    print(f"\n=== Triton vs Gluon (best config, and the default): {table.device}, copy {table.copy_gbs:.0f} GB/s ===")
    cases = dict.fromkeys((r["case"], r["mode"]) for r in table.rows if r["kernel"] == "triton")
    for case, mode in cases:
        t = table.get(case, "triton", mode)[0]
        line = f"{case:30s} {mode:6s} triton {t['us']:8.1f} us {t['pct_copy']:5.1f}%"
        gl_rows = table.get(case, "gluon", mode)
        if not gl_rows:
            print(line + "  gluon: no config passed the byte check")
            continue
        best = min(gl_rows, key=lambda r: r["us"])
        default = [r for r in gl_rows if r["config"] is None]
        line += f" | gluon best {best['us']:8.1f} us {best['pct_copy']:5.1f}% ({t['us'] / best['us']:.2f}x)"
        if default:
            d = default[0]
            line += f" | default {d['us']:8.1f} us {d['pct_copy']:5.1f}% ({t['us'] / d['us']:.2f}x)"
        print(line + f"  best: {best['config'] or 'default'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", default="1,4,16,64")
    p.add_argument("--groups", default="16,64")
    p.add_argument("--modes", default="floor")
    p.add_argument("--elem", default="e4m3")
    p.add_argument("--no-sweep", action="store_true", help="the default Gluon config only")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gluon_3d_groups.py needs a CUDA GPU")
    experts = [int(e) for e in args.experts.split(",") if e]
    group_counts = [int(g) for g in args.groups.split(",") if g]
    modes = args.modes.split(",")
    device = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth_gbs()
    torch.cuda.empty_cache()
    print(f"device: {device}; torch {torch.__version__}; triton {triton.__version__}; elem {args.elem}, bf16 input")
    print(f"device-to-device copy (1 GiB, read + write): {copy_gbs:.0f} GB/s")
    table = Table(device, copy_gbs)
    for e in experts:
        bench_3d(table, e, modes, args.elem, not args.no_sweep)
        torch.cuda.empty_cache()
    x = plant_specials(torch.randn(M_GROUPS, K_GROUPS, device="cuda", dtype=torch.bfloat16))
    for num_groups in group_counts:
        bench_groups(table, x, num_groups, modes, args.elem, not args.no_sweep)
    summary(table)
    print(f"peak GPU memory allocated: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    if args.out:
        meta = dict(device=device, torch=torch.__version__, triton=triton.__version__, elem=args.elem,
                    copy_gbs=copy_gbs, triton_dim1_config=TRITON_DIM1, triton_groups_config=TRITON_GROUPS)  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=table.rows, mismatches=table.mismatches), f, indent=1)
    if table.mismatches:
        print("\nbyte mismatches against the Triton kernels:\n  " + "\n  ".join(table.mismatches))
        sys.exit(1)


if __name__ == "__main__":
    main()
