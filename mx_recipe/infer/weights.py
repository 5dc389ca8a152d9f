"""Weights kept quantized for inference: MXFP8, MXFP4 (e8m0 scales per 32) or NVFP4 (e4m3 scales per 16 and an
fp32 tensor scale), packed as the formats define them (mx_recipe.formats), along K, the dim a GEMM reduces over.

``quantize_model`` swaps each ``nn.Linear`` (but the skipped ones: the output layer and the router gates, as the
training converter) for a ``QuantizedLinear`` and each ``GroupedExperts`` for ``QuantizedExperts``. On an NVIDIA
GPU with bf16 activations their GEMM is the weight-only kernel (``mx_recipe.infer.weight_only``): it reads the
packed bytes and upcasts them in registers, so it saves the bandwidth as well as the memory (an MXFP8 weight at one
row: the GEMV of ``mx_recipe.infer.gemv``, which a bf16 one takes there too). Elsewhere, or with
``kernel=False``, it is the reference: dequantize the packed weight to the activations' dtype, then the GEMM,
which the kernel equals up to summation order (and, for NVFP4, one bf16 rounding per weight).
``activations=True`` also quantizes each GEMM's input along K to the same format, as a B200's MX GEMM would read it.

``fuse_projections`` concatenates the linears that read one input along N -- wq, wk, wv of each attention, w1 and
w3 of each feed-forward and of each MoE block's experts -- in every format, bf16 too: a decode step then runs
4 GEMMs a layer, not 7, each reading more bytes at once. The linears' places hold ``FusedPart``s, which
``mx_recipe.models.llama.project`` runs as their ``FusedLinear``'s one GEMM; each output is a view of it. Per
output row the math is the unfused linear's: packed weights keep their scales, NVFP4 each part's tensor scale
(one per row). The outputs equal the unfused ones bit for bit where the GEMM takes the same summation order for
both shapes (the weight-only kernel with the same split of K); otherwise they differ by summation order only.
It also folds an MoE block's shared feed-forward into its experts (``shared_parts``), quantized or bf16, as
groups after the routed ones: a decode step then runs the shared experts inside the routed experts' two grouped
GEMMs, each token in every shared group with weight 1, where they took a GEMM, silu * mul and a GEMM of their
own (``QuantizedExperts.fold_shared``, ``FusedExperts.fold_shared``; ``SharedExpertGroups`` computes them for a
full forward). The bytes are the same; each shared part's output is rounded once before the sum (the unfolded GEMM
rounds their sum).

``tile_weights`` then repacks the dense weights for Hopper's decode GEMM (mx_kernels.gluon.weight_only_tiled: 16-row,
128-element tiles a warp reads as one contiguous run, 1 KB of 4-bit codes or 2 KB of e4m3 ones, each code word's bits
permuted so that a pair upcasts in one to four integer operations): the 4-bit formats' always, MXFP8's where a
decode step runs more than one sequence (at one, the GEMV over the formats' layout is the faster). It replaces the
formats' layout: the weight keeps its bytes; ``dequantize`` (prefill, the reference) reads the tiles in one kernel on
a GPU and unpacks them on a CPU. An MoE's 4-bit experts are tiled too where the step decodes one sequence, each
expert its own tiles: a token's rows run the tiled grouped kernel, a prompt's dequantize each expert (w1/w3 in their
packed row order, SwiGLU taken over it) for cuBLAS's grouped GEMM.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from mx_recipe.formats.mx import BLOCK_SIZE, MXTensor, fake_quant, to_mx
from mx_recipe.formats.nvfp4 import NVFP4_BLOCK, NVFP4Tensor, to_nvfp4
from mx_recipe.infer.fused import silu_mul
from mx_recipe.infer.gemv import MAX_M as GEMV_MAX_M
from mx_recipe.infer.gemv import gemv, grouped_gemv, linear, takes, takes_grouped, use_gemv, use_grouped_gemv
from mx_recipe.infer.weight_only import (
    LARGE_M,
    PACK,
    swiglu_of,
    tiled_weight_only_grouped_mm,
    tiled_weight_only_mm,
    tiled_weight_only_partials,
    use_kernel,
    weight_only_grouped_mm,
    weight_only_mm,
)
from mx_recipe.models.llama import Attention, FeedForward
from mx_recipe.models.moe import GroupedExperts, MoE
from mx_recipe.nn.convert import DEFAULT_SKIP, skip_reason
from mx_recipe.ops.device import capability

# weight format -> MX element format (None: NVFP4)
FORMATS = {"mxfp8": "e4m3", "mxfp4": "e2m1", "nvfp4": None}
WEIGHT_FORMATS = ("bf16", *FORMATS)


def quantize(w: torch.Tensor, fmt: str) -> MXTensor | NVFP4Tensor:
    """``w`` [..., N, K] in ``fmt`` along K (floor scales for MX, as the recipes' default)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(WEIGHT_FORMATS)}")
    elem = FORMATS[fmt]
    return to_nvfp4(w, dim=-1) if elem is None else to_mx(w, elem, "floor", dim=-1)


def quantize_activation(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x along its last dim in ``fmt`` and back, in x's dtype (the emulated MX GEMM's view of its input)."""
    elem = FORMATS[fmt]
    return to_nvfp4(x, dim=-1).dequantize(x.dtype) if elem is None else fake_quant(x, elem, "floor", dim=-1)


class PackedWeight(nn.Module):
    """A quantized weight as buffers (qdata, scale and, for NVFP4, the tensor scale), dequantized on use. ``tile``
    repacks a 4-bit one for Hopper's decode kernel (``tiled``)."""

    tiled = False

    def __init__(self, q: MXTensor | NVFP4Tensor, fmt: str):
        super().__init__()
        self.fmt = fmt
        self.register_buffer("qdata", q.qdata)
        self.register_buffer("scale", q.scale)
        tensor_scale = getattr(q, "per_tensor_scale", None)
        self.register_buffer("tensor_scale", tensor_scale)

    def tile(self, swiglu: bool = False) -> None:
        """Keep the codes and scales in the tiled layout of the weight-only GEMM on Hopper's tensor cores
        (mx_kernels.gluon.weight_only_tiled, ``pack``), in place of the formats' own, for a dense weight or experts
        [E, N, K] (N a multiple of 16: each expert its own tiles; what it takes off a decode step: docs/DESIGN.md,
        Architecture). MXFP8 codes must not be NaN (``pack``).
        ``swiglu``: the weight is w1 and w3 concatenated along N, its rows (each expert's) ordered for the SwiGLU
        epilogue. The tensor scale stays per the original rows (``dequantize``); the kernel's, in the packed order,
        beside it."""
        from mx_kernels.gluon.weight_only_tiled import pack, partials_scale, wide_scales

        if self.tiled or self.qdata.dim() not in (2, 3):
            raise ValueError(f"PackedWeight.tile: a 2D weight or 3D experts not tiled yet, got {self.fmt} "
                             f"{tuple(self.qdata.shape)}{' (tiled)' if self.tiled else ''}")  # fmt: skip
        words, scales, ts = pack(self.qdata, self.scale, self.tensor_scale, self.fmt, swiglu)
        self.rows, self.swiglu_rows, self.wide_scales = self.qdata.shape[-2], swiglu, wide_scales(self.scale, self.fmt)
        self.codes_dtype = self.qdata.dtype
        self.qdata, self.scale = words, scales
        self.register_buffer("tensor_scale_tiled", ts)
        self.register_buffer("partials_scale", partials_scale(ts), persistent=False)  # mm_partials' consumer's
        self.tiled = True

    @property
    def in_features(self) -> int:
        """K: the elements a row of the weight holds."""
        return self.qdata.shape[-1] * PACK[self.fmt] * (4 if self.tiled else 1)  # tiled: int32 words

    def natural_codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(qdata, scale) in the formats' own layout (unpacked if ``tiled``)."""
        if not self.tiled:
            return self.qdata, self.scale
        from mx_kernels.gluon.weight_only_tiled import unpack

        scale_dtype = torch.float8_e4m3fn if self.fmt == "nvfp4" else torch.float8_e8m0fnu
        if self.qdata.dim() == 2:
            codes, scales = unpack(self.qdata, self.scale, self.rows, self.fmt, self.swiglu_rows)
            return codes.view(self.codes_dtype), scales.view(scale_dtype)
        e, n = self.qdata.shape[:2]  # experts: unpacked as one weight in the packed row order, then each's rows
        codes, scales = unpack(self.qdata.reshape(e * n, -1), self.scale.reshape(e * n, -1), e * n, self.fmt)
        codes, scales = self._natural_rows(codes.view(e, n, -1)), self._natural_rows(scales.view(e, n, -1))
        return codes.view(self.codes_dtype), scales.view(scale_dtype)

    def _natural_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Tiled experts' rows [E, N, ...] from the packed order (SwiGLU's, for w1 and w3) back to the formats'."""
        if not self.swiglu_rows:
            return t
        from mx_kernels.gluon.weight_only_tiled import swiglu_rows

        order = swiglu_rows(self.rows).to(t.device)
        return t[:, torch.empty_like(order).scatter_(0, order, torch.arange(self.rows, device=t.device))]

    def _dequantize_tiled(self, dtype: torch.dtype) -> torch.Tensor:
        """A tiled weight on the GPU dequantized in one kernel (mx_kernels.gluon.weight_only_tiled.dequantize);
        experts in each one's packed row order (SwiGLU's: ``_swiglu_packed`` of the GEMM's output)."""
        from mx_kernels.gluon.weight_only_tiled import dequantize

        if self.qdata.dim() == 2:
            return dequantize(self.qdata, self.scale, self.tensor_scale, self.rows, self.fmt, self.swiglu_rows, dtype)
        e, n = self.qdata.shape[:2]
        w = dequantize(self.qdata.reshape(e * n, -1), self.scale.reshape(e * n, -1), self.tensor_scale_tiled, e * n,
                       self.fmt, dtype=dtype)  # fmt: skip
        return w.view(e, n, -1)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.tiled and self.qdata.is_cuda and dtype in (torch.bfloat16, torch.float32):
            w = self._dequantize_tiled(dtype)
            return w if w.dim() == 2 else self._natural_rows(w)
        qdata, scale = self.natural_codes()
        if self.fmt == "nvfp4":
            return NVFP4Tensor(qdata, scale, self.tensor_scale, qdata.dim() - 1).dequantize(dtype)
        return MXTensor(qdata, scale, FORMATS[self.fmt], qdata.dim() - 1).dequantize(dtype)

    def mm(self, x: torch.Tensor, kernel: bool, swiglu: bool = False) -> torch.Tensor:
        """x [..., K] @ w.T: the weight-only kernel where ``use_kernel(x)`` (and ``kernel``; an MXFP8 weight at one
        row: the GEMV of mx_recipe.infer.gemv), else the reference.
        ``swiglu``: w is SwiGLU's w1 and w3 along N, the output silu(x w1^T) * (x w3^T) (``weight_only_mm``). A tiled
        weight past LARGE_M rows (prefill), or asked for another epilogue than its rows are ordered for, is
        dequantized for cuBLAS."""
        if kernel and use_kernel(x):
            if self.fmt == "mxfp8" and not self.tiled and takes(x):  # one row: the GEMV (mx_recipe.infer.gemv)
                return gemv(x, self.qdata, self.scale, swiglu)
            if not self.tiled:
                return weight_only_mm(x, self.qdata, self.scale, self.tensor_scale, self.fmt, swiglu)
            if x.numel() // x.shape[-1] <= LARGE_M and swiglu == self.swiglu_rows:
                return tiled_weight_only_mm(x, self.qdata, self.scale, self.tensor_scale_tiled, self.rows, self.fmt,
                                            self.wide_scales, swiglu)  # fmt: skip
        y = F.linear(x, self.dequantize(x.dtype))
        return swiglu_of(y) if swiglu else y

    def mm_partials(self, x: torch.Tensor, kernel: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``mm(x, kernel)`` for rows x [M, K], as (output, None); or, for a tiled weight whose GEMM splits K over
        programs, (its splits' fp32 sums [splits, M, N], their scale or None) for its consumer to add (the add +
        norm kernel, mx_kernels.decode_fused; the decode attention for q, k and v): the GEMM ends without summing."""
        if kernel and self.tiled and use_kernel(x) and x.shape[0] <= LARGE_M and not self.swiglu_rows:
            y = tiled_weight_only_partials(x, self.qdata, self.scale, self.tensor_scale_tiled, self.rows, self.fmt,
                                           self.wide_scales)  # fmt: skip
            return y, self.partials_scale if y.dim() == 3 else None
        return self.mm(x, kernel), None

    def grouped_mm(self, x: torch.Tensor, offs: torch.Tensor, kernel: bool, rows: torch.Tensor | None = None,
                   swiglu: bool = False, offs_ready: bool = False, early: int = 0) -> torch.Tensor:  # fmt: skip
        """x [M, K] sorted by group (int32 cumulative ends ``offs``) by each group's w [N, K]: [M, N]. ``rows``:
        int32 [M], the groups' rows are x[rows] (the kernel reads them in place). ``swiglu``: as ``mm``'s. The
        weight-only kernel where ``use_kernel(x)`` (and ``kernel``; MXFP8 experts at a token's rows: the grouped
        GEMV of mx_recipe.infer.gemv), else the reference. ``offs_ready``: ``offs`` and ``rows`` were written
        before the launch right before this one (the untiled kernels then read them before their PDL wait).
        ``early``: the last groups hold every token of x in order (folded shared experts), and x was written before
        the launch right before this one: the tiled kernel and the grouped GEMV run them without waiting for it."""
        if self.tiled:
            return self._tiled_grouped_mm(x, offs, kernel, rows, swiglu, early)
        if kernel and use_kernel(x):
            if self.fmt == "mxfp8" and takes_grouped(x, x.shape[0] if rows is None else rows.shape[0]):
                return grouped_gemv(x, self.qdata, offs, rows, self.scale, swiglu, offs_ready, early)  # a token's rows
            return weight_only_grouped_mm(x, self.qdata, self.scale, self.tensor_scale, self.fmt, offs, rows, swiglu,
                                          offs_ready)  # fmt: skip
        x = x if rows is None else x[rows]
        y = torch._grouped_mm(x, self.dequantize(x.dtype).transpose(-2, -1), offs=offs)
        return swiglu_of(y) if swiglu else y

    def _tiled_grouped_mm(self, x: torch.Tensor, offs: torch.Tensor, kernel: bool, rows: torch.Tensor | None,
                          swiglu: bool, early: int = 0) -> torch.Tensor:  # fmt: skip
        """``grouped_mm`` for tiled experts: the tiled grouped kernel up to LARGE_M rows (decode), else (prefill)
        the experts dequantized in their packed row order for cuBLAS's grouped GEMM."""
        if self.qdata.dim() != 3:
            raise ValueError("PackedWeight.grouped_mm: a tiled 2D weight is a dense one")
        m = x.shape[0] if rows is None else rows.shape[0]
        if kernel and use_kernel(x) and m <= LARGE_M and swiglu == self.swiglu_rows:
            return tiled_weight_only_grouped_mm(x, self.qdata, self.scale, self.tensor_scale_tiled, self.fmt,
                                                self.wide_scales, offs, rows, swiglu, early)  # fmt: skip
        x = x if rows is None else x[rows]
        if swiglu and self.swiglu_rows:
            return _swiglu_packed(torch._grouped_mm(x, self._dequantize_tiled(x.dtype).transpose(-2, -1), offs=offs))
        y = torch._grouped_mm(x, self.dequantize(x.dtype).transpose(-2, -1), offs=offs)
        return swiglu_of(y) if swiglu else y

    def last_groups(self, n: int) -> PackedWeight:
        """The last ``n`` groups of experts [E, N, K] (views; tiled ones stay tiled), NVFP4 with their tensor
        scales."""
        e = self.qdata.shape[0]
        part = copy.copy(self)
        part._buffers = {name: None if b is None else _last_groups(b, e, n) for name, b in self._buffers.items()}
        return part

    def nbytes(self) -> int:
        """Bytes the GEMM reads: codes, scales and tensor scale (tiled: the kernel's, not the copy in the original
        row order that ``dequantize`` keeps, nor its copy times 2**8 that ``mm_partials``'s consumer reads in its
        place)."""
        skip = ("tensor_scale", "partials_scale") if self.tiled else ()
        return sum(b.numel() * b.element_size() for name, b in self.named_buffers() if name not in skip)

    @classmethod
    def cat(cls, parts: list[PackedWeight]) -> PackedWeight:
        """``parts`` (one format, same K) concatenated along N (dim -2); NVFP4 keeps each part's tensor scale, as
        one per row of N ([N, 1])."""
        fmt, dim = parts[0].fmt, parts[0].qdata.dim() - 1
        if any(p.tiled for p in parts):
            raise ValueError("PackedWeight.cat: concatenate before tiling")
        if any(p.fmt != fmt or p.qdata.shape[:-2] != parts[0].qdata.shape[:-2] for p in parts):
            raise ValueError("PackedWeight.cat: the parts must share a format and their leading dims")
        qdata = torch.cat([p.qdata for p in parts], dim=-2)
        scale = torch.cat([p.scale for p in parts], dim=-2)
        if fmt != "nvfp4":
            return cls(MXTensor(qdata, scale, FORMATS[fmt], dim), fmt)
        rows = [p.tensor_scale.reshape(-1, 1).expand(p.qdata.shape[-2], 1) for p in parts]
        return cls(NVFP4Tensor(qdata, scale, torch.cat(rows).contiguous(), dim), fmt)


class QuantizedLinear(nn.Module):
    """y = x @ dequantize(w).T with w kept in ``fmt``; ``activations``: x quantized along K first; ``kernel``:
    the weight-only kernel where it runs (False: always the reference)."""

    def __init__(self, linear: nn.Linear, fmt: str, activations: bool = False, kernel: bool = True):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("QuantizedLinear: a linear with a bias is not supported")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_packed = PackedWeight(quantize(linear.weight.detach(), fmt), fmt)
        self.fmt, self.activations, self.kernel = fmt, activations, kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations:
            x = quantize_activation(x, self.fmt)
        return self.weight_packed.mm(x, self.kernel)

    def partials(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward`` of rows x [M, K] and None, or its GEMM's split-K partials and their scale
        (``PackedWeight.mm_partials``)."""
        if self.activations:
            x = quantize_activation(x, self.fmt)
        return self.weight_packed.mm_partials(x, self.kernel)


def _cat_bytes(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` of one 1-byte dtype concatenated along dim 0, in that dtype (CUDA has no cat for e8m0)."""
    return torch.cat([p.view(torch.uint8) for p in parts]).view(parts[0].dtype)


class QuantizedExperts(nn.Module):
    """``GroupedExperts`` with w1, w2, w3 [E, N, K] kept in ``fmt`` (each expert along its K); ``kernel`` as
    ``QuantizedLinear``'s. ``shared``: the shared experts folded in after the routed ones (``fold_shared``)."""

    shared = 0

    @property
    def hidden(self) -> int:
        """Each expert's hidden size (w2's K)."""
        return self.w2_packed.in_features

    def __init__(self, experts: GroupedExperts, fmt: str, activations: bool = False, kernel: bool = True):
        super().__init__()
        for name in ("w1", "w2", "w3"):
            setattr(self, f"{name}_packed", PackedWeight(quantize(getattr(experts, name).detach(), fmt), fmt))
        self.fmt, self.activations, self.kernel = fmt, activations, kernel

    def _mm(self, x: torch.Tensor, packed: PackedWeight, offs: torch.Tensor, rows: torch.Tensor | None = None,
            swiglu: bool = False, offs_ready: bool = False, x_ready: bool = False) -> torch.Tensor:  # fmt: skip
        offs, complete = _all_groups(offs, packed.qdata.shape[0])
        x_ready = x_ready and complete  # else the cat is the launch before, and it writes none of the shared rows
        if self.activations:
            x = quantize_activation(x, self.fmt)  # per row along K: the same rows whether gathered before or after
            x_ready = False  # the launch right before wrote the quantized x
        early = self.shared if x_ready and rows is not None else 0  # the shared groups' rows are the tokens x
        return packed.grouped_mm(x, offs, self.kernel, rows, swiglu, offs_ready, early)

    def fuse(self) -> None:
        """Keep w1 and w3 as one weight [E, 2 * hidden, K] (``w13_packed``): one grouped GEMM for both."""
        self.w13_packed = PackedWeight.cat([self.w1_packed, self.w3_packed])
        del self.w1_packed, self.w3_packed

    def fold_shared(self, ffn: FeedForward, parts: int) -> None:
        """Append the shared feed-forward ``ffn`` (QuantizedLinears of this format, hidden = ``parts`` * the
        experts' hidden) as ``parts`` groups after the routed ones, in place: its hidden units cut in ``parts``
        experts whose outputs sum to its output (SwiGLU is a sum over hidden units). Its packed bytes move as
        they are (w1 and w3 by rows, w2 along K at scale-block bounds): the same quantized weights. A decode step
        then runs the shared experts in the routed experts' two grouped GEMMs, every token in each shared group
        with weight 1 (``moe_route``'s ``shared``), where they took three launches of their own. NVFP4 tensor
        scales become one per group and row ([E + parts, N, 1]): each part keeps its linear's."""
        if not hasattr(self, "w13_packed"):
            self.fuse()
        hidden, pack = self.hidden, PACK[self.fmt]
        group = NVFP4_BLOCK if self.fmt == "nvfp4" else BLOCK_SIZE
        w1, w3, w2 = (getattr(ffn, name).weight_packed for name in ("w1", "w3", "w2"))
        cuts = [slice(i * hidden, (i + 1) * hidden) for i in range(parts)]
        added = {  # per part: codes, scales, tensor scale per row (nvfp4)
            "w13_packed": [
                (torch.cat([w1.qdata[c], w3.qdata[c]]), torch.cat([w1.scale[c], w3.scale[c]]),
                 _cat_rows([_row_scales(w1, hidden), _row_scales(w3, hidden)]))
                for c in cuts
            ],
            "w2_packed": [
                (w2.qdata[:, c.start // pack : c.stop // pack], w2.scale[:, c.start // group : c.stop // group],
                 _row_scales(w2, w2.qdata.shape[0]))
                for c in cuts
            ],
        }  # fmt: skip
        for name, parts_qs in added.items():
            packed = getattr(self, name)
            qdata = _cat_bytes([packed.qdata, *(q[None] for q, _, _ in parts_qs)])
            scale = _cat_bytes([packed.scale, *(sc[None] for _, sc, _ in parts_qs)])
            if self.fmt == "nvfp4":
                rows = packed.qdata.shape[1]
                experts = _row_scales(packed, rows)[None].expand(packed.qdata.shape[0], rows, 1)
                ts = torch.cat([experts, *(t[None] for _, _, t in parts_qs)]).contiguous()
                setattr(self, name, PackedWeight(NVFP4Tensor(qdata, scale, ts, 2), self.fmt))
            else:
                setattr(self, name, PackedWeight(MXTensor(qdata, scale, FORMATS[self.fmt], 2), self.fmt))
        self.shared = parts

    def gate_up(self, x: torch.Tensor, offs: torch.Tensor, routed: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """As ``models.moe.GroupedExperts.gate_up``: w1's and w3's outputs (views of one GEMM's when fused). The
        routed rows are read from x in place (``rows``), not gathered first."""
        rows = routed if routed is None or routed.dtype == torch.int32 else routed.to(torch.int32)
        if hasattr(self, "w13_packed"):
            h1, h3 = self._mm(x, self.w13_packed, offs, rows).chunk(2, dim=-1)
            return h1, h3
        return self._mm(x, self.w1_packed, offs, rows), self._mm(x, self.w3_packed, offs, rows)

    @property
    def fuses_swiglu(self) -> bool:
        """Whether ``swiglu`` runs in the grouped GEMM's epilogue: w1 and w3 fused, on the weight-only kernel."""
        return hasattr(self, "w13_packed") and self.kernel

    def swiglu(self, x: torch.Tensor, offs: torch.Tensor, routed: torch.Tensor | None = None,
               x_ready: bool = False) -> torch.Tensor:  # fmt: skip
        """SwiGLU's ``F.silu(h1) * h3`` of ``gate_up``'s outputs; with w1 and w3 fused and the kernel, in the
        grouped GEMM's epilogue (``weight_only_grouped_mm``'s ``swiglu``: ``silu_mul``'s roundings). ``x_ready``:
        x was written before the launch right before this one (a decode step's routing), so the folded shared
        experts, whose rows are every token, start without waiting for it (tiled experts)."""
        rows = routed if routed is None or routed.dtype == torch.int32 else routed.to(torch.int32)
        if hasattr(self, "w13_packed"):
            return self._mm(x, self.w13_packed, offs, rows, swiglu=True, x_ready=x_ready)
        h1, h3 = self.gate_up(x, offs, routed)
        return F.silu(h1) * h3

    def down(self, h: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """w2 of ``swiglu``'s (or ``gate_up``'s) output h on the same ``offs``, which a launch before h's wrote."""
        return self._mm(h, self.w2_packed, offs, offs_ready=True)

    def forward(self, x: torch.Tensor, offs: torch.Tensor, routed: torch.Tensor | None = None) -> torch.Tensor:
        """As ``models.moe.GroupedExperts``: the groups are x, or x[routed] where the router hands the tokens over.
        SwiGLU by ``swiglu`` where the GEMM fuses it (its roundings are the eager expression's)."""
        if self.fuses_swiglu:
            return self.down(self.swiglu(x, offs, routed), offs)
        h1, h3 = self.gate_up(x, offs, routed)
        return self.down(F.silu(h1) * h3, offs)

    def shared_groups(self, x: torch.Tensor) -> torch.Tensor:
        """The folded shared groups alone on tokens x [T, dim] (every token in each): [shared * T, dim]. Counted
        over all the groups, a prompt's rows looked few per group and ran the weight-only kernel, where past
        LARGE_M rows dequantize + cuBLAS wins."""
        tokens, parts = x.shape[0], self.shared
        w13, w2 = (p.last_groups(parts) for p in (self.w13_packed, self.w2_packed))
        offs = _shared_offs(parts, tokens, x.device)
        rows = torch.arange(tokens, device=x.device, dtype=torch.int32).repeat(parts)
        if self.fuses_swiglu:
            h = self._mm(x, w13, offs, rows, swiglu=True)
        else:
            h1, h3 = self._mm(x, w13, offs, rows).chunk(2, dim=-1)
            h = F.silu(h1) * h3
        return self._mm(h, w2, offs, offs_ready=True)


class FusedExperts(GroupedExperts):
    """bf16 ``GroupedExperts`` with w1 and w3 as one weight ``w13`` [E, 2 * hidden, dim] (``fuse_projections``): one
    grouped GEMM for both, as ``QuantizedExperts.fuse`` makes for packed experts; w2 as it is. At a token's rows on
    a GPU (``use_grouped_gemv``) the grouped GEMMs are the grouped GEMV (mx_recipe.infer.gemv), which reads the
    routed rows from x in place and takes SwiGLU in its epilogue, as the quantized experts' kernel does; elsewhere
    ``torch._grouped_mm``. The shared experts fold in as groups after the routed ones (``fold_shared``)."""

    fuses_swiglu = True
    shared = 0  # shared experts folded in after the routed ones (``fold_shared``)

    def __init__(self, experts: GroupedExperts):
        nn.Module.__init__(self)  # not GroupedExperts': it would allocate a w1 and a w3 only to drop them
        self.w13 = nn.Parameter(torch.cat([experts.w1, experts.w3], dim=1).detach(), requires_grad=False)
        self.w2 = experts.w2

    def fold_shared(self, ffn: FeedForward, parts: int) -> None:
        """Append the shared feed-forward ``ffn`` (bias-free ``nn.Linear``s in the experts' dtype, hidden =
        ``parts`` * the experts' hidden) as ``parts`` groups after the routed ones, in place, as
        ``QuantizedExperts.fold_shared`` does for packed experts: its hidden units cut in ``parts`` experts (w1 and
        w3 by rows, w2 along K), the same weights."""
        hidden = self.w2.shape[-1]
        w1, w3, w2 = (getattr(ffn, name).weight.detach() for name in ("w1", "w3", "w2"))
        cuts = [slice(i * hidden, (i + 1) * hidden) for i in range(parts)]
        w13, w2 = torch.stack([torch.cat([w1[c], w3[c]]) for c in cuts]), torch.stack([w2[:, c] for c in cuts])
        self.w13 = nn.Parameter(torch.cat([self.w13.detach(), w13]), requires_grad=False)
        self.w2 = nn.Parameter(torch.cat([self.w2.detach(), w2]), requires_grad=False)
        self.shared = parts

    def grouped_mm(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        offs, _ = _all_groups(offs, w.shape[0])
        if use_grouped_gemv(x, w, x.shape[0]):
            return grouped_gemv(x, w, offs)
        return super().grouped_mm(x, w, offs)

    def shared_groups(self, x: torch.Tensor) -> torch.Tensor:
        """The folded shared groups alone on tokens x [T, dim] (every token in each): [shared * T, dim]."""
        parts = self.shared
        offs = _shared_offs(parts, x.shape[0], x.device)
        xs = x.repeat(parts, 1)
        h1, h3 = super().grouped_mm(xs, self.w13[-parts:], offs).chunk(2, dim=-1)
        h = silu_mul(h1, h3) if use_kernel(x) else F.silu(h1) * h3
        return super().grouped_mm(h, self.w2[-parts:], offs)

    def down(self, h: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """w2 of ``swiglu``'s (or ``gate_up``'s) output h on the same ``offs``, which a launch before h's wrote."""
        if use_grouped_gemv(h, self.w2, h.shape[0]):
            offs, complete = _all_groups(offs, self.w2.shape[0])
            return grouped_gemv(h, self.w2, offs, offs_ready=complete)
        return super().down(h, offs)

    def _gemv_rows(self, x: torch.Tensor, routed: torch.Tensor | None) -> torch.Tensor | None | bool:
        """``routed`` as the grouped GEMV's int32 rows where it takes them (None: the rows are x), else False."""
        if not use_grouped_gemv(x, self.w13, x.shape[0] if routed is None else routed.shape[0]):
            return False
        return routed if routed is None or routed.dtype == torch.int32 else routed.to(torch.int32)

    def gate_up(self, x: torch.Tensor, offs: torch.Tensor, routed: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """w1's and w3's outputs, views of the one GEMM's."""
        rows = self._gemv_rows(x, routed)
        if rows is False:
            (h,) = self.grouped_mm_on_one_input(x, (self.w13,), offs, routed)
        else:
            h = grouped_gemv(x, self.w13, _all_groups(offs, self.w13.shape[0])[0], rows)
        h1, h3 = h.chunk(2, dim=-1)
        return h1, h3

    def swiglu(self, x: torch.Tensor, offs: torch.Tensor, routed: torch.Tensor | None = None,
               x_ready: bool = False) -> torch.Tensor:  # fmt: skip
        """SwiGLU's ``F.silu(h1) * h3`` of ``gate_up``'s outputs: in the grouped GEMV's epilogue where it runs, else
        by the ``silu_mul`` kernel on a GPU (the same roundings), the eager expression elsewhere. ``x_ready``: x was
        written before the launch right before this one (a decode step's routing), so the folded shared experts'
        rows, every token, start without waiting for it (``grouped_gemv``'s ``early``)."""
        rows = self._gemv_rows(x, routed)
        if rows is not False:
            offs, complete = _all_groups(offs, self.w13.shape[0])
            early = self.shared if x_ready and complete and rows is not None else 0
            return grouped_gemv(x, self.w13, offs, rows, swiglu=True, early=early)
        h1, h3 = self.gate_up(x, offs, routed)
        return silu_mul(h1, h3) if use_kernel(x) else F.silu(h1) * h3


class SharedExpertGroups(nn.Module):
    """An MoE block's shared feed-forward once folded into its experts (``fold_shared``: ``QuantizedExperts``,
    ``FusedExperts``), in its place: the same function of x [..., dim], by the experts' grouped GEMMs over the
    shared groups, each part's output summed in fp32 and rounded once."""

    def __init__(self, experts: QuantizedExperts | FusedExperts):
        super().__init__()
        self._experts = (experts,)  # not a submodule: the block registers the experts once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = self._experts[0]
        x2 = x.reshape(-1, x.shape[-1])
        y = experts.shared_groups(x2)  # [parts * tokens, dim]: each part's output, rounded
        return y.view(experts.shared, x2.shape[0], -1).float().sum(0).to(x.dtype).view(*x.shape[:-1], -1)


def _all_groups(offs: torch.Tensor, groups: int) -> tuple[torch.Tensor, bool]:
    """``offs`` over all ``groups`` groups, and whether it already was: a full forward's routing ends the routed
    groups only, and the folded shared groups after them get no rows (``SharedExpertGroups`` runs them)."""
    if offs.shape[0] == groups:
        return offs, True
    return torch.cat([offs, offs[-1:].expand(groups - offs.shape[0])]), False


def _shared_offs(parts: int, tokens: int, device: torch.device) -> torch.Tensor:
    """The cumulative ends of ``parts`` groups of every one of ``tokens`` tokens (folded shared experts)."""
    return (torch.arange(1, parts + 1, device=device) * tokens).to(torch.int32)


def _cat_rows(scales: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if scales[0] is None else torch.cat(scales)


def _row_scales(packed: PackedWeight, rows: int) -> torch.Tensor | None:
    """An NVFP4 weight's tensor scale (one, or one per row) as one per row [rows, 1]; None for the MX formats."""
    ts = packed.tensor_scale
    return None if ts is None else ts.reshape(-1, 1).expand(rows, 1)


def _last_groups(t: torch.Tensor, e: int, n: int) -> torch.Tensor:
    """The last ``n`` of ``e`` groups of a buffer: its last n along dim 0, or of a flat one per group and row (a
    tiled tensor scale); one value for all stays."""
    if t.numel() == 1:
        return t
    return t[-n:] if t.shape[0] == e else t.view(e, -1)[-n:].reshape(-1)


def _swiglu_packed(h: torch.Tensor) -> torch.Tensor:
    """``swiglu_of`` for a GEMM output whose columns are in SwiGLU's packed row order (each 16: 8 units' gate, then
    their up): the same expression, so the same bits, in the units' order."""
    gate, up = h.view(*h.shape[:-1], -1, 2, 8).unbind(-2)
    return (F.silu(gate) * up).reshape(*h.shape[:-1], -1)


def shared_parts(moe: MoE) -> int:
    """The parts ``fold_shared`` cuts ``moe``'s shared feed-forward in (0: it stays as it is): quantized experts
    and shared linears of one MX format alike (``activations``, ``kernel``), or bf16 experts (``FusedExperts``) and
    bias-free ``nn.Linear``s of their dtype; and a shared hidden size a whole number of the experts' (scale blocks
    whole)."""
    experts, ffn = moe.experts, moe.shared_experts
    if not isinstance(experts, QuantizedExperts | FusedExperts) or experts.shared or not isinstance(ffn, FeedForward):
        return 0
    linears = [getattr(ffn, name) for name in ("w1", "w3", "w2")]
    if isinstance(experts, FusedExperts):
        hidden = experts.w2.shape[-1]
        dtype = experts.w13.dtype
        if any(type(lin) is not nn.Linear or lin.bias is not None or lin.weight.dtype != dtype for lin in linears):
            return 0
    else:
        hidden = experts.hidden
        alike = (experts.fmt, experts.activations, experts.kernel)
        if any(type(lin) is not QuantizedLinear or (lin.fmt, lin.activations, lin.kernel) != alike for lin in linears):
            return 0
    shared_hidden = ffn.w1.out_features
    return shared_hidden // hidden if shared_hidden % hidden == 0 and hidden % BLOCK_SIZE == 0 else 0


class FusedLinear(nn.Module):
    """Linears that read one input, their weights concatenated along N: one GEMM; ``forward`` returns each
    linear's output, a view of it. All ``nn.Linear`` without bias, or all ``QuantizedLinear`` of one format,
    ``activations`` and ``kernel``."""

    def __init__(self, linears: list[nn.Module]):
        super().__init__()
        first = linears[0]
        self.sizes = [lin.out_features for lin in linears]
        self.in_features, self.out_features = first.in_features, sum(self.sizes)
        if all(type(lin) is nn.Linear and lin.bias is None for lin in linears):
            weight = torch.cat([lin.weight.detach() for lin in linears])
            self.weight, self.weight_packed = nn.Parameter(weight, requires_grad=False), None
        elif (
            all(type(lin) is QuantizedLinear for lin in linears)
            and len({(lin.fmt, lin.activations, lin.kernel) for lin in linears}) == 1
        ):
            self.weight_packed = PackedWeight.cat([lin.weight_packed for lin in linears])
            self.fmt, self.activations, self.kernel = first.fmt, first.activations, first.kernel
        else:
            raise ValueError("FusedLinear: the linears must all be nn.Linear (no bias) or QuantizedLinear alike")

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.weight_packed is None:
            y = linear(x, self.weight)
        else:
            y = self.weight_packed.mm(quantize_activation(x, self.fmt) if self.activations else x, self.kernel)
        return list(y.split(self.sizes, dim=-1))

    def partials(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The one GEMM of rows x [M, K] as (output [M, N], None), or as its split-K partials [S, M, N] and their
        scale (``PackedWeight.mm_partials``): each part's columns are its slice of N, as ``forward`` splits them."""
        if self.weight_packed is None:
            return linear(x, self.weight), None
        x = quantize_activation(x, self.fmt) if self.activations else x
        return self.weight_packed.mm_partials(x, self.kernel)

    @property
    def halves(self) -> bool:
        """Whether the fused weight is two parts of one size (SwiGLU's w1 and w3)."""
        return len(self.sizes) == 2 and self.sizes[0] == self.sizes[1]

    @property
    def fuses_swiglu(self) -> bool:
        """Whether ``swiglu`` runs in the GEMM's epilogue: packed w1 and w3 of one size, on the weight-only kernel."""
        return self.weight_packed is not None and self.kernel and self.halves

    def swiglu_in_epilogue(self, x: torch.Tensor) -> bool:
        """Whether ``swiglu(x)`` runs in the GEMM's epilogue: ``fuses_swiglu``, or bf16 w1 and w3 of one size on
        the GEMV kernel (mx_recipe.infer.gemv: a decode step's few rows on a GPU)."""
        if self.weight_packed is not None:
            return self.fuses_swiglu
        return self.halves and use_gemv(x, self.weight)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU's ``F.silu(h1) * h3`` of this fused [w1; w3] (two parts of one size), in the GEMM's epilogue where
        the kernel runs (``silu_mul``'s roundings): the weight-only kernel's for packed weights, the GEMV's for bf16
        ones (``swiglu_in_epilogue``)."""
        if not self.halves:
            raise ValueError(f"FusedLinear.swiglu: needs w1 and w3 of one size, got parts {self.sizes}")
        if self.weight_packed is None:
            return linear(x, self.weight, swiglu=True)
        x = quantize_activation(x, self.fmt) if self.activations else x
        return self.weight_packed.mm(x, self.kernel, swiglu=True)


class FusedPart(nn.Module):
    """Output ``index`` of a ``FusedLinear``, in the place of the linear it was. ``project``
    (mx_recipe.models.llama) runs all the parts of one ``FusedLinear``, in order, as its one GEMM; a part called
    alone runs that GEMM too and keeps its slice."""

    def __init__(self, fused: FusedLinear, index: int):
        super().__init__()
        self._fused = (fused,)  # not a submodule: the FusedLinear is registered once, beside its parts
        self.index = index
        self.in_features, self.out_features = fused.in_features, fused.sizes[index]

    @property
    def fused(self) -> FusedLinear:
        return self._fused[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)[self.index]

    @staticmethod
    def apply_to_shared_input(x: torch.Tensor, parts: tuple[FusedPart, ...]) -> list[torch.Tensor]:
        fused = parts[0].fused
        if len(parts) == len(fused.sizes) and all(p.fused is fused and p.index == i for i, p in enumerate(parts)):
            return fused(x)
        return [p(x) for p in parts]


def _fuse(parent: nn.Module, names: tuple[str, ...], fused_name: str) -> None:
    linears = [getattr(parent, name) for name in names]
    try:
        fused = FusedLinear(linears)
    except ValueError:  # e.g. a skipped linear beside quantized ones: left unfused
        return
    setattr(parent, fused_name, fused)
    for i, name in enumerate(names):
        setattr(parent, name, FusedPart(fused, i))


def fuse_projections(model: nn.Module) -> nn.Module:
    """Fuse the linears of ``model`` that read one input, in place (module doc): each attention's wq, wk, wv as
    ``wqkv``, each feed-forward's w1, w3 as ``w13``, and each MoE block's experts' w1, w3 (``QuantizedExperts.fuse``,
    bf16 ones as ``FusedExperts``), with an MoE block's shared experts folded into its experts where
    ``shared_parts`` allows. After ``quantize_model``, which reads the experts' w1."""
    for module in list(model.modules()):
        if isinstance(module, MoE) and type(module.experts) is GroupedExperts:
            module.experts = FusedExperts(module.experts)
        if isinstance(module, MoE) and (parts := shared_parts(module)):
            module.experts.fold_shared(module.shared_experts, parts)
            module.shared_experts = SharedExpertGroups(module.experts)
    for module in list(model.modules()):
        if isinstance(module, Attention):
            _fuse(module, ("wq", "wk", "wv"), "wqkv")
        elif isinstance(module, FeedForward):
            _fuse(module, ("w1", "w3"), "w13")
        elif isinstance(module, QuantizedExperts) and not hasattr(module, "w13_packed"):
            module.fuse()
    return model


def quantize_model(
    model: nn.Module,
    fmt: str,
    activations: bool = False,
    skip: tuple[str, ...] | list[str] = DEFAULT_SKIP,
    kernel: bool = True,
    output: bool = False,
) -> nn.Module:
    """Swap ``model``'s linears and expert groups for quantized ones in place (``fmt`` "bf16": nothing). What stays
    as it is follows the training converter's rule (``skip_reason``): the ``skip`` patterns, and layers whose
    features are not multiples of 32. ``output``: the output layer too, though ``skip`` names it (it trained in
    high precision, but at one decode row its bf16 weight is a seventh of an 8B model's bytes).
    ``kernel=False``: the reference GEMM even where the kernel runs."""
    if fmt == "bf16":
        return model
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(WEIGHT_FORMATS)}")
    if output:
        skip = tuple(pattern for pattern in skip if pattern != "output")
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            quantized, features = QuantizedLinear, (module.out_features, module.in_features)
        elif isinstance(module, GroupedExperts):
            quantized, features = QuantizedExperts, tuple(module.w1.shape[1:])
        else:
            continue
        if skip_reason(name, features, skip, BLOCK_SIZE) is None:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, quantized(module, fmt, activations, kernel))
    return model


def tile_weights(model: nn.Module, batch: int) -> nn.Module:
    """Repack ``model``'s weights in the tiled layout of the weight-only GEMM on Hopper's tensor cores
    (``PackedWeight.tile``), in place, where they live on an sm_90 GPU and take the kernel, for decoding ``batch``
    sequences at once: MXFP4 and NVFP4 weights, and MXFP8 ones past the GEMV's one row (without NaN codes, which
    the tile cannot hold); SwiGLU's fused w1 and w3 with their rows ordered for its epilogue. An MoE's 4-bit fused
    w1/w3 experts are tiled for one sequence, a token's rows (the tiled grouped kernel); w2, whose K the warps do not
    split evenly (the MoE 16B's 1408: 11 steps), stays on the weight-only kernel's grouped path, which takes less of
    the step (on one H200, the MoE 16B's step with PDL: 7.7 against 9.1 us a layer). Other weights, and other GPUs,
    keep the formats' layout; tiled weights stay tiled (a smaller batch still runs, on the tile)."""
    for module in model.modules():
        if isinstance(module, QuantizedExperts) and module.kernel and batch == 1 and hasattr(module, "w13_packed"):
            w13 = module.w13_packed
            if w13.fmt != "mxfp8" and not w13.tiled and _takes_tiles(w13, w13.qdata.shape[1] % 16 == 0):
                w13.tile(swiglu=True)
            continue
        packed = getattr(module, "weight_packed", None)
        if not isinstance(module, QuantizedLinear | FusedLinear) or packed is None or not module.kernel:
            continue
        if packed.tiled or (packed.fmt == "mxfp8" and batch <= GEMV_MAX_M):
            continue
        swiglu = isinstance(module, FusedLinear) and module.fuses_swiglu
        if not _takes_tiles(packed, not swiglu or packed.qdata.shape[0] % 16 == 0):
            continue
        from mx_kernels.gluon.weight_only_tiled import has_nan_codes

        if packed.fmt != "mxfp8" or not has_nan_codes(packed.qdata):
            packed.tile(swiglu)
    return model


def _takes_tiles(packed: PackedWeight, rows_fit: bool) -> bool:
    """Whether ``packed`` can be tiled: on an sm_90 GPU, K a multiple of 128, its rows as the tile asks."""
    on_hopper = packed.qdata.is_cuda and capability(packed.qdata.device) == (9, 0)
    return on_hopper and packed.in_features % 128 == 0 and rows_fit


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and packed weight of ``model`` (buffers such as RoPE tables left out)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + sum(m.nbytes() for m in model.modules() if isinstance(m, PackedWeight))
