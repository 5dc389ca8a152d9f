"""What the Gluon kernels (``gluon_casts``, ``gluon_cast_3d``, ``gluon_cast_groups``, ``gluon_fake_quant``)
share: the tile layout and its config, and the dim1 pieces (quantize along M, transposed store).

A program's tile is [NUM_SUB, 32 rows, CHUNKS, 32 cols] (NUM_SUB 32-row sub-tiles, BLOCK_K = 32 *
CHUNKS columns) in

    size_per_thread [NUM_SUB, ROWS, 1, 8], threads_per_warp [1, 32 / ROWS, ROWS / 4, 4],
    warps_per_cta [1, 1, NUM_WARPS, 1]

A thread loads ROWS rows x 8 contiguous elements (16-byte loads for bf16); a block of 32 along K
is 8 values in a thread then 4 lanes (2 shuffle steps), a block of 32 along M is ROWS values in
a thread then 32 / ROWS lanes of one warp; warps split K, so no reduction touches shared memory.
For dim1 the tile is relabelled with its registers listed rows first (``transposed_layout``: a
register permutation, every convert_layout asserted trivial at compile time), so that cvt packs fp8
pairs along M and each thread stores ROWS contiguous bytes of [K, M] per column (``dim1_tile``).
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
from mx_kernels.common import format_constexprs, interpreting
from mx_kernels.mx_quantize import blocked_scale_offset, quantize_blocks, scale_exponent
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


# ---------------------------------------------------------------------------------------
# dim1: blocks of 32 along M, qdata stored transposed ([K, M]), scales [K, M/32]


@gluon.constexpr_function
def _pow2_below(n: int) -> list[int]:
    """1, 2, 4, .. < n (the linear-layout bases of a power-of-two extent n)."""
    return [1 << i for i in range(n.bit_length() - 1)]


@gluon.constexpr_function
def _lanes_and_warps(rows, num_warps, dim_row, dim_chunk, dim_col, rank):
    """Lane and warp bases of tile_layout (or of a slice of it: dim_row None drops the row dim, whose
    lanes then hold copies). Lanes go columns first, then chunks, then rows; warps along chunks."""

    def basis(dim, value):
        return [value if d == dim else 0 for d in range(rank)]

    lane = [basis(dim_col, 8), basis(dim_col, 16)] + [basis(dim_chunk, c) for c in _pow2_below(rows // 4)]
    lane += [basis(dim_row, rows * r) if dim_row is not None else [0] * rank for r in _pow2_below(32 // rows)]
    warp = [basis(dim_chunk, rows // 4 * w) for w in _pow2_below(num_warps)]
    return lane, warp


@gluon.constexpr_function
def transposed_layout(num_sub, rows, num_warps, reps):
    """tile_layout with each thread's registers listed rows first: same lanes and warps, so converting
    to it moves no data; its fp8 pairs and stores run along M (``rows`` contiguous bytes of [K, M])."""
    chunks = rows // 4 * num_warps * reps
    reg = [[0, r, 0, 0] for r in _pow2_below(rows)] + [[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]]
    reg += [[s, 0, 0, 0] for s in _pow2_below(num_sub)]
    reg += [[0, 0, rows // 4 * num_warps * r, 0] for r in _pow2_below(reps)]
    lane, warp = _lanes_and_warps(rows, num_warps, 1, 2, 3, 4)
    return gl.DistributedLinearLayout(reg, lane, warp, [], [num_sub, 32, chunks, 32])


@gluon.constexpr_function
def dim1_scale_layout(num_sub, rows, num_warps, reps):
    """The dim1 scales [NUM_SUB, CHUNKS, 32] as the row reduction leaves them (copies on the row
    lanes), registers listed sub-tile first: NUM_SUB contiguous scale bytes per column."""
    chunks = rows // 4 * num_warps * reps
    reg = [[s, 0, 0] for s in _pow2_below(num_sub)] + [[0, 0, 1], [0, 0, 2], [0, 0, 4]]
    reg += [[0, rows // 4 * num_warps * r, 0] for r in _pow2_below(reps)]
    lane, warp = _lanes_and_warps(rows, num_warps, None, 1, 2, 3)
    return gl.DistributedLinearLayout(reg, lane, warp, [], [num_sub, chunks, 32])


@gluon.jit
def quantize_blocks_lean(
    blocks, AXIS: gl.constexpr, EMAX: gl.constexpr, MAX_MANT: gl.constexpr, IS_E4M3: gl.constexpr,
    RCEIL: gl.constexpr,
):  # fmt: skip
    """quantize_blocks in fewer instructions per element, for the hardware cvt path only:
    - no clamp to +-max_normal: cvt.rn.satfinite already saturates (PTX: |v| > MAX_NORM gives
      the signed MAX_NORM, inf included), and RNE below the bound rounds the same either way;
    - the NaN block through the scale, not by selecting 0x7F on the fp8 bytes (unpack, select,
      mask, repack per element): 2**-e is NaN there, so every product is NaN and cvt makes it
      fp8 NaN. Bit-identical to quantize_blocks if that NaN is 0x7F for both formats (the GPU
      tests check it), so LEAN is off by default."""
    amax = gl.reduce(gl.abs(blocks), AXIS, max_nan)
    amax_bits = amax.to(gl.int32, bitcast=True) & 0x7FFFFFFF
    is_nan = amax_bits > 0x7F800000
    e = scale_exponent(amax_bits, EMAX, MAX_MANT, RCEIL)
    inv_scale = gl.where(e < 127, (127 - e) << 23, 0x400000).to(gl.float32, bitcast=True)
    v = blocks * gl.expand_dims(gl.where(is_nan, float("nan"), inv_scale), AXIS)
    if IS_E4M3:
        q = v.to(gl.float8e4nv).to(gl.uint8, bitcast=True)
    else:
        q = v.to(gl.float8e5).to(gl.uint8, bitcast=True)
    return q, gl.where(is_nan, 0xFF, e + 127).to(gl.uint8)


@gluon.jit
def quantize(
    blocks, AXIS: gl.constexpr, EMAX: gl.constexpr, MAX_MANT: gl.constexpr, MAX_NORMAL: gl.constexpr,
    MBITS: gl.constexpr, EMIN: gl.constexpr, IS_E4M3: gl.constexpr, RCEIL: gl.constexpr, LEAN: gl.constexpr,
):  # fmt: skip
    if LEAN:
        return quantize_blocks_lean(blocks, AXIS, EMAX, MAX_MANT, IS_E4M3, RCEIL)
    return quantize_blocks(blocks, AXIS, EMAX, MAX_MANT, MAX_NORMAL, MBITS, EMIN, IS_E4M3, RCEIL, False)


@gluon.jit
def store_scales(s_ptr, scale, r, c, n_rows, n_cols, BLOCKED: gl.constexpr, EVEN: gl.constexpr):
    """mx_quantize.store_scales for broadcastable index tensors r (scale row) and c (scale column).
    EVEN: the tile lies inside the matrix and there is no padding (no masks)."""
    if BLOCKED:
        col_tiles = (n_cols + 3) >> 2
        offs = blocked_scale_offset(r, c, col_tiles)
        if EVEN:
            gl.store(s_ptr + offs, scale)
        else:
            valid = (r < n_rows) & (c < n_cols)
            in_buffer = (r < ((n_rows + 127) >> 7 << 7)) & (c < col_tiles * 4)
            gl.store(s_ptr + offs, gl.where(valid, scale, 0), mask=in_buffer)
    elif EVEN:
        gl.store(s_ptr + r * n_cols + c, scale)  # < 2**31 bytes: 1/32 of an int32-indexable qdata
    else:
        gl.store(s_ptr + r * n_cols + c, scale, mask=(r < n_rows) & (c < n_cols))


@gluon.jit
def dim1_tile(
    x_ptr, q_ptr, M, K, stride_xm, stride_xk, row0, row_end, pid_k,
    NUM_SUB: gl.constexpr, ROWS: gl.constexpr, NUM_WARPS: gl.constexpr, REPS: gl.constexpr,
    MASK_ROWS: gl.constexpr, MASK_COLS: gl.constexpr, OFFS64: gl.constexpr, LEAN: gl.constexpr,
    EMAX: gl.constexpr, MAX_MANT: gl.constexpr, MAX_NORMAL: gl.constexpr, MBITS: gl.constexpr, EMIN: gl.constexpr,
    IS_E4M3: gl.constexpr, RCEIL: gl.constexpr,
):  # fmt: skip
    """Rows [row0, row0 + 32 * NUM_SUB) x columns [pid_k * BLOCK_K, +BLOCK_K) of x [M, K] (x_ptr, q_ptr:
    this slice's bases) quantized in blocks of 32 along M; qdata stored transposed into q [K, M].
    Rows >= row_end (MASK_ROWS) and columns >= K (MASK_COLS) read as zeros and are not stored.
    row0 and row_end: multiples of 32. Returns the scales [NUM_SUB, CHUNKS, 32] (uint8, biased) in
    ``dim1_scale_layout``: NUM_SUB contiguous scale bytes per column k in a thread.
    The 3D and per-group casts use it; the 2D kernel of gluon_casts keeps its own tile code (joint
    row-and-column masks), so that its measured code does not change."""
    CHUNKS: gl.constexpr = ROWS // 4 * NUM_WARPS * REPS
    L: gl.constexpr = tile_layout(NUM_SUB, ROWS, NUM_WARPS)
    rows = row0 + arange_along(NUM_SUB, 0, 4, L) * 32 + arange_along(32, 1, 4, L)  # [NUM_SUB, 32, 1, 1]
    cols = (pid_k * CHUNKS + arange_along(CHUNKS, 2, 4, L)) * 32 + arange_along(32, 3, 4, L)  # [1, 1, CHUNKS, 32]
    x_ptrs = x_ptr + wide(rows, OFFS64) * stride_xm + cols * stride_xk
    # masks stay full-shape ([NUM_SUB, 32, CHUNKS, 32]): a `>= 0` term stands in for the unmasked dim
    if MASK_ROWS:
        if MASK_COLS:
            x = gl.load(x_ptrs, mask=(rows < row_end) & (cols < K), other=0.0)
        else:
            x = gl.load(x_ptrs, mask=(rows < row_end) & (cols >= 0), other=0.0)
    elif MASK_COLS:
        x = gl.load(x_ptrs, mask=(rows >= 0) & (cols < K), other=0.0)
    else:
        x = gl.load(x_ptrs)

    # blocks of 32 along M (axis 1), quantized in the rows-first register order, so that cvt packs fp8
    # pairs along M, as the transposed [K, M] store wants them
    T: gl.constexpr = transposed_layout(NUM_SUB, ROWS, NUM_WARPS, REPS)
    q, s = quantize(
        gl.convert_layout(x.to(gl.float32), T, assert_trivial=True), 1, EMAX, MAX_MANT, MAX_NORMAL, MBITS, EMIN,
        IS_E4M3, RCEIL, LEAN,
    )  # fmt: skip
    t_rows = row0 + arange_along(NUM_SUB, 0, 4, T) * 32 + arange_along(32, 1, 4, T)
    t_cols = (pid_k * CHUNKS + arange_along(CHUNKS, 2, 4, T)) * 32 + arange_along(32, 3, 4, T)
    q_ptrs = q_ptr + wide(t_cols, OFFS64) * M + t_rows
    if MASK_ROWS:
        if MASK_COLS:
            gl.store(q_ptrs, q, mask=(t_rows < row_end) & (t_cols < K))
        else:
            gl.store(q_ptrs, q, mask=(t_rows < row_end) & (t_cols >= 0))
    elif MASK_COLS:
        gl.store(q_ptrs, q, mask=(t_rows >= 0) & (t_cols < K))
    else:
        gl.store(q_ptrs, q)
    S1L: gl.constexpr = dim1_scale_layout(NUM_SUB, ROWS, NUM_WARPS, REPS)
    return gl.convert_layout(s, S1L, assert_trivial=True)


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


def tile_launch_args(cfg: dict, elem: str, mode: str) -> dict:
    """The launch keywords every Gluon kernel on ``tile_layout`` takes from its checked config and
    format: the tile constexprs, LEAN, num_warps and the format's constants."""
    return dict(
        NUM_SUB=cfg["NUM_SUB"],
        ROWS=cfg["ROWS"],
        NUM_WARPS=cfg["NUM_WARPS"],
        REPS=cfg["BLOCK_K"] // (8 * cfg["ROWS"] * cfg["NUM_WARPS"]),  # layout repeats along K
        LEAN=cfg["LEAN"],
        num_warps=cfg["NUM_WARPS"],
        **format_constexprs(elem, mode),
    )


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
