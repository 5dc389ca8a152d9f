"""Strict configs: every bad key, section or type stops the run with one line naming it."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from mx_recipe.train.config import (
    CONFIG_DIR,
    ConfigError,
    build_config,
    config_to_toml,
    load_config,
    parse_overrides,
    resolve_config_path,
)

REPO = Path(__file__).resolve().parents[1]
MINIMAL = {
    "job": {"output_dir": "out", "seed": 0},
    "model": {"name": "llama", "flavor": "debug"},
    "training": {"steps": 2, "local_batch_size": 2, "seq_len": 64, "lr": 1e-3, "warmup_steps": 1},
    "mx": {"recipe": "mxfp8"},
    "metrics": {"log_freq": 1},
}


def _with(section: str, key: str, value) -> dict:
    data = {s: dict(t) for s, t in MINIMAL.items()}
    data.setdefault(section, {})[key] = value
    return data


def test_every_shipped_config_loads():
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))
    assert {"debug_bf16", "debug_mxfp8", "llama_bf16", "llama_mxfp8"} <= set(names)
    for name in names:
        config = load_config(name)
        assert config.source.endswith(f"{name}.toml")


def test_name_resolution_with_and_without_suffix():
    assert resolve_config_path("debug_bf16") == resolve_config_path("debug_bf16.toml")
    assert resolve_config_path(None).stem == "debug_mxfp8"
    with pytest.raises(ConfigError, match="no_such_config"):
        resolve_config_path("no_such_config")


def test_minimal_config_and_defaults():
    config = build_config(MINIMAL, "mem.toml", [])
    assert config.training.weight_decay == 0.1 and config.mx.skip == ["output", "*router.gate"]
    assert config.training.lr == 1e-3


@pytest.mark.parametrize(
    "data, message",
    [
        (_with("bogus", "x", 1), r"mem.toml: unknown section \[bogus\]"),
        (_with("training", "stepz", 1), r"mem.toml: unknown key 'training.stepz'"),
        (_with("training", "steps", "10"), r"mem.toml: key 'training.steps': expected an integer"),
        (_with("training", "steps", 1.5), r"key 'training.steps'"),
        (_with("training", "steps", True), r"key 'training.steps'"),
        (_with("training", "lr", "fast"), r"key 'training.lr': expected a number"),
        (_with("mx", "skip", "output"), r"key 'mx.skip': expected a list of strings"),
        (_with("mx", "recipe", "mxfp9"), r"key 'mx.recipe': unknown recipe 'mxfp9'"),
        (_with("mx", "backend", "tpu"), r"key 'mx.backend'"),
        (_with("mx", "save_mx_input", "yes"), r"key 'mx.save_mx_input': expected true or false"),
        (_with("mx", "grad_rounding", "random"), r"key 'mx.grad_rounding': MXRecipe\.grad_rounding='random': expected"),
        (_with("mx", "backend", 3), r"mem.toml: key 'mx.backend': expected a string, got 3"),
        (_with("mx", "hadamard_seed", 1), r"mem.toml: unknown key 'mx.hadamard_seed'"),  # from job.seed
        (_with("mx", "forward", "e2m1"), r"mem.toml: unknown key 'mx.forward'"),  # defines a recipe: not an option
        (
            _with("mx", "recipe", "nvfp4") | {"mx": {"recipe": "nvfp4", "fuse_x_casts": False}},
            r"mem.toml: key 'mx.fuse_x_casts': is an MX cast option; recipe 'nvfp4' is an NVFP4Recipe",
        ),
        (
            _with("mx", "recipe", "nvfp4") | {"mx": {"recipe": "nvfp4", "grad_rounding": "even"}},
            r"mem.toml: key 'mx.grad_rounding': NVFP4Recipe\.grad_rounding='even'.*\(recipe 'nvfp4'\)",
        ),
        (
            _with("mx", "recipe", "none") | {"mx": {"recipe": "none", "backend": "tpu"}},  # unused, still checked
            r"mem.toml: key 'mx.backend': MXRecipe\.backend='tpu'.*; NVFP4Recipe\.backend='tpu'",
        ),
        (_with("mx", "grad_rounding", "stochastic"), r"key 'mx.grad_rounding': .*needs grad='e2m1'.*'mxfp8'"),
        (
            _with("mx", "save_mx_input", True) | {"mx": {"recipe": "mxfp8_wgrad_bf16", "save_mx_input": True}},
            r"key 'mx.save_mx_input': .*needs an MX grad_weight",
        ),
        (_with("mx", "fuse_x_casts", 1), r"key 'mx.fuse_x_casts': expected true or false"),
        (_with("mx", "fuse_expert_casts", "on"), r"key 'mx.fuse_expert_casts': expected true or false"),
        (_with("model", "flavor", "13B"), r"key 'model.flavor': unknown llama flavor '13B'"),
        (_with("training", "steps", 0), r"key 'training.steps': must be positive"),
        (_with("training", "lr", float("nan")), r"key 'training.lr': expected a finite number, got nan"),
        (_with("training", "lr", float("inf")), r"key 'training.lr': expected a finite number, got inf"),
        (_with("training", "max_norm", float("-inf")), r"key 'training.max_norm': expected a finite number"),
        (_with("job", "seed", -1), r"key 'job.seed': must be in \[0, 2\*\*32\), got -1"),
        (_with("metrics", "log_freq", -1), r"key 'metrics.log_freq'"),
        (_with("activation_checkpoint", "mode", "some"), r"key 'activation_checkpoint.mode': unknown mode 'some'"),
        (_with("training", "gradient_accumulation_steps", 0), r"key 'training.gradient_accumulation_steps'"),
        (_with("checkpoint", "keep_latest_k", -1), r"key 'checkpoint.keep_latest_k'"),
        (_with("compile", "enable", "yes"), r"key 'compile.enable': expected true or false"),
        (_with("compile", "mode", "fast"), r"key 'compile.mode': unknown mode 'fast'; known: default, max-autotune"),
        (_with("compile", "mode", "reduce-overhead"), r"key 'compile.mode': reduce-overhead .* training.cuda_graph"),
        (_with("training", "cuda_graph", "yes"), r"key 'training.cuda_graph': unknown mode 'yes'"),
        (_with("mx", "share_input_casts", "no"), r"key 'mx.share_input_casts': expected true or false"),
        (_with("data", "validation_fraction", 1.0), r"key 'data.validation_fraction'"),
        (_with("data", "dataset", "imagenet"), r"key 'data.dataset': unknown dataset 'imagenet'"),
        (
            _with("data", "path", "/no/such/dir/*.txt") | {"data": {"dataset": "files", "path": "/no/such/*.txt"}},
            r"key 'data.path'",
        ),
        (_with("data", "tokenizer", "/no/such/tokenizer.json"), r"key 'data.tokenizer'"),
    ],
)
def test_bad_values_name_the_key_and_file(data, message):
    with pytest.raises(ConfigError, match=message):
        build_config(data, "mem.toml", [])


@pytest.mark.parametrize("missing", ["job.output_dir", "job.seed", "training.lr", "model.flavor", "mx.recipe"])
def test_required_keys(missing):
    section, key = missing.split(".")
    data = {s: dict(t) for s, t in MINIMAL.items()}
    del data[section][key]
    with pytest.raises(ConfigError, match=rf"mem.toml: missing required key '{missing}'"):
        build_config(data, "mem.toml", [])


def test_overrides_are_typed():
    pairs = parse_overrides(["--training.steps", "7", "--training.lr=0.5", "--mx.skip", "output,layers.0.*"])
    config = build_config(MINIMAL, "mem.toml", pairs)
    assert config.training.steps == 7 and config.training.lr == 0.5
    assert config.mx.skip == ["output", "*router.gate", "layers.0.*"]  # added to the defaults
    with pytest.raises(ConfigError, match=r"^command line --training.steps: expected an integer, got 'many'$"):
        build_config(MINIMAL, "mem.toml", parse_overrides(["--training.steps", "many"]))
    with pytest.raises(ConfigError, match=r"unknown key 'training.nope'"):
        build_config(MINIMAL, "mem.toml", parse_overrides(["--training.nope", "1"]))
    for bad in ("nan", "inf", "-inf"):  # as users type them: a config error, not a traceback or a NaN run
        with pytest.raises(ConfigError, match=rf"--training.lr: expected a finite number, got {bad}"):
            build_config(MINIMAL, "mem.toml", parse_overrides(["--training.lr", bad]))
    with pytest.raises(ConfigError, match=r"command line --job.seed: must be in"):
        build_config(MINIMAL, "mem.toml", parse_overrides(["--job.seed", "-1"]))
    with pytest.raises(ConfigError, match="needs a value"):
        parse_overrides(["--training.steps"])
    with pytest.raises(ConfigError, match="expected --section.key"):
        parse_overrides(["steps"])


def test_an_error_in_an_override_names_the_override_not_the_file():
    """A value from the command line that fails a check names --section.key; the same value in the file names the
    file; an unknown override says which key was probably meant."""
    with pytest.raises(ConfigError, match=r"^command line --training.lr: must be positive, got -1.0$"):
        build_config(MINIMAL, "mem.toml", parse_overrides(["--training.lr", "-1"]))
    with pytest.raises(ConfigError, match=r"^mem.toml: key 'training.lr': must be positive, got -1.0$"):
        build_config(_with("training", "lr", -1.0), "mem.toml", [])
    with pytest.raises(
        ConfigError, match=r"^command line --training.stepz: unknown key .*did you mean --training.steps"
    ):
        build_config(MINIMAL, "mem.toml", parse_overrides(["--training.stepz", "3"]))


def test_a_data_path_given_alone_reads_files(tmp_path):
    """data.path without data.dataset means dataset files (it used to train on the stdlib corpus, silently); with
    another dataset named, it is an error naming both keys."""
    (tmp_path / "a.txt").write_text("some text")
    (tmp_path / "b.txt").write_text("more text")
    pattern = str(tmp_path / "*.txt")
    config = build_config(MINIMAL, "mem.toml", parse_overrides(["--data.path", pattern]))
    assert config.data.dataset == "files" and config.data.path == pattern
    overrides = parse_overrides(["--data.path", pattern, "--data.dataset", "python_stdlib"])
    with pytest.raises(ConfigError, match=r"^command line --data.path: .* data.dataset is 'python_stdlib': set data"):
        build_config(MINIMAL, "mem.toml", overrides)


def test_mx_skip_adds_to_the_default_patterns_unless_told_to_replace_them(tmp_path):
    """A given mx.skip keeps the output layer and router gates in bf16 (it used to replace them, converting the
    output layer); mx.skip_replace true makes it the whole list. The resolved config loads to itself."""
    added = build_config(MINIMAL, "mem.toml", parse_overrides(["--mx.skip", "layers.0.*"]))
    assert added.mx.skip == ["output", "*router.gate", "layers.0.*"] and not added.mx.skip_replace
    in_file = build_config(_with("mx", "skip", ["layers.0.*", "output"]), "mem.toml", [])
    assert in_file.mx.skip == ["output", "*router.gate", "layers.0.*"]
    replaced = build_config(MINIMAL, "mem.toml", parse_overrides(["--mx.skip", "layers.0.*", "--mx.skip_replace", "1"]))
    assert replaced.mx.skip == ["layers.0.*"]
    nothing = build_config(MINIMAL, "mem.toml", parse_overrides(["--mx.skip=", "--mx.skip_replace", "true"]))
    assert nothing.mx.skip == []
    for config in (added, replaced, nothing):
        (tmp_path / "config.toml").write_text(config_to_toml(config))
        assert load_config(str(tmp_path / "config.toml")).mx.skip == config.mx.skip


def test_a_config_file_that_is_not_utf8_text_is_one_line(tmp_path):
    binary = tmp_path / "model.toml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(ConfigError, match=rf"^{binary}: not a TOML text file \(byte 0x89 at offset 0 is not UTF-8\)$"):
        load_config(str(binary))
    with pytest.raises(ConfigError, match="no such config file"):  # longer than a file name may be
        load_config("x" * 300)


def test_resolved_config_round_trips(tmp_path):
    config = build_config(MINIMAL, "mem.toml", parse_overrides(["--job.description", 'say "hi"']))
    path = tmp_path / "config.toml"
    path.write_text(config_to_toml(config))
    again = load_config(str(path))
    assert config_to_toml(again).splitlines()[1:] == config_to_toml(config).splitlines()[1:]


def test_train_py_bad_config_is_one_line_and_nonzero(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text((CONFIG_DIR / "debug_mxfp8.toml").read_text().replace("seq_len = 256", "seq_len = 256\nseq_lem = 3"))
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--config", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"config error: {bad}: unknown key 'training.seq_lem'"]
    assert "Traceback" not in proc.stderr and not (tmp_path / "outputs").exists()


def test_mx_keys_build_the_recipe():
    """[mx] save_mx_input and grad_rounding set the MXRecipe fields; an empty grad_rounding keeps the
    named recipe's; with recipe "none" there is no recipe and the keys go unused (as mx.backend)."""
    from mx_recipe.train.config import build_mx_recipe

    config = build_config(_with("mx", "save_mx_input", True), "mem.toml", [])
    recipe = build_mx_recipe(config.mx)
    assert (recipe.name, recipe.save_mx_input, recipe.grad_rounding) == ("mxfp8", True, "nearest")
    assert build_mx_recipe(build_config(MINIMAL, "mem.toml", []).mx).save_mx_input is False
    assert build_mx_recipe(build_config(_with("mx", "fuse_x_casts", False), "mem.toml", []).mx).fuse_x_casts is False
    assert build_mx_recipe(build_config(MINIMAL, "mem.toml", []).mx).fuse_x_casts is True
    fused = build_config(_with("mx", "fuse_expert_casts", True), "mem.toml", [])
    assert build_mx_recipe(fused.mx).fuse_expert_casts is True

    sr = {**MINIMAL, "mx": {"recipe": "mxfp4_sr"}}
    assert build_mx_recipe(build_config(sr, "mem.toml", []).mx).grad_rounding == "stochastic"
    pairs = parse_overrides(["--mx.grad_rounding", "nearest", "--mx.save_mx_input", "true", "--mx.backend", "emulated"])
    recipe = build_mx_recipe(build_config(sr, "mem.toml", pairs).mx)
    assert (recipe.grad_rounding, recipe.save_mx_input, recipe.backend) == ("nearest", True, "emulated")
    pairs = parse_overrides(["--mx.recipe", "mxfp4", "--mx.grad_rounding", "stochastic"])
    assert build_mx_recipe(build_config(MINIMAL, "mem.toml", pairs).mx).grad_rounding == "stochastic"

    none = {**MINIMAL, "mx": {"recipe": "none", "save_mx_input": True, "grad_rounding": "stochastic"}}
    assert build_mx_recipe(build_config(none, "mem.toml", []).mx) is None


