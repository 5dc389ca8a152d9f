"""Wall time against GPU kernel time of one transformer block, forward + backward: bf16 and an MX recipe.

    python scripts/profile_block.py [--model moe] [--flavor moe_1B] [--layer 1] [--tokens 8192] [--recipe mxfp8]

Builds the model as train.py does (meta device, then materialized on the GPU, bf16), converts it for the
recipe, compiles the chosen block (as [compile] enable = true does) and times its forward + backward on
random input: the wall time per step and the summed GPU kernel time from torch.profiler, then the
kernels that take the most GPU time. Wall time well above kernel time means the step is bound by
launches and host work, not by the GPU.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mx_recipe import MXRecipe, convert_to_mx
from mx_recipe.models import build_model, model_args


def profile_recipe(args: argparse.Namespace, recipe: str) -> None:
    margs = model_args(args.model, args.flavor, 258, args.seq_len)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model(margs)
    model.to_empty(device="cuda")
    model.init_weights()
    if recipe != "none":
        convert_to_mx(model, MXRecipe.from_name(recipe))
    model.to(torch.bfloat16)
    block = model.layers[str(args.layer)] if isinstance(model.layers, torch.nn.ModuleDict) else model.layers[args.layer]
    block.compile()
    cos, sin = model.rope_cos.float(), model.rope_sin.float()
    x = torch.randn(args.tokens // args.seq_len, args.seq_len, margs.dim, device="cuda", dtype=torch.bfloat16)
    x.requires_grad_()

    def step() -> None:
        block(x, cos, sin).float().square().mean().backward()

    for _ in range(5):  # compile and warm up
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / args.steps * 1e3
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    # Kernel records only: an op's CUDA time is also its kernels', and would count twice.
    gpu_ms = sum(e.device_time_total for e in events if e.device_type.name == "CUDA") / 5 / 1e3
    name = "bf16" if recipe == "none" else recipe
    print(f"=== {name}: wall {wall_ms:.3f} ms per forward + backward, GPU kernels {gpu_ms:.3f} ms")
    print(events.table(sort_by="self_device_time_total", row_limit=args.top, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="moe")
    parser.add_argument("--flavor", default="moe_1B")
    parser.add_argument("--layer", type=int, default=1, help="which block (layer 0 of moe_1B is dense)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per step (a multiple of --seq-len)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--recipe", default="mxfp8")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=12, help="kernels listed")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_block.py needs a CUDA GPU")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.model} {args.flavor}")
    for recipe in ("none", args.recipe):
        profile_recipe(args, recipe)


if __name__ == "__main__":
    main()
