"""MXLinear against nn.Linear, forward + backward, both torch.compile'd, in the same run.

For M = 16384 and (K, N) in (4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192) (the target of
docs/DESIGN.md, Performance targets: MX time <= 1.10x bf16 on Hopper, <= 1.15x for the 4-bit recipes), prints
the device, each time, the ratio
and the peak memory of one step; --out writes JSON with provenance for docs/results/.

MX is timed as the recipe is and with ``fuse_x_casts`` (mx_fuse: x read once in forward for both
of its fake-quants, x along M saved instead of x; recipe.py).

Activation memory, for bf16, MX, MX with ``save_mx_input`` (x saved for backward in MX form,
recipe.py) and mx_fuse: the bytes autograd saves for backward per layer (saved_tensors_hooks on an eager
forward, parameters not counted), the memory a forward leaves allocated until its backward (output
and saved tensors, of the benchmarked, possibly compiled, layer) and the peak of one step.

Times are wall medians with every variant interleaved in --rounds rounds (timing.py), so a
drift of the GPU between measurements lands on all of them; each row also carries the summed GPU
kernel time of one step per variant and the spread of the round medians.

    python benchmarks/bench_linear.py [--recipe mxfp8] [--m 16384] [--eager] [--rounds 5] [--out FILE]

--recipe takes the MX recipes and the NVFP4 ones (nvfp4, nvfp4_no_rht, ...); an NVFP4 recipe has no
save_mx_input or fuse_x_casts variant.
"""

from __future__ import annotations

import dataclasses
import json

import torch
from saved_memory import saved_bytes
from timing import add_run_args, interleaved, require_cuda, run_meta

from mx_recipe import MXLinear, MXRecipe
from mx_recipe.cli import ArgumentParser, recipe_name
from mx_recipe.formats.recipe import NVFP4_RECIPES, NVFP4Recipe

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192)]
MIB, GIB = 2**20, 2**30


