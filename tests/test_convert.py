"""convert_to_mx: which layers it swaps, which it skips and why, the records and the logged table."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from mx_recipe.formats.recipe import RECIPES, MXRecipe
from mx_recipe.nn.convert import ConversionRecord, MXGroupedExperts, convert_to_mx, format_conversion_table
from mx_recipe.nn.linear import MXLinear
from mx_recipe.ops import gemm
from mx_recipe.ops.mx_backends import CublasBackend, EmulatedBackend

MXFP8 = RECIPES["mxfp8"]


class ScaledLinear(nn.Linear):
    """An nn.Linear subclass (converted like any nn.Linear, per convert_to_mx's docstring)."""


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(64, 64)
        self.wk = nn.Linear(64, 32, bias=False)
        self.wo = nn.Linear(64, 48)  # out_features 48: not a multiple of 32

    def forward(self, x):
        return self.wo(self.wq(x) + self.wk(x).repeat(1, 1, 2))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attention()
        self.proj = ScaledLinear(48, 64)  # in_features 48
        self.ffn = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), ScaledLinear(128, 64))

    def forward(self, x):
        x = x + self.proj(self.attention(x))
        return x + self.ffn(x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(10, 64)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(64)
        self.output = nn.Linear(64, 128)  # divisible: skipped only because of its name

    def forward(self, idx):
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


SIZE_REASON = "skipped: features not multiples of 32"
CONVERTED = "converted: mxfp8"
EMULATED = "emulated"  # the backend on the CPU


def expected_records(wq_skipped=False, output_skipped=True):
    rows = []
    for i in range(2):
        p = f"layers.{i}"
        wq = ("skipped: matches 'layers.*.attention.wq'", "") if wq_skipped else (CONVERTED, EMULATED)
        rows += [
            ConversionRecord(f"{p}.attention.wq", (64, 64), not wq_skipped, *wq),
            ConversionRecord(f"{p}.attention.wk", (32, 64), True, CONVERTED, EMULATED),
            ConversionRecord(f"{p}.attention.wo", (48, 64), False, SIZE_REASON),
            ConversionRecord(f"{p}.proj", (64, 48), False, SIZE_REASON),
            ConversionRecord(f"{p}.ffn.0", (128, 64), True, CONVERTED, EMULATED),
            ConversionRecord(f"{p}.ffn.2", (64, 128), True, CONVERTED, EMULATED),
        ]
    out = ("skipped: matches 'output'", False, "") if output_skipped else (CONVERTED, True, EMULATED)
    rows.append(ConversionRecord("output", (128, 64), out[1], out[0], out[2]))
    return rows


def linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_default_conversion_records_and_swaps():
    torch.manual_seed(0)
    model = Model()
    before = linears(model)
    params_before = dict(model.named_parameters())
    keys_before = list(model.state_dict())

    records = convert_to_mx(model, MXFP8, log=False)

    assert records == expected_records()
    after = linears(model)
    assert list(after) == list(before)
    for r in records:
        old, new = before[r.fqn], after[r.fqn]
        if r.converted:
            assert type(new) is MXLinear and new is not old
            assert new.recipe is MXFP8
            assert new.weight is old.weight and new.bias is old.bias  # shared, not copied
        else:
            assert new is old and type(new) is type(old)  # left exactly as it was
    assert type(model.layers[0].ffn[2]) is MXLinear  # the nn.Linear subclass is converted too
    assert type(model.layers[0].proj) is ScaledLinear  # skipped for its size, keeps its class

    # parameters: same objects under the same names; state_dict keys unchanged
    assert {n: id(p) for n, p in model.named_parameters()} == {n: id(p) for n, p in params_before.items()}
    assert list(model.state_dict()) == keys_before


def test_converted_model_runs_and_stays_close():
    torch.manual_seed(0)
    model = Model()
    idx = torch.randint(0, 10, (2, 32))
    ref = model(idx).detach()
    convert_to_mx(model, MXFP8, log=False)
    out = model(idx)
    out.sum().backward()
    rel = ((out.detach() - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.1
    assert model.layers[0].attention.wq.weight.grad is not None


def test_user_skip_patterns():
    model = Model()
    records = convert_to_mx(model, MXFP8, skip=["output", "layers.*.attention.wq"], log=False)
    assert records == expected_records(wq_skipped=True)
    assert type(model.layers[1].attention.wq) is nn.Linear


def test_user_skip_replaces_default():
    # an explicit skip list is the whole list: "output" is converted when it is not named
    model = Model()
    records = convert_to_mx(model, MXFP8, skip=[], log=False)
    assert records == expected_records(output_skipped=False)
    assert type(model.output) is MXLinear


def test_skip_pattern_is_fnmatch_on_the_full_fqn():
    model = Model()
    records = convert_to_mx(model, MXFP8, skip=["*.ffn.?", "attention.wk"], log=False)
    by_fqn = {r.fqn: r for r in records}
    assert by_fqn["layers.0.ffn.0"].reason == "skipped: matches '*.ffn.?'"
    assert by_fqn["layers.1.ffn.2"].reason == "skipped: matches '*.ffn.?'"
    assert by_fqn["layers.0.attention.wk"].converted  # "attention.wk" is not the fqn: no match
    assert by_fqn["output"].converted


def test_a_recipe_name_converts_as_the_named_recipe():
    """convert_to_mx(model, "mxfp8") used to fail with AttributeError: 'str' object has no attribute 'block_size'."""
    by_name, by_recipe = Model(), Model()
    assert convert_to_mx(by_name, "mxfp8", log=False) == convert_to_mx(by_recipe, MXFP8, log=False)
    assert by_name.layers[0].attention.wq.recipe == MXFP8
    with pytest.raises(ValueError, match=r"^convert_to_mx: unknown recipe 'mxfp9'; known: mxfp8, .*nvfp4"):
        convert_to_mx(Model(), "mxfp9")
    with pytest.raises(TypeError, match="recipe must be an MXRecipe, an NVFP4Recipe or a recipe's name, got 8"):
        convert_to_mx(Model(), 8)


def test_unmatched_skip_patterns_are_those_that_match_no_layer():
    from mx_recipe.nn.convert import unmatched_skip_patterns

    patterns = ["output", "layers.*.attention.wq", "layers.0.attention", "*router.gate"]
    assert unmatched_skip_patterns(Model(), patterns) == ["layers.0.attention", "*router.gate"]


def test_second_conversion_is_a_no_op_for_converted_layers():
    model = Model()
    convert_to_mx(model, MXFP8, log=False)
    again = convert_to_mx(model, MXFP8, log=False)
    assert [r.fqn for r in again] == [r.fqn for r in expected_records() if not r.converted]
    assert not any(r.converted for r in again)


def test_log_table(capsys):
    """Printed, so that a library user sees what was skipped without configuring logging."""
    model = Model()
    records = convert_to_mx(model, MXFP8)
    msgs = [capsys.readouterr().out.rstrip("\n")]
    lines = msgs[0].splitlines()
    assert "mxfp8" in lines[0]
    assert lines[1].split() == ["fqn", "shape", "result"]
    rows = lines[2:-1]
    assert len(rows) == len(records) == 13
    for line, r in zip(rows, records, strict=True):
        fqn, shape, *result = line.split()
        assert (fqn, shape, " ".join(result)) == (r.fqn, f"{r.shape[0]}x{r.shape[1]}", r.reason)
    assert "layers.0.attention.wo  48x64" in msgs[0]  # columns padded to one width
    assert lines[-1] == "8 of 13 layers converted (linear layers and expert groups)"
    assert format_conversion_table(records) == "\n".join(lines[1:])


def test_log_false_prints_nothing(capsys):
    convert_to_mx(Model(), MXFP8, log=False)
    assert capsys.readouterr().out == ""


def test_top_level_linear_and_empty_model():
    model = nn.Sequential(nn.Linear(32, 32))
    records = convert_to_mx(model, RECIPES["mxfp4"], log=False)
    assert records == [ConversionRecord("0", (32, 32), True, "converted: mxfp4", EMULATED)]
    assert type(model[0]) is MXLinear and model[0].recipe.name == "mxfp4"
    assert convert_to_mx(nn.ReLU(), MXFP8, log=False) == []
    assert format_conversion_table([]).splitlines()[-1] == "0 of 0 layers converted (linear layers and expert groups)"


def test_converted_layer_keeps_training_mode():
    # model.eval() before conversion: the swapped-in modules must be in eval mode too
    model = Model().eval()
    convert_to_mx(model, MXFP8, log=False)
    modes = {n: m.training for n, m in model.named_modules()}
    assert not any(modes.values()), [n for n, t in modes.items() if t]


def test_shared_linear_converted_everywhere():
    # one nn.Linear registered under two names (module tying): both names must see the MX version
    shared = nn.Linear(32, 32)
    model = nn.Module()
    model.a = shared
    model.b = shared
    convert_to_mx(model, MXFP8, log=False)
    assert type(model.a) is MXLinear
    assert model.b is model.a, f"model.b is still {type(model.b).__name__}"


@pytest.mark.parametrize("recipe", ["mxfp8_rceil", "mxfp4"])
def test_recipe_is_recorded(recipe):
    model = Model()
    records = convert_to_mx(model, RECIPES[recipe], log=False)
    assert {r.reason for r in records if r.converted} == {f"converted: {recipe}"}
    assert model.layers[0].ffn[0].recipe is RECIPES[recipe]


def _moe_model() -> nn.Module:
    from mx_recipe.models import build_model, model_args

    with torch.device("meta"):
        return build_model(model_args("moe", "debug_moe", vocab_size=320, max_seq_len=32))


def _backends(model: nn.Module) -> list:
    return [m.backend for m in model.modules() if isinstance(m, (MXLinear, MXGroupedExperts))]


def test_one_backend_object_for_the_model():
    model = _moe_model()
    records = convert_to_mx(model, MXFP8, log=False, device="cpu")
    backends = _backends(model)
    assert len(backends) == sum(r.converted for r in records) > 0
    assert all(b is backends[0] for b in backends) and type(backends[0]) is EmulatedBackend
    assert {r.backend for r in records if r.converted} == {"emulated"}


@pytest.mark.parametrize("experts", [False, True])
def test_backend_resolved_for_the_model_on_a_fake_sm100(monkeypatch, pretend_gpu, experts):
    """sm_100 with a torch that lacks the grouped MXFP8 kernel: a model with experts runs every
    layer emulated (dense ones included, as startup says), one without runs cublas."""
    pretend_gpu((10, 0))
    monkeypatch.setattr(gemm, "cublas_grouped_available", lambda d: False)
    model = _moe_model() if experts else Model()
    records = convert_to_mx(model, MXFP8, log=False, device="cuda:0")
    want = EmulatedBackend if experts else CublasBackend
    assert {type(b) for b in _backends(model)} == {want}
    assert {r.backend for r in records if r.converted} == {want.name}


def test_forced_backend_the_device_lacks_converts_nothing():
    model = Model()
    with pytest.raises(ValueError, match=r"backend 'cublas' needs .*sm_100"):
        convert_to_mx(model, MXRecipe.from_name("mxfp8", backend="cublas"), log=False, device="cpu")
    assert not any(isinstance(m, MXLinear) for m in model.modules())


def test_import_loads_no_model_zoo():
    code = "import sys, mx_recipe.nn.convert; sys.exit(any(m.startswith('mx_recipe.models') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
