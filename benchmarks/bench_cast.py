"""The MX cast kernels against the HBM roofline and the torch.compile'd reference.

    python benchmarks/bench_cast.py [--m 16384 --k 16384] [--experts 1,4,16,64] [--modes floor,rceil] [--no-gluon]
        [--out FILE]

For each cast of ``mx_recipe.ops.mx_cast`` (the public API, as a user calls it): median time
(triton.testing.do_bench: CUDA events around each call, so the host's launch path counts where it is
slower than the kernels), GB/s counting bytes read + written (input, qdata, scales), % of the
device-to-device copy bandwidth measured in the same run; then the same from the GPU time of the
kernels one call launches (torch.profiler: what the kernels themselves reach); and for the 2D casts
the speedup over torch.compile of the reference (``to_mx`` for dim0, ``to_mx(x.t().contiguous())``
for dim1). Then the cast targets of docs/DESIGN.md (Performance targets), judged on both figures:
every cast >= 90% of copy bandwidth, rceil within 3% of floor, fused >= 1.4x two separate casts, 3D
GB/s flat across E within 10%. A copy of the same bytes as each 3D and per-group input is timed too:
what the copy itself reaches at that size. (The host time of each call: benchmarks/bench_host.py.)

``--no-gluon`` (the kernel setting ``gluon=False``) times the Triton kernels where Gluon ones would run.
``--out`` writes JSON with provenance for docs/results/ (rendered by scripts/perf_report.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
from timing import kernel_us, median_ms, require_cuda, run_meta

import mx_recipe.ops.mx_cast as mx_cast
from mx_recipe.cli import ArgumentParser, int_list, names, output_file
from mx_recipe.formats.mx import ELEM_FORMATS, SCALE_RULES, to_mx
from mx_recipe.ops import KernelSettings, set_kernel_settings
from mx_recipe.ops.mx_cast import (
    cast_dim0,
    cast_dim0_dim1,
    cast_dim1,
    fake_quant_along_m,
    fake_quant_dim0,
    fake_quant_dim0_dim1,
)


def timed(fn: Callable, *args, **kwargs) -> tuple[tuple[float, float], object]:
    """((median ms of fn(*args, **kwargs), ms of the GPU kernels it launches), one result of it)."""
    call = lambda: fn(*args, **kwargs)
    return (median_ms(call), kernel_us(call, calls=10, flush_l2=True) / 1e3), call()


def separate(x: torch.Tensor, elem: str, mode: str, blocked: bool):
    """The unfused baseline: two casts, two reads of x."""
    return cast_dim0(x, elem, mode, blocked), cast_dim1(x, elem, mode, blocked)


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def out_bytes(result) -> int:
    results = result if isinstance(result, tuple) else (result,)
    return sum(nbytes(r.qdata, r.scale) for r in results)


def copy_bandwidth_gbs() -> tuple[float, float]:
    """Device-to-device copy of 1 GiB, counting bytes read + written: (events GB/s, kernel GB/s)."""
    src = torch.randn(2**28, device="cuda")  # 1 GiB fp32
    dst = torch.empty_like(src)
    (ms, kernel_ms), _ = timed(dst.copy_, src)
    return 2 * nbytes(src) / ms / 1e6, 2 * nbytes(src) / kernel_ms / 1e6


class Results:
    def __init__(self, copy_gbs: tuple[float, float]):
        self.copy_gbs, self.copy_kernel_gbs = copy_gbs
        self.rows: list[dict] = []

    def add(self, name: str, shape, mode: str, ms: tuple[float, float], bytes_moved: int) -> dict:
        """``ms``: (events, kernels) milliseconds of one call."""
        gbs, kernel_gbs = bytes_moved / ms[0] / 1e6, bytes_moved / ms[1] / 1e6
        row = dict(
            name=name,
            shape=list(shape),
            mode=mode,
            us=ms[0] * 1e3,
            gbs=gbs,
            pct_copy=100 * gbs / self.copy_gbs,
            kernel_us=ms[1] * 1e3,
            kernel_gbs=kernel_gbs,
            kernel_pct_copy=100 * kernel_gbs / self.copy_kernel_gbs,
            speedup_vs_compiled_ref=None,
        )
        self.rows.append(row)
        print(
            f"{name:28s} {str(tuple(shape)):20s} {mode:6s} {ms[0] * 1e3:9.1f} us {gbs:7.0f} GB/s "
            f"{row['pct_copy']:5.1f}% | kernels {ms[1] * 1e3:9.1f} us {row['kernel_pct_copy']:5.1f}%"
        )
        return row

    def casts(self, fake_quant: bool = False) -> list[dict]:
        """The rows the >= 90% target of docs/DESIGN.md (Performance targets) applies to: the MX casts (dim0,
        dim1, fused, 3D, per-group), not copies or two-cast baselines; ``fake_quant``: the emulated GEMM path's
        fake-quants instead (no target of their own)."""
        return [
            r
            for r in self.rows
            if "separate" not in r["name"]
            and not r["name"].startswith("copy")
            and r["name"].startswith("fq") == fake_quant
        ]

    def get(self, name: str, mode: str, shape=None) -> dict:
        for r in self.rows:
            if r["name"] == name and r["mode"] == mode and (shape is None or r["shape"] == list(shape)):
                return r
        raise KeyError((name, mode, shape))


def copy_like(res: Results, x: torch.Tensor) -> None:
    """A copy of x's bytes: what the copy itself reaches at this size (not a cast: no target)."""
    dst = torch.empty_like(x)
    ms, _ = timed(dst.copy_, x)
    res.add("copy (same size)", x.shape, "-", ms, 2 * nbytes(x))


