"""MX fake-quant along K and/or along M in one read of x, in Gluon: ``fake_quant_2d``'s contract, bit for bit.

The outputs of ``mx_kernels.fake_quant_2d.fake_quant_2d`` / ``fake_quant_groups_along_m`` (bf16 x,
2D or 3D, ragged M, any strides), with the layout chosen by hand: ``gluon_common.tile_layout``, so a
thread holds ROWS rows x 8 contiguous bf16 (16-byte loads), a block of 32 along K is 8 registers x
4 lanes (2 shuffle steps) and a block of 32 along M is ROWS registers x 32 / ROWS lanes of one warp.
Warps split K, so neither reduction touches shared memory, and both results are written in x's own
layout from the same registers (16-byte stores): no transpose, no ``convert_layout``, no
``bar.sync`` (the Triton kernel reduces through shared memory).

Numerics: ``mx_quantize.fake_quant_blocks`` itself (the @triton.jit helpers lower in the caller's
layout), on the 4D tile with AXIS 3 (along K) or AXIS 1 (along M), no reshape; or, with LEAN, the
same fp32 multiplies in fewer instructions (``_fake_quant_lean``). Both quantize with
``cvt.rn.satfinite`` and dequantize with the hardware cvt (e4m3x2/e5m2x2 -> f16x2).

``mx_kernels.fake_quant_2d`` dispatches here on Hopper (``mx_kernels.common.use_gluon`` decides).
"""

from __future__ import annotations

import mx_recipe.formats  # noqa: F401  (first: importing mx_kernels.common before mx_recipe is circular)

# isort: split
import torch
import triton.experimental.gluon.language as gl
from mx_kernels.common import cdiv, check_cast, fake_quant_2d_shapes, groups_along_m_rows
from mx_kernels.gluon_common import (
    arange_along,
    check_tile_config,
    compile_for_arch,
    max_nan,
    require_gpu,
    tile_launch_args,
    tile_layout,
    wide,
)
from mx_kernels.launch_cache import LaunchCache
from mx_kernels.mx_quantize import fake_quant_blocks, scale_exponent
from triton.experimental import gluon

# 32 x 128 tiles, 8 rows a thread, 2 warps, LEAN: on an H200 (e4m3 floor) the fastest of a 9-config sweep,
# or within 2% of it, in every case of scripts/bench_gluon_fake_quant.py: x 16384 x 4096 both results
# 111.9 us (Triton kernel 117.3), along M 75.9 (81.2); w [64, 8192, 5120] both 4203 (4356); 64 gathered
# token groups along M 146.0 (159.1).
GLUON_FAKE_QUANT_CONFIG = dict(ROWS=8, BLOCK_K=128, NUM_WARPS=2, NUM_SUB=1, LEAN=True)


@gluon.jit
def _fake_quant_lean(
    blocks, AXIS: gl.constexpr, EMAX: gl.constexpr, MAX_MANT: gl.constexpr, IS_E4M3: gl.constexpr,
    RCEIL: gl.constexpr,
):  # fmt: skip
    """fake_quant_blocks in fewer instructions per element (hardware cvt path only), shown bit-identical
    to it on an H200 (every bf16 value, both formats and rules, NaN payloads included):
    - no clamp to +-max_normal before cvt.rn.satfinite, which saturates the same way (as
      gluon_common.quantize_blocks_lean);
    - no 0x7F select on the fp8 bytes of a NaN block: its dequantize factor is NaN, so every
      result is NaN anyway, with the same bits as the Triton kernel's (the GPU's canonical NaN).
    Same fp32 multiplies as fake_quant_blocks (v * 2**-e, element * 2**e), so the same bits."""
    amax = gl.reduce(gl.abs(blocks), AXIS, max_nan)
    amax_bits = amax.to(gl.int32, bitcast=True) & 0x7FFFFFFF
    e = scale_exponent(amax_bits, EMAX, MAX_MANT, RCEIL)
    inv_scale = gl.where(e < 127, (127 - e) << 23, 0x400000).to(gl.float32, bitcast=True)  # 2**-e
    factor = gl.where(e > -127, (e + 127) << 23, 0x400000).to(gl.float32, bitcast=True)  # 2**e
    factor = gl.where(amax_bits > 0x7F800000, float("nan"), factor)
    v = blocks * gl.expand_dims(inv_scale, AXIS)
    if IS_E4M3:
        element = v.to(gl.float8e4nv).to(gl.float32)  # cvt.rn.satfinite.e4m3x2.f32, then back via f16x2
    else:
        element = v.to(gl.float8e5).to(gl.float32)
    return element * gl.expand_dims(factor, AXIS)


