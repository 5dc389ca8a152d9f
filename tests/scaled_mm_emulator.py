"""A layout-faithful emulator of PyTorch's MXFP8 (and NVFP4) block-scaled GEMMs on sm_100 (Blackwell).

``scaled_mm`` takes the arguments of ``torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=...)``
in its MXFP8 form, and ``scaled_grouped_mm`` those of ``torch._scaled_grouped_mm(...)``; both
check them as PyTorch does, read every scale through the blocked layout the way the hardware
does, and compute exactly: dequantize in fp64 (element * 2**e, exact), multiply and accumulate
in fp64, round to fp32 (the hardware's accumulator type), then cast to ``out_dtype``. It runs on
any device, so our argument preparation can be tested where no sm_100 GPU exists.

Contract emulated (sources: pytorch test/test_scaled_matmul_cuda.py, torch/_meta_registrations.py
``_check_scaled_mm_sizes`` of torch 2.13, aten/src/ATen/native/cuda/ScaledBlas.cpp
``is_blockwise_1x32_scaling`` and GroupedBlas.cpp ``_check_scales_blocked``):

* dense: a [M, K] row-major, b [K, N] column-major (``w.t()`` of a row-major w [N, K]), both
  float8 (e4m3fn or e5m2), K % 16 == 0 and N % 16 == 0; scales float8_e8m0fnu, contiguous, with
  exactly round_up(rows, 128) * round_up(ceil(K / 32), 4) elements (rows = M for a, N for b), in
  the blocked layout of scale_layout.py; any shape with that many elements (1D is what
  ``to_blocked`` gives). Element k of a row uses scale column k // 32.
* grouped (MXFP8 only with e4m3fn operands, bf16 output, int32 ``offs``):
  2d-3d: a [M_total, K] row-major, b [G, K, N] column-major per group; scale_b [G, blocked(N, K/32)]
  (each expert blocked on its own); scale_a 2D with >= M_total rows holding each token group's
  scales blocked on their own, group g starting at row sum_{h<g} round_up(M_h, 128) (torchao's
  "2d M groups" layout; pytorch's 2d-3d test concatenates per-group ``to_blocked`` outputs).
  2d-2d: a [M, K_total] row-major, b [K_total, N] column-major, groups along K, out [G, M, N];
  each scale 2D with >= M (a) or >= N (b) rows, group g's blocked bytes starting at byte
  round_up(rows, 128) * sum_{h<g} round_up(K_h / 32, 4) (scale_layout.to_blocked_groups).

Padding bytes of the blocked layout are never read: they belong to rows past M/N or to K blocks
past K, which do not exist. What the hardware does with non-zero padding is not modeled.
"""

from __future__ import annotations

import torch

from mx_recipe.formats.mx import BLOCK_SIZE, E8M0_BIAS, E8M0_NAN

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DENSE_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TILE_ROWS, TILE_COLS, TILE_BYTES = 128, 4, 512


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def blocked_scale_count(rows: int, k: int) -> int:
    """Scale bytes the op expects for ``rows`` rows with a contraction dim of ``k``."""
    return _round_up(rows, TILE_ROWS) * _round_up(_ceil_div(k, BLOCK_SIZE), TILE_COLS)