def bench_2d(res: Results, m: int, k: int, elem: str, modes: list[str]) -> None:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    for mode in modes:
        for blocked in (False, True):
            tag = " blocked" if blocked else ""
            for name, fn in (
                ("dim0", cast_dim0),
                ("dim1", cast_dim1),
                ("dim0_dim1 fused", cast_dim0_dim1),
                ("dim0 + dim1 separate", separate),
            ):
                ms, out = timed(fn, x, elem, mode, blocked)
                reads = 2 if fn is separate else 1
                res.add(name + tag, x.shape, mode, ms, reads * nbytes(x) + out_bytes(out))


def fake_quant_separate(x: torch.Tensor, elem: str, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused fake-quant's two halves as two calls: two reads of x."""
    return fake_quant_dim0(x, elem, mode), fake_quant_along_m(x, elem, mode)


def bench_fake_quant(res: Results, shape: tuple[int, ...], elem: str, modes: list[str]) -> None:
    """The emulated backend's casts (bf16 in, dequantized bf16 out): bytes = input + outputs."""
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    for mode in modes:
        for name, fn in (
            ("fq dim0", fake_quant_dim0),
            ("fq along M", fake_quant_along_m),
            ("fq dim0 + along M fused", fake_quant_dim0_dim1),
            ("fq dim0 + along M separate", fake_quant_separate),
        ):
            ms, out = timed(fn, x, elem, mode)
            outs = out if isinstance(out, tuple) else (out,)
            reads = 2 if fn is fake_quant_separate else 1
            res.add(name, x.shape, mode, ms, reads * nbytes(x) + nbytes(*outs))


def bench_compiled_refs(res: Results, m: int, k: int, elem: str, modes: list[str]) -> None:
    """torch.compile of the reference, last (compiling takes a while): fills the speedup column."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    for mode in modes:
        ref0, _ = timed(torch.compile(to_mx), x, elem, mode, dim=-1)
        ref1, _ = timed(torch.compile(lambda t, e, r: to_mx(t.t().contiguous(), e, r, dim=-1)), x, elem, mode)
        print(
            f"torch.compile reference {mode}: dim0 {ref0[0] * 1e3:.1f} us, "
            f"dim1 via x.t().contiguous() {ref1[0] * 1e3:.1f} us"
        )
        both = (ref0[0] + ref1[0], ref0[1] + ref1[1])
        for name, ref in (("dim0", ref0), ("dim1", ref1), ("dim0 + dim1 separate", both), ("dim0_dim1 fused", both)):
            row = res.get(name, mode, x.shape)
            row["speedup_vs_compiled_ref"] = ref[0] * 1e3 / row["us"]


def bench_3d(res: Results, experts: list[int], n: int, k: int, elem: str, modes: list[str]) -> None:
    for e in experts:
        w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
        copy_like(res, w)
        for mode in modes:
            for name, fn in (("3d dim0 blocked", mx_cast.cast_3d_dim0), ("3d dim1 blocked", mx_cast.cast_3d_dim1)):
                ms, out = timed(fn, w, elem, mode, True)
                res.add(name, w.shape, mode, ms, nbytes(w) + out_bytes(out))
                out = None
        w = None
        torch.cuda.empty_cache()


def bench_groups(res: Results, m: int, k: int, num_groups: int, elem: str, modes: list[str]) -> None:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    # uneven groups, multiples of 32 rows, one empty, summing to m
    g = torch.Generator().manual_seed(0)
    weights = torch.rand(num_groups, generator=g)
    weights[num_groups // 2] = 0
    sizes = (weights / weights.sum() * (m // 32)).floor().long() * 32
    sizes[0] += m - sizes.sum()
    offs = sizes.cumsum(0).to(torch.int32).cuda()
    copy_like(res, x)
    for mode in modes:
        ms, out = timed(mx_cast.cast_groups_dim1, x, offs, elem, mode, blocked_scales=True)
        res.add(f"groups dim1 blocked G={num_groups}", x.shape, mode, ms, nbytes(x) + out_bytes(out))


def check_targets(res: Results, experts: list[int], n: int, k: int, modes: list[str]) -> list[str]:
    """The cast targets of docs/DESIGN.md (Performance targets), each judged on the events time and on the
    kernel time."""
    lines = []
    for mode in modes:
        sep, fused = res.get("fq dim0 + along M separate", mode), res.get("fq dim0 + along M fused", mode)
        lines.append(f"fake-quant fused speedup over separate {mode}: {sep['us'] / fused['us']:.2f}x")
    for key, what in (("pct_copy", "events"), ("kernel_pct_copy", "kernels")):
        for fake_quant, label, target in ((False, "cast", " (target >= 90%)"), (True, "fake-quant", "")):
            rows = res.casts(fake_quant)
            if rows:
                worst = min(rows, key=lambda r: r[key])
                lines.append(
                    f"slowest {label} ({what}): {worst['name']} {tuple(worst['shape'])} {worst['mode']} at "
                    f"{worst[key]:.1f}% of copy{target}"
                )
    if set(modes) >= {"floor", "rceil"}:
        for r in res.rows:
            if r["mode"] == "rceil":
                f = res.get(r["name"], "floor", r["shape"])
                lines.append(
                    f"rceil/floor time {r['name']} {tuple(r['shape'])}: events {r['us'] / f['us']:.3f}, "
                    f"kernels {r['kernel_us'] / f['kernel_us']:.3f} (target <= 1.03)"
                )
    for mode in modes:
        for tag in ("", " blocked"):
            sep, fused = res.get("dim0 + dim1 separate" + tag, mode), res.get("dim0_dim1 fused" + tag, mode)
            lines.append(
                f"fused speedup over separate{tag} {mode}: events {sep['us'] / fused['us']:.2f}x, "
                f"kernels {sep['kernel_us'] / fused['kernel_us']:.2f}x (target >= 1.4x)"
            )
    for name in ("3d dim0 blocked", "3d dim1 blocked"):
        for mode in modes:
            rows = [res.get(name, mode, (e, n, k)) for e in experts]
            if rows:
                spread = [max(r[key] for r in rows) / min(r[key] for r in rows) for key in ("gbs", "kernel_gbs")]
                lines.append(
                    f"{name} {mode}: GB/s across E={experts}: max/min events {spread[0]:.3f}, "
                    f"kernels {spread[1]:.3f} (target <= 1.10)"
                )
    return lines


def main() -> None:
    p = ArgumentParser(description=__doc__)
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--k", type=int, default=16384)
    p.add_argument("--experts", type=int_list(), default=(1, 4, 16, 64), help="comma-separated E for the 3D casts")
    p.add_argument("--n3d", type=int, default=8192)
    p.add_argument("--k3d", type=int, default=5120)
    p.add_argument("--elem", default="e4m3", choices=list(ELEM_FORMATS))
    p.add_argument("--modes", type=names(SCALE_RULES), default=("floor", "rceil"), help="comma-separated")
    p.add_argument("--no-compile-ref", action="store_true", help="skip the torch.compile'd reference")
    p.add_argument("--no-gluon", action="store_true", help="the Triton kernels where Gluon ones would run (Hopper)")
    p.add_argument("--out", type=output_file, help="write the results as JSON here")
    args = p.parse_args()
    require_cuda("bench_cast.py")
    set_kernel_settings(KernelSettings(gluon=not args.no_gluon))
    experts, modes = list(args.experts), list(args.modes)

    device = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth_gbs()
    print(
        f"device: {device}; torch {torch.__version__}; device-to-device copy of 1 GiB (read + write): "
        f"{copy_gbs[0]:.0f} GB/s events, {copy_gbs[1]:.0f} GB/s kernel"
    )
    res = Results(copy_gbs)
    bench_2d(res, args.m, args.k, args.elem, modes)
    bench_fake_quant(res, (args.m, args.k), args.elem, modes)
    bench_fake_quant(res, (max(experts), args.n3d, args.k3d), args.elem, modes[:1])
    bench_3d(res, experts, args.n3d, args.k3d, args.elem, modes)
    bench_groups(res, 16640, args.k3d, 16, args.elem, modes)
    meta = run_meta(copy_gbs=copy_gbs[0], copy_kernel_gbs=copy_gbs[1], elem=args.elem)
    write_json(args.out, meta, res, [])  # in case the compiled references run out of time
    if not args.no_compile_ref:
        try:
            bench_compiled_refs(res, args.m, args.k, args.elem, modes)
        except Exception as exc:  # a compiler failure must not lose the kernel results
            print(f"torch.compile reference failed: {type(exc).__name__}: {str(exc)[:500]}")

    print(
        f"\n=== MX cast benchmark: {device}, copy {copy_gbs[0]:.0f} GB/s (events) / {copy_gbs[1]:.0f} GB/s "
        f"(kernel), elem {args.elem}, bf16 input ==="
    )
    print(
        f"{'cast':28s} {'shape':20s} {'mode':6s} {'time':>12s} {'GB/s':>12s} {'%copy':>6s} | "
        f"{'kernels':>12s} {'%copy':>6s}  vs torch.compile ref"
    )
    for r in res.rows:
        ref = "" if r["speedup_vs_compiled_ref"] is None else f"  {r['speedup_vs_compiled_ref']:.2f}x"
        print(
            f"{r['name']:28s} {str(tuple(r['shape'])):20s} {r['mode']:6s} {r['us']:9.1f} us "
            f"{r['gbs']:7.0f} GB/s {r['pct_copy']:5.1f}% | {r['kernel_us']:9.1f} us {r['kernel_pct_copy']:5.1f}%{ref}"
        )
    targets = check_targets(res, experts, args.n3d, args.k3d, modes)
    print("\n" + "\n".join(targets))
    write_json(args.out, meta, res, targets)


def write_json(path: str | None, meta: dict, res: Results, targets: list[str]) -> None:
    if path:
        with open(path, "w") as f:
            data = dict(meta=meta, results=res.rows, targets=targets)
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
