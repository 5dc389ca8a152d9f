"""MXRecipe: which element format each GEMM of an MX linear uses, the scale rule, the backend."""

from __future__ import annotations

from dataclasses import dataclass, replace

from mx_recipe.formats import ELEM_FORMATS, SCALE_RULES

HIGH_PRECISION = "bf16"  # keep that GEMM in bf16: no casts at all
GEMM_FORMATS = (*ELEM_FORMATS, HIGH_PRECISION)
GRAD_FORMATS = ("e4m3", "e5m2", "e2m1")
# "cublas": torch's MXFP8 block-scaled GEMMs, sm_100 and later (mx_recipe.gemm.validate_backend
# checks the device at startup). "triton" is not built; naming it is an error.
BACKENDS = ("auto", "emulated", "cublas")


@dataclass(frozen=True)
class MXRecipe:
    """Formats of the three GEMMs of ``y = x @ w.T`` (DESIGN.md, "three GEMMs, six casts").

    forward:     y  = x @ w.T   -- element format of x and w (or "bf16")
    grad_input:  gx = g @ w     -- element format of w (or "bf16"); g uses ``grad``
    grad_weight: gw = g.T @ x   -- element format of x (or "bf16"); g uses ``grad``
    """

    name: str = "custom"
    forward: str = "e4m3"
    grad_input: str = "e4m3"
    grad_weight: str = "e4m3"
    grad: str = "e4m3"
    scale_rule: str = "floor"
    backend: str = "auto"
    block_size: int = 32

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
            raise ValueError(
                f"MXRecipe.backend={self.backend!r}: expected one of {list(BACKENDS)} "
                "(the triton backend is not built yet)"
            )
        if self.block_size != 32:
            raise ValueError(f"MXRecipe.block_size={self.block_size}: MX blocks are 32 elements")

    @staticmethod
    def from_name(name: str, **overrides: str) -> MXRecipe:
        if name not in RECIPES:
            raise ValueError(f"unknown MX recipe {name!r}; expected one of {sorted(RECIPES)}")
        return replace(RECIPES[name], **overrides)

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
    )
}
