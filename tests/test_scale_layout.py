"""The blocked scale layout reference (mx_recipe/formats/scale_layout.py) on cases checked by hand.

docs/DESIGN.md, Scale layout: pad [rows, cols] to rows % 128 == 0 and cols % 4 == 0; 128x4 tiles in row-major
tile order, 512 bytes each; inside a tile, scale (r, c) at byte (r % 32) * 16 + (r // 32) * 4 + c.
"""

import pytest
import torch

from mx_recipe.formats.scale_layout import (
    blocked_byte_offset,
    blocked_groups_numel,
    blocked_numel,
    blocked_shape,
    from_blocked,
    from_blocked_3d,
    from_blocked_groups,
    group_scale_starts,
    to_blocked,
    to_blocked_3d,
    to_blocked_groups,
)


def _numbered(rows: int, cols: int) -> torch.Tensor:
    """Distinct non-zero bytes (1..255, wrapping) so every position is identifiable."""
    return (torch.arange(rows * cols).reshape(rows, cols) % 255 + 1).to(torch.uint8)


def test_byte_positions_by_hand():
    # inside tile 0: (r % 32) * 16 + (r // 32) * 4 + c
    assert blocked_byte_offset(0, 0, 4) == 0
    assert blocked_byte_offset(0, 3, 4) == 3
    assert blocked_byte_offset(1, 0, 4) == 16
    assert blocked_byte_offset(32, 0, 4) == 4
    assert blocked_byte_offset(33, 2, 4) == 1 * 16 + 1 * 4 + 2  # 22
    assert blocked_byte_offset(127, 3, 4) == 31 * 16 + 3 * 4 + 3  # 511, the last byte of tile 0
    # with 8 columns there are two tiles per 128 rows: (r, c) = (5, 6) is in tile 1
    assert blocked_byte_offset(5, 6, 8) == 512 + 5 * 16 + 0 * 4 + 2
    # row 130 of a 2-tile-wide matrix: tile row 1 starts at tile 2
    assert blocked_byte_offset(130, 1, 8) == 2 * 512 + 2 * 16 + 0 * 4 + 1


def test_to_blocked_places_every_scale():
    scale = _numbered(128, 4)
    blocked = to_blocked(scale)
    assert blocked.shape == (512,)
    assert blocked[22].item() == scale[33, 2].item()
    assert blocked[4].item() == scale[32, 0].item()
    assert blocked[16].item() == scale[1, 0].item()
    for r in range(128):
        for c in range(4):
            assert blocked[blocked_byte_offset(r, c, 4)].item() == scale[r, c].item()


def test_padding_is_zero():
    rows, cols = 130, 5  # pads to 256 x 8: 4 tiles
    assert blocked_shape(rows, cols) == (256, 8)
    assert blocked_numel(rows, cols) == 2048
    scale = _numbered(rows, cols)
    blocked = to_blocked(scale)
    assert blocked.numel() == 2048
    assert int((blocked != 0).sum()) == rows * cols  # every data byte is non-zero, the rest is padding
    # (r, c) = (129, 4) sits in tile (1, 1) = tile 3, at (1 % 32) * 16 + 0 * 4 + 0
    assert blocked[3 * 512 + 16].item() == scale[129, 4].item()
    # padding positions inside the data tiles
    assert blocked[blocked_byte_offset(0, 5, 8)].item() == 0
    assert blocked[blocked_byte_offset(131, 0, 8)].item() == 0


@pytest.mark.parametrize("rows,cols", [(1, 1), (96, 5), (128, 4), (200, 7), (257, 12)])
def test_round_trip(rows, cols):
    scale = _numbered(rows, cols).view(torch.float8_e8m0fnu)
    blocked = to_blocked(scale)
    assert blocked.dtype == torch.float8_e8m0fnu
    assert torch.equal(from_blocked(blocked, rows, cols).view(torch.uint8), scale.view(torch.uint8))


def test_3d_is_blocked_per_expert():
    scale = torch.stack([_numbered(96, 5), _numbered(96, 5).flip(0), _numbered(96, 5) + 1])
    blocked = to_blocked_3d(scale)
    assert blocked.shape == (3, blocked_numel(96, 5))
    for e in range(3):
        assert torch.equal(blocked[e], to_blocked(scale[e]))
    assert torch.equal(from_blocked_3d(blocked, 96, 5), scale)


def test_groups_layout():
    # scales [rows=40, cols=10]; groups in units of the quantized dim (32 per scale column):
    # group sizes in columns: 3, 0 (empty), 5, 2 -> padded to 4, 0, 8, 4
    rows, cols = 40, 10
    offs = torch.tensor([3, 3, 8, 10], dtype=torch.int32) * 32
    assert group_scale_starts(offs).tolist() == [0, 4, 4, 12, 16]
    scale = _numbered(rows, cols)
    blocked = to_blocked_groups(scale, offs)
    assert blocked.numel() == blocked_groups_numel(rows, cols, 4) == 128 * 4 * (3 + 4)
    padded_rows = 128
    assert torch.equal(blocked[: padded_rows * 4], to_blocked(scale[:, 0:3]))
    assert torch.equal(blocked[padded_rows * 4 : padded_rows * 12], to_blocked(scale[:, 3:8]))
    assert torch.equal(blocked[padded_rows * 12 : padded_rows * 16], to_blocked(scale[:, 8:10]))
    assert int((blocked[padded_rows * 16 :] != 0).sum()) == 0  # the unused tail is zero
    assert int((blocked != 0).sum()) == rows * cols
    assert torch.equal(from_blocked_groups(blocked, rows, cols, offs), scale)


def test_errors():
    with pytest.raises(ValueError, match="2D"):
        to_blocked(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8, float8_e8m0fnu or float8_e4m3fn"):
        to_blocked(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="do not hold"):
        from_blocked(torch.zeros(100, dtype=torch.uint8), 4, 4)
