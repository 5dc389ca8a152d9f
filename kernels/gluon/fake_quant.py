"""MX fake-quant along K and/or along M in one read of x, in Gluon: ``fake_quant_2d``'s contract, bit for bit.

The Hopper implementation of ``fake_quant_2d`` and ``fake_quant_groups_along_m`` (mx_recipe.ops.dispatch picks it
for bf16 input on compute capability 9.x), with the layout chosen by hand: ``gluon_common.tile_layout``, so a
thread holds 8 rows x 8 contiguous bf16 (16-byte loads), a block of 32 along K is 8 registers x 4 lanes and a
block of 32 along M is 8 registers x 4 lanes of one warp. Warps split K, so neither reduction touches shared
memory, and both results are written in x's own layout from the same registers (16-byte stores): no
transpose, no ``convert_layout``, no ``bar.sync`` (the Triton kernel reduces through shared memory).

32 x 128 tiles, 2 warps: on an H200 (e4m3 floor) the fastest of a 9-config sweep, or within 2% of it, in
every case measured: x 16384 x 4096 both results 111.9 us (Triton kernel 117.3), along M 75.9 (81.2);
w [64, 8192, 5120] both 4203 (4356); 64 gathered token groups along M 146.0 (159.1).
"""

from __future__ import annotations

import torch
import triton.experimental.gluon.language as gl
from mx_kernels.common import fake_quant_2d_outputs, fake_quant_groups_outputs
from mx_kernels.gluon.common import arange_along, compile_for_arch, max_nan, require_gpu, tile_layout, wide
from mx_kernels.launch_cache import LaunchCache
from mx_kernels.quantize import scale_exponent
from mx_kernels.spec import cdiv
from triton.experimental import gluon

TILE = dict(NUM_SUB=1, ROWS=8, NUM_WARPS=2, REPS=1)  # 32 x 128
BLOCK_M, BLOCK_K = 32, 128


@gluon.jit
def _fake_quant(blocks, AXIS: gl.constexpr, ELEM: gl.constexpr, RCEIL: gl.constexpr):
    """fp32 blocks of 32 along AXIS -> their MX quantize-dequantize in bf16, same shape and layout. The same fp32
    multiplies as ``mx_quantize.fake_quant_blocks`` (v * 2**-e, element * 2**e), so the same bits (every bf16
    value, both formats and rules, NaN payloads included, on an H200), in fewer instructions:
    - no clamp to +-max_normal before cvt.rn.satfinite, which saturates the same way;
    - no 0x7F select on the fp8 bytes of a NaN block: its dequantize factor is NaN, so every result is NaN
      anyway, with the same bits as the Triton kernel's (the GPU's canonical NaN)."""
    amax = gl.reduce(gl.abs(blocks), AXIS, max_nan)
    amax_bits = amax.to(gl.int32, bitcast=True) & 0x7FFFFFFF
    e = scale_exponent(amax_bits, ELEM, RCEIL)
    inv_scale = gl.where(e < 127, (127 - e) << 23, 0x400000).to(gl.float32, bitcast=True)  # 2**-e
    factor = gl.where(e > -127, (e + 127) << 23, 0x400000).to(gl.float32, bitcast=True)  # 2**e
    factor = gl.where(amax_bits > 0x7F800000, float("nan"), factor)
    v = blocks * gl.expand_dims(inv_scale, AXIS)
    if ELEM == "e4m3":
        element = v.to(gl.float8e4nv).to(gl.float32)  # cvt.rn.satfinite.e4m3x2.f32, then back via f16x2
    else:
        element = v.to(gl.float8e5).to(gl.float32)
    return (element * gl.expand_dims(factor, AXIS)).to(gl.bfloat16)


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
    ELEM: gl.constexpr,
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
        v = _fake_quant(x, 3, ELEM, RCEIL)
        k_ptrs = k_ptr + pid_b * M * K + x_rows * K + cols
        if EVEN:
            gl.store(k_ptrs, v)
        else:
            gl.store(k_ptrs, v, mask=in_x)
    if ALONG_M:  # blocks of 32 along M (axis 1): ROWS registers x 32 / ROWS lanes, one warp
        v = _fake_quant(x, 1, ELEM, RCEIL)
        if GATHER:  # each row back to its own row of x's shape; padding rows are dropped
            gl.store(m_ptr + x_rows * K + cols, v, mask=in_x)
        else:  # rows in [M, M_PAD) are the zero padding's result (0; NaN in a NaN block), as in Triton's
            m_ptrs = m_ptr + pid_b * M_PAD * K + x_rows * K + cols
            if EVEN:
                gl.store(m_ptrs, v)
            else:
                gl.store(m_ptrs, v, mask=(rows < M_PAD) & (cols < K))


_LAUNCHES = LaunchCache(_gluon_fake_quant_kernel)


