"""mx-recipe: MX (microscaling) low-precision training recipes for Llama and MoE models.

The public API: ``to_mx`` and ``MXTensor`` (the reference), ``MXRecipe``, ``mx_linear`` / ``MXLinear``,
``mx_grouped_mm`` (MoE experts), ``convert_to_mx``, and the NVFP4 reference ``to_nvfp4`` / ``NVFP4Tensor``. The
last ones are imported on first use: they bring in the MoE grouped GEMM, the converter and the NVFP4 format,
which ``import mx_recipe`` alone does not need.
"""

from __future__ import annotations

import importlib
from typing import Any

from mx_recipe.formats.mx import ELEM_FORMATS, SCALE_RULES, ElemFormat, MXTensor, to_mx
from mx_recipe.formats.recipe import NVFP4_RECIPES, RECIPES, MXRecipe, NVFP4Recipe
from mx_recipe.nn.linear import MXLinear, mx_linear

_LAZY = {
    "convert_to_mx": "mx_recipe.nn.convert",
    "ConversionRecord": "mx_recipe.nn.convert",
    "format_conversion_table": "mx_recipe.nn.convert",
    "mx_grouped_mm": "mx_recipe.nn.grouped",
    "mx_mm": "mx_recipe.ops.gemm",
    "NVFP4Tensor": "mx_recipe.formats.nvfp4",
    "to_nvfp4": "mx_recipe.formats.nvfp4",
}

__all__ = [
    "ELEM_FORMATS",
    "NVFP4_RECIPES",
    "RECIPES",
    "SCALE_RULES",
    "ConversionRecord",
    "ElemFormat",
    "MXLinear",
    "MXRecipe",
    "MXTensor",
    "NVFP4Recipe",
    "NVFP4Tensor",
    "convert_to_mx",
    "format_conversion_table",
    "mx_grouped_mm",
    "mx_linear",
    "mx_mm",
    "to_mx",
    "to_nvfp4",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mx_recipe' has no attribute {name!r}")
