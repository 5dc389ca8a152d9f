"""Render the measured tables of docs/PERFORMANCE.md from the result files in docs/results/.

Every figure in that document comes from a file a benchmark or a training run wrote:
``*_bench_cast.json``, ``*_bench_fp4_cast.json``, ``*_bench_gemm.json``, ``*_bench_linear[_RECIPE].json``,
``*_bench_moe.json``,
``*_bench_host.json``, ``*_bench_train_CONFIG.json`` (benchmarks/),
``*_roofline_observe.json`` (scripts/roofline.py --observe), ``*_train_*/`` folders holding a ``meta.json``
and one ``metrics.jsonl`` per run (train.py) and ``*_parity_*/`` sets (scripts/parity_sweep.py). One file per
benchmark, device and variant: the latest (older ones stay in git history).

    python scripts/perf_report.py            # print the tables
    python scripts/perf_report.py --write    # replace the generated part of docs/PERFORMANCE.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
DOC = ROOT / "docs" / "PERFORMANCE.md"
ROOFLINE_DOC = ROOT / "docs" / "ROOFLINE.md"
BEGIN, END = "<!-- perf_report: begin -->", "<!-- perf_report: end -->"


def source_line(meta: dict, name: str) -> str:
    when = f"{meta['device']}, torch {meta['torch']}, {meta['date'][:10]}, commit {meta['commit'][:7]}"
    note = f" {meta['note']}." if meta.get("note") else ""
    command = f" Command: `{meta['command']}`." if meta.get("command") else ""
    return f"Source: `docs/results/{name}`: {when}.{command}{note}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]


def device_of(path: Path) -> str:
    """The device tag of a result file's name (DATE_DEVICE_...): h200, h100, h200x4."""
    return path.name.split("_")[1]


def is_cast(r: dict) -> bool:
    """An MX cast that the cast targets judge (not a fake-quant, a copy or a pair of separate casts)."""
    return not r["name"].startswith(("fq", "copy")) and "separate" not in r["name"]


def cast_section(path: Path) -> list[str]:
    """One row per cast and shape: kernel time and % of copy under both scale rules, and the events figure
    (which holds the host's launch path where it is slower than the kernels)."""
    data = json.loads(path.read_text())
    meta = data["meta"]
    by_key: dict[tuple, dict] = {}
    for r in data["results"]:
        by_key.setdefault((r["name"], tuple(r["shape"])), {})[r["mode"]] = r
    compiled = any(r.get("speedup_vs_compiled_ref") for r in data["results"])
    rows = []
    for (name, shape), modes in by_key.items():
        first = next(iter(modes.values()))
        cells = [name, "x".join(map(str, shape))]
        for mode in ("floor", "rceil"):
            r = modes.get(mode, modes.get("-") if mode == "floor" else None)
            cells.append(f"{r['kernel_us']:.1f} ({r['kernel_pct_copy']:.1f}%)" if r else "")
        cells.append(f"{first['us']:.1f} ({first['pct_copy']:.1f}%)")
        if compiled:
            ref = first.get("speedup_vs_compiled_ref")
            cells.append("" if ref is None else f"{ref:.2f}x")
        rows.append(cells)
    copy = f"copy {meta['copy_kernel_gbs']:.0f} GB/s kernel time, {meta['copy_gbs']:.0f} GB/s events"
    lines = [f"### MX casts, {meta['device']}, {meta['elem']}, bf16 input ({copy}, same run)", ""]
    header = ["cast", "shape", "floor: kernels us (% of copy)", "rceil: kernels us (% of copy)"]
    header += ["events us (% of copy)"] + (["vs torch.compile reference"] if compiled else [])
    lines += table(header, rows)
    lines += [""] + [f"{t[0].upper()}{t[1:]}." for t in data.get("targets", []) if t.startswith("fake-quant fused")]
    return lines + ["", source_line(meta, path.name), ""]


