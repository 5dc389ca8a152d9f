"""The one dispatch rule (mx_recipe.ops.dispatch) and the README table it generates; the device probe
(mx_recipe.ops.device) and the kernel settings (mx_recipe.ops.settings) it reads."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from mx_recipe.ops import (
    KernelSettings,
    capability,
    dispatch,
    get_kernel_settings,
    kernel_settings,
    pretend_capability,
    set_kernel_settings,
)
from mx_recipe.ops.mx_cast import cast_dim0, fake_quant_dim0_dim1

README = Path(__file__).resolve().parents[1] / "README.md"
HOPPER, BLACKWELL = (9, 0), (10, 0)


@pytest.mark.parametrize("op", list(dispatch.OPS))
def test_rule(op):
    bf16, fp32 = torch.bfloat16, torch.float32
    assert dispatch.rule(op, None, bf16, "e4m3", "nearest") == "reference"  # off CUDA
    assert dispatch.rule(op, HOPPER, bf16, "e4m3", "nearest") == "gluon"
    assert dispatch.rule(op, (9, 0), bf16, "e5m2", "nearest", gluon=False) == "triton"  # KernelSettings(gluon=False)
    assert dispatch.rule(op, BLACKWELL, bf16, "e5m2", "nearest") == "triton"
    assert dispatch.rule(op, (8, 9), bf16, "e4m3", "nearest") == "triton"
    fake_quant = op.startswith("fake_quant")
    fp4_kernel = "triton"  # e2m1: the Triton casts (packed codes) and fake-quants; on Hopper the Gluon cast along M
    assert dispatch.rule(op, HOPPER, bf16, "e2m1", "nearest") == ("gluon" if op == "cast_dim1" else fp4_kernel)
    assert dispatch.rule(op, HOPPER, bf16, "e2m1", "nearest", gluon=False) == fp4_kernel
    assert dispatch.rule(op, BLACKWELL, bf16, "e2m1", "nearest") == fp4_kernel
    assert dispatch.rule(op, HOPPER, fp32, "e2m1", "nearest") == ("reference" if fake_quant else fp4_kernel)
    # the Triton fake-quants' and one-sided casts' draws; the fused and per-group casts round to nearest
    sr_kernel = "reference" if op in ("cast_dim0_dim1", "cast_groups_dim1", "fake_quant_groups") else "triton"
    assert dispatch.rule(op, HOPPER, bf16, "e2m1", "stochastic") == sr_kernel
    assert dispatch.rule(op, BLACKWELL, bf16, "e2m1", "stochastic") == sr_kernel
    assert dispatch.rule(op, HOPPER, fp32, "e2m1", "stochastic") == ("reference" if fake_quant else sr_kernel)
    assert dispatch.rule(op, HOPPER, bf16, "e4m3", "stochastic") == "reference"  # fp8 kernels round to nearest
    fp32_kernel = "reference" if fake_quant else "triton"  # the fake-quant kernels take bf16
    assert dispatch.rule(op, HOPPER, fp32, "e4m3", "nearest") == fp32_kernel


def test_every_op_names_real_launchers():
    pytest.importorskip("triton")
    for op, spec in dispatch.OPS.items():
        assert callable(spec.reference), op
        for kind in ("triton", "gluon"):
            assert callable(dispatch.launcher(op, kind)), (op, kind)
        assert hasattr(torch.ops.mx_recipe, op), op


def test_implementation_reads_the_device_and_the_settings(pretend_gpu):
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.zeros(32, 32, dtype=torch.bfloat16)
    meta = torch.zeros(32, 32, dtype=torch.bfloat16, device="meta")
    pretend_gpu(HOPPER)
    assert dispatch.implementation("cast_dim0", x, "e4m3") == "reference"  # a CPU tensor stays on the CPU
    assert dispatch.implementation("cast_dim0", meta, "e4m3") == "reference"  # not CUDA
    with FakeTensorMode():  # CUDA tensors without a GPU
        cuda = torch.empty(32, 32, dtype=torch.bfloat16, device="cuda")
    assert dispatch.implementation("cast_dim0", cuda, "e4m3") == "gluon"
    with kernel_settings(gluon=False):
        assert dispatch.implementation("cast_dim0", cuda, "e4m3") == "triton"
    assert dispatch.implementation("cast_dim0", cuda, "e4m3") == "gluon"
    with pretend_capability(BLACKWELL):
        assert dispatch.implementation("cast_dim0", cuda, "e4m3") == "triton"
    with pretend_capability(None):  # ROCm
        assert dispatch.implementation("cast_dim0", cuda, "e4m3") == "reference"


def test_pretended_capabilities_nest_and_end_with_their_block():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    real = capability(cuda)
    assert real is None or torch.cuda.is_available()
    with pretend_capability(HOPPER):
        assert capability(cuda) == HOPPER and capability(torch.device("cuda")) == HOPPER
        assert capability(cpu) is None
        with pretend_capability(BLACKWELL):
            assert capability(cuda) == BLACKWELL
        assert capability(cuda) == HOPPER
    assert capability(cuda) == real


def test_kernel_settings_hold_for_their_block_and_are_restored():
    assert get_kernel_settings() == KernelSettings()
    with kernel_settings(gluon=False, check_offs=True) as inside:
        assert get_kernel_settings() is inside == KernelSettings(gluon=False, check_offs=True)
        with kernel_settings(check_offs=False):
            assert get_kernel_settings() == KernelSettings(gluon=False)
        assert get_kernel_settings() == inside
    assert get_kernel_settings() == KernelSettings()
    previous = set_kernel_settings(KernelSettings(gluon=False))
    try:
        assert previous == KernelSettings() and not get_kernel_settings().gluon
    finally:
        set_kernel_settings(previous)
    with pytest.raises(TypeError):
        with kernel_settings(gluon_kernels=False):
            pass
    assert get_kernel_settings() == KernelSettings()


def test_the_reference_path_runs_off_cuda():
    x = torch.randn(64, 96, dtype=torch.bfloat16)
    assert cast_dim0(x).qdata.shape == (64, 96)
    k, m = fake_quant_dim0_dim1(torch.randn(40, 64, dtype=torch.bfloat16))
    assert k.shape == (40, 64) and m.shape == (64, 64)


def test_readme_table_is_generated_from_the_rule():
    table = dispatch.device_table()
    assert table.count("\n") == len(dispatch.OPS) + 1
    assert table in README.read_text(), "README.md's kernel table differs from mx_recipe.ops.dispatch.device_table()"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_launch_cache_wraps_every_kernel():
    """Every launcher's kernel runs through a LaunchCache (module-level ``_LAUNCHES``)."""
    import importlib

    from mx_kernels.launch_cache import LaunchCache

    for spec in dispatch.OPS.values():
        for path in (spec.triton, spec.gluon):
            module = importlib.import_module(f"mx_kernels.{path.split(':')[0]}")
            assert isinstance(module._LAUNCHES, LaunchCache), path


