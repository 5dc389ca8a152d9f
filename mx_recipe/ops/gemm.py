"""The MX GEMMs themselves, and which of them a device can run.

* The cublas path: PyTorch's MXFP8 block-scaled GEMMs on sm_100 and later (blocked e8m0 scales, scale_layout.py):
  ``F.scaled_mm`` where torch has it, else ``torch._scaled_mm``; for MoE, ``F.scaled_grouped_mm`` /
  ``torch._scaled_grouped_mm`` (``mx_scaled_mm``, ``mx_mm_blocked``, ``mx_grouped_mm_2d_3d``,
  ``mx_grouped_mm_2d_2d``). A ``scaled_mm`` / ``scaled_grouped_mm`` argument replaces the op (tests pass
  tests/scaled_mm_emulator.py's).
* The triton path: ``tl.dot_scaled`` (``mx_mm_triton``, through the custom op ``torch.ops.mx_recipe.mx_gemm``,
  opaque to torch.compile) on NVIDIA sm_89 and later, for e4m3, e5m2 and e2m1 in any pairing, plain scales.
  Native MX MMA on sm_100; on sm_90 Triton upcasts both tiles to bf16 (exact) and runs a bf16 MMA.
* ``mx_mm`` multiplies two MXTensors on a backend named by string.

The backends that cast a layer's operands and call these are ``mx_backends`` and ``nvfp4_backends``;
``backends.resolve_backend`` picks one with the availability checks below.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F

import mx_recipe.ops.dispatch  # noqa: F401  (registers torch.ops.mx_recipe.mx_gemm; imports no Triton)
from mx_recipe.formats.mx import BLOCK_SIZE, MXTensor
from mx_recipe.formats.recipe import HIGH_PRECISION, MXRecipe
from mx_recipe.formats.scale_layout import (
    SCALE_TILE_COLS,
    SCALE_TILE_ROWS,
    blocked_byte_offset,
    blocked_numel,
    padded_group_layout,
    to_blocked,
)
from mx_recipe.ops.device import capability
from mx_recipe.ops.mx_cast import (
    BlockedMXTensor,
)

ScaledMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
ScaledGroupedMM = Callable[..., torch.Tensor]

CUBLAS_MIN_CAPABILITY = (10, 0)
CUBLAS_ELEMS = ("e4m3", "e5m2")  # fp8 elements; e2m1 (packed fp4) has no cublas path here
CUBLAS_GROUPED_OUT_DTYPE = torch.bfloat16  # MXFP8 torch._scaled_grouped_mm writes bf16 only
# tl.dot_scaled takes fp8 operands from sm_89 on (Triton's own tests skip below that).
TRITON_MIN_CAPABILITY = (8, 9)
TRITON_ELEMS = ("e4m3", "e5m2", "e2m1")


# --- what a device runs ---


def describe_device(device: torch.device) -> str:
    cap = capability(device)
    if cap is None:
        return f"{device} is not an NVIDIA CUDA device"
    return f"{device} has compute capability {cap[0]}.{cap[1]} (sm_{cap[0]}{cap[1]})"


def cublas_available(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs MXFP8 on ``device``: CUDA sm_100 or later."""
    cap = capability(device)
    return cap is not None and cap >= CUBLAS_MIN_CAPABILITY and hasattr(torch, "_scaled_mm")


# Read once: building this string takes about 9 us, and dynamo cannot trace it.
_TORCH_HAS_MSLK = any(flag in torch.__config__.show() for flag in ("USE_MSLK", "USE_FBGEMM_GENAI"))


