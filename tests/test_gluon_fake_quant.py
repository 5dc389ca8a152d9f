"""The Gluon fake-quant kernel (mx_kernels.gluon_fake_quant), bit for bit vs the Triton kernel and the reference.

* CPU: argument errors, launch facts (grid, EVEN, OFFS64), the dispatch rule of
  ``common.gluon_rule``, and the kernel compiled for sm_90 without a GPU: 16-byte
  loads and stores only, no shared memory, no bar.sync, the hardware fp8 conversions both ways,
  no .ftz, no local memory.
* GPU (``@pytest.mark.gpu``): both results against the Triton kernel of ``mx_kernels.fake_quant_2d``
  (every byte, NaN payloads included: the same math on the same GPU) and against the reference
  (values; NaN positions), both rules and formats, ragged M, 3D, special values, every bf16 value,
  strided x, the row-gather mode against ``fake_quant_groups_along_m``; and that ``fake_quant_2d``
  launches the Gluon kernel on Hopper.
"""

from __future__ import annotations

import pytest
import torch
from test_cast_kernels import (
    assert_bits_equal,
    assert_values_equal,
    group_sources,
    ref_along_m,
    ref_groups_along_m,
    special_input,
)
from test_gluon_casts import gpu_cases, kernels_launched, ptx_ops, resource_usage

from mx_recipe.formats import to_mx

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
ELEMS = ["e4m3", "e5m2"]
MODES = ["floor", "rceil"]


def cfg(rows: int, block_k: int, warps: int, sub: int, lean: bool) -> dict:
    return dict(ROWS=rows, BLOCK_K=block_k, NUM_WARPS=warps, NUM_SUB=sub, LEAN=lean)


R4, R8 = cfg(4, 128, 4, 1, False), cfg(8, 256, 4, 1, False)
# the default (8 rows a thread, 2 warps, LEAN), then the others spelled out in full (a change of default
# changes no other case): 4, 8 and 16 rows a thread, 2 sub-tiles, 2 K repeats, 2 and 8 warps, LEAN
CONFIGS = [
    None,
    R4,
    R8,
    cfg(16, 512, 4, 1, False),
    cfg(4, 128, 4, 2, False),
    cfg(4, 256, 4, 1, False),
    cfg(4, 64, 2, 1, False),
    cfg(4, 256, 8, 1, False),
    cfg(4, 128, 4, 1, True),
    cfg(8, 256, 4, 1, True),
    cfg(16, 512, 4, 1, True),
]
CONFIG_IDS = ["default", "r4", "r8", "r16", "s2", "rep2", "w2", "w8", "lean_r4", "lean_r8", "lean_r16"]


def gfq():
    import mx_kernels.gluon_fake_quant

    return mx_kernels.gluon_fake_quant


# ---------------------------------------------------------------------------------------
# CPU


def test_default_config_is_the_measured_one():
    assert gfq().GLUON_FAKE_QUANT_CONFIG == cfg(8, 128, 2, 1, True)


