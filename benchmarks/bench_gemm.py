"""MX GEMM backends against a bf16 torch.mm, in the same run: TFLOP/s and the time ratio to bf16.

out = a @ b.T for a [M, K] and b [N, K], both cast along K (``cast_dim0``, e4m3 by default), at
8192^3 and at M = 16384 with (K, N) in (4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192).
Per shape, what the device offers:

* bf16:        torch.mm of the bf16 inputs (the baseline);
* emulated:    dequantize both MX operands to bf16, then torch.mm (mx_mm's emulated backend), timed
               as a whole, under torch.compile (``--eager``: not);
* emulated_mm: that torch.mm alone, of the already dequantized operands;
* triton:      tl.dot_scaled (``mx_mm_triton``), NVIDIA sm_89 and later;
* cublas:      torch's MXFP8 GEMM with blocked scales (``mx_mm_blocked``), sm_100, fp8 elements.

Before timing, each MX result is compared with the emulated one computed in fp32:
max |MX - emulated| / max |emulated|: summation order and one bf16 rounding, a few 1e-3 at most.
``--out`` writes JSON with provenance for docs/results/ (rendered by scripts/perf_report.py).

    python benchmarks/bench_gemm.py [--elem e4m3] [--rule floor] [--eager] [--out FILE]
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
from timing import add_run_args, median_ms, require_cuda, run_meta

from mx_recipe.cli import ArgumentParser
from mx_recipe.formats.mx import ELEM_FORMATS, SCALE_RULES, MXTensor
from mx_recipe.ops.gemm import CUBLAS_ELEMS, cublas_available, mx_mm, mx_mm_blocked, mx_mm_triton, triton_available
from mx_recipe.ops.mx_cast import cast_dim0

SHAPES = [(8192, 8192, 8192)] + [(16384, k, n) for k, n in [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192)]]
BACKEND_TITLES = {  # perf_report.py renders these column titles
    "emulated": "emulated (dequantize + mm)",
    "emulated_mm": "emulated, mm alone",
    "triton": "triton dot_scaled",
    "cublas": "cublas",
}


def tflops(m: int, k: int, n: int, ms: float) -> float:
    return 2 * m * k * n / ms / 1e9


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|: 0 for the same sums, ~2**-8 for one bf16 rounding apart."""
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def make_row(m: int, k: int, n: int, bf16_ms: float, mx: dict[str, tuple[float, float]]) -> dict:
    """One result row: ``mx`` maps backend -> (ms, rel_err); times are per GEMM, medians."""
    return {
        "M": m,
        "K": k,
        "N": n,
        "bf16_ms": bf16_ms,
        "bf16_tflops": tflops(m, k, n, bf16_ms),
        "mx": {
            name: {"ms": ms, "tflops": tflops(m, k, n, ms), "ratio": ms / bf16_ms, "rel_err": err}
            for name, (ms, err) in mx.items()
        },
    }


def bench_shape(
    m: int,
    k: int,
    n: int,
    elem: str,
    rule: str,
    compiled: bool,
    device: torch.device | None = None,
    timer: Callable[[Callable[[], torch.Tensor]], float] = median_ms,
) -> dict:
    """One row (``make_row``) for one shape. ``device`` and ``timer`` let tests run it on the CPU."""
    device = device or torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g)
    a, b = cast_dim0(x, elem, rule), cast_dim0(w, elem, rule)
    ref = mx_mm(a, b, torch.float32, "emulated")  # exact products, fp32 sums

    bf16_ms = timer(lambda: torch.mm(x, w.t()))
    mx: dict[str, tuple[float, float]] = {}

    def emulated(aq: torch.Tensor, a_s: torch.Tensor, bq: torch.Tensor, b_s: torch.Tensor) -> torch.Tensor:
        return mx_mm(MXTensor(aq, a_s, elem, 1), MXTensor(bq, b_s, elem, 1), torch.bfloat16, "emulated")

    emulated_fn = torch.compile(emulated, fullgraph=True) if compiled else emulated
    # Scales as their uint8 bytes (dequantize reads them so): inductor (torch 2.13, CPU) has no float8_e8m0fnu.
    args = (a.qdata, a.scale.view(torch.uint8), b.qdata, b.scale.view(torch.uint8))
    out = emulated_fn(*args)
    mx["emulated"] = timer(lambda: emulated_fn(*args)), rel_err(out, ref)
    ad, bd = a.dequantize(torch.bfloat16), b.dequantize(torch.bfloat16)
    mx["emulated_mm"] = timer(lambda: torch.mm(ad, bd.t())), rel_err(torch.mm(ad, bd.t()), ref)

    if triton_available(device):
        out = mx_mm_triton(a, b, torch.bfloat16)
        mx["triton"] = timer(lambda: mx_mm_triton(a, b, torch.bfloat16)), rel_err(out, ref)
    if cublas_available(device) and elem in CUBLAS_ELEMS:
        ab, bb = cast_dim0(x, elem, rule, blocked_scales=True), cast_dim0(w, elem, rule, blocked_scales=True)
        try:
            out = mx_mm_blocked(ab, bb, torch.bfloat16)
            mx["cublas"] = timer(lambda: mx_mm_blocked(ab, bb, torch.bfloat16)), rel_err(out, ref)
        except (RuntimeError, NotImplementedError) as err:  # e5m2: torch's checks accept it, cuBLAS may not
            print(f"cublas failed at {m}x{k}x{n} ({elem}): {err}")
    return make_row(m, k, n, bf16_ms, mx)


def main() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--elem", default="e4m3", choices=list(ELEM_FORMATS))
    parser.add_argument("--rule", default="floor", choices=list(SCALE_RULES))
    args = add_run_args(parser, rounds=False).parse_args()
    require_cuda("bench_gemm.py")
    print(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, elem {args.elem}, rule {args.rule}, "
        f"emulated {'eager' if args.eager else 'under torch.compile'}; TFLOP/s (time / bf16 time), "
        "[max |MX - emulated fp32| / max |emulated|]"
    )
    rows = []
    for m, k, n in SHAPES:
        rows.append(bench_shape(m, k, n, args.elem, args.rule, not args.eager))
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        r = rows[-1]
        cells = [f"{name} {v['tflops']:.0f} ({v['ratio']:.2f}x) [{v['rel_err']:.1e}]" for name, v in r["mx"].items()]
        print(f"{m:>6} {k:>6} {n:>6}  bf16 {r['bf16_tflops']:.0f}  " + "  ".join(cells))
    if args.out:
        backends = [name for name in BACKEND_TITLES if any(name in r["mx"] for r in rows)]
        meta = run_meta(elem=args.elem, rule=args.rule, compiled=not args.eager)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "backends": backends, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
