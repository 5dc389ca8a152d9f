"""Recipe options: the fields of ``MXRecipe`` and ``NVFP4Recipe`` that a run sets on top of a named recipe.

A field made with ``recipe.option(default, help)`` is an option; this module derives each option's type,
default and help from the dataclasses, so train.py's [mx] section (``mx_recipe.train.config.MXConfig``) and
the torchtitan converters' configs are generated from ``RECIPE_OPTIONS`` and build their recipe with
``recipe_from_options``. A new option field is a new [mx] key and converter field, with nothing else to edit.

An option's default keeps every named recipe as it is: the field's default where every recipe class with
the field and every named recipe agree on it, else ``KEEP`` ("", for a string option): "the recipe's own".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, get_type_hints

from mx_recipe.formats.recipe import NVFP4_RECIPES, OPTION, RECIPES, SEEDED, MXRecipe, NVFP4Recipe

Recipe = MXRecipe | NVFP4Recipe
KEEP = ""  # a string option left at "" keeps the named recipe's value
# Each recipe class, its named recipes, and what its own options are called in messages.
KINDS: dict[type, tuple[Mapping[str, Any], str]] = {
    MXRecipe: (RECIPES, "an MX cast option"),
    NVFP4Recipe: (NVFP4_RECIPES, "an NVFP4 option"),
}


class RecipeOptionError(ValueError):
    """A bad recipe name or option value. ``key`` is the option's name, "recipe" for the name, or None for
    options that are fine alone but not together; the message does not repeat it."""

    def __init__(self, key: str | None, message: str):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class RecipeOption:
    name: str
    type: type  # str, bool or int
    default: Any  # the value that keeps every named recipe as it is
    help: str  # one line
    kinds: tuple[type, ...]  # the recipe classes that have this field


def _type_name(tp: type) -> str:
    return {bool: "true or false", int: "an integer", str: "a string"}[tp]


def collect_options(kinds: Mapping[type, tuple[Mapping[str, Any], str]]) -> dict[str, RecipeOption]:
    """The options of the recipe classes ``kinds`` (each with its named recipes and its options' label): each
    field made with ``recipe.option``, once however many classes have it. TypeError for an option whose type or
    help differs between classes, or whose named recipes differ and that has no KEEP value (not a string)."""
    found: dict[str, list[tuple[type, dataclasses.Field, type]]] = {}
    for kind in kinds:
        hints = get_type_hints(kind)
        for f in fields(kind):
            if OPTION in f.metadata:
                found.setdefault(f.name, []).append((kind, f, hints[f.name]))
    options = {}
    for name, entries in found.items():
        types = {tp for _, _, tp in entries}
        tp = types.pop() if len(types) == 1 else None
        if tp not in (str, bool, int):
            raise TypeError(f"recipe option {name!r}: one type of str, bool or int in every recipe class")
        helps = {f.metadata[OPTION] for _, f, _ in entries}
        if len(helps) > 1:
            raise TypeError(f"recipe option {name!r}: one help in every recipe class, got {sorted(helps)}")
        values = {f.default for _, f, _ in entries}
        values |= {getattr(recipe, name) for kind, _, _ in entries for recipe in kinds[kind][0].values()}
        (help,) = helps
        if len(values) == 1:
            (default,) = values
        elif tp is str:  # the recipes differ: the default must keep each one's own value
            default, help = KEEP, f'{help}; "" keeps the recipe\'s'
        else:
            raise TypeError(
                f"recipe option {name!r}: the recipes' values differ ({sorted(values)}), so its default would change "
                f"some of them; a {tp.__name__} option has no value meaning 'keep the recipe's'"
            )
        owners = tuple(kind for kind, _, _ in entries)
        if len(owners) < len(kinds):
            help = f"{help} ({', '.join(k.__name__ for k in owners)} only)"
        options[name] = RecipeOption(name, tp, default, help, owners)
    return options


RECIPE_OPTIONS: dict[str, RecipeOption] = collect_options(KINDS)


def recipe_option_fields() -> list[tuple[str, type, dataclasses.Field]]:
    """One ``(name, type, field)`` per option, for ``dataclasses.make_dataclass``: a config class with a key
    per option, its default, and its help as the field's "help" metadata."""
    return [
        (o.name, o.type, dataclasses.field(default=o.default, metadata={"help": o.help}))
        for o in RECIPE_OPTIONS.values()
    ]


def _check_type(key: str, value: Any) -> RecipeOption:
    if key not in RECIPE_OPTIONS:
        raise RecipeOptionError(key, f"unknown recipe option; known: {', '.join(RECIPE_OPTIONS)}")
    option = RECIPE_OPTIONS[key]
    if type(value) is not option.type:  # exact: True is no integer here, 1 no bool
        raise RecipeOptionError(key, f"expected {_type_name(option.type)}, got {value!r}")
    return option


def check_option(key: str, value: Any) -> None:
    """Raise RecipeOptionError unless ``value`` is a value of option ``key`` for some recipe class (checked on
    its default recipe): for options given without a recipe to apply them to (train.py's recipe "none")."""
    option = _check_type(key, value)
    if value == option.default:
        return
    errors = []
    for kind in option.kinds:
        try:
            kind(**{key: value})
            return
        except ValueError as e:
            errors.append(str(e))
    raise RecipeOptionError(key, "; ".join(errors))


def recipe_kind(name: str) -> type:
    """The recipe class of the named recipe (MXRecipe or NVFP4Recipe)."""
    for kind, (registry, _) in KINDS.items():
        if name in registry:
            return kind
    known = [n for registry, _ in KINDS.values() for n in registry]
    raise RecipeOptionError("recipe", f"unknown recipe {name!r}; known: {', '.join(known)}")


def recipe_from_options(name: str, options: Mapping[str, Any] | None = None, seed: int = 0) -> Recipe:
    """The named recipe with ``options`` (option name -> value) set on it, and its seeded fields (NVFP4's
    Hadamard signs) from ``seed``. An option at its default keeps the recipe's value; one that the recipe's
    class has not is an error unless at its default. Errors are RecipeOptionError naming the option."""
    kind = recipe_kind(name)
    base = replace(kind.from_name(name), **{f.name: seed for f in fields(kind) if f.metadata.get(SEEDED)})
    overrides = {}
    for key, value in (options or {}).items():
        option = _check_type(key, value)
        if value == option.default:
            continue
        if kind not in option.kinds:
            label = KINDS[option.kinds[0]][1]
            raise RecipeOptionError(key, f"is {label}; recipe {name!r} is an {kind.__name__}, which has no such field")
        try:  # one option at a time, so that the error names it
            replace(base, **{key: value})
        except ValueError as e:
            raise RecipeOptionError(key, f"{e} (recipe {name!r})") from None
        overrides[key] = value
    try:
        return replace(base, **overrides)
    except ValueError as e:
        raise RecipeOptionError(None, f"{e} (recipe {name!r})") from None
