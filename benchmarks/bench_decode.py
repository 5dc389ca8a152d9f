"""Decode and prefill speed with the weights in bf16, MXFP8, MXFP4 and NVFP4, all in one run: Llama 3 8B dims
(or --model moe: DeepSeek-MoE 16B dims) built at random (mx_recipe.infer.load), quantized by
mx_recipe.infer.weights, whose GEMMs run the weight-only kernel on the GPU.

    python benchmarks/bench_decode.py [--batch 1,8,32,128] [--weights bf16,mxfp8,mxfp4,nvfp4] [--out FILE]
    python benchmarks/bench_decode.py --model moe --layers 12 --batch 1
    python benchmarks/bench_decode.py --gemms-only                 # the linear layers' GEMMs of one step
    python benchmarks/bench_decode.py --sweep [--batch 1,2,4]      # every small-M kernel config, per shape
    python benchmarks/bench_decode.py --flavor debug --device cpu  # a smoke run

Decode: one step of every sequence of --batch at the last of --context KV positions (the whole cache is read),
replayed from a CUDA graph (mx_recipe.infer.decode.DecodeGraph) --steps times per timing, the formats
interleaved in --rounds rounds; tokens/s = batch / median step time. --gemms-only replays only the GEMMs of the
linear layers and experts of one step (inputs at random; the MoE's tokens go to the first experts, as many as
a decode step of that batch reaches on average). Prefill: one --prefill-token prompt into the cache
(mx_recipe.infer.decode.prefill), eager (its kernels are long), median of --rounds, the formats interleaved.
Token ids are drawn at random (seed 0), so that an MoE routes them over its experts as text would: tokens all
alike would all pick the same experts.

Each row gives tokens/s, the ratio to bf16, and the HBM bound: the bytes a step must read (the weights it
uses, the MoE's routed experts in the expected share a batch reaches, E * (1 - (1 - k / E) ** batch) of E, and
the whole KV cache) over the device's copy bandwidth, measured here (a device-to-device copy, read + write
bytes). The targets on one H200: bf16 batch-1 decode >= 80% of the bound; MXFP8 >= 1.7x bf16 at batch 1,
MXFP4 and NVFP4 >= 2.8x, 4-bit >= 1.5x at batch 32; MoE 16B dims, MXFP4 experts >= 2x bf16 at batch 1.

The kernel's configs are timed once per GEMM shape, before the graphs are captured, and the fastest kept
(mx_recipe.infer.weight_only.set_tuning; --no-tune: its defaults by M). On sm_90 and newer a decode step launches
its Triton kernels with programmatic dependent launch where mx_recipe.infer.decode.pdl_pays says; --pdl off: plain
launches; --pdl both: each step captured both ways and timed interleaved, a second set of rows ("decode no-pdl").
--sweep times each small-M config of the weight-only kernel (mx_kernels.mx.weight_only.FMA_CANDIDATES), its
weight read from memory as in a model (cold_copies), on each weight shape of its table (Llama 3 8B's projections,
alone and fused), for each format of --weights and each --batch M (default 1), beside cuBLAS on the bf16 weight,
the tl.dot path's default and, at one row, the GEMV that a decode step runs there for bf16 and MXFP8 weights
(mx_recipe.infer.gemv): a row per config with microseconds and the bytes read (codes, scales, x) over the copy
bandwidth, then the fastest config per format and shape (the GEMV's rows aside) as ``FMA_CHOSEN`` entries to paste
into the kernel's table.
--reference: the quantized GEMMs dequantize to bf16 first (what they did before the kernel), for comparison.
--layout: where the weights are repacked in the tiled layout of Hopper's decode GEMM (mx_recipe.infer.weights.
tile_weights): auto as a decode step of each batch would, formats nowhere (the formats' own layout throughout),
tiled every weight the tile takes (MXFP8's at one row too); runs of each give the layout's gain in their ratios.
--profile-top N: after each batch's timing, replayed steps of each format under torch.profiler: what each kernel
adds to the step's end (how far its end passes every earlier kernel's; with PDL a kernel's own duration includes
its wait for the one before), ms a step for the N that add the most, then us a layer for each kernel of a layer.
DESIGN's decode limits read them at batch 1.
On the CPU (fp32, no graphs, the reference GEMMs) the numbers only show that the script runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable

import torch
from timing import copy_gbs, end_increments, kernel_spans, repeated_run, run_meta

from mx_recipe.cli import ArgumentParser, int_list, names, output_file
from mx_recipe.infer.decode import DecodeGraph, KVCache, forward, prefill
from mx_recipe.infer.gemv import MAX_M as GEMV_MAX_M
from mx_recipe.infer.gemv import apply_linear, gemv
from mx_recipe.infer.load import init_random
from mx_recipe.infer.weight_only import set_tuning
from mx_recipe.infer.weights import (
    WEIGHT_FORMATS,
    FusedLinear,
    QuantizedExperts,
    QuantizedLinear,
    fuse_projections,
    quantize_model,
    tile_weights,
    weight_bytes,
)
from mx_recipe.models import MODEL_FLAVORS, build_model, model_args
from mx_recipe.models.llama import Transformer
from mx_recipe.models.moe import GroupedExperts
from mx_recipe.ops import kernel_settings
from mx_recipe.ops.device import shortfall

DEFAULT_FLAVOR = {"llama": "8B", "moe": "moe_16B"}
VOCAB = {"llama": 128256, "moe": 102400}  # Llama 3's tokenizer, DeepSeek-MoE's
SMALL_VOCAB = 512  # the debug flavors
DEFAULT_BATCH = {"llama": (1, 8, 32, 128), "moe": (1,)}
# (model, weights, batch, minimum ratio to bf16 tokens/s)
TARGETS = [
    ("llama", "mxfp8", 1, 1.7),
    ("llama", "mxfp4", 1, 2.8),
    ("llama", "nvfp4", 1, 2.8),
    ("llama", "mxfp4", 32, 1.5),
    ("llama", "nvfp4", 32, 1.5),
    ("moe", "mxfp4", 1, 2.0),
]
BF16_BOUND_TARGET = 0.8


def compute_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def meta_model(name: str, flavor: str, layers: int | None, max_len: int) -> Transformer:
    """The model's shapes without memory (the meta device): --layers keeps its first blocks."""
    dims = model_args(name, flavor, SMALL_VOCAB if flavor.startswith("debug") else VOCAB[name], max_len)
    if layers is not None:
        if not 0 < layers <= dims.n_layers:
            raise ValueError(f"--layers {layers}: the flavor has {dims.n_layers} blocks")
        dims = dataclasses.replace(dims, n_layers=layers)
    with torch.device("meta"):
        return build_model(dims)


