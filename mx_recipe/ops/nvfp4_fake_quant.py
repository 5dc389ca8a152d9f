"""The NVFP4 operands of the emulated GEMMs, from one entry point: ``fake_quant_nvfp4`` runs the Triton kernel
(``mx_kernels.nvfp4.casts``) for bf16 on CUDA and the reference (``nvfp4.nvfp4_operand``) otherwise;
both give the same bits (docs/DESIGN.md, "NVFP4").

One call quantizes x [M, K] along K (1x16 blocks, or 16x16 tiles for the recipe's weights) and/or along M
(1x16 blocks of rows, after the random Hadamard transform along M when ``signs`` is given; rows zero-padded
to a multiple of 16), reading x once on the GPU, and returns each operand with its per-tensor decode scale.

Stochastic rounding: the reference draws from ``generator`` (or the default generator) as ``to_nvfp4`` does;
the kernel rounds with a Philox stream keyed by a seed drawn from that generator on x's device
(``philox.philox_uniform`` is the same stream in PyTorch). The two draw different bits for the same
generator state; each is exact against the reference given the same draws.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from mx_kernels.common import check_nvfp4
from torch import Tensor

from mx_recipe.formats.nvfp4 import NVFP4_BLOCK, hadamard_transform, nvfp4_operand
from mx_recipe.formats.scale_layout import pad_groups, zero_rows_past_groups
from mx_recipe.library import define
from mx_recipe.ops.device import capability
from mx_recipe.ops.dispatch import draw_seed

TILES, ROWS = (NVFP4_BLOCK, NVFP4_BLOCK), (1, NVFP4_BLOCK)


class NVFP4Operands(NamedTuple):
    """What ``fake_quant_nvfp4`` returns: each operand (None if not asked for) and its decode scale s_dec."""

    along_k: Tensor | None
    s_dec_k: Tensor | None
    along_m: Tensor | None
    s_dec_m: Tensor | None


def uses_kernel(x: Tensor) -> bool:
    """The kernel takes bf16 on NVIDIA CUDA devices; everything else takes the reference."""
    return x.dtype == torch.bfloat16 and capability(x.device) is not None


def along_m_input(x: Tensor, signs: Tensor | None, pad_m: int) -> Tensor:
    """What the references quantize along M: x [M, C] zero-padded to a multiple of ``pad_m`` rows, then put
    through the random Hadamard transform along M (fp32, quantized as it is) when ``signs`` is given."""
    pad = -x.shape[0] % pad_m
    t = F.pad(x, (0, 0, 0, pad)) if pad else x
    return t if signs is None else hadamard_transform(t, signs, dim=0)


def reference_fake_quant_nvfp4(
    x: Tensor, along_k: bool, along_m: bool, tiles: bool, signs: Tensor | None, rounding: str,
    generator: torch.Generator | None = None, uniforms: tuple[Tensor | None, Tensor | None] = (None, None),
) -> NVFP4Operands:  # fmt: skip
    """The contract in plain PyTorch. ``uniforms``: the draws for along K and along M (stochastic rounding)."""
    k = s_k = m = s_m = None
    if along_k:
        block_shape = TILES if tiles else ROWS
        k, s_k = nvfp4_operand(x, -1, block_shape=block_shape, rounding=rounding, generator=generator,
                               uniform=uniforms[0])  # fmt: skip
    if along_m:
        t = along_m_input(x, signs, NVFP4_BLOCK)
        m, s_m = nvfp4_operand(t, 0, rounding=rounding, generator=generator, uniform=uniforms[1])
        m = m.to(x.dtype)  # exact: e2m1 * e4m3 has at most 6 significant bits
    return NVFP4Operands(k, s_k, m, s_m)


def fake_quant_nvfp4(
    x: Tensor, along_k: bool = True, along_m: bool = False, tiles: bool = False, signs: Tensor | None = None,
    rounding: str = "nearest", generator: torch.Generator | None = None,
) -> NVFP4Operands:  # fmt: skip
    """x [M, K] (K a multiple of 16; M too with ``tiles``) -> its NVFP4 operands (``NVFP4Operands``):
    along K [M, K] and along M [ceil16(M), K], each e2m1 * float(block scale) in x's dtype, and their fp32
    decode scales. ``tiles``: 16x16 scale tiles along K; ``signs``: fp32 [16], the random Hadamard transform
    along M first; ``rounding``: "nearest" or "stochastic" (the draws: module docstring)."""
    check_nvfp4(x, along_k, along_m, tiles)
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"fake_quant_nvfp4: rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if not uses_kernel(x):
        return reference_fake_quant_nvfp4(x, along_k, along_m, tiles, signs, rounding, generator)
    seed = draw_seed(x, generator) if rounding == "stochastic" else None
    k, m, s_dec = torch.ops.mx_recipe.fake_quant_nvfp4(x, along_k, along_m, tiles, signs, seed)
    return NVFP4Operands(k if along_k else None, s_dec[0], m if along_m else None, s_dec[1])


def reference_fake_quant_nvfp4_groups(
    x: Tensor, offs: Tensor, dest: Tensor, size: int, along_k: bool, along_m: bool, signs: Tensor | None,
    rounding: str, generator: torch.Generator | None = None,
    uniforms: tuple[Tensor | None, Tensor | None] = (None, None),
) -> NVFP4Operands:  # fmt: skip
    """``fake_quant_nvfp4_groups``'s contract in plain PyTorch: x's rows past the groups zeroed, then along K
    as it is and along M as the groups padded to multiples of 16 (``pad_groups`` to ``dest`` in ``size`` rows)."""
    x = zero_rows_past_groups(x, offs)
    k = m = NVFP4Operands(None, None, None, None)
    if along_k:
        k = reference_fake_quant_nvfp4(x, True, False, False, None, rounding, generator, uniforms)
    if along_m:
        padded = pad_groups(x, dest, size)
        m = reference_fake_quant_nvfp4(padded, False, True, False, signs, rounding, generator, uniforms)
    return NVFP4Operands(k.along_k, k.s_dec_k, m.along_m, m.s_dec_m)


def fake_quant_nvfp4_groups(
    x: Tensor, offs: Tensor, dest: Tensor, row_src: Tensor, along_k: bool = True, along_m: bool = False,
    signs: Tensor | None = None, rounding: str = "nearest", generator: torch.Generator | None = None,
) -> NVFP4Operands:  # fmt: skip
    """The NVFP4 operands (1x16 blocks) of MoE token groups from one read of x [M, K]. ``offs`` int32 [E]: the
    groups' cumulative ends; ``dest``: where each row goes in the groups padded to multiples of 16
    (``padded_group_layout(offs, M, 16)``), and ``row_src`` its inverse (``group_row_sources``), whose length R
    is the padded size. The rows at and past offs[-1] belong to no group and count as zeros.
    along K [M, K] in x's rows (the kernel leaves the rows past the groups unwritten: the grouped GEMMs read only
    group rows); along M [R, K] in the padded groups, after the random Hadamard transform along M when ``signs``
    is given, so that no block and no transform straddles two experts. ``rounding`` and the draws as
    ``fake_quant_nvfp4``'s, along K over the [M, K] output and along M over the padded one."""
    check_nvfp4(x, along_k, along_m, False, "fake_quant_nvfp4_groups")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"fake_quant_nvfp4_groups: rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if not uses_kernel(x):
        return reference_fake_quant_nvfp4_groups(
            x, offs, dest, row_src.numel(), along_k, along_m, signs, rounding, generator
        )
    seed = draw_seed(x, generator) if rounding == "stochastic" else None
    k, m, s_dec = torch.ops.mx_recipe.fake_quant_nvfp4_groups(x, row_src, offs[-1:], along_k, along_m, signs, seed)
    return NVFP4Operands(k if along_k else None, s_dec[0], m if along_m else None, s_dec[1])


