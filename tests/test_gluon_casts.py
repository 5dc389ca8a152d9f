"""The Gluon casts (mx_kernels.gluon_casts: dim0, dim1, fused; 2D here, 3D in test_gluon_3d_groups.py), bit for
bit vs ``to_mx`` and the Triton kernels.

* CPU: argument errors, and the kernels compiled for sm_90 without a GPU (the explicit layouts
  must give 16-byte loads, shuffle-only reductions, no shared memory, vector transposed stores,
  the hardware cvt; every layout conversion is asserted trivial when the kernel compiles).
  Gluon kernels do not run in the Triton interpreter (3.6): the launchers refuse it.
* GPU (``@pytest.mark.gpu``): qdata and scale bytes against the reference and against
  ``cast_dim0`` / ``cast_dim1`` / ``cast_dim0_dim1``, for several layout configs, both scale rules and formats.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from test_cast_kernels import assert_bits_equal, special_input

from mx_recipe.formats import to_mx
from mx_recipe.scale_layout import blocked_numel, to_blocked

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")

ELEMS = ["e4m3", "e5m2"]
MODES = ["floor", "rceil"]
# 128 x 128 tiles, warps along M, whole-line stores: the dim1 default (the fused default adds K_FIRST)
LINES_CONFIG = dict(ROWS=8, BLOCK_K=128, NUM_WARPS=2, WARPS_M=4, NUM_SUB=4, LEAN=True, PLAIN_VIA_BLOCKED=True)
LINES_CONFIG.update(SCATTER=True, LINES=True)
# layout configs: the default, rows per thread 8 and 16, warps and K repeats, sub-tiles, LEAN
CONFIGS = [
    None,  # what cast_dim1 / cast_dim0_dim1 run on Hopper: gluon_casts.DIM1_CONFIG / DIM0_DIM1_CONFIG
    dict(ROWS=4, BLOCK_K=128, NUM_WARPS=4, NUM_SUB=2, LEAN=False, PLAIN_VIA_BLOCKED=False),  # GLUON_CONFIG
    dict(ROWS=8, BLOCK_K=256, NUM_WARPS=4, NUM_SUB=1),
    dict(ROWS=8, BLOCK_K=512, NUM_WARPS=4, NUM_SUB=2),  # 2 chunk repeats per warp
    dict(ROWS=16, BLOCK_K=512, NUM_WARPS=4, NUM_SUB=1),
    dict(ROWS=4, BLOCK_K=32, NUM_WARPS=1, NUM_SUB=4),
    dict(ROWS=4, BLOCK_K=256, NUM_WARPS=8, NUM_SUB=1),
    dict(ROWS=4, BLOCK_K=128, NUM_WARPS=4, NUM_SUB=2, LEAN=True),
    dict(ROWS=8, BLOCK_K=256, NUM_WARPS=4, NUM_SUB=1, LEAN=True),
    dict(ROWS=8, BLOCK_K=256, NUM_WARPS=4, NUM_SUB=2, LEAN=True),
    dict(ROWS=4, BLOCK_K=128, NUM_WARPS=4, NUM_SUB=2, PLAIN_VIA_BLOCKED=True),
    # the reduce-scatter of block maxima (the defaults use it): one and two sub-tiles, 2 chunk repeats
    dict(ROWS=8, BLOCK_K=256, NUM_WARPS=4, NUM_SUB=1, LEAN=True, SCATTER=True),
    dict(ROWS=8, BLOCK_K=512, NUM_WARPS=4, NUM_SUB=2, LEAN=True, SCATTER=True),
    # warps along M (WARPS_M): 128 x 128 tiles with whole-line stores (LINES: the dim1 default, the fused default
    # with K_FIRST) along M first, with 4 warps (2 chunk repeats) along K first, without LINES; the butterfly with
    # warps along M
    LINES_CONFIG,
    {**LINES_CONFIG, "NUM_WARPS": 1, "K_FIRST": True},
    {**LINES_CONFIG, "LINES": False},
    dict(ROWS=4, BLOCK_K=128, NUM_WARPS=4, WARPS_M=2, NUM_SUB=2),
]
CONFIG_IDS = ["default", "base", "r8", "r8rep2s2", "r16", "w1s4", "w8", "lean_r4", "lean_r8", "lean_r8s2"]
CONFIG_IDS += ["via_blocked", "scatter_r8", "scatter_r8rep2s2", "lines", "lines_w4", "warps_m4", "warps_m2_r4"]


def gluon():
    import mx_kernels.gluon_casts

    return mx_kernels.gluon_casts


def special_input_plus(shape: tuple[int, int], dtype: torch.dtype, device, seed: int = 0) -> torch.Tensor:
    """``special_input`` plus what the Gluon paths add cases for: a negative NaN with a payload
    (the LEAN path's NaN comes out of cvt), an all-subnormal dim1 block, an all -inf dim1 block."""
    x = special_input(shape, dtype, "cpu", seed)
    m, k = shape
    if m >= 96 and k >= 128:
        bits = x.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
        bits[40, 100] = -63 if dtype == torch.bfloat16 else -4194303  # 0xFFC1 / 0xFFC00001
        x[32:64, 101] = torch.linspace(-3e-39, 5e-39, 32).to(dtype)  # bf16 and fp32 subnormals
        x[64:96, 102] = -float("inf")
    return x.to(device)


def check_one_side(side: str, shape, dtype, elem, mode, blocked, config, seed=0):
    """gluon_cast_dim0 / gluon_cast_dim1 (``side``) against ``to_mx`` and the Triton kernel of that side."""
    import mx_kernels.cast_dim0
    import mx_kernels.cast_dim1

    x = special_input_plus(shape, dtype, "cuda", seed)
    what = f"gluon {side} {shape} {dtype} {elem} {mode} blocked={blocked} {config}"
    ref = to_mx(x.cpu() if side == "dim0" else x.cpu().t().contiguous(), elem, mode)
    triton = mx_kernels.cast_dim0 if side == "dim0" else mx_kernels.cast_dim1
    cast, triton_cast = getattr(gluon(), f"gluon_cast_{side}"), getattr(triton, f"cast_{side}")
    triton_config = getattr(triton, f"{side.upper()}_CONFIG")
    q, s = cast(x, elem, mode, blocked, config)
    assert q.dtype == ref.qdata.dtype and s.dtype == torch.float8_e8m0fnu, what
    assert_bits_equal(q, ref.qdata, what + " qdata")
    assert_bits_equal(s, to_blocked(ref.scale) if blocked else ref.scale, what + " scale")
    # the Triton kernel with its own tile (without a config, Hopper would run the Gluon kernel again)
    tq, ts = triton_cast(x, elem, mode, blocked, triton_config)
    assert_bits_equal(q, tq, what + " qdata vs triton")
    assert_bits_equal(s, ts, what + " scale vs triton")


def check_dim1(shape, dtype, elem, mode, blocked, config, seed=0):
    check_one_side("dim1", shape, dtype, elem, mode, blocked, config, seed)


def check_dim0(shape, dtype, elem, mode, blocked, config, seed=0):
    check_one_side("dim0", shape, dtype, elem, mode, blocked, config, seed)


def check_dim0_dim1(shape, dtype, elem, mode, blocked, config, seed=0):
    x = special_input_plus(shape, dtype, "cuda", seed)
    what = f"gluon dim0_dim1 {shape} {dtype} {elem} {mode} blocked={blocked} {config}"
    outs = gluon().gluon_cast_dim0_dim1(x, elem, mode, blocked, config)
    ref0, ref1 = to_mx(x.cpu(), elem, mode, dim=-1), to_mx(x.cpu().t().contiguous(), elem, mode, dim=-1)
    refs = [ref0.qdata, ref0.scale, ref1.qdata, ref1.scale]
    if blocked:
        refs[1], refs[3] = to_blocked(refs[1]), to_blocked(refs[3])
    import mx_kernels.cast_dim0_dim1

    triton_config = mx_kernels.cast_dim0_dim1.DIM0_DIM1_CONFIG  # else Hopper runs the Gluon kernel again
    triton_outs = mx_kernels.cast_dim0_dim1.cast_dim0_dim1(x, elem, mode, blocked, triton_config)
    for name, out, ref, t in zip(("q0", "s0", "q1", "s1"), outs, refs, triton_outs, strict=True):
        assert out.dtype == t.dtype, f"{what} {name} dtype {out.dtype} != {t.dtype}"
        assert_bits_equal(out, ref, f"{what} {name}")
        assert_bits_equal(out, t, f"{what} {name} vs cast_dim0_dim1")


# ---------------------------------------------------------------------------------------
# CPU


@needs_triton
def test_argument_errors(monkeypatch):
    g = gluon()
    with pytest.raises(ValueError, match=r"dim 0 of shape \(33, 64\) has size 33"):
        g.gluon_cast_dim1(torch.randn(33, 64), "e4m3", "floor")
    with pytest.raises(ValueError, match=r"dim 1 of shape \(64, 48\) has size 48"):
        g.gluon_cast_dim0_dim1(torch.randn(64, 48), "e4m3", "floor")
    with pytest.raises(ValueError, match="e2m1 is not supported"):
        g.gluon_cast_dim1(torch.randn(64, 64), "e2m1", "floor")
    with pytest.raises(ValueError, match="unknown MX scale rule"):
        g.gluon_cast_dim1(torch.randn(64, 64), "e4m3", "nearest")
    with pytest.raises(ValueError, match="takes a 2D or 3D tensor"):
        g.gluon_cast_dim1(torch.randn(64), "e4m3", "floor")
    with pytest.raises(ValueError, match="takes a 2D tensor"):  # the fused cast: 2D only
        g.gluon_cast_dim0_dim1(torch.randn(2, 64, 64), "e4m3", "floor")
    with pytest.raises(ValueError, match=r"dim 2 of shape \(2, 33, 48\) has size 48"):
        g.gluon_cast_dim0(torch.randn(2, 33, 48), "e4m3", "floor")  # dim0: rows need not be a multiple of 32
    with pytest.raises(ValueError, match=r"dim 1 of shape \(2, 33, 64\) has size 33"):
        g.gluon_cast_dim1(torch.randn(2, 33, 64), "e4m3", "floor")
    with pytest.raises(TypeError, match="bf16 or fp32"):
        g.gluon_cast_dim1(torch.randn(64, 64).half(), "e4m3", "floor")
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    bad_configs = [dict(BLOCK_K=96), dict(BLOCK_K=64, NUM_WARPS=4), dict(ROWS=32), dict(NUM_SUB=3), dict(LEAN=1)]
    bad_configs += [dict(SCATTER=True), dict(ROWS=8, BLOCK_K=256, SCATTER=True)]  # SCATTER: ROWS 8 and LEAN
    bad_configs += [dict(WARPS_M=3), dict(WARPS_M=4), dict(NUM_WARPS=8, WARPS_M=8, NUM_SUB=8, BLOCK_K=256)]
    bad_configs += [dict(LINES=True), {**LINES_CONFIG, "BLOCK_K": 256}, {**LINES_CONFIG, "PLAIN_VIA_BLOCKED": False}]
    for bad in bad_configs + [dict(PLAIN_VIA_BLOCKED=1), dict(K_FIRST="yes")]:
        with pytest.raises(ValueError, match="Gluon cast config"):
            g.gluon_cast_dim1(x, "e4m3", "floor", config=bad)
        with pytest.raises(ValueError, match="Gluon cast config"):
            g.gluon_cast_dim0(x, "e4m3", "floor", config=bad)
    with pytest.raises(ValueError, match="unknown Gluon cast config keys"):
        g.gluon_cast_dim1(x, "e4m3", "floor", config=dict(num_warps=4))
    with pytest.raises(ValueError, match="neither dim0 nor dim1"):
        g.kernel_launch(x, (x,) * 4, "e4m3", "floor", True, False, None, dim1=False)
    if not HAS_CUDA:
        for cast in (g.gluon_cast_dim1, g.gluon_cast_dim0):
            with pytest.raises(RuntimeError, match="need a CUDA tensor"):
                cast(x, "e4m3", "floor")
            with pytest.raises(RuntimeError, match="need a CUDA tensor"):
                cast(x.reshape(2, 32, 64), "e4m3", "floor")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for cast in (g.gluon_cast_dim0_dim1, g.gluon_cast_dim1, g.gluon_cast_dim0):
        with pytest.raises(NotImplementedError, match="do not run in the Triton interpreter"):
            cast(x, "e4m3", "floor")


@needs_triton
def test_launch_grid_order_and_contig():
    """kernel_launch: K_FIRST swaps the grid to (K tiles, M tiles); CONTIG (x's row stride taken as K) is on
    only for row-major x; X_EVICT by the size of x; a grid past CUDA's 65535 in y is refused with the shape named."""
    g = gluon()
    u8 = torch.empty(16, dtype=torch.uint8)
    x = torch.empty(1024, 512, dtype=torch.bfloat16)
    grid, kw = g.kernel_launch(x, (u8,) * 4, "e4m3", "floor", True, True, g.DIM0_DIM1_CONFIG)  # K_FIRST
    assert grid == (512 // 128, 1024 // 128) and kw["K_FIRST"] and kw["CONTIG"]
    grid, kw = g.kernel_launch(x, (u8,) * 4, "e4m3", "floor", True, False, g.DIM1_CONFIG)
    assert grid == (1024 // 128, 512 // 128) and not kw["K_FIRST"] and kw["CONTIG"]
    for strided in (x.t(), x[:, :256], x[::2]):
        assert not g.kernel_launch(strided, (u8,) * 4, "e4m3", "floor", True, True, None)[1]["CONTIG"]
    assert g.kernel_launch(x[:1], (u8,) * 4, "e4m3", "floor", False, False, None)[1]["CONTIG"]  # one row
    # x loads evict_last in the fused LINES kernel from EVICT_LAST_MIN_BYTES of x on (256 MiB), else the default
    big = torch.empty(16384, 8192, dtype=torch.bfloat16)

    def evict(x: torch.Tensor, dim0: bool) -> str:
        config = g.DIM0_DIM1_CONFIG if dim0 else g.DIM1_CONFIG
        return g.kernel_launch(x, (u8,) * 4, "e4m3", "floor", True, dim0, config)[1]["X_EVICT"]

    assert (evict(big, True), evict(big[:8192].contiguous(), True), evict(big, False)) == ("evict_last", "", "")
    with pytest.raises(ValueError, match=r"x \(8388736, 32\): 65537 tiles along M"):
        tall = torch.empty(8388736, 32, dtype=torch.bfloat16)
        g.kernel_launch(tall, (u8,) * 4, "e4m3", "floor", False, True, g.DIM0_DIM1_CONFIG)


@needs_triton
def test_launch_dim0_alone_and_batched():
    """dim0 alone (DIM1 off) runs along K first; 3D x is BATCHED: the expert on grid axis 2, per-expert output
    strides (qdata M * K, scales one expert's matrix, blocked or plain), int32 offsets inside an expert unless
    one expert passes 2**31 elements, and a grid past CUDA's 65535 experts refused."""
    g = gluon()
    u8 = torch.empty(16, dtype=torch.uint8)
    x = torch.empty(1024, 512, dtype=torch.bfloat16)
    grid, kw = g.kernel_launch(x, (u8,) * 4, "e4m3", "floor", True, True, g.DIM0_CONFIG, dim1=False)
    assert grid == (512 // 128, 1024 // 128) and kw["DIM0"] and not kw["DIM1"] and not kw["BATCHED"], kw
    big = torch.empty(16384, 8192, dtype=torch.bfloat16, device="meta")
    assert g.kernel_launch(big, (u8,) * 4, "e4m3", "floor", True, True, g.DIM0_CONFIG, dim1=False)[1]["X_EVICT"] == ""
    w = torch.empty(3, 1024, 512, dtype=torch.bfloat16)
    grid, kw = g.kernel_launch(w, (u8,) * 4, "e4m3", "floor", True, False, g.DIM1_CONFIG)
    assert grid == (1024 // 128, 512 // 128, 3) and kw["BATCHED"] and kw["CONTIG"] and kw["EVEN"], kw
    assert (kw["M"], kw["K"], kw["stride_xb"], kw["stride_q1b"]) == (1024, 512, 1024 * 512, 1024 * 512)
    assert kw["stride_s1b"] == blocked_numel(512, 1024 // 32) and not kw["OFFS64"]
    grid, kw = g.kernel_launch(w, (u8,) * 4, "e4m3", "floor", False, True, {**g.DIM0_CONFIG, "LINES": False}, False)
    assert grid == (512 // 128, 1024 // 128, 3) and (kw["stride_q0b"], kw["stride_s0b"]) == (1024 * 512, 1024 * 16)
    assert g.kernel_launch(w[::2], (u8,) * 4, "e4m3", "floor", True, False, None)[1]["stride_xb"] == 2 * 1024 * 512
    assert not g.kernel_launch(w.transpose(1, 2), (u8,) * 4, "e4m3", "floor", True, True, None, False)[1]["CONTIG"]
    ragged = torch.empty(3, 224, 96, dtype=torch.bfloat16)
    grid, kw = g.kernel_launch(ragged, (u8,) * 4, "e4m3", "floor", True, False, g.DIM1_CONFIG)
    assert grid == (2, 1, 3) and not kw["EVEN"]  # padded to 256 x 128 for the blocked scales, masked
    experts = torch.empty(64, 8192, 5120, dtype=torch.bfloat16, device="meta")  # E * N * K > 2**31
    assert not g.kernel_launch(experts, (u8,) * 4, "e4m3", "floor", True, False, g.DIM1_CONFIG)[1]["OFFS64"]
    huge = torch.empty(2, 65536, 32768, dtype=torch.bfloat16, device="meta")  # 2**31 elements in one expert
    assert g.kernel_launch(huge, (u8,) * 4, "e4m3", "floor", True, False, g.DIM1_CONFIG)[1]["OFFS64"]
    with pytest.raises(ValueError, match=r"x \(65536, 32, 32\): 65536 experts"):
        many = torch.empty(65536, 32, 32, dtype=torch.bfloat16, device="meta")
        g.kernel_launch(many, (u8,) * 4, "e4m3", "floor", False, False, g.DIM1_CONFIG)


def ptx_ops(ptx: str) -> dict[str, int]:
    """Counts of the memory, barrier, shuffle and fp8-conversion instructions in PTX."""
    found = re.findall(
        r"\b(?:ld|st)\.(?:global|shared)[\w.:]*|\bbar\.sync|\bshfl\.sync[\w.]*|\bcvt\.rn\.satfinite[\w.]*", ptx
    )
    return {op: found.count(op) for op in sorted(set(found))}


def cuobjdump(cubin: bytes, flag: str) -> str | None:
    """cuobjdump's output for the cubin (``-res-usage``, ``-sass``), None where the tool is missing."""
    import triton

    tool = triton.knobs.nvidia.cuobjdump.path
    if not tool or not Path(tool).exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def resource_usage(cubin: bytes) -> dict[str, int] | None:
    """REG, SHARED, LOCAL of the kernel from cuobjdump (None where the tool is missing)."""
    out = cuobjdump(cubin, "-res-usage")
    return None if out is None else {k: int(v) for k, v in re.findall(r"\b(REG|SHARED|LOCAL):(\d+)", out)}


COMPILE_CASES = [
    # (dim0, config, elem, mode, blocked, transposed store instruction)
    (False, None, "e4m3", "floor", False, "st.global.b32"),
    (False, dict(ROWS=8, BLOCK_K=256, NUM_SUB=1), "e5m2", "rceil", True, "st.global.v2.b32"),
    (False, dict(ROWS=16, BLOCK_K=512, NUM_SUB=1, LEAN=True), "e4m3", "rceil", False, "st.global.v4.b32"),
    (True, None, "e5m2", "floor", True, "st.global.b32"),
    (True, dict(ROWS=8, BLOCK_K=256, NUM_SUB=1, LEAN=True), "e4m3", "floor", False, "st.global.v2.b32"),
    (True, dict(ROWS=4, BLOCK_K=512, NUM_WARPS=2, NUM_SUB=1), "e4m3", "rceil", False, "st.global.b32"),
]


@needs_triton
@pytest.mark.parametrize("dim0, config, elem, mode, blocked, transposed_store", COMPILE_CASES)
def test_compiles_for_sm90_with_the_intended_memory_ops(dim0, config, elem, mode, blocked, transposed_store):
    kernel = gluon().compile_for_target((16384, 16384), torch.bfloat16, elem, mode, blocked, dim0, config, arch=90)
    ops = ptx_ops(kernel.asm["ptx"])
    what = f"dim0={dim0} {config} {elem} {mode} blocked={blocked}: {ops}"
    assert set(op for op in ops if op.startswith("ld.")) == {"ld.global.v4.b32"}, what  # 16-byte loads only
    assert "bar.sync" not in ops and not any(".shared" in op for op in ops), what  # reductions: registers + shuffles
    assert ops.get(f"cvt.rn.satfinite.{elem}x2.f32", 0) > 0, what
    assert ops.get(transposed_store, 0) > 0, what
    if dim0:
        assert ops.get("st.global.v2.b32", 0) > 0, what  # the row-major dim0 qdata: 8 bytes per thread
    assert ".ftz" not in kernel.asm["ptx"], what  # subnormal inputs and the 2**-127 factor are not flushed
    usage = resource_usage(kernel.asm["cubin"])
    if usage is not None:
        assert usage["LOCAL"] == 0 and usage["SHARED"] == 0 and usage["REG"] <= 255, f"{what} {usage}"


@needs_triton
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_every_test_config_compiles(config):
    """Each GPU-test config, fused and dim1, ragged (masked) and even shapes: the layout
    conversions are asserted trivial at compile time (a mistake in the hand-written linear
    layouts fails here, without a GPU)."""
    g = gluon()
    lines = bool(config and config.get("LINES"))  # its stores go through shared memory
    for dim0 in (False, True):
        for shape in ((96, 160), (4096, 4096)):
            ops = ptx_ops(g.compile_for_target(shape, torch.bfloat16, "e4m3", "floor", lines, dim0, config).asm["ptx"])
            assert ("bar.sync" in ops) == lines, (dim0, shape, config, ops)


@needs_triton
@pytest.mark.parametrize(
    "shape, dim0, dim1",
    [((16384, 16384), True, True), ((16384, 16384), False, True), ((16384, 16384), True, False),
     ((16, 8192, 5120), False, True), ((16, 8192, 5120), True, False)],
    ids=["fused", "dim1", "dim0", "3d_dim1", "3d_dim0"],
)  # fmt: skip
def test_lines_store_whole_lines(shape, dim0, dim1):
    """LINES: every output leaves as 16-byte stores (q0 rows and q1 k-rows as whole 128-byte lines, each
    blocked scale tile as 16-byte rows), after layout conversions through shared memory; the loads and the
    reductions are the SCATTER tile's (16-byte loads, shuffles). The same for one side alone and per expert."""
    g = gluon()
    kernel = g.compile_for_target(shape, torch.bfloat16, "e4m3", "floor", True, dim0, LINES_CONFIG, dim1=dim1)
    ops = ptx_ops(kernel.asm["ptx"])
    stores = {op: n for op, n in ops.items() if op.startswith("st.global")}
    # per thread: 4 stores of 16 bytes for each 64-byte qdata share, one 16-byte scale row of each tile
    assert stores == {"st.global.v4.b32": 10 if dim0 and dim1 else 5}, ops
    # 16-byte loads of x; the fused kernel's with evict_last at this size (512 MiB, EVICT_LAST_MIN_BYTES)
    load = "ld.global.L1::evict_last.L2::cache_hint.v4.b32" if dim0 and dim1 else "ld.global.v4.b32"
    assert set(op for op in ops if op.startswith("ld.global")) == {load}, ops
    assert ops.get("shfl.sync.bfly.b32", 0) > 0 and ops.get("bar.sync", 0) > 0, ops
    usage = resource_usage(kernel.asm["cubin"])
    if usage is not None:
        assert usage["LOCAL"] == 0 and usage["REG"] <= 128, usage  # 2 programs of 8 warps per SM


def sass_instructions(cubin: bytes) -> int | None:
    """SASS instructions in the cubin (None where cuobjdump is missing)."""
    out = cuobjdump(cubin, "-sass")
    return None if out is None else len(re.findall(r"/\*[0-9a-f]{4}\*/\s+[@A-Z]", out))


@needs_triton
@pytest.mark.parametrize("dim0", [True, False])
def test_scatter_stays_in_registers_and_issues_fewer_instructions(dim0):
    """The reduce-scatter's layout swaps must lower to warp shuffles: a conversion with two register-lane
    swaps at once goes through shared memory (bar.sync). And it is there to cut instructions: fewer
    SASS than the butterfly on the same tile (sm_90: fused 760 against 1000)."""
    g = gluon()
    counts = {}
    for scatter in (False, True):
        config = dict(ROWS=8, BLOCK_K=256, NUM_SUB=1, LEAN=True, SCATTER=scatter)
        kernel = g.compile_for_target((4096, 4096), torch.bfloat16, "e4m3", "rceil", True, dim0, config)
        ops = ptx_ops(kernel.asm["ptx"])
        assert "bar.sync" not in ops and not any(".shared" in op for op in ops), (scatter, ops)
        counts[scatter] = sass_instructions(kernel.asm["cubin"])
    if counts[False] is not None:
        assert counts[True] < 0.9 * counts[False], counts


@needs_triton
@pytest.mark.parametrize("dim0", [False, True])
def test_int64_offsets_compile(dim0):
    """2**31 elements switch the address math to int64 (OFFS64): that variant compiles too (it did not,
    with two differently typed returns in _wide), with and without LINES."""
    ptx = gluon().compile_for_target((65536, 32768), torch.bfloat16, "e4m3", "floor", False, dim0).asm["ptx"]
    assert ".s64" in ptx and "bar.sync" not in ptx
    ptx = gluon().compile_for_target((65536, 32768), torch.bfloat16, "e4m3", "floor", True, dim0, LINES_CONFIG)
    assert ".s64" in ptx.asm["ptx"]


# ---------------------------------------------------------------------------------------
# GPU: the hardware cvt.rn.satfinite path

DIM1_SHAPES = [(32, 160), (96, 160), (32, 33), (64, 100), (4128, 160), (160, 4128), (1024, 4096), (256, 512)]
FUSED_SHAPES = [(32, 32), (96, 160), (4128, 160), (160, 4128), (1024, 4096), (256, 512)]
DIM0_SHAPES = [(1, 96), (33, 64), (100, 160), (4128, 160), (160, 4128), (1024, 4096), (256, 512)]  # any row count


def gpu_cases(configs: list, config_ids: list[str], full: set[str]) -> list:
    """(config, mode, elem) params: every rule and format for the configs in ``full`` (the default and
    the likely winners), two combinations for the rest."""
    return [
        pytest.param(config, mode, elem, id=f"{cid}-{mode}-{elem}")
        for config, cid in zip(configs, config_ids, strict=True)
        for mode in MODES
        for elem in ELEMS
        if cid in full or (mode, elem) in (("floor", "e4m3"), ("rceil", "e5m2"))
    ]


GPU_CASES = gpu_cases(CONFIGS, CONFIG_IDS, {"default", "r8", "lean_r8", "scatter_r8", "lines"})


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("side", ["dim1", "dim0"])
@pytest.mark.parametrize("config, mode, elem", GPU_CASES)
def test_gpu_one_side_bit_exact(config, mode, elem, side):
    for blocked in (False, True):
        for shape in DIM0_SHAPES if side == "dim0" else DIM1_SHAPES:
            check_one_side(side, shape, torch.bfloat16, elem, mode, blocked, config)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("config, mode, elem", GPU_CASES)
def test_gpu_dim0_dim1_bit_exact(config, mode, elem):
    for blocked in (False, True):
        for shape in FUSED_SHAPES:
            check_dim0_dim1(shape, torch.bfloat16, elem, mode, blocked, config)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "config",
    [
        None,
        dict(ROWS=8, BLOCK_K=256, NUM_SUB=1, LEAN=True),
        dict(ROWS=8, BLOCK_K=512, NUM_SUB=2, LEAN=True, SCATTER=True),
        LINES_CONFIG,
    ],
    ids=["default", "lean_r8", "scatter_r8rep2s2", "lines"],
)
@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("mode", MODES)
def test_gpu_fp32_input_bit_exact(mode, elem, config):
    for blocked in (False, True):
        for shape in [(96, 160), (64, 100), (1024, 4096)]:
            check_dim1(shape, torch.float32, elem, mode, blocked, config)
        for shape in [(33, 64), (1024, 4096)]:
            check_dim0(shape, torch.float32, elem, mode, blocked, config)
        for shape in [(96, 160), (1024, 4096)]:
            check_dim0_dim1(shape, torch.float32, elem, mode, blocked, config)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "config", [None, dict(LEAN=True), dict(ROWS=8, BLOCK_K=256, NUM_SUB=1, LEAN=True), LINES_CONFIG]
)
def test_gpu_every_bf16_value(config):
    """All 65536 bf16 patterns (NaNs of every payload and sign, infinities, subnormals), in blocks
    along M (dim1) and along K (dim0), through both kernels."""
    g = gluon()
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    for x in (bits.view(torch.bfloat16).reshape(-1, 512), bits.view(torch.bfloat16).reshape(512, -1)):
        for elem in ELEMS:
            for mode in MODES:
                what = f"all bf16 {tuple(x.shape)} {elem} {mode} {config}"
                ref0, ref1 = to_mx(x, elem, mode), to_mx(x.t().contiguous(), elem, mode)
                q, s = g.gluon_cast_dim1(x.cuda(), elem, mode, config=config)
                assert_bits_equal(q, ref1.qdata, what + " dim1 qdata")
                assert_bits_equal(s, ref1.scale, what + " dim1 scale")
                q, s = g.gluon_cast_dim0(x.cuda(), elem, mode, config=config)
                assert_bits_equal(q, ref0.qdata, what + " dim0 qdata")
                assert_bits_equal(s, ref0.scale, what + " dim0 scale")
                q0, s0, q1, s1 = g.gluon_cast_dim0_dim1(x.cuda(), elem, mode, config=config)
                for name, out, ref in (("q0", q0, ref0.qdata), ("s0", s0, ref0.scale), ("q1", q1, ref1.qdata)):
                    assert_bits_equal(out, ref, f"{what} fused {name}")
                assert_bits_equal(s1, ref1.scale, what + " fused s1")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_strided_input_and_empty():
    g = gluon()
    x = special_input_plus((256, 512), torch.bfloat16, "cuda")
    xt = x.t()  # [512, 256], stride (1, 512): the unvectorized load path
    q, s = g.gluon_cast_dim1(xt, "e4m3", "rceil")
    ref = to_mx(x.cpu(), "e4m3", "rceil")
    assert_bits_equal(q, ref.qdata, "strided qdata")
    assert_bits_equal(s, ref.scale, "strided scale")
    ref0 = to_mx(xt.cpu(), "e5m2", "rceil")
    for blocked in (False, True):  # dim0 on the transposed view and on a row stride of 512
        q, s = g.gluon_cast_dim0(xt, "e5m2", "rceil", blocked)
        assert_bits_equal(q, ref0.qdata, "strided dim0 qdata")
        assert_bits_equal(s, to_blocked(ref0.scale) if blocked else ref0.scale, "strided dim0 scale")
        q, s = g.gluon_cast_dim0(x[:, :96], "e4m3", "floor", blocked)
        ref = to_mx(x[:, :96].cpu(), "e4m3", "floor")
        assert_bits_equal(q, ref.qdata, "row stride dim0 qdata")
        assert_bits_equal(s, to_blocked(ref.scale) if blocked else ref.scale, "row stride dim0 scale")
    q0, s0, q1, s1 = g.gluon_cast_dim0_dim1(xt, "e5m2", "floor", True)
    import mx_kernels.cast_dim0_dim1

    ref = mx_kernels.cast_dim0_dim1.cast_dim0_dim1(xt, "e5m2", "floor", True)
    for name, a, b in zip(("q0", "s0", "q1", "s1"), (q0, s0, q1, s1), ref, strict=True):
        assert_bits_equal(a, b, f"strided fused {name}")
    q, s = g.gluon_cast_dim1(torch.empty(0, 64, device="cuda", dtype=torch.bfloat16), "e4m3", "floor")
    assert q.shape == (64, 0) and s.shape == (64, 0)
    for shape in ((0, 64), (5, 0)):
        q, s = g.gluon_cast_dim0(torch.empty(shape, device="cuda", dtype=torch.bfloat16), "e4m3", "floor")
        assert q.shape == shape and s.shape == (shape[0], shape[1] // 32)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_int64_offsets_match_triton_kernels():
    """2**31 elements: the int64 offset path (OFFS64), against the Triton kernels on the GPU."""
    import mx_kernels.cast_dim0_dim1
    import mx_kernels.cast_dim1

    g = gluon()
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs ~20 GiB of GPU memory")
    x = torch.randn(65536, 32768, device="cuda", dtype=torch.bfloat16)
    x[-1, -1] = float("nan")
    import mx_kernels.cast_dim0

    ref = mx_kernels.cast_dim1.cast_dim1(x, "e4m3", "floor", config=mx_kernels.cast_dim1.DIM1_CONFIG)
    for a, b in zip(g.gluon_cast_dim1(x, "e4m3", "floor"), ref, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    del a, b, ref
    ref = mx_kernels.cast_dim0.cast_dim0(x, "e5m2", "rceil", True, mx_kernels.cast_dim0.DIM0_CONFIG)
    for a, b in zip(g.gluon_cast_dim0(x, "e5m2", "rceil", True), ref, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    del a, b, ref
    triton_config = mx_kernels.cast_dim0_dim1.DIM0_DIM1_CONFIG  # else Hopper runs the Gluon kernel again
    ref = mx_kernels.cast_dim0_dim1.cast_dim0_dim1(x, "e4m3", "rceil", config=triton_config)
    for config in (dict(ROWS=8, BLOCK_K=256, NUM_SUB=1), LINES_CONFIG):
        outs = g.gluon_cast_dim0_dim1(x, "e4m3", "rceil", config=config)
        for name, a, b in zip(("q0", "s0", "q1", "s1"), outs, ref, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (name, config)
        del outs


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_large_fused_loads_evict_last_and_matches_triton():
    """From EVICT_LAST_MIN_BYTES of x (256 MiB) the fused kernel loads x with evict_last: the same bytes as the
    Triton fused kernel, both scale layouts, with special values at the tile edges."""
    import mx_kernels.cast_dim0_dim1

    g = gluon()
    x = torch.randn(16384, 8192, device="cuda", dtype=torch.bfloat16) * 4
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40])
    x[-1, -1], x[127, 127] = 0.0, 3e38
    assert x.nbytes >= g.EVICT_LAST_MIN_BYTES
    triton_config = mx_kernels.cast_dim0_dim1.DIM0_DIM1_CONFIG  # else Hopper runs the Gluon kernel again
    for mode, blocked in (("floor", True), ("rceil", False)):
        ref = mx_kernels.cast_dim0_dim1.cast_dim0_dim1(x, "e5m2", mode, blocked, triton_config)
        outs = g.gluon_cast_dim0_dim1(x, "e5m2", mode, blocked)
        for name, a, b in zip(("q0", "s0", "q1", "s1"), outs, ref, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (name, mode, blocked)


def kernels_launched(fn) -> set[str]:
    """Names of the GPU kernels ``fn()`` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # compiled outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type.name == "CUDA"}


@pytest.mark.gpu
def test_gpu_casts_launch_the_gluon_kernel_on_hopper(monkeypatch):
    """cast_dim0, cast_dim1 (2D; 3D: tests/test_gluon_3d_groups.py) and cast_dim0_dim1 launch the Gluon kernel
    on sm_90 for bf16 input, the Triton one with MX_RECIPE_GLUON=0 or a Triton config and for fp32 input; the
    same bytes either way."""
    from mx_kernels.cast_dim0 import DIM0_CONFIG, cast_dim0
    from mx_kernels.cast_dim0_dim1 import cast_dim0_dim1
    from mx_kernels.cast_dim1 import cast_dim1
    from mx_kernels.common import GLUON_ENV

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon dispatch is for compute capability 9.x (Hopper)")
    x = special_input_plus((320, 416), torch.bfloat16, "cuda")
    calls = {
        "dim0": lambda: cast_dim0(x, "e5m2", "floor"),
        "dim0 blocked": lambda: cast_dim0(x, "e4m3", "rceil", blocked=True),
        "dim1": lambda: cast_dim1(x, "e4m3", "floor"),
        "dim1 blocked": lambda: cast_dim1(x, "e5m2", "rceil", blocked=True),
        "fused": lambda: cast_dim0_dim1(x, "e4m3", "rceil"),
        "fused blocked": lambda: cast_dim0_dim1(x, "e5m2", "floor", blocked=True),
    }
    monkeypatch.delenv(GLUON_ENV, raising=False)
    gluon_out = {}
    for name, fn in calls.items():
        launched = kernels_launched(fn)
        assert any("_gluon_cast_kernel" in k for k in launched), (name, launched)
        gluon_out[name] = fn()
    for fn in (
        lambda: cast_dim1(x, "e4m3", "floor", config=dict(BLOCK_K=64, NUM_SUB=2, num_warps=1)),
        lambda: cast_dim1(x.float(), "e4m3", "floor"),
        lambda: cast_dim0(x, "e4m3", "floor", config=DIM0_CONFIG),
        lambda: cast_dim0(x.float(), "e4m3", "floor"),
    ):
        assert not any("_gluon_cast_kernel" in k for k in kernels_launched(fn))
    monkeypatch.setenv(GLUON_ENV, "0")
    for name, fn in calls.items():
        assert not any("_gluon_cast_kernel" in k for k in kernels_launched(fn)), name
        for i, (a, b) in enumerate(zip(gluon_out[name], fn(), strict=True)):
            assert_bits_equal(a, b, f"{name} output {i}: Gluon vs MX_RECIPE_GLUON=0")
