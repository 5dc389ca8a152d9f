"""mx_recipe in torchtitan 0.2.x (the line for torch 2.10 and 2.11): a model converter registered under the name
``mx``, and the ``[mx]`` section of the job config.

    torchrun --nproc_per_node=8 -m torchtitan.train --job.config_file <a torchtitan .toml> \\
        --job.custom_config_module mx_recipe.integrations.torchtitan.registered \\
        --model.converters mx --mx.recipe mxfp8

torchtitan 0.2 builds the model, then converts it in place through the converters that ``model.converters``
names (its ``ModelConverter`` protocol). ``--job.custom_config_module`` imports this module, which registers
``MXModelConverter`` as ``mx`` and adds ``[mx]`` to the job config (``JobConfig`` below, merged into torchtitan's):
the recipe, the skip patterns, torchtitan's ``fqns`` include-list and every recipe option (train.py's [mx] keys,
the 0.3 converters' fields). The conversion is ``convert_to_mx``'s: every ``nn.Linear`` the skip rules let through
becomes an ``MXLinear`` sharing its parameters (state-dict keys and checkpoints unchanged), and every MoE
``GroupedExperts`` becomes its MX subclass, whose three grouped GEMMs run ``mx_grouped_mm`` over token groups of
any size (torchtitan's padding of the groups is not needed). Tensor and expert parallelism are refused (the MX
GEMMs take plain tensors); FSDP2, torch.compile and activation checkpointing work as with the 0.3 converters.
"""

# No ``from __future__ import annotations``: torchtitan merges JobConfig's fields into its own dataclass, and tyro
# reads their types there, where a string "MX" would not resolve.
import functools
from dataclasses import dataclass, field, make_dataclass

import torch
import torch.nn.functional as F
import torchtitan
from torch import nn
from torch.distributed.tensor import DTensor

try:
    from torchtitan.config import JobConfig as TorchTitanJobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.moe.moe import GroupedExperts
    from torchtitan.protocols.model_converter import register_model_converter
    from torchtitan.tools.logging import logger
except ImportError as e:  # torchtitan 0.3 converts configs instead: mx_recipe.integrations.torchtitan's converters
    raise ImportError(
        f"mx_recipe.integrations.torchtitan.registered is for torchtitan 0.2.x; torchtitan "
        f"{getattr(torchtitan, '__version__', '?')} is installed ({e}): use mx_recipe.integrations.torchtitan"
    ) from e

from mx_recipe.formats.options import RECIPE_OPTIONS, RecipeOptionError, recipe_from_options, recipe_option_fields
from mx_recipe.formats.recipe import MXRecipe
from mx_recipe.integrations.torchtitan.common import TORCHTITAN_SKIP, training_device, why_skipped
from mx_recipe.nn.convert import ConversionRecord, format_conversion_table
from mx_recipe.nn.grouped import grouped_mm_on_one_input, mx_grouped_mm
from mx_recipe.nn.linear import MXLinear
from mx_recipe.ops.backends import Backend, resolve_backend

# [mx]: the recipe, the layers to convert, and one field per recipe option, with the recipes' defaults
MX = make_dataclass(
    "MX",
    [
        ("recipe", str, field(default="mxfp8")),
        ("skip", list[str], field(default_factory=lambda: list(TORCHTITAN_SKIP))),
        ("fqns", list[str], field(default_factory=list)),
        *recipe_option_fields(),
    ],
)
MX.__module__ = __name__
MX.__doc__ = """The recipe (an ``mx_recipe.RECIPES`` name), ``skip``: fqn patterns (fnmatch) left in bf16, ``fqns``:
torchtitan's include-list (only fqns containing one of these convert; empty: all), and the recipe options."""


@dataclass
class JobConfig:
    """What ``--job.custom_config_module`` merges into torchtitan's job config: the ``[mx]`` section."""

    mx: MX = field(default_factory=MX)  # type: ignore[valid-type]


class MXExpertsMixin:
    """Marks the MX subclasses of torchtitan's experts classes."""


