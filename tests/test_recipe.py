"""MXRecipe: the named recipes carry the documented formats; bad fields are rejected by name."""

from __future__ import annotations

import dataclasses

import pytest

from mx_recipe.formats.recipe import RECIPES, MXRecipe

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
    assert MXRecipe.from_name("mxfp8", fuse_expert_casts=True).fuse_expert_casts is True
    assert MXRecipe.from_name("mxfp4", fuse_expert_casts=True).fuse_expert_casts is True
    with pytest.raises(ValueError, match=r"fuse_expert_casts=True needs grad_input == forward"):
        MXRecipe(forward="e4m3", grad_input="bf16", fuse_expert_casts=True)
    with pytest.raises(ValueError, match=r"fuse_expert_casts=True needs grad_input == forward"):
        MXRecipe(forward="e4m3", grad_input="e5m2", fuse_expert_casts=True)
    with pytest.raises(ValueError, match=r"MXRecipe\.fuse_expert_casts="):
        MXRecipe(fuse_expert_casts="no")