def check_memory(model: Transformer, device: torch.device, what: str) -> None:
    """Raise ValueError, naming the sizes, where the bf16 model ``what`` and the one being quantized cannot both fit
    in the device's memory (Llama 3 8B dims in fp32 on a CPU would swap for minutes before failing)."""
    dtype = compute_dtype(device)
    need = 2 * sum(p.numel() for p in model.parameters()) * dtype.itemsize
    name = str(dtype).removeprefix("torch.")
    problem = shortfall(need, device, f"{what} in {name} (the bf16 model and one being quantized)")
    if problem is not None:
        raise ValueError(problem + ("; --flavor debug runs a smoke test" if device.type == "cpu" else ""))


def build(name: str, flavor: str, layers: int | None, fmt: str, max_len: int, device: torch.device,
          reference: bool, fuse: bool = True, layout: str = "auto", output: bool = False) -> Transformer:  # fmt: skip
    """The model at random (seed 0), in the compute dtype (bf16 on CUDA, fp32 on the CPU), weights in ``fmt``;
    ``fuse``: the projections that read one input as one GEMM (mx_recipe.infer.weights.fuse_projections); dense
    weights tiled for Hopper's decode kernel as ``layout`` says for one sequence (``tile``)."""
    model = meta_model(name, flavor, layers, max_len)
    model = init_random(model, device, 0, compute_dtype(device)).eval()
    model = quantize_model(model, fmt, kernel=not reference, output=output)
    return tile(fuse_projections(model) if fuse else model, 1, layout)