@functools.cache
def _mx_experts_class(experts_cls: type) -> type:
    """The MX subclass of a torchtitan 0.2 experts class (one per class, so isinstance and pickling work)."""

    class MXExperts(MXExpertsMixin, experts_cls):
        recipe: MXRecipe
        backend: Backend

        def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
            # as torchtitan's grouped path: local weights of DTensors, the GEMMs in bf16, the output in x's dtype
            w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
            offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
            xb = x.bfloat16()
            y1, y3 = grouped_mm_on_one_input(xb, (w1.bfloat16(), w3.bfloat16()), offs, self.recipe, self.backend)
            h = F.silu(y1) * y3
            return mx_grouped_mm(h, w2.bfloat16(), offs, self.recipe, self.backend).type_as(x)

        def extra_repr(self) -> str:
            return f"experts={self.num_experts}, recipe={self.recipe.name}, backend={self.backend.name}"

    MXExperts.__name__ = MXExperts.__qualname__ = f"MX{experts_cls.__name__}"
    return MXExperts


class MXModelConverter:
    """torchtitan 0.2's ``ModelConverter``: the model's linears and MoE experts in the ``[mx]`` recipe."""

    def __init__(self, job_config: TorchTitanJobConfig, parallel_dims: ParallelDims):
        config = getattr(job_config, "mx", None)
        if config is None:
            raise ValueError(
                "model.converters names mx, but the job config has no [mx] section: add "
                "--job.custom_config_module mx_recipe.integrations.torchtitan.registered"
            )
        if config.recipe == "none":
            raise ValueError("mx.recipe 'none' converts nothing: leave mx out of model.converters")
        for what, enabled in (("tensor", parallel_dims.tp_enabled), ("expert", parallel_dims.ep_enabled)):
            if enabled:
                raise ValueError(
                    f"the mx converter does not support {what} parallelism (the MX GEMMs take plain tensors)"
                )
        try:
            self.recipe = recipe_from_options(config.recipe, {key: getattr(config, key) for key in RECIPE_OPTIONS})
        except RecipeOptionError as e:
            raise ValueError(f"mx{'.' + e.key if e.key else ''}: {e}") from None
        self.skip, self.fqns = list(config.skip), list(config.fqns)
        self.records: list[ConversionRecord] = []

    def _why_skipped(self, fqn: str, features: tuple[int, ...]) -> str | None:
        return why_skipped(fqn, features, self.skip, self.fqns, self.recipe.block_size)

    def convert(self, model: nn.Module) -> None:
        """Swap the model's linears and experts in place (the backends are resolved once, here)."""
        self.records = []
        linear_backend = resolve_backend(self.recipe, training_device())
        grouped_backend = None
        for fqn, module in list(model.named_modules()):
            if isinstance(module, MXLinear | MXExpertsMixin):  # converted already
                shape = tuple((module.weight if isinstance(module, MXLinear) else module.w1).shape)
                self.records.append(ConversionRecord(fqn, shape, True, f"already {module.recipe.name}"))
            elif isinstance(module, nn.Linear):
                shape = (module.out_features, module.in_features)
                skipped = self._why_skipped(fqn, shape)
                if skipped is None:
                    parent, _, child = fqn.rpartition(".")
                    setattr(
                        model.get_submodule(parent), child, MXLinear.from_linear(module, self.recipe, linear_backend)
                    )
                self.records.append(self._record(fqn, shape, skipped, linear_backend))
            elif isinstance(module, GroupedExperts):
                shape = tuple(module.w1.shape)
                skipped = self._why_skipped(fqn, shape[1:])
                if skipped is None:
                    grouped_backend = grouped_backend or resolve_backend(self.recipe, training_device(), grouped=True)
                    module.__class__ = _mx_experts_class(type(module))
                    module.recipe, module.backend = self.recipe, grouped_backend
                self.records.append(self._record(fqn, shape, skipped, grouped_backend))
        logger.info(f"mx converter ({self.recipe.name}):\n{format_conversion_table(self.records)}")

    def _record(self, fqn: str, shape: tuple[int, ...], skipped: str | None, backend) -> ConversionRecord:
        if skipped is not None:
            return ConversionRecord(fqn, shape, False, skipped)
        return ConversionRecord(fqn, shape, True, f"converted: {self.recipe.name}", backend.name)

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        pass  # the casts are made from the weights at each GEMM: nothing to refresh after a step


register_model_converter(MXModelConverter, "mx")