@gluon.jit
def _fake_quant(
    blocks, AXIS: gl.constexpr, EMAX: gl.constexpr, MAX_MANT: gl.constexpr, MAX_NORMAL: gl.constexpr,
    MBITS: gl.constexpr, EMIN: gl.constexpr, IS_E4M3: gl.constexpr, RCEIL: gl.constexpr, LEAN: gl.constexpr,
):  # fmt: skip
    """fp32 blocks of 32 along AXIS -> their MX quantize-dequantize in bf16, same shape and layout."""
    if LEAN:
        v = _fake_quant_lean(blocks, AXIS, EMAX, MAX_MANT, IS_E4M3, RCEIL)
    else:
        v = fake_quant_blocks(blocks, AXIS, EMAX, MAX_MANT, MAX_NORMAL, MBITS, EMIN, IS_E4M3, RCEIL, False, False)
    return v.to(gl.bfloat16)


@gluon.jit
def _gluon_fake_quant_kernel(
    x_ptr,
    src_ptr,  # int32 row_src (GATHER), else unused
    k_ptr,  # bf16 [.., M, K] along-K result
    m_ptr,  # bf16 [.., M_PAD, K] along-M result (GATHER: [M_x, K], rows back to their own place)
    M,  # rows the grid walks: x's, or row_src's length (GATHER)
    M_PAD,  # rows of the along-M result (ceil32(M)); unused under GATHER
    K,
    stride_xb,
    stride_xm,
    stride_xk,
    NUM_SUB: gl.constexpr,
    ROWS: gl.constexpr,
    NUM_WARPS: gl.constexpr,
    REPS: gl.constexpr,  # layout repeats along K: BLOCK_K = 8 * ROWS * NUM_WARPS * REPS
    ALONG_K: gl.constexpr,
    ALONG_M: gl.constexpr,
    GATHER: gl.constexpr,
    EVEN: gl.constexpr,  # the grid tiles x exactly and M == M_PAD: no masks
    OFFS64: gl.constexpr,  # a slice's offsets pass 2**31: int64 tensor offsets
    LEAN: gl.constexpr,
    EMAX: gl.constexpr,
    MAX_MANT: gl.constexpr,
    MAX_NORMAL: gl.constexpr,
    MBITS: gl.constexpr,
    EMIN: gl.constexpr,
    IS_E4M3: gl.constexpr,
    RCEIL: gl.constexpr,
):
    CHUNKS: gl.constexpr = ROWS // 4 * NUM_WARPS * REPS
    L: gl.constexpr = tile_layout(NUM_SUB, ROWS, NUM_WARPS)
    pid_m = gl.program_id(0)
    pid_k = gl.program_id(1)
    pid_b = gl.program_id(2).to(gl.int64)  # E * M * K can pass 2**31: the slice base is int64 (scalar)
    rows = (pid_m * NUM_SUB + arange_along(NUM_SUB, 0, 4, L)) * 32 + arange_along(32, 1, 4, L)  # [NUM_SUB, 32, 1, 1]
    cols = (pid_k * CHUNKS + arange_along(CHUNKS, 2, 4, L)) * 32 + arange_along(32, 3, 4, L)  # [1, 1, CHUNKS, 32]
    if GATHER:  # tile row i is x's row src[i]; -1: a zero (padding) row
        # loaded as [NUM_SUB, 32] (ROWS loads a thread), then broadcast: in L's [NUM_SUB, 32, 1, 1] a
        # thread would load its ROWS sources once per register along K (8x the loads)
        R: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, L))
        src_rows = (pid_m * NUM_SUB + arange_along(NUM_SUB, 0, 2, R)) * 32 + arange_along(32, 1, 2, R)
        x_rows = gl.expand_dims(gl.load(src_ptr + src_rows, mask=src_rows < M, other=-1), (2, 3))
        in_x = (x_rows >= 0) & (cols < K)
    else:
        x_rows = rows
        in_x = (rows < M) & (cols < K)
    x_rows = wide(x_rows, OFFS64)
    x_ptrs = x_ptr + pid_b * stride_xb + x_rows * stride_xm + cols * stride_xk
    if EVEN:
        x = gl.load(x_ptrs).to(gl.float32)
    else:
        x = gl.load(x_ptrs, mask=in_x, other=0.0).to(gl.float32)

    if ALONG_K:  # blocks of 32 along K (axis 3): 8 registers x 4 lanes
        v = _fake_quant(x, 3, EMAX, MAX_MANT, MAX_NORMAL, MBITS, EMIN, IS_E4M3, RCEIL, LEAN)
        k_ptrs = k_ptr + pid_b * M * K + x_rows * K + cols
        if EVEN:
            gl.store(k_ptrs, v)
        else:
            gl.store(k_ptrs, v, mask=in_x)
    if ALONG_M:  # blocks of 32 along M (axis 1): ROWS registers x 32 / ROWS lanes, one warp
        v = _fake_quant(x, 1, EMAX, MAX_MANT, MAX_NORMAL, MBITS, EMIN, IS_E4M3, RCEIL, LEAN)
        if GATHER:  # each row back to its own row of x's shape; padding rows are dropped
            gl.store(m_ptr + x_rows * K + cols, v, mask=in_x)
        else:  # rows in [M, M_PAD) are the zero padding's result (0; NaN in a NaN block), as in Triton's
            m_ptrs = m_ptr + pid_b * M_PAD * K + x_rows * K + cols
            if EVEN:
                gl.store(m_ptrs, v)
            else:
                gl.store(m_ptrs, v, mask=(rows < M_PAD) & (cols < K))