def test_mx_keys_are_the_recipe_options():
    """[mx] is recipe, skip and skip_replace plus one key per option field of MXRecipe and NVFP4Recipe, with the
    field's type and default ("" where the named recipes differ: keep the recipe's), so a new option field is a
    new key."""
    import dataclasses
    import typing

    from mx_recipe.formats.options import KEEP
    from mx_recipe.formats.recipe import NVFP4_RECIPES, OPTION, RECIPES, MXRecipe, NVFP4Recipe
    from mx_recipe.train.config import MXConfig

    keys = {f.name: f for f in dataclasses.fields(MXConfig)}
    option_fields = {}
    for kind, registry in ((MXRecipe, RECIPES), (NVFP4Recipe, NVFP4_RECIPES)):
        hints = typing.get_type_hints(kind)
        for f in dataclasses.fields(kind):
            if OPTION in f.metadata:
                values = {f.default} | {getattr(r, f.name) for r in registry.values()}
                assert keys[f.name].type is hints[f.name], f.name
                assert keys[f.name].default in ({KEEP} if len(values) > 1 else {f.default}), f.name
                option_fields[f.name] = f
    assert set(keys) == {"recipe", "skip", "skip_replace"} | set(option_fields)
    assert {"backend", "grad_rounding", "save_mx_input", "fuse_x_casts", "share_input_casts"} <= set(option_fields)