def tile(model: Transformer, batch: int, layout: str) -> Transformer:
    """``model``'s weights repacked for Hopper's decode kernel, in place (``tile_weights``), by ``layout``:
    ``auto`` as a decode step of ``batch`` sequences would (4-bit ones, MXFP8 ones past the GEMV's rows, 4-bit
    experts at one sequence), ``tiled`` every weight the tile takes, ``formats`` none. Tiled weights stay tiled."""
    if layout == "formats":
        return model
    if layout == "tiled":  # MXFP8's dense weights tile past one row, the experts at one
        return tile_weights(tile_weights(model, GEMV_MAX_M + 1), 1)
    return tile_weights(model, batch)


def active_experts(n_experts: int, top_k: int, batch: int) -> float:
    """Experts a decode step of ``batch`` tokens reaches on average, each choosing top_k of n_experts at random."""
    return n_experts * (1 - (1 - top_k / n_experts) ** batch)


def step_bytes(model: Transformer, batch: int, cache: KVCache | None) -> float:
    """Bytes one decode step must read: the weights it uses (the embedding's ``batch`` rows, the routed experts
    in their expected share) and the whole KV cache."""
    total = weight_bytes(model) - model.tok_embeddings.weight.numel() * model.tok_embeddings.weight.element_size()
    total += batch * model.tok_embeddings.weight.shape[1] * model.tok_embeddings.weight.element_size()
    args = model.args
    for module in model.modules():
        if isinstance(module, GroupedExperts | QuantizedExperts):
            n = args.n_routed_experts
            experts = sum(p.numel() * p.element_size() for p in module.parameters())
            experts += sum(b.numel() * b.element_size() for b in module.buffers())
            experts *= n / (n + getattr(module, "shared", 0))  # the routed groups' (shared ones folded in: read)
            total -= experts * (1 - active_experts(n, args.top_k, batch) / n)
    if cache is not None:
        total += 2 * cache.k.numel() * cache.k.element_size()
    return total


def timed(fn: Callable[[], object], device: torch.device, calls: int) -> float:
    """Seconds per call of ``fn`` over ``calls`` back-to-back calls (CUDA events on the GPU)."""
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / calls


def replayable(step: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """``step`` captured in a CUDA graph (after two warm-up runs on a side stream) on CUDA; ``step`` elsewhere."""
    if device.type != "cuda":
        return step
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def token_ids(model: Transformer, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Token ids at random (seed 0, the same for every format) of ``shape`` (module doc)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, model.args.vocab_size, shape, generator=generator).to(device)


def decode_step(model: Transformer, cache: KVCache, batch: int, step_fn: Callable, device: torch.device
                ) -> Callable[[], object]:  # fmt: skip
    tokens = token_ids(model, (batch, 1), device)
    position = torch.tensor([cache.max_len - 1], device=device)
    if device.type != "cuda":
        return lambda: step_fn(model, tokens, position, cache)
    graph = DecodeGraph(model, cache, tokens, position, step_fn)
    # the closure keeps the graph's tokens, position and logits alive: the replay reads and writes them in place, and
    # freed, their memory would go to the next allocation (the replay reading another tensor's bytes as tokens)
    return lambda: graph.graph.replay()


def gemms_step(model: Transformer, batch: int, device: torch.device) -> Callable[[], object]:
    """The GEMMs of one decode step: every linear (the output layer and router gates included) on a [batch, K]
    input, and every expert group on batch * top_k rows sent to the first experts it reaches on average."""
    dtype = model.output.weight.dtype
    calls = []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear | QuantizedLinear | FusedLinear):
            x = torch.randn(batch, module.in_features, device=device, dtype=dtype)
            calls.append(lambda module=module, x=x: apply_linear(module, x))  # a decode step's kernel
        elif isinstance(module, GroupedExperts | QuantizedExperts):
            args = model.args
            rows, reached = batch * args.top_k, round(active_experts(args.n_routed_experts, args.top_k, batch))
            sizes = [rows // reached + (e < rows % reached) for e in range(reached)] + [0] * (
                args.n_routed_experts - reached
            )
            sizes += [batch] * getattr(module, "shared", 0)  # shared experts folded in: every token
            offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
            x = torch.randn(sum(sizes), args.dim, device=device, dtype=dtype)
            calls.append(lambda module=module, x=x, offs=offs: module(x, offs))

    def step() -> None:
        for call in calls:
            call()

    return step


