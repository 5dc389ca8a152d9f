"""MXRecipe: the named recipes carry the documented formats; bad fields are rejected by name."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from mx_recipe.formats.options import (
    KEEP,
    KINDS,
    RECIPE_OPTIONS,
    RecipeOptionError,
    check_option,
    collect_options,
    recipe_from_options,
    recipe_kind,
)
from mx_recipe.formats.recipe import NVFP4_RECIPES, OPTION, RECIPES, MXRecipe, option

# (forward, grad_input, grad_weight, grad, scale_rule) as documented for each named recipe.
DOCUMENTED = {
    "mxfp8": ("e4m3", "e4m3", "e4m3", "e4m3", "floor"),
    "mxfp8_rceil": ("e4m3", "e4m3", "e4m3", "e4m3", "rceil"),
    "mxfp8_wgrad_bf16": ("e4m3", "e4m3", "bf16", "e4m3", "floor"),
    "mxfp8_e5m2_grads": ("e4m3", "e4m3", "e4m3", "e5m2", "floor"),
    "mxfp4": ("e2m1", "e2m1", "e2m1", "e2m1", "floor"),
    "mxfp4_sr": ("e2m1", "e2m1", "e2m1", "e2m1", "floor"),
}
# grad_rounding of each named recipe (MXFP4 with stochastically rounded gradients: mxfp4_sr).
ROUNDING = {name: "stochastic" if name == "mxfp4_sr" else "nearest" for name in DOCUMENTED}


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_from_name_gives_documented_formats(name):
    r = MXRecipe.from_name(name)
    assert r.name == name
    assert (r.forward, r.grad_input, r.grad_weight, r.grad, r.scale_rule) == DOCUMENTED[name]
    assert r.backend == "auto"
    assert r.block_size == 32
    assert r.grad_rounding == ROUNDING[name]
    assert r.save_mx_input is False  # an option, on in no named recipe


def test_registry_is_exactly_the_documented_recipes():
    assert set(RECIPES) == set(DOCUMENTED)
    for name, recipe in RECIPES.items():
        assert recipe.name == name


def test_grad_elem():
    r = MXRecipe.from_name("mxfp8_wgrad_bf16")
    assert r.grad_elem(r.grad_weight) == "bf16"  # a bf16 GEMM casts nothing, the gradient included
    assert r.grad_elem(r.grad_input) == "e4m3"
    assert MXRecipe.from_name("mxfp8_e5m2_grads").grad_elem("e4m3") == "e5m2"
    assert MXRecipe.from_name("mxfp4").grad_elem("e2m1") == "e2m1"


def test_from_name_overrides_and_frozen():
    r = MXRecipe.from_name("mxfp8", scale_rule="rceil", backend="emulated")
    assert (r.name, r.scale_rule, r.backend, r.forward) == ("mxfp8", "rceil", "emulated", "e4m3")
    assert RECIPES["mxfp8"].scale_rule == "floor"  # the registry entry is untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.scale_rule = "floor"


def test_unknown_name_raises():
    with pytest.raises(ValueError) as err:
        MXRecipe.from_name("mxfp6")
    assert "mxfp6" in str(err.value)
    assert "mxfp8" in str(err.value)  # lists the known names


@pytest.mark.parametrize("field", ["forward", "grad_input", "grad_weight"])
@pytest.mark.parametrize("value", ["e3m2", "fp8", "", "E4M3", "fp32"])
def test_bad_gemm_format_names_the_field(field, value):
    with pytest.raises(ValueError) as err:
        MXRecipe(**{field: value})
    msg = str(err.value)
    assert f"MXRecipe.{field}=" in msg and repr(value) in msg, msg


@pytest.mark.parametrize("value", ["bf16", "e3m2", "fp16"])
def test_bad_grad_format_names_the_field(value):
    # the upstream gradient is always cast when its GEMM is MX: bf16 is not a gradient format
    with pytest.raises(ValueError, match=r"MXRecipe\.grad="):
        MXRecipe(grad=value)


@pytest.mark.parametrize("value", ["ceil", "round", "FLOOR", "even"])
def test_bad_scale_rule_names_the_field(value):
    with pytest.raises(ValueError, match=r"MXRecipe\.scale_rule=") as err:
        MXRecipe(scale_rule=value)
    assert repr(value) in str(err.value)


@pytest.mark.parametrize("backend", ["Triton", "cuda", "", "tl"])
def test_unsupported_backend_names_the_field(backend):
    with pytest.raises(ValueError, match=r"MXRecipe\.backend=") as err:
        MXRecipe(backend=backend)
    assert repr(backend) in str(err.value)


@pytest.mark.parametrize("backend", ["cutlass"])
def test_unsupported_backend_via_from_name(backend):
    with pytest.raises(ValueError, match=r"MXRecipe\.backend="):
        MXRecipe.from_name("mxfp8", backend=backend)


@pytest.mark.parametrize("backend", ["auto", "emulated", "cublas", "triton"])
def test_every_backend_name_is_accepted(backend):
    # whether the device can run it is resolve_backend's question (mx_recipe/ops/gemm.py), at conversion
    assert MXRecipe.from_name("mxfp8", backend=backend).backend == backend


@pytest.mark.parametrize("block_size", [16, 64, 0])
def test_block_size_other_than_32_rejected(block_size):
    with pytest.raises(ValueError, match=r"MXRecipe\.block_size="):
        MXRecipe(block_size=block_size)


def test_override_validation_and_unknown_field():
    with pytest.raises(ValueError, match=r"MXRecipe\.forward="):
        MXRecipe.from_name("mxfp4", forward="int8")
    with pytest.raises(TypeError):
        MXRecipe.from_name("mxfp8", not_a_field="x")


@pytest.mark.parametrize("backend", ["auto", "emulated"])
def test_valid_custom_recipe(backend):
    r = MXRecipe(
        name="mine", forward="e4m3", grad_input="bf16", grad_weight="e5m2", grad="e5m2", scale_rule="rceil",
        backend=backend,
    )  # fmt: skip
    assert (r.grad_elem(r.grad_input), r.grad_elem(r.grad_weight)) == ("bf16", "e5m2")


@pytest.mark.parametrize("value", ["round", "Stochastic", "", "rne"])
def test_bad_grad_rounding_names_the_field(value):
    with pytest.raises(ValueError, match=r"MXRecipe\.grad_rounding=") as err:
        MXRecipe.from_name("mxfp4", grad_rounding=value)
    assert repr(value) in str(err.value)


@pytest.mark.parametrize("name", ["mxfp8", "mxfp8_e5m2_grads", "mxfp8_wgrad_bf16"])
def test_stochastic_rounding_needs_fp4_gradients(name):
    """Stochastic rounding is for e2m1 gradients only: the fp8 cast kernels round to nearest."""
    with pytest.raises(ValueError, match=r"MXRecipe\.grad_rounding='stochastic' needs grad='e2m1'") as err:
        MXRecipe.from_name(name, grad_rounding="stochastic")
    assert repr(RECIPES[name].grad) in str(err.value)
    # e2m1 gradients with fp8 GEMM formats are fine
    r = MXRecipe.from_name(name, grad="e2m1", grad_rounding="stochastic")
    assert (r.grad, r.grad_rounding) == ("e2m1", "stochastic")


@pytest.mark.parametrize("name", sorted(n for n in DOCUMENTED if DOCUMENTED[n][2] != "bf16"))
def test_save_mx_input_accepted_with_mx_grad_weight(name):
    r = MXRecipe.from_name(name, save_mx_input=True)
    assert r.save_mx_input is True and r.grad_weight == DOCUMENTED[name][2]


def test_save_mx_input_rejected_with_bf16_grad_weight():
    """With grad_weight='bf16' the grad-weight GEMM reads x in bf16: nothing to save in MX form."""
    with pytest.raises(ValueError, match=r"MXRecipe\.save_mx_input=True needs an MX grad_weight") as err:
        MXRecipe.from_name("mxfp8_wgrad_bf16", save_mx_input=True)
    assert "grad_weight='bf16'" in str(err.value)
    with pytest.raises(ValueError, match=r"MXRecipe\.save_mx_input="):
        MXRecipe(save_mx_input="yes")


def test_fuse_x_casts_applies_where_one_format_serves_both_gemms_of_x():
    """On by default; it applies on the emulated backend where grad_weight == forward (MX) and save_mx_input
    (the other way to save x) is off, and changes nothing elsewhere."""
    for name in ("mxfp8", "mxfp8_rceil", "mxfp8_e5m2_grads", "mxfp4", "mxfp4_sr"):
        r = MXRecipe.from_name(name)
        assert r.fuse_x_casts and r.fuses_x_casts("emulated") and not r.fuses_x_casts("cublas"), name
    assert not MXRecipe.from_name("mxfp8_wgrad_bf16").fuses_x_casts("emulated")
    assert not MXRecipe(forward="e4m3", grad_weight="e2m1").fuses_x_casts("emulated")
    assert not MXRecipe(save_mx_input=True).fuses_x_casts("emulated")
    assert not MXRecipe(fuse_x_casts=False).fuses_x_casts("emulated")
    with pytest.raises(ValueError, match=r"MXRecipe\.fuse_x_casts="):
        MXRecipe(fuse_x_casts=1)


def test_fuse_expert_casts_validation():
    assert MXRecipe.from_name("mxfp8").fuse_expert_casts is True  # on by default
    assert MXRecipe.from_name("mxfp4", fuse_expert_casts=False).fuse_expert_casts is False
    # where grad input runs in bf16 or another format, it changes nothing (test_moe checks the bits)
    assert MXRecipe(forward="e4m3", grad_input="bf16").fuse_expert_casts is True
    with pytest.raises(ValueError, match=r"MXRecipe\.fuse_expert_casts="):
        MXRecipe(fuse_expert_casts="no")


# Recipe options (mx_recipe.formats.options): the fields a run sets on top of a named recipe, derived from the
# dataclasses; train.py's [mx] keys and the torchtitan converters' fields are generated from them.


def test_options_are_the_option_fields_of_the_recipe_classes():
    """Each field made with recipe.option is one option with the field's type, default and help; the default is
    "" (keep the recipe's) where the named recipes differ, as grad_rounding does (nearest, stochastic)."""
    for kind, (registry, _) in KINDS.items():
        marked = {f.name: f for f in dataclasses.fields(kind) if OPTION in f.metadata}
        assert marked == {n: f for n, f in marked.items() if kind in RECIPE_OPTIONS[n].kinds}
        assert {n for n, o in RECIPE_OPTIONS.items() if kind in o.kinds} == set(marked)
        hints = typing.get_type_hints(kind)
        for name, f in marked.items():
            option = RECIPE_OPTIONS[name]
            assert option.type is hints[name] and option.help.startswith(f.metadata[OPTION]), name
            values = {f.default} | {getattr(r, name) for r in registry.values()}
            assert option.default == (KEEP if len(values) > 1 else f.default), name
    # the [mx] keys that configs and checkpoints' config.toml hold, with the defaults they were written with
    assert {n: o.default for n, o in RECIPE_OPTIONS.items()} == {
        "backend": "auto",
        "grad_rounding": "",
        "save_mx_input": False,
        "fuse_x_casts": True,
        "fuse_expert_casts": True,
        "share_input_casts": True,
    }


def test_a_new_option_field_becomes_an_option():
    @dataclasses.dataclass(frozen=True)
    class Toy:
        name: str = "toy"
        width: int = option(8, "how wide")
        fast: bool = option(False, "go fast")
        mode: str = option("a", "which mode")

    named = {"toy": Toy(), "toy_b": Toy("toy_b", mode="b")}
    options = collect_options({Toy: (named, "a toy option")})
    assert [(o.name, o.type, o.default, o.help) for o in options.values()] == [
        ("width", int, 8, "how wide"),
        ("fast", bool, False, "go fast"),
        ("mode", str, KEEP, 'which mode; "" keeps the recipe\'s'),  # the named recipes differ
    ]

    @dataclasses.dataclass(frozen=True)
    class Other:
        width: int = option(8, "how broad")

    with pytest.raises(TypeError, match="recipe option 'width': one help in every recipe class"):
        collect_options({Toy: (named, "a toy option"), Other: ({}, "another option")})
    named["toy_fast"] = Toy("toy_fast", fast=True)  # a bool has no value meaning "keep the recipe's"
    with pytest.raises(TypeError, match="recipe option 'fast': the recipes' values differ"):
        collect_options({Toy: (named, "a toy option")})


@pytest.mark.parametrize("name", [*RECIPES, *NVFP4_RECIPES])
def test_default_options_keep_every_named_recipe(name):
    """Every option at its default (as [mx] holds them) gives the named recipe itself; the seed goes to NVFP4's
    Hadamard signs."""
    defaults = {n: o.default for n, o in RECIPE_OPTIONS.items()}
    recipe = recipe_from_options(name, defaults, seed=7)
    if name in NVFP4_RECIPES:
        assert recipe == dataclasses.replace(NVFP4_RECIPES[name], hadamard_seed=7)
    else:
        assert recipe == RECIPES[name]
    assert recipe_from_options(name) == recipe_kind(name).from_name(name)


def test_recipe_from_options_sets_options_and_names_the_bad_one():
    r = recipe_from_options("mxfp4_sr", {"grad_rounding": "nearest", "share_input_casts": False, "backend": "emulated"})
    assert (r.name, r.grad_rounding, r.share_input_casts, r.backend) == ("mxfp4_sr", "nearest", False, "emulated")
    assert recipe_from_options("nvfp4", {"grad_rounding": "nearest"}).grad_rounding == "nearest"

    def error(name, options) -> tuple[str | None, str]:
        with pytest.raises(RecipeOptionError) as err:
            recipe_from_options(name, options)
        return err.value.key, str(err.value)

    assert error("mxfp9", {}) == ("recipe", f"unknown recipe 'mxfp9'; known: {', '.join([*RECIPES, *NVFP4_RECIPES])}")
    key, msg = error("mxfp8", {"grad_rounding": "stochastic"})
    assert key == "grad_rounding" and "needs grad='e2m1'" in msg and msg.endswith("(recipe 'mxfp8')")
    assert error("mxfp8", {"save_mx_input": "yes"}) == ("save_mx_input", "expected true or false, got 'yes'")
    assert error("mxfp8", {"backend": None}) == ("backend", "expected a string, got None")
    assert error("mxfp8", {"forward": "e2m1"})[0] == "forward"  # defines the recipe: not an option
    key, msg = error("nvfp4", {"backend": "triton"})
    assert key == "backend" and msg.startswith("NVFP4Recipe.backend='triton'")
    # an MX option on an NVFP4 recipe: an error unless at its default
    assert error("nvfp4", {"fuse_x_casts": False}) == (
        "fuse_x_casts",
        "is an MX cast option; recipe 'nvfp4' is an NVFP4Recipe, which has no such field",
    )
    assert recipe_from_options("nvfp4", {"fuse_x_casts": True}) == NVFP4_RECIPES["nvfp4"]


def test_check_option_takes_a_value_some_recipe_class_takes():
    check_option("grad_rounding", "stochastic")  # MX e2m1 gradients and NVFP4 take it
    check_option("backend", "triton")  # MX only
    with pytest.raises(RecipeOptionError, match=r"MXRecipe\.backend='tpu'.*; NVFP4Recipe\.backend='tpu'") as err:
        check_option("backend", "tpu")
    assert err.value.key == "backend"
    with pytest.raises(RecipeOptionError, match="expected true or false, got 1"):
        check_option("fuse_x_casts", 1)
