"""Host time of one MX call, against torch's own ops on the same input.

    python benchmarks/bench_host.py [--out FILE]

On a small input ([256, 256] bf16, 3 token groups) the GPU finishes each kernel long before the host
launches the next, so the time per call is the host's: argument checks, dispatch, the custom-op
boundary and the kernel launch. Rows:

* every public cast and fake-quant of ``mx_recipe.ops.mx_cast``, as a user calls it (eager);
* the custom ops as torch.compile's generated code calls them (``torch.ops.mx_recipe.*``): the host
  cost that remains inside a compiled block;
* an MX linear and an MX grouped GEMM, forward and backward, next to ``F.linear`` and
  ``torch._grouped_mm`` (the emulated backend: what a Hopper training step runs);
* the same for NVFP4: its fake-quants (the per-tensor maximum and the quantization, two kernels a call),
  its custom op, and the nvfp4 recipe's linear and grouped GEMM.

Baselines: ``x.to(torch.float8_e4m3fn)`` (one torch kernel launch) for the casts; bf16 forward and
backward for the layers. ``--out`` writes JSON with provenance for docs/results/.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from timing import host_us, require_cuda, run_meta

from mx_recipe import MXRecipe, mx_grouped_mm, mx_linear
from mx_recipe.cli import ArgumentParser, output_file
from mx_recipe.formats.nvfp4 import random_signs
from mx_recipe.formats.recipe import NVFP4Recipe
from mx_recipe.formats.scale_layout import group_row_sources, padded_group_layout
from mx_recipe.ops.backends import resolve_backend
from mx_recipe.ops.mx_cast import (
    cast_3d_dim1,
    cast_dim0,
    cast_dim0_dim1,
    cast_dim1,
    cast_groups_dim1,
    fake_quant_dim0,
    fake_quant_dim0_dim1,
    fake_quant_groups_along_m,
)
from mx_recipe.ops.nvfp4_fake_quant import fake_quant_nvfp4, fake_quant_nvfp4_groups


def cast_calls(x: torch.Tensor, offs: torch.Tensor, row_src: torch.Tensor) -> dict[str, Callable[[], object]]:
    w = x.unsqueeze(0)
    ops = torch.ops.mx_recipe
    return {
        "cast dim0": lambda: cast_dim0(x),
        "cast dim1 blocked": lambda: cast_dim1(x, blocked_scales=True),
        "cast dim0+dim1 fused": lambda: cast_dim0_dim1(x),
        "cast 3d dim1 blocked": lambda: cast_3d_dim1(w, blocked_scales=True),
        "cast groups dim1 blocked": lambda: cast_groups_dim1(x, offs, blocked_scales=True),
        "fake-quant dim0": lambda: fake_quant_dim0(x),
        "fake-quant dim0 + along M": lambda: fake_quant_dim0_dim1(x),
        "fake-quant groups along M": lambda: fake_quant_groups_along_m(x, row_src),
        "op cast_dim0 (compiled code)": lambda: ops.cast_dim0(x, "e4m3", "floor", False),
        "op fake_quant_2d (compiled code)": lambda: ops.fake_quant_2d(x, "e4m3", "floor", True, True),
        "op fake_quant_groups_along_m (compiled code)": lambda: ops.fake_quant_groups_along_m(
            x, "e4m3", "floor", row_src
        ),
    }


def nvfp4_calls(x: torch.Tensor, offs: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The NVFP4 fake-quants as the nvfp4 recipe calls them: x in forward, g in backward, token groups."""
    signs = random_signs(0, x.device)
    dest, _, size = padded_group_layout(offs, x.shape[0], 16)
    src = group_row_sources(dest, size)
    return {
        "nvfp4 fake-quant along K": lambda: fake_quant_nvfp4(x),
        "nvfp4 fake-quant along K + M, RHT (x)": lambda: fake_quant_nvfp4(x, along_m=True, signs=signs),
        "nvfp4 fake-quant along N + M, RHT, SR (g)": lambda: fake_quant_nvfp4(
            x, along_m=True, signs=signs, rounding="stochastic"
        ),
        "nvfp4 fake-quant token groups, RHT": lambda: fake_quant_nvfp4_groups(x, offs, dest, src, True, True, signs),
        "op fake_quant_nvfp4 (compiled code)": lambda: torch.ops.mx_recipe.fake_quant_nvfp4(
            x, True, True, False, signs, None
        ),
    }


def layer_calls(x: torch.Tensor, offs: torch.Tensor) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """(bf16, MX) forward + backward of a linear and of a grouped GEMM on x."""
    recipe, nvfp4 = MXRecipe.from_name("mxfp8"), NVFP4Recipe.from_name("nvfp4")
    w = torch.randn(256, 256, device=x.device, dtype=x.dtype, requires_grad=True)
    w3 = torch.randn(offs.numel(), 256, 256, device=x.device, dtype=x.dtype, requires_grad=True)
    xg = x.detach().requires_grad_()
    gy = torch.randn_like(x)  # a contiguous upstream gradient (sum()'s is expanded, which _grouped_mm refuses)
    dense, grouped = resolve_backend(recipe, x.device), resolve_backend(recipe, x.device, grouped=True)
    bf16_linear = lambda: F.linear(xg, w).backward(gy)  # noqa: E731
    bf16_grouped = lambda: torch._grouped_mm(xg, w3.transpose(-2, -1), offs=offs).backward(gy)  # noqa: E731
    return {
        "linear fwd+bwd": (bf16_linear, lambda: mx_linear(xg, w, None, recipe, dense).backward(gy)),
        "grouped GEMM fwd+bwd": (bf16_grouped, lambda: mx_grouped_mm(xg, w3, offs, recipe, grouped).backward(gy)),
        "nvfp4 linear fwd+bwd": (bf16_linear, lambda: mx_linear(xg, w, None, nvfp4).backward(gy)),
        "nvfp4 grouped GEMM fwd+bwd": (bf16_grouped, lambda: mx_grouped_mm(xg, w3, offs, nvfp4).backward(gy)),
    }


def main() -> None:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=output_file, help="write the rows as JSON here, with provenance")
    args = parser.parse_args()
    require_cuda("bench_host.py")
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([64, 128, 256], dtype=torch.int32, device="cuda")
    row_src = torch.arange(256, dtype=torch.int32, device="cuda")  # groups of multiples of 32: no padding
    device = torch.cuda.get_device_name()
    torch_fp8 = host_us(lambda: x.to(torch.float8_e4m3fn))
    print(f"device: {device}, torch {torch.__version__}; host time per call, [256, 256] bf16, e4m3 floor")
    print(f"{'torch x.to(float8_e4m3fn)':48s} {torch_fp8:7.1f} us")
    rows = []
    for name, call in (cast_calls(x, offs, row_src) | nvfp4_calls(x, offs)).items():
        us = host_us(call)
        rows.append(dict(name=name, host_us=us, torch_us=torch_fp8, torch_op="x.to(float8_e4m3fn)"))
        print(f"{name:48s} {us:7.1f} us  {us / torch_fp8:5.1f}x torch")
    for name, (bf16, mx) in layer_calls(x, offs).items():
        base, us = host_us(bf16), host_us(mx)
        rows.append(dict(name=name, host_us=us, torch_us=base, torch_op="bf16"))
        print(f"{name:48s} {us:7.1f} us  {us / base:5.1f}x bf16 ({base:.1f} us)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": run_meta(shape=[256, 256]), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
