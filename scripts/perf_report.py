"""Render the measured tables of docs/PERFORMANCE.md from the result files in docs/results/.

Every figure in that document comes from a file a benchmark or a training run wrote:
``*_bench_cast[_e2m1].json``, ``*_bench_fp4_cast.json``, ``*_bench_gemm.json``, ``*_bench_linear[_RECIPE].json``,
``*_bench_moe.json``, ``*_bench_host.json``, ``*_bench_train_CONFIG.json``, ``*_bench_decode*.json`` (benchmarks/),
``*_roofline_observe.json`` (scripts/roofline.py --observe), ``*_train_*/`` folders holding a ``meta.json``
and one ``metrics.jsonl`` per run (train.py), ``*_parity_*/`` sets (scripts/parity_sweep.py), ``*_torchtitan/``
folders of torchtitan runs (scripts/torchtitan_gpu.sh: a ``meta.json`` and rank 0's log of each run) and
``*_weight_quality/`` sets (scripts/weight_quality.py, a JSON per trained checkpoint: their table is in RESULTS.md,
their source line here under the decode table). One file per benchmark, device and variant: the latest (older ones
stay in git history).

The document is a summary: one table per benchmark, a row per variant and device, a column per shape (or a
range over the shapes). The per-shape detail (times, bandwidths, memory) stays in the JSON files.

    python scripts/perf_report.py            # print the tables
    python scripts/perf_report.py --write    # replace the generated part of docs/PERFORMANCE.md
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from compare_runs import Run, median_of, peak_memory_gib, read_run  # noqa: E402
from results_report import quality_folders, quality_meta  # noqa: E402

RESULTS = ROOT / "docs" / "results"
DOC = ROOT / "docs" / "PERFORMANCE.md"
ROOFLINE_DOC = ROOT / "docs" / "ROOFLINE.md"
BEGIN, END = "<!-- perf_report: begin -->", "<!-- perf_report: end -->"


def source_line(meta: dict, name: str) -> str:
    when = f"{meta['device']}, torch {meta['torch']}, {meta['date'][:10]}, commit {meta['commit'][:7]}"
    command = f" `{meta['command']}`" if meta.get("command") else ""
    note = f" ({meta['note']})" if meta.get("note") else ""  # how a run differs from what its commit would run
    return f"- Source: `docs/results/{name}`: {when}.{command}{note}"


def sources(items: list[tuple[dict, str]]) -> list[str]:
    return [""] + [source_line(meta, name) for meta, name in items] + [""]


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]


def span(values: list[float], fmt: str = "{:.1%}") -> str:
    """A range, or one value where the range is a point."""
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def device_of(path: Path) -> str:
    """The device tag of a result file's name (DATE_DEVICE_...): h200, h100, h200x4."""
    return path.name.split("_")[1]


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def is_cast(r: dict) -> bool:
    """An MX cast that the cast targets judge (not a fake-quant, a copy or a pair of separate casts)."""
    return not r["name"].startswith(("fq", "copy")) and "separate" not in r["name"]


# --- the targets ---


def cast_targets(path: Path) -> dict[str, str]:
    """The cast targets of docs/DESIGN.md (Performance targets) judged on kernel time, one cell each. The e2m1
    casts (``bench_cast.py --elem e2m1``) have the 4-bit target alone: 85% of copy."""
    data = load(path)
    results = data["results"]
    get = {(r["name"], tuple(r["shape"]), r["mode"]): r for r in results}
    casts = [r for r in results if is_cast(r)]
    worst = min(casts, key=lambda r: r["kernel_pct_copy"])
    where = f"{worst['name']} {'x'.join(map(str, worst['shape']))} {worst['mode']}"
    slowest = f"{worst['kernel_pct_copy']:.1f}% at the slowest ({where})"
    if data["meta"]["elem"] == "e2m1":
        return {"MXFP4 packed casts (dim0, dim1, fused, 3D, per group) >= 85% of copy (kernel time)": slowest}
    fused = [
        get[(f"dim0 + dim1 separate{tag}", k[1], k[2])]["kernel_us"] / r["kernel_us"]
        for k, r in get.items()
        for tag in ("", " blocked")
        if k[0] == f"dim0_dim1 fused{tag}"
    ]
    rceil = [
        r["kernel_us"] / get[(k[0], k[1], "floor")]["kernel_us"]
        for k, r in get.items()
        if k[2] == "rceil" and is_cast(r) and (k[0], k[1], "floor") in get
    ]
    flat = []
    for name in {r["name"] for r in casts if r["name"].startswith("3d")}:
        for mode in {r["mode"] for r in casts}:
            gbs = [r["kernel_gbs"] for r in casts if (r["name"], r["mode"]) == (name, mode)]
            flat.append(max(gbs) / min(gbs))
    cells = {"MX casts >= 90% of copy bandwidth (kernel time)": slowest}
    if fused:
        cells["fused dim0+dim1 >= 1.4x faster than two casts"] = f"{min(fused):.2f}-{max(fused):.2f}x"
    if rceil:
        cells["rceil within 3% of floor"] = f"rceil/floor {min(rceil):.3f}-{max(rceil):.3f}"
    if flat:
        cells["3D casts flat across E within 10%"] = f"max/min GB/s over E {max(flat):.3f}"
    return cells


