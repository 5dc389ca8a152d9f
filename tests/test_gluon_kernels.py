"""The Gluon kernels (mx_kernels.gluon.casts, gluon_cast_groups, gluon_fake_quant): what is particular to them.

The bit-exact checks every kernel meets (against ``to_mx``, under both implementations) are in
test_cast_kernels.py. Here:

* CPU: argument errors; launch facts (grid, EVEN, OFFS64, K_FIRST, CONTIG, X_EVICT, BATCHED, PACKED) from
  ``kernel_launch`` on meta tensors; the per-group tile choice, group lookup and program walk as Python models;
  the 3D dim1 device rule; which launcher the custom ops call; each kernel compiled for sm_90 without a GPU
  (16-byte loads, whole-line or 16-byte stores, shuffle reductions, no local memory, int64 offsets only where a
  tensor passes 2**31 elements). Gluon kernels do not run in the Triton interpreter (3.6): the launchers
  refuse it.
* GPU (``@pytest.mark.gpu``, Hopper): against ``to_mx`` and the Triton kernels, byte for byte, on the special
  values the Gluon paths add cases for, every bf16 value, strided and empty input, both per-group tiles and both
  group lookups; invalid offs, no host sync, the int64 offsets, large shapes; and which kernels the public API
  launches on Hopper (the Triton ones with the kernel setting ``gluon=False``).
"""

from __future__ import annotations

import itertools
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from mx_kernels.common import groups_dim1_shapes  # noqa: E402
from mx_kernels.gluon import cast_groups as gluon_cast_groups  # noqa: E402
from mx_kernels.gluon import casts as gluon_casts  # noqa: E402
from mx_kernels.gluon import fake_quant as gluon_fake_quant  # noqa: E402
from test_cast_kernels import (  # noqa: E402
    assert_bits_equal,
    assert_values_equal,
    group_sources,
    ref_along_m,
    ref_groups_along_m,
    special_input,
)

import mx_recipe.ops.mx_cast as mx_cast  # noqa: E402
from mx_recipe.formats.mx import MXTensor, to_mx  # noqa: E402
from mx_recipe.formats.scale_layout import blocked_numel, to_blocked, to_blocked_3d, to_blocked_groups  # noqa: E402
from mx_recipe.ops import dispatch, get_kernel_settings, kernel_settings  # noqa: E402
from mx_recipe.ops.mx_cast import BlockedMXTensor  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
IS_HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
hopper = pytest.mark.skipif(
    not IS_HOPPER,
    reason="needs a Hopper GPU: the Gluon kernels run on compute capability 9.x" if HAS_CUDA else "needs a CUDA GPU",
)
ELEMS = ["e4m3", "e5m2"]
MODES = ["floor", "rceil"]
RULES_AND_FORMATS = [(mode, elem) for mode in MODES for elem in ELEMS]
TILES = {"small": gluon_cast_groups.SMALL_TILE, "lines": gluon_cast_groups.LINES_TILE}
BF16 = torch.bfloat16


