"""Roofline of MX training against bf16 (scripts/roofline_model.py): per GEMM shape, per model, observed.

    python scripts/roofline.py --shape 16384,4096,4096 [--device b200] [--path native] [--recipe mxfp8]
    python scripts/roofline.py --model llama --flavor 8B --seq-len 8192 [--batch 1] [--vocab-size 128256]
    python scripts/roofline.py --project [--write docs/ROOFLINE.md] [--plot docs/roofline_speedup.png]
    python scripts/roofline.py --observe [--out FILE]     # on a CUDA GPU: measured against the roofline

--project renders the B200 projections of configs/llama_mxfp8.toml and configs/moe_mxfp8.toml
(the generated part of docs/ROOFLINE.md; tests/test_roofline.py checks the committed doc against it).
--observe times our casts (mx_recipe.ops.mx_cast), a bf16 GEMM, the emulated MX GEMM (mx_recipe.ops.gemm.mx_mm
on cast outputs) and the MX linear forward + backward, and sets each against its roofline time.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere without installing

from roofline_model import (  # noqa: E402
    DEVICES,
    H200_ACHIEVED,
    OURS_TODAY,
    PATHS,
    Device,
    Gemm,
    MXPath,
    bf16_ops,
    cast_op,
    check_path,
    dequant_op,
    estimate,
    estimate_model,
    gemm_op,
    implied_other_time,
    layer_groups,
    model_gemms,
    mx_ops,
    step_time,
)

from mx_recipe.cli import ArgumentParser, int_list, output_file, recipe_name  # noqa: E402
from mx_recipe.formats.recipe import NVFP4_RECIPES, MXRecipe, NVFP4Recipe  # noqa: E402
from mx_recipe.models import MODEL_FLAVORS  # noqa: E402

DOC = ROOT / "docs" / "ROOFLINE.md"
PLOT = ROOT / "docs" / "roofline_speedup.png"
BEGIN, END = "<!-- roofline: begin -->", "<!-- roofline: end -->"

# (config, vocabulary, why that vocabulary): the configs' byte tokenizer would make the bf16 output
# GEMM negligible; the published models (and the peer's Llama 3 8B figure) use these tokenizers.
PROJECTIONS = [
    ("llama_mxfp8", 128256, "Llama 3 tokenizer"),
    ("moe_mxfp8", 102400, "DeepSeek-MoE tokenizer"),
]
PEER_LLAMA = (1.16, 1.20)  # MXFP8 Llama3-8B on 8 B200, tokens/s over bf16 (docs/DESIGN.md, Hardware facts)
PLOT_KN = (4096, 8192, 16384)
# --observe: bench_cast's square shape, Llama 3 8B activation [M, K] and weight [N, K]; bench_moe's and
# moe_16B's expert weights [E, N, K]; bench_linear's MX linear shapes (M, K, N) and a square GEMM.
OBSERVE_CASTS = ((16384, 16384), (16384, 4096), (14336, 4096))
OBSERVE_CASTS_3D = ((16, 8192, 5120), (64, 1408, 2048))
OBSERVE_LINEARS = ((16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096))
OBSERVE_GEMMS = OBSERVE_LINEARS + ((8192, 8192, 8192),)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f}"


def rate(flops: float | None, unit: float = 1e12) -> str:
    return "none" if flops is None else f"{flops / unit:,.0f}"


# --- rendering ---


def casts_cell(p: MXPath) -> str:
    if p.fused_casts:
        return "fused dim0+dim1 (one read)"
    if p.fused_grad_cast or p.fused_x_cast:
        which = " and ".join(t for t, fused in (("x", p.fused_x_cast), ("g", p.fused_grad_cast)) if fused)
        return f"dim0 and dim1 separate (two reads), except a linear's {which} (one read)"
    return "dim0 and dim1 separate (two reads)"


def device_section() -> list[str]:
    rows = [
        [
            d.name,
            rate(d.bf16_flops),
            rate(d.fp8_flops),
            rate(d.fp4_flops),
            rate(d.mem_bw, 1e9),
            rate(d.copy_bw, 1e9) if d.copy_bw else "n/a",
            "yes (sm_100)" if d.native_mx else "no: emulated at the bf16 rate",
            d.source,
        ]
        for d in DEVICES.values()
    ]
    header = ["device", "bf16 TF/s", "fp8/MXFP8 TF/s", "fp4 TF/s", "HBM GB/s (datasheet)", "copy GB/s (measured)"]
    lines = ["### Devices (dense peaks, no sparsity)", ""]
    lines += table(header + ["MX GEMM in hardware", "source"], rows)
    rows = [
        [
            p.name,
            "fp8/fp4 peak" if p.native_gemm else "bf16 peak",
            casts_cell(p),
            "yes, in memory" if p.dequant_passes else "no",
            "copy into a zeroed buffer" if p.group_pad_copy else "none",
            p.description + (" **(our code on Hopper)**" if p.name == OURS_TODAY else ""),
        ]
        for p in PATHS.values()
    ]
    lines += ["", "### MX paths", ""]
    lines += table(["path", "MX GEMM rate", "casts", "dequantize to bf16", "MoE group padding", "what"], rows)
    return lines + [""]


def shape_section(recipe: MXRecipe) -> list[str]:
    """Speedup of one linear (forward + backward) against M, the numbers behind the plot."""
    m_values = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
    cases = [
        (DEVICES["b200"], PATHS["native"]),
        (DEVICES["b200"], PATHS["native_fused"]),
        (DEVICES["h200"], PATHS[OURS_TODAY]),
    ]
    rows = []
    for kn in PLOT_KN:
        for dev, path in cases:
            speedups = [estimate(Gemm("linear", m, kn, kn), dev, recipe, path).speedup for m in m_values]
            rows.append([f"{kn}", f"{dev.name} {path.name}"] + [f"{s:.2f}x" for s in speedups])
    lines = [f"### One linear, forward + backward, {recipe.name}: bf16 time / MX time", ""]
    lines += table(["K = N", "device, path"] + [f"M={m}" for m in m_values], rows)
    lines += ["", "![MX over bf16 speedup against M](roofline_speedup.png)", ""]
    return lines


def op_breakdown(g: Gemm, dev: Device, recipe: MXRecipe, path: MXPath) -> list[str]:
    rows = [
        [op.name, f"{op.flops / 1e9:,.1f}", f"{op.bytes / 1e6:,.1f}", us(op.time(dev)), op.bound(dev)]
        for op in mx_ops(g, recipe, path)
    ]
    bf16 = step_time(bf16_ops(g), dev)
    mx = step_time(mx_ops(g, recipe, path), dev)
    rows.append(["**MX total**", "", "", us(mx), f"bf16 {us(bf16)} us: {bf16 / mx:.2f}x"])
    lines = [f"Ops of `{g.name}` ({g.shape_str()}) on {dev.name}, path {path.name}:", ""]
    return lines + table(["op", "GFLOP", "MB moved", "time (us)", "bound"], rows) + [""]


def layer_section(mg, dev: Device, recipe: MXRecipe, path: MXPath) -> list[str]:
    rows = []
    for layers, gemms in layer_groups(mg):
        label = layers[0] if len(layers) == 1 else f"{layers[0]}..{layers[-1].split('.')[-1]} (x{len(layers)})"
        label = label or "outside layers"
        total_b = total_m = 0.0
        for g in gemms:
            e = estimate(g, dev, recipe, path)
            total_b, total_m = total_b + e.bf16_s, total_m + e.mx_s
            name = g.name.removeprefix(layers[0] + ".")
            rows.append(
                [
                    label,
                    name + ("" if g.mx else " (bf16)"),
                    g.shape_str(),
                    us(e.bf16_s),
                    us(e.mx_gemm_s),
                    us(e.mx_other_s),
                    us(e.mx_s),
                    f"{e.speedup:.2f}x",
                    e.mx_gemm_bound,
                ]
            )
        total = "**total**" if label == "outside layers" else "**layer total**"
        rows.append([label, total, "", us(total_b), "", "", us(total_m), f"{total_b / total_m:.2f}x", ""])
    header = ["layers", "GEMM", "shape M x K x N", "bf16 (us)", "MX GEMMs (us)", "MX casts etc. (us)", "MX (us)"]
    lines = [f"Per layer on {dev.name}, path {path.name} (forward + backward of each GEMM):", ""]
    return lines + table(header + ["speedup", "MX forward GEMM bound"], rows) + [""]


def model_cases() -> list[tuple[Device, MXPath]]:
    b200, h200, h100 = DEVICES["b200"], DEVICES["h200"], DEVICES["h100"]
    return [
        (b200, PATHS["native"]),
        (b200, PATHS["native_fused"]),
        (b200.derated(H200_ACHIEVED), PATHS["native"]),
        (b200.derated(H200_ACHIEVED), PATHS["native_fused"]),
        (b200, PATHS[OURS_TODAY]),
        (h200, PATHS[OURS_TODAY]),
        (h200, PATHS["emulated"]),
        (h200, PATHS["emulated_fused"]),
        (h200.measured(), PATHS[OURS_TODAY]),
        (h100, PATHS[OURS_TODAY]),
    ]


def model_section(mg, recipe: MXRecipe) -> tuple[list[str], dict]:
    rows, results = [], {}
    for dev, path in model_cases():
        e = estimate_model(mg, dev, recipe, path)
        results[(dev.name, path.name)] = e
        rows.append(
            [
                dev.name,
                path.name,
                ms(e.converted_bf16_s),
                ms(e.converted_mx_s),
                f"{e.gemm_speedup:.2f}x",
                ms(e.unchanged_s),
                ms(e.bf16_step_s),
                ms(e.mx_step_s),
                f"**{e.speedup:.2f}x**",
            ]
        )
    header = ["device", "path", "MX-converted GEMMs, bf16 (ms)", "same in MX (ms)", "GEMM speedup"]
    header += ["unchanged bf16 (ms)", "bf16 step (ms)", "MX step (ms)", "model speedup"]
    return table(header, rows) + [""], results


def projection_section(config_name: str, vocab: int, vocab_note: str) -> tuple[list[str], dict]:
    from mx_recipe.train.config import load_config

    cfg = load_config(config_name)
    t, recipe = cfg.training, MXRecipe.from_name(cfg.mx.recipe)
    mg = model_gemms(cfg.model.name, cfg.model.flavor, t.local_batch_size, t.seq_len, vocab, cfg.mx.skip)
    n_mx = sum(g.mx for _, g in mg.gemms)
    kept = [g.name for _, g in mg.gemms if not g.mx]
    kept_s = ", ".join(sorted({k if k == "output" else "*." + k.split(".")[-2] + "." + k.split(".")[-1] for k in kept}))
    experts = [g for _, g in mg.gemms if g.groups > 1]
    lines = [f"### {config_name}: {cfg.model.name} {cfg.model.flavor}, recipe {recipe.name}", ""]
    lines += [
        "Assumptions:",
        "",
        f"- per GPU: local batch {t.local_batch_size} x seq_len {t.seq_len} = {mg.tokens} tokens a step "
        "(configs/" + config_name + ".toml); under FSDP each GPU runs the unsharded GEMMs on its own tokens",
        f"- {n_mx} GEMMs converted to MX (convert_to_mx, skip {list(cfg.mx.skip)}); {len(kept)} stay bf16 ({kept_s})",
        f"- vocabulary {vocab} ({vocab_note}) for the bf16 output GEMM",
    ]
    if experts:
        e = experts[0]
        lines.append(
            f"- experts: one grouped GEMM per weight over tokens x top_k = {e.m} rows, {e.m // e.groups} per "
            f"expert on average (perfect balance); the whole [{e.groups}, N, K] weight is read and cast every step"
        )
    lines += [
        "- every GEMM at the dense peak of its format, every cast/pad/dequantize at the memory bandwidth, "
        "each op max(compute, memory), ops summed with no overlap",
        "- unchanged bf16 time = the GEMMs left in bf16 + causal attention (SDPA) at the bf16 peak; "
        "norms, RoPE, SwiGLU, routing, loss, optimizer and FSDP communication are left out",
        recompute_line(cfg.activation_checkpoint.mode),
        "",
    ]
    b200, native = DEVICES["b200"], PATHS["native"]
    lines += layer_section(mg, b200, recipe, native)
    biggest = max((g for _, g in mg.gemms if g.mx), key=lambda g: g.flops)
    lines += op_breakdown(biggest, b200, recipe, native)
    if experts:
        lines += op_breakdown(experts[0], b200, recipe, native)
    lines += ["Whole step (GEMMs + attention):", ""]
    model_lines, results = model_section(mg, recipe)
    lines += model_lines
    lines += batch_sweep(cfg.model.name, cfg.model.flavor, t.seq_len, vocab, list(cfg.mx.skip), recipe)
    if config_name == "llama_mxfp8":
        lines += peer_lines(results)
    return lines, results


def recompute_line(mode: str) -> str:
    if mode == "none":
        return "- no activation checkpointing (the config's mode is none), so no recomputed forward"
    return f"- activation checkpointing {mode} in the config; the model counts no recomputed forward"


def batch_sweep(name: str, flavor: str, seq_len: int, vocab: int, skip: list[str], recipe: MXRecipe) -> list[str]:
    """More tokens per GPU raise the GEMMs' share against the weight casts (memory permitting)."""
    b200 = DEVICES["b200"]
    rows = []
    for batch in (1, 2, 4, 8):
        mg = model_gemms(name, flavor, batch, seq_len, vocab, skip)
        cells = [f"{estimate_model(mg, b200, recipe, PATHS[p]).speedup:.2f}x" for p in ("native", "native_fused")]
        rows.append([str(batch), str(mg.tokens)] + cells)
    lines = ["Model speedup on B200 against the local batch (activation memory not checked):", ""]
    return lines + table(["local batch", "tokens per GPU", "native", "native_fused"], rows) + [""]