def blocked_byte_index(rows: int, cols: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [rows, cols]: the byte holding scale (r, c) of a [rows, cols] matrix in the blocked layout.

    128x4 tiles stored in row-major tile order, 512 bytes each; inside a tile, (r, c) sits at
    byte (r % 32) * 16 + (r // 32) * 4 + c. Written from the formula, independently of
    scale_layout.to_blocked, so that each checks the other.
    """
    r = torch.arange(rows, device=device, dtype=torch.int64)[:, None]
    c = torch.arange(cols, device=device, dtype=torch.int64)[None, :]
    col_tiles = _ceil_div(cols, TILE_COLS)
    tile = (r // TILE_ROWS) * col_tiles + c // TILE_COLS
    inner = r % TILE_ROWS
    return tile * TILE_BYTES + (inner % 32) * 16 + (inner // 32) * 4 + c % TILE_COLS


def read_blocked_scales(buf: torch.Tensor, rows: int, cols: int, base: int = 0) -> torch.Tensor:
    """uint8 [rows, cols]: scales of a blocked [rows, cols] matrix whose tiles start at byte ``base`` of ``buf``."""
    flat = buf.reshape(-1).view(torch.uint8)
    need = base + _round_up(rows, TILE_ROWS) * _round_up(cols, TILE_COLS)
    if rows and cols and need > flat.numel():
        raise ValueError(
            f"blocked scales: [{rows}, {cols}] at byte {base} need {need} bytes, the buffer has {flat.numel()}"
        )
    return flat[base + blocked_byte_index(rows, cols, buf.device)]


def _exp2_fp64(biased: torch.Tensor) -> torch.Tensor:
    """2**(byte - 127) in fp64, exact (built from the exponent bits), NaN for 0xFF."""
    e = biased.to(torch.int64) - E8M0_BIAS
    factor = ((e + 1023) << 52).view(torch.float64)
    return torch.where(biased == E8M0_NAN, torch.nan, factor)


def _dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp8 [R, K] with uint8 scales [R, ceil(K / 32)] -> exact fp64 values; element k uses column k // 32."""
    k = q.shape[-1]
    factor = _exp2_fp64(scales).repeat_interleave(BLOCK_SIZE, dim=-1)[..., :k]
    return q.to(torch.float64) * factor


def _finish(acc: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    # The tensor cores accumulate in fp32: round there first, then to the output type.
    return acc.to(torch.float32).to(out_dtype)


def _is_row_major(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.stride(-2) > 1


def _is_col_major(t: torch.Tensor) -> bool:
    return t.stride(-2) == 1 and t.stride(-1) > 1


def _check_e8m0(name: str, scale: torch.Tensor) -> None:
    if scale.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"{name} must be float8_e8m0fnu MX scales, got {scale.dtype}")


def _check_dense_layout(a: torch.Tensor, b: torch.Tensor, op: str) -> tuple[int, int, int]:
    """(M, K, N) of a [M, K] row-major @ b [K, N] column-major, K and N multiples of 16, as the op checks them
    (for packed fp4, K counts bytes)."""
    m, k = a.shape
    if b.shape[0] != k:
        raise ValueError(f"{op}: a {tuple(a.shape)} and b {tuple(b.shape)} do not share K")
    n = b.shape[1]
    if m and k and not _is_row_major(a):
        raise ValueError(f"{op}: a must be row-major, got strides {a.stride()}")
    if n and k and not _is_col_major(b):
        raise ValueError(f"{op}: b must be column-major (pass w.t() of a row-major w [N, K]), got strides {b.stride()}")
    if k % 16 or n % 16:
        raise ValueError(f"{op}: K and N must be multiples of 16, got K={k}, N={n}")
    return m, k, n


def scaled_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype)`` for MXFP8: a [M, K] @ b [K, N]."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"scaled_mm: inputs must be 2D, got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if a.dtype not in FP8_DTYPES or b.dtype not in FP8_DTYPES:
        raise TypeError(f"scaled_mm: a and b must be float8_e4m3fn or float8_e5m2, got {a.dtype} and {b.dtype}")
    _check_e8m0("scale_a", scale_a)
    _check_e8m0("scale_b", scale_b)
    if out_dtype not in DENSE_OUT_DTYPES:
        raise TypeError(f"scaled_mm: out_dtype must be one of {DENSE_OUT_DTYPES}, got {out_dtype}")
    m, k, n = _check_dense_layout(a, b, "scaled_mm")
    for name, scale, rows in (("scale_a", scale_a, m), ("scale_b", scale_b, n)):
        expected = blocked_scale_count(rows, k)
        if scale.numel() != expected:
            raise ValueError(
                f"scaled_mm: {name} has {scale.numel()} elements; MXFP8 block scaling of {rows} rows with K={k} "
                f"needs {expected} (the blocked layout: rows padded to 128, K/32 padded to 4)"
            )
        if not scale.is_contiguous():
            raise ValueError(f"scaled_mm: {name} must be contiguous")
    cols = _ceil_div(k, BLOCK_SIZE)
    a_f64 = _dequantize(a, read_blocked_scales(scale_a, m, cols))
    b_f64 = _dequantize(b.t(), read_blocked_scales(scale_b, n, cols))  # [N, K]
    return _finish(a_f64 @ b_f64.t(), out_dtype)


E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_BLOCK = 16


def _unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C] holding two e2m1 codes a byte, the first element in the low nibble -> fp64 [R, 2C]."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).to(torch.int64)
    magnitude = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64, device=packed.device)[codes & 7]
    return torch.where(codes >= 8, -magnitude, magnitude)


