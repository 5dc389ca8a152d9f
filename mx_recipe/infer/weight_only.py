"""The weight-only GEMM as custom ops: ``torch.ops.mx_recipe.weight_only_mm`` and ``weight_only_grouped_mm``,
x (bf16) times a weight kept packed in MXFP8, MXFP4 or NVFP4, upcast in registers (mx_kernels.mx.weight_only,
whose docstring gives the layout and the numerics). Fake implementations give the shapes, so torch.compile and
CUDA-graph capture take the kernel as one opaque node; Triton is imported on the first call only.

``use_kernel`` is the rule ``QuantizedLinear`` and ``QuantizedExperts`` follow: the kernel for bf16 activations
on an NVIDIA GPU of compute capability 8.0 or newer (its configs are Hopper's), else the reference (dequantize,
then the GEMM in the activations' dtype). Up to the kernel's FMA_MAX_M rows (per group: decode) the kernel
multiplies on CUDA cores with configs per weight shape, else on tensor cores (``tl.dot_scaled`` for the MX formats
from sm_89 on, a bf16 ``tl.dot`` after the kernel's own upcast for NVFP4). Past ``LARGE_M``
rows (per group) a GEMM is compute-bound (prefill): there ``torch.ops.mx_recipe.dequantize_packed`` writes the
bf16 weight in one kernel, bit for bit the reference's, and cuBLAS multiplies, which beats a tile that also
upcasts.

``torch.ops.mx_recipe.weight_only_tiled_mm`` is the GEMM for a 4-bit weight that ``PackedWeight.tile`` repacked
for Hopper's decode (mx_kernels.gluon.weight_only_tiled), up to LARGE_M rows; ``weight_only_tiled_grouped_mm`` the
grouped one for tiled experts (a token's rows at decode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mx_recipe.library import define
from mx_recipe.ops.device import capability

PACK = {"mxfp8": 1, "mxfp4": 2, "nvfp4": 2}  # elements per code byte along K
LARGE_M = 128  # rows (per group) past which dequantize_packed + cuBLAS runs instead of the weight-only kernel


def _launch(x: Tensor, qdata: Tensor, scale: Tensor, tensor_scale: Tensor | None, fmt: str,
            offs: Tensor | None = None, rows: Tensor | None = None, *, swiglu: bool = False,
            offs_ready: bool = False) -> Tensor:  # fmt: skip
    from mx_kernels.mx.weight_only import weight_only_mm as launch

    return launch(x, qdata, scale, tensor_scale, fmt, offs, rows=rows, swiglu=swiglu, offs_ready=offs_ready)


def _fake(x: Tensor, qdata: Tensor, scale: Tensor, tensor_scale: Tensor | None, fmt: str,
          offs: Tensor | None = None, rows: Tensor | None = None, *, swiglu: bool = False,
          offs_ready: bool = False) -> Tensor:  # fmt: skip
    m = x.shape[0] if rows is None else rows.shape[0]
    n = qdata.shape[-2]
    return x.new_empty((m, n // 2 if swiglu else n), dtype=torch.bfloat16)


define("weight_only_mm(Tensor x, Tensor qdata, Tensor scale, Tensor? tensor_scale, str fmt, *, bool swiglu=False)"
       " -> Tensor", _launch, _fake)  # fmt: skip
define(
    "weight_only_grouped_mm(Tensor x, Tensor qdata, Tensor scale, Tensor? tensor_scale, str fmt, Tensor offs,"
    " Tensor? rows=None, *, bool swiglu=False, bool offs_ready=False) -> Tensor",
    _launch,
    _fake,
)


def _tiled(x: Tensor, words: Tensor, scales: Tensor, tensor_scale: Tensor | None, n: int, fmt: str, wide_scales: bool,
           *, swiglu: bool = False, partials: bool = False) -> Tensor:  # fmt: skip
    from mx_kernels import pdl
    from mx_kernels.gluon.weight_only_tiled import tiled_weight_only_mm

    return tiled_weight_only_mm(x, words, scales, tensor_scale, n, fmt, wide_scales, swiglu, pdl=pdl.enabled(x.device),
                                partials=partials)  # fmt: skip


def _tiled_fake(x: Tensor, words: Tensor, scales: Tensor, tensor_scale: Tensor | None, n: int, fmt: str,
                wide_scales: bool, *, swiglu: bool = False, partials: bool = False) -> Tensor:  # fmt: skip
    if partials:
        from mx_kernels.gluon.weight_only_tiled import partial_splits

        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        if (splits := partial_splits(x.shape[0], n, x.shape[1], sms)) > 1:
            return x.new_empty((splits, x.shape[0], n), dtype=torch.float32)
    return x.new_empty((x.shape[0], n // 2 if swiglu else n), dtype=torch.bfloat16)


define("weight_only_tiled_mm(Tensor x, Tensor words, Tensor scales, Tensor? tensor_scale, int n, str fmt,"
       " bool wide_scales, *, bool swiglu=False, bool partials=False) -> Tensor", _tiled, _tiled_fake)  # fmt: skip


def _tiled_grouped(x: Tensor, words: Tensor, scales: Tensor, tensor_scale: Tensor | None, fmt: str, wide_scales: bool,
                   offs: Tensor, rows: Tensor | None = None, *, swiglu: bool = False,
                   early: int = 0) -> Tensor:  # fmt: skip
    from mx_kernels import pdl
    from mx_kernels.gluon.weight_only_tiled import tiled_weight_only_grouped_mm

    return tiled_weight_only_grouped_mm(x, words, scales, tensor_scale, fmt, wide_scales, offs, rows, swiglu,
                                        pdl=pdl.enabled(x.device), early=early)  # fmt: skip


def _tiled_grouped_fake(x: Tensor, words: Tensor, scales: Tensor, tensor_scale: Tensor | None, fmt: str,
                        wide_scales: bool, offs: Tensor, rows: Tensor | None = None, *,
                        swiglu: bool = False, early: int = 0) -> Tensor:  # fmt: skip
    m = x.shape[0] if rows is None else rows.shape[0]
    return x.new_empty((m, words.shape[1] // 2 if swiglu else words.shape[1]), dtype=torch.bfloat16)


define("weight_only_tiled_grouped_mm(Tensor x, Tensor words, Tensor scales, Tensor? tensor_scale, str fmt,"
       " bool wide_scales, Tensor offs, Tensor? rows=None, *, bool swiglu=False, int early=0) -> Tensor",
       _tiled_grouped, _tiled_grouped_fake)  # fmt: skip


def _dequantize(qdata: Tensor, scale: Tensor, tensor_scale: Tensor | None, fmt: str) -> Tensor:
    from mx_kernels.mx.weight_only import dequantize

    return dequantize(qdata, scale, tensor_scale, fmt)


def _dequantize_fake(qdata: Tensor, scale: Tensor, tensor_scale: Tensor | None, fmt: str) -> Tensor:
    return qdata.new_empty((*qdata.shape[:-1], qdata.shape[-1] * PACK[fmt]), dtype=torch.bfloat16)


define("dequantize_packed(Tensor qdata, Tensor scale, Tensor? tensor_scale, str fmt) -> Tensor", _dequantize,
       _dequantize_fake)  # fmt: skip


def set_tuning(enabled: bool) -> None:
    """Time the kernel's candidate configs once per new GEMM shape and keep the fastest (off, the default: its
    configs by M). The timing runs on the first call of a shape outside CUDA-graph capture."""
    from mx_kernels.mx.weight_only import set_tuning as set_kernel_tuning

    set_kernel_tuning(enabled)


def use_kernel(x: Tensor) -> bool:
    """Whether a GEMM of activations ``x`` runs the weight-only kernel (module doc)."""
    cap = capability(x.device)
    return x.dtype == torch.bfloat16 and cap is not None and cap >= (8, 0)


def swiglu_of(h: Tensor) -> Tensor:
    """SwiGLU's ``F.silu(h1) * h3`` of a GEMM output h [..., 2H] = [h1, h3] (the eager expression: the reference
    of the kernels' ``swiglu`` epilogue)."""
    h1, h3 = h.chunk(2, dim=-1)
    return F.silu(h1) * h3