def peer_lines(results: dict) -> list[str]:
    lo, hi = PEER_LLAMA
    mid = (lo + hi) / 2
    lines = [f"Against the peer library's published {lo:.2f}-{hi:.2f}x (MXFP8 Llama3-8B on 8 B200):", ""]
    for dev, path in model_cases()[:4]:
        e = results[(dev.name, path.name)]
        other = implied_other_time(e.bf16_step_s, e.mx_step_s, mid)
        lines.append(
            f"- {dev.name}, {path.name}: projected {e.speedup:.2f}x; {mid:.2f}x would follow if the step also "
            f"held {ms(other)} ms of time MX does not change ({other / (e.bf16_step_s + other):.0%} of the bf16 step)"
        )
    return lines + [""]


def summary_line(config_name: str, results: dict) -> str:
    b200, derated = DEVICES["b200"].name, DEVICES["b200"].derated(H200_ACHIEVED).name
    h200 = DEVICES["h200"].name
    s = {key: e.speedup for key, e in results.items()}
    return (
        f"- **{config_name}**, model speedup on B200: **{s[(b200, 'native')]:.2f}x** with a native MX GEMM and "
        f"separate casts (native), {s[(b200, 'native_fused')]:.2f}x with fused casts and no group padding copy "
        "(native_fused); "
        f"{s[(derated, 'native')]:.2f}x / "
        f"{s[(derated, 'native_fused')]:.2f}x at the fractions of peak reached on H200; the emulated path that "
        f"Hopper runs ({OURS_TODAY}) {s[(h200, OURS_TODAY)]:.2f}x on H200 "
        f"({s[(b200, OURS_TODAY)]:.2f}x at B200's rates)"
    )


