"""The MX GEMM backends, and the MX recipe's GEMMs of a linear and of the MoE grouped GEMM written once over them.

Each backend casts a GEMM's operands along its K and runs ``a @ b.T`` on them (its primitives: ``cast``,
``cast_both``, ``mm``, and for MoE ``cast_experts``, ``grouped_mm``, ``grouped_mm_along_m``):

* ``EmulatedBackend``: fake-quant casts and a high-precision GEMM with fp32 accumulation, a hardware MX GEMM up
  to summation order, on any device.
* ``CublasBackend``: PyTorch's MXFP8 block-scaled GEMMs on sm_100 (blocked e8m0 scales): ``mx_mm_blocked``,
  ``mx_grouped_mm_2d_3d`` and ``mx_grouped_mm_2d_2d`` of gemm.py. Its ``scaled_mm`` / ``scaled_grouped_mm``
  replace torch's ops (tests pass tests/scaled_mm_emulator.py's).
* ``TritonBackend``: ``tl.dot_scaled`` (``mx_mm_triton``) on NVIDIA sm_89 and later, plain scales, dense only.

``MXBackend``, their base, implements the layer interface of ``mx_recipe.ops.backends`` from the recipe: which
GEMM is MX and in which element format, and where x is cast for the grad-weight GEMM (docs/DESIGN.md, "The MX
linear: three GEMMs, six casts"). ``cast(t, ...)`` quantizes t [R, C] along C; with ``along_rows`` along R, rows
zero-padded to a multiple of 32 (zero rows add nothing to a sum over R), as a [C, ceil32(R)] operand.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from mx_recipe.formats.mx import BLOCK_SIZE, MXTensor, dequantize_along_last
from mx_recipe.formats.recipe import HIGH_PRECISION, MXRecipe
from mx_recipe.formats.scale_layout import (
    group_row_sources,
    pad_groups,
    padded_group_layout,
    zero_rows_past_groups,
)
from mx_recipe.ops.gemm import (
    CUBLAS_GROUPED_OUT_DTYPE,
    ScaledGroupedMM,
    ScaledMM,
    mx_grouped_mm_2d_2d,
    mx_grouped_mm_2d_3d,
    mx_mm_blocked,
    mx_mm_triton,
)
from mx_recipe.ops.mx_cast import (
    BlockedMXTensor,
    cast_3d_dim0,
    cast_3d_dim1,
    cast_dim0,
    cast_dim0_dim1,
    cast_dim1,
    cast_groups_dim1,
    fake_quant_along_m,
    fake_quant_dim0,
    fake_quant_dim0_dim1,
    fake_quant_dim0_groups_along_m,
    fake_quant_groups_along_m,
    fake_quant_routed_groups,
)

MXOperand = MXTensor | BlockedMXTensor
Operand = MXOperand | torch.Tensor  # what a backend's cast gives: an MX tensor, or emulated, a fake-quant
GroupLayout = tuple[torch.Tensor, torch.Tensor, int]  # padded_group_layout: (dest rows, padded ends, size)
InputCasts = tuple[Operand | None, Operand | None]  # x along K (forward GEMM), x along M (grad-weight GEMM)
GroupedInputCasts = tuple[torch.Tensor, torch.Tensor | None]  # the same for a grouped GEMM's x (emulated)


class MXBackend:
    """The MX recipe's GEMMs over a backend's casts and GEMMs (the subclasses)."""

    name: str
    recipe_type = MXRecipe
    grouped = True  # has the MoE grouped GEMM

    # --- the linear: y = x @ w.T; gx = g @ w; gw = g.T @ x ---

    def check_weight(self, w: torch.Tensor, recipe: MXRecipe) -> None:
        n, k = w.shape
        if k % recipe.block_size or n % recipe.block_size:
            raise ValueError(
                f"mx_linear: weight shape {tuple(w.shape)} needs in and out features divisible by {recipe.block_size}"
            )

    def shares_input_casts(self, recipe: MXRecipe) -> bool:
        """Whether linears that read one input share its casts: with share_input_casts, where there is something
        of x to share (a cast along K, or along M for an MX grad-weight GEMM)."""
        return recipe.share_input_casts and (recipe.forward, recipe.grad_weight) != (HIGH_PRECISION,) * 2

    def input_casts(self, x: torch.Tensor, recipe: MXRecipe, for_grad_weight: bool, shared: bool = False) -> InputCasts:
        """x along K, the forward GEMM's operand (None when that GEMM runs in bf16), and x along M, the grad-weight
        GEMM's, where forward makes it: in MX form to save (``save_mx_input``; ``shared`` on an MX-operand backend)
        or as the emulated operand (``fuse_x_casts``; ``shared`` on the emulated backend). ``for_grad_weight``: the
        grad-weight GEMM will run. ``shared``: one cast for several linears that read x (``linears_on_one_input``)."""
        mx_grad_weight = for_grad_weight and recipe.grad_weight != HIGH_PRECISION
        if not shared:
            save_mx = for_grad_weight and recipe.save_mx_input
            return self._input_casts(x, recipe, save_mx, for_grad_weight and recipe.fuses_x_casts(self.name))
        if not mx_grad_weight:
            return self._input_casts(x, recipe, save_mx=False, fuse_x=False)
        if recipe.save_mx_input or self.name != "emulated":
            return self._input_casts(x, recipe, save_mx=True, fuse_x=False)
        if recipe.grad_weight == recipe.forward:
            return self._input_casts(x, recipe, save_mx=False, fuse_x=True)
        x_k, _ = self._input_casts(x, recipe, save_mx=False, fuse_x=False)
        return x_k, self.cast(x, recipe.grad_weight, recipe.scale_rule, x.dtype, along_rows=True)

    def _input_casts(self, x: torch.Tensor, recipe: MXRecipe, save_mx: bool, fuse_x: bool) -> InputCasts:
        elem, rule, dtype = recipe.forward, recipe.scale_rule, x.dtype
        x_k = x_m = None
        if elem != HIGH_PRECISION:
            # One read of x for both orientations. Not for save_mx_input on the emulated backend, whose fused
            # cast gives fake-quants: there the saved x along M is an MX cast of its own (below).
            if fuse_x or (save_mx and self.name != "emulated" and recipe.grad_weight == elem):
                x_k, x_m = self.cast_both(x, elem, rule, dtype)
            else:
                x_k = self.cast(x, elem, rule, dtype)
        if save_mx and x_m is None:
            x_m = self.cast_saved(x, recipe.grad_weight, rule)
        return x_k, x_m

    def weight_casts(
        self, w: torch.Tensor, recipe: MXRecipe, dtype: torch.dtype
    ) -> tuple[Operand | None, Operand | None]:
        """A weight's casts for its GEMMs, made once for a step (``mx_recipe.nn.weight_casts``): w along K (the
        forward GEMM's operand) and along N (grad input's), None for a GEMM in high precision; one read of w where
        both are one format (2D on every backend, 3D experts on the emulated one). The casts each GEMM makes."""
        fwd, grad_input, rule = recipe.forward, recipe.grad_input, recipe.scale_rule
        if fwd != HIGH_PRECISION and fwd == grad_input and (w.dim() == 2 or self.name == "emulated"):
            return self.cast_both(w, fwd, rule, dtype)
        w_k = None if fwd == HIGH_PRECISION else self.cast_experts(w, fwd, rule, dtype)
        w_n = None if grad_input == HIGH_PRECISION else self.cast_experts(w, grad_input, rule, dtype, along_rows=True)
        return w_k, w_n

    def forward(
        self, x: torch.Tensor, x_k: Operand | None, w: torch.Tensor, recipe: MXRecipe, w_k: Operand | None = None
    ) -> torch.Tensor:
        """y = x @ w.T: x along K (``x_k``), w along K (``w_k`` where made already)."""
        if x_k is None:
            return torch.mm(x, w.to(x.dtype).t())
        if w_k is None:
            w_k = self.cast(w, recipe.forward, recipe.scale_rule, x.dtype)
        return self.mm(x_k, w_k, x.dtype)

    def save_input(self, x: torch.Tensor, x_m: Operand | None) -> tuple[tuple[torch.Tensor, ...], str]:
        """What forward keeps of x for backward, and its form: "x" itself, "operand" (x along M as the grad-weight
        GEMM takes it) or "mx" (x along M in MX form, to load as that operand)."""
        if x_m is None:
            return (x,), "x"
        if isinstance(x_m, torch.Tensor):
            return (x_m,), "operand"
        return (x_m.qdata, x_m.scale), "mx"

    def load_input(
        self, saved: tuple[torch.Tensor, ...], form: str, recipe: MXRecipe, dtype: torch.dtype
    ) -> tuple[torch.Tensor | None, Operand | None]:
        """(x, x along M) from ``save_input``'s tensors: one of the two."""
        if form == "mx":
            return None, self.load_saved(*saved, recipe.grad_weight, dtype)
        return (saved[0], None) if form == "x" else (None, saved[0])

    def grad_casts(
        self, g: torch.Tensor, recipe: MXRecipe, need_gx: bool, need_gw: bool
    ) -> tuple[Operand | None, Operand | None]:
        """g along N (grad input) and along M (grad weight, rows zero-padded to 32) for the MX GEMMs that run; one
        read of g for both. Only g rounds with ``grad_rounding``."""
        rule, dtype, rounding = recipe.scale_rule, g.dtype, recipe.grad_rounding
        mx_gx = need_gx and recipe.grad_input != HIGH_PRECISION
        mx_gw = need_gw and recipe.grad_weight != HIGH_PRECISION
        if mx_gx and mx_gw:
            return self.cast_both(g, recipe.grad, rule, dtype, rounding)
        if mx_gx:
            return self.cast(g, recipe.grad, rule, dtype, rounding=rounding), None
        if mx_gw:
            return None, self.cast(g, recipe.grad, rule, dtype, along_rows=True, rounding=rounding)
        return None, None

    def grad_input(
        self, g: torch.Tensor, g_n: Operand | None, w: torch.Tensor, recipe: MXRecipe, w_n: Operand | None = None
    ) -> torch.Tensor:
        """gx = g @ w: g along N (``g_n``), w along N (``w_n`` where made already)."""
        if recipe.grad_input == HIGH_PRECISION:
            return torch.mm(g, w.to(g.dtype))
        if w_n is None:
            w_n = self.cast(w, recipe.grad_input, recipe.scale_rule, g.dtype, along_rows=True)
        return self.mm(g_n, w_n, g.dtype)

    def grad_weight(
        self, g: torch.Tensor, g_m: Operand | None, x: torch.Tensor | None, x_m: Operand | None, recipe: MXRecipe
    ) -> torch.Tensor:
        """gw = g.T @ x: g along M (``g_m``), x along M (``x_m`` when forward made it, else cast from x)."""
        if recipe.grad_weight == HIGH_PRECISION:
            return torch.mm(g.t(), x.to(g.dtype))
        if x_m is None:
            x_m = self.cast(x, recipe.grad_weight, recipe.scale_rule, g.dtype, along_rows=True)
        return self.mm(g_m, x_m, g.dtype)

    # --- the MoE grouped GEMM: group e computes x_e @ w[e].T ---

    def grouped_input_casts(
        self, x: torch.Tensor, offs: torch.Tensor, recipe: MXRecipe, for_grad_weight: bool
    ) -> GroupedInputCasts | None:
        """x's casts for its grouped GEMMs, made in forward: x along K and, where the grad-weight GEMM will run in
        MX and ``fuse_x_casts`` is on, x along M inside each token group, which backward then reads instead of x.
        None where each GEMM casts x itself (a bf16 forward GEMM; the MX-operand backends, whose casts pad the
        token groups). Given to several GEMMs of x (w1 and w3), one set serves all: ``grouped_mm_on_one_input``."""
        return None

    def grouped_forward(
        self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: MXRecipe, for_grad_input: bool,
        for_grad_weight: bool, x_casts: GroupedInputCasts | None = None, w_casts: tuple | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:  # fmt: skip
        """y = x_e @ w[e].T per group (x along K, each w[e] along K) and what backward keeps: x (or x along M, from
        ``x_casts`` or ``grouped_input_casts``), w and, with ``fuse_expert_casts`` (emulated, where grad input
        will run), each w[e] along N from the same read of w. ``w_casts``: ``weight_casts(w)``, made already."""
        elem, rule, dtype = recipe.forward, recipe.scale_rule, x.dtype
        x_k = x_m = None
        w_n = w_casts[1] if w_casts is not None and for_grad_input else None
        if elem == HIGH_PRECISION:
            y = plain_grouped_mm(x, w.transpose(-2, -1), offs, dtype)
        else:
            if w_casts is not None:
                w_k = w_casts[0]
            elif for_grad_input and recipe.fuse_expert_casts and recipe.grad_input == elem and self.name == "emulated":
                w_k, w_n = self.cast_both(w, elem, rule, dtype)
            else:
                w_k = self.cast_experts(w, elem, rule, dtype)
            x_k, x_m = x_casts or self.grouped_input_casts(x, offs, recipe, for_grad_weight) or (None, None)
            y = self.grouped_mm(x, elem, rule, w_k, offs, dtype, a_cast=x_k)
        x_m = x_m if for_grad_weight else None
        saved_x = x if for_grad_weight and x_m is None else None  # the grad-weight GEMM's; grad input needs none
        return zero_rows_past_groups(y, offs), (saved_x, x_m, w, offs, w_n)

    def casts_routed_input(self, recipe: MXRecipe) -> bool:
        """Whether the experts' routed input x[routed] is cast from the tokens x without the routed copy
        (``routed_input_casts``); elsewhere the copy is made and cast as any input."""
        return False

    def grouped_grad_casts(
        self, g: torch.Tensor, recipe: MXRecipe, layout: GroupLayout
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """g along N (grad input) and along M in token groups (grad weight) from one read of g, where both GEMMs
        run in MX; (None, None) where each GEMM casts g itself."""
        return None, None

    def grouped_backward(
        self, g: torch.Tensor, saved: tuple[torch.Tensor | None, ...], recipe: MXRecipe, need_gx: bool, need_gw: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """gx = g_e @ w[e] (g along N, each w[e] along N) and gw[e] = g_e.T @ x_e (g and x along M inside each
        group), in the dtype of g; rows of gx past the groups are zero."""
        x, x_m, w, offs, w_n = saved
        layout = None  # token rows in groups padded to 32: the MX grad-weight GEMM's, shared with grad input
        mx_gx = need_gx and recipe.grad_input != HIGH_PRECISION
        mx_gw = need_gw and recipe.grad_weight != HIGH_PRECISION
        if mx_gw:
            layout = padded_group_layout(offs, g.shape[0], BLOCK_SIZE)
        g_n, g_m = self.grouped_grad_casts(g, recipe, layout) if mx_gx and mx_gw else (None, None)
        gx = gw = None
        rule = recipe.scale_rule
        if need_gx:
            if recipe.grad_input == HIGH_PRECISION:
                gx = plain_grouped_mm(g, w, offs, g.dtype)
            else:
                if w_n is None:
                    w_n = self.cast_experts(w, recipe.grad_input, rule, g.dtype, along_rows=True)
                gx = self.grouped_mm(g, recipe.grad, rule, w_n, offs, g.dtype, recipe.grad_rounding, layout, a_cast=g_n)
            gx = zero_rows_past_groups(gx, offs)
        if need_gw:
            if recipe.grad_weight == HIGH_PRECISION:
                gw = plain_grouped_mm(g.t(), x, offs, g.dtype)
            else:
                gw = self.grouped_mm_along_m(
                    g, recipe.grad, x, recipe.grad_weight, rule, offs, layout, g.dtype, recipe.grad_rounding,
                    g_m=g_m, x_m=x_m,
                )  # fmt: skip
        return gx, gw


# --- the backends' primitives ---


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """Zero rows at the end so that blocks along dim 0 do not run off the tensor."""
    pad = -t.shape[0] % BLOCK_SIZE
    return F.pad(t, (0, 0, 0, pad)) if pad else t


def plain_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``torch._grouped_mm`` in ``dtype``: a GEMM the recipe keeps in high precision, or an emulated one."""
    return torch._grouped_mm(a.to(dtype), b.to(dtype), offs=offs)


class EmulatedBackend(MXBackend):
    """Fake-quant casts, then GEMMs in the input dtype. A cast along rows stays in its input's layout
    and is handed out transposed (a view), so each GEMM takes its operands in the layouts of the
    bf16 backward (gx = g @ w, gw = g.T @ x) and runs as fast as bf16 training's."""

    name = "emulated"

    def cast(
        self, t: torch.Tensor, elem: str, rule: str, dtype: torch.dtype, along_rows: bool = False,
        rounding: str = "nearest",
    ) -> torch.Tensor:  # fmt: skip
        if along_rows:
            return fake_quant_along_m(t, elem, rule, rounding).to(dtype).transpose(-2, -1)
        return fake_quant_dim0(t, elem, rule, rounding).to(dtype)

    def cast_both(
        self, t: torch.Tensor, elem: str, rule: str, dtype: torch.dtype, rounding: str = "nearest"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        along_last, along_rows = fake_quant_dim0_dim1(t, elem, rule, rounding)
        return along_last.to(dtype), along_rows.to(dtype).transpose(-2, -1)

    def cast_saved(self, t: torch.Tensor, elem: str, rule: str) -> MXTensor:
        """t along rows in MX form, to save for backward (save_mx_input); ``load_saved`` makes it the operand."""
        return cast_dim1(_pad_rows(t), elem, rule)

    def load_saved(self, qdata: torch.Tensor, scale: torch.Tensor, elem: str, dtype: torch.dtype) -> torch.Tensor:
        # made contiguous in the input's layout, [ceil32(R), C], as fake_quant_along_m writes it
        return dequantize_along_last(qdata, scale, elem, dtype).t().contiguous().t()

    def mm(self, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return torch.mm(a, b.t())  # both operands already in out_dtype

    cast_experts = cast  # 2D or 3D alike; along rows: along N of each expert

    def grouped_input_casts(
        self, x: torch.Tensor, offs: torch.Tensor, recipe: MXRecipe, for_grad_weight: bool
    ) -> GroupedInputCasts | None:
        elem, rule, dtype = recipe.forward, recipe.scale_rule, x.dtype
        if elem == HIGH_PRECISION or x.shape[0] == 0:
            return None
        if not (for_grad_weight and recipe.grad_weight != HIGH_PRECISION and recipe.fuse_x_casts):
            return self.cast(x, elem, rule, dtype), None
        layout = padded_group_layout(offs, x.shape[0], BLOCK_SIZE)
        src = group_row_sources(layout[0], layout[2])
        if recipe.grad_weight == elem:  # one read of x for both
            x_k, x_m = fake_quant_dim0_groups_along_m(x, src, elem, rule)
            return x_k.to(dtype), x_m.to(dtype)
        return self.cast(x, elem, rule, dtype), fake_quant_groups_along_m(x, src, recipe.grad_weight, rule).to(dtype)

    def casts_routed_input(self, recipe: MXRecipe) -> bool:
        """Whether ``routed_input_casts`` makes x[routed]'s casts from x (x's both casts from one read apply)."""
        return recipe.forward != HIGH_PRECISION and recipe.grad_weight == recipe.forward and recipe.fuse_x_casts

    def routed_input_casts(
        self, x: torch.Tensor, routed: torch.Tensor, offs: torch.Tensor, recipe: MXRecipe
    ) -> GroupedInputCasts:
        """``grouped_input_casts(x[routed], offs, recipe, for_grad_weight=True)``, bit for bit, reading the tokens x
        where the routed rows need them: the routed copy x[routed] is never written."""
        layout = padded_group_layout(offs, routed.shape[0], BLOCK_SIZE)
        src = group_row_sources(layout[0], layout[2])
        x_k, x_m = fake_quant_routed_groups(x, routed, src, recipe.forward, recipe.scale_rule)
        return x_k.to(x.dtype), x_m.to(x.dtype)

    def grouped_grad_casts(
        self, g: torch.Tensor, recipe: MXRecipe, layout: GroupLayout
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if recipe.grad_rounding != "nearest" or g.shape[0] == 0:  # the fused kernel rounds to nearest only
            return None, None
        g_n, g_m = fake_quant_dim0_groups_along_m(
            g, group_row_sources(layout[0], layout[2]), recipe.grad, recipe.scale_rule
        )
        return g_n.to(g.dtype), g_m.to(g.dtype)

    def grouped_mm(
        self, a: torch.Tensor, elem: str, rule: str, w: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype,
        rounding: str = "nearest", layout: GroupLayout | None = None, a_cast: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Token groups a [M, C], cast along C here (or given as ``a_cast``), times per-expert operands w [E, D, C]
        -> [M, D]."""
        if a_cast is None:
            a_cast = self.cast(a, elem, rule, dtype, rounding=rounding)
        return plain_grouped_mm(a_cast, w.transpose(-2, -1), offs, dtype)

    def grouped_mm_along_m(
        self, g: torch.Tensor, g_elem: str, x: torch.Tensor | None, x_elem: str, rule: str, offs: torch.Tensor,
        layout: GroupLayout, dtype: torch.dtype, rounding: str = "nearest", g_m: torch.Tensor | None = None,
        x_m: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Per group e, g_e.T @ x_e -> [E, N, K], both quantized along M in blocks of 32 from each
        group's start (a group's last block as if zero-padded) and left in their own layout: the GEMM
        runs on the bf16 backward's operands and groups, no padded copies and no padding rows. Only
        ``g`` takes ``rounding``. ``g_m``, ``x_m``: those casts, where already made."""
        src = None
        if g_m is None or x_m is None:
            src = group_row_sources(layout[0], layout[2])
        if g_m is None:
            g_m = fake_quant_groups_along_m(g, src, g_elem, rule, rounding).to(dtype)
        if x_m is None:
            x_m = fake_quant_groups_along_m(x, src, x_elem, rule).to(dtype)
        return plain_grouped_mm(g_m.t(), x_m, offs, dtype)


class _HardwareBackend(MXBackend):
    """Casts to MX tensors for a hardware MX GEMM, in the scale layout its kernel reads."""

    blocked: bool

    def cast(
        self, t: torch.Tensor, elem: str, rule: str, dtype: torch.dtype, along_rows: bool = False,
        rounding: str = "nearest",
    ) -> MXOperand:  # fmt: skip
        if along_rows:  # written transposed: [C, ceil32(R)]
            return cast_dim1(_pad_rows(t).to(dtype), elem, rule, blocked_scales=self.blocked, rounding=rounding)
        return cast_dim0(t.to(dtype), elem, rule, blocked_scales=self.blocked, rounding=rounding)

    def cast_both(
        self, t: torch.Tensor, elem: str, rule: str, dtype: torch.dtype, rounding: str = "nearest"
    ) -> tuple[MXOperand, MXOperand]:
        if t.shape[0] % BLOCK_SIZE or rounding != "nearest":  # the fused cast neither pads nor rounds stochastically
            return self.cast(t, elem, rule, dtype, rounding=rounding), self.cast(t, elem, rule, dtype, True, rounding)
        return cast_dim0_dim1(t.to(dtype), elem, rule, blocked_scales=self.blocked)

    def cast_saved(self, t: torch.Tensor, elem: str, rule: str) -> MXOperand:
        return self.cast(t, elem, rule, t.dtype, along_rows=True)


class CublasBackend(_HardwareBackend):
    """fp8 casts with blocked scales, then torch's MXFP8 GEMMs. ``scaled_mm`` / ``scaled_grouped_mm``:
    callables with the signatures of torch's ops to run instead (tests pass an emulator's)."""

    name, blocked = "cublas", True

    def __init__(self, scaled_mm: ScaledMM | None = None, scaled_grouped_mm: ScaledGroupedMM | None = None):
        self.scaled_mm, self.scaled_grouped_mm = scaled_mm, scaled_grouped_mm

    def load_saved(self, qdata: torch.Tensor, scale: torch.Tensor, elem: str, dtype: torch.dtype) -> BlockedMXTensor:
        rows, cols = qdata.shape  # fp8: one element per byte
        return BlockedMXTensor(qdata, scale, elem, 1, (rows, cols // BLOCK_SIZE))

    def mm(self, a: BlockedMXTensor, b: BlockedMXTensor, out_dtype: torch.dtype) -> torch.Tensor:
        return mx_mm_blocked(a, b, out_dtype, self.scaled_mm)

    def cast_experts(self, w: torch.Tensor, elem: str, rule: str, dtype: torch.dtype, along_rows: bool = False):
        """Per expert along K ([E, N, K]) or along N (written [E, K, N]), per-expert blocked scales."""
        return (cast_3d_dim1 if along_rows else cast_3d_dim0)(w, elem, rule, blocked_scales=True)

    def grouped_mm(
        self, a: torch.Tensor, elem: str, rule: str, w: BlockedMXTensor, offs: torch.Tensor, dtype: torch.dtype,
        rounding: str = "nearest", layout: GroupLayout | None = None, a_cast: None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The op takes token groups of multiples of 32 rows only: a's dim0 cast is row-local, so its
        rows are scattered into groups padded to 32 after casting, and the output rows gathered back."""
        dest, padded_offs, _ = layout = layout or padded_group_layout(offs, a.shape[0], BLOCK_SIZE)
        a_padded = _pad_mx_rows(cast_dim0(a, elem, rule, rounding=rounding), layout)
        y = mx_grouped_mm_2d_3d(a_padded, w, padded_offs, CUBLAS_GROUPED_OUT_DTYPE, self.scaled_grouped_mm)
        return y.index_select(0, dest).to(dtype)

    def grouped_mm_along_m(
        self, g: torch.Tensor, g_elem: str, x: torch.Tensor, x_elem: str, rule: str, offs: torch.Tensor,
        layout: GroupLayout, dtype: torch.dtype, rounding: str = "nearest", g_m: None = None, x_m: None = None,
    ) -> torch.Tensor:  # fmt: skip
        # rounding is "nearest": stochastic rounding is for e2m1, which has no cublas path; g_m and x_m are the
        # emulated backend's (this one's grouped_input_casts and grouped_grad_casts give none)
        g_m = _cast_groups_along_m(g, g_elem, rule, layout)  # [N, size]
        x_m = _cast_groups_along_m(x, x_elem, rule, layout)  # [K, size]
        return mx_grouped_mm_2d_2d(g_m, x_m, CUBLAS_GROUPED_OUT_DTYPE, self.scaled_grouped_mm).to(dtype)


class TritonBackend(_HardwareBackend):
    """Casts with plain scales, then ``tl.dot_scaled``. Dense GEMMs only."""

    name, blocked, grouped = "triton", False, False

    def load_saved(self, qdata: torch.Tensor, scale: torch.Tensor, elem: str, dtype: torch.dtype) -> MXTensor:
        return MXTensor(qdata, scale, elem, 1)

    def mm(self, a: MXTensor, b: MXTensor, out_dtype: torch.dtype) -> torch.Tensor:
        return mx_mm_triton(a, b, out_dtype)


# --- the cublas path's token groups ---


def _pad_mx_rows(t: MXTensor, layout: GroupLayout) -> MXTensor:
    """A dim0 cast's rows (data and plain scales) scattered into groups padded to 32 rows; the
    padding rows hold zero elements under scale byte 0 (2**-127), i.e. zeros."""
    dest, _, size = layout
    qdata = pad_groups(t.qdata.view(torch.uint8), dest, size).view(t.qdata.dtype)
    scale = pad_groups(t.scale.view(torch.uint8), dest, size).view(t.scale.dtype)
    return MXTensor(qdata, scale, t.elem, t.dim, t.block_size)


def _cast_groups_along_m(t: torch.Tensor, elem: str, rule: str, layout: GroupLayout) -> BlockedMXTensor:
    """t [M_total, C] along M inside each token group, groups padded to 32 rows: [C, size] with
    per-group blocked scales, grouped by the E padded group ends.

    cast_groups_dim1 wants groups that cover the whole buffer, so the buffer's tail past the last
    padded group goes to it as one more (all-zero) group. Its scale tiles come after every expert's,
    so the GEMM, given the E expert ends, reads the same bytes as without it and never the tail.
    """
    dest, padded_offs, size = layout
    cast_offs = torch.cat([padded_offs, padded_offs.new_full((1,), size)])
    cast = cast_groups_dim1(pad_groups(t, dest, size), cast_offs, elem, rule, blocked_scales=True)
    return dataclasses.replace(cast, group_offs=padded_offs)