def test_a_checkpoints_mx_table_still_loads_and_builds_the_named_recipe():
    """The [mx] table as config.toml has been written (every key, this order) builds each named recipe as it is;
    NVFP4's Hadamard seed is job.seed. An error in an override on the command line names the override."""
    from mx_recipe.formats.recipe import NVFP4_RECIPES, RECIPES
    from mx_recipe.train.config import build_mx_recipe

    written = {
        "backend": "auto",
        "skip": ["output", "*router.gate"],
        "save_mx_input": False,
        "fuse_x_casts": True,
        "fuse_expert_casts": True,  # false in tables written before it was on by default: off, same bits
        "share_input_casts": True,
        "grad_rounding": "",
    }
    for name, expected in (RECIPES | NVFP4_RECIPES).items():
        data = {**MINIMAL, "job": {"output_dir": "out", "seed": 9}, "mx": {"recipe": name, **written}}
        recipe = build_mx_recipe(build_config(data, "config.toml", []).mx, seed=9)
        assert recipe == (dataclasses.replace(expected, hadamard_seed=9) if name in NVFP4_RECIPES else expected)
    with pytest.raises(ConfigError, match=r"command line --mx.fuse_x_casts: expected true"):
        build_config(MINIMAL, "mem.toml", parse_overrides(["--mx.fuse_x_casts", "maybe"]))
    overrides = parse_overrides(["--mx.recipe", "nvfp4", "--mx.share_input_casts", "false"])
    with pytest.raises(ConfigError, match=r"command line --mx.share_input_casts: is an MX cast option"):
        build_config(MINIMAL, "mem.toml", overrides)


def test_help_lists_every_key_with_type_default_and_meaning():
    """train.py --help is generated from the config classes: each key, its type, its default, one line of meaning."""
    import dataclasses
    import subprocess
    import sys

    from mx_recipe.train.config import _SECTION_TYPES

    out = subprocess.run([sys.executable, "train.py", "--help"], cwd=REPO, capture_output=True, text=True).stdout
    for section, cls in _SECTION_TYPES.items():
        assert f"  [{section}]" in out
        for f in dataclasses.fields(cls):
            (line,) = [ln for ln in out.splitlines() if ln.strip().startswith(f"{section}.{f.name} (")]
            assert "required" in line or "default " in line, line
            assert line.split("): ", 1)[1].strip(), f"{section}.{f.name} has no meaning in --help"
    assert "training.lr (number, required): peak learning rate" in out
    assert 'mx.skip (list of strings, default ["output", "*router.gate"])' in out
    from mx_recipe.formats.options import RECIPE_OPTIONS

    for name, option in RECIPE_OPTIONS.items():  # the help of the recipe's field
        assert f"mx.{name} (" in out and f"): {option.help}\n" in out, name
    assert 'mx.grad_rounding (string, default ""): how gradients round' in out
