"""MXRecipe: which element format each GEMM of an MX linear uses, the scale rule, the backend."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any

from mx_recipe.formats.mx import ELEM_FORMATS, ROUNDINGS, SCALE_RULES

HIGH_PRECISION = "bf16"  # keep that GEMM in bf16: no casts at all
GEMM_FORMATS = (*ELEM_FORMATS, HIGH_PRECISION)
GRAD_FORMATS = ("e4m3", "e5m2", "e2m1")
# "cublas": torch's MXFP8 block-scaled GEMMs, sm_100 and later (mx_recipe.ops.backends.resolve_backend
# checks the device at conversion). "triton": tl.dot_scaled, NVIDIA sm_89 and later, dense GEMMs only
# (mx_recipe/ops/gemm.py; "auto" never picks it: on sm_90 it is slower than "emulated").
BACKENDS = ("auto", "emulated", "cublas", "triton")

# Field metadata keys read by mx_recipe.formats.options, which derives train.py's [mx] keys and the torchtitan
# converters' options from these dataclasses.
OPTION = "option"  # a field a run may set on top of a named recipe; the value is its one-line help
SEEDED = "seeded"  # a field set from the run's seed (job.seed in train.py)


def option(default: Any, help: str) -> Any:
    """A recipe field that a run may set on top of a named recipe (an [mx] key), with its one-line help."""
    return dataclasses.field(default=default, metadata={OPTION: help})


# The help of the options both recipe classes have: one option, one line of help.
BACKEND_HELP = "GEMM backend: auto, emulated, cublas (sm_100), triton (MX dense GEMMs only)"
GRAD_ROUNDING_HELP = "how gradients round in the backward GEMMs: nearest, or stochastic (MX: e2m1 gradients only)"


@dataclass(frozen=True)
class MXRecipe:
    """Formats of the three GEMMs of ``y = x @ w.T`` (docs/DESIGN.md, "The MX linear: three GEMMs, six casts").

    forward:     y  = x @ w.T   -- element format of x and w (or "bf16")
    grad_input:  gx = g @ w     -- element format of w (or "bf16"); g uses ``grad``
    grad_weight: gw = g.T @ x   -- element format of x (or "bf16"); g uses ``grad``

    grad_rounding: how g is rounded to ``grad`` in the backward GEMMs: "nearest" (ties to even) or
        "stochastic" (formats/mx.py; unbiased), which needs grad="e2m1": it is for MXFP4 gradients, whose
        1-bit mantissa makes round-to-nearest's bias matter; the fp8 cast kernels round to nearest.
        Random bits come from the default generator of g's device (torch.manual_seed repeats them).
    save_mx_input: save x for backward in MX form, x along M as the grad-weight GEMM quantizes it
        (fp8 + e8m0 scales, about 1.03 bytes per element instead of bf16's 2; e2m1 about 0.53), cast in
        forward, instead of x in bf16. Bit-identical gradients, since that GEMM quantizes x along M
        anyway. Needs an MX grad_weight (with "bf16" the GEMM reads x itself). MXLinear only: the
        MoE grouped GEMM saves x as it is.
    fuse_x_casts: emulated backend, where grad_weight == forward (an MX format) and save_mx_input is off
        (elsewhere it changes nothing). The forward fake-quantizes x along K (its own GEMM) and along M
        (the grad-weight GEMM's operand) in one read of x (``fake_quant_dim0_dim1``) and saves the along-M
        result, bf16, instead of x; backward then does not read x again: 6 bytes an element of x instead
        of 8. Bit-identical gradients. On by default; off, backward casts x along M itself. The MoE grouped
        GEMM does the same with x along M inside token groups (one read where grad_weight == forward).
    fuse_expert_casts: MoE grouped GEMM, emulated backend, where grad_input == forward (an MX format;
        elsewhere it changes nothing). The forward fake-quantizes the expert weights w [E, N, K] along K
        (forward GEMM) and along N (grad-input GEMM) in one read (``fake_quant_dim0_dim1``) and saves the
        along-N result for backward: one read of w fewer per step, at the cost of a bf16 copy of w held
        from forward to backward (turn it off where memory is short). Bit-identical gradients. On by
        default. No effect on MXLinear.
    share_input_casts: an input read by several linears (wq, wk and wv; w1 and w3) is cast once for all of
        them (``linears_on_one_input``), and so is the routed x of the experts' w1 and w3
        (``grouped_mm_on_one_input``). Bit-identical outputs and gradients. On by default.

    The fields made with ``option`` are the options a run sets on top of a named recipe (train.py's [mx]
    keys, the torchtitan converters' fields; mx_recipe.formats.options); the others define the recipe.
    """

    name: str = "custom"
    forward: str = "e4m3"
    grad_input: str = "e4m3"
    grad_weight: str = "e4m3"
    grad: str = "e4m3"
    scale_rule: str = "floor"
    backend: str = option("auto", BACKEND_HELP)
    block_size: int = 32
    grad_rounding: str = option("nearest", GRAD_ROUNDING_HELP)
    save_mx_input: bool = option(False, "save x for backward in MX form (fp8 or e2m1 and scales), not bf16")
    fuse_x_casts: bool = option(True, "emulated: both fake-quants of x in forward, where it applies")
    fuse_expert_casts: bool = option(True, "emulated MoE: both fake-quants of the expert weights in forward")
    share_input_casts: bool = option(True, "one cast of an input read by several linears (wq/wk/wv, w1/w3)")

    def __post_init__(self) -> None:
        for field in ("forward", "grad_input", "grad_weight"):
            value = getattr(self, field)
            if value not in GEMM_FORMATS:
                raise ValueError(f"MXRecipe.{field}={value!r}: expected one of {list(GEMM_FORMATS)}")
        if self.grad not in GRAD_FORMATS:
            raise ValueError(f"MXRecipe.grad={self.grad!r}: expected one of {list(GRAD_FORMATS)}")
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(f"MXRecipe.scale_rule={self.scale_rule!r}: expected one of {list(SCALE_RULES)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"MXRecipe.backend={self.backend!r}: expected one of {list(BACKENDS)}")
        if self.block_size != 32:
            raise ValueError(f"MXRecipe.block_size={self.block_size}: MX blocks are 32 elements")
        if self.grad_rounding not in ROUNDINGS:
            raise ValueError(f"MXRecipe.grad_rounding={self.grad_rounding!r}: expected one of {list(ROUNDINGS)}")
        if self.grad_rounding == "stochastic" and self.grad != "e2m1":
            raise ValueError(
                f"MXRecipe.grad_rounding='stochastic' needs grad='e2m1', got grad={self.grad!r}: stochastic "
                "rounding is for MXFP4 gradients (fp8 gradients round to nearest)"
            )
        if not isinstance(self.save_mx_input, bool):
            raise ValueError(f"MXRecipe.save_mx_input={self.save_mx_input!r}: expected True or False")
        if self.save_mx_input and self.grad_weight == HIGH_PRECISION:
            raise ValueError(
                f"MXRecipe.save_mx_input=True needs an MX grad_weight, got grad_weight={self.grad_weight!r}: "
                "that GEMM reads x in bf16, so x is saved as it is"
            )
        if not isinstance(self.fuse_x_casts, bool):
            raise ValueError(f"MXRecipe.fuse_x_casts={self.fuse_x_casts!r}: expected True or False")
        if not isinstance(self.fuse_expert_casts, bool):
            raise ValueError(f"MXRecipe.fuse_expert_casts={self.fuse_expert_casts!r}: expected True or False")
        if not isinstance(self.share_input_casts, bool):
            raise ValueError(f"MXRecipe.share_input_casts={self.share_input_casts!r}: expected True or False")

    @staticmethod
    def from_name(name: str, **overrides: str | bool) -> MXRecipe:
        if name not in RECIPES:
            raise ValueError(f"unknown MX recipe {name!r}; expected one of {sorted(RECIPES)}")
        return replace(RECIPES[name], **overrides)

    def fuses_x_casts(self, backend: str) -> bool:
        """Whether fuse_x_casts applies on the backend named ``backend`` (see the field)."""
        mx_grad_weight = self.grad_weight == self.forward != HIGH_PRECISION
        return self.fuse_x_casts and backend == "emulated" and mx_grad_weight and not self.save_mx_input

    def grad_elem(self, gemm_format: str) -> str:
        """Element format of the upstream gradient in a backward GEMM of this format."""
        return HIGH_PRECISION if gemm_format == HIGH_PRECISION else self.grad


RECIPES: dict[str, MXRecipe] = {
    r.name: r
    for r in (
        MXRecipe("mxfp8"),
        MXRecipe("mxfp8_rceil", scale_rule="rceil"),
        MXRecipe("mxfp8_wgrad_bf16", grad_weight=HIGH_PRECISION),
        MXRecipe("mxfp8_e5m2_grads", grad="e5m2"),
        MXRecipe("mxfp4", forward="e2m1", grad_input="e2m1", grad_weight="e2m1", grad="e2m1"),
        MXRecipe(
            "mxfp4_sr", forward="e2m1", grad_input="e2m1", grad_weight="e2m1", grad="e2m1", grad_rounding="stochastic"
        ),
    )
}


# "auto": cublas for dense linears on sm_100 (gemm._resolve_nvfp4), emulated elsewhere
NVFP4_BACKENDS = ("auto", "emulated", "cublas")


@dataclass(frozen=True)
class NVFP4Recipe:
    """NVIDIA's NVFP4 training recipe (docs/DESIGN.md, "NVFP4"), each piece an option to ablate.

    All three GEMMs of a linear take NVFP4 operands: 1x16 blocks for activations and gradients, and
    weight_tiles: 16x16 tiles for the weight, so that its forward (along K) and grad-input (along N)
        quantizations are one tensor; off, 1x16 blocks along each GEMM's K;
    hadamard: the grad-weight GEMM's operands (g and x, along the tokens) go through the 16-point
        random Hadamard transform first, whose signs come from ``hadamard_seed`` (train.py uses the
        run's job.seed, so a checkpoint's config.toml fixes them);
    grad_rounding: "stochastic" (the recipe's) or "nearest" for the gradient's casts; x and w round to
        nearest.
    Which layers stay in bf16 (the recipe keeps the last few) is the converter's ``skip``. backend and
    grad_rounding are options (see MXRecipe); hadamard_seed is the run's seed.
    """

    name: str = "nvfp4"
    weight_tiles: bool = True
    hadamard: bool = True
    hadamard_seed: int = dataclasses.field(default=0, metadata={SEEDED: True})
    grad_rounding: str = option("stochastic", GRAD_ROUNDING_HELP)
    backend: str = option("auto", BACKEND_HELP)
    block_size: int = 16

    def __post_init__(self) -> None:
        for field in ("weight_tiles", "hadamard"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"NVFP4Recipe.{field}={getattr(self, field)!r}: expected True or False")
        if not isinstance(self.hadamard_seed, int) or not 0 <= self.hadamard_seed < 2**63:
            raise ValueError(f"NVFP4Recipe.hadamard_seed={self.hadamard_seed!r}: expected an integer >= 0")
        if self.grad_rounding not in ROUNDINGS:
            raise ValueError(f"NVFP4Recipe.grad_rounding={self.grad_rounding!r}: expected one of {list(ROUNDINGS)}")
        if self.backend not in NVFP4_BACKENDS:
            raise ValueError(
                f"NVFP4Recipe.backend={self.backend!r}: expected one of {list(NVFP4_BACKENDS)} (NVFP4 GEMMs are "
                "emulated, or torch._scaled_mm's on sm_100 with 'cublas')"
            )
        if self.block_size != 16:
            raise ValueError(f"NVFP4Recipe.block_size={self.block_size}: NVFP4 blocks are 16 elements")

    @staticmethod
    def from_name(name: str, **overrides: str | bool | int) -> NVFP4Recipe:
        if name not in NVFP4_RECIPES:
            raise ValueError(f"unknown NVFP4 recipe {name!r}; expected one of {sorted(NVFP4_RECIPES)}")
        return replace(NVFP4_RECIPES[name], **overrides)


NVFP4_RECIPES: dict[str, NVFP4Recipe] = {
    r.name: r
    for r in (
        NVFP4Recipe("nvfp4"),
        NVFP4Recipe("nvfp4_no_rht", hadamard=False),
        NVFP4Recipe("nvfp4_1d_weights", weight_tiles=False),
        NVFP4Recipe("nvfp4_nearest_grads", grad_rounding="nearest"),
    )
}
