"""convert_to_mx: swap a model's nn.Linear layers for MXLinear in place, and say what it did."""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass

import torch
from torch import nn

from mx_recipe.grouped import mx_grouped_mm
from mx_recipe.linear import MXLinear
from mx_recipe.models.moe import GroupedExperts
from mx_recipe.recipe import MXRecipe

logger = logging.getLogger(__name__)

# Stay in high precision by default: the output projection (its logits feed the loss directly)
# and MoE router gates (tiny GEMMs whose top-k choice is sensitive to rounding).
DEFAULT_SKIP = ("output", "*router.gate")


class MXGroupedExperts(GroupedExperts):
    """GroupedExperts whose three grouped GEMMs run in MX. Made by swapping the class in place."""

    recipe: MXRecipe

    def grouped_mm(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return mx_grouped_mm(x, w, offs, self.recipe)

    def extra_repr(self) -> str:
        return f"experts={self.w1.shape[0]}, recipe={self.recipe.name}"


@dataclass(frozen=True)
class ConversionRecord:
    fqn: str
    shape: tuple[int, ...]  # the weight's: (out, in) for a linear, w1's (E, hidden, dim) for experts
    converted: bool
    reason: str


def _matches(fqn: str, patterns: list[str] | tuple[str, ...]) -> str | None:
    for pattern in patterns:
        if fnmatch.fnmatchcase(fqn, pattern) or fqn == pattern:
            return pattern
    return None


def convert_to_mx(
    model: nn.Module,
    recipe: MXRecipe,
    skip: list[str] | tuple[str, ...] = DEFAULT_SKIP,
    log: bool = True,
) -> list[ConversionRecord]:
    """Replace every ``nn.Linear`` (and subclass) of ``model`` by an ``MXLinear``, and every MoE
    ``GroupedExperts`` by ``MXGroupedExperts``, in place.

    ``skip`` holds fqn patterns (fnmatch, e.g. ``"output"``, ``"layers.*.attention.wq"``).
    Layers whose features are not multiples of the block size are skipped too. Parameters
    are shared, not copied, so optimizers and state_dict keys are unchanged.
    """
    records: list[ConversionRecord] = []
    swapped: dict[int, MXLinear] = {}  # a module registered under several names is swapped everywhere
    for fqn, module in list(model.named_modules(remove_duplicate=False)):
        if isinstance(module, (MXLinear, MXGroupedExperts)):
            continue
        if isinstance(module, GroupedExperts):
            records.append(_convert_experts(fqn, module, recipe, skip))
            continue
        if not isinstance(module, nn.Linear):
            continue
        shape = (module.out_features, module.in_features)
        pattern = _matches(fqn, skip)
        if pattern is not None:
            records.append(ConversionRecord(fqn, shape, False, f"skipped: matches {pattern!r}"))
            continue
        if module.in_features % recipe.block_size or module.out_features % recipe.block_size:
            reason = f"skipped: features not multiples of {recipe.block_size}"
            records.append(ConversionRecord(fqn, shape, False, reason))
            continue
        if id(module) not in swapped:
            swapped[id(module)] = MXLinear.from_linear(module, recipe)
        parent_fqn, _, name = fqn.rpartition(".")
        parent = model.get_submodule(parent_fqn) if parent_fqn else model
        setattr(parent, name, swapped[id(module)])
        records.append(ConversionRecord(fqn, shape, True, f"converted: {recipe.name}"))
    if log:
        logger.info("convert_to_mx(%s):\n%s", recipe.name, format_conversion_table(records))
    return records


def _convert_experts(
    fqn: str, experts: GroupedExperts, recipe: MXRecipe, skip: list[str] | tuple[str, ...]
) -> ConversionRecord:
    shape = tuple(experts.w1.shape)
    pattern = _matches(fqn, skip)
    if pattern is not None:
        return ConversionRecord(fqn, shape, False, f"skipped: matches {pattern!r}")
    if any(d % recipe.block_size for d in shape[1:]):
        return ConversionRecord(fqn, shape, False, f"skipped: features not multiples of {recipe.block_size}")
    experts.__class__ = MXGroupedExperts  # parameters, hooks and FSDP state stay as they are
    experts.recipe = recipe
    return ConversionRecord(fqn, shape, True, f"converted: {recipe.name}")


def format_conversion_table(records: list[ConversionRecord]) -> str:
    rows = [("fqn", "shape", "result")] + [(r.fqn, "x".join(map(str, r.shape)), r.reason) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    converted = sum(r.converted for r in records)
    lines.append(f"{converted} of {len(records)} layers converted (linear layers and expert groups)")
    return "\n".join(lines)