def nvfp4_scaled_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype)`` for NVFP4 (sm_100): a [M, K/2] row-major
    and b [K/2, N] column-major, float4_e2m1fn_x2 (two e2m1 a byte, the first in the low nibble); scale_a and
    scale_b float8_e4m3fn, one per 16 elements along K, blocked as MXFP8's e8m0 scales are (rows padded to
    128, K/16 padded to 4), contiguous. The op's size checks (torch's ``_check_scaled_mm_sizes``): a.size(1)
    % 16 == 0 and both dims of b multiples of 16, so K % 32 == 0. No per-tensor scale: the caller multiplies
    the fp32 output by it."""
    if a.dtype != torch.float4_e2m1fn_x2 or b.dtype != torch.float4_e2m1fn_x2:
        raise TypeError(f"nvfp4_scaled_mm: a and b must be float4_e2m1fn_x2, got {a.dtype} and {b.dtype}")
    for name, scale in (("scale_a", scale_a), ("scale_b", scale_b)):
        if scale.dtype != torch.float8_e4m3fn:
            raise TypeError(f"nvfp4_scaled_mm: {name} must be float8_e4m3fn NVFP4 block scales, got {scale.dtype}")
        if not scale.is_contiguous():
            raise ValueError(f"nvfp4_scaled_mm: {name} must be contiguous")
    if out_dtype not in DENSE_OUT_DTYPES:
        raise TypeError(f"nvfp4_scaled_mm: out_dtype must be one of {DENSE_OUT_DTYPES}, got {out_dtype}")
    m, half_k, n = _check_dense_layout(a, b, "nvfp4_scaled_mm")  # packed: the sizes are of bytes along K
    k = 2 * half_k
    cols = _ceil_div(k, NVFP4_BLOCK)
    for name, scale, rows in (("scale_a", scale_a, m), ("scale_b", scale_b, n)):
        expected = _round_up(rows, TILE_ROWS) * _round_up(cols, TILE_COLS)
        if scale.numel() != expected:
            raise ValueError(
                f"nvfp4_scaled_mm: {name} has {scale.numel()} elements; {rows} rows with K={k} need {expected}"
            )

    def dequantize(q: torch.Tensor, scale: torch.Tensor, rows: int) -> torch.Tensor:
        factor = read_blocked_scales(scale, rows, cols).view(torch.float8_e4m3fn).to(torch.float64)
        return _unpack_e2m1(q.view(torch.uint8)) * factor.repeat_interleave(NVFP4_BLOCK, dim=-1)

    a_f64 = dequantize(a, scale_a, m)
    b_f64 = dequantize(b.view(torch.uint8).t().contiguous(), scale_b, n)  # [N, K] (fp4x2 tensors do not copy)
    return _finish(a_f64 @ b_f64.t(), out_dtype)


def _group_bounds(offs: torch.Tensor, total: int, what: str) -> list[tuple[int, int]]:
    if offs.dim() != 1 or offs.dtype != torch.int32:
        raise ValueError(f"scaled_grouped_mm: offs must be a 1D int32 tensor, got {offs.dtype} {tuple(offs.shape)}")
    ends = offs.tolist()
    bounds, start = [], 0
    for end in ends:
        if end < start or (end - start) % BLOCK_SIZE:
            raise ValueError(
                f"scaled_grouped_mm: offs must be non-decreasing group ends with every {what} group a multiple "
                f"of {BLOCK_SIZE}, got {ends}"
            )
        bounds.append((start, end))
        start = end
    if start > total:
        raise ValueError(f"scaled_grouped_mm: offs end at {start}, past the {total} {what} rows of the operand")
    return bounds


def _check_2d_group_scale(name: str, scale: torch.Tensor, min_rows: int) -> None:
    if scale.dim() != 2 or not scale.is_contiguous():
        raise ValueError(f"scaled_grouped_mm: {name} of a 2D operand must be contiguous and 2D, got {scale.dim()}D")
    if scale.shape[0] < min_rows:
        raise ValueError(f"scaled_grouped_mm: {name} must have at least {min_rows} rows, got {tuple(scale.shape)}")


def scaled_grouped_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``torch._scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=offs, out_dtype=out_dtype)`` for MXFP8.

    2d-3d: [M_total, K] x [G, K, N] -> [M_total, N]; 2d-2d: [M, K_total] x [K_total, N] -> [G, M, N].
    Rows (2d-3d) or K (2d-2d) past offs[-1] take part in nothing; their output rows stay zero.
    """
    if mat_a.dim() != 2 or mat_b.dim() not in (2, 3):
        raise ValueError(
            f"scaled_grouped_mm: MXFP8 supports 2d-2d and 2d-3d, got {mat_a.dim()}D and {mat_b.dim()}D operands"
        )
    if mat_a.dtype != torch.float8_e4m3fn or mat_b.dtype != torch.float8_e4m3fn:
        raise TypeError(
            f"scaled_grouped_mm: MXFP8 grouped GEMM takes float8_e4m3fn operands, got {mat_a.dtype} and {mat_b.dtype}"
        )
    _check_e8m0("scale_a", scale_a)
    _check_e8m0("scale_b", scale_b)
    if out_dtype != torch.bfloat16:
        raise TypeError(f"scaled_grouped_mm: only bf16 output is supported, got {out_dtype}")
    if not _is_row_major(mat_a):
        raise ValueError(f"scaled_grouped_mm: mat_a must be row-major, got strides {mat_a.stride()}")
    if not _is_col_major(mat_b):
        raise ValueError(f"scaled_grouped_mm: mat_b must be column-major in its last two dims, got {mat_b.stride()}")
    if mat_a.shape[-1] % 16 or mat_b.shape[-2] % 16 or mat_b.shape[-1] % 16:
        raise ValueError(
            f"scaled_grouped_mm: mat_a's last dim and both of mat_b's must be multiples of 16, got "
            f"{tuple(mat_a.shape)} and {tuple(mat_b.shape)}"
        )
    if mat_a.shape[-1] != mat_b.shape[-2]:
        raise ValueError(f"scaled_grouped_mm: contraction dims differ, {tuple(mat_a.shape)} x {tuple(mat_b.shape)}")
    if mat_b.dim() == 3:
        return _grouped_2d_3d(mat_a, mat_b, scale_a, scale_b, offs)
    return _grouped_2d_2d(mat_a, mat_b, scale_a, scale_b, offs)


