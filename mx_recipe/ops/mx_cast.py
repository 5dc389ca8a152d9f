"""The MX casts and fake-quants: the public entry points, each a contract that every implementation meets bit
for bit (the reference, a Triton kernel, a Gluon kernel on Hopper; ``mx_recipe.ops.dispatch`` picks which runs).

* ``blocked_scales=False``: an ``MXTensor`` (formats/mx.py), quantized along its last dim;
* ``blocked_scales=True``: a ``BlockedMXTensor``, whose scales are already in the blocked layout that hardware
  block-scaled GEMMs read (docs/DESIGN.md, Scale layout), written by the cast kernel itself.

Orientation: ``cast_dim0(x)`` quantizes x [M, K] along K; ``cast_dim1(x)`` quantizes along M and stores the
result as the MX form of x.t(): qdata [K, M] row-major, scales [K, M/32], equal to
``to_mx(x.t().contiguous())`` (no transpose copy on the GPU). 3D expert weights [E, N, K] and token groups
along M (MoE grad-weight) have their own entry points.

The fake-quants return the dequantized values instead (in the input's dtype): what the emulated GEMM backend
multiplies. ``fake_quant_dim0`` quantizes along K; ``fake_quant_along_m`` along M, left in the input's layout
([.., M padded to 32, K]: a bf16 GEMM takes either operand transposed, so nothing is written transposed);
``fake_quant_dim0_dim1`` returns both from one read of the input; ``fake_quant_dim0_groups_along_m`` likewise for
rows in MoE token groups.

``rounding="stochastic"`` (the one-sided 2D casts and the fake-quants; recipe.py allows it for e2m1 gradients):
the e2m1 casts and the e2m1 fake-quants of bf16 on CUDA run on the Triton kernels, which draw from a Philox stream keyed
by a seed drawn from ``generator`` (``dispatch.run``), each element by its row-major index in the input, stream
0 along K and 1 along M, so that a cast and the fake-quant round alike for the same seed; everything else takes
the reference, whose random bits come from ``generator``, or the default generator of the input's device when it
is None (formats.to_mx).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from mx_kernels.common import check_offs

from mx_recipe.formats.mx import BLOCK_SIZE, MXTensor
from mx_recipe.formats.scale_layout import from_blocked, from_blocked_3d, from_blocked_groups, group_scale_starts
from mx_recipe.ops.device import capability
from mx_recipe.ops.dispatch import reference_fake_quant_routed_groups, run

__all__ = [
    "BlockedMXTensor",
    "cast_3d_dim0",
    "cast_3d_dim1",
    "cast_dim0",
    "cast_dim0_dim1",
    "cast_dim1",
    "cast_groups_dim1",
    "fake_quant_along_m",
    "fake_quant_dim0",
    "fake_quant_dim0_dim1",
    "fake_quant_dim0_groups_along_m",
    "fake_quant_groups_along_m",
]


@dataclass
class BlockedMXTensor:
    """An MX tensor whose scales are in the blocked layout (scale_layout.py).

    qdata: as ``MXTensor.qdata`` (quantized along ``dim``, the last dim).
    scale: float8_e8m0fnu blocked bytes: 1D for 2D data (``to_blocked``), [E, n] for 3D expert
        data (``to_blocked_3d``), or 1D per-group (``to_blocked_groups``) when ``group_offs`` is set.
    scale_shape: the plain scale shape ([rows, cols] or [E, rows, cols]) the blocked bytes hold.
    group_offs: the int32 group ends the per-group layout was cut by; None otherwise.
    """

    qdata: torch.Tensor
    scale: torch.Tensor
    elem: str
    dim: int
    scale_shape: tuple[int, ...]
    block_size: int = BLOCK_SIZE
    group_offs: torch.Tensor | None = None

    def group_scale_starts(self) -> torch.Tensor:
        """Per-group layout: first padded scale column of each group (``scale_layout.group_scale_starts``)."""
        if self.group_offs is None:
            raise ValueError("group_scale_starts: this BlockedMXTensor has no token groups")
        return group_scale_starts(self.group_offs, self.block_size)

    def unblocked(self) -> MXTensor:
        """The same data as an ``MXTensor`` with plain scales (for checks and the emulated GEMM)."""
        if self.group_offs is not None:
            scale = from_blocked_groups(self.scale, *self.scale_shape, self.group_offs, self.block_size)
        elif len(self.scale_shape) == 3:
            scale = from_blocked_3d(self.scale, *self.scale_shape[1:])
        else:
            scale = from_blocked(self.scale, *self.scale_shape)
        return MXTensor(self.qdata, scale, self.elem, self.dim, self.block_size)


def _check_ndim(x: torch.Tensor, ndims: tuple[int, ...], op: str) -> None:
    if x.dim() not in ndims:
        dims = " or ".join(f"{n}D" for n in ndims)
        raise ValueError(f"{op} takes a {dims} tensor, got shape {tuple(x.shape)}")


def _result(
    qdata: torch.Tensor,
    scale: torch.Tensor,
    elem: str,
    blocked: bool,
    scale_shape: tuple[int, ...],
    group_offs: torch.Tensor | None = None,
) -> MXTensor | BlockedMXTensor:
    dim = qdata.dim() - 1
    if blocked:
        return BlockedMXTensor(qdata, scale, elem, dim, scale_shape, group_offs=group_offs)
    return MXTensor(qdata, scale, elem, dim)


def cast_dim0(
    x: torch.Tensor, elem: str = "e4m3", mode: str = "floor", blocked_scales: bool = False, rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> MXTensor | BlockedMXTensor:  # fmt: skip
    """x [M, K] -> MX along K: qdata [M, K], scales [M, K/32]; equals ``to_mx(x, elem, mode, dim=-1)``."""
    _check_ndim(x, (2,), "cast_dim0")
    m, k = x.shape
    qdata, scale = run("cast_dim0", x, elem, mode, blocked_scales, rounding=rounding, generator=generator)
    return _result(qdata, scale, elem, blocked_scales, (m, k // BLOCK_SIZE))


def cast_dim1(
    x: torch.Tensor, elem: str = "e4m3", mode: str = "floor", blocked_scales: bool = False, rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> MXTensor | BlockedMXTensor:  # fmt: skip
    """x [M, K] -> MX along M, stored as the MX form of x.t(): qdata [K, M], scales [K, M/32];
    equals ``to_mx(x.t().contiguous(), elem, mode, dim=-1)``."""
    _check_ndim(x, (2,), "cast_dim1")
    m, k = x.shape
    qdata, scale = run("cast_dim1", x, elem, mode, blocked_scales, rounding=rounding, generator=generator)
    return _result(qdata, scale, elem, blocked_scales, (k, m // BLOCK_SIZE))


def cast_dim0_dim1(
    x: torch.Tensor, elem: str = "e4m3", mode: str = "floor", blocked_scales: bool = False
) -> tuple[MXTensor | BlockedMXTensor, MXTensor | BlockedMXTensor]:
    """(cast_dim0(x), cast_dim1(x)) from one read of x on the GPU (one fused kernel), rounded to nearest."""
    _check_ndim(x, (2,), "cast_dim0_dim1")
    m, k = x.shape
    q0, s0, q1, s1 = run("cast_dim0_dim1", x, elem, mode, blocked_scales)
    return (
        _result(q0, s0, elem, blocked_scales, (m, k // BLOCK_SIZE)),
        _result(q1, s1, elem, blocked_scales, (k, m // BLOCK_SIZE)),
    )


def cast_3d_dim0(
    w: torch.Tensor, elem: str = "e4m3", mode: str = "floor", blocked_scales: bool = False
) -> MXTensor | BlockedMXTensor:
    """Expert weights [E, N, K] -> MX along K per expert: qdata [E, N, K], scales [E, N, K/32]
    (blocked: per expert, [E, n])."""
    _check_ndim(w, (3,), "cast_3d_dim0")
    e, n, k = w.shape
    qdata, scale = run("cast_dim0", w, elem, mode, blocked_scales)
    return _result(qdata, scale, elem, blocked_scales, (e, n, k // BLOCK_SIZE))


def cast_3d_dim1(
    w: torch.Tensor, elem: str = "e4m3", mode: str = "floor", blocked_scales: bool = False
) -> MXTensor | BlockedMXTensor:
    """Expert weights [E, N, K] -> MX along N per expert, each expert stored transposed:
    qdata [E, K, N], scales [E, K, N/32]; equals ``to_mx(w.transpose(-2, -1).contiguous())``."""
    _check_ndim(w, (3,), "cast_3d_dim1")
    e, n, k = w.shape
    qdata, scale = run("cast_dim1", w, elem, mode, blocked_scales)
    return _result(qdata, scale, elem, blocked_scales, (e, k, n // BLOCK_SIZE))


def cast_groups_dim1(
    x: torch.Tensor,
    offs: torch.Tensor,
    elem: str = "e4m3",
    mode: str = "floor",
    blocked_scales: bool = False,
    validate: bool | None = None,
) -> MXTensor | BlockedMXTensor:
    """Token groups x [M_total, K] ending at ``offs`` -> per-group MX along M, as one [K, M_total] tensor.

    Each group is a multiple of 32 rows, so no block straddles groups: qdata [K, M_total] and
    plain scales [K, M_total/32] are ``cast_dim1(x)``, and columns [offs[g-1], offs[g]) of qdata
    are group g's ``to_mx(x_g.t().contiguous())``. With ``blocked_scales`` each group's scales are
    blocked on their own and concatenated (``scale_layout.to_blocked_groups``); the result's
    ``group_scale_starts()`` says where each group begins.

    Contract on ``offs`` (int32 [G], G >= 1): non-decreasing cumulative ends, each group a
    multiple of 32 rows (empty groups allowed), offs[-1] == M_total. ``validate`` checks it on
    the host; by default only for CPU tensors, since on GPU it would sync. On GPU, offs that
    break the contract give unspecified values but no out-of-bounds access.
    """
    _check_ndim(x, (2,), "cast_groups_dim1")
    m, k = x.shape
    check_offs(offs, m, check_values=not x.is_cuda if validate is None else validate)
    if blocked_scales:
        qdata, scale = run("cast_groups_dim1", x, elem, mode, offs)
    else:
        qdata, scale = run("cast_dim1", x, elem, mode, False)
    group_offs = offs if blocked_scales else None
    return _result(qdata, scale, elem, blocked_scales, (k, m // BLOCK_SIZE), group_offs)


def fake_quant_dim0(
    x: torch.Tensor, elem: str = "e4m3", mode: str = "floor", rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] or [E, M, K] -> ``to_mx(x, elem, mode, dim=-1).dequantize(x.dtype)``, bit for bit."""
    _check_ndim(x, (2, 3), "fake_quant_dim0")
    return run("fake_quant_2d", x, elem, mode, True, False, rounding=rounding, generator=generator)[0]