def training_targets(folders: list[Path]) -> dict[str, list[str]]:
    """MXFP8 tokens/s against bf16, from the parity sets and the multi-GPU training sets."""
    cells: dict[str, list[str]] = {}
    for folder in folders:
        device = device_of(folder)
        if "_parity_" in folder.name:
            summary = load(folder / "summary.json")
            name = folder.name.split("_parity_", 1)[1]
            for arm in summary["arms"]:  # one cell per recipe, whatever the number of seeds
                if arm["mx_recipe"].startswith("mxfp8"):
                    cells.setdefault(device, []).append(f"{name} {arm['mx_recipe']} {arm['tokens_per_sec_ratio']:.3f}x")
        else:
            for name, _, tps, base in run_set(train_py_runs(folder)):
                if name.endswith("_mxfp8") and base:
                    cells.setdefault(device, []).append(f"{name.removesuffix('_mxfp8')} {tps / base:.3f}x")
    return cells


def targets_section(results: dict[str, list[Path]]) -> list[str]:
    """Where each Hopper target stands, per device, computed from the latest result files below."""
    devices = sorted({device_of(p) for kind, paths in results.items() if kind != "weight_quality" for p in paths})
    cells: dict[str, dict[str, str]] = {}

    def append(target: str, device: str, cell: str) -> None:
        """``cell`` after what ``target`` already holds for ``device`` (several files of one benchmark, by name)."""
        by_device = cells.setdefault(target, {})
        by_device[device] = "; ".join(filter(None, [by_device.get(device), cell]))

    for path in results["bench_cast"]:
        for target, cell in cast_targets(path).items():
            cells.setdefault(target, {})[device_of(path)] = cell
    for path in results["bench_linear"]:
        data = load(path)
        ratios, recipe = [r["ratio"] for r in data["rows"]], data["meta"]["recipe"]
        target = f"MX linear fwd+bwd <= 1.15x bf16 ({recipe})" if "fp4" in recipe else "MX linear fwd+bwd <= 1.10x bf16"
        cells.setdefault(target, {})[device_of(path)] = f"{min(ratios):.2f}-{max(ratios):.2f}x"
    for path in results["bench_fp4_cast"]:
        shares = [r["of_copy"] for r in load(path)["rows"]]
        share = f"{min(shares):.0%}-{max(shares):.0%} (each kernel, of the bytes it moves)"
        cells.setdefault("4-bit cast and fake-quant kernels >= 85% of copy", {})[device_of(path)] = share
    for path in results["bench_moe"]:
        data = load(path)
        ratios = ", ".join(f"E={experts(r)} {r['scaled_e2e_us'] / r['bf16_e2e_us']:.2f}x" for r in data["rows"])
        target = f"MX grouped GEMM fwd+bwd <= 1.15x bf16 ({data['meta']['recipe']})"
        cells.setdefault(target, {})[device_of(path)] = ratios
    for device, runs in training_targets(results["train"]).items():
        cells.setdefault("training step MXFP8 >= 0.90x bf16 tokens/s", {})[device] = "; ".join(runs)
    for path in results["bench_train"]:
        append(
            "bench_train: Llama MXFP8 >= 0.97x, MoE >= 0.90x bf16 tokens/s", device_of(path), bench_train_targets(path)
        )
    for path in results["bench_host"]:
        cells.setdefault("host time of one MX cast or fake-quant call <= 20 us", {})[device_of(path)] = host_targets(
            path
        )
    plain_first = sorted(results["bench_decode"], key=lambda path: bool(load(path)["meta"].get("quantized_output")))
    for path in plain_first:  # a run with the output layer quantized after the plain one, whichever ran first
        for target, cell in decode_targets(path).items():
            append(target, device_of(path), cell)
    rows = [[target, *(by_device.get(d, "") for d in devices)] for target, by_device in cells.items()]
    lines = ["## Where each target stands", ""]
    return lines + table(["target", *devices], rows) + [""]


