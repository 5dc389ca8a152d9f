"""Training steps of one config in bf16 and in each MX recipe, timed in interleaved rounds, on one device or,
under torchrun, on several through FSDP2.

    python benchmarks/bench_train.py --config llama1b_bf16 --recipes mxfp8 [--layers N] [--steps 10]
        [--warmup 3] [--rounds 3] [--out FILE] [--section.key value ...]
    torchrun --nproc_per_node=2 benchmarks/bench_train.py --config moe_bf16 --recipes mxfp8 --all-gather both
        [--skip-bf16] ...

Every variant is the config as train.py builds and steps it (conversion, activation checkpointing, compile
per block, unsharded mixed precision, CUDA graph, clipping and fused AdamW as the config says), with
``mx.recipe`` set to "none" (bf16) or to one of ``--recipes``; ``--layers`` keeps the first N blocks (to fit a
large flavor on one GPU). All variants are resident at once and train on the same pre-drawn batches: after
``--warmup`` steps each (compilation, the CUDA graph's capture), every round runs ``--steps`` steps of each
variant in turn, so that a drift of the clock lands on all of them.
``--all-gather both`` times each MX recipe twice, with FSDP2's bf16 all-gather and with the MX all-gather
(``parallel.mx_all_gather``), and prints the bytes each all-gather moves; ``--skip-bf16`` leaves out the bf16
variant (the ratios are then to the first variant). Under torchrun, tokens/s are the sum over the ranks and the
memory is rank 0's.
Printed per variant: median tokens/s over the rounds, MFU, the peak memory of its steps (the other
variants' weights and optimizer state included) and the ratio to bf16, with the device name; ``--out``
writes JSON with provenance for docs/results/.

``--profile`` then profiles two more steps of each variant (torch.profiler) and prints where a step's
time goes: GPU kernel time by kind (GEMM, attention, MX cast, fused elementwise, optimizer, copies)
and the rest of the wall time, when the GPU waits on the host.
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import sys
import time

import torch
from timing import run_meta
from torch.profiler import ProfilerActivity, profile

from mx_recipe.cli import ArgumentParser, output_file, recipe_name
from mx_recipe.models import flops_per_token, model_args
from mx_recipe.train.config import ConfigError, load_config, parse_overrides
from mx_recipe.train.data import build_datasets
from mx_recipe.train.metrics import device_peak_flops
from mx_recipe.train.parallel import build_mesh, destroy_distributed, init_distributed
from mx_recipe.train.step import TrainStep
from mx_recipe.train.trainer import (
    TrainingError,
    build_optimizer,
    build_training_model,
    padded_vocab_size,
    step_setup,
    update_expert_biases,
    uses_cast_weights_once,
    uses_cuda_graph,
)


@dataclasses.dataclass
class Variant:
    """One recipe's model and optimizer, and what its rounds measured."""

    recipe: str
    name: str  # the recipe, and which all-gather where --all-gather both
    model: torch.nn.Module
    step: TrainStep
    flops_per_token: float
    tokens_per_sec: list[float] = dataclasses.field(default_factory=list)
    peak_gib: float | None = None  # CUDA only
    losses: list[float] = dataclasses.field(default_factory=list)
    profile: dict[str, float] | None = None  # ms per step by kernel kind, and "GPU idle"
    top_kernels: list[tuple[str, float, float]] = dataclasses.field(default_factory=list)  # (name, calls, ms)


def with_layers(dims, layers: int | None):
    """The model dims with only the first ``layers`` blocks (None: as the flavor has them); ValueError for more
    blocks than the flavor has."""
    if layers is None:
        return dims
    if not 0 < layers <= dims.n_layers:
        raise ValueError(f"--layers {layers}: the flavor has {dims.n_layers} blocks")
    return dataclasses.replace(dims, n_layers=layers)


def build_variant(config, recipe: str, all_gather: str | None, dims, info, mesh, log) -> Variant:
    """``recipe``'s variant of ``config``; ``all_gather``: its parallel.mx_all_gather (None: the config's)."""
    config = dataclasses.replace(config, mx=dataclasses.replace(config.mx, recipe=recipe))
    if all_gather is not None:
        config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, mx_all_gather=all_gather))
    name = "bf16" if recipe == "none" else recipe
    reports = []
    model = build_training_model(config, dims, info, mesh, log=reports.append)
    if all_gather is not None:
        name += " MX all-gather" if all_gather == "on" else " bf16 all-gather"
    for line in reports[-1:] if reports and reports[-1].startswith("all-gather bytes") else []:
        log(f"{name}: {line}")
    t = config.training
    step = TrainStep(
        model, build_optimizer(model, t), info.device, t.max_norm, uses_cuda_graph(config, model, info),
        cast_weights_once=uses_cast_weights_once(config, info),
    )  # fmt: skip
    return Variant(recipe, name, model, step, flops_per_token(dims, model, t.seq_len))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_steps(v: Variant, batches: list, device: torch.device) -> float:
    """Train on ``batches`` (one list of microbatches per step); returns the seconds it took, the device
    synchronized at both ends. The last step's loss is kept (a non-finite one stops the benchmark)."""
    if not batches:  # --warmup 0
        return 0.0
    synchronize(device)
    start = time.perf_counter()
    for microbatches in batches:
        loss, _ = v.step(microbatches)
        finite = torch.isfinite(loss).item()  # train.py reads the loss on the host every step too
        v.step.update()
        update_expert_biases(v.model)
        v.step.zero_grad()
        if not finite:
            raise SystemExit(f"{v.name}: the loss is {loss.item()}")
    synchronize(device)
    elapsed = time.perf_counter() - start
    v.losses.append(loss.item())
    return elapsed