FP4_RECIPES = ("mxfp8", "mxfp4", "nvfp4")  # the 4-bit rows, with MXFP8 beside them


def fp4_section() -> list[str]:
    """Llama 3 8B (configs/llama_mxfp8.toml's GEMMs) under MXFP8, MXFP4 and NVFP4: model speedup per path."""
    from mx_recipe.train.config import load_config

    config_name, vocab, _ = PROJECTIONS[0]
    cfg = load_config(config_name)
    t = cfg.training
    mg = model_gemms(cfg.model.name, cfg.model.flavor, t.local_batch_size, t.seq_len, vocab, cfg.mx.skip)
    cases = model_cases()
    rows = []
    for name in FP4_RECIPES:
        recipe = NVFP4Recipe.from_name(name) if name in NVFP4_RECIPES else MXRecipe.from_name(name)
        rows.append([name] + [f"{estimate_model(mg, dev, recipe, path).speedup:.2f}x" for dev, path in cases])
    lines = [f"### The 4-bit recipes: {cfg.model.name} {cfg.model.flavor} ({config_name}'s GEMMs and skips)", ""]
    lines += [
        "Model speedup over bf16 with every converted GEMM in the recipe's format: MXFP4 and NVFP4 run their GEMMs "
        "at the fp4 peak on B200; NVFP4 pays one more read of each cast tensor (its per-tensor maximum) and "
        "e4m3 scales per 16 elements. On Hopper both are emulated at the bf16 rate.",
        "",
    ]
    return lines + table(["recipe", *(f"{dev.name}, {path.name}" for dev, path in cases)], rows) + [""]


