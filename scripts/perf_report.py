"""Render the measured tables of docs/PERFORMANCE.md from the result files in docs/results/.

Every figure in that document comes from a file a benchmark or a training run wrote:
``*_bench_cast.json`` (scripts/bench_cast.py), ``*_bench_gemm.json`` (scripts/bench_gemm.py),
``*_bench_linear.json`` (scripts/bench_linear.py), ``*_bench_moe.json`` (scripts/bench_moe.py) and
``*_train_*/`` folders holding a ``meta.json`` and one ``metrics.jsonl`` per run (train.py).

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
    return f"Source: `docs/results/{name}`: {when}.{note}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]


def cast_section(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    meta = data["meta"]
    kernels = "kernel_us" in data["results"][0]  # runs since the kernel-time columns were added

    def row(r: dict) -> list[str]:
        cells = [r["name"], "x".join(map(str, r["shape"])), r["mode"], f"{r['us']:.1f}", f"{r['gbs']:.0f}"]
        cells.append(f"{r['pct_copy']:.1f}%")
        if kernels:
            cells += [f"{r['kernel_us']:.1f}", f"{r['kernel_pct_copy']:.1f}%"]
        ref = r.get("speedup_vs_compiled_ref")
        return cells + ["" if ref is None else f"{ref:.2f}x"]

    copy = f"copy bandwidth {meta['copy_gbs']:.0f} GB/s"
    if kernels:
        copy += f" (events), {meta['copy_kernel_gbs']:.0f} GB/s (kernel)"
    header = ["cast", "shape", "rule", "time (us)", "GB/s", "% of copy"]
    header += ["kernels (us)", "% of copy (kernels)"] if kernels else []
    lines = [f"### MX casts, {meta['elem']}, bf16 input ({copy}, same run)", ""]
    lines += table(header + ["vs torch.compile reference"], [row(r) for r in data["results"]])
    lines += ["", "Targets as the benchmark judged them:", ""] + [f"- {t}" for t in data.get("targets", [])]
    if data.get("host"):
        lines += ["", "Host time of one call, [256, 256] bf16 input (the GPU waits on the host):", ""]
        header = ["call", "host (us)", "launch cache off (us)", "torch x.to(fp8) (us)", "host / torch"]
        lines += table(header, [host_row(r) for r in data["host"]])
    return lines + ["", source_line(meta, path.name), ""]


def host_row(r: dict) -> list[str]:
    cells = [r["name"], f"{r['host_us']:.1f}", f"{r['host_us_no_launch_cache']:.1f}", f"{r['torch_fp8_us']:.1f}"]
    return cells + [f"{r['host_us'] / r['torch_fp8_us']:.1f}x"]


GEMM_TITLES = {  # scripts/bench_gemm.py's backend names
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
    header = ["M", "K", "N", "bf16 ms", "MX ms", "MX/bf16 (target <= 1.10x)", "bf16 TFLOP/s", "bf16 peak GiB"]
    header += ["MX peak GiB"]
    if "mx_fuse_ms" in data["rows"][0]:  # MX with fuse_x_casts, in runs that timed it
        header += ["MX fuse_x_casts ms", "fuse_x_casts/bf16", "fuse_x_casts peak GiB"]
        for row, r in zip(rows, data["rows"], strict=True):
            row += [f"{r['mx_fuse_ms']:.3f}", f"{r['mx_fuse_ratio']:.2f}x", f"{r['mx_fuse_peak_gib']:.2f}"]
    if "kernel_ratio" in data["rows"][0]:  # runs timed in interleaved rounds (bench_timing.py)
        header += ["MX/bf16 GPU kernel time", "rounds spread"]
        for row, r in zip(rows, data["rows"], strict=True):
            row += [f"{r['kernel_ratio']:.2f}x", f"{r['round_spread']:.1%}"]
    how = "torch.compile'd" if meta.get("compiled", True) else "eager"
    lines = [f"### MX linear forward + backward, {meta['recipe']} against bf16 nn.Linear (both {how})", ""]
    lines += table(header, rows)
    return lines + ["", source_line(meta, path.name), ""]


def moe_section(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    meta, keys = data["meta"], list(data["rows"][0])  # the seed's columns, in bench_moe.py's order

    def fmt(key: str, value) -> str:
        if key.endswith("speedup"):
            return f"{value:.3f}x"
        if key.endswith("spread"):
            return f"{value:.1%}"
        return f"{value:.1f}" if isinstance(value, float) else value

    ratio = lambda r, side: r[f"scaled_{side}_us"] / r[f"bf16_{side}_us"]
    rows = [[fmt(k, r[k]) for k in keys] + [f"{ratio(r, 'e2e'):.2f}x"] for r in data["rows"]]
    extra = ["MX/bf16 e2e time (target <= 1.15x)"]
    if "bf16_e2e_kernel_us" in keys:  # runs timed in interleaved rounds (bench_timing.py)
        extra.append("MX/bf16 e2e GPU kernel time")
        for row, r in zip(rows, data["rows"], strict=True):
            row.append(f"{ratio(r, 'e2e_kernel'):.2f}x")
    lines = ["### MoE grouped GEMM, the seed's table (e2e = forward + backward; both sides torch.compile'd)", ""]
    lines += table(keys + extra, rows)
    return lines + ["", source_line(meta, path.name), ""]


def run_summary(run: Path) -> list[str]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if "loss" in r]
    steady = [r["tokens_per_sec"] for r in train if r["step"] > 1] or [train[-1]["tokens_per_sec"]]
    mfu = [r["mfu"] for r in train if r["step"] > 1 and r.get("mfu") is not None]
    return [
        run.name,
        str(train[-1]["step"]),
        f"{train[0]['loss']:.4f}",
        f"{train[-1]['loss']:.4f}",
        f"{statistics.median(steady):,.0f}",
        f"{statistics.median(mfu):.1f}%" if mfu else "n/a",
        f"{max(r['memory_gib'] for r in train):.2f}",
    ]


def train_section(folder: Path) -> list[str]:
    meta = json.loads((folder / "meta.json").read_text())
    runs = sorted(p for p in folder.iterdir() if (p / "metrics.jsonl").is_file())
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


def render() -> str:
    lines: list[str] = projection_section()
    for path in sorted(RESULTS.glob("*_roofline_observe.json")):
        lines += observe_section(path)
    for path in sorted(RESULTS.glob("*_bench_cast.json")):
        lines += cast_section(path)
    for path in sorted(RESULTS.glob("*_bench_gemm.json")):
        lines += gemm_section(path)
    for path in sorted(RESULTS.glob("*_bench_linear.json")):
        lines += linear_section(path)
    for path in sorted(RESULTS.glob("*_bench_moe.json")):
        lines += moe_section(path)
    for folder in sorted(p for p in RESULTS.glob("*_train_*") if p.is_dir()):
        lines += train_section(folder)
    for folder in sorted(p for p in RESULTS.glob("*_parity_*") if p.is_dir()):
        lines += parity_section(folder)
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
