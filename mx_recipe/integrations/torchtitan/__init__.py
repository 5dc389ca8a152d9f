"""mx_recipe inside torchtitan (``pip install -e .[torchtitan]``): model converters that build our MX
linear and MX grouped GEMM from torchtitan's model configs, on any GPU (emulated) and on sm_100 (cuBLAS).

    torchrun --nproc_per_node=8 -m torchtitan.train \\
        --module mx_recipe.integrations.torchtitan --config llama3_8b_mxfp8

``--module`` points torchtitan's config manager at ``config_registry`` here, whose functions are
torchtitan's own trainer configs with our converters applied (``<torchtitan config>_<recipe>``). In a
config function of your own, ``with_mx(config, "mxfp8")`` or the converters themselves
(``MXLinearConverter``, ``MXGroupedExpertsConverter``) do the same.
"""

from __future__ import annotations

try:
    import torchtitan
except ImportError as e:  # the message is the point
    raise ImportError("mx_recipe.integrations.torchtitan needs torchtitan: pip install -e '.[torchtitan]'") from e

try:
    from mx_recipe.integrations.torchtitan.converters import (
        TORCHTITAN_SKIP,
        MXGroupedExpertsConverter,
        MXLinearConverter,
        TorchTitanMXLinear,
        mx_converters,
        with_mx,
    )
except ImportError as e:  # another torchtitan release, or a torch too old for the one installed
    raise ImportError(
        f"mx_recipe.integrations.torchtitan: torchtitan {getattr(torchtitan, '__version__', '?')} or a module it needs "
        f"did not import ({e}). These converters are written for torchtitan 0.3 (tested with torch 2.13)."
    ) from e

__all__ = [
    "TORCHTITAN_SKIP",
    "MXGroupedExpertsConverter",
    "MXLinearConverter",
    "TorchTitanMXLinear",
    "mx_converters",
    "with_mx",
]
