"""Host-side pieces shared by the MX cast kernels: argument checks, output shapes, format constants.

No Triton import here: the custom ops' fake implementations use these shape functions too,
so tracing with torch.compile never needs Triton or a GPU.
"""

from __future__ import annotations

import functools
import os

import torch
from mx_kernels.spec import (
    BLOCK_SIZE,
    KERNEL_ELEMS,
    NVFP4_BLOCK,
    SCALE_RULES,
    blocked_groups_numel,
    blocked_numel,
    cdiv,
    elem_format,
)


def check_cast(
    x: torch.Tensor, elem: str, mode: str, ndims: tuple[int, ...], qdim: int | None, op: str, fp4: bool = False
) -> None:
    """Raise the reference's errors (and the kernels' own limits) before any launch. ``qdim``: the
    quantized dim, whose size must be a multiple of 32 (None: the kernel pads it). ``fp4``: the kernel
    takes e2m1 too (the Triton casts and fake-quants; not the Gluon kernels or the per-group cast)."""
    if elem == "e2m1" and not fp4:
        raise ValueError(
            f"{op}: this kernel writes fp8 (e4m3, e5m2) only; e2m1 is not supported here (mx_recipe.ops.mx_cast "
            "takes the Triton kernel or the reference for it)"
        )
    elem_format(elem)  # unknown names raise the reference's ValueError
    if elem not in KERNEL_ELEMS + (("e2m1",) if fp4 else ()):
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


NVFP4_PAD_M = (NVFP4_BLOCK, 2 * NVFP4_BLOCK)  # the rows along M are padded to a block, or to the cublas op's 32


def check_nvfp4(
    x: torch.Tensor, along_k: bool, along_m: bool, tiles: bool, op: str = "fake_quant_nvfp4", pad_m: int = NVFP4_BLOCK
) -> None:
    """The argument errors of the NVFP4 fake-quant and cast (``op``: their entry points, their ops' fakes and
    their launchers): a 2D x whose K, and M too with 16x16 ``tiles``, are multiples of 16; at least one
    direction asked for; rows along M padded to 16 or 32 (``pad_m``)."""
    if not (along_k or along_m):
        raise ValueError(f"{op}: ask for along_k, along_m or both")
    if x.dim() != 2:
        raise ValueError(f"{op} takes a 2D tensor, got shape {tuple(x.shape)}")
    m, k = x.shape
    if k % NVFP4_BLOCK or (tiles and m % NVFP4_BLOCK):
        need = "both dims" if tiles else "dim 1"
        raise ValueError(f"{op}: {need} of shape {tuple(x.shape)} must be multiples of {NVFP4_BLOCK}")
    if pad_m not in NVFP4_PAD_M:
        raise ValueError(f"{op}: pad_m must be one of {NVFP4_PAD_M}, got {pad_m}")


def fp8_dtype(elem: str) -> torch.dtype:
    return elem_format(elem).torch_dtype


