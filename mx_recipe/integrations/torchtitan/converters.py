"""torchtitan model converters that build our MX layers (torchtitan 0.3: ``ModelConfigConverter``).

A torchtitan converter rewrites the model's config tree before the model is built. ``MXLinearConverter``
swaps each ``Linear.Config`` for ``TorchTitanMXLinear.Config``, whose module is our ``MXLinear`` (same
parameters, so state-dict keys and checkpoints are unchanged). ``MXGroupedExpertsConverter`` gives each
experts config (``GroupedExperts`` and its subclasses, 3D weights ``w1_EFD``, ``w2_EDF``, ``w3_EFD``: our
[E, N, K] layout) a subclass whose ``_grouped_mm`` runs our ``mx_grouped_mm``. Which layers convert follows
``convert_to_mx``: ``skip`` patterns (default: the output projection and router gates, by torchtitan's
names) and features that are multiples of 32; ``fqns`` is torchtitan's own include-list (substrings).

Unlike torchtitan's MXFP8 converters (torchao, sm_100 only), these run on any device: the backend
resolves as in ``convert_to_mx`` (emulated on Hopper and the CPU, cuBLAS on sm_100 for e4m3), and any
recipe of ``mx_recipe.RECIPES`` applies, with the recipe options of ``mx_recipe.formats.options`` (the keys
of train.py's [mx] section) as fields of the converters' config. Token groups of any
size are fine, so torchtitan's token dispatcher is left as it is (no padding to 32 rows). Tensor
parallelism is not supported (the MX GEMMs take plain tensors); FSDP2, torch.compile and activation
checkpointing are.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field, fields, make_dataclass

import torch
from torch import nn
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.utils import validate_converter_order
from torchtitan.tools.logging import logger

from mx_recipe.formats.options import RECIPE_OPTIONS, RecipeOptionError, recipe_from_options, recipe_option_fields
from mx_recipe.formats.recipe import MXRecipe
from mx_recipe.integrations.torchtitan.common import TORCHTITAN_SKIP, training_device, why_skipped
from mx_recipe.nn.convert import ConversionRecord, format_conversion_table
from mx_recipe.nn.grouped import mx_grouped_mm
from mx_recipe.nn.linear import MXLinear
from mx_recipe.ops.backends import resolve_backend


def _default_recipe() -> MXRecipe:
    return MXRecipe.from_name("mxfp8")


def _replace(model_config, parent, attr, new_config):
    """Put ``new_config`` where traverse() found a config; returns the (possibly new) root."""
    if parent is None:
        return new_config
    if isinstance(parent, list):
        parent[attr] = new_config
    else:
        setattr(parent, attr, new_config)
    return model_config


class TorchTitanMXLinear(MXLinear, Linear):
    """Our ``MXLinear``, built by torchtitan from its config (torchtitan's ``Linear`` protocol: param_init,
    sharding_config). The backend is resolved once, when the module is built."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        recipe: MXRecipe = field(default_factory=_default_recipe)

    def __init__(self, config: Config):
        nn.Linear.__init__(self, config.in_features, config.out_features, bias=config.bias)
        self.recipe, self.backend = config.recipe, resolve_backend(config.recipe, training_device())