_LAUNCHES = LaunchCache(_gluon_fake_quant_kernel)


def check_config(config: dict | None) -> dict:
    """GLUON_FAKE_QUANT_CONFIG updated with ``config``, checked."""
    return check_tile_config(config, GLUON_FAKE_QUANT_CONFIG, "Gluon fake-quant")


def kernel_launch(
    x: torch.Tensor, row_src: torch.Tensor | None, out_k: torch.Tensor, out_m: torch.Tensor, elem: str, mode: str,
    along_k: bool, along_m: bool, m: int, m_pad: int, config: dict | None,
) -> tuple[tuple[int, int, int], dict]:  # fmt: skip
    """(grid, keyword arguments) of one launch; ``m``: the rows the grid walks (x's, or row_src's),
    ``m_pad``: the along-M result's rows. Also used to compile ahead of time (``compile_for_target``)."""
    cfg = check_config(config)
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    num_batch, x_m, k = x3.shape
    block_m, block_k = 32 * cfg["NUM_SUB"], cfg["BLOCK_K"]
    walk = m_pad if along_m and row_src is None else m
    grid = (cdiv(walk, block_m), cdiv(k, block_k), num_batch)
    m_cover, k_cover = grid[0] * block_m, grid[1] * block_k
    # largest in-slice offset a (masked or not) lane forms, for x and for the outputs
    x_rows = x_m if row_src is not None else m_cover
    span = max((x_rows - 1) * abs(x3.stride(1)) + (k_cover - 1) * abs(x3.stride(2)), max(m_cover, x_m) * k_cover)
    kwargs = dict(
        x_ptr=x3,
        src_ptr=x3 if row_src is None else row_src,
        k_ptr=out_k,
        m_ptr=out_m,
        M=m,
        M_PAD=m_pad,
        K=k,
        stride_xb=x3.stride(0),
        stride_xm=x3.stride(1),
        stride_xk=x3.stride(2),
        ALONG_K=along_k,
        ALONG_M=along_m,
        GATHER=row_src is not None,
        EVEN=row_src is None and (m_cover, k_cover) == (m, k) and m == m_pad,
        OFFS64=span >= 2**31,
        **tile_launch_args(cfg, elem, mode),
    )
    return grid, kwargs