# --- the custom ops: opaque to torch.compile, traced by their fakes ---


def _kernel(x: Tensor, along_k: bool, along_m: bool, tiles: bool, signs: Tensor | None, seed: Tensor | None):
    from mx_kernels.nvfp4.casts import fake_quant_nvfp4 as launch

    return launch(x, along_k, along_m, tiles, signs, seed)


def _fake(x: Tensor, along_k: bool, along_m: bool, tiles: bool, signs: Tensor | None, seed: Tensor | None):
    check_nvfp4(x, along_k, along_m, tiles)
    m, k = x.shape
    m_pad = -(-m // NVFP4_BLOCK) * NVFP4_BLOCK
    return (
        x.new_empty((m, k) if along_k else (0,)),
        x.new_empty((m_pad, k) if along_m else (0,)),
        x.new_empty(2, dtype=torch.float32),
    )


define(
    "fake_quant_nvfp4(Tensor x, bool along_k, bool along_m, bool tiles, Tensor? signs, Tensor? seed)"
    " -> (Tensor, Tensor, Tensor)",
    _kernel,
    _fake,
)


def _groups_kernel(
    x: Tensor, row_src: Tensor, group_end: Tensor, along_k: bool, along_m: bool, signs: Tensor | None,
    seed: Tensor | None,
):  # fmt: skip
    from mx_kernels.nvfp4.casts import fake_quant_nvfp4_groups as launch

    return launch(x, row_src, group_end, along_k, along_m, signs, seed)


def _groups_fake(
    x: Tensor, row_src: Tensor, group_end: Tensor, along_k: bool, along_m: bool, signs: Tensor | None,
    seed: Tensor | None,
):  # fmt: skip
    check_nvfp4(x, along_k, along_m, False, "fake_quant_nvfp4_groups")
    m, k = x.shape
    return (
        x.new_empty((m, k) if along_k else (0,)),
        x.new_empty((row_src.shape[0], k) if along_m else (0,)),
        x.new_empty(2, dtype=torch.float32),
    )


define(
    "fake_quant_nvfp4_groups(Tensor x, Tensor row_src, Tensor group_end, bool along_k, bool along_m, Tensor? signs,"
    " Tensor? seed) -> (Tensor, Tensor, Tensor)",
    _groups_kernel,
    _groups_fake,
)
