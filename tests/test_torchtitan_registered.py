"""mx_recipe inside torchtitan 0.2.x (the installed package, CPU): the ``mx`` converter registered by name and the
``[mx]`` job-config section through torchtitan's own config manager, torchtitan's Llama 3 and DeepSeek-V3 debug
models converted (every linear and the experts; the router gates and the output layer left in bf16), the converted
layers bit-identical in forward and backward to ours on the same weights, state-dict keys unchanged, the
errors for a config the converter cannot serve, and the offline tokenizer and dataset of
scripts/torchtitan_assets.py read by torchtitan's own tokenizer and dataset classes.

CI runs this file in a second environment with torchtitan 0.2.2 (``.ci/run``); where torchtitan 0.3 is installed
it skips (``tests/test_torchtitan.py`` covers 0.3).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

torchtitan = pytest.importorskip("torchtitan", reason="torchtitan is a dev extra")
if not torchtitan.__version__.startswith("0.2"):  # noqa: SIM108
    pytest.skip(f"torchtitan {torchtitan.__version__}: this file tests the 0.2 line", allow_module_level=True)

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, deepseekv3_args  # noqa: E402
from torchtitan.models.llama3 import Transformer, llama3_args  # noqa: E402
from torchtitan.models.moe.moe import GroupedExperts  # noqa: E402
from torchtitan.protocols.model_converter import build_model_converters  # noqa: E402

from mx_recipe import MXRecipe  # noqa: E402
from mx_recipe.integrations.torchtitan import MXModelConverter  # noqa: E402
from mx_recipe.nn.grouped import mx_grouped_mm  # noqa: E402
from mx_recipe.nn.linear import MXLinear, mx_linear  # noqa: E402

MODULE = "mx_recipe.integrations.torchtitan.registered"


def job_config(*overrides: str):
    return ConfigManager().parse_args(["--job.custom_config_module", MODULE, "--model.converters", "mx", *overrides])


def parallel_dims(**kw) -> ParallelDims:
    dims = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1) | kw
    return ParallelDims(**dims)


def build(model_cls, args, *overrides: str, convert: bool = True) -> nn.Module:
    """The model as torchtitan's trainer builds it (its args updated from the job config), then converted."""
    config = job_config(*overrides)
    args = copy.deepcopy(args)
    args.update_from_config(config)
    torch.manual_seed(0)
    with torch.device("cpu"), torch.no_grad():
        model = model_cls(args)
        model.init_weights()
    if convert:
        build_model_converters(config, parallel_dims()).convert(model)
    return model


def test_the_config_manager_adds_the_mx_section_and_the_converter():
    config = job_config("--mx.recipe", "mxfp8_rceil", "--mx.skip", "output,layers.0.*")
    assert config.model.converters == ["mx"] and config.mx.recipe == "mxfp8_rceil"
    assert config.mx.skip == ["output", "layers.0.*"] and config.mx.fuse_expert_casts is True  # a recipe option
    (converter,) = build_model_converters(config, parallel_dims()).converters
    assert isinstance(converter, MXModelConverter) and converter.recipe == MXRecipe.from_name("mxfp8_rceil")