def test_draw_seed_is_one_int64_draw_from_the_generator():
    """The seed of every kernel's stochastic rounding (MX and NVFP4): the GPU tests replay this draw."""
    x = torch.zeros(8, 8, dtype=torch.bfloat16)
    seed = dispatch.draw_seed(x, torch.Generator().manual_seed(3))
    want = torch.randint(0, 2**62, (1,), dtype=torch.int64, generator=torch.Generator().manual_seed(3))
    assert seed.dtype == torch.int64 and seed.device == x.device and torch.equal(seed, want)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        first = dispatch.draw_seed(x, None)  # the default generator
        torch.manual_seed(4)
        assert torch.equal(first, torch.randint(0, 2**62, (1,), dtype=torch.int64))


def test_compiled_layers_trace_the_capability_lookup_without_a_warning():
    """Dynamo traces ``implementation`` inside every compiled MX layer; a functools cache on the capability lookup
    made it warn of the cache wrapper ("Silent incorrectness is only a potential risk") in every training log. The
    real lookup of cuda:0, whatever this machine holds, first probed then cached: in a fresh interpreter, whose
    probe has cached nothing yet."""
    code = textwrap.dedent("""
        import warnings
        import torch
        from mx_recipe.ops import capability

        cuda = torch.device("cuda", 0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lookup = torch.compile(lambda t: (t, capability(cuda)), backend="eager", fullgraph=True)
            traced = [lookup(torch.ones(2))[1]]  # traces the probe
            torch._dynamo.reset()
            traced.append(lookup(torch.ones(2))[1])  # traces the cached value
        assert traced == [capability(cuda)] * 2, traced
        cache_warnings = [str(w.message) for w in caught if "cache wrapper" in str(w.message)]
        assert not cache_warnings, cache_warnings
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=README.parent, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_compiled_linear_resolves_its_default_backend_without_a_warning(monkeypatch):
    """``mx_linear`` with no backend looks up the default one; compiled, Dynamo traces that lookup (its eager cache
    made Dynamo warn of the cache wrapper)."""
    import torch._dynamo.utils

    from mx_recipe import MXRecipe, mx_linear

    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())
    torch._dynamo.reset()
    recipe = MXRecipe.from_name("mxfp8")
    x, w = torch.randn(64, 64), torch.randn(32, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(lambda a, b: mx_linear(a, b, None, recipe), backend="eager")(x, w)
    assert torch.equal(out, mx_linear(x, w, None, recipe))
    assert not [w for w in caught if "cache wrapper" in str(w.message)], [str(w.message) for w in caught]