def render() -> str:
    recipe = MXRecipe.from_name("mxfp8")
    body, summary = [], ["### Summary", ""]
    for config_name, vocab, note in PROJECTIONS:
        lines, results = projection_section(config_name, vocab, note)
        body += lines
        summary.append(summary_line(config_name, results))
    lines = summary + [""] + device_section() + shape_section(recipe) + body + fp4_section()
    return "\n".join(lines).rstrip() + "\n"


def write_doc(path: Path, generated: str) -> None:
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: the markers {BEGIN} and {END} are missing")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{generated}{END}{tail}")
    print(f"wrote {path}")


def plot(path: Path) -> None:
    """Speedup of one linear against M for K = N in PLOT_KN: B200 native (solid), B200 fused casts
    (dotted), H200 emulated as our code runs today (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recipe = MXRecipe.from_name("mxfp8")
    m_values = sorted({32 * round(128 * 2 ** (i / 4) / 32) for i in range(37)})  # 128 .. 65536
    cases = [
        (DEVICES["b200"], PATHS["native"], "-", "B200 native MX GEMM"),
        (DEVICES["b200"], PATHS["native_fused"], ":", "B200 native, fused casts"),
        (DEVICES["h200"], PATHS[OURS_TODAY], "--", "H200 emulated, fake quant (our code today)"),
    ]
    colors = ("tab:blue", "tab:orange", "tab:green")
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    for kn, color in zip(PLOT_KN, colors, strict=True):
        for dev, path_, style, _ in cases:
            ys = [estimate(Gemm("linear", m, kn, kn), dev, recipe, path_).speedup for m in m_values]
            ax.plot(m_values, ys, style, color=color, linewidth=1.4)
    # two legends: color says K = N, line style says device and path
    k_handles = [plt.Line2D([], [], color=c, label=f"K = N = {kn}") for kn, c in zip(PLOT_KN, colors, strict=True)]
    path_handles = [plt.Line2D([], [], color="black", linestyle=st, label=label) for _, _, st, label in cases]
    ax.add_artist(ax.legend(handles=k_handles, fontsize=8, loc="upper left"))
    ax.legend(handles=path_handles, fontsize=8, loc="center right")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.axhline(2.0, color="gray", linewidth=0.8, linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("bf16 time / MXFP8 time")
    ax.set_title("Roofline: one linear, forward + backward (no cast/GEMM overlap)", fontsize=10)
    ax.set_ylim(0, 2.2)
    ax.grid(True, which="major", linewidth=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KB)")


def print_shape(m: int, k: int, n: int, dev: Device, recipe: MXRecipe, path: MXPath) -> None:
    check_path(dev, path)
    print("\n".join(op_breakdown(Gemm("linear", m, k, n), dev, recipe, path)))


def print_model(args, dev: Device, recipe: MXRecipe, path: MXPath) -> None:
    mg = model_gemms(args.model, args.flavor, args.batch, args.seq_len, args.vocab_size)
    print("\n".join(layer_section(mg, dev, recipe, path)))
    e = estimate_model(mg, dev, recipe, path)
    print(
        f"{dev.name}, {path.name}: converted GEMMs {ms(e.converted_bf16_s)} -> {ms(e.converted_mx_s)} ms "
        f"({e.gemm_speedup:.2f}x); step {ms(e.bf16_step_s)} -> {ms(e.mx_step_s)} ms ({e.speedup:.2f}x), "
        f"with {ms(e.unchanged_s)} ms unchanged (bf16 GEMMs + attention)"
    )


# --- observed against theoretical (CUDA) ---


def observe(out: str | None, device_key: str | None) -> None:
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        raise SystemExit("--observe needs a CUDA GPU, and torch.cuda.is_available() is False here")
    import triton.testing

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from timing import run_meta  # the benchmarks' provenance, for the same meta in every result file

    from mx_recipe.nn.linear import mx_linear
    from mx_recipe.ops.backends import resolve_backend
    from mx_recipe.ops.gemm import mx_mm
    from mx_recipe.ops.mx_cast import cast_3d_dim0, cast_3d_dim1, cast_dim0, cast_dim0_dim1, cast_dim1

    start = time.time()
    name = torch.cuda.get_device_name()
    key = device_key or next((k for k in DEVICES if DEVICES[k].name.split()[0].lower() in name.lower()), None)
    if key is None:
        raise SystemExit(f"no roofline entry for {name!r}; pass --device one of {sorted(DEVICES)}")
    dev = DEVICES[key]
    recipe = MXRecipe.from_name("mxfp8")
    elem, rule = recipe.forward, recipe.scale_rule
    backend = resolve_backend(recipe, torch.device("cuda")).name
    path = PATHS[OURS_TODAY if backend == "emulated" else "native"]
    bench = lambda fn, **kw: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median", **kw) * 1e-3

    src = torch.randn(2**28, device="cuda")  # 1 GiB fp32: copy bandwidth, read + write
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() * 4 / bench(lambda: dst.copy_(src))
    src = dst = None
    at_copy = replace(dev, name=f"{dev.name} at {copy_bw / 1e9:.0f} GB/s", mem_bw=copy_bw)
    print(f"device: {name}; roofline entry {dev.name}; torch {torch.__version__}; copy {copy_bw / 1e9:.0f} GB/s")
    print(f"MX GEMM backend {backend}: roofline path {path.name}; casts {elem} {rule}, plain scales\n")

    rows: list[dict] = []

    def add(kind: str, op: str, shape, measured_s: float, ops) -> None:
        ops = ops if isinstance(ops, list) else [ops]
        roof, roof_copy = step_time(ops, dev), step_time(ops, at_copy)
        bound = "+".join(sorted({o.bound(dev) for o in ops}))
        row = dict(kind=kind, op=op, shape=list(shape), measured_us=measured_s * 1e6, roofline_us=roof * 1e6)
        row.update(pct_of_roofline=100 * roof / measured_s, roofline_copy_us=roof_copy * 1e6, bound=bound)
        row["pct_of_copy_roofline"] = 100 * roof_copy / measured_s
        rows.append(row)
        print(
            f"{kind:7s} {op:28s} {str(tuple(shape)):22s} {measured_s * 1e6:10.1f} us  roofline {roof * 1e6:9.1f} us "
            f"{row['pct_of_roofline']:5.1f}%  at copy bw {row['pct_of_copy_roofline']:5.1f}%  {bound}"
        )

    for shape in OBSERVE_CASTS:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        for op, fn in (("dim0", cast_dim0), ("dim1", cast_dim1)):
            add("cast", op, shape, bench(lambda fn=fn, x=x: fn(x, elem, rule)), cast_op(op, x.numel(), elem))
        fused = cast_op("dim0+dim1", x.numel(), elem, fused=True)
        add("cast", "dim0+dim1 fused", shape, bench(lambda x=x: cast_dim0_dim1(x, elem, rule)), fused)
    for shape in OBSERVE_CASTS_3D:
        w = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        for op, fn in (("3d dim0", cast_3d_dim0), ("3d dim1", cast_3d_dim1)):
            add("cast", op, shape, bench(lambda fn=fn, w=w: fn(w, elem, rule)), cast_op(op, w.numel(), elem))

    ratios: list[dict] = []
    for m, k, n in OBSERVE_GEMMS:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * m * k * n
        bf16_op = gemm_op("bf16 GEMM", flops, (m * k, 2), (n * k, 2), m * n, "bf16")
        t_bf16 = bench(lambda a=a, b=b: torch.mm(a, b.t()))
        add("gemm", "bf16 mm", (m, k, n), t_bf16, bf16_op)
        a_mx, b_mx = cast_dim0(a, elem, rule), cast_dim0(b, elem, rule)
        emulated = [dequant_op("a", m * k, elem), dequant_op("b", n * k, elem), bf16_op]
        t_mx = bench(lambda a=a_mx, b=b_mx: mx_mm(a, b, torch.bfloat16, recipe.backend))
        add("gemm", f"mx_mm ({backend})", (m, k, n), t_mx, emulated)
        ratios.append(ratio_row("gemm", (m, k, n), t_bf16, t_mx, step_time([bf16_op], dev), step_time(emulated, dev)))

    for m, k, n in OBSERVE_LINEARS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        lin = Gemm("linear", m, k, n)
        t_bf16 = bench(lambda x=x, w=w, g=g: F.linear(x, w).backward(g), grad_to_none=[x, w])
        add("linear", "bf16 fwd+bwd", (m, k, n), t_bf16, bf16_ops(lin))
        t_mx = bench(lambda x=x, w=w, g=g: mx_linear(x, w, None, recipe).backward(g), grad_to_none=[x, w])
        add("linear", f"{recipe.name} fwd+bwd ({path.name})", (m, k, n), t_mx, mx_ops(lin, recipe, path))
        roof_b, roof_m = step_time(bf16_ops(lin), dev), step_time(mx_ops(lin, recipe, path), dev)
        ratios.append(ratio_row("linear", (m, k, n), t_bf16, t_mx, roof_b, roof_m))

    print(f"\n=== observed vs roofline: {name} (roofline entry {dev.name}), copy {copy_bw / 1e9:.0f} GB/s ===")
    header = ["kind", "op", "shape", "measured (us)", "roofline (us)", "% of roofline", "% at copy bw", "bound"]
    body = [
        [r["kind"], r["op"], "x".join(map(str, r["shape"])), f"{r['measured_us']:.1f}", f"{r['roofline_us']:.1f}"]
        + [f"{r['pct_of_roofline']:.1f}%", f"{r['pct_of_copy_roofline']:.1f}%", r["bound"]]
        for r in rows
    ]
    print("\n".join(table(header, body)))
    print("\nMX time / bf16 time, measured and by the roofline (same device):")
    for r in ratios:
        print(
            f"  {r['kind']:6s} {'x'.join(map(str, r['shape'])):18s} measured {r['measured']:.2f}x, "
            f"roofline {r['roofline']:.2f}x"
        )
    elapsed = time.time() - start
    print(f"\n{len(rows)} rows in {elapsed:.0f} s")
    if out:
        meta = run_meta(copy_gbs=copy_bw / 1e9, roofline_device=dev.name, path=path.name, elem=elem, mode=rule)
        Path(out).write_text(json.dumps(dict(meta=meta, rows=rows, ratios=ratios, seconds=elapsed), indent=1))
        print(f"wrote {out}")


def ratio_row(kind: str, shape, t_bf16: float, t_mx: float, roof_bf16: float, roof_mx: float) -> dict:
    return dict(kind=kind, shape=list(shape), measured=t_mx / t_bf16, roofline=roof_mx / roof_bf16)


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__)
    p.add_argument("--shape", type=int_list(3, "M,K,N"), help="M,K,N of one linear: its ops, forward + backward")
    p.add_argument("--model", choices=sorted(MODEL_FLAVORS), help="every GEMM of the model, per layer")
    p.add_argument("--flavor", help="with --model: its size (default 8B)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1, help="local batch size (sequences per GPU)")
    p.add_argument("--vocab-size", type=int, default=128256)
    p.add_argument("--device", choices=sorted(DEVICES), help="roofline device (default: b200; --observe: the GPU's)")
    p.add_argument("--path", choices=sorted(PATHS), help=f"MX path (default: native on B200, {OURS_TODAY} elsewhere)")
    p.add_argument("--recipe", default="mxfp8", type=recipe_name(nvfp4=False), help="an MX recipe")
    p.add_argument("--project", action="store_true", help="the B200 projections of docs/ROOFLINE.md")
    p.add_argument("--write", metavar="DOC", help="with --project: replace the generated part of DOC")
    p.add_argument("--plot", metavar="PNG", type=output_file, help="write the speedup-against-M plot here")
    p.add_argument("--observe", action="store_true", help="measure on this CUDA GPU against the roofline")
    p.add_argument("--out", type=output_file, help="with --observe: write the rows as JSON here")
    args = p.parse_args(argv)
    if args.flavor is not None and args.model is None:
        p.error(f"argument --flavor: {args.flavor!r} needs --model")
    if args.model is not None:
        known = ", ".join(MODEL_FLAVORS[args.model])
        if args.flavor is None and args.model != "llama":
            p.error(f"argument --flavor: --model {args.model} needs one of {known}")
        args.flavor = args.flavor or "8B"
        if args.flavor not in MODEL_FLAVORS[args.model]:
            p.error(f"argument --flavor: unknown {args.model} flavor {args.flavor!r}; known: {known}")
    if args.write is not None and not Path(args.write).is_file():
        p.error(f"argument --write: no file {args.write}")

    if args.observe:
        observe(args.out, args.device)
        return
    dev = DEVICES[args.device or "b200"]
    path = PATHS[args.path or ("native" if dev.native_mx else OURS_TODAY)]
    recipe = MXRecipe.from_name(args.recipe)
    did = False
    if args.shape:
        print_shape(*args.shape, dev, recipe, path)
        did = True
    if args.model:
        print_model(args, dev, recipe, path)
        did = True
    if args.plot:
        plot(Path(args.plot))
        did = True
    if args.project or not did:
        generated = render()
        if args.write:
            write_doc(Path(args.write), generated)
        else:
            print(generated, end="")


if __name__ == "__main__":
    main()