def cast_targets(path: Path) -> dict[str, str]:
    """The cast targets of docs/DESIGN.md (Performance targets) judged on kernel time, one cell each. The e2m1
    casts (``bench_cast.py --elem e2m1``) have the 4-bit target alone: 85% of copy."""
    data = json.loads(path.read_text())
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
            summary = json.loads((folder / "summary.json").read_text())
            name = folder.name.split("_parity_", 1)[1]
            for r in summary["runs"]:
                if r["mx_recipe"].startswith("mxfp8"):
                    cells.setdefault(device, []).append(f"{name} {r['mx_recipe']} {r['tokens_per_sec_ratio']:.3f}x")
        else:
            speed = {run.name: median_tokens_per_sec(train_records(run)) for run in runs_of(folder)}
            for name, tokens in speed.items():
                if name.endswith("_mxfp8") and name.replace("_mxfp8", "_bf16") in speed:
                    ratio = tokens / speed[name.replace("_mxfp8", "_bf16")]
                    cells.setdefault(device, []).append(f"{name.removesuffix('_mxfp8')} {ratio:.3f}x")
    return cells


def targets_section(results: dict[str, list[Path]]) -> list[str]:
    """Where each Hopper target stands, per device, computed from the latest result files below."""
    devices = sorted({device_of(p) for paths in results.values() for p in paths})
    cells: dict[str, dict[str, str]] = {}
    for path in results["bench_cast"]:
        for target, cell in cast_targets(path).items():
            cells.setdefault(target, {})[device_of(path)] = cell
    for path in results["bench_linear"]:
        data = json.loads(path.read_text())
        ratios, recipe = [r["ratio"] for r in data["rows"]], data["meta"]["recipe"]
        target = f"MX linear fwd+bwd <= 1.15x bf16 ({recipe})" if "fp4" in recipe else "MX linear fwd+bwd <= 1.10x bf16"
        cells.setdefault(target, {})[device_of(path)] = f"{min(ratios):.2f}-{max(ratios):.2f}x"
    for path in results["bench_fp4_cast"]:
        shares = [r["of_copy"] for r in json.loads(path.read_text())["rows"]]
        share = f"{min(shares):.0%}-{max(shares):.0%} (each kernel, of the bytes it moves)"
        cells.setdefault("4-bit cast and fake-quant kernels >= 85% of copy", {})[device_of(path)] = share
    for path in results["bench_moe"]:
        data = json.loads(path.read_text())
        ratios = ", ".join(
            f"E={r['B_shape'].strip('()').split(',')[0]} {r['scaled_e2e_us'] / r['bf16_e2e_us']:.2f}x"
            for r in data["rows"]
        )
        target = f"MX grouped GEMM fwd+bwd <= 1.15x bf16 ({data['meta']['recipe']})"
        cells.setdefault(target, {})[device_of(path)] = ratios
    for device, runs in training_targets(results["train"]).items():
        cells.setdefault("training step MXFP8 >= 0.90x bf16 tokens/s", {})[device] = "; ".join(runs)
    for path in results["bench_train"]:
        target = "bench_train: Llama MXFP8 >= 0.97x, MoE >= 0.90x bf16 tokens/s"
        by_device, device = cells.setdefault(target, {}), device_of(path)
        by_device[device] = "; ".join(filter(None, [by_device.get(device), bench_train_targets(path)]))
    for path in results["bench_host"]:
        cells.setdefault("host time of one MX cast or fake-quant call <= 20 us", {})[device_of(path)] = host_targets(
            path
        )
    rows = [[target, *(by_device.get(d, "") for d in devices)] for target, by_device in cells.items()]
    lines = ["## The targets, from the latest runs", ""]
    return lines + table(["target", *devices], rows) + [""]


GEMM_TITLES = {  # benchmarks/bench_gemm.py's backend names
    "emulated": "emulated (dequantize + mm)",
    "emulated_mm": "emulated, mm alone",
    "triton": "triton dot_scaled",
    "cublas": "cublas",
}


