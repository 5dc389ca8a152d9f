"""convert_to_mx: swap a model's nn.Linear layers and MoE experts for MX versions in place, and say what it did."""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass

import torch
from torch import nn

from mx_recipe.formats.options import recipe_from_options
from mx_recipe.formats.recipe import MXRecipe, NVFP4Recipe
from mx_recipe.nn.grouped import grouped_mm_on_one_input, mx_grouped_mm
from mx_recipe.nn.linear import MXLinear
from mx_recipe.ops.backends import Backend, resolve_backend

# Stay in high precision by default: the output projection (its logits feed the loss directly)
# and MoE router gates (tiny GEMMs whose top-k choice is sensitive to rounding).
DEFAULT_SKIP = ("output", "*router.gate")


class MXGroupedExperts(nn.Module):
    """Mixed into the class of an MoE expert module, whose three grouped GEMMs then run in MX.

    An expert module (models.moe.GroupedExperts) holds 3D weights w1 [E, hidden, dim], w2, w3 and
    runs every GEMM through its ``grouped_mm(x, w, offs)``: convert_to_mx recognizes it by that
    method, so this module imports no model."""

    recipe: MXRecipe
    backend: Backend
    weight_casts: dict | None = None  # w1, w2, w3's casts for a step (mx_recipe.nn.weight_casts)

    def step_weight_casts(self, x: torch.Tensor, w: torch.Tensor) -> tuple | None:
        """w's casts made for the step, where made for x's dtype."""
        if self.weight_casts is None:
            return None
        for name, casts in self.weight_casts.items():
            if w is getattr(self, name):
                return casts.operands if casts.dtype == x.dtype else None
        return None

    def grouped_mm(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return mx_grouped_mm(x, w, offs, self.recipe, self.backend, self.step_weight_casts(x, w))

    def grouped_mm_on_one_input(
        self, x: torch.Tensor, ws: tuple[torch.Tensor, ...], offs: torch.Tensor, routed: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        casts = [self.step_weight_casts(x, w) for w in ws]
        return grouped_mm_on_one_input(x, ws, offs, self.recipe, self.backend, casts, routed)

    def extra_repr(self) -> str:
        return f"experts={self.w1.shape[0]}, recipe={self.recipe.name}, backend={self.backend.name}"


@functools.cache
def _mx_experts_class(cls: type[nn.Module]) -> type[nn.Module]:
    return type(MXGroupedExperts.__name__, (MXGroupedExperts, cls), {})


def _is_experts(module: nn.Module) -> bool:
    return callable(getattr(module, "grouped_mm", None))


@dataclass(frozen=True)
class ConversionRecord:
    fqn: str
    shape: tuple[int, ...]  # the weight's: (out, in) for a linear, w1's (E, hidden, dim) for experts
    converted: bool
    reason: str
    backend: str = ""  # the GEMM backend of a converted layer


def _matches(fqn: str, patterns: list[str] | tuple[str, ...]) -> str | None:
    for pattern in patterns:
        if fnmatch.fnmatchcase(fqn, pattern) or fqn == pattern:
            return pattern
    return None


def skip_reason(fqn: str, features: tuple[int, ...], skip: list[str] | tuple[str, ...], block_size: int) -> str | None:
    """Why the layer at ``fqn`` stays in high precision (None: it is converted): it matches a ``skip`` pattern,
    or its features (a linear's (out, in), experts' (hidden, dim)) are not multiples of the MX block."""
    pattern = _matches(fqn, skip)
    if pattern is not None:
        return f"skipped: matches {pattern!r}"
    if any(d % block_size for d in features):
        return f"skipped: features not multiples of {block_size}"
    return None


def unmatched_skip_patterns(model: nn.Module, skip: list[str] | tuple[str, ...]) -> list[str]:
    """The patterns of ``skip`` that match no linear layer or expert group of ``model``: a misspelt pattern
    otherwise leaves converted a layer that was meant to stay in high precision."""
    fqns = [fqn for fqn, m in model.named_modules(remove_duplicate=False) if isinstance(m, nn.Linear) or _is_experts(m)]
    return [pattern for pattern in skip if not any(_matches(fqn, [pattern]) for fqn in fqns)]


def convert_to_mx(
    model: nn.Module,
    recipe: MXRecipe | NVFP4Recipe | str,
    skip: list[str] | tuple[str, ...] = DEFAULT_SKIP,
    log: bool = True,
    device: torch.device | str | None = None,
) -> list[ConversionRecord]:
    """Replace every ``nn.Linear`` (and subclass) of ``model`` by an ``MXLinear``, and make every MoE
    expert module (``MXGroupedExperts``'s docstring says which) an ``MXGroupedExperts``, in place.

    ``recipe`` is a recipe or the name of one (``"mxfp8"``, ``"nvfp4"``, ...: the named recipe as a training
    config's ``mx.recipe`` gives it); an unknown name is a ValueError listing the known ones.

    ``skip`` holds fqn patterns (fnmatch, e.g. ``"output"``, ``"layers.*.attention.wq"``).
    Layers whose features are not multiples of the block size are skipped too. Parameters
    are shared, not copied, so optimizers and state_dict keys are unchanged.

    The GEMM backend is resolved once (``backends.resolve_backend``) for ``device`` (default: the
    current CUDA device if CUDA is available, else the CPU), with grouped GEMMs if any experts are
    converted, and every converted module gets that one backend object. A backend the device or the
    recipe cannot run is a ValueError, raised before anything is swapped.
    """
    if isinstance(recipe, str):
        try:
            recipe = recipe_from_options(recipe)
        except ValueError as e:
            raise ValueError(f"convert_to_mx: {e}") from None
    elif not isinstance(recipe, (MXRecipe, NVFP4Recipe)):
        raise TypeError(f"convert_to_mx: recipe must be an MXRecipe, an NVFP4Recipe or a recipe's name, got {recipe!r}")
    layers = []  # (fqn, module, shape, why it is skipped or None)
    for fqn, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, (MXLinear, MXGroupedExperts)):
            continue
        if _is_experts(module):
            shape, features = tuple(module.w1.shape), module.w1.shape[1:]
        elif isinstance(module, nn.Linear):
            shape = features = (module.out_features, module.in_features)
        else:
            continue
        layers.append((fqn, module, shape, skip_reason(fqn, features, skip, recipe.block_size)))
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    grouped = any(skipped is None and _is_experts(module) for _, module, _, skipped in layers)
    backend = resolve_backend(recipe, torch.device(device), grouped)
    records: list[ConversionRecord] = []
    swapped: dict[int, MXLinear] = {}  # a module registered under several names is swapped everywhere
    for fqn, module, shape, skipped in layers:
        if skipped is not None:
            records.append(ConversionRecord(fqn, shape, False, skipped))
            continue
        if not _is_experts(module):
            if id(module) not in swapped:
                swapped[id(module)] = MXLinear.from_linear(module, recipe, backend)
            parent_fqn, _, name = fqn.rpartition(".")
            setattr(model.get_submodule(parent_fqn), name, swapped[id(module)])
        elif not isinstance(module, MXGroupedExperts):  # parameters, hooks and FSDP state stay as they are
            module.__class__ = _mx_experts_class(type(module))
            module.recipe, module.backend = recipe, backend
        records.append(ConversionRecord(fqn, shape, True, f"converted: {recipe.name}", backend.name))
    if log:  # printed: logging.info reaches nobody unless the caller configured logging
        print(f"convert_to_mx({recipe.name}, {backend.name} backend):\n{format_conversion_table(records)}")
    return records


def format_conversion_table(records: list[ConversionRecord]) -> str:
    rows = [("fqn", "shape", "result")] + [(r.fqn, "x".join(map(str, r.shape)), r.reason) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    converted = sum(r.converted for r in records)
    lines.append(f"{converted} of {len(records)} layers converted (linear layers and expert groups)")
    return "\n".join(lines)