def empty_outputs(x: torch.Tensor, elem: str, shapes: tuple[tuple[int, ...], tuple[int, ...]]) -> list[torch.Tensor]:
    """[qdata, scale] of one cast, uninitialized, on x's device (fake tensors too, for the custom ops). e2m1
    qdata is packed as the reference packs it: uint8, two codes a byte along the last dim."""
    q_shape, s_shape = shapes
    if elem == "e2m1":
        q = x.new_empty((*q_shape[:-1], q_shape[-1] // 2), dtype=torch.uint8)
    else:
        q = x.new_empty(q_shape, dtype=fp8_dtype(elem))
    return [q, x.new_empty(s_shape, dtype=torch.float8_e8m0fnu)]


def fake_quant_2d_outputs(
    x: torch.Tensor, elem: str, mode: str, along_k: bool, along_m: bool, launch, op: str, fp4: bool = False,
    seed: torch.Tensor | None = None,
):  # fmt: skip
    """The host side of a fake_quant_2d launcher (Triton or Gluon): checks, outputs, one ``launch(x, row_src,
    out_k, out_m, elem, mode, along_k, along_m, rows, m_pad)``. ``fp4``: the kernel takes e2m1 (Triton's);
    ``seed``: stochastic rounding, which the launch then takes as its last argument."""
    if not (along_k or along_m):
        raise ValueError(f"{op}: ask for along_k, along_m or both")
    check_cast(x, elem, mode, ndims=(2, 3), qdim=-1 if along_k else None, op=op, fp4=fp4)
    random = check_stochastic(x, elem, seed, op, fp4)
    k_shape, m_shape = fake_quant_2d_shapes(x.shape, along_k, along_m)
    out_k, out_m = x.new_empty(k_shape), x.new_empty(m_shape)
    if x.numel():
        m_pad = m_shape[-2] if along_m else x.shape[-2]
        launch(x, None, out_k, out_m, elem, mode, along_k, along_m, x.shape[-2], m_pad, *random)
    return out_k, out_m


def fake_quant_groups_outputs(
    x: torch.Tensor, row_src: torch.Tensor, elem: str, mode: str, launch, op: str, fp4: bool = False,
    seed: torch.Tensor | None = None, along_k: bool = False, routed: torch.Tensor | None = None,
):  # fmt: skip
    """The host side of a fake_quant_groups_along_m launcher, as ``fake_quant_2d_outputs``: the along-M result,
    or with ``along_k`` (fake_quant_groups, to nearest) the pair (along K, along M). ``routed`` (int64 [M]): the
    rows are x[routed], read through it (the launch takes it by name)."""
    check_cast(x, elem, mode, ndims=(2,), qdim=-1 if along_k else None, op=op, fp4=fp4)
    random = check_stochastic(x, elem, seed, op, fp4)
    rows = groups_along_m_rows(row_src)
    if routed is not None and (routed.dtype != torch.int64 or routed.dim() != 1):
        raise ValueError(f"{op}: routed must be 1D int64, got {routed.dtype} {tuple(routed.shape)}")
    m = x.shape[0] if routed is None else routed.shape[0]
    out = x.new_empty(m, x.shape[1])
    out_k = x.new_empty(m, x.shape[1]) if along_k else out
    if out.numel():
        launch(x, row_src, out_k, out, elem, mode, along_k, True, rows, rows, *random,
               **({} if routed is None else {"routed": routed}))  # fmt: skip
    return (out_k, out) if along_k else out


def check_stochastic(x: torch.Tensor, elem: str, seed: torch.Tensor | None, op: str, fp4: bool = True) -> tuple:
    """() to round to nearest, (seed,) to round stochastically: e2m1 on the Triton kernels (the fake-quants and
    the one-sided casts), x's last dim a multiple of 8 (the draws come eight to a Philox call along it)."""
    if seed is None:
        return ()
    if not fp4 or elem != "e2m1":
        raise ValueError(f"{op}: stochastic rounding runs on the Triton e2m1 kernels only, got {elem}")
    if x.shape[-1] % 8:
        raise ValueError(f"{op}: stochastic rounding needs the last dim a multiple of 8, got shape {tuple(x.shape)}")
    return (seed,)


def interpreting() -> bool:
    """True under the Triton CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of the CUDA ``device`` (its index, or the current device), probed once per device."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


_ARRIVALS: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counters(owner: str, device: torch.device, size: int) -> torch.Tensor:
    """A zeroed int32 buffer [size] per (``owner``, device), kept: the counters by which the last program of a
    tile to finish knows it is last and reduces the tile's partials. That program resets its counter to 0, so the
    buffer is zero between launches (and CUDA-graph replays). Two launches of one owner must not run at once on
    different streams."""
    key = (owner, device)
    if key not in _ARRIVALS:
        _ARRIVALS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    if _ARRIVALS[key].numel() != size:  # a CUDA graph may hold the buffer: it is never replaced
        raise ValueError(f"arrival_counters: {owner} asked {size} counters, after {_ARRIVALS[key].numel()}")
    return _ARRIVALS[key]


def software_round(x: torch.Tensor, op: str) -> bool:
    """Whether kernels must round fp8 in integer arithmetic: only in the interpreter, whose
    fp8 conversion is wrong (no ties-to-even, lost mantissa carry). The GPU uses cvt.rn.satfinite."""
    if interpreting():
        return True
    if not x.is_cuda:
        raise RuntimeError(f"{op}: the Triton kernels need a CUDA tensor (or TRITON_INTERPRET=1), got {x.device}")
    return False


def e2m1_reads_words(x: torch.Tensor, elem: str, software: bool, stochastic: bool) -> bool:
    """Whether an e2m1 cast of x reads it as int32 words of two bf16 (``mx_quantize.e2m1_words_along_k`` and
    ``e2m1_words_along_m``: inline PTX, so on the GPU only, to nearest): bf16 whose last dim is contiguous and even,
    at an even offset with even strides, so that no word straddles two rows."""
    return (elem == "e2m1" and x.dtype == torch.bfloat16 and not software and not stochastic and x.stride(-1) == 1
            and x.shape[-1] % 2 == 0 and all(s % 2 == 0 for s in (x.storage_offset(), *x.stride()[:-1])))  # fmt: skip


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


def check_early(op: str, early: int, rows: torch.Tensor | None, groups: int, m: int, tokens: int) -> None:
    """A one-line error unless the last ``early`` of ``groups`` grouped groups can be an MoE's folded shared experts
    over every one of the ``tokens`` rows of x, as ``moe_route`` lays them out after the routed rows (a grouped
    kernel's ``early``): rows gathered from the tokens, fewer than all the groups, within the ``m`` rows."""
    if early and (rows is None or not 0 < early < groups or m < early * tokens):
        raise ValueError(f"{op}: early groups are shared experts over every token of x (rows given), fewer than the "
                         f"{groups} groups and within the {m} rows; got {early} groups of {tokens} tokens, rows "
                         f"{'given' if rows is not None else 'None'}")  # fmt: skip