def _gemm_runs(x: torch.Tensor, copies: list[tuple[torch.Tensor, ...]], tensor_scale: torch.Tensor | None, fmt: str,
               config: dict) -> list[Callable[[], object]]:  # fmt: skip
    """One call of the weight-only GEMM with ``config`` per copy of the weight (codes, scales)."""
    from mx_kernels.mx.weight_only import weight_only_mm

    return [lambda c=c: weight_only_mm(x, *c, tensor_scale, fmt, config=config) for c in copies]


def sweep(formats: tuple[str, ...], batches: tuple[int, ...], device: torch.device, bandwidth: float,
          shapes: list[tuple[int, int]] | None = None) -> list[dict]:  # fmt: skip
    """Time every small-M config of the weight-only kernel per format, shape and M (module doc); the rows."""
    from mx_kernels.mx import weight_only as kernel

    from mx_recipe.infer.weights import quantize

    shapes = shapes or [shape for shape in kernel.FMA_CANDIDATES if shape is not None]
    rows, chosen = [], {}
    print(f"{'N x K':>13} {'format':>6} {'M':>3}  {'config':<58} {'us':>8} {'% copy bw':>9}")

    def add(n: int, k: int, m: int, fmt: str, config: str, us: float, nbytes: int) -> None:
        pct = 100 * nbytes / (us * 1e-6) / bandwidth
        rows.append(dict(n=n, k=k, m=m, weights=fmt, config=config, us=us, bytes=nbytes, pct_of_copy=pct))
        print(f"{n:>6} x {k:<5}{fmt:>6} {m:>3}  {config:<58} {us:8.2f} {pct:8.1f}%")

    for n, k in shapes:
        torch.manual_seed(0)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        packed = {fmt: quantize(w, fmt) for fmt in formats if fmt != "bf16"}
        w_copies = kernel.cold_copies((w,))  # each call reads its weight from memory, as in a model (cold_copies)
        for m in batches:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            us = kernel.time_us([lambda x=x, w=w: torch.nn.functional.linear(x, w) for (w,) in w_copies])
            add(n, k, m, "bf16", "cuBLAS", us, 2 * (n * k + m * k))
            if m <= GEMV_MAX_M:  # what the decode step runs there (mx_recipe.infer.gemv)
                add(n, k, m, "bf16", "GEMV", kernel.time_us([lambda x=x, w=w: gemv(x, w) for (w,) in w_copies]),
                    2 * (n * k + m * k))  # fmt: skip
            for fmt, q in packed.items():
                ts = getattr(q, "per_tensor_scale", None)
                copies = kernel.cold_copies((q.qdata, q.scale))
                nbytes = q.qdata.numel() + q.scale.numel() + 2 * m * k
                gemv_runs = m <= GEMV_MAX_M and fmt == "mxfp8"  # the decode step's GEMV, not the configs below
                if gemv_runs:
                    add(n, k, m, fmt, "GEMV", kernel.time_us([lambda x=x, c=c: gemv(x, *c) for c in copies]), nbytes)
                dot = kernel.config_for(m, fmt, fma=False)
                us = kernel.time_us(_gemm_runs(x, copies, ts, fmt, dot))
                add(n, k, m, fmt, "tl.dot " + _config_name(dot), us, nbytes)
                for config in kernel.candidates(m, fmt, n, k, fma=True):
                    try:
                        us = kernel.time_us(_gemm_runs(x, copies, ts, fmt, config))
                    except Exception as e:  # noqa: BLE001  (out of registers or shared memory: skip the config)
                        print(f"{n:>6} x {k:<5}{fmt:>6} {m:>3}  {_config_name(config):<58} skipped: {type(e).__name__}")
                        continue
                    add(n, k, m, fmt, _config_name(config), us, nbytes)
                    if m == batches[0] and not gemv_runs and us < chosen.get((fmt, n, k), (float("inf"),))[0]:
                        chosen[(fmt, n, k)] = (us, config)
    print(f"fastest small-M configs at M = {batches[0]} (FMA_CHOSEN in kernels/mx/weight_only.py):")
    for (fmt, n, k), (us, config) in chosen.items():
        print(f"    ({fmt!r}, {n}, {k}): {config!r},  # {us:.2f} us")
    return rows


