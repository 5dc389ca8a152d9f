"""mx_recipe inside torchtitan 0.2.x (the installed package, CPU): the ``mx`` converter registered by name and the
``[mx]`` job-config section through torchtitan's own config manager, torchtitan's Llama 3 and DeepSeek-V3 debug
models converted (every linear and the experts; the router gates and the output layer left in bf16), the converted
layers bit-identical in forward and backward to ours on the same weights, state-dict keys unchanged, the
errors for a config the converter cannot serve, the offline tokenizer and dataset of scripts/torchtitan_assets.py
read by torchtitan's own tokenizer and dataset classes, and the launcher (mx_recipe.integrations.torchtitan.train)
with configs/torchtitan/: the flavor cut to --layers as torchtitan's trainer builds it (on the meta device: the
trainer itself needs CUDA), the rest of the command line torchtitan's, and its errors.

CI runs this file in a second environment with torchtitan 0.2.2 (``.ci/run``); where torchtitan 0.3 is installed
it skips (``tests/test_torchtitan.py`` covers 0.3).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

torchtitan = pytest.importorskip("torchtitan", reason="torchtitan is a dev extra")
if not torchtitan.__version__.startswith("0.2"):  # noqa: SIM108
    pytest.skip(f"torchtitan {torchtitan.__version__}: this file tests the 0.2 line", allow_module_level=True)

from torchtitan.config import ConfigManager, JobConfig  # noqa: E402
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


# --- the launcher: torchtitan's own trainer on a flavor with its layers cut ---

LAUNCHER = "mx_recipe.integrations.torchtitan.train"
CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs" / "torchtitan").glob("*.toml"))


class MetaTrainer:
    """Stands in for torchtitan's Trainer (which needs CUDA): builds the model as it does, on the meta device, from
    the train spec and flavor it looks up, and converts it."""

    built: list[tuple[JobConfig, nn.Module, int]] = []

    def __init__(self, job_config):
        from torchtitan.protocols.train_spec import get_train_spec

        spec = get_train_spec(job_config.model.name)
        args = spec.model_args[job_config.model.flavor]
        args.update_from_config(job_config)
        with torch.device("meta"):
            model = spec.model_cls(args)
        build_model_converters(job_config, parallel_dims()).convert(model)
        _, flops = args.get_nparams_and_flops(model, job_config.training.seq_len)
        MetaTrainer.built.append((job_config, model, flops))

    def train(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def launch(monkeypatch):
    """The launcher's main on argv, torchtitan's Trainer replaced by MetaTrainer; what it registers and patches is
    undone after the test. Returns the job config and model built."""
    import torchtitan.protocols.train_spec as train_spec
    import torchtitan.train

    from mx_recipe.integrations.torchtitan import train as launcher

    monkeypatch.setattr(train_spec, "_extra_train_specs", {})
    monkeypatch.setattr(ConfigManager.parse_args, "__defaults__", ConfigManager.parse_args.__defaults__)
    monkeypatch.setattr(torchtitan.train, "Trainer", MetaTrainer)
    monkeypatch.setattr(sys, "argv", ["train"])
    MetaTrainer.built = []

    def run(*argv: str):
        launcher.main(list(argv))
        (built,) = MetaTrainer.built
        return built

    return run


def test_layers_cut_llama3_8b_to_its_first_blocks_and_torchtitan_parses_the_rest(launch):
    config, model, flops = launch("--model.flavor", "8B", "--layers", "4", "--training.seq_len", "4096",
                                  "--job.custom_config_module", MODULE, "--model.converters", "mx")  # fmt: skip
    assert config.model.flavor == "8B" and config.training.seq_len == 4096 and sys.argv[1:] == [
        "--model.flavor", "8B", "--training.seq_len", "4096", "--job.custom_config_module", MODULE,
        "--model.converters", "mx",
    ]  # fmt: skip
    assert list(model.layers) == ["0", "1", "2", "3"] and model.layers["0"].attention.wq.weight.shape == (4096, 4096)
    assert isinstance(model.layers["3"].feed_forward.w1, MXLinear)  # the converter ran on the cut model
    assert llama3_args["8B"].n_layers == 32  # torchtitan's flavor itself is left as it is
    full = copy.deepcopy(llama3_args["8B"])
    with torch.device("meta"):
        _, full_flops = full.get_nparams_and_flops(Transformer(full), 4096)
    assert flops < full_flops / 4  # the cut's FLOPs are what MFU counts


def test_layers_keep_deepseek_v3s_dense_first_layer(launch):
    _, model, _ = launch("--layers", "4", "--model.name", "deepseek_v3", "--model.flavor", "16B")
    assert [block.moe_enabled for block in model.layers.values()] == [False, True, True, True]
    assert model.layers["1"].moe.experts.w1.shape == (64, 1408, 2048)
    assert deepseekv3_args["16B"].n_layers == 27


def test_without_layers_the_launcher_is_torchtitans_train(launch):
    _, model, _ = launch("--model.flavor", "debugmodel")
    assert len(model.layers) == llama3_args["debugmodel"].n_layers == 6


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_the_torchtitan_configs_build_their_cut_models(launch, config):
    job, model, _ = launch("--layers", "4", "--job.config_file", str(config))
    assert len(model.layers) == 4 and job.training.steps >= 100 and job.debug.seed is not None
    assert job.metrics.enable_tensorboard and not job.checkpoint.enable and job.activation_checkpoint.mode == "none"
    converted = any(isinstance(m, MXLinear) for m in model.modules())
    assert converted == config.stem.endswith("_mxfp8") == (job.model.converters == ["mx"])


def test_the_bf16_and_mxfp8_configs_of_a_model_differ_only_in_the_converter():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    by_model: dict[str, dict] = {}
    for path in CONFIGS:
        model, _, recipe = path.stem.rpartition("_")
        config = tomllib.loads(path.read_text())
        config["model"].pop("converters", None)
        config.pop("mx", None)
        job = config.pop("job")
        assert job["dump_folder"] == f"outputs/torchtitan/{path.stem}", path
        by_model.setdefault(model, {})[recipe] = config
    assert set(by_model) == {"llama3_8b", "deepseek_v3_16b"}
    for model, configs in by_model.items():
        assert configs["bf16"] == configs["mxfp8"], model


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layers", "0"], "--layers must be at least 1, got 0"),
        (["--layers", "33", "--model.flavor", "8B"], "--layers 33: llama3 8B has 32 layers"),
        (["--layers", "1", "--model.name", "deepseek_v3", "--model.flavor", "16B"], "--layers must be at least 2"),
        (["--layers", "2", "--model.name", "nosuch"], "model.name 'nosuch'"),
        (["--layers", "2", "--model.flavor", "9B"], "llama3 has no flavor '9B' (it has debugmodel,"),
        (["--layers", "two"], "argument --layers: invalid int value: 'two'"),
    ],
)
def test_bad_input_to_the_launcher_is_one_line_and_exit_status_2(launch, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        launch(*argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m mx_recipe.integrations.torchtitan.train: error: ") and message in err


def test_the_launcher_runs_as_a_module():
    """``python -m`` (as torchrun -m runs it): a bad --layers is one line on stderr before any training starts."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", LAUNCHER, "--layers", "7", "--model.flavor", "debugmodel"]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "python -m mx_recipe.integrations.torchtitan.train: error: --layers 7: llama3 debugmodel has 6 layers"
    ]
