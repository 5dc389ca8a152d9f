"""torchtitan trainer configs with our converters, for ``--module mx_recipe.integrations.torchtitan``.

Each function is ``<torchtitan config>_<recipe>``: torchtitan's own config of that name (model, data,
optimizer, parallelism, as torchtitan ships it) with its model converted by ``with_mx(config, recipe)``.
For example ``--config llama3_8b_mxfp8``, ``--config deepseek_v3_16b_mxfp8_rceil`` or
``--config qwen3_moe_debug_mxfp4``. Command-line overrides (``--training.steps 100``) apply as usual.
"""

from __future__ import annotations

from collections.abc import Callable

from torchtitan.models.deepseek_v3 import config_registry as deepseek_v3
from torchtitan.models.llama3 import config_registry as llama3
from torchtitan.models.qwen3 import config_registry as qwen3

from mx_recipe.formats.recipe import RECIPES
from mx_recipe.integrations.torchtitan.converters import with_mx

BASE_CONFIGS: dict[str, Callable] = {
    "llama3_debugmodel": llama3.llama3_debugmodel,
    "llama3_8b": llama3.llama3_8b,
    "llama3_70b": llama3.llama3_70b,
    "deepseek_v3_debugmodel": deepseek_v3.deepseek_v3_debugmodel,
    "deepseek_v3_16b": deepseek_v3.deepseek_v3_16b,
    "qwen3_moe_debug": qwen3.qwen3_moe_debug,
    "qwen3_30b_a3b": qwen3.qwen3_30b_a3b,
}


def _mx_config(base: Callable, recipe: str) -> Callable:
    def config():
        return with_mx(base(), recipe)

    config.__name__ = config.__qualname__ = f"{base.__name__}_{recipe}"
    config.__doc__ = f"torchtitan's {base.__name__} with its model converted to MX recipe {recipe!r}."
    return config


# One function per (config, recipe): torchtitan's config manager looks them up by name in this module.
for _name, _base in BASE_CONFIGS.items():
    for _recipe in RECIPES:
        globals()[f"{_name}_{_recipe}"] = _mx_config(_base, _recipe)
