"""The blocked layout of MX scales for hardware block-scaled GEMMs: the pure-PyTorch reference.

cuBLAS and tcgen05 read E8M0 scales in "block scaling factors" layout (docs/DESIGN.md, Scale layout): pad the
[rows, cols] scale matrix to rows % 128 == 0 and cols % 4 == 0, cut it into 128x4 tiles
stored tile after tile in row-major tile order, 512 bytes each; inside a tile the scale at
(r, c) sits at byte (r % 32) * 16 + (r // 32) * 4 + c. Padding bytes are zero.

The Triton cast kernels write this layout directly; the functions here are the reference
they are tested against:

* ``to_blocked`` / ``from_blocked``: one 2D scale matrix <-> a 1D blocked tensor;
* ``to_blocked_3d`` / ``from_blocked_3d``: expert scales [E, rows, cols], blocked per
  expert, experts concatenated -> [E, padded_rows * padded_cols];
* ``to_blocked_groups``: scales whose columns are cut into token groups (the MoE
  grad-weight operand, groups along M): each group blocked on its own (its columns padded to
  a multiple of 4), groups concatenated, in a buffer of a size known without reading
  ``offs`` (so a kernel needs no host sync); ``group_scale_starts`` says where each group's
  tiles begin.
"""

from __future__ import annotations

import torch
from mx_kernels.spec import (  # the layout's shapes, shared with the kernels
    SCALE_TILE_BYTES,
    SCALE_TILE_COLS,
    SCALE_TILE_ROWS,
    blocked_groups_numel,
    blocked_numel,
    blocked_shape,
)
from mx_kernels.spec import cdiv as _ceil_div

__all__ = [
    "SCALE_TILE_BYTES",
    "SCALE_TILE_COLS",
    "SCALE_TILE_ROWS",
    "blocked_byte_offset",
    "blocked_groups_numel",
    "blocked_numel",
    "blocked_shape",
    "from_blocked",
    "from_blocked_3d",
    "from_blocked_groups",
    "group_scale_starts",
    "padded_group_layout",
    "to_blocked",
    "to_blocked_3d",
    "to_blocked_groups",
]