# --- one table per benchmark ---


def column_name(meta: dict, *extra: str) -> str:
    device = meta["device"].removeprefix("NVIDIA ").replace(" 80GB HBM3", "")
    return ", ".join([device, *filter(None, extra)])


def device_name(meta: dict) -> str:
    """The GPU alone (H200), without the note on the machine in parentheses, which the Sources lines keep."""
    return column_name(meta).split(" (")[0]


def cast_section(paths: list[Path]) -> list[str]:
    """One row per cast (plain or blocked scales), one column per run: the kernel time's share of the copy
    bandwidth of the same run, over the run's shapes and both scale rules."""
    if not paths:
        return []
    columns, cells, names = [], {}, {}
    for path in paths:
        data = load(path)
        column = column_name(data["meta"], data["meta"]["elem"])
        columns.append(column)
        for r in data["results"]:
            if r["name"].startswith("copy") or "separate" in r["name"]:
                continue
            names.setdefault(r["name"], None)
            cells.setdefault((r["name"], column), []).append(r["kernel_pct_copy"] / 100)
    rows = [[name, *(span(cells[(name, c)]) if (name, c) in cells else "" for c in columns)] for name in names]
    lines = ["## Casts (`benchmarks/bench_cast.py`)", ""]
    lines += [
        "Kernel time as a share of the copy bandwidth measured in the same run, the range over the shapes (16384^2;",
        "3D [E, 8192, 5120] for E = 1, 4, 16, 64; 16640 x 5120 in 16 groups) and both scale rules. `fq` is a",
        "fake-quant (the emulated path's operand in bf16); `blocked`, scales in the layout of the sm_100 GEMMs.",
        "",
    ]
    lines += table(["cast", *columns], rows)
    return lines + sources([(load(p)["meta"], p.name) for p in paths])


def fp4_cast_section(paths: list[Path]) -> list[str]:
    """One row per operand, one column per run: each kernel's share of copy (the bytes it moves), then the
    whole call's share counting x once."""
    if not paths:
        return []
    columns, cells, names = [], {}, {}
    for path in paths:
        data = load(path)
        column = column_name(data["meta"])
        columns.append(column)
        for r in data["rows"]:
            names.setdefault(r["name"], None)
            cell = cells.setdefault((r["name"], column), {"kernels": [], "call": None})
            cell["kernels"].append(f"{r['of_copy']:.0%}")
            if r.get("call_of_copy_x_once") is not None and cell["call"] is None:
                cell["call"] = r["call_of_copy_x_once"]

    def fmt(cell: dict | None) -> str:
        if cell is None:
            return ""
        kernels = " + ".join(cell["kernels"])
        return kernels if cell["call"] is None or len(cell["kernels"]) == 1 else f"{kernels} (call {cell['call']:.0%})"

    rows = [[name, *(fmt(cells.get((name, c))) for c in columns)] for name in names]
    lines = ["## 4-bit casts and fake-quants (`benchmarks/bench_fp4_cast.py`), x 16384 x 16384", ""]
    lines += [
        "Each kernel's share of the copy bandwidth, counting the bytes it moves (an NVFP4 cast is two kernels:",
        "the per-tensor maxima, then the cast; a packed MXFP4 cast with plain scales adds an unblock pass); in",
        "parentheses the whole call's share counting x once, which NVFP4's second read caps at two thirds.",
        "",
    ]
    lines += table(["operand", *columns], rows)
    return lines + sources([(load(p)["meta"], p.name) for p in paths])


GEMM_TITLES = {  # benchmarks/bench_gemm.py's backend names
    "emulated": "emulated (dequantize + mm)",
    "emulated_mm": "emulated, mm alone",
    "triton": "triton dot_scaled",
    "cublas": "cublas",
}