def meta(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


# ---------------------------------------------------------------------------------------
# CPU: argument errors


def test_cast_argument_errors(monkeypatch):
    x = torch.randn(64, 64, dtype=BF16)
    with pytest.raises(ValueError, match=r"dim 0 of shape \(33, 64\) has size 33"):
        gluon_casts.cast_dim1(torch.randn(33, 64), "e4m3", "floor")
    with pytest.raises(ValueError, match=r"dim 1 of shape \(64, 48\) has size 48"):
        gluon_casts.cast_dim0_dim1(torch.randn(64, 48), "e4m3", "floor")
    with pytest.raises(ValueError, match="e2m1 is not supported"):
        gluon_casts.cast_dim0(x, "e2m1", "floor")
    with pytest.raises(RuntimeError, match="gluon e2m1 cast_dim1: the Gluon kernels need a CUDA tensor"):
        gluon_casts.cast_dim1(x, "e2m1", "floor")  # along M: gluon_e2m1_casts
    with pytest.raises(ValueError, match="unknown MX scale rule"):
        gluon_casts.cast_dim1(x, "e4m3", "nearest")
    with pytest.raises(ValueError, match="takes a 2D or 3D tensor"):
        gluon_casts.cast_dim1(torch.randn(64), "e4m3", "floor")
    with pytest.raises(ValueError, match="takes a 2D tensor"):  # the fused cast: 2D only
        gluon_casts.cast_dim0_dim1(torch.randn(2, 64, 64), "e4m3", "floor")
    with pytest.raises(ValueError, match=r"dim 2 of shape \(2, 33, 48\) has size 48"):  # dim0: any row count
        gluon_casts.cast_dim0(torch.randn(2, 33, 48), "e4m3", "floor")
    with pytest.raises(ValueError, match=r"dim 1 of shape \(2, 33, 64\) has size 33"):
        gluon_casts.cast_dim1(torch.randn(2, 33, 64), "e4m3", "floor")
    with pytest.raises(TypeError, match="bf16 or fp32"):
        gluon_casts.cast_dim1(x.half(), "e4m3", "floor")
    for name in ("cast_dim0", "cast_dim1", "cast_dim0_dim1"):
        cast = getattr(gluon_casts, name)
        with pytest.raises(RuntimeError, match=f"gluon {name}: the Gluon kernels need a CUDA tensor"):
            cast(x, "e4m3", "floor")
        if name != "cast_dim0_dim1":
            with pytest.raises(RuntimeError, match="need a CUDA tensor"):
                cast(x.reshape(2, 32, 64), "e4m3", "floor", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for cast in (gluon_casts.cast_dim0_dim1, gluon_casts.cast_dim1, gluon_casts.cast_dim0):
        with pytest.raises(NotImplementedError, match="do not run in the Triton interpreter"):
            cast(x, "e4m3", "floor")


def test_groups_argument_errors(monkeypatch):
    x = torch.randn(96, 64, dtype=BF16)
    offs = torch.tensor([32, 96], dtype=torch.int32)
    cast = gluon_cast_groups.cast_groups_dim1
    with pytest.raises(ValueError, match=r"dim 0 of shape \(90, 64\) has size 90"):
        cast(torch.randn(90, 64), offs, "e4m3", "floor")
    with pytest.raises(ValueError, match="takes a 2D tensor"):
        cast(torch.randn(2, 96, 64), offs, "e4m3", "floor")
    with pytest.raises(ValueError, match="e2m1 is not supported"):
        cast(x, offs, "e2m1", "floor")
    for bad in (offs.long(), offs[:0], offs.reshape(1, 2)):
        with pytest.raises(ValueError, match="non-empty 1D int32"):
            cast(x, bad, "e4m3", "floor")
    with pytest.raises(RuntimeError, match="gluon cast_groups_dim1: the Gluon kernels need a CUDA tensor"):
        cast(x, offs, "e4m3", "floor")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(NotImplementedError, match="do not run in the Triton interpreter"):
        cast(x, offs, "e4m3", "floor")


def test_fake_quant_argument_errors(monkeypatch):
    x = torch.randn(64, 64, dtype=BF16)
    fq, groups = gluon_fake_quant.fake_quant_2d, gluon_fake_quant.fake_quant_groups_along_m
    with pytest.raises(ValueError, match="ask for along_k, along_m or both"):
        fq(x, "e4m3", "floor", False, False)
    with pytest.raises(ValueError, match=r"dim 1 of shape \(64, 48\) has size 48"):
        fq(torch.randn(64, 48, dtype=BF16), "e4m3", "floor", True, False)
    with pytest.raises(RuntimeError, match="need a CUDA tensor"):  # along M alone: any K, so no shape error
        fq(torch.randn(64, 48, dtype=BF16), "e4m3", "floor", False, True)
    with pytest.raises(ValueError, match="takes a 2D or 3D tensor"):
        fq(torch.randn(64), "e4m3", "floor", False, True)
    with pytest.raises(ValueError, match="e2m1 is not supported"):  # MXFP4 fake-quants are the Triton kernel's
        fq(x, "e2m1", "floor", True, True)
    with pytest.raises(ValueError, match="e2m1 is not supported"):
        groups(x, torch.zeros(64, dtype=torch.int32), "e2m1", "floor")
    with pytest.raises(ValueError, match="row_src must be 1D int32"):
        groups(x, torch.zeros(64, dtype=torch.int64), "e4m3", "floor")
    with pytest.raises(ValueError, match="row_src length 40 is not a multiple of 32"):
        groups(x, torch.zeros(40, dtype=torch.int32), "e4m3", "floor")
    with pytest.raises(RuntimeError, match="gluon fake_quant_2d: the Gluon kernels need a CUDA tensor"):
        fq(x, "e4m3", "floor", True, True)
    with pytest.raises(RuntimeError, match="need a CUDA tensor"):
        groups(x, torch.zeros(64, dtype=torch.int32), "e4m3", "floor")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(NotImplementedError, match="do not run in the Triton interpreter"):
        fq(x, "e4m3", "floor", True, True)


# ---------------------------------------------------------------------------------------
# CPU: launch facts


def cast_launch(x: torch.Tensor, dim0: bool, dim1: bool, k_first: bool) -> tuple[tuple[int, ...], dict]:
    u8 = meta(16, dtype=torch.uint8)
    return gluon_casts.kernel_launch(x, (u8,) * 4, "e4m3", "floor", dim0, dim1, k_first)


def test_cast_launch_grid_order_contig_and_evict():
    """K_FIRST swaps the grid to (K tiles, M tiles); CONTIG (x's row stride taken as K) only for row-major x;
    X_EVICT for the fused cast from EVICT_LAST_MIN_BYTES of x; a grid past CUDA's 65535 in y is refused."""
    x = meta(1024, 512)
    grid, kw = cast_launch(x, True, True, True)
    assert grid == (512 // 128, 1024 // 128) and kw["K_FIRST"] and kw["CONTIG"] and kw["EVEN"], kw
    assert kw["DIM0"] and kw["DIM1"] and not kw["BATCHED"] and not kw["OFFS64"] and kw["num_warps"] == 8, kw
    grid, kw = cast_launch(x, False, True, False)
    assert grid == (1024 // 128, 512 // 128) and not kw["K_FIRST"] and kw["CONTIG"] and not kw["DIM0"], kw
    for strided in (x.t(), x[:, :256], x[::2]):
        assert not cast_launch(strided, True, True, True)[1]["CONTIG"], strided.stride()
    assert cast_launch(x[:1], True, False, True)[1]["CONTIG"]  # one row: its stride is never used
    # scales are always blocked: the grid covers their padding (M and K to 128), masked where x ends
    grid, kw = cast_launch(meta(96, 160), True, True, True)
    assert grid == (2, 1) and not kw["EVEN"], kw
    big = meta(16384, 8192)
    assert big.numel() * 2 == gluon_casts.EVICT_LAST_MIN_BYTES
    evict = [cast_launch(t, True, dim1, True)[1]["X_EVICT"] for t, dim1 in ((big, True), (big[:8192], True))]
    evict += [cast_launch(big, dim0, not dim0, dim0)[1]["X_EVICT"] for dim0 in (True, False)]
    assert evict == ["evict_last", "", "", ""]
    with pytest.raises(ValueError, match=r"x \(8388736, 32\): 65537 tiles along M"):
        cast_launch(meta(8388736, 32), True, True, True)
    with pytest.raises(ValueError, match=r"x \(32, 8388736\): 65537 tiles along K"):
        cast_launch(meta(32, 8388736), False, True, False)


def test_cast_launch_batched():
    """3D x is BATCHED: the expert on grid axis 2, per-expert output strides (qdata M * K, scales one expert's
    blocked matrix), int32 offsets inside an expert unless one expert passes 2**31 elements; more than 65535
    experts are refused."""
    w = meta(3, 1024, 512)
    grid, kw = cast_launch(w, False, True, False)
    assert grid == (1024 // 128, 512 // 128, 3) and kw["BATCHED"] and kw["CONTIG"] and kw["EVEN"], kw
    assert (kw["M"], kw["K"], kw["stride_xb"], kw["stride_q1b"]) == (1024, 512, 1024 * 512, 1024 * 512)
    assert kw["stride_s1b"] == blocked_numel(512, 1024 // 32) and not kw["OFFS64"]
    grid, kw = cast_launch(w, True, False, True)
    assert grid == (512 // 128, 1024 // 128, 3) and (kw["stride_q0b"], kw["stride_s0b"]) == (1024 * 512, 1024 * 16)
    assert cast_launch(w[::2], False, True, False)[1]["stride_xb"] == 2 * 1024 * 512
    assert not cast_launch(w.transpose(1, 2), True, False, True)[1]["CONTIG"]
    grid, kw = cast_launch(meta(3, 224, 96), False, True, False)
    assert grid == (2, 1, 3) and not kw["EVEN"] and kw["stride_s1b"] == blocked_numel(96, 7), kw
    assert not cast_launch(meta(64, 8192, 5120), False, True, False)[1]["OFFS64"]  # E * N * K > 2**31
    assert cast_launch(meta(2, 65536, 32768), False, True, False)[1]["OFFS64"]  # 2**31 elements in one expert
    with pytest.raises(ValueError, match=r"x \(65536, 32, 32\): 65536 experts"):
        cast_launch(meta(65536, 32, 32), False, True, False)


@pytest.mark.parametrize(
    "name, k_first", [("NVIDIA H100 80GB HBM3", True), ("NVIDIA H100 NVL", True), ("NVIDIA H200", False)]
)
def test_3d_dim1_runs_k_first_on_the_listed_devices(monkeypatch, name, k_first):
    """3D dim1 runs along K first on the devices of DIM1_3D_K_FIRST_DEVICES (measured faster on an H100), along M
    elsewhere; 2D dim1 runs along M and dim0 and the fused cast along K everywhere. The device name is looked up
    once per device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert gluon_casts.DIM1_3D_K_FIRST_DEVICES == ("H100",)
    seen = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: seen.append(index) or name)
    runs = []

    def cast(x, elem, mode, blocked, dim0, dim1, k_first, op):
        runs.append((x.dim(), dim0, dim1, k_first))

    monkeypatch.setattr(gluon_casts, "_cast", cast)
    gluon_casts._dim1_3d_k_first.cache_clear()
    try:
        assert gluon_casts._dim1_3d_k_first(1) is k_first
        assert gluon_casts._dim1_3d_k_first(1) is k_first and seen == [1]
        with FakeTensorMode():  # CUDA tensors without a GPU: the launchers' own rule, the launch stubbed
            w = torch.empty(2, 64, 64, dtype=BF16, device="cuda")
            x = torch.empty(64, 64, dtype=BF16, device="cuda")
            gluon_casts.cast_dim1(w, "e4m3", "floor")
            gluon_casts.cast_dim1(x, "e4m3", "floor")
            gluon_casts.cast_dim0(w, "e4m3", "floor")
            gluon_casts.cast_dim0_dim1(x, "e4m3", "floor")
    finally:
        gluon_casts._dim1_3d_k_first.cache_clear()
    assert runs == [(3, False, True, k_first), (2, False, True, False), (3, True, False, True), (2, True, True, True)]


def test_groups_tile_follows_the_average_group_size():
    """LINES_TILE (128 x 128, whole-line stores) from LINES_MIN_ROWS rows a group on average, else SMALL_TILE."""
    tile_for, small, lines = gluon_cast_groups.tile_for, gluon_cast_groups.SMALL_TILE, gluon_cast_groups.LINES_TILE
    assert gluon_cast_groups.LINES_MIN_ROWS == 1024
    assert (small["NUM_SUB"], lines["NUM_SUB"], small["LINES"], lines["LINES"]) == (1, 4, False, True)
    assert tile_for(16640, 16) is lines  # 1040 rows a group
    assert tile_for(16640, 64) is small  # 260
    assert tile_for(1024, 1) is lines and tile_for(992, 1) is small
    assert tile_for(4096, 0) is lines  # no groups: as one


def groups_launch(m: int, k: int, num_groups: int, tile: dict | None = None) -> tuple[tuple[int, int], dict]:
    x, offs, u8 = meta(m, k), meta(num_groups, dtype=torch.int32), meta(16, dtype=torch.uint8)
    tile = tile or gluon_cast_groups.tile_for(m, num_groups)
    return gluon_cast_groups.kernel_launch(x, offs, u8, u8, "e4m3", "floor", tile)


def test_groups_launch_facts():
    """cdiv(M / 32, 4) + G tile columns, 4 / NUM_SUB programs each; K padded to 128 (MASK_COLS where the grid's
    columns pass K); the G-vector padded to a power of two."""
    small, lines = TILES["small"], TILES["lines"]

    def facts(m, k, num_groups, tile=None):
        grid, kw = groups_launch(m, k, num_groups, tile)
        return grid, kw["MASK_COLS"], kw["OFFS64"], kw["GROUPS_POW2"], kw["LINES"]

    assert facts(16640, 5120, 16, small) == ((4 * (130 + 16), 20), False, False, 16, False)
    assert facts(16640, 5120, 16) == ((130 + 16, 40), False, False, 16, True)  # 1040 rows a group: LINES
    assert facts(16640, 5120, 64) == ((4 * (130 + 64), 20), False, False, 64, False)
    assert facts(16640, 160, 5, lines) == ((130 + 5, 2), True, False, 8, True)
    assert facts(352, 96, 1) == ((4 * (3 + 1), 1), True, False, 1, False)  # K 96: one 256-column tile, masked
    assert facts(65536, 32768, 8)[2]  # 2**31 elements: int64 offsets
    _, kw = groups_launch(16640, 5120, 16)
    assert (kw["max_tile_cols"], kw["num_warps"]) == (130 + 16, 8)


def test_groups_lookup_is_packed_up_to_its_bound():
    """The packed lookup (16-bit fields) where M_total / 32 and the scale tile columns fit PACKED_MAX, else the
    counting one (both: test_packed_group_lookup_matches_the_counting_one, test_gpu_groups_lookups_agree)."""

    def packed(m: int, num_groups: int) -> bool:
        return groups_launch(m, 32, num_groups)[1]["PACKED"]

    assert gluon_cast_groups.PACKED_MAX == 2**16 - 1
    assert packed(16640, 16) and packed(16640, 64) and packed(2**21 - 32, 8)
    assert not packed(2**21, 8)  # M_total / 32 = 2**16
    assert not packed(2**18, 2**16 - 2**11)  # 2048 + 63488 = 2**16 tile columns


def many_groups(num_groups: int, seed: int) -> list[int]:
    """Random multiples of 32 rows (0 to 320), a third of them empty."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 11, (num_groups,), generator=g) * 32
    sizes[torch.randperm(num_groups, generator=g)[: num_groups // 3]] = 0
    return sizes.tolist()


def clamped_groups_model(ends: list[int], m: int) -> tuple[list[int], list[int]]:
    """The kernel's view of group ends: each clamped to [0, M] and rounded down to 32 rows, and the 128-row tile
    columns each group takes."""
    clamp = [min(max(e, 0), m) & -32 for e in ends]
    starts = [0] + clamp[:-1]
    return clamp, [(max(e - s, 0) + 127) >> 7 for s, e in zip(starts, clamp, strict=True)]


def group_lookup_model(t: int, clamp: list[int], tiles: list[int], max_tile_cols: int, packed: bool):
    """``_tile_column_group`` in Python: (tile_start, group_tiles, row_start, row_end) of tile column t, by the
    counting lookup (6 reductions) or the packed one (one owner lane, two int32 sums of 16-bit fields)."""
    num_groups = len(clamp)
    starts = [0] + clamp[:-1]
    tiles_end = list(itertools.accumulate(tiles))
    used = tiles_end[-1]
    if not packed:
        g = sum(te <= t for te in tiles_end)
        if g == num_groups:
            return used, max_tile_cols - used, 0, 0
        return tiles_end[g] - tiles[g], tiles[g], starts[g], clamp[g]
    first = [te - n for te, n in zip(tiles_end, tiles, strict=True)]
    owners = [h for h in range(num_groups) if first[h] <= t < tiles_end[h]]
    tail = used <= t
    assert len(owners) + tail <= 1, "two lanes would add their fields"
    fields = [(first[h] | tiles[h] << 16, starts[h] >> 5 | (clamp[h] >> 5) << 16) for h in owners]
    if tail:
        fields.append((used | (max_tile_cols - used) << 16, 0))
    for a, b in fields:  # PACKED_MAX bounds every field: the sums stay exact
        assert max(a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16) <= 0xFFFF and a >> 32 == 0 and b >> 32 == 0
    tile_fields, row_fields = sum(a for a, _ in fields), sum(b for _, b in fields)
    return tile_fields & 0xFFFF, tile_fields >> 16 & 0xFFFF, (row_fields & 0xFFFF) << 5, (row_fields >> 16) << 5


def walk_groups_model(scale: torch.Tensor, ends: list[int], m: int, k: int, tile: dict, packed: bool):
    """The per-group kernel's program walk with ``tile``, transcribed to Python (its index arithmetic line by
    line; the numerics are ``scale``, a plain [K, M/32] matrix): (the blocked scale buffer with -1 where no
    program wrote, how often each qdata element is stored). Raises on a store outside either buffer."""
    num_sub, lines = tile["NUM_SUB"], tile["LINES"]
    block_k = 8 * tile["ROWS"] * tile["NUM_WARPS"] * tile["REPS"]
    num_groups, split = len(ends), 4 // num_sub
    max_tile_cols = -(-(m // 32) // 4) + num_groups
    padded_k = -(-k // 128) * 128
    buf = torch.full((padded_k * 4 * max_tile_cols,), -1, dtype=torch.int32)
    q_writes = torch.zeros(k, m, dtype=torch.int32)
    clamp, tiles = clamped_groups_model(ends, m)
    for pid in range(max_tile_cols * split):
        t, part = divmod(pid, split)
        tile_start, group_tiles, row_start, row_end = group_lookup_model(t, clamp, tiles, max_tile_cols, packed)
        col_tile = t - tile_start
        row0 = row_start + col_tile * 128 + part * 32 * num_sub
        group_base = padded_k * 4 * tile_start
        left = max(min(padded_k * 4 * max_tile_cols - group_base, 2**31 - 1), 0)
        for pid_k in range(-(-padded_k // block_k)):
            r = pid_k * block_k + torch.arange(block_k)[None, :]
            sub = torch.arange(num_sub)[:, None]
            blocks = row0 + sub * 32
            valid = (blocks < row_end) & (r < k)
            c = col_tile * 4 + part * num_sub + sub
            offs = ((r >> 7) * group_tiles + (c >> 2)) * 512 + (r & 31) * 16 + ((r >> 5) & 3) * 4 + (c & 3)
            if lines:  # one mask per 16-byte row of the scale tile
                in_buffer = (offs & -16) + 16 <= left
            else:
                in_buffer = (offs < left) & (r < padded_k)
            src = scale[r.clamp(max=k - 1), (blocks // 32).clamp(0, max(m // 32 - 1, 0))] if m and k else 0
            values = torch.where(valid, torch.as_tensor(src, dtype=torch.int32), 0)
            targets = (group_base + offs)[in_buffer]
            assert bool(((targets >= 0) & (targets < buf.numel())).all()), "scale store out of bounds"
            buf[targets] = values.expand_as(offs)[in_buffer]
            for b in range(num_sub):  # the qdata store: rows [block, block + 32) below row_end, columns < K
                lo = row0 + 32 * b
                if lo < row_end:
                    assert 0 <= lo and lo + 32 <= m, "qdata store out of bounds"
                    q_writes[pid_k * block_k : min((pid_k + 1) * block_k, k), lo : lo + 32] += 1
    return buf, q_writes


@pytest.mark.parametrize("tile", list(TILES))
@pytest.mark.parametrize(
    "sizes, k",
    [([32, 0, 160, 0, 64], 96), ([0, 0, 4096, 256, 32, 0], 160), ([128] * 7 + [96], 300), ([1056, 1024, 0], 256),
     ([0], 64), ([64, 0, 0], 128)],
)  # fmt: skip
@pytest.mark.parametrize("packed", [False, True], ids=["counting", "packed"])
def test_groups_program_walk_model(sizes, k, tile, packed):
    """The walk's arithmetic, for either tile and either group lookup, writes every byte of the per-group blocked
    buffer once, with ``to_blocked_groups``'s bytes, and every qdata element once; for invalid offs it stays in
    bounds."""
    m = sum(sizes)
    g = torch.Generator().manual_seed(m + k)
    scale = torch.randint(1, 255, (k, m // 32), generator=g, dtype=torch.uint8)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    buf, q_writes = walk_groups_model(scale.to(torch.int32), offs.tolist(), m, k, TILES[tile], packed)
    assert bool((buf >= 0).all()), "bytes of the scale buffer no program wrote"
    assert_bits_equal(buf.to(torch.uint8), to_blocked_groups(scale, offs), f"walk {sizes} k={k}")
    assert bool((q_writes == 1).all()), "qdata elements stored twice or never"
    for bad in ([m, 0, m], [m + 64], [-32, m], [40, 200, m], [m] * 9):  # invalid offs: in bounds only
        walk_groups_model(scale.to(torch.int32), bad, m, k, TILES[tile], packed)


def test_packed_group_lookup_matches_the_counting_one():
    """For every tile column, valid and invalid offs (clamped as the kernel clamps them), up to the PACKED_MAX
    bounds: the packed lookup returns the counting lookup's four values."""
    gen = torch.Generator().manual_seed(3)
    cases = [[32, 0, 160, 0, 64], [0, 0, 4096, 256, 32, 0], [1056, 1024, 0], [0], [64, 0, 0]]
    cases += [many_groups(64, 5), many_groups(33, 6), [0] * 5 + [2**21 - 32 - 5 * 32] + [32] * 5]
    for sizes in cases:
        m = sum(sizes)
        ends = torch.tensor(sizes).cumsum(0).tolist()
        for bad in (False, True):
            if bad:  # decreasing, negative, past M and unaligned ends, as the kernel clamps them
                ends = torch.randint(-64, m + 256, (len(sizes),), generator=gen).tolist()
            clamp, tiles = clamped_groups_model(ends, m)
            max_tile_cols = -(-(m // 32) // 4) + len(sizes)
            assert max(m >> 5, max_tile_cols) <= gluon_cast_groups.PACKED_MAX
            for t in range(max_tile_cols):
                want = group_lookup_model(t, clamp, tiles, max_tile_cols, packed=False)
                assert group_lookup_model(t, clamp, tiles, max_tile_cols, packed=True) == want, (sizes, bad, t)


def test_fake_quant_launch_facts():
    """32 x 128 tiles; along M the grid walks the rows padded to 32; EVEN only where no mask is needed; OFFS64
    by one slice's offsets; the row gather walks row_src."""

    def facts(shape, along_k, along_m, gather_rows=None):
        x, out = meta(*shape), meta(16)
        src = None if gather_rows is None else meta(gather_rows, dtype=torch.int32)
        m = shape[-2] if src is None else gather_rows
        m_pad = -(-m // 32) * 32 if along_m else m
        grid, kw = gluon_fake_quant.kernel_launch(x, src, out, out, "e4m3", "floor", along_k, along_m, m, m_pad)
        return grid, kw["EVEN"], kw["OFFS64"], kw["GATHER"]

    assert facts((16384, 4096), True, True) == ((512, 32, 1), True, False, False)
    assert facts((4130, 160), True, True) == ((130, 2, 1), False, False, False)  # 4130 -> 4160 rows
    assert facts((4130, 160), True, False) == ((130, 2, 1), False, False, False)  # along K: rows < M only
    assert facts((64, 8192, 5120), True, True) == ((256, 40, 64), True, False, False)  # E * M * K > 2**31
    assert facts((65536, 32768), True, True)[2]  # 2**31 elements in one slice: int64 offsets
    assert facts((16640, 8192), False, True, gather_rows=18688) == ((584, 64, 1), False, False, True)
    xt = meta(512, 256).t()
    _, kw = gluon_fake_quant.kernel_launch(xt, None, meta(16), meta(16), "e4m3", "floor", True, True, 256, 256)
    assert (kw["stride_xm"], kw["stride_xk"], kw["num_warps"]) == (1, 256, 2)


# ---------------------------------------------------------------------------------------
# CPU: which launcher the custom ops call


@pytest.mark.parametrize("capability", [(9, 0), (10, 0), (8, 9)], ids=str)
@pytest.mark.parametrize("gluon_allowed", [True, False])
def test_kernel_choice_follows_the_capability_and_settings(pretend_gpu, capability, gluon_allowed):
    """Inside a custom op (``dispatch._kernel``): the Gluon launcher exactly for fp8 casts of bf16 on compute
    capability 9.x unless the kernel settings say gluon=False, else the Triton one (also for input the kernels
    refuse, which it names); for e2m1 the Gluon one only along M of bf16 read as words, else the Triton one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    pretend_gpu(capability)
    launchers = {(op, kind): dispatch.launcher(op, kind) for op in dispatch.OPS for kind in ("gluon", "triton")}
    gluon = capability[0] == 9 and gluon_allowed
    with FakeTensorMode(), kernel_settings(gluon=gluon_allowed):  # CUDA tensors without a GPU
        for dtype in (BF16, torch.float32):
            x = torch.empty(64, 64, dtype=dtype, device="cuda")
            for op, spec in dispatch.OPS.items():
                if dtype == BF16:
                    want = "gluon" if gluon else "triton"
                else:
                    want = "reference" if spec.bf16_only else "triton"
                assert dispatch.implementation(op, x, "e4m3") == want, (op, dtype)
                kind = "gluon" if want == "gluon" else "triton"
                assert dispatch._kernel(op, x, "e4m3") is launchers[op, kind], (op, dtype)
                # e2m1: the Triton kernels, but along M of bf16 (read as words) on Hopper
                fp4 = "gluon" if gluon and op == "cast_dim1" and dtype == BF16 else "triton"
                assert dispatch._kernel(op, x, "e2m1") is launchers[op, fp4], (op, dtype, "e2m1")
                assert dispatch._kernel(op, x.t(), "e2m1") is launchers[op, "triton"], (op, dtype, "e2m1 strided")


def reference_from_launcher_args(op: str, *args):
    """What ``op``'s launcher returns, from the launcher's own arguments (their order differs from the op's)."""
    ref = dispatch.OPS[op].reference
    if op in ("cast_groups_dim1", "fake_quant_groups_along_m", "fake_quant_groups"):
        x, offs_or_src, elem, mode = args
        return ref(x, elem, mode, offs_or_src)
    return ref(*args)


def same_args(got: tuple, want: tuple) -> bool:
    """The same arguments, tensors by storage and shape."""
    if len(got) != len(want):
        return False
    for a, b in zip(got, want, strict=True):
        if isinstance(b, torch.Tensor):
            if not (isinstance(a, torch.Tensor) and a.data_ptr() == b.data_ptr() and a.shape == b.shape):
                return False
        elif a != b or type(a) is not type(b):
            return False
    return True


@pytest.mark.parametrize("kind", ["gluon", "triton", "reference"])
def test_custom_ops_call_the_launcher_the_rule_names(monkeypatch, kind):
    """Each custom op (and the public API through it) calls the Gluon launcher exactly when the rule says
    "gluon", else the Triton one, with the caller's arguments, and returns what the launcher returns."""
    calls = []

    def launcher(op: str, impl: str) -> Callable:
        def launch(*args):
            calls.append((op, impl, args))
            return reference_from_launcher_args(op, *args)

        return launch

    monkeypatch.setattr(dispatch, "launcher", launcher)
    monkeypatch.setattr(dispatch, "implementation", lambda op, x, elem, rounding="nearest": kind)
    impl = "gluon" if kind == "gluon" else "triton"
    x, w = special_input((96, 64), BF16, "cpu"), special_input((2, 64, 96), BF16, "cpu", seed=1)
    xs = special_input((64, 96), BF16, "cpu", seed=2)
    offs, src = torch.tensor([32, 96], dtype=torch.int32), group_sources([40, 0, 24], "cpu")
    ops = torch.ops.mx_recipe
    cases = [  # (the call, the op, the launcher's arguments)
        (lambda: ops.cast_dim0(x, "e5m2", "rceil", True), "cast_dim0", (x, "e5m2", "rceil", True)),
        (lambda: ops.cast_dim1(w, "e4m3", "floor", False), "cast_dim1", (w, "e4m3", "floor", False)),
        (lambda: ops.cast_dim0_dim1(x, "e4m3", "rceil", False), "cast_dim0_dim1", (x, "e4m3", "rceil", False)),
        (lambda: ops.cast_groups_dim1(x, "e5m2", "floor", offs), "cast_groups_dim1", (x, offs, "e5m2", "floor")),
        (
            lambda: ops.fake_quant_2d(w, "e4m3", "rceil", False, True),
            "fake_quant_2d", (w, "e4m3", "rceil", False, True),
        ),
        (
            lambda: ops.fake_quant_groups_along_m(xs, "e5m2", "floor", src),
            "fake_quant_groups_along_m", (xs, src, "e5m2", "floor"),
        ),
    ]  # fmt: skip
    if kind != "reference":  # the public API takes the reference itself where the rule says so
        cases += [
            (lambda: mx_cast.cast_3d_dim1(w, "e5m2", "rceil", True), "cast_dim1", (w, "e5m2", "rceil", True)),
            (
                lambda: mx_cast.cast_groups_dim1(x, offs, "e4m3", "rceil", blocked_scales=True),
                "cast_groups_dim1", (x, offs, "e4m3", "rceil"),
            ),
            (
                lambda: mx_cast.fake_quant_dim0_dim1(x, "e5m2", "floor"),
                "fake_quant_2d", (x, "e5m2", "floor", True, True),
            ),
            (
                lambda: mx_cast.fake_quant_groups_along_m(xs, src, "e4m3", "floor"),
                "fake_quant_groups_along_m", (xs, src, "e4m3", "floor"),
            ),
        ]  # fmt: skip
    for call, op, args in cases:
        calls.clear()
        out = call()
        assert len(calls) == 1 and calls[0][:2] == (op, impl), (op, calls)
        assert same_args(calls[0][2], args), (op, calls[0][2])
        want = reference_from_launcher_args(op, *args)
        for i, (a, b) in enumerate(zip(tensors(out), tensors(want), strict=True)):
            assert_bits_equal(a, b, f"{op} output {i}")


def tensors(out) -> list[torch.Tensor]:
    """The tensors of a cast's or fake-quant's result, in order (MX tensors as qdata, scale)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (MXTensor, BlockedMXTensor)):
        return [out.qdata, out.scale]
    return [t for part in out for t in tensors(part)]


# ---------------------------------------------------------------------------------------
# CPU: the kernels compiled for sm_90 without a GPU


def ptx_ops(ptx: str) -> dict[str, int]:
    """Counts of the memory, barrier, shuffle and fp8-conversion instructions in PTX."""
    found = re.findall(
        r"\b(?:ld|st)\.(?:global|shared|local)[\w.:]*|\bbar\.sync|\bshfl\.sync[\w.]*|\bcvt\.rn\.satfinite[\w.]*", ptx
    )
    return {op: found.count(op) for op in sorted(set(found))}


def resource_usage(cubin: bytes) -> dict[str, int] | None:
    """REG, SHARED, LOCAL of the kernel from cuobjdump (None where the tool is missing)."""
    import triton

    tool = triton.knobs.nvidia.cuobjdump.path
    if not tool or not Path(tool).exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|SHARED|LOCAL):(\d+)", out)}


def check_compiled(kernel, elem: str, what: str, max_reg: int = 255) -> dict[str, int]:
    """What every Gluon kernel compiles to: the hardware fp8 conversion, block maxima by warp shuffles, no
    flush of subnormals (inputs and the 2**-127 factor), no local memory (no spills), at most ``max_reg``
    registers. Returns the PTX's counts."""
    ptx = kernel.asm["ptx"]
    ops = ptx_ops(ptx)
    what = f"{what}: {ops}"
    assert ops.get(f"cvt.rn.satfinite.{elem}x2.f32", 0) > 0, what
    assert ops.get("shfl.sync.bfly.b32", 0) > 0, what
    assert ".ftz" not in ptx, what
    assert not any(".local" in op for op in ops), what
    usage = resource_usage(kernel.asm["cubin"])
    if usage is not None:
        assert usage["LOCAL"] == 0 and usage["REG"] <= max_reg, f"{what} {usage}"
    return ops


def loads_and_stores(ops: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    return (
        {op: n for op, n in ops.items() if op.startswith("ld.global")},
        {op: n for op, n in ops.items() if op.startswith("st.global")},
    )


LOAD, LOAD_EVICT_LAST = "ld.global.v4.b32", "ld.global.L1::evict_last.L2::cache_hint.v4.b32"
CAST_COMPILES = [
    # (shape, dtype, elem, mode, dim0, dim1, k_first, x load)
    ((16384, 16384), BF16, "e4m3", "floor", True, True, True, LOAD_EVICT_LAST),  # 512 MiB of x: evict_last
    ((16384, 16384), BF16, "e5m2", "rceil", False, True, False, LOAD),
    ((16384, 16384), BF16, "e4m3", "rceil", True, False, True, LOAD),
    ((96, 160), BF16, "e5m2", "floor", True, True, True, LOAD),  # ragged: masks
    ((4096, 4096), torch.float32, "e4m3", "floor", True, True, True, LOAD),
    ((16, 8192, 5120), BF16, "e5m2", "floor", False, True, False, LOAD),
    ((16, 8192, 5120), BF16, "e4m3", "rceil", False, True, True, LOAD),  # 3D dim1 along K first (H100)
    ((16, 8192, 5120), BF16, "e4m3", "floor", True, False, True, LOAD),
]


@pytest.mark.parametrize("shape, dtype, elem, mode, dim0, dim1, k_first, x_load", CAST_COMPILES)
def test_cast_compiles_to_whole_line_stores(shape, dtype, elem, mode, dim0, dim1, k_first, x_load):
    """Each thread loads its 128 bytes of x as 16-byte loads, and every output leaves as 16-byte stores: 4 for
    each 64-byte share of q0 rows / q1 k-rows (whole 128-byte lines per 8 lanes), one 16-byte row of each
    blocked scale tile; at most 128 registers (2 programs of 8 warps per SM). The same per expert and along
    either grid order."""
    kernel = gluon_casts.compile_for_target(shape, dtype, elem, mode, dim0, dim1, k_first, arch=90)
    what = f"cast {shape} {dtype} {elem} {mode} dim0={dim0} dim1={dim1} k_first={k_first}"
    loads, stores = loads_and_stores(check_compiled(kernel, elem, what, max_reg=128))
    assert loads == {x_load: 8 if dtype == BF16 else 16}, what  # 4 fp32 or 8 bf16 a load
    assert stores == {"st.global.v4.b32": 10 if dim0 and dim1 else 5}, what


GROUPS_COMPILES = [
    # (shape, groups, elem, mode, tile (None: tile_for's), the q store)
    ((16640, 5120), 16, "e4m3", "floor", "small", "st.global.v2.b32"),
    ((16640, 5120), 64, "e5m2", "rceil", None, "st.global.v2.b32"),  # 260 rows a group: the small tile
    ((16640, 160), 5, "e4m3", "rceil", "small", "st.global.v2.b32"),  # masked columns
    ((16640, 5120), 16, "e5m2", "floor", None, "st.global.v4.b32"),  # 1040 rows a group: LINES
]


@pytest.mark.parametrize("shape, groups, elem, mode, tile, q_store", GROUPS_COMPILES)
def test_groups_compiles_for_sm90(shape, groups, elem, mode, tile, q_store):
    """16-byte loads of x (8 a thread) and at most 4 small loads of offs; the group scan in shfl.up steps (log2 of
    the padded group count, up to 32 groups); the small tile: 8 contiguous bytes of [K, M] a thread and column,
    no shared memory, no barrier, at most 96 registers (Triton 3.6: 60-80); LINES: only 16-byte stores."""
    kernel = gluon_cast_groups.compile_for_target(shape, groups, BF16, elem, mode, TILES.get(tile), arch=90)
    what = f"groups {shape} G={groups} {elem} {mode} {tile}"
    ops = check_compiled(kernel, elem, what, max_reg=96)
    loads, stores = loads_and_stores(ops)
    assert loads.pop(LOAD) == 8, what
    assert set(loads) <= {"ld.global.b32", "ld.global.v2.b32"} and sum(loads.values()) <= 4, what
    if groups <= 32:
        assert ops.get("shfl.sync.up.b32", 0) == (groups - 1).bit_length(), what
    if (TILES[tile] if tile else gluon_cast_groups.tile_for(shape[0], groups))["LINES"]:
        assert stores == {"st.global.v4.b32": 5}, what
    else:
        assert stores.get(q_store, 0) == 8 and set(stores) <= {q_store, "st.global.b8"}, what
        assert "bar.sync" not in ops and not any(".shared" in op for op in ops), what


FAKE_QUANT_COMPILES = [
    # (shape, along_k, along_m, elem, mode, gather_rows)
    ((16384, 4096), True, True, "e4m3", "floor", None),
    ((16384, 4096), False, True, "e5m2", "rceil", None),
    ((16384, 4096), True, False, "e4m3", "rceil", None),
    ((64, 8192, 5120), True, True, "e5m2", "floor", None),
    ((4130, 160), True, True, "e4m3", "floor", None),  # ragged M: masks
    ((16640, 8192), False, True, "e4m3", "floor", 18688),  # row gather / scatter
]


@pytest.mark.parametrize("shape, along_k, along_m, elem, mode, gather_rows", FAKE_QUANT_COMPILES)
def test_fake_quant_compiles_for_sm90(shape, along_k, along_m, elem, mode, gather_rows):
    """16-byte loads and stores only (8 bf16 a thread and register row), no shared memory, no barrier (both
    reductions in registers and shuffles), the hardware fp8 conversions both ways, bf16 results rounded to
    nearest even."""
    kernel = gluon_fake_quant.compile_for_target(shape, elem, mode, along_k, along_m, gather_rows, arch=90)
    what = f"fake quant {shape} along_k={along_k} along_m={along_m} {elem} {mode} gather={gather_rows}"
    ops = check_compiled(kernel, elem, what)
    loads, stores = loads_and_stores(ops)
    assert set(loads) == {LOAD} and set(stores) == {"st.global.v4.b32"}, what
    assert stores["st.global.v4.b32"] == 8 * (along_k + along_m), what
    assert "bar.sync" not in ops and not any(".shared" in op for op in ops), what
    ptx = kernel.asm["ptx"]
    assert f"cvt.rn.f16x2.{elem}x2" in ptx and "cvt.rn.bf16x2.f32" in ptx, what
    usage = resource_usage(kernel.asm["cubin"])
    if usage is not None:
        assert usage["SHARED"] == 0, f"{what} {usage}"


def int64_tensor_offsets(kernel) -> int:
    """Pointer arithmetic on tensors of int64 offsets in the kernel's TTGIR (scalar int64 bases not counted)."""
    return len(re.findall(r"tt\.addptr [^\n]*tensor<[^>]*xi64", kernel.asm["ttgir"]))


INT64_COMPILES = {  # kernel: (compile, a shape under 2**31 elements a slice, one at 2**31)
    "cast fused": (lambda s: gluon_casts.compile_for_target(s), (16384, 16384), (65536, 32768)),
    "cast 3d dim1": (
        lambda s: gluon_casts.compile_for_target(s, dim0=False, k_first=False), (64, 8192, 5120), (2, 65536, 32768)
    ),
    "groups small": (lambda s: gluon_cast_groups.compile_for_target(s, 8, tile=TILES["small"]), (16640, 5120),
                     (65536, 32768)),
    "groups lines": (lambda s: gluon_cast_groups.compile_for_target(s, 8, tile=TILES["lines"]), (16640, 5120),
                     (65536, 32768)),
    "fake quant": (lambda s: gluon_fake_quant.compile_for_target(s), (16384, 4096), (65536, 32768)),
    "fake quant gather": (
        lambda s: gluon_fake_quant.compile_for_target(s, along_k=False, gather_rows=s[0]), (16640, 8192),
        (65536, 32768),
    ),
}  # fmt: skip


@pytest.mark.parametrize("kernel", list(INT64_COMPILES))
def test_int64_offsets_only_past_2_31_elements(kernel):
    """OFFS64: a slice of 2**31 elements compiles with int64 tensor offsets (it did not, with two differently
    typed returns in ``wide``), and below that the offsets stay int32 (cheaper address math), per expert too."""
    compile_for, small, large = INT64_COMPILES[kernel]
    assert int64_tensor_offsets(compile_for(small)) == 0
    assert int64_tensor_offsets(compile_for(large)) > 0


# ---------------------------------------------------------------------------------------
# GPU (Hopper): against to_mx and the Triton kernels


def special_input_plus(shape: tuple[int, int], dtype: torch.dtype, device, seed: int = 0) -> torch.Tensor:
    """``special_input`` plus what the Gluon paths add cases for: a negative NaN with a payload (a NaN block's
    bytes come out of cvt), an all-subnormal dim1 block, an all -inf dim1 block."""
    x = special_input(shape, dtype, "cpu", seed)
    m, k = shape
    if m >= 96 and k >= 128:
        bits = x.view(torch.int16 if dtype == BF16 else torch.int32)
        bits[40, 100] = -63 if dtype == BF16 else -4194303  # 0xFFC1 / 0xFFC00001
        x[32:64, 101] = torch.linspace(-3e-39, 5e-39, 32).to(dtype)  # bf16 and fp32 subnormals
        x[64:96, 102] = -float("inf")
    return x.to(device)


def special_3d(shape: tuple[int, int, int], dtype: torch.dtype = BF16, seed: int = 0) -> torch.Tensor:
    """``special_input_plus`` per expert (different data per expert), on the GPU."""
    e, n, k = shape
    experts = [special_input_plus((n, k), dtype, "cpu", seed + i) for i in range(e)]
    return (torch.stack(experts) if experts else torch.empty(shape, dtype=dtype)).cuda()


def gluon(op: str) -> Callable:
    return dispatch.launcher(op, "gluon")


def triton(op: str) -> Callable:
    return dispatch.launcher(op, "triton")


def cast_ops(shape: tuple[int, ...]) -> list[str]:
    """The casts a shape allows: dim0 where K % 32 == 0, dim1 where M % 32 == 0, the fused cast (2D) where both."""
    ops = [op for op, size in (("cast_dim0", shape[-1]), ("cast_dim1", shape[-2])) if size % 32 == 0]
    return ops + ["cast_dim0_dim1"] if len(shape) == 2 and len(ops) == 2 else ops


def cast_refs(x: torch.Tensor, elem: str, mode: str, blocked: bool) -> dict[str, list[torch.Tensor]]:
    """The reference outputs of each cast of ``cast_ops``."""
    block = to_blocked if x.dim() == 2 else to_blocked_3d
    refs = {}
    for op in cast_ops(tuple(x.shape)):
        if op == "cast_dim0_dim1":
            refs[op] = refs["cast_dim0"] + refs["cast_dim1"]
            continue
        ref = to_mx(x.cpu() if op == "cast_dim0" else x.cpu().transpose(-2, -1).contiguous(), elem, mode, dim=-1)
        refs[op] = [ref.qdata, block(ref.scale) if blocked else ref.scale]
    return refs


def check_casts(x: torch.Tensor, elem: str, mode: str, blocked: bool, what: str) -> None:
    """Every Gluon cast x's shape allows, against ``to_mx`` and the Triton kernel, byte for byte."""
    refs = cast_refs(x, elem, mode, blocked)
    assert refs, what
    for op, ref in refs.items():
        got, want = gluon(op)(x, elem, mode, blocked), triton(op)(x, elem, mode, blocked)
        label = f"{what} {op} {tuple(x.shape)} {x.dtype} {elem} {mode} blocked={blocked}"
        for i, (g, r, t) in enumerate(zip(got, ref, want, strict=True)):
            assert g.dtype == t.dtype, f"{label} output {i}: {g.dtype} != {t.dtype}"
            assert_bits_equal(g, r, f"{label} output {i}")
            assert_bits_equal(g, t, f"{label} output {i} vs triton")


def groups_with_tile(x: torch.Tensor, offs: torch.Tensor, elem: str, mode: str, tile: dict):
    """The Gluon per-group cast with ``tile`` in place of tile_for's choice."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gluon_cast_groups, "tile_for", lambda m, num_groups: tile)
        return gluon_cast_groups.cast_groups_dim1(x, offs, elem, mode)


def check_groups(x: torch.Tensor, sizes: list[int], elem: str, mode: str, tile: dict, what: str) -> None:
    """The Gluon per-group cast with ``tile`` against ``to_mx``, ``to_blocked_groups`` and the Triton kernel
    (that each group's columns are its own dim1 cast: test_cast_kernels.check_groups)."""
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
    what = f"{what} {sizes} K={x.shape[1]} {x.dtype} {elem} {mode} lines={tile['LINES']}"
    q, s = groups_with_tile(x, offs.to(x.device), elem, mode, tile)
    ref = to_mx(x.cpu().t().contiguous(), elem, mode, dim=-1)
    assert q.dtype == ref.qdata.dtype and s.dtype == torch.float8_e8m0fnu, what
    assert_bits_equal(q, ref.qdata, what + " qdata")
    assert_bits_equal(s, to_blocked_groups(ref.scale, offs), what + " scale")
    if x.shape[0]:  # (M_total = 0: the reference only)
        tq, ts = triton("cast_groups_dim1")(x, offs.to(x.device), elem, mode)
        assert_bits_equal(q, tq, what + " qdata vs triton")
        assert_bits_equal(s, ts, what + " scale vs triton")


def check_fake_quant(x: torch.Tensor, elem: str, mode: str, what: str) -> None:
    """Both results (and each alone) against the Triton kernel (bytes, NaN payloads included: the same math on
    the same GPU) and the reference (values, NaN positions)."""
    what = f"{what} {tuple(x.shape)} {elem} {mode}"
    fq, tfq = gluon("fake_quant_2d"), triton("fake_quant_2d")
    ref_m = ref_along_m(x, elem, mode)
    if x.shape[-1] % 32 == 0:
        ref_k = to_mx(x.cpu(), elem, mode, dim=-1).dequantize(BF16)
        (gk, gm), (tk, tm) = fq(x, elem, mode, True, True), tfq(x, elem, mode, True, True)
        assert_bits_equal(gk, tk, what + " along K vs triton")
        assert_bits_equal(gm, tm, what + " along M vs triton")
        assert_values_equal(gk, ref_k, what + " along K vs reference")
        assert_values_equal(gm, ref_m, what + " along M vs reference")
        gk, gm = fq(x, elem, mode, True, False)
        assert gm.numel() == 0
        assert_bits_equal(gk, tk, what + " along K alone vs triton")
    (gk, gm), (_, tm) = fq(x, elem, mode, False, True), tfq(x, elem, mode, False, True)
    assert gk.numel() == 0
    assert_bits_equal(gm, tm, what + " along M alone vs triton")
    assert_values_equal(gm, ref_m, what + " along M alone vs reference")


def check_groups_along_m(x: torch.Tensor, src: torch.Tensor, elem: str, mode: str, what: str) -> None:
    got = gluon("fake_quant_groups_along_m")(x, src, elem, mode)
    assert_bits_equal(got, triton("fake_quant_groups_along_m")(x, src, elem, mode), what + " vs triton")
    assert_values_equal(got, ref_groups_along_m(x, src, elem, mode), what + " vs reference")


SHAPES_2D = [(1, 96), (32, 33), (33, 64), (64, 100), (96, 160), (256, 512), (4128, 160), (160, 4128), (1024, 4096)]
SHAPES_3D = [(1, 96, 160), (3, 224, 96), (2, 64, 100), (2, 4128, 160), (1, 160, 4128), (3, 33, 96), (2, 1, 160)]
GROUP_CASES = [
    ([32, 0, 160, 0, 64], 96),  # empty groups in the middle; K < 128
    ([0, 0, 4096, 256, 32, 0], 160),  # empty first and last
    ([128] * 7 + [96], 4128),  # K past a tile; a group ending inside a 128-row tile column
    ([0, 64, 96], 100),  # K % 32 != 0, empty first group
    ([1056, 1024, 1056, 0], 512),  # 1056 = 8 * 128 + 32: a last tile column of one block
    ([64, 0, 0], 256),  # empty last groups
    ([4128], 384),  # one group
]
FAKE_QUANT_SHAPES = [(96, 160), (4130, 160), (160, 4128), (1024, 4096), (3, 224, 96), (5, 100, 256), (64, 80)]


# The GPU tests below take the scale rules and formats in turn, one a case: each combination compiles its own
# kernels, and test_cast_kernels runs every combination on every kernel, under both implementations.


@pytest.mark.gpu
@hopper
def test_gpu_casts_special_values():
    """The 2D and 3D casts, each side and fused, both scale layouts, ragged shapes, on the special values."""
    for seed, shape in enumerate(SHAPES_2D + SHAPES_3D):
        x = special_input_plus(shape, BF16, "cuda", seed) if len(shape) == 2 else special_3d(shape, BF16, seed)
        mode, elem = RULES_AND_FORMATS[seed % 4]
        for blocked in (False, True):
            check_casts(x, elem, mode, blocked, "special values")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("tile", list(TILES))
def test_gpu_groups_both_tiles(tile):
    """Both per-group tiles, whatever tile_for would pick for the shape: empty groups first, in the middle and
    last, ragged K, groups ending inside a tile column, many random groups."""
    cases = GROUP_CASES + [(many_groups(33, 1), 256), (many_groups(64, 2), 160)]
    for seed, (sizes, k) in enumerate(cases):
        x = special_input_plus((sum(sizes), k), BF16, "cuda", seed)
        mode, elem = RULES_AND_FORMATS[seed % 4]
        check_groups(x, sizes, elem, mode, TILES[tile], "groups")


@pytest.mark.gpu
@hopper
def test_gpu_fake_quant_matches_triton():
    """Both fake-quants against the Triton kernel's bytes (NaN payloads included) and the reference's values."""
    for seed, shape in enumerate(FAKE_QUANT_SHAPES):
        mode, elem = RULES_AND_FORMATS[seed % 4]
        check_fake_quant(special_input(shape, BF16, "cuda", seed), elem, mode, "fake quant")
    for seed, sizes in enumerate(([40, 0, 33, 1, 64], [1040] * 4 + [0, 7], [0, 0], [4096])):
        mode, elem = RULES_AND_FORMATS[seed % 4]
        for flip in (False, True):
            x = special_input((sum(sizes), 256), BF16, "cuda", seed=len(sizes))
            src = group_sources(sizes, "cuda")
            if flip and sizes[0]:  # the first group's rows listed in reverse: each still comes back home
                src[: sizes[0]] = src[: sizes[0]].flip(0)
            check_groups_along_m(x, src, elem, mode, f"groups along M {sizes} flip={flip} {elem} {mode}")


@pytest.mark.gpu
@hopper
def test_gpu_every_bf16_value():
    """All 65536 bf16 patterns (NaNs of every payload and sign, infinities, subnormals) through the 3D casts, both
    per-group tiles and the fake-quant (the 2D casts: test_cast_kernels.test_gpu_every_bf16_value_and_rejections)."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(BF16)
    for mode, elem in RULES_AND_FORMATS:  # (every value is a rounding case: all combinations here)
        check_casts(x.reshape(2, 256, 128).cuda(), elem, mode, True, "all bf16")
        for tile in TILES.values():
            check_groups(x.reshape(512, 128).cuda(), [96, 0, 320, 96], elem, mode, tile, "all bf16")
        for t in (x.reshape(-1, 512), x.reshape(512, -1)):  # blocks along K, then along M
            check_fake_quant(t.cuda(), elem, mode, "all bf16")


@pytest.mark.gpu
@hopper
def test_gpu_strided_input_and_empty():
    x = special_input_plus((256, 512), BF16, "cuda")
    check_casts(x.t(), "e4m3", "rceil", False, "transposed")  # [512, 256], stride (1, 512): scalar loads
    check_casts(x[:, :96], "e5m2", "floor", True, "row stride 512")
    base = special_3d((3, 160, 224))
    check_casts(base.transpose(1, 2), "e4m3", "rceil", True, "3d transposed")  # [3, 224, 160], K stride 224
    check_casts(base[:, :, :96], "e5m2", "floor", False, "3d row stride 224")
    check_casts(special_3d((6, 128, 256))[::2], "e4m3", "floor", True, "3d every other expert")
    xg = special_input_plus((256, 416), BF16, "cuda")
    for tile in TILES.values():
        check_groups(xg.t().contiguous().t(), [64, 0, 192], "e4m3", "floor", tile, "groups column-major")
        check_groups(xg[:, :160], [0, 256], "e5m2", "rceil", tile, "groups row stride 416")
        # M_total = 0: the scale buffer (one tile column per group) is all zeros
        check_groups(torch.empty(0, 96, device="cuda", dtype=BF16), [0, 0], "e4m3", "floor", tile, "M=0")
    check_fake_quant(x.t(), "e4m3", "rceil", "fake quant transposed")
    check_fake_quant(x[:, :384], "e5m2", "floor", "fake quant row stride 512")
    for shape in ((0, 64), (64, 0), (5, 0), (0, 64, 96), (2, 0, 96), (2, 64, 0)):
        empty = torch.empty(shape, device="cuda", dtype=BF16)
        for op in cast_ops(shape):
            for blocked in (False, True):
                got, want = gluon(op)(empty, "e4m3", "floor", blocked), triton(op)(empty, "e4m3", "floor", blocked)
                assert [t.shape for t in got] == [t.shape for t in want], (op, shape, blocked)
    offs = torch.tensor([64], dtype=torch.int32, device="cuda")
    q, s = gluon_cast_groups.cast_groups_dim1(torch.empty(64, 0, device="cuda", dtype=BF16), offs, "e4m3", "floor")
    assert q.shape == (0, 64) and s.numel() == 0
    k, m = gluon_fake_quant.fake_quant_2d(torch.empty(0, 64, device="cuda", dtype=BF16), "e4m3", "floor", True, True)
    assert k.shape == (0, 64) and m.shape == (0, 64)


@pytest.mark.gpu
@hopper
def test_gpu_launcher_refusals():
    """offs on another device than x, and fp32 input to the fake-quant (the Gluon kernel takes bf16)."""
    x = special_input((96, 64), BF16, "cuda")
    with pytest.raises(ValueError, match="offs is on cpu, x on cuda"):
        gluon_cast_groups.cast_groups_dim1(x, torch.tensor([32, 96], dtype=torch.int32), "e4m3", "floor")
    with pytest.raises(NotImplementedError, match="the Gluon kernel takes bf16 input"):
        gluon_fake_quant.fake_quant_2d(x.float(), "e4m3", "floor", True, True)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("tile", list(TILES))
def test_gpu_groups_lookups_agree(tile):
    """The packed group lookup (every launch up to PACKED_MAX) and the counting one (past it) write the same
    bytes, for valid offs; for invalid ones neither faults."""
    cases = GROUP_CASES + [(many_groups(33, 1), 256), (many_groups(64, 2), 160)]
    kernel = gluon_cast_groups._gluon_cast_groups_dim1_kernel
    for seed, (sizes, k) in enumerate(cases):
        x = special_input_plus((sum(sizes), k), BF16, "cuda", seed)
        offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
        q_shape, s_shape = groups_dim1_shapes(x.shape, offs.numel(), blocked=True)
        outs = []
        for packed in (True, False):
            q = torch.full(q_shape, 7, dtype=torch.uint8, device="cuda")
            s = torch.full(s_shape, 7, dtype=torch.uint8, device="cuda")
            grid, kw = gluon_cast_groups.kernel_launch(x, offs, q, s, "e4m3", "rceil", TILES[tile])
            assert kw["PACKED"]
            kernel[grid](**{**kw, "PACKED": packed})
            outs.append((q, s))
        assert_bits_equal(outs[0][0], outs[1][0], f"{sizes} qdata")
        assert_bits_equal(outs[0][1], outs[1][1], f"{sizes} scale")
    x = special_input((256, 160), BF16, "cuda")
    q_shape, s_shape = groups_dim1_shapes(x.shape, 3, blocked=True)
    q = torch.empty(q_shape, dtype=torch.uint8, device="cuda")
    for ends in ([256, 0, 256], [-32, 256, 512], [40, 200, 256]):
        offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
        s = torch.empty(s_shape, dtype=torch.uint8, device="cuda")
        grid, kw = gluon_cast_groups.kernel_launch(x, offs, q, s, "e4m3", "floor", TILES[tile])
        for packed in (True, False):
            kernel[grid](**{**kw, "PACKED": packed})
    torch.cuda.synchronize()


@pytest.mark.gpu
@hopper
def test_gpu_invalid_offs_do_not_fault():
    """Offs that break the contract (decreasing, past M_total, negative, not multiples of 32): unspecified
    values, but no illegal access (which would poison the CUDA context), with either tile."""
    x = special_input((256, 160), BF16, "cuda")
    for ends in ([256, 0, 256], [512], [-32, 256], [40, 200, 256], [256] * 40, [0, 0, 0]):
        offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
        gluon_cast_groups.cast_groups_dim1(x, offs, "e4m3", "floor")
        for tile in TILES.values():
            groups_with_tile(x, offs, "e4m3", "floor", tile)
    torch.cuda.synchronize()
    check_groups(x, [128, 128], "e4m3", "floor", TILES["small"], "after invalid offs")  # the context still works


@pytest.mark.gpu
@hopper
def test_gpu_no_host_sync():
    """No Gluon launcher waits for the device (offs and row_src stay there): torch's sync debug mode raises on a
    sync."""
    w = special_3d((2, 128, 256))
    x = special_input((256, 256), BF16, "cuda")
    offs = torch.tensor([96, 96, 256], dtype=torch.int32, device="cuda")
    src = group_sources([100, 0, 124], "cuda")
    calls = [
        lambda: gluon_casts.cast_dim1(w, "e4m3", "floor", True),
        lambda: gluon_casts.cast_dim1(w, "e4m3", "floor", False),  # plain: blocked, then unblock_scales
        lambda: gluon_casts.cast_dim0(w, "e4m3", "floor", True),
        lambda: gluon_casts.cast_dim0(w, "e4m3", "floor", False),
        lambda: gluon_casts.cast_dim0_dim1(x, "e4m3", "floor", False),
        lambda: gluon_cast_groups.cast_groups_dim1(x, offs, "e4m3", "floor"),
        lambda: groups_with_tile(x, offs, "e4m3", "floor", TILES["lines"]),
        lambda: gluon_fake_quant.fake_quant_2d(x, "e4m3", "floor", True, True),
        lambda: gluon_fake_quant.fake_quant_groups_along_m(x[:224], src, "e4m3", "floor"),
    ]
    for call in calls:
        call()  # compiled outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls:
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def assert_same_bytes(got, want, what: str) -> None:
    for i, (a, b) in enumerate(zip(tensors(got), tensors(want), strict=True)):
        assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{what} output {i}"


@pytest.mark.gpu
@hopper
def test_gpu_large_fused_loads_evict_last_and_matches_triton():
    """From EVICT_LAST_MIN_BYTES of x (256 MiB) the fused kernel loads x with evict_last: the Triton fused
    kernel's bytes, both scale layouts, with special values at the tile edges."""
    x = torch.randn(16384, 8192, device="cuda", dtype=BF16) * 4
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40])
    x[-1, -1], x[127, 127] = 0.0, 3e38
    assert x.nbytes >= gluon_casts.EVICT_LAST_MIN_BYTES
    for mode, blocked in (("floor", True), ("rceil", False)):
        got = gluon("cast_dim0_dim1")(x, "e5m2", mode, blocked)
        assert_same_bytes(got, triton("cast_dim0_dim1")(x, "e5m2", mode, blocked), f"fused {mode} {blocked}")


@pytest.mark.gpu
@hopper
def test_gpu_large_experts_match_triton():
    """Real-sized experts (E = 2) and token groups (LINES) against the Triton kernels, both scale layouts."""
    w = torch.randn(2, 8192, 5120, device="cuda", dtype=BF16)
    w[1, 4000:4032, 17] = float("nan")
    w[0, 0, :] = 1e30
    for blocked in (False, True):
        for op, elem, mode in (("cast_dim1", "e4m3", "rceil"), ("cast_dim0", "e5m2", "floor")):
            got, want = gluon(op)(w, elem, mode, blocked), triton(op)(w, elem, mode, blocked)
            assert_same_bytes(got, want, f"{op} blocked={blocked}")
    sizes = [1056, 1024] * 8
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(sum(sizes), 5120, device="cuda", dtype=BF16)
    assert gluon_cast_groups.tile_for(x.shape[0], len(sizes))["LINES"]
    args = (x, offs, "e5m2", "floor")
    assert_same_bytes(gluon("cast_groups_dim1")(*args), triton("cast_groups_dim1")(*args), "groups")


@pytest.mark.gpu
@pytest.mark.slow
@hopper
def test_gpu_int64_offsets_match_triton():
    """2**31 elements: the int64 offset paths (OFFS64) of every Gluon kernel, against the Triton kernels."""
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs ~30 GiB of GPU memory")
    x = torch.randn(65536, 32768, device="cuda", dtype=BF16)
    x[-1, -1] = float("nan")
    for op, elem, mode, blocked in (
        ("cast_dim1", "e4m3", "floor", False),
        ("cast_dim0", "e5m2", "rceil", True),
        ("cast_dim0_dim1", "e4m3", "rceil", False),
    ):
        assert_same_bytes(gluon(op)(x, elem, mode, blocked), triton(op)(x, elem, mode, blocked), op)
    offs = torch.tensor([32768, 32768, 65536], dtype=torch.int32, device="cuda")
    args = (x, offs, "e4m3", "floor")
    assert_same_bytes(gluon("cast_groups_dim1")(*args), triton("cast_groups_dim1")(*args), "groups")
    args = (x, "e5m2", "floor", True, True)
    assert_same_bytes(gluon("fake_quant_2d")(*args), triton("fake_quant_2d")(*args), "fake quant")


def kernels_launched(fn: Callable) -> set[str]:
    """Names of the GPU kernels ``fn()`` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # compiled outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type.name == "CUDA"}


def ran(kernel: str, launched: set[str]) -> bool:
    """Whether ``kernel`` (a name, not the end of a longer one: _cast_kernel is not _gluon_cast_kernel) ran."""
    return any(re.search(rf"(?<!\w){kernel}", name) for name in launched)


CAST_KERNELS = ("_gluon_cast_kernel", "_cast_kernel")  # (Gluon, Triton)
GROUPS_KERNELS = ("_gluon_cast_groups_dim1_kernel", "_cast_groups_dim1_kernel")
FAKE_QUANT_KERNELS = ("_gluon_fake_quant_kernel", "_fake_quant_2d_kernel")


@pytest.mark.gpu
@hopper
def test_gpu_public_api_launches_the_gluon_kernels_on_hopper():
    """The public casts and fake-quants (and the torch ops) launch the Gluon kernels on sm_90 for bf16 input, the
    Triton ones with the kernel setting gluon=False (the same bytes) and for fp32 casts; fp32 fake-quants take the
    reference."""
    w = special_3d((3, 224, 160))
    x = special_input_plus((352, 256), BF16, "cuda")
    offs = torch.tensor([96, 96, 352], dtype=torch.int32, device="cuda")
    xs = special_input((138, 256), BF16, "cuda", seed=2)
    src = group_sources([40, 0, 33, 1, 64], "cuda")
    calls = {  # name: ((the Gluon kernel, the Triton kernel), the call)
        "cast_dim0": (CAST_KERNELS, lambda: mx_cast.cast_dim0(x, "e5m2", "floor")),
        "cast_dim0 blocked": (CAST_KERNELS, lambda: mx_cast.cast_dim0(x, "e4m3", "rceil", blocked_scales=True)),
        "cast_dim1": (CAST_KERNELS, lambda: mx_cast.cast_dim1(x, "e4m3", "floor")),
        "cast_dim0_dim1": (CAST_KERNELS, lambda: mx_cast.cast_dim0_dim1(x, "e4m3", "rceil")),
        "cast_dim0_dim1 blocked": (CAST_KERNELS, lambda: mx_cast.cast_dim0_dim1(x, "e5m2", "floor", True)),
        "cast_3d_dim0": (CAST_KERNELS, lambda: mx_cast.cast_3d_dim0(w, "e5m2", "floor")),
        "cast_3d_dim1 blocked": (CAST_KERNELS, lambda: mx_cast.cast_3d_dim1(w, "e4m3", "rceil", True)),
        "op cast_dim1 3d": (CAST_KERNELS, lambda: torch.ops.mx_recipe.cast_dim1(w, "e5m2", "rceil", False)),
        "cast_groups_dim1": (
            GROUPS_KERNELS, lambda: mx_cast.cast_groups_dim1(x, offs, "e4m3", "rceil", blocked_scales=True)
        ),
        "op cast_groups_dim1": (GROUPS_KERNELS, lambda: torch.ops.mx_recipe.cast_groups_dim1(x, "e5m2", "floor", offs)),
        "fake_quant_dim0_dim1": (FAKE_QUANT_KERNELS, lambda: mx_cast.fake_quant_dim0_dim1(x, "e4m3", "floor")),
        "fake_quant_along_m 3d": (FAKE_QUANT_KERNELS, lambda: mx_cast.fake_quant_along_m(w, "e5m2", "rceil")),
        "fake_quant_groups_along_m": (
            FAKE_QUANT_KERNELS, lambda: mx_cast.fake_quant_groups_along_m(xs, src, "e4m3", "floor")
        ),
    }  # fmt: skip
    assert get_kernel_settings().gluon
    gluon_out = {}
    for name, ((gluon_kernel, triton_kernel), fn) in calls.items():
        launched = kernels_launched(fn)
        assert ran(gluon_kernel, launched) and not ran(triton_kernel, launched), (name, launched)
        gluon_out[name] = fn()
    launched = kernels_launched(lambda: mx_cast.cast_dim0_dim1(x.float(), "e4m3", "floor"))
    assert ran("_cast_kernel", launched) and not ran("_gluon_cast_kernel", launched), launched
    launched = kernels_launched(lambda: mx_cast.fake_quant_dim0(x.float(), "e4m3", "floor"))
    assert not any(ran(kernel, launched) for kernel in FAKE_QUANT_KERNELS), launched
    with kernel_settings(gluon=False):
        for name, ((gluon_kernel, triton_kernel), fn) in calls.items():
            launched = kernels_launched(fn)
            assert ran(triton_kernel, launched) and not ran(gluon_kernel, launched), (name, launched)
            assert_same_bytes(gluon_out[name], fn(), f"{name}: Gluon vs gluon=False")


def test_blocked_reference_helpers_agree():
    """The references the GPU tests use agree with each other on a one-group split."""
    x = special_input((256, 160), torch.float32, "cpu")
    ref = to_mx(x.t().contiguous(), "e4m3", "floor")
    one = to_blocked_groups(ref.scale, torch.tensor([256], dtype=torch.int32))
    assert_bits_equal(one[: blocked_numel(160, 8)], to_blocked(ref.scale), "one group = to_blocked")
