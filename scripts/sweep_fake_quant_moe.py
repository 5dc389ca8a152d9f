"""Tile sweep of the fake-quant kernel on the MoE shapes of bench_moe.py (GPU only).

Both outputs of fake_quant_2d on expert weights [E, 8192, 5120] (E = 64, 16), and
fake_quant_groups_along_m on g [16640, 8192] routed evenly to 64 groups (each quantized as if
padded to 32 rows, the result unpadded); prints per config the time, GB/s (bytes read + written) and % of
the copy bandwidth measured in the same run.

    python scripts/sweep_fake_quant_moe.py
"""

from __future__ import annotations

import mx_recipe  # noqa: F401  (first: importing mx_kernels before mx_recipe is circular)

# isort: split
import torch
import triton.testing
from mx_kernels.fake_quant_2d import fake_quant_2d, fake_quant_groups_along_m

CONFIGS = [(32, 128, 4), (32, 256, 4), (32, 256, 8), (64, 128, 4), (64, 128, 8), (64, 256, 8), (32, 64, 2),
           (128, 64, 4), (32, 512, 8)]  # fmt: skip


def us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    """GB/s (read + write) of a 1 GiB device copy."""
    src = torch.randn(2**28, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / us(lambda: dst.copy_(src)) / 1e3


def sweep(name: str, nbytes: int, copy_gbs: float, run) -> None:
    for bm, bk, nw in CONFIGS:
        cfg = dict(BLOCK_M=bm, BLOCK_K=bk, num_warps=nw)
        t = us(lambda cfg=cfg: run(cfg))
        print(f"{name} {cfg} {t:9.1f} us {nbytes / t / 1e3:6.0f} GB/s {nbytes / t / 1e3 / copy_gbs:6.1%}")


def main() -> None:
    copy_gbs = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()} copy {copy_gbs:.0f} GB/s")
    for experts in (64, 16):
        w = torch.randn(experts, 8192, 5120, device="cuda", dtype=torch.bfloat16) * 0.02
        sweep(
            f"3d both E={experts}",
            w.numel() * 2 * 3,
            copy_gbs,
            lambda c, w=w: fake_quant_2d(w, "e4m3", "floor", True, True, c),
        )
        del w
        torch.cuda.empty_cache()
    g = torch.randn(16640, 8192, device="cuda", dtype=torch.bfloat16)
    rows, start = [], 0
    for size in [16640 // 64] * 64:
        rows += list(range(start, start + size)) + [-1] * (-size % 32)
        start += size
    rows += [-1] * (16640 + 32 * 64 - len(rows))  # padded_group_layout's static buffer size
    row_src = torch.tensor(rows, dtype=torch.int32, device="cuda")
    nbytes = g.numel() * 2 * 2
    sweep("groups g", nbytes, copy_gbs, lambda c: fake_quant_groups_along_m(g, row_src, "e4m3", "floor", c))


if __name__ == "__main__":
    main()