def gemm_section(paths: list[Path]) -> list[str]:
    lines = []
    for path in paths:
        data = load(path)
        meta, backends = data["meta"], data["backends"]
        rows = [
            [f"{r['M']}x{r['K']}x{r['N']}", f"{r['bf16_tflops']:.0f}"]
            + [f"{r['mx'][b]['ratio']:.2f}x" if b in r["mx"] else "n/a" for b in backends]
            for r in data["rows"]
        ]
        how = "under torch.compile" if meta.get("compiled", True) else "eager"
        lines += [f"## MX GEMM (`benchmarks/bench_gemm.py`), {column_name(meta)}", ""]
        lines += [
            f"MX time over bf16 `torch.mm` time, {meta['elem']} ({meta['rule']}) operands, {how}.",
            "",
        ]
        lines += table(["M x K x N", "bf16 TFLOP/s", *(GEMM_TITLES.get(b, b) for b in backends)], rows)
        lines += sources([(meta, path.name)])
    return lines


def linear_section(paths: list[Path]) -> list[str]:
    """One row per run (device, recipe), one column per (K, N): MX time over bf16 time."""
    if not paths:
        return []
    runs = [load(p) for p in paths]
    shapes = list(dict.fromkeys((r["M"], r["K"], r["N"]) for data in runs for r in data["rows"]))
    rows = []
    for data in runs:
        by_shape = {(r["M"], r["K"], r["N"]): r for r in data["rows"]}
        cells = [f"{by_shape[s]['ratio']:.2f}x" if s in by_shape else "" for s in shapes]
        kernel = [r["kernel_ratio"] for r in data["rows"] if "kernel_ratio" in r]
        kernel_cell = span(kernel, "{:.2f}x") if kernel else ""
        rows.append([column_name(data["meta"]), data["meta"]["recipe"], *cells, kernel_cell])
    lines = ["## MX linear forward + backward (`benchmarks/bench_linear.py`)", ""]
    lines += [
        "MX time over bf16 `nn.Linear` time, both compiled, timed in interleaved rounds; the last column is the",
        "same ratio of GPU kernel time (the range over the shapes). Target: 1.10x, 1.15x for the 4-bit recipes.",
        "",
    ]
    header = ["device", "recipe", *(f"{m}x{k}x{n}" for m, k, n in shapes), "GPU kernel time"]
    lines += table(header, sorted(rows, key=lambda r: (r[0], r[1])))
    return lines + sources([(data["meta"], p.name) for data, p in zip(runs, paths, strict=True)])


def experts(r: dict) -> str:
    return r["B_shape"].strip("()").split(",")[0]


def moe_section(paths: list[Path]) -> list[str]:
    """One row per run (device, recipe), one column per expert count: MX e2e time over bf16 e2e time."""
    if not paths:
        return []
    runs = [load(p) for p in paths]
    counts = list(dict.fromkeys(experts(r) for data in runs for r in data["rows"]))
    rows = []
    for data in runs:
        by_e = {experts(r): r for r in data["rows"]}
        cells = [f"{by_e[e]['scaled_e2e_us'] / by_e[e]['bf16_e2e_us']:.2f}x" if e in by_e else "" for e in counts]
        rows.append([column_name(data["meta"]), data["meta"]["recipe"], *cells])
    a_shape = runs[0]["rows"][0]["A_shape"]
    lines = ["## MoE grouped GEMM forward + backward (`benchmarks/bench_moe.py`)", ""]
    lines += [
        f"MX time over bf16 time, both compiled, A {a_shape}, B [E, 8192, 5120]. Target: 1.15x.",
        "",
    ]
    lines += table(["device", "recipe", *(f"E={e}" for e in counts)], sorted(rows, key=lambda r: (r[0], r[1])))
    return lines + sources([(data["meta"], p.name) for data, p in zip(runs, paths, strict=True)])


HOST_FAMILIES = (
    "MX fake-quant",
    "MX cast, blocked scales",
    "MX cast, plain scales",
    "NVFP4 fake-quant",
    "layer fwd+bwd",
)


def host_family(r: dict) -> str:
    name = r["name"]
    if r["torch_op"] == "bf16":
        return "layer fwd+bwd"
    if "nvfp4" in name:
        return "NVFP4 fake-quant"
    if "fake" in name:
        return "MX fake-quant"
    return "MX cast, blocked scales" if "blocked" in name else "MX cast, plain scales"


