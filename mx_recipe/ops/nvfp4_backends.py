"""The NVFP4 GEMM backends: the three GEMMs of NVIDIA's NVFP4 recipe (docs/DESIGN.md, "NVFP4") behind the same
layer interface as the MX backends (``mx_recipe.ops.backends``).

    forward      y  = x @ w.T   x along K (1x16), w along K (16x16 tiles, or 1x16)
    grad input   gx = g @ w     g along N (1x16, the recipe's rounding), w along N (the same tiles)
    grad weight  gw = g.T @ x   g and x along M, after the random Hadamard transform along M

* ``NVFP4EmulatedBackend``: each operand is ``fake_quant_nvfp4``'s exact e2m1 * scale in the input dtype with its
  per-tensor decode scale; the GEMM runs in that dtype with fp32 accumulation, and its output is multiplied by the
  two decode scales in fp32 (one rounding to the output dtype more than the hardware's fp32 epilogue). Token rows
  are zero-padded to a multiple of 16 for the along-M casts (zero rows add nothing to the grad-weight sum). It
  has the MoE grouped GEMM: along M, each group is padded to a multiple of 16 rows so that no block, and no
  Hadamard block, straddles two experts.
* ``NVFP4CublasBackend``: ``cast_nvfp4`` (packed e2m1, e4m3 block scales) into the layouts torch._scaled_mm takes
  on sm_100, rows padded to 32; its fp32 output times the two decode scales. Its values are the emulated
  backend's, its sums the hardware's. Dense GEMMs only. ``scaled_mm`` replaces the op (tests pass an emulator).

Both read x once in forward for its two operands and save x along M (the grad-weight operand) instead of x, and
read g once in backward for its two.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from mx_recipe.formats.nvfp4 import NVFP4_BLOCK, NVFP4Tensor, random_signs
from mx_recipe.formats.recipe import NVFP4Recipe
from mx_recipe.formats.scale_layout import group_row_sources, padded_group_layout, to_blocked, zero_rows_past_groups
from mx_recipe.ops.nvfp4_cast import cast_nvfp4
from mx_recipe.ops.nvfp4_fake_quant import ROWS, fake_quant_nvfp4, fake_quant_nvfp4_groups

CUBLAS_ROWS = 32  # torch._scaled_mm's K (a.size(1) packed) must be a multiple of 16 bytes: 32 elements


class ScaledOperand(NamedTuple):
    """An emulated NVFP4 operand: e2m1 * block scale in the GEMM's dtype, and the tensor's fp32 decode scale."""

    values: torch.Tensor
    s_dec: torch.Tensor


_SIGNS: dict[tuple[int, torch.device], torch.Tensor] = {}


def signs_for(recipe: NVFP4Recipe, device: torch.device) -> torch.Tensor | None:
    """The signs of the recipe's random Hadamard transform on ``device``, or None without the transform. Made once
    per seed and device: building them is a host-to-device copy, which a CUDA graph cannot capture (a compiled
    graph folds them into a constant instead)."""
    if not recipe.hadamard:
        return None
    if torch.compiler.is_compiling():
        return random_signs(recipe.hadamard_seed, device)
    key = (recipe.hadamard_seed, torch.device(device))
    if key not in _SIGNS:
        _SIGNS[key] = random_signs(*key)
    return _SIGNS[key]


class NVFP4Backend:
    """The NVFP4 recipe's GEMMs over a backend's casts and GEMMs (the subclasses)."""

    name: str
    recipe_type = NVFP4Recipe
    grouped = False
    multiple = NVFP4_BLOCK  # what in and out features must be multiples of

    def check_weight(self, w: torch.Tensor, recipe: NVFP4Recipe) -> None:
        n, k = w.shape
        if k % self.multiple or n % self.multiple:
            raise ValueError(
                f"mx_linear: NVFP4 on the {self.name} backend needs in and out features divisible by {self.multiple}, "
                f"got weight shape {tuple(w.shape)}"
            )

    def shares_input_casts(self, recipe: NVFP4Recipe) -> bool:
        return True  # linears that read one input take the same casts of it: one read of x

    def weight_casts(self, w: torch.Tensor, recipe: NVFP4Recipe, dtype: torch.dtype) -> tuple:
        """w along K and along N, made once for a step (``mx_recipe.nn.weight_casts``)."""
        return self.weight(w, True, recipe, dtype), self.weight(w, False, recipe, dtype)

    def forward(self, x: torch.Tensor, x_k, w: torch.Tensor, recipe: NVFP4Recipe, w_k=None) -> torch.Tensor:
        return self.mm(x_k, self.weight(w, True, recipe, x.dtype) if w_k is None else w_k, x.dtype)

    def load_input(self, saved: tuple[torch.Tensor, ...], form: str, recipe: NVFP4Recipe, dtype: torch.dtype):
        return None, (self.load_saved(saved) if saved else None)

    def grad_input(self, g: torch.Tensor, g_n, w: torch.Tensor, recipe: NVFP4Recipe, w_n=None) -> torch.Tensor:
        return self.mm(g_n, self.weight(w, False, recipe, g.dtype) if w_n is None else w_n, g.dtype)

    def grad_weight(self, g: torch.Tensor, g_m, x: torch.Tensor | None, x_m, recipe: NVFP4Recipe) -> torch.Tensor:
        return self.mm(g_m, x_m, g.dtype)

    def grouped_input_casts(self, x: torch.Tensor, offs: torch.Tensor, recipe: NVFP4Recipe, for_grad_weight: bool):
        return None  # each grouped GEMM casts its x in forward, both orientations from one read

    def grouped_forward(self, x, w, offs, recipe, for_grad_input, for_grad_weight, x_casts=None, w_casts=None):
        raise ValueError(f"NVFP4 backend {self.name!r} has no MoE grouped GEMM; use 'emulated'")

    grouped_backward = grouped_forward


class NVFP4EmulatedBackend(NVFP4Backend):
    """Fake-quant NVFP4 operands, then GEMMs in the input dtype times the per-tensor decode scales."""

    name, grouped = "emulated", True

    def input_casts(self, x: torch.Tensor, recipe: NVFP4Recipe, for_grad_weight: bool, shared: bool = False):
        """x along K and, ``for_grad_weight``, along M after the Hadamard transform, from one read of x."""
        signs = signs_for(recipe, x.device) if for_grad_weight else None
        q = fake_quant_nvfp4(x, along_m=for_grad_weight, signs=signs)
        x_m = ScaledOperand(q.along_m.t(), q.s_dec_m) if for_grad_weight else None
        return ScaledOperand(q.along_k, q.s_dec_k), x_m

    def weight(self, w: torch.Tensor, along_k: bool, recipe: NVFP4Recipe, dtype: torch.dtype) -> ScaledOperand:
        """w [N, K] or [E, N, K] in the recipe's weight blocks, along K ([.., N, K]) or along N (its transpose
        [.., K, N], a view); with 16x16 tiles the same values either way. N is a multiple of 16, so no block
        straddles two experts."""
        w2 = w.to(dtype).reshape(-1, w.shape[-1])
        if along_k or recipe.weight_tiles:
            q = fake_quant_nvfp4(w2, tiles=recipe.weight_tiles)
            values, s_dec = q.along_k.view(w.shape), q.s_dec_k
        else:
            q = fake_quant_nvfp4(w2, along_k=False, along_m=True)
            values, s_dec = q.along_m.view(w.shape), q.s_dec_m
        return ScaledOperand(values if along_k else values.transpose(-2, -1), s_dec)

    def weight_casts(self, w: torch.Tensor, recipe: NVFP4Recipe, dtype: torch.dtype) -> tuple:
        """With 16x16 tiles w along N is w along K transposed (one cast for both); else the two casts."""
        if not recipe.weight_tiles:
            return super().weight_casts(w, recipe, dtype)
        w_k = self.weight(w, True, recipe, dtype)
        return w_k, w_k._replace(values=w_k.values.transpose(-2, -1))

    def save_input(self, x: torch.Tensor, x_m: ScaledOperand | None) -> tuple[tuple[torch.Tensor, ...], str]:
        return (() if x_m is None else tuple(x_m)), "operand"

    def load_saved(self, saved: tuple[torch.Tensor, ...]) -> ScaledOperand:
        return ScaledOperand(*saved)

    def grad_casts(self, g: torch.Tensor, recipe: NVFP4Recipe, need_gx: bool, need_gw: bool):
        """g along N and along M (after the transform, rows zero-padded to 16) from one read of g."""
        q = fake_quant_nvfp4(g, need_gx, need_gw, signs=signs_for(recipe, g.device), rounding=recipe.grad_rounding)
        g_n = ScaledOperand(q.along_k, q.s_dec_k) if need_gx else None
        return g_n, (ScaledOperand(q.along_m.t(), q.s_dec_m) if need_gw else None)

    def mm(self, a: ScaledOperand, b: ScaledOperand, dtype: torch.dtype) -> torch.Tensor:
        """a @ b.T in ``dtype``, times the product of the per-tensor decode scales in fp32."""
        y = torch.mm(a.values.to(dtype), b.values.to(dtype).t())
        return (y.float() * (a.s_dec * b.s_dec)).to(dtype)

    def grouped_mm(self, a: ScaledOperand, b: ScaledOperand, offs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``torch._grouped_mm(a, b)`` in ``dtype``, times the product of the per-tensor decode scales in fp32."""
        y = torch._grouped_mm(a.values.to(dtype), b.values.to(dtype), offs=offs)
        return (y.float() * (a.s_dec * b.s_dec)).to(dtype)

    def grouped_forward(
        self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: NVFP4Recipe, for_grad_input: bool,
        for_grad_weight: bool, x_casts: None = None, w_casts: tuple | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:  # fmt: skip
        """x along K and, for grad weight, along M in the groups padded to 16 (one read); w in the recipe's blocks
        (``w_casts``: made for the step already). Saves x along M instead of x, and the padded layout for
        backward (and w along N, where made already)."""
        dest, padded_offs, size = padded_group_layout(offs, x.shape[0], NVFP4_BLOCK)
        src = group_row_sources(dest, size)
        signs = signs_for(recipe, x.device) if for_grad_weight else None
        q = fake_quant_nvfp4_groups(x, offs, dest, src, along_m=for_grad_weight, signs=signs)
        w_k = self.weight(w, True, recipe, x.dtype) if w_casts is None else w_casts[0]
        w_n = w_casts[1] if w_casts is not None and for_grad_input else ScaledOperand(None, None)
        y = self.grouped_mm(ScaledOperand(q.along_k, q.s_dec_k), w_k._replace(values=w_k.values.transpose(-2, -1)),
                            offs, x.dtype)  # fmt: skip
        x_m = (q.along_m, q.s_dec_m) if for_grad_weight else (None, None)
        return zero_rows_past_groups(y, offs), (w, offs, dest, src, padded_offs, *x_m, *w_n)

    def grouped_backward(
        self, g: torch.Tensor, saved: tuple[torch.Tensor | None, ...], recipe: NVFP4Recipe, need_gx: bool,
        need_gw: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
        w, offs, dest, src, padded_offs, x_along_m, s_x, w_n_values, w_n_s_dec = saved
        dtype = g.dtype
        signs = signs_for(recipe, g.device) if need_gw else None
        q = fake_quant_nvfp4_groups(g, offs, dest, src, need_gx, need_gw, signs, recipe.grad_rounding)
        gx = gw = None
        if need_gx:
            w_n = self.weight(w, False, recipe, dtype) if w_n_values is None else ScaledOperand(w_n_values, w_n_s_dec)
            w_n = w_n._replace(values=w_n.values.transpose(-2, -1))  # [E, N, K]: g_e [M, N] @ w[e]
            gx = zero_rows_past_groups(self.grouped_mm(ScaledOperand(q.along_k, q.s_dec_k), w_n, offs, dtype), offs)
        if need_gw:  # the padded groups: zero rows add nothing to the sums
            g_m = ScaledOperand(q.along_m.t(), q.s_dec_m)
            gw = self.grouped_mm(g_m, ScaledOperand(x_along_m, s_x), padded_offs, dtype)
        return gx, gw


def torch_nvfp4_scaled_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """The real op: a [M, K/2] row-major @ b [K/2, N] column-major, float4_e2m1fn_x2, blocked e4m3 scales of 1x16
    blocks (the NVFP4 recipe, which torch infers from the scales' dtype and count)."""
    return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype)


class NVFP4CublasBackend(NVFP4Backend):
    """Packed NVFP4 operands (``cast_nvfp4``: the kernel on CUDA, the same bits as ``to_nvfp4``), then
    torch._scaled_mm. The grad-weight operands are quantized along M with the token rows zero-padded to 32 (zero
    blocks only) and stored transposed, as the op reads them; forward saves x along M packed (about 0.56 bytes an
    element) instead of x."""

    name, multiple = "cublas", CUBLAS_ROWS

    def __init__(self, scaled_mm: Callable | None = None):
        self.scaled_mm = scaled_mm or torch_nvfp4_scaled_mm

    def input_casts(self, x: torch.Tensor, recipe: NVFP4Recipe, for_grad_weight: bool, shared: bool = False):
        signs = signs_for(recipe, x.device) if for_grad_weight else None
        return cast_nvfp4(x, True, for_grad_weight, signs=signs, pad_m=CUBLAS_ROWS)

    def weight(self, w: torch.Tensor, along_k: bool, recipe: NVFP4Recipe, dtype: torch.dtype) -> NVFP4Tensor:
        """w along K ([N, K/2] packed), or along N (w.T along its K, [K, N/2]); with tiles the same values."""
        t = w.to(dtype)
        return cast_nvfp4(t if along_k else t.t(), tiles=recipe.weight_tiles)[0]

    def save_input(self, x: torch.Tensor, x_m: NVFP4Tensor | None) -> tuple[tuple[torch.Tensor, ...], str]:
        return (() if x_m is None else (x_m.qdata, x_m.scale, x_m.per_tensor_scale)), "packed"

    def load_saved(self, saved: tuple[torch.Tensor, ...]) -> NVFP4Tensor:
        return NVFP4Tensor(*saved, 1, ROWS)

    def grad_casts(self, g: torch.Tensor, recipe: NVFP4Recipe, need_gx: bool, need_gw: bool):
        signs = signs_for(recipe, g.device)
        return cast_nvfp4(g, need_gx, need_gw, signs=signs, rounding=recipe.grad_rounding, pad_m=CUBLAS_ROWS)

    def mm(self, a: NVFP4Tensor, b: NVFP4Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """a [M, K] @ b [N, K].T, both quantized along K: the block-scaled GEMM in fp32, then both per-tensor
        decode scales in fp32 and one rounding to ``out_dtype``."""
        fp4 = torch.float4_e2m1fn_x2
        scale_a, scale_b = to_blocked(a.scale), to_blocked(b.scale)
        out = self.scaled_mm(a.qdata.view(fp4), b.qdata.view(fp4).t(), scale_a, scale_b, torch.float32)
        return (out * (a.per_tensor_scale * b.per_tensor_scale)).to(out_dtype)