def gemm_section(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    meta, backends = data["meta"], data["backends"]
    rows = []
    for r in data["rows"]:
        cells = [
            f"{r['mx'][b]['tflops']:.0f} ({r['mx'][b]['ratio']:.2f}x)" if b in r["mx"] else "n/a" for b in backends
        ]
        rows.append([str(r["M"]), str(r["K"]), str(r["N"]), f"{r['bf16_tflops']:.0f}"] + cells)
    how = "under torch.compile" if meta.get("compiled", True) else "eager"
    lines = [f"### MX GEMM out = a @ b.T, {meta['elem']} ({meta['rule']}) operands, against bf16 torch.mm", ""]
    lines += [
        f"TFLOP/s, and in parentheses the time relative to bf16 from the same run. The emulated backend "
        f"dequantizes both operands to bf16, then multiplies ({how}).",
        "",
    ]
    lines += table(["M", "K", "N", "bf16 TFLOP/s"] + [f"{GEMM_TITLES.get(b, b)} TFLOP/s" for b in backends], rows)
    errors = [
        f"{GEMM_TITLES.get(b, b)} {max(r['mx'][b]['rel_err'] for r in data['rows'] if b in r['mx']):.1e}"
        for b in backends
    ]
    lines += ["", "Largest max |MX - emulated in fp32| / max |emulated| over the shapes: " + ", ".join(errors) + "."]
    return lines + ["", source_line(meta, path.name), ""]


def linear_section(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    meta = data["meta"]
    rows = [
        [
            str(r["M"]),
            str(r["K"]),
            str(r["N"]),
            f"{r['bf16_ms']:.3f}",
            f"{r['mx_ms']:.3f}",
            f"{r['ratio']:.2f}x",
            f"{r['bf16_tflops']:.0f}",
            f"{r['bf16_peak_gib']:.2f}",
            f"{r['mx_peak_gib']:.2f}",
        ]
        for r in data["rows"]
    ]
    target = "1.15x" if "fp4" in meta["recipe"] else "1.10x"  # the 4-bit recipes' target (DESIGN.md)
    header = ["M", "K", "N", "bf16 ms", "MX ms", f"MX/bf16 (target <= {target})", "bf16 TFLOP/s", "bf16 peak GiB"]
    header += ["MX peak GiB"]
    if "mx_fuse_ms" in data["rows"][0]:  # MX with fuse_x_casts, in runs that timed it
        header += ["MX fuse_x_casts ms", "fuse_x_casts/bf16", "fuse_x_casts peak GiB"]
        for row, r in zip(rows, data["rows"], strict=True):
            row += [f"{r['mx_fuse_ms']:.3f}", f"{r['mx_fuse_ratio']:.2f}x", f"{r['mx_fuse_peak_gib']:.2f}"]
    if "kernel_ratio" in data["rows"][0]:  # runs timed in interleaved rounds (benchmarks/timing.py)
        header += ["MX/bf16 GPU kernel time", "rounds spread"]
        for row, r in zip(rows, data["rows"], strict=True):
            row += [f"{r['kernel_ratio']:.2f}x", f"{r['round_spread']:.1%}"]
    how = "torch.compile'd" if meta.get("compiled", True) else "eager"
    title = f"MX linear forward + backward, {meta['recipe']} against bf16 nn.Linear (both {how}), {meta['device']}"
    lines = [f"### {title}", ""]
    lines += table(header, rows)
    return lines + ["", source_line(meta, path.name), ""]


def fp4_cast_section(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    meta, rows, last = data["meta"], [], None
    for r in data["rows"]:
        first = r["name"] != last
        share = r.get("call_of_copy_x_once")
        rows.append([
            r["name"] if first else "", f"{r['M']} x {r['K']}" if first else "", r.get("kernel", ""),
            f"{r['gpu_ms']:.3f}", f"{r['gbs']:.0f}", f"{r['of_copy']:.1%}",
            f"{share:.1%}" if first and share is not None else "",
        ])  # fmt: skip
        last = r["name"]
    lines = [f"### 4-bit casts and fake-quants, {meta['device']}, against a copy ({meta['copy_gbs']:.0f} GB/s)", ""]
    lines += [
        "Each kernel's bandwidth counts the bytes it moves: the NVFP4 maxima kernel reads x, the fake-quant reads",
        "x again and writes its outputs. The last column is the whole call's share of a copy's speed counting x",
        "once, which the format's second read caps at two thirds for a one-sided NVFP4 cast.",
    ]
    if any("packed" in r["name"] for r in data["rows"]):
        lines += [
            "The packed casts (codes and scales, the sm_100 GEMMs' operands) count the bytes they write;",
            "an `_unblock_kernel` (plain scales from blocked ones) counts the scales it reads and writes.",
        ]
    lines += [""]
    header = ["operand", "x (bf16)", "kernel", "GPU ms", "GB/s", "of copy (target >= 85%)", "call, x once"]
    lines += table(header, rows)
    return lines + ["", source_line(meta, path.name), ""]


def moe_section(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    meta, keys = data["meta"], list(data["rows"][0])  # bench_moe.py's columns, in its order

    def fmt(key: str, value) -> str:
        if key.endswith("speedup"):
            return f"{value:.3f}x"
        if key.endswith("spread"):
            return f"{value:.1%}"
        return f"{value:.1f}" if isinstance(value, float) else value

    ratio = lambda r, side: r[f"scaled_{side}_us"] / r[f"bf16_{side}_us"]
    rows = [[fmt(k, r[k]) for k in keys] + [f"{ratio(r, 'e2e'):.2f}x"] for r in data["rows"]]
    extra = ["MX/bf16 e2e time (target <= 1.15x)"]
    if "bf16_e2e_kernel_us" in keys:  # runs timed in interleaved rounds (benchmarks/timing.py)
        extra.append("MX/bf16 e2e GPU kernel time")
        for row, r in zip(rows, data["rows"], strict=True):
            row.append(f"{ratio(r, 'e2e_kernel'):.2f}x")
    title = f"### MoE grouped GEMM, {meta['recipe']} against bf16 (e2e = forward + backward; both torch.compile'd)"
    lines = [title, ""]
    lines += table(keys + extra, rows)
    return lines + ["", source_line(meta, path.name), ""]


def host_section(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    meta = data["meta"]
    ratio = lambda r: f"{r['host_us'] / r['torch_us']:.1f}x"  # noqa: E731
    rows = [[r["name"], f"{r['host_us']:.1f}", r["torch_op"], f"{r['torch_us']:.1f}", ratio(r)] for r in data["rows"]]
    lines = [f"### Host time of one MX call, {meta['shape']} bf16 input (the GPU waits on the host)", ""]
    lines += table(["call", "host (us)", "torch's op", "torch (us)", "MX / torch"], rows)
    return lines + ["", source_line(meta, path.name), ""]


def host_targets(path: Path) -> str:
    """Host time per call by family: the fake-quants (the emulated path), the casts with blocked scales (the
    sm_100 path) and those with plain scales (the triton backend's), public and as compiled code calls them."""
    rows = [r for r in json.loads(path.read_text())["rows"] if r["torch_op"] != "bf16"]  # not the layers
    families: dict[str, list[float]] = {"fake-quant": [], "blocked cast": [], "plain-scale cast": []}
    for r in rows:
        name = r["name"]
        family = "fake-quant" if "fake" in name else "blocked cast" if "blocked" in name else "plain-scale cast"
        families[family].append(r["host_us"])
    return "; ".join(f"{name} {min(us):.0f}-{max(us):.0f} us" for name, us in families.items() if us)


def bench_train_section(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    meta, rows = data["meta"], data["rows"]
    lines = [f"### Training steps, {meta['config']} ({meta['layers']} blocks), MX against bf16 in one run", ""]
    lines += table(
        ["recipe", "tokens/s", "ratio to bf16", "MFU", "peak memory (GiB)", "rounds spread", "last loss"],
        [
            [
                r["recipe"], f"{r['tokens_per_sec']:,.0f}", f"{r['ratio']:.3f}x",
                "n/a" if r["mfu"] is None else f"{r['mfu']:.1f}%",
                "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}", f"{r['rounds_spread']:.1%}",
                f"{r['last_loss']:.4f}",
            ]
            for r in rows
        ],
    )  # fmt: skip
    if all("profile_ms_per_step" in r for r in rows):
        kinds = list(rows[0]["profile_ms_per_step"])
        lines += ["", "GPU time per step by kernel kind (ms, torch.profiler; GPU idle: the GPU waits on the host):", ""]
        profile = [[kind, *(f"{r['profile_ms_per_step'][kind]:.1f}" for r in rows)] for kind in kinds]
        profile.append(["step", *(f"{sum(r['profile_ms_per_step'].values()):.1f}" for r in rows)])
        lines += table(["kind", *(r["recipe"] for r in rows)], profile)
    return lines + ["", source_line(meta, path.name), ""]


def bench_train_targets(path: Path) -> str:
    data = json.loads(path.read_text())
    name = f"{data['meta']['config']} ({data['meta']['layers']} blocks)"
    return ", ".join(f"{name} {r['recipe']} {r['ratio']:.3f}x" for r in data["rows"][1:])


def train_records(run: Path) -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if "loss" in r]


def median_tokens_per_sec(train: list[dict]) -> float:
    """Over the steps after the first (compilation), or the last step where there is only one."""
    return statistics.median([r["tokens_per_sec"] for r in train if r["step"] > 1] or [train[-1]["tokens_per_sec"]])


def run_summary(run: Path) -> list[str]:
    train = train_records(run)
    mfu = [r["mfu"] for r in train if r["step"] > 1 and r.get("mfu") is not None]
    return [
        run.name,
        str(train[-1]["step"]),
        f"{train[0]['loss']:.4f}",
        f"{train[-1]['loss']:.4f}",
        f"{median_tokens_per_sec(train):,.0f}",
        f"{statistics.median(mfu):.1f}%" if mfu else "n/a",
        f"{max(r['memory_gib'] for r in train):.2f}",
    ]


def runs_of(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if (p / "metrics.jsonl").is_file())


def train_section(folder: Path) -> list[str]:
    meta = json.loads((folder / "meta.json").read_text())
    runs = runs_of(folder)
    lines = [f"### Training runs, MX casts: {meta['casts']}", ""]
    lines += table(
        ["run", "steps", "loss at step 1", "final loss", "median tokens/s per GPU", "median MFU", "peak memory (GiB)"],
        [run_summary(r) for r in runs],
    )
    lines += ["", "Commands:", ""] + [f"- `{k}`: `{v}`" for k, v in meta["commands"].items()]
    return lines + ["", source_line(meta, folder.name), ""]


def parity_section(folder: Path) -> list[str]:
    """Throughput of a parity set (scripts/results_report.py writes its summary.json; RESULTS.md has the curves)."""
    meta = json.loads((folder / "meta.json").read_text())
    summary = json.loads((folder / "summary.json").read_text())
    name = folder.name.split("_parity_", 1)[1]
    rows = [
        [
            r["label"],
            str(r["last_step"]),
            f"{r['median_tokens_per_sec']:,.0f}",
            "1.000x" if r["is_baseline"] else f"{r['tokens_per_sec_ratio']:.3f}x",
            f"{r['peak_memory_gib']:.2f}",
            "baseline" if r["is_baseline"] else f"{r['rel_delta']:+.2%}",
        ]
        for r in summary["runs"]
    ]
    lines = [f"### Parity runs, {name}: tokens/s against bf16 (curves in [RESULTS.md](RESULTS.md))", ""]
    lines += table(
        ["run", "steps", "median tokens/s per GPU", "ratio to bf16", "peak memory (GiB)", "final val loss"], rows
    )
    return lines + ["", f"Command: `{meta['commands']['all']}`", "", source_line(meta, folder.name), ""]


def observe_section(path: Path) -> list[str]:
    """scripts/roofline.py --observe: our casts and GEMMs, measured against the roofline of the same device."""
    data = json.loads(path.read_text())
    meta = data["meta"]
    rows = [
        [
            r["kind"],
            r["op"],
            "x".join(map(str, r["shape"])),
            f"{r['measured_us']:.1f}",
            f"{r['roofline_us']:.1f}",
            f"{r['pct_of_roofline']:.1f}%",
            f"{r['pct_of_copy_roofline']:.1f}%",
            r["bound"],
        ]
        for r in data["rows"]
    ]
    lines = [f"### Observed against the roofline ({meta['roofline_device']} peaks; {meta['elem']}, {meta['mode']})", ""]
    lines += table(
        ["kind", "op", "shape", "measured (us)", "roofline (us)", "of roofline", "of copy roofline", "bound"], rows
    )
    lines += ["", "MX time / bf16 time, measured and by the roofline (same device):", ""]
    lines += table(
        ["kind", "shape", "measured", "roofline"],
        [
            [r["kind"], "x".join(map(str, r["shape"])), f"{r['measured']:.2f}x", f"{r['roofline']:.2f}x"]
            for r in data["ratios"]
        ],
    )
    note = (
        f" Roofline: published dense peaks and the measured copy bandwidth ({meta['copy_gbs']:,.0f} GB/s);"
        " 'of copy roofline' sets memory-bound ops against that copy rate instead of the datasheet bandwidth."
    )
    return lines + ["", f"Command: `{meta['command']}`.{note}", "", source_line(meta, path.name), ""]


def projection_section() -> list[str]:
    """The B200 projection's summary, as scripts/roofline.py generated it into docs/ROOFLINE.md."""
    text = ROOFLINE_DOC.read_text()
    summary = text.split("### Summary", 1)[1].split("\n### ", 1)[0].strip()
    return [
        "### Projected (roofline model, not a measurement)",
        "",
        summary,
        "",
        "Assumptions, per-layer tables and the plot: [ROOFLINE.md](ROOFLINE.md) (`scripts/roofline.py`).",
        "",
        "![projected B200 speedup of an MX linear against M](roofline_speedup.png)",
        "",
    ]


def latest_results() -> dict[str, list[Path]]:
    """The result files by benchmark; each benchmark, device and variant must have one file (the latest: older
    runs stay in git history), which ``check_one_per_kind`` enforces."""
    kinds = {"bench_cast": "*_bench_cast*.json", "bench_gemm": "*_bench_gemm.json"}
    kinds |= {"bench_linear": "*_bench_linear*.json", "bench_moe": "*_bench_moe.json"}
    kinds |= {"bench_fp4_cast": "*_bench_fp4_cast.json"}
    kinds |= {"bench_host": "*_bench_host.json", "bench_train": "*_bench_train_*.json"}
    kinds |= {"observe": "*_roofline_observe.json"}
    found = {kind: sorted(RESULTS.glob(pattern)) for kind, pattern in kinds.items()}
    runs = (p for p in RESULTS.iterdir() if p.is_dir() and ("_train_" in p.name or "_parity_" in p.name))
    found["train"] = sorted(runs)
    return found


def check_one_per_kind(results: dict[str, list[Path]]) -> None:
    """Raise if two files hold the same benchmark on the same device (their names differ only in the date)."""
    seen: dict[str, str] = {}
    for path in (p for paths in results.values() for p in paths):
        kind = path.name.split("_", 1)[1]
        if kind in seen:
            raise SystemExit(f"{RESULTS}: {seen[kind]} and {path.name} hold the same run kind; keep the latest")
        seen[kind] = path.name


def render() -> str:
    results = latest_results()
    check_one_per_kind(results)
    lines: list[str] = targets_section(results) + ["## Measured", ""] + projection_section()
    sections = dict(observe=observe_section, bench_cast=cast_section, bench_fp4_cast=fp4_cast_section)
    sections |= dict(bench_gemm=gemm_section)
    sections |= dict(bench_linear=linear_section, bench_moe=moe_section, bench_host=host_section)
    sections |= dict(bench_train=bench_train_section)
    for kind, section in sections.items():
        for path in results[kind]:
            lines += section(path)
    for folder in results["train"]:
        lines += parity_section(folder) if "_parity_" in folder.name else train_section(folder)
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