def cublas_grouped_available(device: torch.device) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs MXFP8 on ``device``.

    It needs sm_100 (the op allows only sm_90 and sm_10x, and MXFP8 only on sm_10x) and a torch
    built with the MSLK (formerly FBGEMM GenAI) kernels; PyTorch's own tests check the build the
    same way, through ``torch.__config__.show()``.
    """
    cap = capability(device)
    return cap is not None and cap[0] == 10 and hasattr(torch, "_scaled_grouped_mm") and _TORCH_HAS_MSLK


def triton_available(device: torch.device) -> bool:
    """Whether the triton backend runs on ``device``: an NVIDIA GPU of sm_89 or later, triton importable."""
    cap = capability(device)
    return cap is not None and cap >= TRITON_MIN_CAPABILITY and importlib.util.find_spec("triton") is not None


def resolve_name(backend: str, device: torch.device) -> str:
    """The concrete backend for the name ``backend`` on ``device``; 'auto' picks cublas where it runs, else emulated."""
    if backend == "emulated":
        return "emulated"
    if backend == "auto":
        # Never triton. On sm_100 cublas is the vendor MX GEMM. On sm_90 tl.dot_scaled has no MX MMA
        # to use: Triton upcasts both tiles to bf16 in the kernel, measured at 120-200 TFLOP/s on an
        # H200 (docs/DESIGN.md, "GEMM backends"), while emulated (dequantize, then a 740-770 TFLOP/s
        # bf16 torch.mm) costs 0.91-1.01x of a bf16 mm's time under torch.compile.
        return "cublas" if cublas_available(device) else "emulated"
    if backend == "triton":
        if not triton_available(device):
            cap = capability(device)
            gpu_ok = cap is not None and cap >= TRITON_MIN_CAPABILITY
            why = f"triton is not importable ({describe_device(device)})" if gpu_ok else describe_device(device)
            raise ValueError(
                "MX GEMM backend 'triton' needs an NVIDIA GPU of compute capability 8.9 or later (sm_89+) and an "
                f"importable triton for tl.dot_scaled, but {why}. Use backend 'emulated' (or 'auto') here."
            )
        return "triton"
    if backend == "cublas":
        if not cublas_available(device):
            raise ValueError(
                f"MX GEMM backend 'cublas' needs an NVIDIA GPU of compute capability 10.0 or later (sm_100, "
                f"Blackwell) for torch._scaled_mm with float8_e8m0fnu block scales, but {describe_device(device)}. "
                "Use backend 'emulated' (or 'auto') here."
            )
        return "cublas"
    raise ValueError(f"unknown MX GEMM backend {backend!r}; expected 'auto', 'emulated', 'cublas' or 'triton'")


def mx_elems(recipe: MXRecipe) -> set[str]:
    """Element formats of the MX operands of the recipe's GEMMs (bf16 GEMMs have none)."""
    elems = {recipe.forward} - {HIGH_PRECISION}
    for gemm in (recipe.grad_input, recipe.grad_weight):  # backward GEMMs also quantize the gradient
        if gemm != HIGH_PRECISION:
            elems |= {gemm, recipe.grad}
    return elems


def cublas_gaps(recipe: MXRecipe, device: torch.device, grouped: bool) -> list[str]:
    """What in ``recipe`` the cublas path cannot run on ``device`` (empty when it can run all of it)."""
    elems = mx_elems(recipe)
    gaps = []
    if "e2m1" in elems:
        gaps.append("MXFP4 (e2m1) GEMMs have no cublas path here (only fp8 MX operands are wired)")
    if grouped and not cublas_grouped_available(device):
        gaps.append(
            f"MXFP8 torch._scaled_grouped_mm needs sm_100 and a torch built with MSLK; {describe_device(device)}"
        )
    if grouped and "e5m2" in elems:
        gaps.append("MXFP8 torch._scaled_grouped_mm takes float8_e4m3fn operands only (the recipe uses e5m2)")
    return gaps


# --- the cublas path: dense ---


def _mxfp8_scale_args(scale_a: torch.Tensor, scale_b: torch.Tensor) -> tuple[tuple, dict]:
    """The scale arguments of F.scaled_mm / F.scaled_grouped_mm for MXFP8: e8m0 scales of 1x32 blocks, both in
    the blocked layout (docs/DESIGN.md, Scale layout)."""
    block, swizzle = F.ScalingType.BlockWise1x32, F.SwizzleType.SWIZZLE_32_4_4
    return (scale_a, block, scale_b, block), dict(swizzle_a=swizzle, swizzle_b=swizzle)