def weight_only_mm(x: Tensor, qdata: Tensor, scale: Tensor, tensor_scale: Tensor | None, fmt: str,
                   swiglu: bool = False) -> Tensor:  # fmt: skip
    """x [..., K] bf16 @ dequantize(w).T for w packed along K (qdata [N, K / pack], scale [N, K / block]) ->
    [..., N] bf16. ``swiglu``: w is SwiGLU's w1 and w3 concatenated along N, and the output [..., N / 2] is
    silu(x w1^T) * (x w3^T), by the kernel (``swiglu_of`` past LARGE_M)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] > LARGE_M:
        y = F.linear(x, torch.ops.mx_recipe.dequantize_packed(qdata, scale, tensor_scale, fmt))
        return swiglu_of(y) if swiglu else y
    out = torch.ops.mx_recipe.weight_only_mm(x2, qdata, scale, tensor_scale, fmt, swiglu=swiglu)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def tiled_weight_only_mm(x: Tensor, words: Tensor, scales: Tensor, tensor_scale: Tensor | None, n: int, fmt: str,
                         wide_scales: bool, swiglu: bool = False) -> Tensor:  # fmt: skip
    """``weight_only_mm`` for a weight in the tiled layout of Hopper's decode kernel (``PackedWeight.tile``: words,
    scales and tensor scale as mx_kernels.gluon.weight_only_tiled.pack returns them, ``n`` rows), up to LARGE_M
    rows of x; the caller dequantizes past that."""
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.ops.mx_recipe.weight_only_tiled_mm(x2, words, scales, tensor_scale, n, fmt, wide_scales, swiglu=swiglu)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def tiled_weight_only_partials(x: Tensor, words: Tensor, scales: Tensor, tensor_scale: Tensor | None, n: int,
                               fmt: str, wide_scales: bool) -> Tensor:  # fmt: skip
    """``tiled_weight_only_mm`` of rows x [M, K], or where its launch splits K over programs, the splits' fp32 sums
    [splits, M, n] for the consumer to add (mx_kernels.gluon.weight_only_tiled, ``partials``)."""
    return torch.ops.mx_recipe.weight_only_tiled_mm(x, words, scales, tensor_scale, n, fmt, wide_scales, partials=True)


def weight_only_grouped_mm(x: Tensor, qdata: Tensor, scale: Tensor, tensor_scale: Tensor | None, fmt: str,
                           offs: Tensor, rows: Tensor | None = None, swiglu: bool = False,
                           offs_ready: bool = False) -> Tensor:  # fmt: skip
    """x [M, K] bf16, sorted by group with int32 cumulative row ends ``offs`` [E], by w [E, N, K] packed along K:
    group e's rows @ dequantize(w[e]).T -> [M, N] bf16. Only the groups with rows read their weights. ``rows``:
    int32 [M], the groups' rows are x[rows] (x [T, K], the tokens), which the kernel reads in place.
    ``swiglu``: as ``weight_only_mm``'s, per group. ``offs_ready``: ``offs`` and ``rows`` were written before the
    launch right before this one (the small-M kernel reads them before its PDL wait)."""
    if (x.shape[0] if rows is None else rows.shape[0]) > LARGE_M * qdata.shape[0]:
        w = torch.ops.mx_recipe.dequantize_packed(qdata, scale, tensor_scale, fmt)
        y = torch._grouped_mm(x if rows is None else x[rows], w.transpose(-2, -1), offs=offs)
        return swiglu_of(y) if swiglu else y
    return torch.ops.mx_recipe.weight_only_grouped_mm(x, qdata, scale, tensor_scale, fmt, offs, rows, swiglu=swiglu,
                                                      offs_ready=offs_ready)  # fmt: skip


def tiled_weight_only_grouped_mm(x: Tensor, words: Tensor, scales: Tensor, tensor_scale: Tensor | None, fmt: str,
                                 wide_scales: bool, offs: Tensor, rows: Tensor | None = None,
                                 swiglu: bool = False, early: int = 0) -> Tensor:  # fmt: skip
    """``weight_only_grouped_mm`` for experts tiled by ``PackedWeight.tile`` (words [E, N, ...], scales and tensor
    scale as mx_kernels.gluon.weight_only_tiled.pack returns them), up to LARGE_M rows; ``swiglu`` for w1 and w3
    packed in SwiGLU's row order. ``early``: the last groups that hold every token of x in order (folded shared
    experts) and run without waiting for the launch before (the kernel's ``early``)."""
    op = torch.ops.mx_recipe.weight_only_tiled_grouped_mm
    return op(x, words, scales, tensor_scale, fmt, wide_scales, offs, rows, swiglu=swiglu, early=early)
