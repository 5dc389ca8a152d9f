"""Instructions per weight element in the K loop of the weight-only GEMM's decode kernels, offline.

Compiles ``_weight_only_fma_kernel`` (kernels/mx/weight_only.py, the small-M kernel) or, with ``--gluon``, the
Gluon tensor-core tile (kernels/gluon/weight_only_mma.py, 5-64 rows) for a CUDA arch without a GPU, disassembles
the cubin with Triton's nvdisasm and counts the SASS instructions of the kernel's K loop (the longest backward
branch), divided by the weight elements a thread upcasts an iteration (BLOCK_N * BLOCK_K / threads). For both
kernels the count is one cost among others: neither is bound by its instruction issue at decode (docs/DESIGN.md,
Performance targets). Also prints registers and local memory (spills) from cuobjdump, and with ``--show`` the
loop's instructions.

    PYTHONPATH=$PWD:$PWD/.pypath python scripts/sass_loop_count.py [mxfp8 mxfp4 nvfp4] [--show] [--arch 90] [--unit 8]
    PYTHONPATH=$PWD:$PWD/.pypath python scripts/sass_loop_count.py --gluon [--rows 8,32] [--warps 4,8]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter

import torch
import triton
from mx_kernels.gluon.common import compile_for_arch
from mx_kernels.mx import weight_only as wo

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# the distinct (BLOCK_N, BLOCK_K, num_warps) of the kernel's chosen configs
CONFIGS = sorted({(c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["UNIT"]) for c in wo.FMA_CHOSEN.values()})


def launch_kwargs(fmt: str, m: int, n: int, k: int, cfg: dict, split_k: int | None = 1) -> dict:
    """The kernel's keyword arguments for a GEMM of these sizes, as ``_fma_mm`` builds them (meta tensors)."""
    group, pack = wo.FORMATS[fmt]
    x = torch.empty(m, k, dtype=torch.bfloat16, device="meta")
    q = torch.empty(n, k // pack, dtype=torch.uint8, device="meta")
    s = torch.empty(n, k // group, dtype=torch.uint8, device="meta")
    ts = torch.empty(1, dtype=torch.float32, device="meta") if fmt == "nvfp4" else None
    out = torch.empty(m, n, dtype=torch.bfloat16, device="meta")
    got = {}
    launch = wo._FMA_LAUNCHES.launch
    wo._FMA_LAUNCHES.launch = lambda grid, kwargs: got.update(kwargs)
    try:
        wo._fma_mm(x, q, s, ts, fmt, None, None, out, cfg, split_k)
    finally:
        wo._FMA_LAUNCHES.launch = launch
    return got


def _tool(name: str, cubin: bytes, *args: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([os.path.join(BIN, name), *args, f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


def loop_body(sass: str) -> list[str]:
    """The instructions of the longest backward branch's loop."""
    instrs, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
        found = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if found:
            addr = int(found.group(1), 16)
            labels.update({p: len(instrs) for p in pending})
            pending = []
            instrs.append((addr, found.group(2).strip()))
    best: list[str] = []
    for i, (_, op) in enumerate(instrs):
        target = re.search(r"BRA\s.*\((\.L_x_\d+)\)", op)
        if target and labels.get(target.group(1), i + 1) <= i and i + 1 - labels[target.group(1)] > len(best):
            best = [o for _, o in instrs[labels[target.group(1)] : i + 1]]
    return best


def report(fmt: str, block_n: int, block_k: int, warps: int, m: int, arch: int, show: bool, unit: int = 4) -> None:
    block_k = max(block_k, 64 * unit * warps)  # a unit per thread of each row at least (the kernel's layout)
    kwargs = launch_kwargs(fmt, m, 14336, 4096, wo._fma(block_n, block_k, None, warps, unit=unit))
    cubin = compile_for_arch(wo._weight_only_fma_kernel, kwargs, arch).asm["cubin"]
    label = f"{fmt} M={m} BLOCK_N={kwargs['BLOCK_N']} BLOCK_K={block_k} warps={warps} UNIT={unit}"
    print_loop(label, cubin, kwargs["BLOCK_N"] * kwargs["BLOCK_K"] / (32 * warps), show)


def gluon_report(fmt: str, warps: int, m: int, arch: int, show: bool, n: int = 14336, k: int = 4096) -> None:
    """The Gluon tile's loop at M rows, one split, launched as ``wgmma_weight_only`` launches it."""
    from mx_kernels.gluon.weight_only_mma import BLOCK_K, weight_only_wgmma_kernel

    group, pack = wo.FORMATS[fmt]
    meta = dict(device="meta")
    kwargs = dict(
        x_ptr=torch.empty(m, k, dtype=torch.bfloat16, **meta),
        w_ptr=torch.empty(n, k // pack, dtype=torch.uint8, **meta),
        s_ptr=torch.empty(n, k // group, dtype=torch.uint8, **meta),
        ts_ptr=torch.empty(1, dtype=torch.float32, **meta),
        out_ptr=torch.empty(m, n, dtype=torch.bfloat16, **meta),
        ws_ptr=torch.empty(1, dtype=torch.float32, **meta),
        cnt_ptr=torch.empty(1, dtype=torch.int32, **meta),
        M=m, N=n, K=k, K_SPLIT=k, SPLIT_K=1, stride_xm=k, stride_wn=k // pack, stride_sn=k // group, stride_tn=0,
        stride_om=n, FMT=fmt, BLOCK_M=max(8, triton.next_power_of_2(m)), NUM_WARPS=warps, SPLIT=False, UNROLL=0,
        num_warps=warps,
    )  # fmt: skip
    cubin = compile_for_arch(weight_only_wgmma_kernel, kwargs, arch).asm["cubin"]
    print_loop(f"gluon {fmt} M={m} warps={warps}", cubin, 16 * warps * BLOCK_K.value / (32 * warps), show)


def loop_instructions(cubin: bytes) -> list[str]:
    """The SASS instructions of a cubin's K loop (its longest backward branch)."""
    return loop_body(_tool("nvdisasm", cubin, "-c"))


def print_loop(label: str, cubin: bytes, elems: float, show: bool) -> None:
    """The K loop's instruction count over ``elems`` (weight elements a thread upcasts an iteration), registers,
    spills and the opcode histogram."""
    body = loop_instructions(cubin)
    res = dict(re.findall(r"\b(REG|LOCAL):(\d+)", _tool("cuobjdump", cubin, "-res-usage")))
    ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", op).split()[0] for op in body)
    print(f"{label}: {len(body)} instructions, {elems:.0f} weight elements -> {len(body) / elems:.2f} an element; "
          f"REG {res.get('REG')} LOCAL {res.get('LOCAL')}")  # fmt: skip
    print("   ", " ".join(f"{op}:{count}" for op, count in ops.most_common()))
    if show:
        print("\n".join(f"      {op}" for op in body))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("formats", nargs="*", default=list(wo.FORMATS))
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--gluon", action="store_true", help="the Gluon tensor-core tile, not the small-M kernel")
    parser.add_argument("--rows", help="rows of x (M), comma-separated (default 1,4; 8,32 with --gluon)")
    parser.add_argument("--warps", default="4,8", help="the Gluon tile's warps, comma-separated (4 or 8)")
    parser.add_argument("--show", action="store_true", help="print the loop's instructions")
    parser.add_argument("--unit", type=int, choices=(4, 8),
                        help="pairs a thread sums per scale multiply (default: each chosen config's)")  # fmt: skip
    args = parser.parse_args()
    rows = [int(m) for m in (args.rows or ("8,32" if args.gluon else "1,4")).split(",")]
    for fmt in args.formats:
        if args.gluon:
            for warps in map(int, args.warps.split(",")):
                for m in rows:
                    gluon_report(fmt, warps, m, args.arch, args.show)
            continue
        for block_n, block_k, warps, unit in CONFIGS:
            for m in rows:
                report(fmt, block_n, block_k, warps, m, args.arch, args.show, args.unit or unit)


if __name__ == "__main__":
    main()