def _torch_scaled_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """The real MXFP8 op: a [M, K] row-major @ b [K, N] column-major, blocked e8m0 scales."""
    e4m3 = a.dtype == b.dtype == torch.float8_e4m3fn
    if hasattr(F, "scaled_mm") and e4m3:  # the documented API; its MXFP8 recipe takes e4m3 only
        scales, swizzles = _mxfp8_scale_args(scale_a, scale_b)
        return F.scaled_mm(a, b, *scales, output_dtype=out_dtype, **swizzles)
    # Infers MXFP8 from the e8m0 scale dtype and their blocked element count; accepts e5m2 too.
    return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype)


def mx_scaled_mm(
    a_q: torch.Tensor,
    a_scale_blocked: torch.Tensor,
    b_q: torch.Tensor,
    b_scale_blocked: torch.Tensor,
    out_dtype: torch.dtype,
    scaled_mm: ScaledMM | None = None,
) -> torch.Tensor:
    """``a @ b.T`` for MX fp8 operands a [M, K] and b [N, K], both row-major and quantized along K.

    Scales: float8_e8m0fnu in the blocked layout (``to_blocked`` of [M, K/32] and [N, K/32]).
    b goes to the op as ``b_q.t()``, the column-major [K, N] operand it wants (no copy).
    """
    if a_q.dim() != 2 or b_q.dim() != 2 or a_q.shape[1] != b_q.shape[1]:
        raise ValueError(f"mx_scaled_mm: expected a [M, K] and b [N, K], got {tuple(a_q.shape)} and {tuple(b_q.shape)}")
    op = _torch_scaled_mm if scaled_mm is None else scaled_mm
    return op(a_q, b_q.t(), a_scale_blocked, b_scale_blocked, out_dtype)


def _check_operand(name: str, t: BlockedMXTensor, ndim: int, grouped: bool) -> None:
    if not isinstance(t, BlockedMXTensor):
        raise TypeError(f"{name} must be a BlockedMXTensor (a cast with blocked_scales=True), got {type(t).__name__}")
    if t.elem not in CUBLAS_ELEMS:
        raise ValueError(f"{name}: the cublas path takes fp8 MX elements {CUBLAS_ELEMS}, got {t.elem!r}")
    if t.qdata.dim() != ndim or t.dim != ndim - 1 or t.block_size != BLOCK_SIZE:
        raise ValueError(f"{name}: expected {ndim}D data quantized along its last dim, got {tuple(t.qdata.shape)}")
    if (t.group_offs is not None) != grouped:
        raise ValueError(f"{name}: {'expected' if grouped else 'unexpected'} per-group blocked scales")


def mx_mm_blocked(
    a: BlockedMXTensor, b: BlockedMXTensor, out_dtype: torch.dtype, scaled_mm: ScaledMM | None = None
) -> torch.Tensor:
    """``a @ b.T`` from two cast outputs (``cast_dim0`` / ``cast_dim1`` with ``blocked_scales=True``)."""
    _check_operand("a", a, 2, grouped=False)
    _check_operand("b", b, 2, grouped=False)
    for name, t in (("a", a), ("b", b)):
        rows, k = t.qdata.shape
        if t.scale_shape != (rows, k // BLOCK_SIZE) or t.scale.numel() != blocked_numel(*t.scale_shape):
            raise ValueError(f"{name}: scales {tuple(t.scale.shape)} do not hold blocked [{rows}, {k // BLOCK_SIZE}]")
    return mx_scaled_mm(a.qdata, a.scale, b.qdata, b.scale, out_dtype, scaled_mm)


def mx_mm(a: MXTensor, b: MXTensor, out_dtype: torch.dtype, backend: str = "auto") -> torch.Tensor:
    """``a @ b.T`` with a: [M, K] and b: [N, K], both quantized in blocks along K."""
    if a.dim != a.qdata.dim() - 1 or b.dim != b.qdata.dim() - 1:
        raise ValueError(f"mx_mm needs both operands quantized along K (their last dim); got dims {a.dim}, {b.dim}")
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"mx_mm: K differs, a {tuple(a.shape)} vs b {tuple(b.shape)}")
    resolved = resolve_name(backend, a.qdata.device)
    if resolved == "triton":
        return mx_mm_triton(a, b, out_dtype)
    fp8 = {a.elem, b.elem} <= set(CUBLAS_ELEMS)
    if backend == "cublas" and not fp8:
        raise ValueError(f"mx_mm: backend 'cublas' takes fp8 MX operands {CUBLAS_ELEMS}, got {a.elem!r}, {b.elem!r}")
    # 'auto' takes cublas for e4m3 only, as resolve_backend does
    if resolved == "cublas" and (backend == "cublas" or a.elem == b.elem == "e4m3"):
        a_q, b_q = a.qdata.contiguous(), b.qdata.contiguous()
        return mx_scaled_mm(a_q, to_blocked(a.scale), b_q, to_blocked(b.scale), out_dtype)
    return torch.mm(a.dequantize(out_dtype), b.dequantize(out_dtype).t())


