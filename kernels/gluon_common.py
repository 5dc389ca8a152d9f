"""What the Gluon kernels (``gluon_casts``, ``gluon_fake_quant``) share: the tile layout and its config.

A program's tile is [NUM_SUB, 32 rows, CHUNKS, 32 cols] (NUM_SUB 32-row sub-tiles, BLOCK_K = 32 *
CHUNKS columns) in

    size_per_thread [NUM_SUB, ROWS, 1, 8], threads_per_warp [1, 32 / ROWS, ROWS / 4, 4],
    warps_per_cta [1, 1, NUM_WARPS, 1]

A thread loads ROWS rows x 8 contiguous elements (16-byte loads for bf16); a block of 32 along K
is 8 values in a thread then 4 lanes (2 shuffle steps), a block of 32 along M is ROWS values in
a thread then 32 / ROWS lanes of one warp; warps split K, so no reduction touches shared memory.
Gluon kernels do not run in the Triton interpreter (3.6): they need a GPU, and
``compile_for_arch`` compiles them on the CPU for inspection and tests.
"""

from __future__ import annotations

import mx_recipe.formats  # noqa: F401  (first: importing mx_kernels.common before mx_recipe is circular)

# isort: split
import torch
import triton
import triton.experimental.gluon.language as gl
import triton.language as tl
from mx_kernels.common import interpreting
from triton.experimental import gluon


@gluon.constexpr_function
def tile_layout(num_sub, rows, num_warps):
    """[NUM_SUB, 32, CHUNKS, 32]: a thread holds ``rows`` rows x 8 contiguous columns; a warp's lanes
    cover the 32 rows of a block (32 / rows lanes) and rows / 4 chunks of 32 columns (4 lanes each)."""
    return gl.BlockedLayout([num_sub, rows, 1, 8], [1, 32 // rows, rows // 4, 4], [1, 1, num_warps, 1], [3, 2, 1, 0])


@gluon.constexpr_function
def _axis_layout(layout, rank, dim):
    """The 1D layout whose arange, expanded along every other dim, has ``layout``."""
    for d in reversed(range(rank)):
        if d != dim:
            layout = gl.SliceLayout(d, layout)
    return layout


@gluon.constexpr_function
def _other_dims(rank, dim):
    return tuple(d for d in range(rank) if d != dim)


@gluon.jit
def arange_along(n: gl.constexpr, dim: gl.constexpr, rank: gl.constexpr, layout: gl.constexpr):
    """arange(n) along ``dim`` of a rank-``rank`` tensor in ``layout``, size 1 along the other dims."""
    return gl.expand_dims(gl.arange(0, n, layout=_axis_layout(layout, rank, dim)), _other_dims(rank, dim))


@gluon.jit
def wide(offsets, OFFS64: gl.constexpr):
    """int64 offsets only where a tensor passes 2**31 elements: int32 address math is cheaper."""
    if OFFS64:  # one return: Triton 3.6 compiles both returns and rejects their two types
        offsets = offsets.to(gl.int64)
    return offsets


@gluon.jit
def max_nan(a, b):
    """max that keeps NaN: a block holding NaN must get the NaN scale."""
    return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


def check_tile_config(config: dict | None, defaults: dict, what: str) -> dict:
    """``defaults`` updated with ``config``, checked: ROWS 4, 8 or 16; NUM_WARPS, NUM_SUB and BLOCK_K
    powers of two, BLOCK_K >= 8 * ROWS * NUM_WARPS; the flags (LEAN, ...) bools. ``what`` names the kernel
    in errors."""
    cfg = {**defaults, **(config or {})}
    unknown = set(cfg) - set(defaults)
    if unknown:
        raise ValueError(f"unknown {what} config keys {sorted(unknown)}; expected {sorted(defaults)}")
    block_k, warps, sub, rows = cfg["BLOCK_K"], cfg["NUM_WARPS"], cfg["NUM_SUB"], cfg["ROWS"]
    for key, default in defaults.items():
        if isinstance(default, bool) and not isinstance(cfg[key], bool):
            raise ValueError(f"{what} config {cfg}: {key} must be a bool")

    def pow2(n: object) -> bool:
        return isinstance(n, int) and n > 0 and n & (n - 1) == 0

    if rows not in (4, 8, 16):  # 32: 256 values per thread, out of registers
        raise ValueError(f"{what} config {cfg}: ROWS (rows per thread) must be 4, 8 or 16")
    if not (pow2(warps) and pow2(sub) and pow2(block_k) and block_k >= 8 * rows * warps):
        raise ValueError(
            f"{what} config {cfg}: NUM_WARPS, NUM_SUB and BLOCK_K must be powers of two with "
            "BLOCK_K >= 8 * ROWS * NUM_WARPS (each warp covers 8 * ROWS columns)"
        )
    return cfg


def require_gpu(x: torch.Tensor, op: str) -> None:
    if interpreting():
        raise NotImplementedError(f"{op}: Gluon kernels do not run in the Triton interpreter (TRITON_INTERPRET=1)")
    if not x.is_cuda:
        raise RuntimeError(f"{op}: the Gluon kernels need a CUDA tensor, got {x.device}")


def compile_for_arch(kernel, kwargs: dict, arch: int):
    """Compile the Gluon ``kernel`` for CUDA ``arch`` without a GPU, its arguments (``kwargs``, by name,
    ``num_warps`` included) specialized as a launch would specialize them (16-divisible ints, stride
    1): the CompiledKernel, with ``.asm["ttgir"]``, ``["ptx"]`` and ``["cubin"]``."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        value = kwargs[p.name]
        ty, attr = (
            ("constexpr", None) if p.is_constexpr else native_specialize_impl(BaseBackend, value, False, True, True)
        )
        signature[p.name] = ty
        if ty == "constexpr":
            constexprs[p.name] = value
        elif attr:
            attrs[(i,)] = BaseBackend.parse_attr(attr)
    src = GluonASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=kwargs["num_warps"]))
