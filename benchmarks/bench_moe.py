"""The grouped-GEMM table: bf16 vs MX forward and forward+backward of one expert GEMM.

A (16640, 5120) routed evenly to E experts, B (E, 8192, 5120), E in 1, 4, 16, 64. Prints the
device, then one row per E; e2e means forward + backward, and ``*_speedup`` is bf16 time / MX
time. Both sides are compiled with torch.compile unless --eager. The Hopper target: MX fwd+bwd
<= 1.15x the bf16 time. --recipe takes the MX recipes and the NVFP4 ones (nvfp4, nvfp4_no_rht, ...).

Times are wall medians with bf16 and MX interleaved in --rounds rounds (timing.py), so a drift
of the GPU between measurements lands on both; the rows also carry each side's summed GPU kernel time
per fwd+bwd and the spread of the round medians.

    python benchmarks/bench_moe.py [--experts 1 4 16 64] [--recipe mxfp8] [--fuse-expert-casts] [--eager]
                                   [--rounds 5] [--out results.json]

--fuse-expert-casts sets MXRecipe.fuse_expert_casts (the expert weights read once in forward for
both of their fake-quants; a bf16 copy of them held until backward); the recipe column says so.
"""

from __future__ import annotations

import json

import torch
from timing import add_run_args, interleaved, require_cuda, run_meta

from mx_recipe import MXRecipe
from mx_recipe.cli import ArgumentParser, recipe_name
from mx_recipe.formats.recipe import NVFP4_RECIPES, NVFP4Recipe
from mx_recipe.nn.grouped import mx_grouped_mm


def bf16_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)


def even_offsets(m: int, experts: int, device: torch.device) -> torch.Tensor:
    sizes = [m // experts + (1 if e < m % experts else 0) for e in range(experts)]
    return torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)


def steps(fns: dict, a, b, offs, grad_out: torch.Tensor | None) -> dict:
    """One call per name: forward + backward with ``grad_out``, or the forward alone under no_grad."""

    def make(fn):
        def step():
            if grad_out is None:
                with torch.no_grad():
                    fn(a, b, offs)
            else:
                fn(a, b, offs).backward(grad_out)

        return step

    return {name: make(fn) for name, fn in fns.items()}


def main() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--experts", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--m", type=int, default=16640)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--k", type=int, default=5120)
    parser.add_argument("--recipe", default="mxfp8", type=recipe_name())
    parser.add_argument("--fuse-expert-casts", action="store_true", help="MXRecipe.fuse_expert_casts=True")
    args = add_run_args(parser).parse_args()
    require_cuda("bench_moe.py")
    device = torch.device("cuda")
    if args.recipe in NVFP4_RECIPES:
        if args.fuse_expert_casts:
            parser.error("--fuse-expert-casts is an MX recipe option (NVFP4's 16x16 weight tiles are one cast)")
        recipe = NVFP4Recipe.from_name(args.recipe)
    else:
        recipe = MXRecipe.from_name(args.recipe, fuse_expert_casts=args.fuse_expert_casts)
    label = f"{recipe.name}+fuse_expert_casts" if args.fuse_expert_casts else recipe.name
    mx_fn = lambda a, b, offs: mx_grouped_mm(a, b, offs, recipe)
    bf16_fn = bf16_grouped_mm
    if not args.eager:
        mx_fn, bf16_fn = torch.compile(mx_fn), torch.compile(bf16_fn)
    print(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, recipe {label}, "
        f"{'eager' if args.eager else 'torch.compile'}"
    )
    header = (
        "A_shape",
        "B_shape",
        "recipe",
        "bf16_e2e_us",
        "scaled_e2e_us",
        "scaled_e2e_speedup",
        "bf16_fwd_us",
        "scaled_fwd_us",
        "scaled_fwd_speedup",
    )
    rows = []
    for experts in args.experts:
        torch.manual_seed(0)
        a = torch.randn(args.m, args.k, device=device, dtype=torch.bfloat16, requires_grad=True)
        b = (torch.randn(experts, args.n, args.k, device=device, dtype=torch.bfloat16) * 0.02).requires_grad_()
        offs = even_offsets(args.m, experts, device)
        grad_out = torch.randn(args.m, args.n, device=device, dtype=torch.bfloat16)
        fns = {"bf16": bf16_fn, "mx": mx_fn}
        e2e = interleaved(steps(fns, a, b, offs, grad_out), args.rounds, grad_to_none=[a, b])
        fwd = interleaved(steps(fns, a, b, offs, None), args.rounds)
        bf16_e2e, mx_e2e = e2e["bf16"].wall_us, e2e["mx"].wall_us
        bf16_fwd, mx_fwd = fwd["bf16"].wall_us, fwd["mx"].wall_us
        rows.append(
            {
                "A_shape": str((args.m, args.k)),
                "B_shape": str((experts, args.n, args.k)),
                "recipe": label,
                "bf16_e2e_us": bf16_e2e,
                "scaled_e2e_us": mx_e2e,
                "scaled_e2e_speedup": bf16_e2e / mx_e2e,
                "bf16_fwd_us": bf16_fwd,
                "scaled_fwd_us": mx_fwd,
                "scaled_fwd_speedup": bf16_fwd / mx_fwd,
                "bf16_e2e_kernel_us": e2e["bf16"].kernel_us,
                "scaled_e2e_kernel_us": e2e["mx"].kernel_us,
                "e2e_round_spread": max(e2e["bf16"].spread, e2e["mx"].spread),
            }
        )
        del a, b, grad_out
        torch.cuda.empty_cache()

    def fmt(key: str, value) -> str:
        if key.endswith("_speedup"):
            return f"{value:.3f}x"
        return f"{value:.1f}" if isinstance(value, float) else value

    print("  ".join(f"{h:>18}" for h in header))
    for row in rows:
        print("  ".join(f"{fmt(h, row[h]):>18}" for h in header))
    for row in rows:
        ratio = row["scaled_e2e_us"] / row["bf16_e2e_us"]
        kernel_ratio = row["scaled_e2e_kernel_us"] / row["bf16_e2e_kernel_us"]
        verdict = "meets" if ratio <= 1.15 else "misses"
        print(
            f"B {row['B_shape']}: MX fwd+bwd takes {ratio:.2f}x the bf16 time ({verdict} the Hopper target <= 1.15x); "
            f"GPU kernel time {kernel_ratio:.2f}x; rounds spread {row['e2e_round_spread']:.1%}"
        )
    if args.out:
        with open(args.out, "w") as f:
            meta = run_meta(recipe=label, compiled=not args.eager)
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
