"""mx-recipe: MX (microscaling) low-precision training recipes for Llama and MoE models."""

from mx_recipe.convert import ConversionRecord, convert_to_mx, format_conversion_table
from mx_recipe.formats import ELEM_FORMATS, SCALE_RULES, ElemFormat, MXTensor, to_mx
from mx_recipe.gemm import mx_mm
from mx_recipe.linear import MXLinear, mx_linear
from mx_recipe.recipe import RECIPES, MXRecipe

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
    "mx_linear",
    "mx_mm",
    "to_mx",
]
