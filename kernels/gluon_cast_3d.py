"""Gluon dim1 MX cast of 3D expert weights [E, N, K]: ``cast_dim1``'s 3D contract, bit for bit.

On a Hopper GPU ``mx_kernels.cast_dim1.cast_dim1`` runs this for 3D bf16 input unless the caller passes
a Triton config (``mx_kernels.common.use_gluon``; ``MX_RECIPE_GLUON=0`` turns it off).

``gluon_cast_3d_dim1(x, elem, mode, blocked_scales, config)`` returns qdata [E, K, N] fp8 (each expert's
[K, N] slice written column-major, directly: no transpose copy, seed 003) and scales e8m0 [E, K, N/32],
or with ``blocked_scales`` [E, blocked_numel(K, N/32)] (each expert blocked on its own).

The kernel is the dim1 half of ``gluon_casts._gluon_cast_kernel`` plus a batch grid axis (axis 2 = expert,
as in the Triton kernel): the expert's input, qdata and scale bases are int64 scalars (``pid_b * stride``),
the in-slice offsets stay int32 unless one slice passes 2**31 elements (``OFFS64``). The tile work (load,
quantize along M, transposed qdata store) is ``gluon_common.dim1_tile``. Plain scales, by default, are
written blocked and unblocked after for all experts in one pass (``PLAIN_VIA_BLOCKED``, as in 2D,
``unblock_scales``). Gluon kernels do not run in the Triton interpreter (3.6): this needs a GPU, and
``compile_for_target`` compiles it for inspection without one (tests/test_gluon_3d_groups.py).
"""

from __future__ import annotations

import mx_recipe.formats  # noqa: F401  (first: importing mx_kernels.common before mx_recipe is circular)

# isort: split
import torch
import triton.experimental.gluon.language as gl
from mx_kernels.common import check_cast, dim1_shapes, fp8_dtype, tile_grid
from mx_kernels.gluon_casts import GLUON_CONFIG
from mx_kernels.gluon_common import (
    arange_along,
    check_tile_config,
    compile_for_arch,
    dim1_scale_layout,
    dim1_tile,
    require_gpu,
    store_scales,
    tile_launch_args,
)
from mx_kernels.unblock_scales import unblock_scales
from triton.experimental import gluon

from mx_recipe.scale_layout import blocked_shape

# The 2D dim1 cast's tile keys: the base a partial config is completed from, and the default (ROWS 8, BLOCK_K 256,
# 4 warps, 2 sub-tiles, LEAN, plain scales via blocked, SCATTER: the 2D dim1 default before LINES).
# H200, x [E, 8192, 5120] bf16, e4m3 floor, % of copy bandwidth (docs/profiles/2026-11-21_h200_gluon_3d_groups.txt):
# blocked scales 74/91/97/99% for E = 1/4/16/64 (the Triton kernel 70/85/90/90%); plain scales at E = 16 92%
# (Triton 77%). ROWS 16, BLOCK_K 512, NUM_SUB 1 was within 1% of it at E >= 4 (3% faster at E = 1).
_TILE_KEYS = ("BLOCK_K", "NUM_WARPS", "NUM_SUB", "ROWS", "LEAN", "PLAIN_VIA_BLOCKED", "SCATTER")
GLUON_3D_BASE_CONFIG = {key: GLUON_CONFIG[key] for key in _TILE_KEYS}
GLUON_3D_CONFIG = dict(BLOCK_K=256, NUM_WARPS=4, NUM_SUB=2, ROWS=8, LEAN=True, PLAIN_VIA_BLOCKED=True, SCATTER=True)


@gluon.jit
def _gluon_cast_3d_dim1_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,  # N: the quantized dim
    K,
    stride_xb,
    stride_xm,
    stride_xk,
    stride_qb,  # M * K
    stride_sb,  # one expert's scale bytes (plain K * M / 32, or blocked_numel(K, M / 32))
    S_COLS,  # M // 32, an argument so that it is specialized like M and K
    NUM_SUB: gl.constexpr,
    ROWS: gl.constexpr,
    NUM_WARPS: gl.constexpr,
    REPS: gl.constexpr,
    BLOCKED: gl.constexpr,
    EVEN: gl.constexpr,  # the grid tiles each [M, K] slice exactly: no bounds masks
    OFFS64: gl.constexpr,  # one slice's offsets pass 2**31: int64 tensor offsets
    LEAN: gl.constexpr,
    SCATTER: gl.constexpr,
    EMAX: gl.constexpr,
    MAX_MANT: gl.constexpr,
    MAX_NORMAL: gl.constexpr,
    MBITS: gl.constexpr,
    EMIN: gl.constexpr,
    IS_E4M3: gl.constexpr,
    RCEIL: gl.constexpr,
):
    CHUNKS: gl.constexpr = ROWS // 4 * NUM_WARPS * REPS
    pid_m = gl.program_id(0)
    pid_k = gl.program_id(1)
    pid_b = gl.program_id(2).to(gl.int64)  # E * M * K can pass 2**31: the slice bases are int64 scalars
    m0 = pid_m * NUM_SUB  # first 32-row block of this program
    s = dim1_tile(
        x_ptr + pid_b * stride_xb, q_ptr + pid_b * stride_qb, M, K, stride_xm, stride_xk, m0 * 32, M, pid_k,
        NUM_SUB, ROWS, NUM_WARPS, REPS, not EVEN, not EVEN, OFFS64, LEAN, SCATTER, EMAX, MAX_MANT, MAX_NORMAL,
        MBITS, EMIN, IS_E4M3, RCEIL,
    )  # fmt: skip
    # scales [K, M/32] of this expert: this program's NUM_SUB scale columns of each k are contiguous
    S1L: gl.constexpr = dim1_scale_layout(NUM_SUB, ROWS, NUM_WARPS, REPS, SCATTER)
    s_rows = (pid_k * CHUNKS + arange_along(CHUNKS, 1, 3, S1L)) * 32 + arange_along(32, 2, 3, S1L)
    s_cols = m0 + arange_along(NUM_SUB, 0, 3, S1L)
    store_scales(s_ptr + pid_b * stride_sb, s, s_rows, s_cols, K, S_COLS, BLOCKED, EVEN)