@functools.cache
def _mx_experts_class(experts_cls: type) -> type:
    """The MX subclass of a torchtitan experts class (one per class, so isinstance and pickling work)."""

    class MXExperts(experts_cls):
        @dataclass(kw_only=True, slots=True)
        class Config(experts_cls.Config):
            recipe: MXRecipe = field(default_factory=_default_recipe)

        def __init__(self, config):
            super().__init__(config)
            self.recipe = config.recipe
            self.backend = resolve_backend(config.recipe, training_device(), grouped=True)

        def _grouped_mm(self, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
            # torchtitan passes w[E, N, K] transposed; ours takes w itself
            return mx_grouped_mm(A, B_t.transpose(-2, -1), offs, self.recipe, self.backend)

        def extra_repr(self) -> str:
            return f"experts={self.num_experts}, recipe={self.recipe.name}, backend={self.backend.name}"

    MXExperts.__name__ = MXExperts.__qualname__ = f"MX{experts_cls.__name__}"
    MXExperts.Config.__qualname__ = f"MX{experts_cls.__name__}.Config"
    return MXExperts


# The converters' config: the recipe, the layers to convert, and one field per recipe option (train.py's [mx]
# keys), generated from the recipe dataclasses with their defaults; each field's help is in its metadata.
_MXConverterConfig = make_dataclass(
    "Config",
    [
        ("recipe", str, field(default="mxfp8", metadata={"help": "an MXRecipe name (mx_recipe.RECIPES)"})),
        (
            "skip",
            list[str],
            field(
                default_factory=lambda: list(TORCHTITAN_SKIP), metadata={"help": "fqn patterns (fnmatch) left in bf16"}
            ),
        ),
        (
            "fqns",
            list[str],
            field(
                default_factory=list,
                metadata={"help": "torchtitan's include-list: only fqns containing one of these convert (empty: all)"},
            ),
        ),
        *recipe_option_fields(),
    ],
    bases=(QuantizationConverter.Config,),
    kw_only=True,
    slots=True,  # torchtitan's Configurable requires both
)


class _MXConverter(QuantizationConverter):
    """What both converters share: the recipe (train.py's [mx] keys), the skip rules and the table."""

    Config = _MXConverterConfig
    Config.__module__, Config.__qualname__ = __name__, "_MXConverter.Config"  # for pickle and repr

    grouped = False  # whether the converted layers are grouped GEMMs (for resolving the backend)

    def __init__(self, config: Config):
        self.config = config
        if config.recipe == "none":
            raise ValueError(f"{type(self).__name__}: recipe 'none' converts nothing; leave the converter out")
        options = {key: getattr(config, key) for key in RECIPE_OPTIONS}
        try:
            self.recipe: MXRecipe = recipe_from_options(config.recipe, options)
        except RecipeOptionError as e:  # name the config field (none for options fine alone but not together)
            where = f"{type(self).__name__}.Config" + (f".{e.key}" if e.key else "")
            raise ValueError(f"{where}: {e}") from None
        # a backend the device cannot run fails here, before the model is built
        self.backend_name = resolve_backend(self.recipe, training_device(), grouped=self.grouped).name
        self.records: list[ConversionRecord] = []

    def _why_skipped(self, fqn: str, features: tuple[int, ...]) -> str | None:
        return why_skipped(fqn, features, self.config.skip, self.config.fqns, self.recipe.block_size)

    def _log(self) -> None:
        table = format_conversion_table(self.records)
        logger.info(f"{type(self).__name__}({self.recipe.name}, {self.backend_name} backend):\n{table}")


class MXLinearConverter(_MXConverter):
    """Every ``Linear.Config`` that the skip rules let through becomes a ``TorchTitanMXLinear.Config``."""

    @dataclass(kw_only=True, slots=True)
    class Config(_MXConverter.Config):
        pass

    def convert(self, model_config):
        self.records = []
        for fqn, config, parent, attr in model_config.traverse(Linear.Config):
            shape = (config.out_features, config.in_features)
            if isinstance(config, TorchTitanMXLinear.Config):
                self.records.append(ConversionRecord(fqn, shape, True, f"already {config.recipe.name}"))
                continue
            skipped = self._why_skipped(fqn, shape)
            if skipped is not None:
                self.records.append(ConversionRecord(fqn, shape, False, skipped))
                continue
            new_config = TorchTitanMXLinear.Config(
                **{f.name: getattr(config, f.name) for f in fields(Linear.Config)}, recipe=self.recipe
            )
            model_config = _replace(model_config, parent, attr, new_config)
            self.records.append(ConversionRecord(fqn, shape, True, f"converted: {self.recipe.name}", self.backend_name))
        self._log()
        return model_config


class MXGroupedExpertsConverter(_MXConverter):
    """Every experts config (``GroupedExperts`` or a subclass) that the skip rules let through builds the
    class's MX subclass, whose three grouped GEMMs run ``mx_grouped_mm``."""

    @dataclass(kw_only=True, slots=True)
    class Config(_MXConverter.Config):
        pass

    grouped = True

    def convert(self, model_config):
        self.records = []
        for fqn, config, parent, attr in model_config.traverse(GroupedExperts.Config):
            shape = (config.num_experts, config.hidden_dim, config.dim)
            experts_cls = type(config)._owner
            if getattr(experts_cls, "_grouped_mm", None) is None:
                raise ValueError(f"{type(self).__name__}: {fqn} ({experts_cls.__name__}) has no _grouped_mm to replace")
            if hasattr(config, "recipe"):
                self.records.append(ConversionRecord(fqn, shape, True, f"already {config.recipe.name}"))
                continue
            skipped = self._why_skipped(fqn, shape[1:])
            if skipped is not None:
                self.records.append(ConversionRecord(fqn, shape, False, skipped))
                continue
            mx_cls = _mx_experts_class(experts_cls)
            new_config = mx_cls.Config(**{f.name: getattr(config, f.name) for f in fields(config)}, recipe=self.recipe)
            model_config = _replace(model_config, parent, attr, new_config)
            self.records.append(ConversionRecord(fqn, shape, True, f"converted: {self.recipe.name}", self.backend_name))
        if self.records:
            self._log()
        return model_config


def mx_converters(recipe: str = "mxfp8", **options) -> list[_MXConverter.Config]:
    """The two converters' configs for ``recipe`` (options: the fields of ``MXLinearConverter.Config``),
    for a ``model_registry(..., converters=...)`` call or ``with_mx``."""
    return [
        MXLinearConverter.Config(recipe=recipe, **options),
        MXGroupedExpertsConverter.Config(recipe=recipe, **options),
    ]


def with_mx(config, recipe: str = "mxfp8", **options):
    """A torchtitan ``Trainer.Config`` with its model converted by ``mx_converters(recipe, **options)``:
    the same as passing the converters to the model's ``model_registry``."""
    compile_model = config.compile.enable and "model" in config.compile.components
    converters = mx_converters(recipe, model_compile_enabled=compile_model, **options)
    validate_converter_order(converters)
    model = config.model_spec.model
    for converter in converters:
        model = converter.build().convert(model)
    config.model_spec = dataclasses.replace(config.model_spec, model=model)
    return config
