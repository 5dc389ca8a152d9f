"""Host-side pieces shared by the MX cast kernels: argument checks, output shapes, format constants.

No Triton import here: the custom ops' fake implementations use these shape functions too,
so tracing with torch.compile never needs Triton or a GPU.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

import torch

from mx_recipe.formats import BLOCK_SIZE, SCALE_RULES, elem_format
from mx_recipe.scale_layout import blocked_groups_numel, blocked_numel

# Element formats the kernels write; e2m1 (fp4) needs nibble packing they don't do.
KERNEL_ELEMS = ("e4m3", "e5m2")


def check_cast(x: torch.Tensor, elem: str, mode: str, ndims: tuple[int, ...], qdim: int | None, op: str) -> None:
    """Raise the reference's errors (and the kernels' own limits) before any launch. ``qdim``: the
    quantized dim, whose size must be a multiple of 32 (None: the kernel pads it)."""
    if elem == "e2m1":
        raise ValueError(
            f"{op}: the Triton MX cast kernels write fp8 (e4m3, e5m2) only; e2m1 is not supported "
            "here (use mx_recipe.formats.to_mx, or mx_recipe.cast, which falls back to it)"
        )
    elem_format(elem)  # unknown names raise the reference's ValueError
    if elem not in KERNEL_ELEMS:
        raise ValueError(f"{op}: element format {elem!r} is not one of {KERNEL_ELEMS}")
    if mode not in SCALE_RULES:
        raise ValueError(f"unknown MX scale rule {mode!r}; expected one of {list(SCALE_RULES)}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"{op} takes bf16 or fp32 input, got {x.dtype}")
    if x.dim() not in ndims:
        dims = " or ".join(f"{n}D" for n in ndims)
        raise ValueError(f"{op} takes a {dims} tensor, got shape {tuple(x.shape)}")
    if qdim is None:
        return
    qdim = qdim % x.dim()
    if x.shape[qdim] % BLOCK_SIZE:
        raise ValueError(
            f"{op}: dim {qdim} of shape {tuple(x.shape)} has size {x.shape[qdim]}, "
            f"which is not a multiple of the block size {BLOCK_SIZE}"
        )


def fp8_dtype(elem: str) -> torch.dtype:
    return elem_format(elem).torch_dtype


def format_constexprs(elem: str, mode: str) -> dict[str, object]:
    """The compile-time constants a kernel needs for one element format and scale rule."""
    fmt = elem_format(elem)
    return dict(
        EMAX=fmt.emax,
        MAX_MANT=fmt.max_mantissa_bits,
        MAX_NORMAL=fmt.max_normal,
        MBITS=fmt.mbits,
        EMIN=fmt.emin,
        IS_E4M3=elem == "e4m3",
        RCEIL=mode == "rceil",
    )


def interpreting() -> bool:
    """True under the Triton CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def software_round(x: torch.Tensor, op: str) -> bool:
    """Whether kernels must round fp8 in integer arithmetic: only in the interpreter, whose
    fp8 conversion is wrong (no ties-to-even, lost mantissa carry). The GPU uses cvt.rn.satfinite."""
    if interpreting():
        return True
    if not x.is_cuda:
        raise RuntimeError(f"{op}: the Triton kernels need a CUDA tensor (or TRITON_INTERPRET=1), got {x.device}")
    return False


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids: triton.cdiv is a ConstexprFunction, 2.3 us a call on the host."""
    return -(-a // b)


def tile_grid(m: int, k: int, block_m: int, block_k: int, pad: int) -> tuple[int, int]:
    """Tiles of block_m x block_k over [m, k] with both rounded up to ``pad`` (128 for blocked scales:
    the tiles cover the scale padding too, to zero it; 1 otherwise)."""
    return cdiv(cdiv(m, pad) * pad, block_m), cdiv(cdiv(k, pad) * pad, block_k)


def scale_bytes_2d(rows: int, cols: int, blocked: bool) -> tuple[int, ...]:
    """Shape of one 2D scale output: [rows, cols] plain, or 1D blocked bytes."""
    return (blocked_numel(rows, cols),) if blocked else (rows, cols)


def dim0_shapes(shape: torch.Size, blocked: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(qdata, scale) shapes of the dim0 cast of a [M, K] or [E, M, K] tensor."""
    *batch, m, k = shape
    return (*batch, m, k), (*batch, *scale_bytes_2d(m, k // BLOCK_SIZE, blocked))


def dim1_shapes(shape: torch.Size, blocked: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(qdata, scale) shapes of the dim1 cast of [M, K] or [E, M, K]: qdata [.., K, M], scale [.., K, M/32]."""
    *batch, m, k = shape
    return (*batch, k, m), (*batch, *scale_bytes_2d(k, m // BLOCK_SIZE, blocked))


def fake_quant_2d_shapes(shape: torch.Size, along_k: bool, along_m: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(along K, along M) output shapes of fake_quant_2d on [M, K] or [E, M, K]: x's shape, and x's
    with M rounded up to a multiple of 32; (0,) for an output not asked for."""
    *batch, m, k = shape
    m_pad = -(-m // BLOCK_SIZE) * BLOCK_SIZE
    return (*batch, m, k) if along_k else (0,), (*batch, m_pad, k) if along_m else (0,)


def groups_along_m_rows(row_src: torch.Tensor) -> int:
    """Rows that fake_quant_groups_along_m walks: row_src's length, checked (int32, 1D, a multiple of 32)."""
    if row_src.dtype != torch.int32 or row_src.dim() != 1:
        got = f"{row_src.dtype} {tuple(row_src.shape)}"
        raise ValueError(f"fake_quant_groups_along_m: row_src must be 1D int32, got {got}")
    if row_src.shape[0] % BLOCK_SIZE:
        n = row_src.shape[0]
        raise ValueError(f"fake_quant_groups_along_m: row_src length {n} is not a multiple of {BLOCK_SIZE}")
    return row_src.shape[0]


def groups_dim1_shapes(shape: torch.Size, num_groups: int, blocked: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(qdata, scale) shapes of the per-group dim1 cast of [M_total, K] with ``num_groups`` groups."""
    m, k = shape
    if not blocked:
        return dim1_shapes(shape, False)
    return (k, m), (blocked_groups_numel(k, m // BLOCK_SIZE, num_groups),)


def check_offs(offs: torch.Tensor, m_total: int, check_values: bool) -> None:
    """Validate token-group ends. Shape and dtype always; the values only when ``check_values``
    (it reads them on the host, a device sync on GPU)."""
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.numel() == 0:
        raise ValueError(
            f"offs must be a non-empty 1D int32 tensor of group ends, got {offs.dtype} {tuple(offs.shape)}"
        )
    if not check_values:
        return
    ends = offs.cpu().to(torch.int64)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    if (sizes < 0).any():
        raise ValueError(f"offs must be non-decreasing group ends starting at >= 0, got {ends.tolist()}")
    if (sizes % BLOCK_SIZE).any():
        raise ValueError(f"every token group must be a multiple of {BLOCK_SIZE} rows, got group sizes {sizes.tolist()}")
    if ends[-1].item() != m_total:
        raise ValueError(f"offs must end at M_total = {m_total} (the groups cover every row), got {ends[-1].item()}")


GLUON_ENV = "MX_RECIPE_GLUON"  # "0" in the environment: the Triton kernels everywhere


def gluon_rule(
    capability: tuple[int, int] | None, dtype: torch.dtype, config: dict | None, interpreter: bool,
    env: Mapping[str, str],
) -> bool:  # fmt: skip
    """Whether a cast launches its Gluon kernel instead of its Triton one: bf16 x on an NVIDIA GPU of
    compute capability 9.x (``capability``; None off NVIDIA CUDA), no Triton ``config`` asked for, not
    the Triton interpreter, and ``env`` (os.environ) not setting MX_RECIPE_GLUON=0."""
    # Hopper only: where the Gluon kernels were measured faster (H200) and tested bit for bit
    hopper = capability is not None and capability[0] == 9
    return hopper and dtype == torch.bfloat16 and config is None and not interpreter and env.get(GLUON_ENV) != "0"


@functools.cache
def _nvidia_capability(device_index: int) -> tuple[int, int] | None:
    """(major, minor) of an NVIDIA GPU; None on ROCm, whose capabilities (MI300: 9.4) mean something else."""
    return None if torch.version.hip else torch.cuda.get_device_capability(device_index)


def use_gluon(x: torch.Tensor, config: dict | None) -> bool:
    """``gluon_rule`` for a launch on ``x`` (read at each call, so the environment can change it)."""
    capability = _nvidia_capability(x.device.index) if x.is_cuda else None
    return gluon_rule(capability, x.dtype, config, interpreting(), os.environ)