def blocked_byte_offset(r, c, cols: int):
    """Byte of scale (r, c) of a [*, cols] matrix in the blocked layout (docs/DESIGN.md, Scale layout).
    ``r`` and ``c`` are ints or integer tensors (broadcast together)."""
    col_tiles = _ceil_div(cols, SCALE_TILE_COLS)
    tile = (r // SCALE_TILE_ROWS) * col_tiles + c // SCALE_TILE_COLS
    inner = r % SCALE_TILE_ROWS
    return tile * SCALE_TILE_BYTES + (inner % 32) * 16 + (inner // 32) * 4 + c % SCALE_TILE_COLS


def _as_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Scale bytes: MX e8m0 (or raw uint8), or NVFP4's e4m3 block scales, which the same layout holds."""
    if scale.dtype not in (torch.uint8, torch.float8_e8m0fnu, torch.float8_e4m3fn):
        raise TypeError(f"block scales are uint8, float8_e8m0fnu or float8_e4m3fn, got {scale.dtype}")
    return scale.view(torch.uint8)


def to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """[rows, cols] scales -> 1D blocked tensor of ``blocked_numel(rows, cols)`` bytes, same dtype."""
    if scale.dim() != 2:
        raise ValueError(f"to_blocked takes a 2D scale matrix, got shape {tuple(scale.shape)}")
    rows, cols = scale.shape
    padded_rows, padded_cols = blocked_shape(rows, cols)
    padded = torch.zeros(padded_rows, padded_cols, dtype=torch.uint8, device=scale.device)
    padded[:rows, :cols] = _as_bytes(scale)
    # r = tile_row * 128 + r_hi * 32 + r_lo, c = tile_col * 4 + c_lo;
    # stored order: tile_row, tile_col, r_lo, r_hi, c_lo.
    tiles = padded.view(padded_rows // 128, 4, 32, padded_cols // 4, 4)
    blocked = tiles.permute(0, 3, 2, 1, 4).contiguous().view(-1)
    return blocked.view(scale.dtype)


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of ``to_blocked``: 1D blocked -> [rows, cols] scales (padding dropped)."""
    padded_rows, padded_cols = blocked_shape(rows, cols)
    if blocked.numel() != padded_rows * padded_cols:
        raise ValueError(
            f"from_blocked: {blocked.numel()} bytes do not hold a blocked [{rows}, {cols}] matrix "
            f"({padded_rows * padded_cols} bytes)"
        )
    # a tile's 4 column bytes of one row are contiguous in both layouts: move them as one int32
    # (a 4-byte-element permute copy, several times faster on a GPU than a byte-wise one)
    tiles = _as_bytes(blocked).contiguous().view(torch.int32).view(padded_rows // 128, padded_cols // 4, 32, 4)
    padded = tiles.permute(0, 3, 2, 1).reshape(padded_rows, padded_cols // 4).view(torch.uint8)
    return padded[:rows, :cols].contiguous().view(blocked.dtype)


def to_blocked_3d(scale: torch.Tensor) -> torch.Tensor:
    """[E, rows, cols] expert scales -> [E, blocked_numel(rows, cols)]: blocked per expert."""
    if scale.dim() != 3:
        raise ValueError(f"to_blocked_3d takes [E, rows, cols] scales, got shape {tuple(scale.shape)}")
    num_experts, rows, cols = scale.shape
    if num_experts == 0:
        return torch.empty(0, blocked_numel(rows, cols), dtype=scale.dtype, device=scale.device)
    return torch.stack([to_blocked(scale[e]) for e in range(num_experts)])


def from_blocked_3d(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of ``to_blocked_3d``: [E, blocked_numel] -> [E, rows, cols]."""
    if blocked.dim() != 2:
        raise ValueError(f"from_blocked_3d takes [E, n] blocked scales, got shape {tuple(blocked.shape)}")
    if blocked.shape[0] == 0:
        return torch.empty(0, rows, cols, dtype=blocked.dtype, device=blocked.device)
    return torch.stack([from_blocked(blocked[e], rows, cols) for e in range(blocked.shape[0])])


def group_scale_starts(offs: torch.Tensor, block_size: int = 32) -> torch.Tensor:
    """First padded scale column of each group, and the total, in the per-group blocked layout.

    ``offs``: int32 cumulative group ends along the quantized dim (rows of x, each group a
    multiple of ``block_size``). Returns int32 [G + 1]; group g's blocked scales are bytes
    [padded_rows * starts[g], padded_rows * starts[g + 1]) of the buffer. Device ops only: no sync.
    """
    ends = offs.to(torch.int64)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    cols = sizes // block_size
    padded_cols = (cols + SCALE_TILE_COLS - 1) // SCALE_TILE_COLS * SCALE_TILE_COLS
    return torch.cat([ends.new_zeros(1), torch.cumsum(padded_cols, 0)]).to(torch.int32)


def to_blocked_groups(scale: torch.Tensor, offs: torch.Tensor, block_size: int = 32) -> torch.Tensor:
    """[rows, cols] scales whose columns are cut into groups by ``offs`` -> 1D per-group blocked buffer.

    ``offs`` are cumulative group ends in units of the quantized dim (cols * block_size in
    all); group g owns scale columns [offs[g-1] / block_size, offs[g] / block_size). Group g's
    bytes equal ``to_blocked(scale[:, group g columns])`` and start at byte
    ``padded_rows * group_scale_starts(offs)[g]``; every other byte of the
    ``blocked_groups_numel`` buffer is zero. Reads ``offs`` on the host: a reference, not a hot path.
    """
    if scale.dim() != 2:
        raise ValueError(f"to_blocked_groups takes a 2D scale matrix, got shape {tuple(scale.shape)}")
    rows, cols = scale.shape
    padded_rows = _ceil_div(rows, SCALE_TILE_ROWS) * SCALE_TILE_ROWS
    out = torch.zeros(blocked_groups_numel(rows, cols, offs.numel()), dtype=torch.uint8, device=scale.device)
    starts = group_scale_starts(offs, block_size).tolist()
    col_start = 0
    for g, end in enumerate(offs.tolist()):
        col_end = end // block_size
        if col_end > col_start:
            group = to_blocked(_as_bytes(scale[:, col_start:col_end]))
            base = padded_rows * starts[g]
            out[base : base + group.numel()] = group
        col_start = col_end
    return out.view(scale.dtype)


def from_blocked_groups(
    blocked: torch.Tensor, rows: int, cols: int, offs: torch.Tensor, block_size: int = 32
) -> torch.Tensor:
    """The inverse of ``to_blocked_groups``: per-group blocked buffer -> [rows, cols] scales."""
    if blocked.numel() != blocked_groups_numel(rows, cols, offs.numel()):
        raise ValueError(
            f"from_blocked_groups: {blocked.numel()} bytes do not hold [{rows}, {cols}] scales in "
            f"{offs.numel()} groups ({blocked_groups_numel(rows, cols, offs.numel())} bytes)"
        )
    padded_rows = _ceil_div(rows, SCALE_TILE_ROWS) * SCALE_TILE_ROWS
    buf = _as_bytes(blocked)
    out = torch.zeros(rows, cols, dtype=torch.uint8, device=blocked.device)
    starts = group_scale_starts(offs, block_size).tolist()
    col_start = 0
    for g, end in enumerate(offs.tolist()):
        col_end = end // block_size
        if col_end > col_start:
            n = blocked_numel(rows, col_end - col_start)
            base = padded_rows * starts[g]
            out[:, col_start:col_end] = from_blocked(buf[base : base + n], rows, col_end - col_start)
        col_start = col_end
    return out.view(blocked.dtype)


def padded_group_layout(offs: torch.Tensor, total_rows: int, block: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each row goes when every group is padded to a multiple of ``block``.

    Returns (destination row of each of the ``total_rows`` rows, padded cumulative group ends,
    padded buffer size). The rows at and past offs[-1] belong to no group: they go after the last
    padded group, so that no block of a group holds one of them. The size is a static bound, so
    nothing waits for the device.
    """
    offs = offs.to(torch.int64)
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    padded_ends = torch.cumsum((sizes + block - 1) // block * block, 0)
    starts, padded_starts = offs - sizes, padded_ends - (sizes + block - 1) // block * block
    rows = torch.arange(total_rows, device=offs.device)
    group = torch.searchsorted(offs, rows, right=True)
    in_group = group.clamp(max=len(offs) - 1)
    dest = torch.where(
        group < len(offs), rows - starts[in_group] + padded_starts[in_group], rows - offs[-1] + padded_ends[-1]
    )
    size = -(-total_rows // block) * block + block * len(offs)  # >= sum of padded sizes, a multiple of block
    return dest, padded_ends.to(torch.int32), size


def group_row_sources(dest: torch.Tensor, size: int) -> torch.Tensor:
    """The inverse of padded_group_layout's ``dest``: for each of the ``size`` padded rows, the row
    of the unpadded tensor it holds, or -1 for a padding row (int32, on the device, no sync)."""
    src = torch.full((size,), -1, dtype=torch.int32, device=dest.device)
    return src.index_copy_(0, dest, torch.arange(dest.numel(), dtype=torch.int32, device=dest.device))


def pad_groups(t: torch.Tensor, dest: torch.Tensor, size: int) -> torch.Tensor:
    """Rows of ``t`` scattered to ``dest`` in a zeroed [size, ...] buffer."""
    out = t.new_zeros(size, *t.shape[1:])
    return out.index_copy_(0, dest, t)


def zero_rows_past_groups(y: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """y with the rows at and past offs[-1] (in no group) set to zero: the grouped GEMMs leave them unwritten.
    A mask computed on the device, so nothing waits for the host (torch.compile fuses it with y's consumer)."""
    rows = torch.arange(y.shape[0], device=y.device)
    return torch.where((rows < offs[-1])[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))
