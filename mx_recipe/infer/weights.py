"""Weights kept quantized for inference: MXFP8, MXFP4 (e8m0 scales per 32) or NVFP4 (e4m3 scales per 16 and an
fp32 tensor scale), packed as the formats define them (mx_recipe.formats), along K, the dim a GEMM reduces over.

``quantize_model`` swaps each ``nn.Linear`` (but the skipped ones: the output layer and the router gates, as the
training converter) for a ``QuantizedLinear`` and each ``GroupedExperts`` for ``QuantizedExperts``. On an NVIDIA
GPU with bf16 activations their GEMM is the weight-only kernel (``mx_recipe.infer.weight_only``): it reads the
packed bytes and upcasts them in registers, so it saves the bandwidth as well as the memory. Elsewhere, or with
``kernel=False``, it is the reference: dequantize the packed weight to the activations' dtype, then the GEMM,
which the kernel equals up to summation order (and, for NVFP4, one bf16 rounding per weight).
``activations=True`` also quantizes each GEMM's input along K to the same format, as a B200's MX GEMM would read it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mx_recipe.formats.mx import BLOCK_SIZE, MXTensor, fake_quant, to_mx
from mx_recipe.formats.nvfp4 import NVFP4Tensor, to_nvfp4
from mx_recipe.infer.weight_only import use_kernel, weight_only_grouped_mm, weight_only_mm
from mx_recipe.models.moe import GroupedExperts
from mx_recipe.nn.convert import DEFAULT_SKIP, skip_reason

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
    """A quantized weight as buffers (qdata, scale and, for NVFP4, the tensor scale), dequantized on use."""

    def __init__(self, q: MXTensor | NVFP4Tensor, fmt: str):
        super().__init__()
        self.fmt = fmt
        self.register_buffer("qdata", q.qdata)
        self.register_buffer("scale", q.scale)
        tensor_scale = getattr(q, "per_tensor_scale", None)
        self.register_buffer("tensor_scale", tensor_scale)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.fmt == "nvfp4":
            return NVFP4Tensor(self.qdata, self.scale, self.tensor_scale, self.qdata.dim() - 1).dequantize(dtype)
        return MXTensor(self.qdata, self.scale, FORMATS[self.fmt], self.qdata.dim() - 1).dequantize(dtype)

    def mm(self, x: torch.Tensor, kernel: bool) -> torch.Tensor:
        """x [..., K] @ w.T: the weight-only kernel where ``use_kernel(x)`` (and ``kernel``), else the reference."""
        if kernel and use_kernel(x):
            return weight_only_mm(x, self.qdata, self.scale, self.tensor_scale, self.fmt)
        return F.linear(x, self.dequantize(x.dtype))

    def grouped_mm(self, x: torch.Tensor, offs: torch.Tensor, kernel: bool) -> torch.Tensor:
        """x [M, K] sorted by group (int32 cumulative ends ``offs``) by each group's w [N, K]: [M, N]."""
        if kernel and use_kernel(x):
            return weight_only_grouped_mm(x, self.qdata, self.scale, self.tensor_scale, self.fmt, offs)
        return torch._grouped_mm(x, self.dequantize(x.dtype).transpose(-2, -1), offs=offs)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


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


class QuantizedExperts(nn.Module):
    """``GroupedExperts`` with w1, w2, w3 [E, N, K] kept in ``fmt`` (each expert along its K); ``kernel`` as
    ``QuantizedLinear``'s."""

    def __init__(self, experts: GroupedExperts, fmt: str, activations: bool = False, kernel: bool = True):
        super().__init__()
        for name in ("w1", "w2", "w3"):
            setattr(self, f"{name}_packed", PackedWeight(quantize(getattr(experts, name).detach(), fmt), fmt))
        self.fmt, self.activations, self.kernel = fmt, activations, kernel

    def _mm(self, x: torch.Tensor, packed: PackedWeight, offs: torch.Tensor) -> torch.Tensor:
        if self.activations:
            x = quantize_activation(x, self.fmt)
        return packed.grouped_mm(x, offs, self.kernel)

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        h = F.silu(self._mm(x, self.w1_packed, offs)) * self._mm(x, self.w3_packed, offs)
        return self._mm(h, self.w2_packed, offs)


def quantize_model(
    model: nn.Module,
    fmt: str,
    activations: bool = False,
    skip: tuple[str, ...] | list[str] = DEFAULT_SKIP,
    kernel: bool = True,
) -> nn.Module:
    """Swap ``model``'s linears and expert groups for quantized ones in place (``fmt`` "bf16": nothing). What stays
    as it is follows the training converter's rule (``skip_reason``): the ``skip`` patterns, and layers whose
    features are not multiples of 32. ``kernel=False``: the reference GEMM even where the kernel runs."""
    if fmt == "bf16":
        return model
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(WEIGHT_FORMATS)}")
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


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and packed weight of ``model`` (buffers such as RoPE tables left out)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + sum(m.nbytes() for m in model.modules() if isinstance(m, PackedWeight))
