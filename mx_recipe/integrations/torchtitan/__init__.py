"""mx_recipe inside torchtitan (``pip install -e .[torchtitan]``): model converters that build our MX
linear and MX grouped GEMM from torchtitan's model configs, on any GPU (emulated) and on sm_100 (cuBLAS).

    torchrun --nproc_per_node=8 -m torchtitan.train \\
        --module mx_recipe.integrations.torchtitan --config llama3_8b_mxfp8

``--module`` points torchtitan's config manager at ``config_registry`` here, whose functions are
torchtitan's own trainer configs with our converters applied (``<torchtitan config>_<recipe>``). In a
config function of your own, ``with_mx(config, "mxfp8")`` or the converters themselves
(``MXLinearConverter``, ``MXGroupedExpertsConverter``) do the same. That is torchtitan 0.3; with torchtitan 0.2.x
(torch 2.10, 2.11) the converter is registered by name (``registered``):

    torchrun --nproc_per_node=8 -m torchtitan.train --job.config_file <a torchtitan .toml> \\
        --job.custom_config_module mx_recipe.integrations.torchtitan.registered --model.converters mx --mx.recipe mxfp8
"""

from __future__ import annotations

import importlib.util

try:
    import torchtitan
except ImportError as e:  # the message is the point
    raise ImportError("mx_recipe.integrations.torchtitan needs torchtitan: pip install -e '.[torchtitan]'") from e

if importlib.util.find_spec("torchtitan.protocols.model_converter") is not None:  # 0.2.x: converters by name
    from mx_recipe.integrations.torchtitan.registered import TORCHTITAN_SKIP, JobConfig, MXModelConverter

    __all__ = ["TORCHTITAN_SKIP", "JobConfig", "MXModelConverter"]
else:
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
            f"mx_recipe.integrations.torchtitan: torchtitan {getattr(torchtitan, '__version__', '?')} or a module it "
            f"needs did not import ({e}). These converters are written for torchtitan 0.3 (tested with torch 2.13) "
            "and 0.2.x (mx_recipe.integrations.torchtitan.registered)."
        ) from e

    __all__ = [
        "TORCHTITAN_SKIP",
        "MXGroupedExpertsConverter",
        "MXLinearConverter",
        "TorchTitanMXLinear",
        "mx_converters",
        "with_mx",
    ]
