"""The Gluon 3D dim0 and dim1 casts (mx_kernels.gluon_casts on [E, N, K]: the 2D kernel with an expert grid axis)
and the per-group dim1 cast (gluon_cast_groups), bit for bit vs ``to_mx`` and the Triton kernels, and their
dispatch from ``cast_dim0`` / ``cast_dim1`` (3D) and ``cast_groups_dim1``.

* CPU: argument errors, the default configs, the dispatch (``common.use_gluon`` true: the Gluon launchers
  run), launch facts (grid, EVEN / MASK_COLS, OFFS64), a Python model of the per-group program walk, and
  both kernels compiled for sm_90 without a GPU: 16-byte loads of x, vector transposed qdata stores,
  reductions in registers and shuffles (no shared memory, no bar.sync), no local memory, the hardware fp8
  cvt, no .ftz. Gluon kernels do not run in the Triton interpreter (3.6): the launchers refuse it.
* GPU (``@pytest.mark.gpu``): qdata and scale bytes against the reference (``to_mx`` per expert / per
  group, ``to_blocked_3d`` / ``to_blocked_groups``) and against the Triton kernels, which get their own
  config passed explicitly (without one, Hopper dispatches to Gluon): both scale rules and formats, bf16
  and fp32, special values (NaN with payloads, +-inf, zeros, subnormals, saturation), every bf16 value,
  ragged N and K, empty groups first / in the middle / last, E = 1 and E > 1, strided input, empty
  tensors, invalid offs (no fault), no host sync; and that the public API launches the Gluon kernels on
  Hopper, the Triton ones with MX_RECIPE_GLUON=0 (same bytes).
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from test_cast_kernels import assert_bits_equal, special_input
from test_gluon_casts import gpu_cases, kernels_launched, ptx_ops, resource_usage, special_input_plus

from mx_recipe.formats import to_mx
from mx_recipe.scale_layout import blocked_numel, to_blocked, to_blocked_3d, to_blocked_groups

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
ELEMS = ["e4m3", "e5m2"]
MODES = ["floor", "rceil"]


def g3d():
    import mx_kernels.gluon_casts

    return mx_kernels.gluon_casts


def ggroups():
    import mx_kernels.gluon_cast_groups

    return mx_kernels.gluon_cast_groups


def cfg(rows: int, block_k: int, warps: int, sub: int, lean: bool, **extra) -> dict:
    return dict(ROWS=rows, BLOCK_K=block_k, NUM_WARPS=warps, NUM_SUB=sub, LEAN=lean, **extra)


# GPU-test configs, 3D: the default (the 2D defaults: 128 x 128 LINES tiles; dim0 along K first), the 32-row tile
# that was the 3D default before LINES (8 rows a thread, 2 sub-tiles, LEAN, SCATTER, plain scales via the blocked
# layout), the base tile without LEAN with the kernel's own plain scale stores, one sub-tile, the butterfly.
TILE_32 = cfg(8, 256, 4, 2, True, PLAIN_VIA_BLOCKED=True, SCATTER=True)
CONFIGS_3D = [
    None,
    TILE_32,
    cfg(4, 128, 4, 2, False, PLAIN_VIA_BLOCKED=False),
    cfg(8, 256, 4, 1, True, PLAIN_VIA_BLOCKED=True),
    cfg(8, 256, 4, 2, True, PLAIN_VIA_BLOCKED=True, SCATTER=False),  # the 32-row tile with the butterfly
]
CONFIG_IDS_3D = ["default", "tile32", "base", "r8s1", "butterfly"]
# 3D dim1's default on an H100 (and dim0's everywhere): the LINES tile along K first
LINES_K_FIRST = cfg(8, 128, 2, 4, True, PLAIN_VIA_BLOCKED=True, SCATTER=True, WARPS_M=4, LINES=True, K_FIRST=True)
CONFIGS_3D.append(LINES_K_FIRST)
CONFIG_IDS_3D.append("lines_kfirst")
# per-group: the default (8 rows, one sub-tile, LEAN: 4 programs per tile column), the base tile without LEAN,
# two sub-tiles (the 2D dim1 tile: 2 programs per tile column), four sub-tiles (one program per tile column)
CONFIGS_GROUPS = [
    None,
    cfg(4, 128, 4, 2, False),
    cfg(8, 256, 4, 2, True),
    cfg(4, 128, 4, 4, True),
    cfg(8, 256, 4, 2, True, SCATTER=True),
    cfg(8, 128, 2, 4, True, SCATTER=True, WARPS_M=4, LINES=True),  # 128 x 128 tiles, whole-line stores
]
CONFIG_IDS_GROUPS = ["default", "base", "r8s2", "s4", "scatter_r8s2", "lines"]
S4, LINES_G = CONFIGS_GROUPS[3], CONFIGS_GROUPS[5]
GROUPS_32 = cfg(8, 256, 4, 1, True, SCATTER=True)  # the per-group default below 1024 rows a group

GLUON_3D_KERNEL, TRITON_3D_KERNEL = "_gluon_cast_kernel", "_cast_dim1_kernel"
TRITON_3D_DIM0_KERNEL = "_cast_dim0_kernel"
GLUON_GROUPS_KERNEL, TRITON_GROUPS_KERNEL = "_gluon_cast_groups_dim1_kernel", "_cast_groups_dim1_kernel"


# ---------------------------------------------------------------------------------------
# CPU


def test_default_configs_are_the_measured_ones():
    """3D: the 2D defaults (LINES; dim0 along K first); per-group: one sub-tile, or LINES for large groups
    (H200 benches)."""
    g = g3d()
    assert g.DIM1_CONFIG == {**TILE_32, "BLOCK_K": 128, "NUM_WARPS": 2, "WARPS_M": 4, "NUM_SUB": 4, "LINES": True}
    assert g.DIM0_CONFIG == {**g.DIM1_CONFIG, "K_FIRST": True} == g.DIM0_DIM1_CONFIG
    assert g.DIM1_3D_CONFIG_K_FIRST == LINES_K_FIRST and g.DIM1_3D_K_FIRST_DEVICES == ("H100",)
    assert ggroups().GLUON_GROUPS_CONFIG == GROUPS_32
    # per-group with groups of 1024 rows or more on average: LINES (128 x 128 tiles)
    assert ggroups().GLUON_GROUPS_LINES_CONFIG == LINES_G
    base = ggroups().GLUON_GROUPS_BASE_CONFIG
    assert ggroups().check_config(None, 16640, 16) == {**base, **LINES_G}  # 1040 rows a group
    assert ggroups().check_config(None, 16640, 64) == {**base, **ggroups().GLUON_GROUPS_CONFIG}  # 260
    assert ggroups().check_config(None, 4096, 0) == {**base, **LINES_G}  # no groups: one tile walk


@pytest.mark.parametrize(
    "name, k_first", [("NVIDIA H100 80GB HBM3", True), ("NVIDIA H100 NVL", True), ("NVIDIA H200", False)]
)
def test_3d_dim1_default_follows_the_device(monkeypatch, name, k_first):
    """A 3D dim1 call without a config runs along K first on an H100 (measured there), along M elsewhere; 2D
    dim1 keeps DIM1_CONFIG everywhere."""
    g = g3d()
    seen = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: seen.append(index) or name)
    g._k_first_device.cache_clear()
    try:
        want = g.DIM1_3D_CONFIG_K_FIRST if k_first else g.DIM1_CONFIG
        assert g.dim1_3d_config(torch.device("cuda", 1)) == want
        assert g.dim1_3d_config(torch.device("cuda", 1)) == want and seen == [1]  # looked up once per device
        configs = []
        monkeypatch.setattr(g, "_cast_one_side", lambda x, e, m, b, config, dim0: configs.append(config))
        monkeypatch.setattr(g, "dim1_3d_config", lambda device: want)
        g.gluon_cast_dim1(torch.randn(2, 64, 64, dtype=torch.bfloat16), "e4m3", "floor")
        g.gluon_cast_dim1(torch.randn(64, 64, dtype=torch.bfloat16), "e4m3", "floor")
        assert configs == [want, g.DIM1_CONFIG]
    finally:
        g._k_first_device.cache_clear()


def test_argument_errors(monkeypatch):
    g, gg = g3d(), ggroups()
    x3 = torch.randn(2, 64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"dim 1 of shape \(2, 33, 64\) has size 33"):
        g.gluon_cast_dim1(torch.randn(2, 33, 64), "e4m3", "floor")
    with pytest.raises(ValueError, match="takes a 2D or 3D tensor"):
        g.gluon_cast_dim1(torch.randn(2, 2, 64, 64), "e4m3", "floor")
    with pytest.raises(ValueError, match="e2m1 is not supported"):
        g.gluon_cast_dim1(x3, "e2m1", "floor")
    with pytest.raises(ValueError, match="unknown MX scale rule"):
        g.gluon_cast_dim1(x3, "e4m3", "nearest")
    with pytest.raises(TypeError, match="bf16 or fp32"):
        g.gluon_cast_dim1(x3.half(), "e4m3", "floor")
    for bad in (dict(BLOCK_K=96), dict(BLOCK_K=64, NUM_WARPS=4), dict(ROWS=32), dict(NUM_SUB=3), dict(LEAN=1)):
        with pytest.raises(ValueError, match="Gluon cast config"):
            g.gluon_cast_dim1(x3, "e4m3", "floor", config=bad)
    for unknown in (dict(num_warps=4), dict(MAXNREG=128)):  # a Triton key, a dropped knob: not silently ignored
        with pytest.raises(ValueError, match="unknown Gluon cast config keys"):
            g.gluon_cast_dim1(x3, "e4m3", "floor", config=unknown)

    x = torch.randn(96, 64, dtype=torch.bfloat16)
    offs = torch.tensor([32, 96], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"dim 0 of shape \(90, 64\) has size 90"):
        gg.gluon_cast_groups_dim1(torch.randn(90, 64), offs, "e4m3", "floor")
    with pytest.raises(ValueError, match="takes a 2D tensor"):
        gg.gluon_cast_groups_dim1(torch.randn(2, 96, 64), offs, "e4m3", "floor")
    with pytest.raises(ValueError, match="non-empty 1D int32"):
        gg.gluon_cast_groups_dim1(x, offs.long(), "e4m3", "floor")
    with pytest.raises(ValueError, match="non-empty 1D int32"):
        gg.gluon_cast_groups_dim1(x, offs[:0], "e4m3", "floor")
    for bad in (dict(NUM_SUB=8), dict(ROWS=32), dict(BLOCK_K=64, NUM_WARPS=4), dict(LEAN=1)):
        with pytest.raises(ValueError, match="Gluon groups cast config"):
            gg.gluon_cast_groups_dim1(x, offs, "e4m3", "floor", config=bad)
    for unknown in (dict(PLAIN_VIA_BLOCKED=True), dict(MAXNREG=128), dict(num_warps=4)):
        with pytest.raises(ValueError, match="unknown Gluon groups cast config keys"):
            gg.gluon_cast_groups_dim1(x, offs, "e4m3", "floor", config=unknown)
    if not HAS_CUDA:
        with pytest.raises(RuntimeError, match="need a CUDA tensor"):
            g.gluon_cast_dim1(x3, "e4m3", "floor")
        with pytest.raises(RuntimeError, match="need a CUDA tensor"):
            gg.gluon_cast_groups_dim1(x, offs, "e4m3", "floor")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(NotImplementedError, match="do not run in the Triton interpreter"):
        g.gluon_cast_dim1(x3, "e4m3", "floor")
    with pytest.raises(NotImplementedError, match="do not run in the Triton interpreter"):
        gg.gluon_cast_groups_dim1(x, offs, "e4m3", "floor")


def test_dispatch_runs_the_gluon_launchers_when_use_gluon(monkeypatch):
    """cast_dim0 and cast_dim1 (2D and 3D) and cast_groups_dim1 call the Gluon launchers exactly when
    ``common.use_gluon(x, config)`` is true (the rule itself: test_gluon_fake_quant.test_dispatch_rule), with
    the caller's arguments; otherwise the Triton launchers run (which, on a CPU tensor outside the
    interpreter, refuse)."""
    import mx_kernels.cast_dim0 as cd0
    import mx_kernels.cast_dim1 as cd1
    import mx_kernels.cast_groups_dim1 as cg

    calls = []

    def recorder(name: str):
        def launch(*args, **kwargs):
            calls.append((name, args, kwargs))
            return name

        return launch

    monkeypatch.setattr(g3d(), "gluon_cast_dim1", recorder("dim1"))
    monkeypatch.setattr(g3d(), "gluon_cast_dim0", recorder("dim0"))
    monkeypatch.setattr(ggroups(), "gluon_cast_groups_dim1", recorder("groups"))
    asked = []

    def use_gluon(x, config):
        asked.append(config)
        return config is None

    for module in (cd0, cd1, cg):
        monkeypatch.setattr(module, "use_gluon", use_gluon)
    w = torch.randn(2, 64, 96, dtype=torch.bfloat16)
    x = torch.randn(96, 64, dtype=torch.bfloat16)
    offs = torch.tensor([32, 96], dtype=torch.int32)
    assert cd1.cast_dim1(w, "e4m3", "rceil", True) == "dim1"
    assert calls[-1] == ("dim1", (w, "e4m3", "rceil", True), {})
    assert cd1.cast_dim1(w, "e5m2", "floor") == "dim1"
    assert calls[-1] == ("dim1", (w, "e5m2", "floor", False), {})
    assert cd1.cast_dim1(x, "e4m3", "floor") == "dim1"
    assert cd0.cast_dim0(w, "e5m2", "rceil", True) == "dim0"
    assert calls[-1] == ("dim0", (w, "e5m2", "rceil", True), {})
    assert cd0.cast_dim0(x, "e4m3", "floor") == "dim0"
    assert calls[-1] == ("dim0", (x, "e4m3", "floor", False), {})
    assert cg.cast_groups_dim1(x, offs, "e5m2", "rceil") == "groups"
    assert calls[-1] == ("groups", (x, offs, "e5m2", "rceil"), {})
    with pytest.raises(RuntimeError, match="Triton kernels need a CUDA tensor"):
        cd1.cast_dim1(w, "e4m3", "floor", config=cd1.DIM1_CONFIG)
    with pytest.raises(RuntimeError, match="Triton kernels need a CUDA tensor"):
        cd0.cast_dim0(w, "e4m3", "floor", config=cd0.DIM0_CONFIG)
    with pytest.raises(RuntimeError, match="Triton kernels need a CUDA tensor"):
        cg.cast_groups_dim1(x, offs, "e4m3", "floor", cg.GROUPS_DIM1_CONFIG)
    assert len(calls) == 6
    assert asked == [None] * 6 + [cd1.DIM1_CONFIG, cd0.DIM0_CONFIG, cg.GROUPS_DIM1_CONFIG]


def facts_3d(shape, blocked, config=None, dtype=torch.bfloat16):
    """(grid, EVEN, OFFS64, REPS, one expert's scale bytes) of the 3D dim1 launch (config None: the default)."""
    x = torch.empty(shape, dtype=dtype, device="meta")
    u8 = torch.empty(16, dtype=torch.uint8, device="meta")
    g = g3d()
    grid, kw = g.kernel_launch(x, (u8,) * 4, "e4m3", "floor", blocked, False, config or g.DIM1_CONFIG)
    return grid, kw["EVEN"], kw["OFFS64"], kw["REPS"], kw["stride_s1b"]


def facts_groups(shape, num_groups, config=None):
    x = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    offs = torch.empty(num_groups, dtype=torch.int32, device="meta")
    u8 = torch.empty(16, dtype=torch.uint8, device="meta")
    grid, kw = ggroups().kernel_launch(x, offs, u8, u8, "e4m3", "floor", config)
    return grid, kw["MASK_COLS"], kw["OFFS64"], kw["GROUPS_POW2"]


def test_groups_lookup_is_packed_up_to_its_bound():
    """The packed lookup (16-bit fields) where M_total / 32 and the scale tile columns fit PACKED_MAX, else the
    counting one (GPU: test_gpu_groups_lookups_agree)."""
    u8 = torch.empty(16, dtype=torch.uint8, device="meta")

    def packed(m, num_groups, config=None):
        x = torch.empty(m, 32, dtype=torch.bfloat16, device="meta")
        offs = torch.empty(num_groups, dtype=torch.int32, device="meta")
        return ggroups().kernel_launch(x, offs, u8, u8, "e4m3", "floor", config)[1]["PACKED"]

    assert ggroups().PACKED_MAX == 2**16 - 1
    assert packed(16640, 16) and packed(16640, 64, GROUPS_32) and packed(2**21 - 32, 8)
    assert not packed(2**21, 8)  # M_total / 32 = 2**16
    assert not packed(2**18, 2**16 - 2**11)  # 2048 + 63488 = 2**16 tile columns


def test_launch_facts():
    # [16, 8192, 5120], default tile 128 x 128: 64 x 40 programs per expert, no masks, int32 in-slice offsets
    assert facts_3d((16, 8192, 5120), True) == ((64, 40, 16), True, False, 1, blocked_numel(5120, 256))
    assert facts_3d((16, 8192, 5120), True, TILE_32) == ((128, 20, 16), True, False, 1, blocked_numel(5120, 256))
    assert facts_3d((16, 8192, 5120), False, cfg(4, 128, 4, 2, False)) == ((128, 40, 16), True, False, 1, 5120 * 256)
    assert facts_3d((64, 8192, 5120), True, cfg(16, 512, 4, 1, True))[:4] == ((256, 10, 64), True, False, 1)
    # ragged: N 224 and K 96 padded to 256 and 128 (blocked), or tiled with masks (plain)
    assert facts_3d((3, 224, 96), True) == ((2, 1, 3), False, False, 1, blocked_numel(96, 7))
    assert facts_3d((3, 224, 96), True, TILE_32) == ((4, 1, 3), False, False, 1, blocked_numel(96, 7))
    assert facts_3d((3, 224, 96), False, cfg(4, 128, 4, 2, False)) == ((4, 1, 3), False, False, 1, 96 * 7)
    assert facts_3d((2, 65536, 32768), True)[2]  # 2**31 elements in one expert: int64 offsets
    assert not facts_3d((64, 8192, 5120), True)[2]  # E * N * K > 2**31, but the expert bases are int64 scalars
    # groups: cdiv(M/32, 4) + G tile columns, 4 / NUM_SUB programs each (default NUM_SUB 1); K padded to 128;
    # LINES (the default from 1024 rows a group): one program per tile column and 128 columns of K
    assert facts_groups((16640, 5120), 16, GROUPS_32) == ((4 * (130 + 16), 20), False, False, 16)
    assert facts_groups((16640, 5120), 16) == ((130 + 16, 40), False, False, 16)
    assert facts_groups((16640, 5120), 64, cfg(8, 256, 4, 2, True)) == ((2 * (130 + 64), 20), False, False, 64)
    assert facts_groups((16640, 160), 5, S4) == ((130 + 5, 2), True, False, 8)
    assert facts_groups((352, 96), 1) == ((4 * (3 + 1), 1), True, False, 1)  # K 96: one 256 tile, masked


def check_compiled(kernel, elem: str, transposed_store: str, x_loads: int, what: str, max_reg: int = 255) -> dict:
    """The memory ops, reductions and conversions of one compiled kernel. ``x_loads``: 16-byte loads of x
    per thread; any other load must be of offs (groups: at most 4, 4 or 8 bytes)."""
    ptx = kernel.asm["ptx"]
    ops = ptx_ops(ptx)
    what = f"{what}: {ops}"
    assert ops.get("ld.global.v4.b32", 0) == x_loads, what  # x: 16-byte loads only
    other_loads = {op: n for op, n in ops.items() if op.startswith("ld.") and op != "ld.global.v4.b32"}
    assert set(other_loads) <= {"ld.global.b32", "ld.global.v2.b32"} and sum(other_loads.values()) <= 4, what
    assert "bar.sync" not in ops and not any(".shared" in op for op in ops), what  # registers + shuffles only
    assert ops.get("shfl.sync.bfly.b32", 0) > 0, what
    assert ops.get(f"cvt.rn.satfinite.{elem}x2.f32", 0) > 0, what  # hardware fp8 conversion
    assert ops.get(transposed_store, 0) > 0, what  # the [K, M] qdata: ROWS contiguous bytes per thread
    assert ".ftz" not in ptx, what  # subnormal inputs and the 2**-127 factor are not flushed
    usage = resource_usage(kernel.asm["cubin"])
    if usage is not None:
        assert usage["LOCAL"] == 0 and usage["SHARED"] == 0 and usage["REG"] <= max_reg, f"{what} {usage}"
    return ops


COMPILE_3D = [
    # (shape, dtype, elem, mode, blocked kernel, config, transposed store, 16-byte x loads per thread); the 32-row
    # tiles (the default LINES tile's stores: test_gluon_casts.test_lines_store_whole_lines)
    ((16, 8192, 5120), torch.bfloat16, "e4m3", "floor", True, TILE_32, "st.global.v2.b32", 16),
    ((16, 8192, 5120), torch.bfloat16, "e5m2", "rceil", False, cfg(4, 128, 4, 2, False), "st.global.b32", 8),
    ((64, 8192, 5120), torch.bfloat16, "e4m3", "rceil", True, cfg(16, 512, 4, 1, True), "st.global.v4.b32", 16),
    ((1, 8192, 5120), torch.bfloat16, "e5m2", "floor", True, cfg(8, 256, 4, 1, True), "st.global.v2.b32", 8),
    ((3, 224, 160), torch.bfloat16, "e4m3", "floor", True, TILE_32, "st.global.v2.b32", 16),  # ragged: masks
    ((4, 8192, 5120), torch.float32, "e4m3", "rceil", True, TILE_32, "st.global.v2.b32", 32),  # 4 fp32 per load
    ((2, 65536, 32768), torch.bfloat16, "e4m3", "floor", True, TILE_32, "st.global.v2.b32", 16),  # OFFS64
]


def compile_3d(shape, dtype, elem, mode, blocked, config, dim0=False):
    """The batched kernel compiled for sm_90, one side (config None: that side's default)."""
    g = g3d()
    config = config or (g.DIM0_CONFIG if dim0 else g.DIM1_CONFIG)
    return g.compile_for_target(shape, dtype, elem, mode, blocked, dim0, config, arch=90, dim1=not dim0)


@pytest.mark.parametrize("shape, dtype, elem, mode, blocked, config, transposed_store, x_loads", COMPILE_3D)
def test_3d_compiles_for_sm90_with_the_intended_memory_ops(
    shape, dtype, elem, mode, blocked, config, transposed_store, x_loads
):
    kernel = compile_3d(shape, dtype, elem, mode, blocked, config)
    what = f"3d {shape} {dtype} {elem} {mode} blocked={blocked} {config}"
    ops = check_compiled(kernel, elem, transposed_store, x_loads, what)
    assert not any(op.startswith("ld.") and op != "ld.global.v4.b32" for op in ops), what


COMPILE_GROUPS = [
    # (shape, groups, dtype, elem, mode, config, transposed store, 16-byte x loads per thread, max registers;
    # the default's bound: 60-64 with Triton 3.6, against 144 for NUM_SUB 2, the tile that measured slower)
    ((16640, 5120), 16, torch.bfloat16, "e4m3", "floor", GROUPS_32, "st.global.v2.b32", 8, 96),
    ((16640, 5120), 64, torch.bfloat16, "e5m2", "rceil", cfg(4, 128, 4, 2, False), "st.global.b32", 8, 255),
    ((16640, 160), 5, torch.bfloat16, "e4m3", "rceil", GROUPS_32, "st.global.v2.b32", 8, 96),  # masked columns
    ((16640, 5120), 64, torch.bfloat16, "e5m2", "rceil", None, "st.global.v2.b32", 8, 96),
    ((16640, 5120), 1, torch.float32, "e4m3", "floor", cfg(8, 256, 4, 1, True), "st.global.v2.b32", 16, 255),
    ((16640, 5120), 33, torch.bfloat16, "e5m2", "floor", S4, "st.global.b32", 16, 255),
    ((16640, 5120), 16, torch.bfloat16, "e4m3", "rceil", cfg(16, 512, 4, 1, True), "st.global.v4.b32", 16, 255),
    ((16640, 5120), 64, torch.bfloat16, "e4m3", "floor", cfg(8, 256, 4, 2, True), "st.global.v2.b32", 16, 255),
]  # fmt: skip


@pytest.mark.parametrize("shape, groups, dtype, elem, mode, config, transposed_store, x_loads, max_reg", COMPILE_GROUPS)
def test_groups_compiles_for_sm90_with_the_intended_memory_ops(
    shape, groups, dtype, elem, mode, config, transposed_store, x_loads, max_reg
):
    kernel = ggroups().compile_for_target(shape, groups, dtype, elem, mode, config, arch=90)
    what = f"groups {shape} G={groups} {dtype} {elem} {mode} {config}"
    ops = check_compiled(kernel, elem, transposed_store, x_loads, what, max_reg)
    if groups <= 32:  # the group scan: shfl.up steps within a warp (log2 of the padded group count)
        assert ops.get("shfl.sync.up.b32", 0) == max(groups - 1, 0).bit_length(), what


@pytest.mark.parametrize("config", CONFIGS_3D, ids=CONFIG_IDS_3D)
def test_every_3d_test_config_compiles(config):
    """The GPU tests' configs on their ragged (masked) and even shapes, blocked and plain scales, both sides: the
    layout conversions are asserted trivial at compile time (a mistake in the layouts fails here, without a GPU)."""
    lines = config is None or bool(config.get("LINES"))  # LINES tiles: their stores go through shared memory
    for shape in ((3, 224, 96), (2, 64, 96), (4, 256, 512)):
        for blocked in (False, True):
            for dim0 in (False, True):
                kernel = compile_3d(shape, torch.bfloat16, "e4m3", "floor", blocked or lines, config, dim0)
                ops = ptx_ops(kernel.asm["ptx"])
                shared = any(".shared" in op for op in ops)
                assert ("bar.sync" in ops) == lines and shared == lines, (shape, config, dim0, ops)


@pytest.mark.parametrize("config", CONFIGS_GROUPS, ids=CONFIG_IDS_GROUPS)
def test_every_groups_test_config_compiles(config):
    for shape, groups in (((352, 96), 5), ((4128, 4128), 8), ((16640, 512), 33), ((512, 100), 1)):
        ops = ptx_ops(ggroups().compile_for_target(shape, groups, torch.bfloat16, "e4m3", "floor", config).asm["ptx"])
        lines = bool(config and config.get("LINES"))  # its stores go through shared memory
        assert ("bar.sync" in ops) == lines and any(".shared" in op for op in ops) == lines, (shape, config, ops)
        if lines and shape[1] % 128 == 0:  # q as whole lines, each scale tile as 16-byte rows
            assert {op for op in ops if op.startswith("st.global")} == {"st.global.v4.b32"}, (shape, groups, ops)


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


def walk_groups_model(
    scale: torch.Tensor, ends: list[int], m: int, k: int, num_sub: int, block_k: int, packed: bool = False
):
    """The per-group kernel's program walk, transcribed to Python (its index arithmetic line by line; the
    numerics are ``scale``, a plain [K, M/32] uint8 matrix): (the blocked scale buffer with -1 where no
    program wrote, how often each qdata element is stored). Raises on a store outside either buffer."""
    num_groups, split = len(ends), 4 // num_sub
    max_tile_cols = -(-(m // 32) // 4) + num_groups
    padded_k = -(-k // 128) * 128
    buf = torch.full((padded_k * 4 * max_tile_cols,), -1, dtype=torch.int32)
    q_writes = torch.zeros(k, m, dtype=torch.int32)
    clamp, tiles = clamped_groups_model(ends, m)
    for pid in range(max_tile_cols * split):
        t, part = divmod(pid, split)
        tile_start, group_tiles, row_start, row_end = group_lookup_model(t, clamp, tiles, max_tile_cols, packed)
        tile = t - tile_start
        row0 = row_start + tile * 128 + part * 32 * num_sub
        group_base = padded_k * 4 * tile_start
        left = max(min(padded_k * 4 * max_tile_cols - group_base, 2**31 - 1), 0)
        for pid_k in range(-(-padded_k // block_k)):
            r = pid_k * block_k + torch.arange(block_k)[None, :]
            sub = torch.arange(num_sub)[:, None]
            blocks = row0 + sub * 32
            valid = (blocks < row_end) & (r < k)
            c = tile * 4 + part * num_sub + sub
            offs = ((r >> 7) * group_tiles + (c >> 2)) * 512 + (r & 31) * 16 + ((r >> 5) & 3) * 4 + (c & 3)
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


@pytest.mark.parametrize("num_sub, block_k", [(2, 256), (1, 256), (4, 128), (2, 512)])
@pytest.mark.parametrize(
    "sizes, k",
    [([32, 0, 160, 0, 64], 96), ([0, 0, 4096, 256, 32, 0], 160), ([128] * 7 + [96], 300), ([1056, 1024, 0], 256),
     ([0], 64), ([64, 0, 0], 128)],
)  # fmt: skip
@pytest.mark.parametrize("packed", [False, True], ids=["counting", "packed"])
def test_groups_program_walk_model(sizes, k, num_sub, block_k, packed):
    """(CPU) The walk's arithmetic writes every byte of the per-group blocked buffer once, with
    ``to_blocked_groups``'s bytes, and every qdata element once; and for invalid offs stays in bounds. Both
    group lookups (PACKED: the default up to PACKED_MAX; the counting one past it)."""
    m = sum(sizes)
    g = torch.Generator().manual_seed(m + k)
    scale = torch.randint(1, 255, (k, m // 32), generator=g, dtype=torch.uint8)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    buf, q_writes = walk_groups_model(scale.to(torch.int32), offs.tolist(), m, k, num_sub, block_k, packed)
    assert bool((buf >= 0).all()), "bytes of the scale buffer no program wrote"
    assert_bits_equal(buf.to(torch.uint8), to_blocked_groups(scale, offs), f"walk {sizes} k={k}")
    assert bool((q_writes == 1).all()), "qdata elements stored twice or never"
    for bad in ([m, 0, m], [m + 64], [-32, m], [40, 200, m], [m] * 9):  # invalid offs: in bounds only
        walk_groups_model(scale.to(torch.int32), bad, m, k, num_sub, block_k, packed)


def test_packed_group_lookup_matches_the_counting_one():
    """(CPU) For every tile column, valid and invalid offs (clamped as the kernel clamps them), up to the
    PACKED_MAX bounds: the packed lookup returns the counting lookup's four values."""
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
            assert max(m >> 5, max_tile_cols) <= ggroups().PACKED_MAX
            for t in range(max_tile_cols):
                want = group_lookup_model(t, clamp, tiles, max_tile_cols, packed=False)
                assert group_lookup_model(t, clamp, tiles, max_tile_cols, packed=True) == want, (sizes, bad, t)


# ---------------------------------------------------------------------------------------
# GPU


def special_3d(shape: tuple[int, int, int], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """``special_input_plus`` per expert (different data per expert), on the GPU."""
    e, n, k = shape
    experts = [special_input_plus((n, k), dtype, "cpu", seed + i) for i in range(e)]
    return (torch.stack(experts) if experts else torch.empty(shape, dtype=dtype)).cuda()


def triton_3d(x, elem, mode, blocked):
    from mx_kernels.cast_dim1 import DIM1_CONFIG, cast_dim1

    return cast_dim1(x, elem, mode, blocked, DIM1_CONFIG)  # its own config: never the Gluon dispatch


def triton_3d_dim0(x, elem, mode, blocked):
    from mx_kernels.cast_dim0 import DIM0_CONFIG, cast_dim0

    return cast_dim0(x, elem, mode, blocked, DIM0_CONFIG)


def check_3d(x: torch.Tensor, elem: str, mode: str, blocked: bool, config, what: str = "3d") -> None:
    """dim1 where N % 32 == 0 (each expert's [K, N] column-major), dim0 where K % 32 == 0: against ``to_mx``
    per expert and the Triton kernels."""
    what = f"{what} {tuple(x.shape)} {x.dtype} {elem} {mode} blocked={blocked} {config}"
    cases = []
    if x.shape[1] % 32 == 0:
        ref = to_mx(x.cpu().transpose(-2, -1).contiguous(), elem, mode, dim=-1)
        cases.append(("dim1", g3d().gluon_cast_dim1, ref, triton_3d))
    if x.shape[2] % 32 == 0:
        cases.append(("dim0", g3d().gluon_cast_dim0, to_mx(x.cpu(), elem, mode, dim=-1), triton_3d_dim0))
    assert cases, what
    for side, cast, ref, triton in cases:
        q, s = cast(x, elem, mode, blocked, config)
        assert q.dtype == ref.qdata.dtype and s.dtype == torch.float8_e8m0fnu, f"{what} {side}"
        assert_bits_equal(q, ref.qdata, f"{what} {side} qdata")
        assert_bits_equal(s, to_blocked_3d(ref.scale) if blocked else ref.scale, f"{what} {side} scale")
        tq, ts = triton(x, elem, mode, blocked)
        assert_bits_equal(q, tq, f"{what} {side} qdata vs triton")
        assert_bits_equal(s, ts, f"{what} {side} scale vs triton")


def triton_groups(x, offs, elem, mode):
    from mx_kernels.cast_groups_dim1 import GROUPS_DIM1_CONFIG, cast_groups_dim1

    return cast_groups_dim1(x, offs, elem, mode, GROUPS_DIM1_CONFIG)


def check_groups(x: torch.Tensor, sizes: list[int], elem: str, mode: str, config, what: str = "groups") -> None:
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
    what = f"{what} {sizes} K={x.shape[1]} {x.dtype} {elem} {mode} {config}"
    q, s = ggroups().gluon_cast_groups_dim1(x, offs.to(x.device), elem, mode, config)
    ref = to_mx(x.cpu().t().contiguous(), elem, mode, dim=-1)
    assert q.dtype == ref.qdata.dtype and s.dtype == torch.float8_e8m0fnu, what
    assert_bits_equal(q, ref.qdata, what + " qdata")
    assert_bits_equal(s, to_blocked_groups(ref.scale, offs), what + " scale")
    start = 0
    for end in offs.tolist():  # each group's columns: that group's own dim1 cast
        if end > start:
            ref_g = to_mx(x.cpu()[start:end].t().contiguous(), elem, mode, dim=-1)
            assert_bits_equal(q[:, start:end], ref_g.qdata, f"{what} group qdata [{start}, {end})")
        start = end
    if x.shape[0]:  # (M_total = 0: the reference only; the Triton kernel is not tested there)
        tq, ts = triton_groups(x, offs.to(x.device), elem, mode)
        assert_bits_equal(q, tq, what + " qdata vs triton")
        assert_bits_equal(s, ts, what + " scale vs triton")


SHAPES_3D = [(1, 96, 160), (3, 224, 96), (5, 128, 256), (2, 64, 100), (2, 4128, 160), (1, 160, 4128), (4, 256, 512)]
SHAPES_3D += [(3, 33, 96), (2, 1, 160)]  # dim0 only: any row count
GPU_CASES_3D = gpu_cases(CONFIGS_3D, CONFIG_IDS_3D, {"default"})


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config, mode, elem", GPU_CASES_3D)
def test_gpu_3d_bit_exact(config, mode, elem):
    for blocked in (False, True):
        for seed, shape in enumerate(SHAPES_3D):
            check_3d(special_3d(shape, torch.bfloat16, seed), elem, mode, blocked, config)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config", CONFIGS_3D[:2], ids=CONFIG_IDS_3D[:2])
@pytest.mark.parametrize("mode, elem", [("floor", "e4m3"), ("rceil", "e4m3"), ("floor", "e5m2"), ("rceil", "e5m2")])
def test_gpu_3d_fp32_bit_exact(config, mode, elem):
    for blocked in (False, True):
        for shape in [(3, 224, 96), (2, 64, 100), (4, 256, 512)]:
            check_3d(special_3d(shape, torch.float32), elem, mode, blocked, config, "3d fp32")


GROUP_CASES = [
    ([32, 0, 160, 0, 64], 96),  # empty groups in the middle; K < 128
    ([0, 0, 4096, 256, 32, 0], 160),  # empty first and last
    ([128] * 7 + [96], 4128),  # K past a tile; a group ending inside a 128-row tile column
    ([0, 64, 96], 100),  # K % 32 != 0, empty first group
    ([1056, 1024, 1056, 0], 512),  # 1056 = 8 * 128 + 32: a last tile column of one block
    ([64, 0, 0], 256),  # empty last groups
    ([4128], 384),  # one group
]
GPU_CASES_GROUPS = gpu_cases(CONFIGS_GROUPS, CONFIG_IDS_GROUPS, {"default", "lines"})


def many_groups(num_groups: int, seed: int) -> list[int]:
    """Random multiples of 32 rows (0 to 320), a third of them empty."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 11, (num_groups,), generator=g) * 32
    sizes[torch.randperm(num_groups, generator=g)[: num_groups // 3]] = 0
    return sizes.tolist()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config, mode, elem", GPU_CASES_GROUPS)
def test_gpu_groups_bit_exact(config, mode, elem):
    cases = GROUP_CASES + [(many_groups(33, 1), 256), (many_groups(64, 2), 160), (many_groups(17, 3), 128)]
    for seed, (sizes, k) in enumerate(cases):
        x = special_input_plus((sum(sizes), k), torch.bfloat16, "cuda", seed)
        check_groups(x, sizes, elem, mode, config)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config", [None, CONFIGS_GROUPS[1], LINES_G], ids=["default", "base", "lines"])
@pytest.mark.parametrize("mode, elem", [("floor", "e4m3"), ("rceil", "e4m3"), ("floor", "e5m2"), ("rceil", "e5m2")])
def test_gpu_groups_fp32_bit_exact(config, mode, elem):
    for seed, (sizes, k) in enumerate(GROUP_CASES[:4]):
        x = special_input_plus((sum(sizes), k), torch.float32, "cuda", seed)
        check_groups(x, sizes, elem, mode, config, "groups fp32")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config", [None, CONFIGS_GROUPS[1], LINES_G], ids=["default", "base", "lines"])
def test_gpu_every_bf16_value(config):
    """All 65536 bf16 patterns (NaNs of every payload and sign, infinities, subnormals) in blocks along N / M."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    cfg3d = None if config is None or "LINES" in config else {**config, "PLAIN_VIA_BLOCKED": False}
    for elem in ELEMS:
        for mode in MODES:
            for blocked in (False, True):
                check_3d(x.reshape(2, 256, 128).cuda(), elem, mode, blocked, cfg3d, "all bf16")
            check_groups(x.reshape(512, 128).cuda(), [96, 0, 320, 96], elem, mode, config, "all bf16")


@pytest.mark.gpu
@needs_cuda
def test_gpu_strided_input_and_empty():
    g, gg = g3d(), ggroups()
    base = special_3d((3, 160, 224), torch.bfloat16)
    check_3d(base.transpose(1, 2), "e4m3", "rceil", True, None, "3d transposed")  # [3, 224, 160], K stride 224
    check_3d(base[:, :, :96], "e5m2", "floor", False, None, "3d row stride 224")
    check_3d(special_3d((6, 128, 256), torch.bfloat16)[::2], "e4m3", "floor", True, None, "3d every other expert")
    x = special_input_plus((256, 416), torch.bfloat16, "cuda")
    check_groups(x.t().contiguous().t(), [64, 0, 192], "e4m3", "floor", None, "groups transposed")
    check_groups(x[:, :160], [0, 256], "e5m2", "rceil", None, "groups row stride 416")
    for shape in ((0, 64, 96), (2, 0, 96), (2, 64, 0)):
        empty = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
        for blocked in (False, True):
            q, s = g.gluon_cast_dim1(empty, "e4m3", "floor", blocked)
            tq, ts = triton_3d(empty, "e4m3", "floor", blocked)
            assert q.shape == tq.shape and s.shape == ts.shape, (shape, blocked)
            q, s = g.gluon_cast_dim0(empty, "e4m3", "floor", blocked)
            tq, ts = triton_3d_dim0(empty, "e4m3", "floor", blocked)
            assert q.shape == tq.shape and s.shape == ts.shape, (shape, blocked)
    # M_total = 0: the scale buffer (one tile column per group) is all zeros; K = 0: nothing
    check_groups(torch.empty(0, 96, device="cuda", dtype=torch.bfloat16), [0, 0], "e4m3", "floor", None, "M=0")
    q, s = gg.gluon_cast_groups_dim1(
        torch.empty(64, 0, device="cuda"), torch.tensor([64], dtype=torch.int32, device="cuda"), "e4m3", "floor"
    )
    assert q.shape == (0, 64) and s.numel() == 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config", [None, GROUPS_32, LINES_G], ids=["default", "tile32", "lines"])
def test_gpu_groups_lookups_agree(config):
    """The packed group lookup (what every launch up to PACKED_MAX runs, checked against the reference above)
    and the counting one (past it) write the same bytes, for valid offs; for invalid ones neither faults."""
    gg = ggroups()
    cases = GROUP_CASES + [(many_groups(33, 1), 256), (many_groups(64, 2), 160)]
    for seed, (sizes, k) in enumerate(cases):
        x = special_input_plus((sum(sizes), k), torch.bfloat16, "cuda", seed)
        offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
        q_shape, s_shape = gg.groups_dim1_shapes(x.shape, offs.numel(), blocked=True)
        outs = []
        for packed in (True, False):
            q = torch.full(q_shape, 7, dtype=torch.uint8, device="cuda")
            s = torch.full(s_shape, 7, dtype=torch.uint8, device="cuda")
            grid, kw = gg.kernel_launch(x, offs, q, s, "e4m3", "rceil", config)
            assert kw["PACKED"]
            gg._gluon_cast_groups_dim1_kernel[grid](**{**kw, "PACKED": packed})
            outs.append((q, s))
        assert_bits_equal(outs[0][0], outs[1][0], f"{sizes} qdata")
        assert_bits_equal(outs[0][1], outs[1][1], f"{sizes} scale")
    x = special_input((256, 160), torch.bfloat16, "cuda")
    q_shape, s_shape = gg.groups_dim1_shapes(x.shape, 3, blocked=True)
    q = torch.empty(q_shape, dtype=torch.uint8, device="cuda")
    for ends in ([256, 0, 256], [-32, 256, 512], [40, 200, 256]):
        offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
        s = torch.empty(s_shape, dtype=torch.uint8, device="cuda")
        grid, kw = gg.kernel_launch(x, offs, q, s, "e4m3", "floor", config)
        for packed in (True, False):
            gg._gluon_cast_groups_dim1_kernel[grid](**{**kw, "PACKED": packed})
    torch.cuda.synchronize()


@pytest.mark.gpu
@needs_cuda
def test_gpu_invalid_offs_do_not_fault():
    """Offs that break the contract (decreasing, past M_total, negative, not multiples of 32): unspecified
    values, but the kernel must run without an illegal access (which would poison the CUDA context)."""
    x = special_input((256, 160), torch.bfloat16, "cuda")
    for ends in ([256, 0, 256], [512], [-32, 256], [40, 200, 256], [256] * 40, [0, 0, 0]):
        offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
        for config in (None, S4, LINES_G):
            ggroups().gluon_cast_groups_dim1(x, offs, "e4m3", "floor", config)
    torch.cuda.synchronize()
    check_groups(x, [128, 128], "e4m3", "floor", None, "after invalid offs")  # the context still works


@pytest.mark.gpu
@needs_cuda
def test_gpu_no_host_sync():
    """Neither cast waits for the device (offs stays there): torch's sync debug mode raises on a sync."""
    x3 = special_3d((2, 128, 256), torch.bfloat16)
    x = special_input((256, 256), torch.bfloat16, "cuda")
    offs = torch.tensor([96, 96, 256], dtype=torch.int32, device="cuda")
    calls = [
        lambda: g3d().gluon_cast_dim1(x3, "e4m3", "floor", True),
        lambda: g3d().gluon_cast_dim1(x3, "e4m3", "floor", False),  # plain via blocked + unblock_scales
        lambda: g3d().gluon_cast_dim0(x3, "e4m3", "floor", True),
        lambda: g3d().gluon_cast_dim0(x3, "e4m3", "floor", False),
        lambda: ggroups().gluon_cast_groups_dim1(x, offs, "e4m3", "floor"),
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


@pytest.mark.gpu
@needs_cuda
def test_gpu_large_experts_match_triton():
    """Real-sized experts (the bench's shape, E = 2) against the Triton kernel, both scale layouts."""
    x = torch.randn(2, 8192, 5120, device="cuda", dtype=torch.bfloat16)
    x[1, 4000:4032, 17] = float("nan")
    x[0, 0, :] = 1e30
    for blocked in (False, True):
        got, want = g3d().gluon_cast_dim1(x, "e4m3", "rceil", blocked), triton_3d(x, "e4m3", "rceil", blocked)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), blocked
        got, want = g3d().gluon_cast_dim0(x, "e5m2", "floor", blocked), triton_3d_dim0(x, "e5m2", "floor", blocked)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), ("dim0", blocked)
    sizes = [1056, 1024] * 8
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    xg = torch.randn(sum(sizes), 5120, device="cuda", dtype=torch.bfloat16)
    got, want = ggroups().gluon_cast_groups_dim1(xg, offs, "e5m2", "floor"), triton_groups(xg, offs, "e5m2", "floor")
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_blocked_reference_helpers_agree():
    """(CPU) The references the GPU tests use agree with each other on a one-group split."""
    x = special_input((256, 160), torch.float32, "cpu")
    ref = to_mx(x.t().contiguous(), "e4m3", "floor")
    one = to_blocked_groups(ref.scale, torch.tensor([256], dtype=torch.int32))
    assert_bits_equal(one[: blocked_numel(160, 8)], to_blocked(ref.scale), "one group = to_blocked")


def ran(kernel: str, launched: set[str]) -> bool:
    """Whether ``kernel`` (a name, not a suffix of a longer one) is among the launched kernels."""
    return any(re.search(rf"(?<!\w){kernel}", name) for name in launched)


@pytest.mark.gpu
@needs_cuda
def test_gpu_dispatch_launches_the_gluon_kernels_on_hopper(monkeypatch):
    """cast_dim0 and cast_dim1 on 3D input and cast_groups_dim1 (the launchers, the torch ops over them and the
    public mx_recipe.cast API) launch the Gluon kernels on sm_90 for bf16 input, the Triton kernels with
    MX_RECIPE_GLUON=0, a Triton config or fp32 input; the same bytes either way."""
    import mx_kernels.ops  # noqa: F401  (registers torch.ops.mx_recipe)
    from mx_kernels.cast_dim0 import DIM0_CONFIG, cast_dim0
    from mx_kernels.cast_dim1 import DIM1_CONFIG, cast_dim1
    from mx_kernels.cast_groups_dim1 import GROUPS_DIM1_CONFIG, cast_groups_dim1
    from mx_kernels.common import GLUON_ENV

    from mx_recipe import cast as mx_cast

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon dispatch is for compute capability 9.x (Hopper)")
    w = special_3d((3, 224, 160), torch.bfloat16)
    x = special_input_plus((352, 256), torch.bfloat16, "cuda")
    offs = torch.tensor([96, 96, 352], dtype=torch.int32, device="cuda")

    def parts(mx) -> tuple[torch.Tensor, torch.Tensor]:
        return mx.qdata, mx.scale

    calls = {  # name: (the Gluon kernel, the Triton kernel, the call)
        "3d": (GLUON_3D_KERNEL, TRITON_3D_KERNEL, lambda: cast_dim1(w, "e4m3", "floor")),
        "3d blocked": (GLUON_3D_KERNEL, TRITON_3D_KERNEL, lambda: cast_dim1(w, "e5m2", "rceil", True)),
        "3d op": (GLUON_3D_KERNEL, TRITON_3D_KERNEL, lambda: torch.ops.mx_recipe.cast_dim1(w, "e4m3", "rceil", True)),
        "3d public": (GLUON_3D_KERNEL, TRITON_3D_KERNEL, lambda: parts(mx_cast.cast_3d_dim1(w, "e5m2", "floor"))),
        "3d dim0": (GLUON_3D_KERNEL, TRITON_3D_DIM0_KERNEL, lambda: cast_dim0(w, "e4m3", "rceil", True)),
        "3d dim0 public": (
            GLUON_3D_KERNEL, TRITON_3D_DIM0_KERNEL, lambda: parts(mx_cast.cast_3d_dim0(w, "e5m2", "floor"))
        ),
        "groups": (GLUON_GROUPS_KERNEL, TRITON_GROUPS_KERNEL, lambda: cast_groups_dim1(x, offs, "e4m3", "floor")),
        "groups op": (
            GLUON_GROUPS_KERNEL, TRITON_GROUPS_KERNEL,
            lambda: torch.ops.mx_recipe.cast_groups_dim1(x, offs, "e5m2", "rceil"),
        ),
        "groups public": (
            GLUON_GROUPS_KERNEL, TRITON_GROUPS_KERNEL,
            lambda: parts(mx_cast.cast_groups_dim1(x, offs, "e4m3", "rceil", blocked_scales=True)),
        ),
    }  # fmt: skip
    monkeypatch.delenv(GLUON_ENV, raising=False)
    gluon_out = {}
    for name, (gluon_kernel, triton_kernel, fn) in calls.items():
        launched = kernels_launched(fn)
        assert ran(gluon_kernel, launched) and not ran(triton_kernel, launched), (name, launched)
        gluon_out[name] = fn()
    forced = {  # a Triton config, or fp32 input: the Triton kernels
        TRITON_3D_KERNEL: [
            lambda: cast_dim1(w, "e4m3", "floor", config=DIM1_CONFIG),
            lambda: cast_dim1(w.float(), "e4m3", "floor"),
        ],
        TRITON_3D_DIM0_KERNEL: [
            lambda: cast_dim0(w, "e4m3", "floor", config=DIM0_CONFIG),
            lambda: cast_dim0(w.float(), "e4m3", "floor"),
        ],
        TRITON_GROUPS_KERNEL: [
            lambda: cast_groups_dim1(x, offs, "e4m3", "floor", GROUPS_DIM1_CONFIG),
            lambda: cast_groups_dim1(x.float(), offs, "e4m3", "floor"),
        ],
    }
    for triton_kernel, fns in forced.items():
        for fn in fns:
            launched = kernels_launched(fn)
            gluon = ran(GLUON_3D_KERNEL, launched) or ran(GLUON_GROUPS_KERNEL, launched)
            assert ran(triton_kernel, launched) and not gluon, (triton_kernel, launched)
    monkeypatch.setenv(GLUON_ENV, "0")
    for name, (gluon_kernel, triton_kernel, fn) in calls.items():
        launched = kernels_launched(fn)
        assert ran(triton_kernel, launched) and not ran(gluon_kernel, launched), (name, launched)
        for i, (a, b) in enumerate(zip(gluon_out[name], fn(), strict=True)):
            assert_bits_equal(a, b, f"{name} output {i}: Gluon vs MX_RECIPE_GLUON=0")
