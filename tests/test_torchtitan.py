"""mx_recipe inside torchtitan (the installed package, CPU): our converters selected by name through torchtitan's
config manager, torchtitan's Llama 3 and DeepSeek-V3 debug models converted (every linear and the experts; the
router gates and lm_head left in bf16), each converted layer bit-identical in forward and backward to our own
MXLinear and MX grouped experts on the same weights and inputs, state-dict keys unchanged, and training steps
under torchtitan's FSDP2, activation checkpointing and per-block torch.compile (gloo).

torchtitan's Trainer itself does not run on a CPU: it calls torch.cuda.set_device in its constructor
(torchtitan 0.3.0, trainer.py), so tests/torchtitan_steps.py drives the same model, parallelize and
compile functions with a loop of its own. Flex attention has no backward on the CPU, so the models here use
torchtitan's ScaledDotProductAttention module instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is a dev extra: pip install -e '.[dev]'")

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts  # noqa: E402

from mx_recipe import MXRecipe, convert_to_mx  # noqa: E402
from mx_recipe.integrations.torchtitan import (  # noqa: E402
    MXGroupedExpertsConverter,
    MXLinearConverter,
    TorchTitanMXLinear,
    with_mx,
)
from mx_recipe.models.moe import GroupedExperts as OurGroupedExperts  # noqa: E402
from mx_recipe.nn.linear import mx_linear  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from torchtitan_steps import MODULE, build, cpu_model_config  # noqa: E402

STEPS_SCRIPT = str(Path(__file__).parent / "torchtitan_steps.py")


def load(config_name: str, *overrides: str):
    return ConfigManager().parse_args(["--module", MODULE, "--config", config_name, *overrides])


def linear_configs(model_config) -> dict[str, object]:
    return {fqn: config for fqn, config, _, _ in model_config.traverse(Linear.Config)}


def test_torchtitan_config_manager_selects_our_configs_by_name():
    config = load("llama3_debugmodel_mxfp8_rceil", "--training.steps", "3")
    assert config.training.steps == 3  # torchtitan's command-line overrides apply as usual
    linears = linear_configs(config.model_spec.model)
    mx = {fqn for fqn, c in linears.items() if isinstance(c, TorchTitanMXLinear.Config)}
    assert set(linears) - mx == {"lm_head"}
    assert len(mx) == 6 * 5  # six blocks of wqkv, wo, w1, w2, w3
    assert all(linears[fqn].recipe == MXRecipe.from_name("mxfp8_rceil") for fqn in mx)
    with pytest.raises(ValueError, match="llama3_debugmodel_mxfp8"):  # torchtitan lists what there is
        load("llama3_debugmodel_mxfp9")


def test_moe_experts_and_linears_convert_router_and_lm_head_stay_bf16():
    model_config = load("deepseek_v3_debugmodel_mxfp8").model_spec.model
    linears = linear_configs(model_config)
    kept = {fqn for fqn, c in linears.items() if not isinstance(c, TorchTitanMXLinear.Config)}
    assert kept == {"lm_head"} | {fqn for fqn in linears if fqn.endswith("router.gate")}
    assert any(".shared_experts." in fqn for fqn in set(linears) - kept)
    experts = [(fqn, c) for fqn, c, _, _ in model_config.traverse(GroupedExperts.Config)]
    assert len(experts) == 5  # layers 1-5 (layer 0 is dense)
    assert all(c.recipe.name == "mxfp8" and type(c).__qualname__ == "MXGroupedExperts.Config" for _, c in experts)


def test_converter_options_filters_and_bad_input():
    base = load("deepseek_v3_debugmodel_mxfp8").model_spec.model  # already converted: counted, not redone
    converter = MXLinearConverter.Config(recipe="mxfp8").build()
    converter.convert(base)
    assert all(r.reason.startswith("already") for r in converter.records if r.converted)

    from torchtitan.models.deepseek_v3 import config_registry as deepseek_v3

    config = with_mx(deepseek_v3.deepseek_v3_debugmodel(), "mxfp4", fqns=["feed_forward"], skip=["layers.2.*"])
    linears = linear_configs(config.model_spec.model)
    mx = {fqn for fqn, c in linears.items() if isinstance(c, TorchTitanMXLinear.Config)}
    assert mx == {f"layers.0.feed_forward.{w}" for w in ("w1", "w2", "w3")}  # the only dense FFN
    experts = {fqn: c for fqn, c, _, _ in config.model_spec.model.traverse(GroupedExperts.Config)}
    assert not any(hasattr(c, "recipe") for c in experts.values())  # no expert fqn holds "feed_forward"

    with pytest.raises(ValueError, match=r"MXLinearConverter\.Config\.recipe: unknown recipe 'mxfp9'"):
        MXLinearConverter.Config(recipe="mxfp9").build()
    with pytest.raises(ValueError, match="recipe 'none' converts nothing"):
        MXGroupedExpertsConverter.Config(recipe="none").build()
    with pytest.raises(ValueError, match="backend 'cublas' needs an NVIDIA GPU"):
        MXLinearConverter.Config(backend="cublas").build()
    with pytest.raises(ValueError, match="stochastic"):
        MXLinearConverter.Config(recipe="mxfp8", grad_rounding="stochastic").build()


@pytest.mark.parametrize("converter", [MXLinearConverter, MXGroupedExpertsConverter])
def test_converter_options_are_the_recipe_options_of_mx(converter):
    """The converters' config has recipe, skip and fqns, torchtitan's own fields, and the [mx] option keys with
    their defaults, all generated from the recipe dataclasses; each option reaches the recipe."""
    import dataclasses

    from torchtitan.components.quantization import QuantizationConverter

    from mx_recipe.formats.options import RECIPE_OPTIONS
    from mx_recipe.train.config import MXConfig

    theirs = {f.name for f in dataclasses.fields(QuantizationConverter.Config)}
    ours = {f.name: f.default for f in dataclasses.fields(converter.Config) if f.name not in theirs}
    mx_keys = {
        f.name: f.default for f in dataclasses.fields(MXConfig) if f.name not in ("recipe", "skip", "skip_replace")
    }
    assert set(ours) == {"recipe", "skip", "fqns"} | set(mx_keys) and set(mx_keys) == set(RECIPE_OPTIONS)
    assert {k: v for k, v in ours.items() if k in mx_keys} == mx_keys
    built = converter.Config(recipe="mxfp4_sr", grad_rounding="nearest", share_input_casts=False).build()
    assert built.recipe == MXRecipe.from_name("mxfp4_sr", grad_rounding="nearest", share_input_casts=False)
    with pytest.raises(ValueError, match=rf"{converter.__name__}\.Config\.save_mx_input: expected true or false"):
        converter.Config(save_mx_input="yes").build()


def test_the_adapter_does_not_import_the_training_loop():
    """The integration builds its recipe with the library's recipe_from_options, not train.py's [mx] config."""
    code = (
        "import sys, mx_recipe.integrations.torchtitan.config_registry; "
        "print(sorted(m for m in sys.modules if m.startswith('mx_recipe.train')))"
    )
    path = os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=os.environ | {"PYTHONPATH": path}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def _capture(model: torch.nn.Module, types: tuple[type, ...]) -> dict[str, dict]:
    """Record each module of ``types``: its inputs and output in forward, its output's and input's gradients."""
    seen: dict[str, dict] = {}
    for fqn, module in model.named_modules():
        if isinstance(module, types):

            def forward_hook(module, args, out, fqn=fqn):
                seen[fqn] = {"args": [a.detach().clone() for a in args], "out": out.detach().clone()}

            def backward_hook(module, grad_in, grad_out, fqn=fqn):
                seen[fqn] |= {"grad_out": grad_out[0].clone(), "grad_in": grad_in[0].clone()}

            module.register_forward_hook(forward_hook)
            module.register_full_backward_hook(backward_hook)
    return seen


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize(
    "base, recipe_name, n_experts",
    [
        ("llama3_debugmodel", "mxfp8", 0),
        ("llama3_debugmodel", "mxfp4", 0),
        ("deepseek_v3_debugmodel", "mxfp8_rceil", 1),
    ],
)
def test_converted_layers_are_bit_identical_to_ours_forward_and_backward(base, recipe_name, n_experts):
    """A bf16 torchtitan model with our converters, forward and backward on random tokens; every converted layer
    recomputed on its recorded inputs by our own code path (mx_linear; our GroupedExperts converted by
    convert_to_mx, holding the same weights) gives the same bits: output, input gradient, weight gradients."""
    model = build(cpu_model_config(f"{base}_{recipe_name}")).to(torch.bfloat16)  # two blocks
    recipe = MXRecipe.from_name(recipe_name)
    mx_experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert len(mx_experts) == n_experts and all(m.recipe == recipe for m in mx_experts)
    seen = _capture(model, (TorchTitanMXLinear, GroupedExperts))
    tokens = torch.randint(0, model.tok_embeddings.weight.shape[0], (2, 64), generator=torch.Generator().manual_seed(0))
    model(tokens).float().square().mean().backward()

    linears = {fqn: m for fqn, m in model.named_modules() if isinstance(m, TorchTitanMXLinear)}
    experts = {fqn for fqn, m in model.named_modules() if isinstance(m, GroupedExperts)}
    assert linears and set(linears) | experts == set(seen)
    for fqn, module in linears.items():
        rec = seen[fqn]
        x = rec["args"][0].requires_grad_()
        w = module.weight.detach().clone().requires_grad_()
        y = mx_linear(x, w, None, recipe)
        y.backward(rec["grad_out"])
        assert _same(y, rec["out"]), fqn
        assert _same(x.grad, rec["grad_in"]), fqn
        assert _same(w.grad, module.weight.grad), fqn

    for fqn, module in model.named_modules():
        if not isinstance(module, GroupedExperts):
            continue
        rec = seen[fqn]
        x, tokens_per_expert = rec["args"]
        ours = OurGroupedExperts(module.num_experts, module.w1_EFD.shape[2], module.w1_EFD.shape[1]).to(torch.bfloat16)
        with torch.no_grad():
            for name, theirs in (("w1", module.w1_EFD), ("w2", module.w2_EDF), ("w3", module.w3_EFD)):
                getattr(ours, name).copy_(theirs)
        convert_to_mx(ours, recipe, skip=(), log=False)
        x.requires_grad_()
        y = ours(x, tokens_per_expert.cumsum(0, dtype=torch.int32))
        y.backward(rec["grad_out"])
        assert _same(y, rec["out"]) and _same(x.grad, rec["grad_in"]), fqn
        for name, theirs in (("w1", module.w1_EFD), ("w2", module.w2_EDF), ("w3", module.w3_EFD)):
            assert _same(getattr(ours, name).grad, theirs.grad), f"{fqn}.{name}"


def test_state_dict_keys_are_unchanged_and_load_both_ways():
    """A bf16 torchtitan checkpoint loads into the converted model and back (strict): conversion renames nothing."""
    from torchtitan.models.deepseek_v3 import config_registry as deepseek_v3

    converted = build(cpu_model_config("deepseek_v3_debugmodel_mxfp8"))
    bf16_config = deepseek_v3.deepseek_v3_debugmodel().model_spec.model
    bf16_config.layers = bf16_config.layers[:2]
    plain = build(bf16_config, seed=1)
    assert list(converted.state_dict()) == list(plain.state_dict())
    converted.load_state_dict(plain.state_dict())
    plain.load_state_dict(converted.state_dict())
    for name, value in plain.state_dict().items():
        assert torch.equal(value, converted.state_dict()[name]), name


def _steps(args: list[str], nproc: int) -> list[float]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run([*launcher, STEPS_SCRIPT, *args], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["losses"]


@pytest.mark.slow
def test_fsdp2_activation_checkpointing_and_compile_of_torchtitan_train_our_layers():
    """torchtitan's apply_fsdp_to_decoder over 2 gloo processes with its selective activation checkpointing and
    per-block torch.compile (fullgraph), against 1 eager process with the same global batch: the same losses
    within 1e-3 relative (the ranks' half batches and the reductions round differently; measured about 2e-5).
    The MoE under FSDP2 and activation checkpointing (eager) too."""
    llama = "llama3_debugmodel_mxfp8"
    expected = _steps([llama, "--fsdp"], 1)
    assert _steps([llama, "--fsdp", "--ac", "--compile"], 2) == pytest.approx(expected, rel=1e-3)
    moe = "deepseek_v3_debugmodel_mxfp8"
    assert _steps([moe, "--fsdp", "--ac"], 2) == pytest.approx(_steps([moe, "--fsdp"], 1), rel=1e-3)