def test_llama_converts_every_linear_but_the_output_bit_for_bit():
    model = build(Transformer, llama3_args["debugmodel"])
    linears = {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert {fqn for fqn, m in linears.items() if not isinstance(m, MXLinear)} == {"output"}
    assert len(linears) == 1 + 6 * 7  # six blocks of wq, wk, wv, wo, w1, w2, w3
    lin = model.layers["0"].attention.wq
    x = torch.randn(2, 8, lin.in_features, requires_grad=True)
    y = lin(x)
    y.square().sum().backward()
    x_ref, w_ref = x.detach().clone().requires_grad_(), lin.weight.detach().clone().requires_grad_()
    y_ref = mx_linear(x_ref, w_ref, None, MXRecipe.from_name("mxfp8"))
    y_ref.square().sum().backward()
    assert torch.equal(y, y_ref) and torch.equal(x.grad, x_ref.grad) and torch.equal(lin.weight.grad, w_ref.grad)
    tokens = torch.randint(0, 2048, (2, 16))
    model(tokens).float().mean().backward()  # the whole model trains on the CPU


def test_deepseek_v3_experts_convert_and_match_our_grouped_gemms():
    model = build(DeepSeekV3Model, deepseekv3_args["debugmodel"], "--mx.recipe", "mxfp8")
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert len(experts) == 5 and all(type(e).__name__ == "MXGroupedExperts" for e in experts)
    plain = {fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, MXLinear)}
    assert plain == {"output", *(f"layers.{i}.moe.router.gate" for i in range(1, 6))}
    e = experts[0]
    counts = torch.tensor([5, 0, 9, 1, 0, 3, 7, 2])
    x = torch.randn(int(counts.sum()), e.w1.shape[-1], requires_grad=True)
    y = e(x, counts)
    y.float().square().sum().backward()
    recipe, offs = MXRecipe.from_name("mxfp8"), torch.cumsum(counts, 0, dtype=torch.int32)
    ws = [getattr(e, n).detach().clone().requires_grad_() for n in ("w1", "w2", "w3")]
    xr = x.detach().clone().requires_grad_()
    xb = xr.bfloat16()
    h = torch.nn.functional.silu(mx_grouped_mm(xb, ws[0].bfloat16(), offs, recipe)) * mx_grouped_mm(
        xb, ws[2].bfloat16(), offs, recipe
    )
    yr = mx_grouped_mm(h, ws[1].bfloat16(), offs, recipe).type_as(xr)
    yr.float().square().sum().backward()
    assert torch.equal(y, yr) and torch.equal(x.grad, xr.grad)
    for name, w in zip(("w1", "w2", "w3"), ws, strict=True):
        assert torch.equal(getattr(e, name).grad, w.grad), name
    # (the whole model does not run on the CPU: torchtitan 0.2.2's router counts tokens with histc of int64)


def test_state_dict_keys_are_unchanged_and_a_second_conversion_changes_nothing():
    plain = build(DeepSeekV3Model, deepseekv3_args["debugmodel"], convert=False)
    model = build(DeepSeekV3Model, deepseekv3_args["debugmodel"])
    assert list(model.state_dict()) == list(plain.state_dict())
    converter = MXModelConverter(job_config(), parallel_dims())
    converter.convert(model)
    assert all(r.reason.startswith("already") for r in converter.records if r.converted)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: MXModelConverter(ConfigManager().parse_args([]), parallel_dims()), "no [mx] section: add"),
        (lambda: MXModelConverter(job_config("--mx.recipe", "none"), parallel_dims()), "converts nothing"),
        (lambda: MXModelConverter(job_config(), parallel_dims(tp=2, world_size=2)), "tensor parallelism"),
        (lambda: MXModelConverter(job_config("--mx.recipe", "nosuch"), parallel_dims()), "nosuch"),
        (lambda: MXModelConverter(job_config("--mx.grad-rounding", "sideways"), parallel_dims()), "grad_rounding"),
    ],
)
def test_a_config_the_converter_cannot_serve_is_an_error(make, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        make()


def test_offline_assets_feed_torchtitans_own_tokenizer_and_dataset(tmp_path):
    """scripts/torchtitan_assets.py: torchtitan's HuggingFaceTokenizer loads the tokenizer (BOS added, EOS known)
    and its c4_test loader reads the corpus from the local path, as a run with no network does."""
    import subprocess
    import sys
    from pathlib import Path

    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "scripts/torchtitan_assets.py", "--out", str(tmp_path), "--vocab-size", "600",
           "--max-mib", "0.25"]  # fmt: skip
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    tokenizer = HuggingFaceTokenizer(str(tmp_path / "tokenizer"))
    assert tokenizer.get_vocab_size() == 600 and tokenizer.eos_id == tokenizer.tokenizer.token_to_id("<|end_of_text|>")
    ids = tokenizer.encode("def main():\n    pass\n", add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert tokenizer.decode(ids[1:-1]) == "def main():\n    pass\n"  # bytes round-trip
    dataset = HuggingFaceTextDataset("c4_test", str(tmp_path / "data"), tokenizer, seq_len=64)
    inputs, labels = next(iter(dataset))
    assert inputs["input"].shape == labels.shape == (64,) and int(inputs["input"][0]) == tokenizer.bos_id
    bad = subprocess.run([*cmd[:-4], "--vocab-size", "100"], cwd=root, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--vocab-size must be at least 258" in bad.stderr
