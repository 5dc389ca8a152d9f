"""mx-recipe: MX (microscaling) low-precision training recipes for Llama and MoE models.

The public API: ``to_mx`` and ``MXTensor`` (the reference), ``MXRecipe``, ``mx_linear`` / ``MXLinear``,
``mx_grouped_mm`` (MoE experts) and ``convert_to_mx``. The last two are imported on first use: they bring in
the MoE grouped GEMM and the converter, which ``import mx_recipe`` alone does not need.
"""

from __future__ import annotations

import importlib
from typing import Any

from mx_recipe.formats import ELEM_FORMATS, SCALE_RULES, ElemFormat, MXTensor, to_mx
from mx_recipe.linear import MXLinear, mx_linear
from mx_recipe.recipe import RECIPES, MXRecipe

_LAZY = {
    "convert_to_mx": "mx_recipe.convert",
    "ConversionRecord": "mx_recipe.convert",
    "format_conversion_table": "mx_recipe.convert",
    "mx_grouped_mm": "mx_recipe.grouped",
    "mx_mm": "mx_recipe.gemm",
}

__all__ = [
    "ELEM_FORMATS",
    "RECIPES",
    "SCALE_RULES",
    "ConversionRecord",
    "ElemFormat",
    "MXLinear",
    "MXRecipe",
    "MXTensor",
    "convert_to_mx",
    "format_conversion_table",
    "mx_grouped_mm",
    "mx_linear",
    "mx_mm",
    "to_mx",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mx_recipe' has no attribute {name!r}")
