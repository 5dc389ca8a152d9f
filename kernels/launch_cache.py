"""Launch a JIT kernel (Triton or Gluon) straight through its compiled form when the same launch recurs.

Host time per call on the H200 machine (2.11.0+cu130, triton 3.6.0): a Gluon cast took about 95 us. Of that,
about 40 us was Triton's JIT launch: it binds and specializes some 35 arguments, builds the cache key (a
``str`` of the options), fills launch metadata and calls the empty launch hooks. The compiled kernel's own
launcher took 10 us. Training repeats the same launches every step, and an MoE block's fake-quant launches
cost more host time than GPU time (docs/RESULTS.md).

``LaunchCache.launch(grid, kwargs)`` keys a launch by everything Triton specializes on:
- the grid and the current device;
- every argument that is not a tensor, by value;
- every tensor argument, by dtype and by whether its address is 16-byte aligned.

A key seen before runs the CompiledKernel that Triton's first launch returned. Any other key goes through
the JIT launch, which compiles the kernel or finds it in Triton's own cache. The JIT launch is also taken
when launch hooks are set (profilers such as proton see every launch then), under the Triton interpreter,
and while ``set_enabled(False)`` is in force (mx_recipe's ``KernelSettings.launch_cache``).

Building the keyword arguments and their key still cost about 10 us a call on that host. A launcher that
knows a cheaper key, its own arguments (shapes, strides, formats), calls ``launch_keyed(key, build,
**tensors)`` instead: ``build()`` runs only the first time that key (with the tensors' alignments) is
seen, and later calls pass the tensors' addresses straight to the compiled kernel's launcher.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from triton import knobs
from triton.runtime import driver

_enabled = True


def set_enabled(enabled: bool) -> None:
    """Turn every LaunchCache on or off (off: each launch takes Triton's JIT path)."""
    global _enabled
    _enabled = enabled


def _hooks_set() -> bool:
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(getattr(hook, "calls", hook is not None) for hook in hooks)  # HookChain, or a function or None


def launch_key(grid: Sequence[int], kwargs: dict, device: int) -> tuple:
    """What decides a launch's compiled kernel and its non-tensor arguments (see the module docstring)."""
    parts = [device, *grid]
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            parts.append((name, value.dtype, value.data_ptr() % 16 == 0))
        else:
            parts.append((name, value))
    return tuple(parts)


class _Plan:
    """A compiled kernel and its arguments in the kernel's order, tensors to be filled in per call."""

    def __init__(self, compiled, grid: Sequence[int], params: list, kwargs: dict):
        self.run = compiled.run  # the launcher (a property: loads the module on first use)
        self.function, self.packed_metadata = compiled.function, compiled.packed_metadata
        self.grid = (*grid, 1, 1)[:3]
        self.args = [kwargs.get(p.name, p.default) for p in params]  # as the JIT binds them, defaults included
        self.slots = self.tensor_slots(params, kwargs)
        for i, _ in self.slots:  # hold no tensor of the first call: it would stay allocated as long as the plan
            self.args[i] = None

    @staticmethod
    def tensor_slots(params: list, kwargs: dict) -> list[tuple[int, str]]:
        """(position, name) of each tensor argument of a launch."""
        return [(i, p.name) for i, p in enumerate(params) if isinstance(kwargs.get(p.name), torch.Tensor)]

    def __call__(self, kwargs: dict, device: int) -> None:
        args = self.args.copy()
        for i, name in self.slots:
            args[i] = kwargs[name]
        g0, g1, g2 = self.grid
        stream = driver.active.get_current_stream(device)
        self.run(g0, g1, g2, stream, self.function, self.packed_metadata, None, None, None, *args)


class LaunchCache:
    """Launches of one JIT kernel, the last ``max_plans`` distinct keys kept (least recently used dropped)."""

    def __init__(self, kernel, max_plans: int = 256):
        self.kernel = kernel
        self.max_plans = max_plans
        self.plans: OrderedDict[tuple, _Plan] = OrderedDict()
        self.keyed: OrderedDict[tuple, _Plan] = OrderedDict()  # launch_keyed's keys

    def _bypass(self) -> bool:
        """Whether every launch takes Triton's JIT path (see the module docstring)."""
        return not _enabled or knobs.runtime.interpret or _hooks_set()

    def launch(self, grid: Sequence[int], kwargs: dict) -> None:
        """``kernel[grid](**kwargs)``, with every argument passed by name (num_warps and the like included)."""
        if self._bypass():
            self.kernel[grid](**kwargs)
            return
        device = driver.active.get_current_device()
        key = launch_key(grid, kwargs, device)
        try:
            plan = self.plans.get(key)
        except TypeError:  # an unhashable argument: not cached
            self.kernel[grid](**kwargs)
            return
        if plan is not None:
            self.plans.move_to_end(key)
            plan(kwargs, device)
            return
        compiled = self.kernel[grid](**kwargs)  # compiles, or finds the kernel in Triton's cache; launches
        self.plans[key] = _Plan(compiled, grid, self.kernel.params, kwargs)
        if len(self.plans) > self.max_plans:
            self.plans.popitem(last=False)

    def launch_keyed(self, key: tuple, build: Callable[[], tuple[Sequence[int], dict]], **tensors: torch.Tensor):
        """``launch(*build())`` where ``key`` (hashable) determines ``build()``'s grid and every argument except
        the addresses of ``tensors``, the launch's tensor arguments by parameter name (so their shapes, strides
        and dtypes belong in ``key``; a tensor may be passed as any view of the same address)."""
        if self._bypass():
            grid, kwargs = build()
            self.kernel[grid](**kwargs)
            return
        device = driver.active.get_current_device()
        ptrs = {name: t.data_ptr() for name, t in tensors.items()}
        full_key = (device, key, *[p % 16 == 0 for p in ptrs.values()])
        plan = self.keyed.get(full_key)
        if plan is None:
            grid, kwargs = build()
            if {name for _, name in _Plan.tensor_slots(self.kernel.params, kwargs)} != set(tensors):
                raise ValueError(f"launch_keyed: the tensors passed, {sorted(tensors)}, are not the launch's")
            self.launch(grid, kwargs)
            plan = self.plans.get(launch_key(grid, kwargs, device))
            if plan is not None:
                self.keyed[full_key] = plan
                if len(self.keyed) > self.max_plans:
                    self.keyed.popitem(last=False)
            return
        plan(ptrs, device)  # addresses as ints: Triton's launcher takes them as they are
