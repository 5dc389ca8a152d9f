"""The packed NVFP4 cast, from one entry point: ``cast_nvfp4`` runs the Triton kernel
(``mx_kernels.nvfp4.casts.cast_nvfp4``) for bf16 on CUDA and the reference (``nvfp4.to_nvfp4``) otherwise;
both give the same bits (docs/DESIGN.md, "NVFP4").

It forms the operands of the cublas NVFP4 GEMMs (sm_100, ``NVFP4CublasBackend``): x [M, K] along K (1x16 blocks, or
16x16 tiles for the recipe's weights) and/or along M, stored transposed as the grad-weight GEMM reads it
([K, M_pad] quantized along its last dim, rows zero-padded to ``pad_m``, after the random Hadamard transform
along M when ``signs`` is given), reading x once on the GPU. Stochastic rounding draws as ``fake_quant_nvfp4``
does: the kernel from a Philox stream keyed by a seed drawn from ``generator`` on x's device, the reference
from ``generator`` itself.
"""

from __future__ import annotations

import torch
from mx_kernels.common import check_nvfp4
from torch import Tensor

from mx_recipe.formats.nvfp4 import NVFP4Tensor, to_nvfp4
from mx_recipe.library import define
from mx_recipe.ops.dispatch import draw_seed
from mx_recipe.ops.nvfp4_fake_quant import ROWS, TILES, along_m_input, uses_kernel


def reference_cast_nvfp4(
    x: Tensor, along_k: bool, along_m: bool, tiles: bool, signs: Tensor | None, rounding: str, pad_m: int,
    generator: torch.Generator | None = None, uniforms: tuple[Tensor | None, Tensor | None] = (None, None),
) -> tuple[NVFP4Tensor | None, NVFP4Tensor | None]:  # fmt: skip
    """The contract in plain PyTorch. ``uniforms``: the draws for along K ([M, K]) and along M ([K, M_pad])."""
    k = m = None
    if along_k:
        k = to_nvfp4(x, -1, block_shape=TILES if tiles else ROWS, rounding=rounding, generator=generator,
                     uniform=uniforms[0])  # fmt: skip
    if along_m:
        t = along_m_input(x, signs, pad_m)
        m = to_nvfp4(t.t().contiguous(), -1, rounding=rounding, generator=generator, uniform=uniforms[1])
    return k, m


def cast_nvfp4(
    x: Tensor, along_k: bool = True, along_m: bool = False, tiles: bool = False, signs: Tensor | None = None,
    rounding: str = "nearest", generator: torch.Generator | None = None, pad_m: int = 16,
) -> tuple[NVFP4Tensor | None, NVFP4Tensor | None]:  # fmt: skip
    """x [M, K] (K a multiple of 16; M too with ``tiles``; any strides) -> (x along K as an ``NVFP4Tensor``
    [M, K], x along M as one [K, M_pad], M_pad the next multiple of ``pad_m``), None for a side not asked for.
    ``tiles``: 16x16 scale tiles along K; ``signs``: fp32 [16], the random Hadamard transform along M first;
    ``rounding``: "nearest" or "stochastic"."""
    check_nvfp4(x, along_k, along_m, tiles, "cast_nvfp4", pad_m)
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"cast_nvfp4: rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if not uses_kernel(x):
        return reference_cast_nvfp4(x, along_k, along_m, tiles, signs, rounding, pad_m, generator)
    seed = draw_seed(x, generator) if rounding == "stochastic" else None
    q_k, scale_k, q_m, scale_m, s_dec = torch.ops.mx_recipe.cast_nvfp4(x, along_k, along_m, tiles, signs, seed, pad_m)
    k = NVFP4Tensor(q_k, scale_k, s_dec[0], 1, TILES if tiles else ROWS) if along_k else None
    m = NVFP4Tensor(q_m, scale_m, s_dec[1], 1, ROWS) if along_m else None
    return k, m


# --- the custom op: opaque to torch.compile, traced by its fake ---


def _kernel(x: Tensor, along_k: bool, along_m: bool, tiles: bool, signs: Tensor | None, seed: Tensor | None,
            pad_m: int):  # fmt: skip
    from mx_kernels.nvfp4.casts import cast_nvfp4 as launch

    return launch(x, along_k, along_m, tiles, signs, seed, pad_m)


def _fake(x: Tensor, along_k: bool, along_m: bool, tiles: bool, signs: Tensor | None, seed: Tensor | None,
          pad_m: int):  # fmt: skip
    check_nvfp4(x, along_k, along_m, tiles, "cast_nvfp4", pad_m)
    m, k = x.shape
    m_pad = -(-m // pad_m) * pad_m
    u8, e4m3 = torch.uint8, torch.float8_e4m3fn
    return (
        x.new_empty((m, k // 2) if along_k else (0,), dtype=u8),
        x.new_empty((m, k // 16) if along_k else (0,), dtype=e4m3),
        x.new_empty((k, m_pad // 2) if along_m else (0,), dtype=u8),
        x.new_empty((k, m_pad // 16) if along_m else (0,), dtype=e4m3),
        x.new_empty(2, dtype=torch.float32),
    )


define(
    "cast_nvfp4(Tensor x, bool along_k, bool along_m, bool tiles, Tensor? signs, Tensor? seed, int pad_m)"
    " -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    _kernel,
    _fake,
)