def host_section(paths: list[Path]) -> list[str]:
    lines = []
    for path in paths:
        data = load(path)
        meta, rows = data["meta"], data["rows"]
        body = []
        for family in HOST_FAMILIES:
            members = [r for r in rows if host_family(r) == family]
            if members:
                host = span([r["host_us"] for r in members], "{:.0f}")
                torch_us = span([r["torch_us"] for r in members], "{:.0f}")
                body.append([family, str(len(members)), host, f"{torch_us} ({members[0]['torch_op']})"])
        lines += [f"## Host time of one call (`benchmarks/bench_host.py`), {column_name(meta)}", ""]
        lines += [
            f"Host microseconds per call on a {meta['shape']} bf16 input, public calls and the ops as compiled code",
            "calls them, against torch's own op (a layer: against the bf16 layer). Target: 20 us a call.",
            "",
        ]
        lines += table(["calls", "count", "host (us)", "torch (us)"], body)
        lines += sources([(meta, path.name)])
    return lines


def host_targets(path: Path) -> str:
    """Host time per call by family: the MX fake-quants (the emulated path), the casts with blocked scales (the
    sm_100 path), those with plain scales (the triton backend's) and the NVFP4 fake-quants; not the layers."""
    rows = load(path)["rows"]
    families = {family: [r["host_us"] for r in rows if host_family(r) == family] for family in HOST_FAMILIES[:-1]}
    return "; ".join(f"{name} {span(us, '{:.0f}')} us" for name, us in families.items() if us)


def bench_train_section(paths: list[Path]) -> list[str]:
    """One row per recipe of each bench_train run, with the profile's MX-cast and GPU-idle time per step."""
    if not paths:
        return []
    rows = []
    for path in paths:
        data = load(path)
        meta = data["meta"]
        for r in data["rows"]:
            profile = r.get("profile_ms_per_step")
            step = f"{sum(profile.values()):.1f}" if profile else ""
            ranks = f", {meta['world_size']} GPUs" if meta.get("world_size", 1) > 1 else ""
            rows.append([
                f"{meta['config']} ({meta['layers']} blocks{ranks})", r["recipe"], f"{r['tokens_per_sec']:,.0f}",
                f"{r['ratio']:.3f}x", "n/a" if r["mfu"] is None else f"{r['mfu']:.1f}%",
                "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}", f"{r['rounds_spread']:.1%}",
                f"{profile['MX cast']:.1f}" if profile else "", f"{profile['GPU idle']:.1f}" if profile else "", step,
            ])  # fmt: skip
    devices = ", ".join(dict.fromkeys(column_name(load(p)["meta"]) for p in paths))
    lines = [f"## Training steps, MX against bf16 in one run (`benchmarks/bench_train.py`), {devices}", ""]
    lines += [
        "Each config's blocks (as many as fit one GPU), compiled, bf16 and each recipe timed in interleaved",
        "rounds. The last three columns are torch.profiler's GPU time per step: the MX casts, the time the GPU",
        "waits on the host, and the whole step (ms).",
        "",
    ]
    header = ["config", "recipe", "tokens/s", "to first row", "MFU", "peak GiB", "rounds spread"]
    lines += table(header + ["MX cast", "GPU idle", "step"], rows)
    return lines + sources([(load(p)["meta"], p.name) for p in paths])


def bench_train_targets(path: Path) -> str:
    """The MX rows' ratios to bf16 (a run timed against another baseline, --skip-bf16, has none)."""
    data = load(path)
    if data["rows"][0]["recipe"] != "bf16":
        return ""
    name = f"{data['meta']['config']} ({data['meta']['layers']} blocks)"
    return ", ".join(f"{name} {r['recipe']} {r['ratio']:.3f}x" for r in data["rows"][1:])


def run_set(runs: dict[str, Run]) -> list[tuple[str, Run, float, float | None]]:
    """Each run of a set by name, with its median tokens/s after start-up (as compare_runs.py reads a run) and
    that of the set's bf16 run of the same kind (``<kind>_bf16`` for ``<kind>_<recipe>``; None if none)."""
    speed = {name: median_of(run, "tokens_per_sec") for name, run in runs.items()}
    return [(name, run, speed[name], speed.get(name.rsplit("_", 1)[0] + "_bf16")) for name, run in runs.items()]


def train_py_runs(folder: Path) -> dict[str, Run]:
    """The train.py runs of a set folder, by folder name."""
    return {p.name: read_run(p) for p in sorted(folder.iterdir()) if (p / "metrics.jsonl").is_file()}


def arm_loss(arm: dict) -> str:
    """The loss column of a parity arm: its mean paired difference to bf16, the 95% interval and the verdict."""
    if arm["is_baseline"]:
        return "baseline"
    ci = arm.get("delta_rel_ci")
    interval = f" [{ci[0]:+.2%}, {ci[1]:+.2%}]" if ci else ""
    return f"{arm['delta_rel_mean']:+.2%}{interval} {arm['verdict']}"