def _grouped_2d_3d(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    m_total, k = a.shape
    g, _, n = b.shape
    cols = _ceil_div(k, BLOCK_SIZE)
    if offs.numel() != g:
        raise ValueError(f"scaled_grouped_mm: {offs.numel()} group ends for {g} groups of mat_b")
    expected = (g, _round_up(cols, TILE_COLS) * _round_up(n, TILE_ROWS))
    if tuple(scale_b.shape) != expected or scale_b.stride(-1) != 1:
        raise ValueError(
            f"scaled_grouped_mm: mat_b {tuple(b.shape)} needs scale_b of shape {expected} (each group's [N, K/32] "
            f"scales blocked on their own), got {tuple(scale_b.shape)}"
        )
    _check_2d_group_scale("scale_a", scale_a, m_total)
    out = torch.zeros(m_total, n, dtype=torch.float64, device=a.device)
    padded_cols = _round_up(cols, TILE_COLS)
    row_base = 0  # token group g's scales start at row sum_{h<g} round_up(M_h, 128)
    for e, (start, end) in enumerate(_group_bounds(offs, m_total, "token")):
        rows = end - start
        if rows == 0:
            continue
        a_f64 = _dequantize(a[start:end], read_blocked_scales(scale_a, rows, cols, base=row_base * padded_cols))
        b_f64 = _dequantize(b[e].t(), read_blocked_scales(scale_b[e], n, cols))  # [N, K]
        out[start:end] = a_f64 @ b_f64.t()
        row_base += _round_up(rows, TILE_ROWS)
    return _finish(out, torch.bfloat16)


def _grouped_2d_2d(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    m, k_total = a.shape
    n = b.shape[1]
    _check_2d_group_scale("scale_a", scale_a, m)
    _check_2d_group_scale("scale_b", scale_b, n)
    bounds = _group_bounds(offs, k_total, "K")
    out = torch.zeros(len(bounds), m, n, dtype=torch.float64, device=a.device)
    col_base = 0  # group g's tiles start at byte round_up(rows, 128) * sum_{h<g} round_up(K_h / 32, 4)
    for e, (start, end) in enumerate(bounds):
        cols = (end - start) // BLOCK_SIZE
        if cols == 0:
            continue
        a_s = read_blocked_scales(scale_a, m, cols, base=_round_up(m, TILE_ROWS) * col_base)
        b_s = read_blocked_scales(scale_b, n, cols, base=_round_up(n, TILE_ROWS) * col_base)
        out[e] = _dequantize(a[:, start:end], a_s) @ _dequantize(b[start:end].t(), b_s).t()
        col_base += _round_up(cols, TILE_COLS)
    return _finish(out, torch.bfloat16)