def kernel_launch(
    x: torch.Tensor, row_src: torch.Tensor | None, out_k: torch.Tensor, out_m: torch.Tensor, elem: str, mode: str,
    along_k: bool, along_m: bool, m: int, m_pad: int,
) -> tuple[tuple[int, int, int], dict]:  # fmt: skip
    """(grid, keyword arguments) of one launch; ``m``: the rows the grid walks (x's, or row_src's),
    ``m_pad``: the along-M result's rows. Also used to compile ahead of time (``compile_for_target``)."""
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    num_batch, x_m, k = x3.shape
    block_m, block_k = BLOCK_M, BLOCK_K
    walk = m_pad if along_m and row_src is None else m
    grid = (cdiv(walk, block_m), cdiv(k, block_k), num_batch)
    m_cover, k_cover = grid[0] * block_m, grid[1] * block_k
    # largest in-slice offset a (masked or not) lane forms, for x and for the outputs
    x_rows = x_m if row_src is not None else m_cover
    span = max((x_rows - 1) * abs(x3.stride(1)) + (k_cover - 1) * abs(x3.stride(2)), max(m_cover, x_m) * k_cover)
    kwargs = dict(
        x_ptr=x3, src_ptr=x3 if row_src is None else row_src, k_ptr=out_k, m_ptr=out_m, M=m, M_PAD=m_pad, K=k,
        stride_xb=x3.stride(0), stride_xm=x3.stride(1), stride_xk=x3.stride(2), ALONG_K=along_k, ALONG_M=along_m,
        GATHER=row_src is not None, EVEN=row_src is None and (m_cover, k_cover) == (m, k) and m == m_pad,
        OFFS64=span >= 2**31, **TILE, ELEM=elem, RCEIL=mode == "rceil", num_warps=TILE["NUM_WARPS"],
    )  # fmt: skip
    return grid, kwargs


def _launch(
    x: torch.Tensor, row_src: torch.Tensor | None, out_k: torch.Tensor, out_m: torch.Tensor, elem: str, mode: str,
    along_k: bool, along_m: bool, m: int, m_pad: int,
) -> None:  # fmt: skip
    require_gpu(x, "gluon fake_quant_2d")
    if x.dtype != torch.bfloat16:
        raise NotImplementedError(f"gluon fake_quant_2d: the Gluon kernel takes bf16 input, got {x.dtype}")
    key = (x.shape, x.stride(), row_src is None, elem, mode, along_k, along_m, m, m_pad)
    _LAUNCHES.launch_keyed(
        key, lambda: kernel_launch(x, row_src, out_k, out_m, elem, mode, along_k, along_m, m, m_pad),
        x_ptr=x, src_ptr=x if row_src is None else row_src, k_ptr=out_k, m_ptr=out_m,
    )  # fmt: skip


def fake_quant_2d(
    x: torch.Tensor, elem: str, mode: str, along_k: bool, along_m: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] or [E, M, K] bf16 (any strides) -> (along K [.., M, K], along M [.., ceil32(M), K]): the outputs
    of ``mx_kernels.mx.fake_quant_2d.fake_quant_2d`` bit for bit (an output not asked for is an empty tensor)."""
    return fake_quant_2d_outputs(x, elem, mode, along_k, along_m, _launch, "gluon fake_quant_2d")


def fake_quant_groups_along_m(x: torch.Tensor, row_src: torch.Tensor, elem: str, mode: str) -> torch.Tensor:
    """x [M, K] bf16, row_src int32 [R] -> [M, K]: ``mx_kernels.mx.fake_quant_2d.fake_quant_groups_along_m`` bit for bit
    (row_src is not checked on the GPU: a row of x it does not list is left unwritten)."""
    return fake_quant_groups_outputs(x, row_src, elem, mode, _launch, "gluon fake_quant_groups_along_m")


def fake_quant_groups(
    x: torch.Tensor, row_src: torch.Tensor, elem: str, mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bf16, row_src int32 [R] -> (along K, groups along M): ``mx_kernels.mx.fake_quant_2d.fake_quant_groups``
    bit for bit, from one read of x."""
    return fake_quant_groups_outputs(x, row_src, elem, mode, _launch, "gluon fake_quant_groups", along_k=True)


def compile_for_target(
    shape: tuple[int, ...], elem: str = "e4m3", mode: str = "floor", along_k: bool = True, along_m: bool = True,
    gather_rows: int | None = None, arch: int = 90,
):  # fmt: skip
    """Compile for CUDA ``arch`` without a GPU: the CompiledKernel (``.asm["ptx"]``, ``["cubin"]``).
    Arguments are specialized as a launch on a contiguous bf16 x of ``shape`` would specialize them;
    ``gather_rows``: the groups-along-M launch with a row_src of that length."""
    x = torch.empty(shape, dtype=torch.bfloat16)
    out = torch.empty(16, dtype=torch.bfloat16)  # stands in for both outputs (only dtype and alignment matter)
    if gather_rows is None:
        m_pad = -(-shape[-2] // 32) * 32 if along_m else shape[-2]
        _, kwargs = kernel_launch(x, None, out, out, elem, mode, along_k, along_m, shape[-2], m_pad)
    else:
        src = torch.empty(gather_rows, dtype=torch.int32)
        _, kwargs = kernel_launch(x, src, out, out, elem, mode, False, True, gather_rows, gather_rows)
    return compile_for_arch(_gluon_fake_quant_kernel, kwargs, arch)