# Kernel kinds by name, first match wins: our MX kernels, Inductor's (triton_poi/red/per_fused_...), then
# flash attention, cuBLAS/CUTLASS GEMMs, the fused optimizer, copies and collectives; then the rest.
KERNEL_KINDS = [
    ("MX cast", re.compile(r"_cast_kernel|_cast_groups_dim1|fake_quant|_unblock_kernel|_amax_kernel")),
    ("fused elementwise", re.compile(r"^triton_")),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),  # before GEMM: their names hold "cutlass"
    ("GEMM", re.compile(r"gemm|nvjet|cutlass|xmma|wgmma|sm90_|sm100_|s16816|cublas", re.I)),
    ("optimizer", re.compile(r"multi_tensor|foreach|adam", re.I)),
    ("copy/collective", re.compile(r"nccl|memcpy|memset|copy|cat_|chunk_cat|split_with_sizes", re.I)),
]


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


def profile_steps(v: Variant, batches: list, device: torch.device, top: int = 0) -> dict[str, float]:
    """ms per step of each kernel kind over ``batches`` (profiled), and "GPU idle": the wall time no
    kernel covers (the GPU waiting on the host; a lower bound when kernels overlap). ``top``: also keep
    the ``top`` costliest kernels, (name, calls per step, ms per step), in ``v.top_kernels``."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # no CPU events: they slow the host
        wall = run_steps(v, batches, device)
    by_kind = dict.fromkeys([kind for kind, _ in KERNEL_KINDS] + ["other"], 0.0)
    kernels = []
    for event in prof.key_averages():
        if event.device_type.name == "CUDA":
            ms = event.device_time_total / 1e3 / len(batches)
            by_kind[kernel_kind(event.key)] += ms
            kernels.append((event.key, event.count / len(batches), ms))
    by_kind["GPU idle"] = max(0.0, 1e3 * wall / len(batches) - sum(by_kind.values()))
    v.top_kernels = sorted(kernels, key=lambda k: -k[2])[:top]
    return by_kind


def print_profiles(variants: list[Variant]) -> None:
    kinds = list(variants[0].profile)
    print("\nms per step by kernel kind (torch.profiler):")
    print(f"{'':>18}" + "".join(f"{v.name:>12}" for v in variants))
    for kind in kinds:
        print(f"{kind:>18}" + "".join(f"{v.profile[kind]:>12.1f}" for v in variants))
    print(f"{'step':>18}" + "".join(f"{sum(v.profile.values()):>12.1f}" for v in variants))
    for v in variants:
        if v.top_kernels:
            print(f"\n{v.name}: costliest kernels, ms per step (calls per step)")
            for name, calls, ms in v.top_kernels:
                print(f"{ms:>8.2f} ({calls:>5.0f})  {kernel_kind(name):<17} {name[:110]}")


def main() -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="configs/NAME[.toml] or a path; its mx.recipe is ignored")
    parser.add_argument("--recipes", nargs="+", type=recipe_name(), default=["mxfp8"], help="recipes to time")
    parser.add_argument("--layers", type=int, help="keep the first N transformer blocks")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (compilation)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=output_file, help="write the rows as JSON here, with provenance")
    parser.add_argument("--profile", action="store_true", help="then profile 2 steps of each variant")
    parser.add_argument(
        "--profile-top", type=int, default=0, metavar="N", help="with --profile: list the N costliest kernels"
    )
    parser.add_argument(
        "--all-gather", choices=["config", "both"], default="config",
        help="both: each MX recipe with the bf16 and with the MX all-gather (FSDP2, under torchrun)",
    )  # fmt: skip
    parser.add_argument("--skip-bf16", action="store_true", help="time the MX recipes only")
    args, rest = parser.parse_known_args()
    if min(args.steps, args.rounds) < 1 or args.warmup < 0:
        parser.error("--steps and --rounds must be >= 1 and --warmup >= 0")
    try:
        overrides = parse_overrides(rest)
        config = load_config(args.config, overrides)
        for recipe in args.recipes:  # the config's [mx] keys with each recipe, checked as train.py checks them
            load_config(args.config, [*overrides, ("mx.recipe", recipe)])
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2

    info = init_distributed()
    log = print if info.is_main else (lambda *a, **k: None)
    if args.profile and info.device.type != "cuda":
        raise SystemExit("--profile breaks GPU kernel time down: it needs a CUDA device")
    finished = False
    try:
        t = config.training
        data = build_datasets(config, info.rank, info.world_size)
        vocab = padded_vocab_size(data.tokenizer.vocab_size)
        try:
            dims = with_layers(model_args(config.model.name, config.model.flavor, vocab, t.seq_len), args.layers)
        except ValueError as e:
            parser.error(str(e))
        mesh = build_mesh(info, config.parallel.dp_replicate)
        plan = [] if args.skip_bf16 else [("none", None)]
        for r in args.recipes:
            plan += [(r, "off"), (r, "on")] if args.all_gather == "both" else [(r, None)]
        try:
            variants = [build_variant(config, r, ag, dims, info, mesh, log) for r, ag in plan]
        except TrainingError as e:  # a backend this device cannot run, a skip pattern that matches nothing
            print(f"error: {e}", file=sys.stderr)
            return e.exit_code
        steps = max(args.steps, args.warmup, 2)
        batches = [[data.train.next_batch() for _ in range(t.gradient_accumulation_steps)] for _ in range(steps)]
        tokens = args.steps * t.gradient_accumulation_steps * t.local_batch_size * t.seq_len * info.world_size
        device_name = torch.cuda.get_device_name(info.device) if info.device.type == "cuda" else "cpu"
        devices = device_name if info.world_size == 1 else f"{info.world_size} x {device_name}"
        log(
            f"device: {devices}, torch {torch.__version__}, {config.model.name} "
            f"{config.model.flavor} ({dims.n_layers} blocks), {t.local_batch_size} x {t.seq_len} tokens x "
            f"{t.gradient_accumulation_steps} microbatches a step per rank, "
            f"{step_setup(config, info, mesh, variants[0].step.cuda_graph, variants[0].model)}"
        )
        for v in variants[1:]:
            log(f"{v.name}: {step_setup(config, info, mesh, v.step.cuda_graph, v.model)}")
        for v in variants:
            run_steps(v, batches[: args.warmup], info.device)
        for _ in range(args.rounds):
            for v in variants:
                if info.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(info.device)
                v.tokens_per_sec.append(tokens / run_steps(v, batches[: args.steps], info.device))
                if info.device.type == "cuda":
                    v.peak_gib = max(v.peak_gib or 0.0, torch.cuda.max_memory_allocated(info.device) / 2**30)
        peak = device_peak_flops(info.device)
        rows = report(variants, None if peak is None else peak * info.world_size, log)
        if args.profile:
            for v, row in zip(variants, rows, strict=True):
                v.profile = row["profile_ms_per_step"] = profile_steps(v, batches[:2], info.device, args.profile_top)
            if info.is_main:
                print_profiles(variants)
        finished = True
    finally:
        # a normal end waits for every rank (a rank exiting while a peer tears gloo down aborts the peer)
        destroy_distributed(barrier=finished)
    if args.out and info.is_main:
        meta = run_meta(
            config=args.config, layers=dims.n_layers, steps=args.steps, rounds=args.rounds, world_size=info.world_size
        )
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


def report(variants: list[Variant], peak_flops: float | None, log=print) -> list[dict]:
    """Print one line per variant and return them as rows (the ratios are to the first variant, bf16 unless
    --skip-bf16). ``peak_flops``: of all ranks together."""
    base = statistics.median(variants[0].tokens_per_sec)
    rows = []
    for v in variants:
        tps = statistics.median(v.tokens_per_sec)
        spread = (max(v.tokens_per_sec) - min(v.tokens_per_sec)) / tps
        mfu = None if peak_flops is None else 100 * tps * v.flops_per_token / peak_flops
        name = v.name
        row = dict(recipe=name, tokens_per_sec=tps, ratio=tps / base, mfu=mfu, peak_gib=v.peak_gib)
        rows.append(row | dict(rounds_spread=spread, last_loss=v.losses[-1]))
        mfu_text = "n/a" if mfu is None else f"{mfu:.1f}%"
        peak = "n/a" if v.peak_gib is None else f"{v.peak_gib:.2f} GiB"
        log(
            f"{name:>22}: {tps:>10,.0f} tokens/s  {tps / base:.3f}x {variants[0].name}  MFU {mfu_text:>6}  "
            f"peak {peak:>10}  rounds spread {spread:.1%}  last loss {v.losses[-1]:.4f}"
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