def step_peak_gib(step) -> float:
    """The peak memory of one step above what was allocated before it (GiB)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / GIB


def fwd_held_gib(layer: torch.nn.Module, x: torch.Tensor) -> float:
    """Memory a forward leaves allocated until its backward (output + saved tensors), GiB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    y = layer(x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    del y
    return held / GIB


def main() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--recipe", default="mxfp8", type=recipe_name())
    parser.add_argument("--m", type=int, default=16384)
    args = add_run_args(parser).parse_args()
    require_cuda("bench_linear.py")
    if args.recipe in NVFP4_RECIPES:
        recipe, save_recipe, fuse_recipe = NVFP4Recipe.from_name(args.recipe), None, None
    else:
        recipe = MXRecipe.from_name(args.recipe)
        # save_mx_input needs an MX grad-weight GEMM (recipe.py); without one that column stays empty
        save_recipe = None if recipe.grad_weight == "bf16" else dataclasses.replace(recipe, save_mx_input=True)
        # fuse_x_casts needs one MX format for x in both of its GEMMs (recipe.py)
        fuse = recipe.grad_weight != "bf16" and recipe.grad_weight == recipe.forward
        fuse_recipe = dataclasses.replace(recipe, fuse_x_casts=True) if fuse else None
    target = 1.15 if isinstance(recipe, NVFP4Recipe) or recipe.forward == "e2m1" else 1.10
    print(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, recipe {recipe.name}, "
        f"{'eager' if args.eager else 'torch.compile'}, M = {args.m}"
    )
    rows = []
    for k, n in SHAPES:
        torch.manual_seed(0)
        bf16 = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        layers = {"bf16": bf16, "mx": MXLinear.from_linear(bf16, recipe)}
        if save_recipe is not None:
            layers["mx_save"] = MXLinear.from_linear(bf16, save_recipe)
        if fuse_recipe is not None:
            layers["mx_fuse"] = MXLinear.from_linear(bf16, fuse_recipe)
        x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(args.m, n, device="cuda", dtype=torch.bfloat16)
        wrap = (lambda m: m) if args.eager else torch.compile
        row = {"M": args.m, "K": k, "N": n}
        runs = {name: wrap(layer) for name, layer in layers.items()}
        steps = {name: (lambda run=run, x=x, g=grad: run(x).backward(g)) for name, run in runs.items()}
        params = {id(p): p for layer in layers.values() for p in layer.parameters()}
        timings = interleaved(steps, args.rounds, grad_to_none=[x, *params.values()])
        for name, layer in layers.items():
            x.grad = None
            row[f"{name}_saved_mib"] = saved_bytes(layer, x) / MIB
            row[f"{name}_ms"] = timings[name].wall_us / 1e3
            row[f"{name}_kernel_ms"] = timings[name].kernel_us / 1e3
            row[f"{name}_peak_gib"] = step_peak_gib(steps[name])
            row[f"{name}_held_gib"] = fwd_held_gib(runs[name], x)
        row["ratio"] = row["mx_ms"] / row["bf16_ms"]
        row["kernel_ratio"] = row["mx_kernel_ms"] / row["bf16_kernel_ms"]
        row["round_spread"] = max(t.spread for t in timings.values())
        row["bf16_tflops"] = 3 * 2 * args.m * k * n / row["bf16_ms"] / 1e9
        for v in ("mx_save", "mx_fuse"):
            if f"{v}_ms" in row:
                row[f"{v}_ratio"] = row[f"{v}_ms"] / row["bf16_ms"]
        rows.append(row)
        del bf16, layers, x, grad
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    print(
        f"{'M':>6} {'K':>6} {'N':>6} {'bf16 ms':>9} {'MX ms':>9} {'MX/bf16':>8} {'bf16 TFLOP/s':>13} "
        f"{'bf16 GiB':>9} {'MX GiB':>8}"
    )
    for r in rows:
        verdict = "meets" if r["ratio"] <= target else "misses"
        print(
            f"{r['M']:>6} {r['K']:>6} {r['N']:>6} {r['bf16_ms']:>9.3f} {r['mx_ms']:>9.3f} {r['ratio']:>7.2f}x "
            f"{r['bf16_tflops']:>13.0f} {r['bf16_peak_gib']:>9.2f} {r['mx_peak_gib']:>8.2f}  "
            f"({verdict} <= {target:.2f}x; "
            f"GPU kernel time {r['kernel_ratio']:.2f}x, rounds spread {r['round_spread']:.1%})"
        )
    if "mx_fuse_ms" in rows[0]:
        print("\nwith fuse_x_casts (mx_fuse):")
        for r in rows:
            verdict = "meets" if r["mx_fuse_ratio"] <= target else "misses"
            print(
                f"{r['M']:>6} {r['K']:>6} {r['N']:>6} {r['bf16_ms']:>9.3f} {r['mx_fuse_ms']:>9.3f} "
                f"{r['mx_fuse_ratio']:>7.2f}x {r['mx_fuse_peak_gib']:>8.2f} GiB  ({verdict} <= {target:.2f}x)"
            )
    variants = [v for v in ("bf16", "mx", "mx_save", "mx_fuse") if f"{v}_ms" in rows[0]]
    print("\nactivation memory per layer: saved for backward (MiB, eager hooks), held from forward to backward")
    print("(GiB, output included) and step peak (GiB); mx_save = MX with save_mx_input (x saved in MX form),")
    print("mx_fuse = MX with fuse_x_casts (x along M saved, bf16)")
    header = " ".join(f"{f'{v} {what}':>16}" for v in variants for what in ("saved", "held", "peak"))
    print(f"{'M':>6} {'K':>6} {'N':>6} {header}")
    for r in rows:
        cells = " ".join(
            f"{r[f'{v}_saved_mib']:>16.1f} {r[f'{v}_held_gib']:>16.3f} {r[f'{v}_peak_gib']:>16.3f}" for v in variants
        )
        print(f"{r['M']:>6} {r['K']:>6} {r['N']:>6} {cells}")
    if "mx_save_ms" in rows[0]:
        print("mx_save time / bf16: " + ", ".join(f"{r['mx_save_ratio']:.2f}x" for r in rows))
    if args.out:
        meta = run_meta(
            recipe=recipe.name,
            compiled=not args.eager,
            save_mx_input_column=save_recipe is not None,
            fuse_x_casts_column=fuse_recipe is not None,
        )
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
