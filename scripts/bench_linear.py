"""MXLinear against nn.Linear, forward + backward, both torch.compile'd, in the same run.

For M = 16384 and (K, N) in (4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192) (DESIGN.md
targets: MX time <= 1.10x bf16 on Hopper), prints the device, each time, the ratio and the peak
memory of one step; --out writes JSON with provenance for docs/results/.

    python scripts/bench_linear.py [--recipe mxfp8] [--m 16384] [--eager] [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_meta import run_meta
from triton.testing import do_bench

from mx_recipe import MXLinear, MXRecipe

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192)]


def fwd_bwd_ms(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[float, float]:
    """Median time of forward + backward, and the peak memory of one step above the inputs (GiB)."""

    def step():
        layer(x).backward(grad)

    ms = do_bench(step, warmup=25, rep=200, return_mode="median", grad_to_none=[x, *layer.parameters()])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="mxfp8")
    parser.add_argument("--m", type=int, default=16384)
    parser.add_argument("--eager", action="store_true", help="do not torch.compile either layer")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_linear.py needs a CUDA GPU")
    recipe = MXRecipe.from_name(args.recipe)
    print(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, recipe {recipe.name}, "
        f"{'eager' if args.eager else 'torch.compile'}, M = {args.m}"
    )
    rows = []
    for k, n in SHAPES:
        torch.manual_seed(0)
        bf16 = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        mx = MXLinear.from_linear(bf16, recipe)
        x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(args.m, n, device="cuda", dtype=torch.bfloat16)
        wrap = (lambda m: m) if args.eager else torch.compile
        bf16_ms, bf16_gib = fwd_bwd_ms(wrap(bf16), x, grad)
        mx_ms, mx_gib = fwd_bwd_ms(wrap(mx), x, grad)
        flops = 3 * 2 * args.m * k * n
        rows.append(
            {
                "M": args.m,
                "K": k,
                "N": n,
                "bf16_ms": bf16_ms,
                "mx_ms": mx_ms,
                "ratio": mx_ms / bf16_ms,
                "bf16_tflops": flops / bf16_ms / 1e9,
                "bf16_peak_gib": bf16_gib,
                "mx_peak_gib": mx_gib,
            }
        )
        del bf16, mx, x, grad
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    print(
        f"{'M':>6} {'K':>6} {'N':>6} {'bf16 ms':>9} {'MX ms':>9} {'MX/bf16':>8} {'bf16 TFLOP/s':>13} "
        f"{'bf16 GiB':>9} {'MX GiB':>8}"
    )
    for r in rows:
        verdict = "meets" if r["ratio"] <= 1.10 else "misses"
        print(
            f"{r['M']:>6} {r['K']:>6} {r['N']:>6} {r['bf16_ms']:>9.3f} {r['mx_ms']:>9.3f} {r['ratio']:>7.2f}x "
            f"{r['bf16_tflops']:>13.0f} {r['bf16_peak_gib']:>9.2f} {r['mx_peak_gib']:>8.2f}  ({verdict} <= 1.10x)"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": run_meta(recipe=recipe.name, compiled=not args.eager), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