def fake_quant_along_m(
    x: torch.Tensor, elem: str = "e4m3", mode: str = "floor", rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] or [E, M, K] zero-padded along M to a multiple of 32, quantized along M and
    dequantized, in x's layout: [.., ceil32(M), K], row-major. Equal, bit for bit, to
    ``to_mx(pad(x).transpose(-2, -1).contiguous(), elem, mode).dequantize(x.dtype).transpose(-2, -1)``;
    stochastic rounding draws in that order too."""
    _check_ndim(x, (2, 3), "fake_quant_along_m")
    return run("fake_quant_2d", x, elem, mode, False, True, rounding=rounding, generator=generator)[1]


def fake_quant_groups_along_m(
    x: torch.Tensor, row_src: torch.Tensor, elem: str = "e4m3", mode: str = "floor", rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] in token groups, row_src int32 [R]: the groups padded to multiples of 32 rows (every
    row of x once, in its padded position; -1 for padding) -> [M, K]: each group quantized along M in
    blocks of 32 from its first row, as if zero-padded, and dequantized; the padding rows dropped.
    The MoE grad-weight operand: on CUDA one kernel, no padded copy, and the GEMM needs no padded
    groups. Stochastic rounding draws as ``fake_quant_along_m`` on the padded tensor does."""
    _check_ndim(x, (2,), "fake_quant_groups_along_m")
    return run("fake_quant_groups_along_m", x, elem, mode, row_src, rounding=rounding, generator=generator)