def print_step_kernels(label: str, step: Callable[[], object], seconds: float, top: int, calls: int = 3) -> None:
    """What the kernels of a replayed ``step`` add to its end (``timing.end_increments``, mean of ``calls`` replays
    under torch.profiler), ms a step: the ``top`` kernels by name, then, where the step repeats one sequence of
    kernels (its layers), what each kernel of a layer adds, us. ``seconds``: the step's timed wall time."""
    per_call = [kernel_spans(step) for _ in range(calls)]
    increments = [end_increments(spans) for spans in per_call]
    by_name: dict[str, float] = {}
    counts: dict[str, int] = {}
    for spans, call_increments in zip(per_call, increments, strict=True):
        for (name, _, _), added in zip(spans, call_increments, strict=True):
            by_name[name] = by_name.get(name, 0.0) + added / calls
            counts[name] = counts.get(name, 0) + 1
    first_to_last = statistics.mean(spans[-1][2] - spans[0][1] for spans in per_call) / 1e3
    print(f"{label}: kernels first start to last end {first_to_last:.3f} ms of a {seconds * 1e3:.3f} ms step; "
          f"what each adds to the step's end, ms a step:")  # fmt: skip
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {us / 1e3:8.3f}  {name[:90]} ({counts[name] // calls} a step)")
    names = [name for name, _, _ in per_call[0]]
    start, period, repeats = repeated_run(names)
    if repeats < 2 or any([n for n, _, _ in spans] != names for spans in per_call):
        return
    print(f"  a layer: {period} kernels, {repeats} layers; what each adds to the step's end, us a layer:")
    for i in range(period):
        added = [call[start + r * period + i] for call in increments for r in range(repeats)]
        print(f"  {statistics.mean(added):8.2f}  {names[start + i][:90]}")


def _config_name(config: dict) -> str:
    return " ".join(f"{key}={value}" for key, value in config.items())


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__)
    p.add_argument("--model", choices=sorted(MODEL_FLAVORS), default="llama")
    p.add_argument("--flavor", help="default: 8B (llama), moe_16B (moe)")
    p.add_argument("--layers", type=int, help="keep the first N blocks (default: all the flavor has)")
    p.add_argument("--weights", type=names(WEIGHT_FORMATS), default=WEIGHT_FORMATS, help="comma-separated")
    p.add_argument("--batch", type=int_list(), help="decode batches (default: 1,8,32,128; moe: 1)")
    p.add_argument("--context", type=int, default=1024, help="KV positions each sequence holds")
    p.add_argument("--prefill", type=int, default=2048, help="prompt tokens for prefill (0: none)")
    p.add_argument("--gemms-only", action="store_true", help="time only the GEMMs of one decode step")
    p.add_argument("--sweep", action="store_true", help="time every small-M kernel config per weight shape")
    p.add_argument("--reference", action="store_true", help="quantized GEMMs dequantize first (no kernel)")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step before capture")
    p.add_argument("--no-fuse", action="store_true", help="wq/wk/wv and w1/w3 as separate GEMMs")
    p.add_argument("--quantize-output", action="store_true", help="the output layer in each format too (not bf16)")
    p.add_argument("--no-tune", action="store_true", help="the kernel's default configs, not the fastest timed")
    p.add_argument("--layout", choices=("auto", "formats", "tiled"), default="auto",
                   help="weights in the tiled decode layout: as a step would, none, or all it takes")  # fmt: skip
    p.add_argument("--pdl", choices=("on", "off", "both"), default="on",
                   help="programmatic dependent launch of the Triton kernels (sm_90+); both: each way")  # fmt: skip
    p.add_argument("--steps", type=int, default=20, help="decode steps per timing")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    p.add_argument("--profile-top", type=int, default=0, metavar="N", help="what the N costliest kernels add to a step")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument("--out", type=output_file, help="write the rows as JSON here, with provenance")
    args = p.parse_args(argv)
    with kernel_settings(pdl=args.pdl != "off"):
        return _run(p, args)


def _run(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``main`` after parsing."""
    torch.set_grad_enabled(False)
    flavor = args.flavor or DEFAULT_FLAVOR[args.model]
    if flavor not in MODEL_FLAVORS[args.model]:
        p.error(f"--flavor: unknown {args.model} flavor {flavor!r}; known: {', '.join(MODEL_FLAVORS[args.model])}")
    if args.context < 1 or args.prefill < 0 or args.steps < 1 or args.rounds < 1:
        p.error("--context, --steps and --rounds must be >= 1 and --prefill >= 0")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.profile_top and (device.type != "cuda" or args.sweep):
        p.error("--profile-top lists a decode step's GPU kernels: it needs a CUDA device and no --sweep")
    if args.compile and device.type == "cpu":
        p.error("--compile: Inductor's CPU code has no float8_e8m0fnu, the MX scales' type: time the CPU eagerly")
    if args.sweep:
        if device.type != "cuda":
            p.error("--sweep times the weight-only kernel: it needs a CUDA device")
        bandwidth = copy_gbs(device) * 1e9
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}; copy bandwidth "
              f"{bandwidth / 1e9:,.0f} GB/s")  # fmt: skip
        rows = sweep(args.weights, args.batch or (1,), device, bandwidth)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": run_meta(mode="sweep", copy_bytes_per_s=bandwidth), "rows": rows}, f, indent=1)
        return 0
    batches = sorted(args.batch or DEFAULT_BATCH[args.model])  # ascending: MXFP8 weights are tiled past one row
    if device.type == "cuda" and not args.no_tune:
        set_tuning(True)
    weights = ("bf16", *[w for w in args.weights if w != "bf16"])  # bf16 first: the ratios' base
    max_len = max(args.context, args.prefill)

    try:
        check_memory(meta_model(args.model, flavor, args.layers, max_len), device, f"{args.model} {flavor}")
        options = dict(max_len=max_len, device=device, reference=args.reference, fuse=not args.no_fuse,
                       layout=args.layout, output=args.quantize_output)  # fmt: skip
        models = {fmt: build(args.model, flavor, args.layers, fmt, **options) for fmt in weights}
    except ValueError as e:
        p.error(str(e))
    dims, dtype = models["bf16"].args, models["bf16"].output.weight.dtype
    bandwidth = copy_gbs(device) * 1e9  # bytes/s
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"device: {name}, torch {torch.__version__}, {args.model} {flavor} dims, {dims.n_layers} layers, "
        f"vocab {dims.vocab_size}; copy bandwidth {bandwidth / 1e9:,.0f} GB/s; "
        f"{'reference GEMMs' if args.reference else 'weight-only kernel'}"
        f"{', default configs' if args.no_tune or args.reference else ', tuned configs'}"
        f"{', torch.compile' if args.compile else ''}{', unfused projections' if args.no_fuse else ''}"
        f"{', output layer quantized' if args.quantize_output else ''}"
        f"{'' if args.layout == 'auto' else f', {args.layout} layout'}"
        f"{', no PDL' if args.pdl == 'off' else ', with and without PDL' if args.pdl == 'both' else ''}; weights "
        + ", ".join(f"{fmt} {weight_bytes(m) / 1e9:.2f} GB" for fmt, m in models.items())
    )
    step_fn = torch.compile(forward) if args.compile else forward
    rows = []

    def add_rows(mode: str, batch: int, tokens: int, seconds: dict[str, float], nbytes: dict[str, float]) -> None:
        for fmt in weights:
            bound = tokens / (nbytes[fmt] / bandwidth) if nbytes[fmt] else None
            row = dict(mode=mode, weights=fmt, batch=batch, tokens=tokens, ms=seconds[fmt] * 1e3,
                       tokens_per_s=tokens / seconds[fmt], vs_bf16=seconds["bf16"] / seconds[fmt],
                       bytes=nbytes[fmt], bound_tokens_per_s=bound,
                       pct_of_bound=100 * tokens / seconds[fmt] / bound if bound else None)  # fmt: skip
            rows.append(row)
            pct = f"{row['pct_of_bound']:5.1f}% of bound" if bound else ""
            print(
                f"{mode:>7} batch {batch:>4} {fmt:>6}: {row['ms']:9.3f} ms  {row['tokens_per_s']:>11,.1f} tok/s  "
                f"{row['vs_bf16']:5.2f}x bf16  {pct}"
            )

    mode = "gemms" if args.gemms_only else "decode"
    pdl_ways = (True, False) if args.pdl == "both" else (args.pdl == "on",)
    for batch in batches:
        for m in models.values():
            tile(m, batch, args.layout)  # MXFP8's past one row where auto (mx_recipe.infer.weights)
        cache = None if args.gemms_only else KVCache(models["bf16"], batch, args.context, dtype, device)
        steps = {}
        for pdl in pdl_ways:  # the kernels' launches are fixed when the graph is captured
            with kernel_settings(pdl=pdl):
                for fmt, m in models.items():
                    if args.gemms_only:
                        steps[fmt, pdl] = replayable(gemms_step(m, batch, device), device)
                    else:
                        steps[fmt, pdl] = decode_step(m, cache, batch, step_fn, device)
        samples = {key: [] for key in steps}
        for _ in range(args.rounds):
            for key in steps:
                samples[key].append(timed(steps[key], device, args.steps))
        nbytes = {fmt: step_bytes(m, batch, cache) for fmt, m in models.items()}
        for pdl in pdl_ways:
            label = mode if pdl or args.pdl == "off" else f"{mode} no-pdl"
            seconds = {fmt: statistics.median(samples[fmt, pdl]) for fmt in weights}
            add_rows(label, batch, batch, seconds, nbytes)
            if args.profile_top:
                for fmt in weights:
                    print_step_kernels(f"{label} batch {batch} {fmt}", steps[fmt, pdl], seconds[fmt], args.profile_top)
        del steps, cache
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if args.prefill and not args.gemms_only:
        cache = KVCache(models["bf16"], 1, args.prefill, dtype, device)
        tokens = token_ids(models["bf16"], (1, args.prefill), device)
        for m in models.values():
            prefill(m, tokens, cache)  # warm-up: kernels compile
        # the formats interleaved in rounds, as decode's: an eager prefill waits on the host, whose speed drifts
        # over a run (MoE 16B MXFP4 on one H200: 18 to 28 ms for the same 8 layers), and a format timed in a
        # slow stretch would carry it into its ratio
        samples = {fmt: [] for fmt in weights}
        for _ in range(args.rounds):
            for fmt, m in models.items():
                samples[fmt].append(timed(lambda m=m: prefill(m, tokens, cache), device, 1))
        seconds = {fmt: statistics.median(samples[fmt]) for fmt in weights}
        add_rows("prefill", 1, args.prefill, seconds, {fmt: 0.0 for fmt in weights})

    verdicts = []
    decode = {(r["weights"], r["batch"]): r for r in rows if r["mode"] == mode}
    if ("bf16", 1) in decode and args.model == "llama" and not args.gemms_only:
        pct = decode[("bf16", 1)]["pct_of_bound"]
        verdicts.append(f"bf16 batch-1 decode at {pct:.1f}% of the HBM bound (target >= {BF16_BOUND_TARGET:.0%})")
    for model, fmt, batch, target in TARGETS:
        if model == args.model and (fmt, batch) in decode:
            ratio = decode[(fmt, batch)]["vs_bf16"]
            verdict = "meets" if ratio >= target else "misses"
            verdicts.append(f"{fmt} batch {batch}: {ratio:.3f}x bf16 tokens/s ({verdict} the target >= {target}x)")
    for line in verdicts:
        print(line)
    if args.out:
        meta = run_meta(model=args.model, flavor=flavor, layers=dims.n_layers, vocab=dims.vocab_size,
                        context=args.context, copy_bytes_per_s=bandwidth, reference=args.reference,
                        compiled=args.compile, fused=not args.no_fuse, pdl=args.pdl, layout=args.layout,
                        tuned=not args.no_tune and device.type == "cuda", mode=mode,
                        quantized_output=args.quantize_output)  # fmt: skip
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows, "verdicts": verdicts}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
