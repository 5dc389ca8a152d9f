"""convert_to_mx: swap a model's nn.Linear layers for MXLinear in place, and say what it did."""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass

from torch import nn

from mx_recipe.linear import MXLinear
from mx_recipe.recipe import MXRecipe

logger = logging.getLogger(__name__)

# The output projection stays in high precision by default: its logits feed the loss directly.
DEFAULT_SKIP = ("output",)


@dataclass(frozen=True)
class ConversionRecord:
    fqn: str
    shape: tuple[int, int]  # (out_features, in_features), as the weight
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
    """Replace every ``nn.Linear`` (and subclass) of ``model`` by an ``MXLinear`` in place.

    ``skip`` holds fqn patterns (fnmatch, e.g. ``"output"``, ``"layers.*.attention.wq"``).
    Layers whose features are not multiples of the block size are skipped too. Parameters
    are shared, not copied, so optimizers and state_dict keys are unchanged.
    """
    records: list[ConversionRecord] = []
    swapped: dict[int, MXLinear] = {}  # a module registered under several names is swapped everywhere
    for fqn, module in list(model.named_modules(remove_duplicate=False)):
        if not isinstance(module, nn.Linear) or isinstance(module, MXLinear):
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


def format_conversion_table(records: list[ConversionRecord]) -> str:
    rows = [("fqn", "shape", "result")] + [(r.fqn, "x".join(map(str, r.shape)), r.reason) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    converted = sum(r.converted for r in records)
    lines.append(f"{converted} of {len(records)} linear layers converted")
    return "\n".join(lines)