def fake_quant_dim0_groups_along_m(
    x: torch.Tensor, row_src: torch.Tensor, elem: str = "e4m3", mode: str = "floor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``fake_quant_dim0(x)``, ``fake_quant_groups_along_m(x, row_src)``): on CUDA one kernel, one read of x. The
    MoE grouped GEMM's x (forward and grad-weight operands) and g (grad-input and grad-weight). Rounds to nearest."""
    _check_ndim(x, (2,), "fake_quant_dim0_groups_along_m")
    return run("fake_quant_groups", x, elem, mode, row_src)


def fake_quant_routed_groups(
    x: torch.Tensor, routed: torch.Tensor, row_src: torch.Tensor, elem: str = "e4m3", mode: str = "floor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fake_quant_dim0_groups_along_m(x[routed], row_src)`` without x[routed]: x [T, K] the tokens, routed int64 [M]
    the token of each routed row (sorted by expert), row_src their layout in padded groups -> (along K, groups along
    M), each [M, K]. The MoE experts' input casts: on CUDA (bf16, to nearest) one Triton kernel that reads the
    tokens' rows where the routed rows need them and never writes the routed copy."""
    _check_ndim(x, (2,), "fake_quant_routed_groups")
    if capability(x.device) is None or x.dtype != torch.bfloat16:
        return reference_fake_quant_routed_groups(x, elem, mode, routed, row_src)
    return torch.ops.mx_recipe.fake_quant_routed_groups(x, elem, mode, routed, row_src)


def fake_quant_dim0_dim1(
    x: torch.Tensor, elem: str = "e4m3", mode: str = "floor", rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(``fake_quant_dim0(x)``, ``fake_quant_along_m(x)``): on CUDA one kernel, one read of x.
    Stochastic rounding draws along K first, then along M."""
    _check_ndim(x, (2, 3), "fake_quant_dim0_dim1")
    return run("fake_quant_2d", x, elem, mode, True, True, rounding=rounding, generator=generator)