def check_config(config: dict | None) -> dict:
    """GLUON_3D_CONFIG for None, else GLUON_3D_BASE_CONFIG updated with ``config``, checked."""
    return check_tile_config(GLUON_3D_CONFIG if config is None else config, GLUON_3D_BASE_CONFIG, "Gluon 3D cast")


def kernel_launch(
    x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, elem: str, mode: str, blocked: bool, config: dict | None
) -> tuple[tuple[int, int, int], dict]:
    """(grid, keyword arguments) of one launch on x [E, M, K] into q (uint8 [E, K, M]) and s (uint8
    [E, ...]); also used to compile ahead of time (``compile_for_target``)."""
    cfg = check_config(config)
    num_batch, m, k = x.shape
    block_m, block_k = 32 * cfg["NUM_SUB"], cfg["BLOCK_K"]
    pad = 128 if blocked else 1  # blocked: the grid covers the padding too, to zero it
    grid = (*tile_grid(m, k, block_m, block_k, pad), num_batch)
    m_cover, k_cover = grid[0] * block_m, grid[1] * block_k  # rows and columns the grid's tiles span
    span = max((m_cover - 1) * abs(x.stride(1)) + (k_cover - 1) * abs(x.stride(2)), m_cover * k_cover)
    s_rows, s_cols = blocked_shape(k, m // 32) if blocked else (k, m // 32)
    kwargs = dict(
        x_ptr=x,
        q_ptr=q,
        s_ptr=s,
        M=m,
        K=k,
        stride_xb=x.stride(0),
        stride_xm=x.stride(1),
        stride_xk=x.stride(2),
        stride_qb=m * k,
        stride_sb=s_rows * s_cols,
        S_COLS=m // 32,
        BLOCKED=blocked,
        EVEN=(m_cover, k_cover) == (m, k),
        OFFS64=span >= 2**31,
        **tile_launch_args(cfg, elem, mode),
    )
    return grid, kwargs


def gluon_cast_3d_dim1(
    x: torch.Tensor, elem: str, mode: str, blocked_scales: bool = False, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [E, N, K] (bf16/fp32, N % 32 == 0, any strides) -> (qdata [E, K, N] fp8, scales e8m0 [E, K, N/32]
    or blocked per expert [E, blocked_numel(K, N/32)]): the outputs of ``mx_kernels.cast_dim1.cast_dim1``
    on a 3D x, bit for bit. ``config``: a Gluon tile config (keys of GLUON_3D_BASE_CONFIG)."""
    check_cast(x, elem, mode, ndims=(3,), qdim=1, op="gluon_cast_3d_dim1")
    cfg = check_config(config)
    require_gpu(x, "gluon_cast_3d_dim1")
    via_blocked = cfg["PLAIN_VIA_BLOCKED"] and not blocked_scales and x.numel() > 0
    blocked = blocked_scales or via_blocked
    q_shape, s_shape = dim1_shapes(x.shape, blocked)
    qdata = torch.empty(q_shape, dtype=fp8_dtype(elem), device=x.device)
    scale = torch.empty(s_shape, dtype=torch.float8_e8m0fnu, device=x.device)
    if x.numel():
        grid, kwargs = kernel_launch(x, qdata.view(torch.uint8), scale.view(torch.uint8), elem, mode, blocked, cfg)
        _gluon_cast_3d_dim1_kernel[grid](**kwargs)
    if via_blocked:  # [E, n] blocked -> [E, K, N/32], all experts in one launch
        scale = unblock_scales(scale, x.shape[2], x.shape[1] // 32)
    return qdata, scale


def compile_for_target(
    shape: tuple[int, int, int], dtype: torch.dtype = torch.bfloat16, elem: str = "e4m3", mode: str = "floor",
    blocked: bool = True, config: dict | None = None, arch: int = 90,
):  # fmt: skip
    """Compile the kernel for CUDA ``arch`` without a GPU (inspection and CPU tests): the CompiledKernel,
    with ``.asm["ptx"]`` and ``["cubin"]``. Arguments are specialized as a launch on a contiguous x of
    ``shape`` would specialize them. ``blocked``: the kernel's BLOCKED flag (the plain default, via
    the blocked layout, compiles the blocked kernel)."""
    x = torch.empty(shape, dtype=dtype, device="meta")
    u8 = torch.empty(16, dtype=torch.uint8, device="meta")  # stands in for both outputs (dtype and alignment)
    _, kwargs = kernel_launch(x, u8, u8, elem, mode, blocked, config)
    return compile_for_arch(_gluon_cast_3d_dim1_kernel, kwargs, arch)