def runs_section(folders: list[Path]) -> list[str]:
    """The parity sets (their summary.json; curves in RESULTS.md) and the multi-GPU training sets: one row per
    run, tokens/s per GPU against the set's bf16 run."""
    if not folders:
        return []
    rows = []
    for folder in folders:
        name = folder.name.split("_", 2)[2].removeprefix("parity_").removeprefix("train_")
        device = device_name(load(folder / "meta.json"))
        if "_parity_" in folder.name:
            for arm in load(folder / "summary.json")["arms"]:  # one row per recipe, its seeds together
                ratio = "1.000x" if arm["is_baseline"] else f"{arm['tokens_per_sec_ratio']:.3f}x"
                label = f"{arm['label']} ({len(arm['seeds'])} seed{'s' * (len(arm['seeds']) > 1)})"
                rows.append([name, device, label, str(arm["final_val_step"]), f"{arm['median_tokens_per_sec']:,.0f}",
                             ratio, f"{arm['peak_memory_gib']:.2f}", arm_loss(arm)])  # fmt: skip
            continue
        for run_name, run, tps, base in run_set(train_py_runs(folder)):
            last = next(reversed(run.train.values()))
            rows.append([name, device, run_name, str(last["step"]), f"{tps:,.0f}", f"{tps / base:.3f}x" if base else "",
                         f"{peak_memory_gib(run):.2f}", f"train {last['loss']:.4f}"])  # fmt: skip
    lines = ["## Training runs (`train.py`; parity sets from `scripts/parity_sweep.py`)", ""]
    lines += [
        "Median tokens/s per GPU after the first step, against the set's bf16 run; a parity set has one row per",
        "recipe over its seeds, and its last column is the mean paired difference of the final validation loss to",
        "bf16, its 95% interval (two seeds or more) and the verdict (curves in [RESULTS.md](RESULTS.md)); a run",
        "set's is the last training loss.",
        "",
    ]
    header = ["set", "device", "run", "steps", "tokens/s per GPU", "to bf16", "peak GiB", "loss"]
    lines += table(header, rows)
    return lines + sources([(load(f / "meta.json"), f.name) for f in folders])


def torchtitan_section(folders: list[Path]) -> list[str]:
    """torchtitan's own trainer with the mx converter (scripts/torchtitan_gpu.sh): one row per run, read from
    rank 0's log as scripts/compare_runs.py reads it (medians after the first step), MXFP8 against bf16."""
    if not folders:
        return []
    rows = []
    for folder in folders:
        meta = load(folder / "meta.json")
        gpus = meta.get("gpus", 1)  # torchrun's --nproc_per_node
        device = (f"{gpus} x " if gpus > 1 else "") + device_name(meta)
        for _, run, tps, base in run_set({log.stem: read_run(log) for log in sorted(folder.glob("*.log"))}):
            last = next(reversed(run.train.values()))
            rows.append([run.label, device, str(last["step"]), f"{tps:,.0f}", f"{tps / base:.3f}x" if base else "",
                         f"{median_of(run, 'mfu'):.1f}%", f"{last['loss']:.4f}"])  # fmt: skip
    lines = ["## torchtitan's trainer with the mx converter (`scripts/torchtitan_gpu.sh`)", ""]
    lines += [
        "torchtitan 0.2.x's own `torchtitan.train` (FSDP2 over the GPUs), the model cut to the layers that fit one",
        "GPU; tokens/s per GPU and MFU as torchtitan logs them (medians after the first step). Our trainer on the",
        "same dims is bench_train's llama_bf16 (Llama 3 8B) and moe_bf16 (the 16B MoE) above.",
        "",
    ]
    lines += table(["run", "device", "steps", "tokens/s per GPU", "to bf16", "MFU", "last train loss"], rows)
    return lines + sources([(load(f / "meta.json"), f.name) for f in folders])