def launch(
    x: torch.Tensor, row_src: torch.Tensor | None, out_k: torch.Tensor, out_m: torch.Tensor, elem: str, mode: str,
    along_k: bool, along_m: bool, m: int, m_pad: int, config: dict | None = None,
) -> None:  # fmt: skip
    """One launch into outputs the caller checked and allocated (``fake_quant_2d._launch``'s arguments)."""
    grid, kwargs = kernel_launch(x, row_src, out_k, out_m, elem, mode, along_k, along_m, m, m_pad, config)
    _LAUNCHES.launch(grid, kwargs)


def _require_bf16_gpu(x: torch.Tensor, op: str) -> None:
    require_gpu(x, op)
    if x.dtype != torch.bfloat16:
        raise NotImplementedError(f"{op}: the Gluon kernel takes bf16 input, got {x.dtype}")


def gluon_fake_quant_2d(
    x: torch.Tensor, elem: str, mode: str, along_k: bool, along_m: bool, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] or [E, M, K] bf16 (any strides) -> (along K [.., M, K], along M [.., ceil32(M), K]),
    the outputs of ``mx_kernels.fake_quant_2d.fake_quant_2d`` bit for bit (an output not asked for
    is an empty tensor)."""
    if not (along_k or along_m):
        raise ValueError("gluon_fake_quant_2d: ask for along_k, along_m or both")
    check_cast(x, elem, mode, ndims=(2, 3), qdim=-1 if along_k else None, op="gluon_fake_quant_2d")
    cfg = check_config(config)
    _require_bf16_gpu(x, "gluon_fake_quant_2d")
    k_shape, m_shape = fake_quant_2d_shapes(x.shape, along_k, along_m)
    out_k, out_m = x.new_empty(k_shape), x.new_empty(m_shape)
    if x.numel():
        m_pad = m_shape[-2] if along_m else x.shape[-2]
        launch(x, None, out_k, out_m, elem, mode, along_k, along_m, x.shape[-2], m_pad, cfg)
    return out_k, out_m


def gluon_fake_quant_groups_along_m(
    x: torch.Tensor, row_src: torch.Tensor, elem: str, mode: str, config: dict | None = None
) -> torch.Tensor:
    """x [M, K] bf16, row_src int32 [R] -> [M, K]: ``fake_quant_2d.fake_quant_groups_along_m`` bit for bit
    (row_src is not checked on the GPU: a row of x it does not list is left unwritten)."""
    check_cast(x, elem, mode, ndims=(2,), qdim=None, op="gluon_fake_quant_groups_along_m")
    cfg = check_config(config)
    rows = groups_along_m_rows(row_src)
    _require_bf16_gpu(x, "gluon_fake_quant_groups_along_m")
    out = x.new_empty(x.shape[0], x.shape[1])
    if out.numel():
        launch(x, row_src, out, out, elem, mode, False, True, rows, rows, cfg)
    return out


def compile_for_target(
    shape: tuple[int, ...], elem: str = "e4m3", mode: str = "floor", along_k: bool = True, along_m: bool = True,
    config: dict | None = None, gather_rows: int | None = None, arch: int = 90,
):  # fmt: skip
    """Compile for CUDA ``arch`` without a GPU: the CompiledKernel (``.asm["ptx"]``, ``["cubin"]``).
    Arguments are specialized as a launch on a contiguous bf16 x of ``shape`` would specialize them;
    ``gather_rows``: the groups-along-M launch with a row_src of that length."""
    x = torch.empty(shape, dtype=torch.bfloat16)
    out = torch.empty(16, dtype=torch.bfloat16)  # stands in for both outputs (only dtype and alignment matter)
    if gather_rows is None:
        m_pad = -(-shape[-2] // 32) * 32 if along_m else shape[-2]
        _, kwargs = kernel_launch(x, None, out, out, elem, mode, along_k, along_m, shape[-2], m_pad, config)
    else:
        src = torch.empty(gather_rows, dtype=torch.int32)
        _, kwargs = kernel_launch(x, src, out, out, elem, mode, False, True, gather_rows, gather_rows, config)
    return compile_for_arch(_gluon_fake_quant_kernel, kwargs, arch)