# --- the triton path ---


TRITON_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def mx_mm_triton(a: MXTensor, b: MXTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T`` on ``tl.dot_scaled``: a [M, K] and b [N, K], 2D MXTensors quantized along K
    (their last dim) with plain scales, e.g. ``cast_dim0`` / ``cast_dim1`` outputs. Any element
    formats of TRITON_ELEMS, mixed too; fp32 accumulation; bf16, fp16 or fp32 out.

    Checks the operands, not the device: callers resolve the backend first (``mx_mm``,
    ``resolve_backend``). On sm_90 the result equals ``emulated`` up to summation order, except
    where an element * 2**e leaves bf16's normal range (mx_kernels/mx/gemm.py).
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, MXTensor):
            raise TypeError(f"mx_mm_triton: {name} must be an MXTensor with plain scales, got {type(t).__name__}")
        if t.qdata.dim() != 2 or t.dim != 1 or t.block_size != BLOCK_SIZE:
            raise ValueError(
                f"mx_mm_triton: {name} must be 2D, quantized along its last dim in blocks of {BLOCK_SIZE}; got "
                f"qdata {tuple(t.qdata.shape)}, dim {t.dim}, block_size {t.block_size}"
            )
        if t.elem not in TRITON_ELEMS:
            raise ValueError(f"mx_mm_triton: {name} has element format {t.elem!r}; triton takes {TRITON_ELEMS}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"mx_mm_triton: K differs, a {tuple(a.shape)} vs b {tuple(b.shape)}")
    if out_dtype not in TRITON_OUT_DTYPES:
        raise ValueError(f"mx_mm_triton: out_dtype must be one of {TRITON_OUT_DTYPES}, got {out_dtype}")
    return torch.ops.mx_recipe.mx_gemm(a.qdata, a.scale, a.elem, b.qdata, b.scale, b.elem, out_dtype)


# --- the cublas path: grouped (MoE) ---


def blocked_row_groups(scale: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Plain scales [M_total, C] of token groups along M -> the 2d-3d grouped GEMM's A-scale layout.

    Each group's [M_g, C] scales are blocked on their own (rows padded to 128, columns to 4), group
    g starting at row sum_{h<g} round_up(M_g, 128). Returns 2D [M_total + 128 * G, round_up(C, 4)]
    (a static bound, so nothing waits for ``offs``; unused rows are zero). Device ops only.
    """
    if scale.dim() != 2 or offs.dim() != 1:
        raise ValueError(f"blocked_row_groups: expected [M, C] scales and 1D offs, got {tuple(scale.shape)}")
    m_total, cols = scale.shape
    padded_cols = -(-cols // SCALE_TILE_COLS) * SCALE_TILE_COLS
    out_rows = m_total + SCALE_TILE_ROWS * offs.numel()
    # Row r of group g goes to row r - start(g) + padded_start(g) of groups padded to 128 rows;
    # since each padded start is a whole tile row, the blocked byte of that row is the group's own.
    rows, _, _ = padded_group_layout(offs, m_total, SCALE_TILE_ROWS)
    valid = torch.arange(m_total, device=scale.device) < offs[-1].to(torch.int64)  # rows past offs[-1]: no group
    byte = blocked_byte_offset(rows[:, None], torch.arange(cols, device=scale.device)[None, :], cols)
    trash = out_rows * padded_cols  # one spare byte takes the rows of no group
    byte = torch.where(valid[:, None], byte, trash)
    out = torch.zeros(trash + 1, dtype=torch.uint8, device=scale.device)
    out.index_copy_(0, byte.reshape(-1), scale.reshape(-1).view(torch.uint8).contiguous())
    return out[:trash].view(out_rows, padded_cols).view(scale.dtype)


def _torch_scaled_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    if hasattr(F, "scaled_grouped_mm"):
        scales, swizzles = _mxfp8_scale_args(scale_a, scale_b)
        return F.scaled_grouped_mm(a, b, *scales, offs=offs, output_dtype=out_dtype, **swizzles)
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=out_dtype)


def mx_grouped_mm_2d_3d(
    a: MXTensor,
    w: BlockedMXTensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    scaled_grouped_mm: ScaledGroupedMM | None = None,
) -> torch.Tensor:
    """Token groups a [M_total, K] (plain scales, groups ending at ``offs``, each a multiple of 32 rows)
    times expert weights w [E, N, K] quantized along K with per-expert blocked scales -> [M_total, N].

    Groups of 32-row multiples are what PyTorch's MXFP8 grouped tests and torchao run the op with
    (torchao pads to them) and what the emulator enforces; the MSLK kernel's argument setup checks
    only offs <= M_total for 2d-3d. ``grouped.mx_grouped_mm`` pads ragged groups on the device.

    MoE forward: ``a = cast_dim0(x)``, ``w = cast_3d_dim0(w, blocked_scales=True)``.
    MoE grad input: ``a = cast_dim0(g)``, ``w = cast_3d_dim1(w, blocked_scales=True)`` ([E, K, N]).
    """
    if not isinstance(a, MXTensor) or a.qdata.dim() != 2 or a.dim != 1:
        raise ValueError("mx_grouped_mm_2d_3d: a must be a 2D MXTensor with plain scales, quantized along K")
    _check_operand("w", w, 3, grouped=False)
    if a.elem not in CUBLAS_ELEMS:
        raise ValueError(f"a: the cublas path takes fp8 MX elements {CUBLAS_ELEMS}, got {a.elem!r}")
    op = _torch_scaled_grouped_mm if scaled_grouped_mm is None else scaled_grouped_mm
    a_scale = blocked_row_groups(a.scale, offs)
    return op(a.qdata, w.qdata.transpose(-2, -1), a_scale, w.scale, offs, out_dtype)


def mx_grouped_mm_2d_2d(
    a: BlockedMXTensor,
    b: BlockedMXTensor,
    out_dtype: torch.dtype = torch.bfloat16,
    scaled_grouped_mm: ScaledGroupedMM | None = None,
) -> torch.Tensor:
    """Per group e: ``a[:, group e] @ b[:, group e].T`` -> [E, rows of a, rows of b].

    Both from ``cast_groups_dim1(..., blocked_scales=True)`` with the same ``offs`` (MoE grad
    weight: a = cast_groups_dim1(g) [N, M], b = cast_groups_dim1(x) [K, M] -> [E, N, K]).
    """
    _check_operand("a", a, 2, grouped=True)
    _check_operand("b", b, 2, grouped=True)
    if a.qdata.shape[1] != b.qdata.shape[1]:
        raise ValueError(f"mx_grouped_mm_2d_2d: token dims differ, {tuple(a.qdata.shape)} vs {tuple(b.qdata.shape)}")
    op = _torch_scaled_grouped_mm if scaled_grouped_mm is None else scaled_grouped_mm
    # The op wants 2D scales with >= rows rows: each per-group buffer, viewed [padded rows, -1].
    a_scale = a.scale.view(-(-a.qdata.shape[0] // SCALE_TILE_ROWS) * SCALE_TILE_ROWS, -1)
    b_scale = b.scale.view(-(-b.qdata.shape[0] // SCALE_TILE_ROWS) * SCALE_TILE_ROWS, -1)
    return op(a.qdata, b.qdata.t(), a_scale, b_scale, a.group_offs, out_dtype)