def decode_targets(path: Path) -> dict[str, str]:
    """The inference targets of the decode: for Llama 3 8B, bf16 against the HBM bound and the MX weights against
    bf16; for the MoE, its MXFP4 experts against bf16 at batch 1. A run with the output layer in each format too
    (``--quantize-output``) gives the MX ratios alone, each cell saying so."""
    data = load(path)
    rows = [r for r in data["rows"] if r["mode"] == "decode"]
    at = {(r["weights"], r["batch"]): r for r in rows}
    variant = "output layer quantized: " if data["meta"].get("quantized_output") else ""
    if data["meta"]["model"] == "moe":
        got = at.get(("mxfp4", 1))
        target = "MoE decode batch 1: mxfp4 experts >= 2x bf16 tokens/s"
        return {target: f"{variant}{got['vs_bf16']:.3f}x"} if got else {}
    cells = {}
    if ("bf16", 1) in at and not variant:
        cells["decode batch 1: bf16 >= 80% of the HBM bound"] = f"{at['bf16', 1]['pct_of_bound']:.1f}%"
    goals = ((("mxfp8",), 1, "1.7x"), (("mxfp4", "nvfp4"), 1, "2.8x"), (("mxfp4", "nvfp4"), 32, "1.5x"))
    for fmts, batch, goal in goals:
        got = [f"{f} {at[f, batch]['vs_bf16']:.3f}x" for f in fmts if (f, batch) in at]  # 1.695 is not 1.7
        if got:
            cells[f"decode batch {batch}: {' and '.join(fmts)} weights >= {goal} bf16 tokens/s"] = variant + ", ".join(
                got
            )
    return cells


def quality_source(folder: Path) -> str:
    """A serving-quality set's source line: what the weights cost trained checkpoints in held-out loss."""
    where = "RESULTS.md, Serving a trained model with MX weights"
    return f"{source_line(quality_meta(folder), folder.name)}: what these weights cost in held-out loss ({where})."


def decode_section(paths: list[Path], quality: list[Path] = ()) -> list[str]:
    """benchmarks/bench_decode.py: a row per model, GPU and batch, bf16 and each MX format of the same run in its
    columns, a run with the output layer quantized too (``--quantize-output``) after the plain one's in a format's
    cell; the serving-quality sets' (``quality``) source lines under it."""
    serving = [quality_source(folder) for folder in quality]
    if not paths:
        return ["## Held-out loss with MX weights (`scripts/weight_quality.py`)", "", *serving, ""] if serving else []
    formats = ("mxfp8", "mxfp4", "nvfp4")
    rows: dict[tuple[str, str, int], list[str]] = {}
    runs = [(path, load(path)) for path in paths]
    for _, data in sorted(runs, key=lambda run: bool(run[1]["meta"].get("quantized_output"))):  # plain runs first
        meta = data["meta"]
        variant = "output layer too: " if meta.get("quantized_output") else ""
        model = f"{meta['model']} {meta['flavor']} ({meta['layers']} layers)"
        at = {(r["batch"], r["weights"]): r for r in data["rows"] if r["mode"] == "decode"}
        for batch in sorted({b for b, _ in at}):
            cells = rows.setdefault((model, device_name(meta), batch), [""] * (1 + len(formats)))
            base = at.get((batch, "bf16"))
            if base and not variant:
                cells[0] = f"{base['ms']:.3f} ms, {base['pct_of_bound']:.1f}%"
            for i, f in enumerate(formats, 1):
                if (batch, f) in at:
                    got = f"{variant}{at[batch, f]['vs_bf16']:.2f}x, {at[batch, f]['pct_of_bound']:.1f}%"
                    cells[i] = "; ".join(filter(None, [cells[i], got]))
    devices = ", ".join(dict.fromkeys(device_name(data["meta"]) for _, data in runs))
    lines = [f"## Decode with MX weights (`benchmarks/bench_decode.py`), {devices}", ""]
    lines += [
        "One decode step of the whole model from a CUDA graph: bf16's time, and each format's tokens/s against bf16",
        "in the same run; each with its share of the HBM-bandwidth bound (the bytes a step must read: weights, the",
        "whole KV cache, at the copy bandwidth measured in the run). The output layer is bf16 but where a cell says.",
        "",
    ]
    body = [[model, device, str(batch), *cells] for (model, device, batch), cells in rows.items()]
    lines += table(["model", "GPU", "batch", "bf16", *formats], body)
    return lines + sources([(data["meta"], path.name) for path, data in runs])[:-1] + serving + [""]