def test_argument_errors(monkeypatch):
    g = gfq()
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="ask for along_k, along_m or both"):
        g.gluon_fake_quant_2d(x, "e4m3", "floor", False, False)
    with pytest.raises(ValueError, match=r"dim 1 of shape \(64, 48\) has size 48"):
        g.gluon_fake_quant_2d(torch.randn(64, 48, dtype=torch.bfloat16), "e4m3", "floor", True, False)
    with pytest.raises(ValueError, match="takes a 2D or 3D tensor"):
        g.gluon_fake_quant_2d(torch.randn(64), "e4m3", "floor", False, True)
    with pytest.raises(ValueError, match="e2m1 is not supported"):
        g.gluon_fake_quant_2d(x, "e2m1", "floor", True, True)
    for bad in (dict(BLOCK_K=96), dict(BLOCK_K=64, NUM_WARPS=4), dict(ROWS=32), dict(NUM_SUB=3), dict(LEAN=1)):
        with pytest.raises(ValueError, match="Gluon fake-quant config"):
            g.gluon_fake_quant_2d(x, "e4m3", "floor", True, True, bad)
    with pytest.raises(ValueError, match="unknown Gluon fake-quant config keys"):
        g.gluon_fake_quant_2d(x, "e4m3", "floor", True, True, dict(num_warps=4))
    with pytest.raises(ValueError, match="row_src must be 1D int32"):
        g.gluon_fake_quant_groups_along_m(x, torch.zeros(64, dtype=torch.int64), "e4m3", "floor")
    if not HAS_CUDA:
        with pytest.raises(RuntimeError, match="need a CUDA tensor"):
            g.gluon_fake_quant_2d(x, "e4m3", "floor", True, True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(NotImplementedError, match="do not run in the Triton interpreter"):
        g.gluon_fake_quant_2d(x, "e4m3", "floor", True, True)


def test_dispatch_rule():
    """Gluon exactly for bf16 on compute capability 9.x, no Triton config, no interpreter, env not "0"."""
    from mx_kernels.common import GLUON_ENV, gluon_rule
    from mx_kernels.fake_quant_2d import FAKE_QUANT_2D_CONFIG

    bf16 = torch.bfloat16
    assert GLUON_ENV == "MX_RECIPE_GLUON"
    assert gluon_rule((9, 0), bf16, None, False, {})
    assert gluon_rule((9, 0), bf16, None, False, {GLUON_ENV: "1"})
    assert not gluon_rule((9, 0), bf16, None, False, {GLUON_ENV: "0"})  # the escape hatch
    assert not gluon_rule((9, 0), bf16, FAKE_QUANT_2D_CONFIG, False, {})  # a Triton config: Triton
    assert not gluon_rule((9, 0), bf16, {}, False, {})  # any config, even an empty one
    assert not gluon_rule((9, 0), bf16, None, True, {})  # the interpreter
    assert not gluon_rule((9, 0), torch.float32, None, False, {})
    assert not gluon_rule((9, 0), torch.float16, None, False, {})
    for capability in (None, (8, 0), (8, 9), (10, 0), (12, 0)):  # off CUDA, Ampere, Ada, Blackwell: unmeasured
        assert not gluon_rule(capability, bf16, None, False, {}), capability


def launch_facts(shape, along_k, along_m, config=None, gather_rows=None):
    x = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    out = torch.empty(16, dtype=torch.bfloat16, device="meta")
    src = None if gather_rows is None else torch.empty(gather_rows, dtype=torch.int32, device="meta")
    m = shape[-2] if src is None else gather_rows
    m_pad = -(-m // 32) * 32 if along_m else m
    grid, kw = gfq().kernel_launch(x, src, out, out, "e4m3", "floor", along_k, along_m, m, m_pad, config)
    return grid, kw["EVEN"], kw["OFFS64"], kw["REPS"]


def test_launch_facts():
    assert launch_facts((16384, 4096), True, True) == ((512, 32, 1), True, False, 1)
    assert launch_facts((4130, 160), True, True) == ((130, 2, 1), False, False, 1)  # 4130 -> 4160 rows
    assert launch_facts((4130, 160), True, False) == ((130, 2, 1), False, False, 1)  # along K: rows < M only
    assert launch_facts((64, 8192, 5120), True, True, cfg(8, 512, 4, 1, True)) == ((256, 10, 64), True, False, 2)
    assert launch_facts((64, 8192, 5120), True, True, cfg(4, 256, 4, 2, False)) == ((128, 20, 64), True, False, 2)
    assert launch_facts((65536, 32768), True, True)[2]  # 2**31 elements in one slice: int64 offsets
    assert launch_facts((16640, 8192), False, True, gather_rows=18688) == ((584, 64, 1), False, False, 1)


def mem_ops_ok(ptx: str, elem: str, what: str) -> dict[str, int]:
    ops = ptx_ops(ptx)
    loads = {op for op in ops if op.startswith("ld.")}
    stores = {op for op in ops if op.startswith("st.")}
    assert loads == {"ld.global.v4.b32"}, what + f" {ops}"  # 16-byte loads (x; and row_src in gather)
    assert stores == {"st.global.v4.b32"}, what + f" {ops}"  # 16-byte stores of 8 bf16, both results
    assert "bar.sync" not in ops and not any(".shared" in op for op in ops), what + f" {ops}"
    assert ops.get(f"cvt.rn.satfinite.{elem}x2.f32", 0) > 0, what  # quantize: hardware cvt
    assert f"cvt.rn.f16x2.{elem}x2" in ptx, what  # dequantize: hardware cvt
    assert "cvt.rn.bf16x2.f32" in ptx, what  # the bf16 results, round to nearest even
    assert ".ftz" not in ptx, what  # subnormals and the 2**-127 factor are not flushed
    return ops


COMPILE_CASES = [
    # (shape, along_k, along_m, config, elem, mode, gather_rows)
    ((16384, 4096), True, True, None, "e4m3", "floor", None),
    ((16384, 4096), False, True, None, "e5m2", "rceil", None),
    ((16384, 4096), True, False, R8, "e4m3", "rceil", None),
    ((16384, 4096), False, True, R4, "e5m2", "floor", None),
    ((64, 8192, 5120), True, True, R8, "e5m2", "floor", None),
    ((64, 8192, 5120), False, True, None, "e4m3", "floor", None),  # the MoE grad-input default
    ((16, 8192, 5120), True, True, cfg(16, 512, 4, 1, True), "e4m3", "floor", None),
    ((4130, 160), True, True, cfg(4, 128, 4, 2, False), "e4m3", "floor", None),  # ragged M: masks
    ((5, 100, 256), True, True, cfg(4, 256, 8, 1, False), "e5m2", "rceil", None),
    ((65536, 32768), True, True, None, "e4m3", "floor", None),  # int64 offsets
    ((16640, 8192), False, True, None, "e4m3", "floor", 18688),  # row gather / scatter
    ((16640, 8192), False, True, cfg(4, 64, 2, 1, False), "e5m2", "rceil", 18688),
    ((16640, 8192), False, True, cfg(8, 256, 4, 1, True), "e4m3", "rceil", 18688),
]


@pytest.mark.parametrize("shape, along_k, along_m, config, elem, mode, gather_rows", COMPILE_CASES)
def test_compiles_for_sm90_with_the_intended_memory_ops(shape, along_k, along_m, config, elem, mode, gather_rows):
    kernel = gfq().compile_for_target(shape, elem, mode, along_k, along_m, config, gather_rows, arch=90)
    what = f"{shape} along_k={along_k} along_m={along_m} {config} {elem} {mode} gather={gather_rows}"
    ops = mem_ops_ok(kernel.asm["ptx"], elem, what)
    assert ops.get("shfl.sync.bfly.b32", 0) > 0, what  # reductions: in-thread, then shuffles within a warp
    usage = resource_usage(kernel.asm["cubin"])
    if usage is not None:
        assert usage["LOCAL"] == 0 and usage["SHARED"] == 0 and usage["REG"] <= 255, f"{what} {usage}"


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_every_gpu_test_config_compiles(config):
    """The GPU tests' configs on their small and ragged shapes (masks; K = 80 along M alone)."""
    for shape, along_k in (((96, 160), True), ((4130, 160), True), ((3, 224, 96), True), ((64, 80), False)):
        ops = ptx_ops(gfq().compile_for_target(shape, "e4m3", "floor", along_k, True, config).asm["ptx"])
        assert "bar.sync" not in ops and not any(".shared" in op for op in ops), (shape, config, ops)


# ---------------------------------------------------------------------------------------
# GPU


def triton_fake_quant_2d(x: torch.Tensor, elem: str, mode: str, along_k: bool, along_m: bool):
    """The Triton kernel with its default tile, whatever the GPU: an explicit config skips the Gluon dispatch."""
    from mx_kernels.fake_quant_2d import ALONG_M_CONFIG, FAKE_QUANT_2D_CONFIG, fake_quant_2d

    return fake_quant_2d(x, elem, mode, along_k, along_m, FAKE_QUANT_2D_CONFIG if along_k else ALONG_M_CONFIG)


def triton_groups_along_m(x: torch.Tensor, src: torch.Tensor, elem: str, mode: str) -> torch.Tensor:
    from mx_kernels.fake_quant_2d import ALONG_M_CONFIG, fake_quant_groups_along_m

    return fake_quant_groups_along_m(x, src, elem, mode, ALONG_M_CONFIG)


def check_2d(x: torch.Tensor, elem: str, mode: str, config, what: str) -> None:
    """Both results (and each alone) against the Triton kernel (bytes) and the reference (values)."""
    g = gfq()
    what = f"{what} {tuple(x.shape)} {elem} {mode} {config}"
    ref_m = ref_along_m(x, elem, mode)
    if x.shape[-1] % 32 == 0:
        ref_k = to_mx(x.cpu(), elem, mode, dim=-1).dequantize(torch.bfloat16)
        tk, tm = triton_fake_quant_2d(x, elem, mode, True, True)
        gk, gm = g.gluon_fake_quant_2d(x, elem, mode, True, True, config)
        assert_bits_equal(gk, tk, what + " along K vs triton")
        assert_bits_equal(gm, tm, what + " along M vs triton")
        assert_values_equal(gk, ref_k, what + " along K vs reference")
        assert_values_equal(gm, ref_m, what + " along M vs reference")
        gk, gm = g.gluon_fake_quant_2d(x, elem, mode, True, False, config)
        assert gm.numel() == 0
        assert_bits_equal(gk, tk, what + " along K alone vs triton")
    tk, tm = triton_fake_quant_2d(x, elem, mode, False, True)
    gk, gm = g.gluon_fake_quant_2d(x, elem, mode, False, True, config)
    assert gk.numel() == 0
    assert_bits_equal(gm, tm, what + " along M alone vs triton")
    assert_values_equal(gm, ref_m, what + " along M alone vs reference")


SHAPES = [(96, 160), (4130, 160), (160, 4128), (1024, 4096), (3, 224, 96), (5, 100, 256), (2, 4130, 512), (64, 80)]
GPU_CASES = gpu_cases(CONFIGS, CONFIG_IDS, {"default", "r4", "r8", "lean_r4", "lean_r8"})


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config, mode, elem", GPU_CASES)
def test_gpu_bit_exact(config, mode, elem):
    for seed, shape in enumerate(SHAPES):
        check_2d(special_input(shape, torch.bfloat16, "cuda", seed), elem, mode, config, "gluon fq")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config", [None, R4, R8, cfg(8, 256, 4, 1, True)], ids=["default", "r4", "r8", "lean_r8"])
def test_gpu_every_bf16_value(config):
    """All 65536 bf16 patterns (NaNs of every payload and sign, infinities, subnormals) in blocks
    along K, then along M."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).reshape(-1, 512)
    for t in (x, x.reshape(512, -1)):
        for elem in ELEMS:
            for mode in MODES:
                check_2d(t.cuda(), elem, mode, config, "all bf16")


@pytest.mark.gpu
@needs_cuda
def test_gpu_strided_input_and_empty():
    x = special_input((256, 512), torch.bfloat16, "cuda")
    check_2d(x.t(), "e4m3", "rceil", None, "strided")  # [512, 256], stride (1, 512): scalar loads
    check_2d(x[:, :384], "e5m2", "floor", R8, "row stride 512")
    empty = torch.empty(0, 64, device="cuda", dtype=torch.bfloat16)
    k, m = gfq().gluon_fake_quant_2d(empty, "e4m3", "floor", True, True)
    assert k.shape == (0, 64) and m.shape == (0, 64)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "config",
    [None, R4, R8, cfg(4, 64, 2, 1, False), cfg(4, 128, 4, 1, True)],
    ids=["default", "r4", "r8", "w2", "lean_r4"],
)
@pytest.mark.parametrize("mode, elem", [("floor", "e4m3"), ("rceil", "e4m3"), ("floor", "e5m2"), ("rceil", "e5m2")])
def test_gpu_groups_along_m_bit_exact(config, mode, elem):
    for sizes in ([40, 0, 33, 1, 64], [1040] * 4 + [0, 7], [0, 0], [4096]):
        for flip in (False, True):
            x = special_input((sum(sizes), 256), torch.bfloat16, "cuda", seed=len(sizes))
            src = group_sources(sizes, "cuda")
            if flip and sizes[0]:  # the first group's rows listed in reverse: each still comes back home
                src[: sizes[0]] = src[: sizes[0]].flip(0)
            what = f"groups {sizes} flip={flip} {elem} {mode} {config}"
            got = gfq().gluon_fake_quant_groups_along_m(x, src, elem, mode, config)
            assert_bits_equal(got, triton_groups_along_m(x, src, elem, mode), what + " vs triton")
            assert_values_equal(got, ref_groups_along_m(x, src, elem, mode), what + " vs reference")


@pytest.mark.gpu
@needs_cuda
def test_gpu_dispatch_launches_the_gluon_kernel_on_hopper(monkeypatch):
    """fake_quant_2d and fake_quant_groups_along_m (and the torch ops over them) launch the Gluon kernel on
    sm_90, the Triton kernel with MX_RECIPE_GLUON=0 or a Triton config; the same bytes."""
    import mx_kernels.ops  # noqa: F401  (registers torch.ops.mx_recipe)
    from mx_kernels.common import GLUON_ENV
    from mx_kernels.fake_quant_2d import fake_quant_2d, fake_quant_groups_along_m

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon dispatch is for compute capability 9.x (Hopper)")
    x = special_input((4130, 512), torch.bfloat16, "cuda")
    w = special_input((3, 224, 96), torch.bfloat16, "cuda", seed=1)
    src = group_sources([40, 0, 33, 1, 64], "cuda")
    g = special_input((138, 256), torch.bfloat16, "cuda", seed=2)
    calls = {
        "x both": lambda: fake_quant_2d(x, "e4m3", "floor", True, True),
        "x along M": lambda: fake_quant_2d(x, "e5m2", "rceil", False, True),
        "w both (op)": lambda: torch.ops.mx_recipe.fake_quant_2d(w, "e4m3", "rceil", True, True),
        "groups": lambda: (fake_quant_groups_along_m(g, src, "e4m3", "floor"),),
        "groups (op)": lambda: (torch.ops.mx_recipe.fake_quant_groups_along_m(g, src, "e5m2", "floor"),),
    }
    monkeypatch.delenv(GLUON_ENV, raising=False)
    gluon_out = {}
    for name, fn in calls.items():
        launched = kernels_launched(fn)
        assert any("_gluon_fake_quant_kernel" in k for k in launched), (name, launched)
        assert not any("_fake_quant_2d_kernel" in k for k in launched), (name, launched)
        gluon_out[name] = fn()
    forced = kernels_launched(lambda: fake_quant_2d(x, "e4m3", "floor", True, True, dict(BLOCK_M=32)))
    assert any("_fake_quant_2d_kernel" in k for k in forced), forced  # a Triton config: the Triton kernel
    monkeypatch.setenv(GLUON_ENV, "0")
    for name, fn in calls.items():
        launched = kernels_launched(fn)
        assert any("_fake_quant_2d_kernel" in k for k in launched), (name, launched)
        assert not any("_gluon_fake_quant_kernel" in k for k in launched), (name, launched)
        for i, (a, b) in enumerate(zip(gluon_out[name], fn(), strict=True)):
            assert_bits_equal(a, b, f"{name} output {i}: gluon vs MX_RECIPE_GLUON=0")
