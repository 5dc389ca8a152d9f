"""mx_kernels.launch_cache: which launches share a compiled kernel, and that a cached launch writes what the
JIT launch writes.

* CPU: the key (what Triton specializes on), and the cache's decisions, with a recording stand-in for a JIT
  kernel and for Triton's driver. A compiled kernel cannot be loaded without a GPU.
* GPU (``@pytest.mark.gpu``): every kernel (the Triton ones, the Gluon ones on Hopper) launched through the cache,
  byte-equal to the same launches through Triton's JIT (the kernel setting ``launch_cache=False``), x aligned and
  not.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch

from mx_recipe.ops import kernel_settings

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


def key(grid=(4, 2), device=0, **kwargs):
    from mx_kernels.launch_cache import launch_key

    return launch_key(grid, kwargs, device)


def test_key_is_the_same_for_other_tensors_of_the_same_kind():
    a, b = torch.empty(64, dtype=torch.bfloat16), torch.empty(64, dtype=torch.bfloat16)
    assert key(x=a, M=64, BLOCK=128) == key(x=b, M=64, BLOCK=128)


def test_key_tells_apart_what_triton_specializes_on():
    x = torch.empty(64, dtype=torch.bfloat16)
    assert x.data_ptr() % 16 == 0
    base = key(x=x, M=64, BLOCK=128)
    assert key(x=x[1:], M=64, BLOCK=128) != base  # a 2-byte offset: not 16-byte aligned
    assert key(x=x[8:], M=64, BLOCK=128) == base  # 16 bytes on: aligned again
    assert key(x=x.float(), M=64, BLOCK=128) != base
    assert key(x=x, M=65, BLOCK=128) != base
    assert key(x=x, M=64, BLOCK=256) != base
    assert key(x=x, M=64, BLOCK=128, num_warps=8) != base
    assert key(grid=(4, 3), x=x, M=64, BLOCK=128) != base
    assert key(device=1, x=x, M=64, BLOCK=128) != base


class Recorder:
    """Stands in for a JIT kernel: ``kernel[grid](**kwargs)`` records the launch and returns a stand-in for
    the CompiledKernel, whose ``run`` records what the cache passes the launcher."""

    def __init__(self):
        def kernel(x_ptr, M, BLOCK: int = 16):
            pass

        self.params = [
            type("Param", (), dict(name=p.name, default=p.default))
            for p in inspect.signature(kernel).parameters.values()
        ]
        self.jit_launches, self.direct_launches = [], []

    def __getitem__(self, grid):
        def launch(**kwargs):
            self.jit_launches.append((grid, kwargs))
            return self

        return launch

    # the CompiledKernel side
    function, packed_metadata = "function", "metadata"

    def run(self, g0, g1, g2, stream, function, metadata, launch_metadata, enter, exit_, *args):
        self.direct_launches.append(((g0, g1, g2), stream, function, metadata, launch_metadata, enter, exit_, args))


class FakeDriver:
    class active:  # noqa: N801  (as triton.runtime.driver.active)
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 1234)


@pytest.fixture
def cache(monkeypatch):
    from mx_kernels import launch_cache

    monkeypatch.setattr(launch_cache, "driver", FakeDriver)
    kernel = Recorder()
    return launch_cache.LaunchCache(kernel, max_plans=2), kernel


def test_a_repeated_launch_skips_the_jit(cache):
    cache, kernel = cache
    x1, x2 = torch.empty(64), torch.empty(64)
    cache.launch((4, 2), dict(x_ptr=x1, M=64))
    assert len(kernel.jit_launches) == 1 and not kernel.direct_launches
    cache.launch((4, 2), dict(x_ptr=x2, M=64))
    assert len(kernel.jit_launches) == 1
    grid, stream, function, metadata, launch_metadata, enter, exit_, args = kernel.direct_launches[0]
    assert (grid, stream, function, metadata) == ((4, 2, 1), 1234, "function", "metadata")
    assert (launch_metadata, enter, exit_) == (None, None, None)
    assert args[0] is x2 and args[1:] == (64, 16)  # this call's tensor, then the arguments in order, defaults too


def test_a_plan_holds_no_tensor_of_its_first_call(cache):
    import gc
    import weakref

    cache, kernel = cache
    x = torch.empty(64)
    ref = weakref.ref(x)
    cache.launch((4, 2), dict(x_ptr=x, M=64))
    del x
    kernel.jit_launches.clear()  # the stand-in's own record of the call
    gc.collect()
    assert ref() is None and len(cache.plans) == 1


def test_a_new_key_takes_the_jit_and_old_plans_are_dropped(cache):
    cache, kernel = cache
    x = torch.empty(64)
    for m in (64, 128, 256, 64):  # max_plans 2: the plan for 64 was dropped by 256
        cache.launch((4,), dict(x_ptr=x, M=m))
    assert [k["M"] for _, k in kernel.jit_launches] == [64, 128, 256, 64]
    cache.launch((4,), dict(x_ptr=x, M=64))
    assert len(kernel.jit_launches) == 4 and len(kernel.direct_launches) == 1
    assert len(cache.plans) == 2


def test_the_settings_switch_and_launch_hooks_force_the_jit(cache):
    from triton import knobs

    cache, kernel = cache
    x = torch.empty(64)
    cache.launch((4,), dict(x_ptr=x, M=64))
    with kernel_settings(launch_cache=False):
        cache.launch((4,), dict(x_ptr=x, M=64))
    hooks = knobs.runtime.launch_enter_hook
    hook = lambda metadata: None  # noqa: E731
    hooks.add(hook)
    try:
        cache.launch((4,), dict(x_ptr=x, M=64))
    finally:
        hooks.remove(hook)
    assert len(kernel.jit_launches) == 3 and not kernel.direct_launches
    cache.launch((4,), dict(x_ptr=x, M=64))
    assert len(kernel.direct_launches) == 1


def test_an_unhashable_argument_is_launched_uncached(cache):
    cache, kernel = cache
    cache.launch((4,), dict(x_ptr=torch.empty(4), M=[1, 2]))
    cache.launch((4,), dict(x_ptr=torch.empty(4), M=[1, 2]))
    assert len(kernel.jit_launches) == 2 and not cache.plans


def test_a_keyed_launch_builds_its_arguments_once_per_key_and_alignment(cache):
    cache, kernel = cache
    builds = []

    def build(t: torch.Tensor, m: int):
        def make():
            builds.append(m)
            return (4,), dict(x_ptr=t, M=m)

        return make

    x = torch.empty(64)
    for t, m in ((x, 64), (x, 64), (x[1:], 64), (x, 32)):  # x[1:]: 4 bytes on, another specialization
        cache.launch_keyed(("m", m), build(t, m), x_ptr=t)
    assert builds == [64, 64, 32] and len(kernel.jit_launches) == 3
    ((grid, _, _, _, _, _, _, args),) = kernel.direct_launches
    assert grid == (4, 1, 1) and args == (x.data_ptr(), 64, 16)  # the address as an int, then the arguments


def test_a_keyed_launch_must_name_every_tensor_of_the_launch(cache):
    cache, _ = cache
    with pytest.raises(ValueError, match="are not the launch's"):
        cache.launch_keyed(("k",), lambda: ((4,), dict(x_ptr=torch.empty(4), M=4)), y_ptr=torch.empty(4))


def test_a_keyed_launch_takes_the_jit_when_the_cache_is_off(cache):
    cache, kernel = cache
    with kernel_settings(launch_cache=False):
        for _ in range(2):
            cache.launch_keyed(("k",), lambda: ((4,), dict(x_ptr=torch.empty(4), M=4)), x_ptr=torch.empty(4))
    assert len(kernel.jit_launches) == 2 and not kernel.direct_launches and not cache.keyed


# ---------------------------------------------------------------------------------------------------------------
# GPU: through the cache and through the JIT, the same bytes


def launches(x: torch.Tensor) -> dict:
    """Launchers of every kernel (each launches through its module's LaunchCache): the Triton ones, and on Hopper
    the Gluon ones."""
    from mx_kernels.mx import cast_groups_dim1, fake_quant_2d, unblock_scales
    from mx_kernels.mx import casts as triton_casts
    from mx_kernels.spec import blocked_numel

    m, k = x.shape
    offs = torch.tensor([m // 4 // 32 * 32, m // 32 * 32], dtype=torch.int32, device=x.device)
    src = torch.arange(m // 32 * 32, dtype=torch.int32, device=x.device)  # every row once, in order
    scales = torch.arange(blocked_numel(m, k // 32), device=x.device).to(torch.uint8)
    calls = {
        "triton dim0 plain": lambda: triton_casts.cast_dim0(x, "e4m3", "floor"),
        "triton dim1 blocked": lambda: triton_casts.cast_dim1(x, "e4m3", "rceil", True),
        "triton fused": lambda: triton_casts.cast_dim0_dim1(x, "e5m2", "floor"),
        "triton groups": lambda: cast_groups_dim1.cast_groups_dim1(x, offs, "e4m3", "rceil"),
        "triton fake quant": lambda: fake_quant_2d.fake_quant_2d(x, "e4m3", "floor", True, True),
        "triton groups along M": lambda: (fake_quant_2d.fake_quant_groups_along_m(x, src, "e5m2", "rceil"),),
        "unblock": lambda: (unblock_scales.unblock_scales(scales, m, k // 32),),
    }
    if torch.cuda.get_device_capability(x.device)[0] == 9:
        from mx_kernels.gluon import cast_groups as gluon_cast_groups
        from mx_kernels.gluon import casts as gluon_casts
        from mx_kernels.gluon import fake_quant as gluon_fake_quant

        calls.update({
            "gluon dim0 plain": lambda: gluon_casts.cast_dim0(x, "e4m3", "floor"),
            "gluon dim1 blocked": lambda: gluon_casts.cast_dim1(x, "e4m3", "rceil", True),
            "gluon fused plain": lambda: gluon_casts.cast_dim0_dim1(x, "e5m2", "floor"),
            "gluon 3d dim1 plain": lambda: gluon_casts.cast_dim1(x.unsqueeze(0), "e4m3", "floor"),
            "gluon groups": lambda: gluon_cast_groups.cast_groups_dim1(x, offs, "e4m3", "rceil"),
            "gluon fake quant": lambda: gluon_fake_quant.fake_quant_2d(x, "e4m3", "floor", True, True),
            "gluon groups along M": lambda: (gluon_fake_quant.fake_quant_groups_along_m(x, src, "e5m2", "rceil"),),
        })  # fmt: skip
    return calls


@pytest.mark.gpu
def test_gpu_cached_launches_write_what_the_jit_writes():
    torch.manual_seed(0)
    base = torch.randn(320 * 256 + 8, device="cuda", dtype=torch.bfloat16)
    # the same shape at a 16-byte aligned address, 2 bytes past one, and 16 bytes on: Triton specializes on the
    # alignment (16-byte loads or not), so the unaligned x must not take the aligned x's plan
    for offset in (0, 1, 8):
        x = base[offset : offset + 320 * 256].view(320, 256)
        for name, call in launches(x).items():
            with kernel_settings(launch_cache=False):
                want = call()
            for _ in range(2):  # a new key: the JIT and a new plan; then the plan
                got = call()
                for g, w in zip(got, want, strict=True):
                    assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), (name, offset)