def observe_section(paths: list[Path]) -> list[str]:
    """scripts/roofline.py --observe: our casts and GEMMs against the roofline of the same device."""
    lines = []
    for path in paths:
        data = load(path)
        meta = data["meta"]
        ops: dict[tuple[str, str], list[float]] = {}
        for r in data["rows"]:
            ops.setdefault((r["kind"], r["op"]), []).append(r["pct_of_copy_roofline"] / 100)
        ratios: dict[str, dict[str, list[float]]] = {}
        for r in data["ratios"]:
            ratios.setdefault(r["kind"], {"measured": [], "roofline": []})
            ratios[r["kind"]]["measured"].append(r["measured"])
            ratios[r["kind"]]["roofline"].append(r["roofline"])
        rows = [[kind, op, span(v)] for (kind, op), v in ops.items()]
        lines += [f"## Observed against the roofline (`scripts/roofline.py --observe`), {column_name(meta)}", ""]
        lines += [
            f"Roofline time over measured time on the same device ({meta['elem']}, {meta['mode']}), memory-bound ops",
            f"at the copy bandwidth measured in the run ({meta['copy_gbs']:,.0f} GB/s); the range over the shapes the",
            "JSON lists (16384^2 and Llama 3 8B sizes for the casts and GEMMs, expert weights for the 3D casts).",
            "",
        ]
        lines += table(["kind", "op", "of the roofline"], rows)
        lines += [""] + [
            f"MX time over bf16 time, {kind}: measured {span(v['measured'], '{:.2f}x')}, "
            f"roofline {span(v['roofline'], '{:.2f}x')}."
            for kind, v in ratios.items()
        ]
        lines += sources([(meta, path.name)])
    return lines


def projection_section() -> list[str]:
    """The B200 projection's summary, as scripts/roofline.py generated it into docs/ROOFLINE.md."""
    text = ROOFLINE_DOC.read_text()
    summary = text.split("### Summary", 1)[1].split("\n### ", 1)[0].strip()
    return [
        "## Projected on B200 (roofline model, not a measurement)",
        "",
        summary,
        "",
        "Assumptions, per-layer tables and the plot: [ROOFLINE.md](ROOFLINE.md).",
        "",
    ]


def latest_results() -> dict[str, list[Path]]:
    """The result files by benchmark; each benchmark, device and variant must have one file (the latest: older
    runs stay in git history), which ``check_one_per_kind`` enforces."""
    kinds = {"bench_cast": "*_bench_cast*.json", "bench_gemm": "*_bench_gemm.json"}
    kinds |= {"bench_linear": "*_bench_linear*.json", "bench_moe": "*_bench_moe.json"}
    kinds |= {"bench_fp4_cast": "*_bench_fp4_cast.json"}
    kinds |= {"bench_host": "*_bench_host.json", "bench_train": "*_bench_train_*.json"}
    kinds |= {"observe": "*_roofline_observe.json", "bench_decode": "*_bench_decode*.json"}
    found = {kind: sorted(RESULTS.glob(pattern)) for kind, pattern in kinds.items()}
    runs = (p for p in RESULTS.iterdir() if p.is_dir() and ("_train_" in p.name or "_parity_" in p.name))
    found["train"] = sorted(runs)
    found["torchtitan"] = sorted(p for p in RESULTS.iterdir() if p.is_dir() and p.name.endswith("_torchtitan"))
    found["weight_quality"] = quality_folders(RESULTS)
    return found


def check_one_per_kind(results: dict[str, list[Path]]) -> None:
    """Raise if two files hold the same benchmark on the same device (their names differ only in the date)."""
    seen: dict[str, str] = {}
    for path in (p for paths in results.values() for p in paths):
        kind = path.name.split("_", 1)[1]
        if kind in seen:
            raise SystemExit(f"{RESULTS}: {seen[kind]} and {path.name} hold the same run kind; keep the latest")
        seen[kind] = path.name


SECTIONS = dict(
    bench_cast=cast_section,
    bench_fp4_cast=fp4_cast_section,
    bench_gemm=gemm_section,
    bench_linear=linear_section,
    bench_moe=moe_section,
    bench_host=host_section,
    bench_train=bench_train_section,
    train=runs_section,
    torchtitan=torchtitan_section,
    bench_decode=decode_section,
    observe=observe_section,
)


def render() -> str:
    results = latest_results()
    check_one_per_kind(results)
    lines: list[str] = targets_section(results) + projection_section()
    sections = SECTIONS | {"bench_decode": functools.partial(decode_section, quality=results["weight_quality"])}
    for kind, section in sections.items():
        lines += section(results[kind])
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"replace the part between the markers in {DOC}")
    args = parser.parse_args()
    generated = render()
    if not args.write:
        print(generated, end="")
        return
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOC}: the markers {BEGIN} and {END} are missing")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{generated}{END}{tail}")
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
