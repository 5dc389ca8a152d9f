"""Training configuration: TOML files plus ``--section.key value`` overrides, validated strictly.

Every error names the key and the file (or the ``--section.key`` override that set it), so a bad run stops
before any model is built.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args, get_origin

from mx_recipe.formats.options import (
    RECIPE_OPTIONS,
    RecipeOptionError,
    check_option,
    recipe_from_options,
    recipe_option_fields,
)
from mx_recipe.nn.convert import DEFAULT_SKIP

if TYPE_CHECKING:
    from mx_recipe.formats.recipe import MXRecipe, NVFP4Recipe

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
DEFAULT_CONFIG = "debug_mxfp8"
REQUIRED: Any = object()  # sentinel default: the key must be given
AC_MODES = ("none", "selective", "full")
# torch.compile modes; "reduce-overhead" is refused by validate (training.cuda_graph captures the whole step)
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("auto", "on", "off")
CAST_ONCE_MODES = ("auto", "on", "off")


class ConfigError(ValueError):
    """A bad config; its message is one line naming the key and the file."""


def required() -> Any:
    return field(default=REQUIRED)


@dataclass
class JobConfig:
    output_dir: str = required()  # metrics, checkpoints and the resolved config go here
    seed: int = required()  # initial weights, data order and stochastic rounding, in [0, 2**32)
    description: str = ""  # free text, logged with the run


@dataclass
class ModelConfig:
    name: str = required()  # llama or moe
    flavor: str = required()  # the model size: debug, 1B, 8B, 70B (llama); debug_moe, moe_1B, moe_16B, moe_scout


@dataclass
class TrainingConfig:
    steps: int = required()  # optimizer steps of the whole run
    local_batch_size: int = required()  # sequences per microbatch on each GPU
    seq_len: int = required()  # tokens per sequence
    lr: float = required()  # peak learning rate of AdamW, after warm-up
    warmup_steps: int = required()  # linear warm-up steps, then cosine decay
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.1  # AdamW decoupled weight decay
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW epsilon
    max_norm: float = 1.0  # gradient-norm clipping; 0 turns it off
    gradient_accumulation_steps: int = 1  # microbatches of local_batch_size per optimizer step
    skip_nan_steps: int = 0  # skip up to this many steps with a NaN/Inf loss before stopping
    deterministic: bool = False  # torch.use_deterministic_algorithms: two runs give the same bits (slower)
    compute_dtype: str = "auto"  # auto (bf16 on CUDA and on CPUs with native bf16 matmul, else fp32), bf16, fp32
    cuda_graph: str = "auto"  # capture forward+backward in a CUDA graph: auto (on CUDA without FSDP2), on, off
    fused_adamw: bool = True  # AdamW as torch's fused kernels (false: its foreach AdamW; same state, other rounding)
    cast_weights_once: str = "auto"  # MX weight casts made once a step: auto (where reused, unsharded), on, off


@dataclass
class DataConfig:
    dataset: str = "python_stdlib"  # python_stdlib (offline), files (path glob), hf (Hugging Face, streaming)
    path: str = ""  # for files: a glob of .txt, .jsonl or .parquet files; a path given alone implies files
    hf_name: str = "allenai/c4"  # for hf: the dataset name on the Hugging Face hub
    hf_config: str = "en"  # for hf: the dataset configuration
    hf_split: str = "train"  # for hf: the split to stream
    text_field: str = "text"  # the text column of jsonl, parquet and hf rows
    tokenizer: str = "byte"  # byte, or the path of a Hugging Face tokenizer.json
    max_bytes: int = 64 * 2**20  # read at most this much of a local corpus
    validation_fraction: float = 0.01  # documents held out for validation


@dataclass
class ValidationConfig:
    enable: bool = False  # evaluate the held-out loss during training
    interval: int = 100  # steps between validations
    steps: int = 10  # batches per validation


@dataclass
class CheckpointConfig:
    enable: bool = False  # save checkpoints (one is saved on SIGTERM/SIGUSR1 regardless)
    interval: int = 500  # steps between checkpoints; one is also written at the end
    keep_latest_k: int = 3  # 0 keeps all
    folder: str = "checkpoints"  # under job.output_dir
    strict: bool = False  # stop at a damaged newest checkpoint instead of falling back to an older intact one
    allow_config_change: bool = False  # resume a checkpoint written under another [model] or [mx] config


_RECIPE_HELP = 'an MXRecipe name (mxfp8, mxfp4, ...), an NVFP4Recipe name (nvfp4, ...) or "none" (bf16)'
_SKIP_HELP = "fqn patterns left in bf16; a list given adds to these defaults (see mx.skip_replace)"
_SKIP_REPLACE_HELP = "a given mx.skip replaces the default patterns instead of adding to them"

# [mx]: the recipe's name, the converter's skip list, and one key per recipe option: the MXRecipe and NVFP4Recipe
# fields made with recipe.option (mx_recipe.formats.options), each key with the field's type, default and help
# (a generated class: config_help reads each key's help from its field's metadata).
MXConfig = dataclasses.make_dataclass(
    "MXConfig",
    [
        ("recipe", str, field(default=REQUIRED, metadata={"help": _RECIPE_HELP})),
        ("skip", list[str], field(default_factory=lambda: list(DEFAULT_SKIP), metadata={"help": _SKIP_HELP})),
        ("skip_replace", bool, field(default=False, metadata={"help": _SKIP_REPLACE_HELP})),
        *recipe_option_fields(),
    ],
)
MXConfig.__module__ = __name__  # for pickle and repr; make_dataclass takes module= only from Python 3.12


@dataclass
class MetricsConfig:
    log_freq: int = required()  # log loss, tokens/s, MFU and memory every this many steps
    tensorboard: bool = False  # event files under job.output_dir/tb
    wandb: bool = False  # offline mode when no API key is set
    wandb_project: str = "mx-recipe"  # the wandb project of the run


@dataclass
class CompileConfig:
    enable: bool = False  # torch.compile each transformer block
    mode: str = "default"  # torch.compile's mode: default, max-autotune-no-cudagraphs


@dataclass
class ActivationCheckpointConfig:
    mode: str = "none"  # none, selective (per op), full


@dataclass
class ParallelConfig:
    reshard_after_forward: bool = True  # FSDP2: free the gathered weights after forward (less memory)
    dp_replicate: int = 1  # HSDP: replicate x shard mesh; 1 is plain FSDP
    fsdp_on_one_device: bool = False  # FSDP2 also where a shard group is one rank (false: whole model, no FSDP2 copies)
    mx_all_gather: str = "auto"  # FSDP2 gathers MX weights as MX (e4m3/e2m1 + e8m0), not bf16: auto (off), on, off


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    mx: MXConfig = field(default_factory=MXConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    source: str = "<defaults>"  # the file the config came from, for messages
    overridden: frozenset[str] = frozenset()  # the keys set on the command line ("section.key"), for messages


_SECTION_TYPES: dict[str, type] = {
    "job": JobConfig,
    "model": ModelConfig,
    "training": TrainingConfig,
    "data": DataConfig,
    "validation": ValidationConfig,
    "checkpoint": CheckpointConfig,
    "mx": MXConfig,
    "metrics": MetricsConfig,
    "compile": CompileConfig,
    "activation_checkpoint": ActivationCheckpointConfig,
    "parallel": ParallelConfig,
}
_KEY_TYPES: dict[str, dict[str, Any]] = {
    name: {f.name: f.type for f in dataclasses.fields(cls)} for name, cls in _SECTION_TYPES.items()
}
_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "list[str]": list[str]}


def _key_comments(cls: type) -> dict[str, str]:
    """The one-line meaning of each key: its field's "help" metadata in a generated class ([mx]), else the
    comment after its field in the class's source."""
    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(cls) if "help" in f.metadata}
    if len(helps) == len(dataclasses.fields(cls)):
        return helps
    pattern = re.compile(r"^    (\w+): [^#]*#\s*(.+)$")
    comments = {m.group(1): m.group(2) for line in inspect.getsource(cls).splitlines() if (m := pattern.match(line))}
    return comments | helps


def config_help() -> str:
    """Every section and key with its type, default and meaning, for ``train.py --help``."""
    lines = ["config keys (in the TOML file, or on the command line as --section.key value):"]
    for section, cls in _SECTION_TYPES.items():
        lines.append(f"  [{section}]")
        comments = _key_comments(cls)
        for f in dataclasses.fields(cls):
            value = _default(f)
            default = "required" if value is REQUIRED else f"default {json.dumps(value)}"  # TOML spells these so
            kind = _type_name(_key_type(section, f.name)).removeprefix("an ").removeprefix("a ")
            lines.append(f"    {section}.{f.name} ({kind}, {default}): {comments.get(f.name, '')}".rstrip(": "))
    return "\n".join(lines)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def section_defaults(section: str) -> dict[str, Any]:
    """The default of each key of ``section`` that has one (a required key has none)."""
    fields = dataclasses.fields(_SECTION_TYPES[section])
    return {f.name: _default(f) for f in fields if _default(f) is not REQUIRED}


def _key_type(section: str, key: str) -> Any:
    annotation = _KEY_TYPES[section][key]
    return _TYPES[annotation] if isinstance(annotation, str) else annotation


def _type_name(tp: Any) -> str:
    if get_origin(tp) is list:
        return "a list of strings"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[tp]


def _check_value(value: Any, tp: Any) -> Any:
    """``value`` as type ``tp``, or raise TypeError. TOML already gives typed values."""
    if get_origin(tp) is list:
        (item,) = get_args(tp)
        if isinstance(value, list) and all(isinstance(v, item) for v in value):
            return list(value)
    elif tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):  # every float key is a rate, a ratio or a bound: nan and inf mean nothing
            raise TypeError(f"expected a finite number, got {value!r}")
        return float(value)
    elif tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif tp is bool and isinstance(value, bool):
        return value
    elif tp is str and isinstance(value, str):
        return value
    raise TypeError(f"expected {_type_name(tp)}, got {value!r}")


def _parse_override(text: str, tp: Any) -> Any:
    """A command-line string as type ``tp``."""
    if get_origin(tp) is list:
        return [s for s in (part.strip() for part in text.split(",")) if s]
    if tp is bool:
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise TypeError(f"expected true or false, got {text!r}")
    try:
        value = tp(text)
    except ValueError:
        raise TypeError(f"expected {_type_name(tp)}, got {text!r}") from None
    return _check_value(value, tp)  # the checks a TOML value gets (a finite float)


def resolve_config_path(name_or_path: str | None) -> Path:
    """A path as given, or NAME / NAME.toml under configs/."""
    name_or_path = name_or_path or DEFAULT_CONFIG
    path = Path(name_or_path)
    if _is_file(path):
        return path
    stem = name_or_path.removesuffix(".toml")
    candidate = CONFIG_DIR / f"{stem}.toml"
    if _is_file(candidate):
        return candidate
    known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.toml")))
    raise ConfigError(f"{name_or_path}: no such config file (and no configs/{stem}.toml; known: {known})")


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long for the file system, say: no such file
        return False


def parse_overrides(argv: list[str]) -> list[tuple[str, str]]:
    """``--section.key value`` and ``--section.key=value`` pairs, in order."""
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"command line: expected --section.key value, got {arg!r}")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"command line: {arg} needs a value")
            key, value = arg[2:], argv[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def load_config(name_or_path: str | None = None, overrides: list[tuple[str, str]] | None = None) -> Config:
    path = resolve_config_path(name_or_path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except UnicodeDecodeError as e:  # a binary file, or text in another encoding: TOML is UTF-8
        byte = e.object[e.start]
        raise ConfigError(f"{path}: not a TOML text file (byte {byte:#04x} at offset {e.start} is not UTF-8)") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror})") from None
    return build_config(data, str(path), overrides or [])


def build_config(data: dict[str, Any], source: str, overrides: list[tuple[str, str]]) -> Config:
    values: dict[str, dict[str, Any]] = {name: {} for name in _SECTION_TYPES}
    for section, table in data.items():
        if section not in _SECTION_TYPES:
            raise ConfigError(f"{source}: unknown section [{section}]; known: {', '.join(_SECTION_TYPES)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: '{section}' must be a table ([{section}])")
        for key, value in table.items():
            if key not in _KEY_TYPES[section]:
                raise ConfigError(f"{source}: unknown key '{section}.{key}'")
            try:
                values[section][key] = _check_value(value, _key_type(section, key))
            except TypeError as e:
                raise ConfigError(f"{source}: key '{section}.{key}': {e}") from None
    for dotted, text in overrides:
        section, _, key = dotted.partition(".")
        if section not in _SECTION_TYPES or key not in _KEY_TYPES[section]:
            known = [f"{s}.{k}" for s, keys in _KEY_TYPES.items() for k in keys]
            close = difflib.get_close_matches(dotted, known, n=1)
            hint = f" (did you mean --{close[0]}?)" if close else ""
            raise ConfigError(f"command line --{dotted}: unknown key '{dotted}'{hint}")
        try:
            values[section][key] = _parse_override(text, _key_type(section, key))
        except TypeError as e:
            raise ConfigError(f"command line --{dotted}: {e}") from None
    _imply(values)
    sections = {}
    for name, cls in _SECTION_TYPES.items():
        section = cls(**values[name])
        for f in dataclasses.fields(cls):
            if getattr(section, f.name) is REQUIRED:
                raise ConfigError(f"{source}: missing required key '{name}.{f.name}'")
        sections[name] = section
    config = Config(**sections, source=source, overridden=frozenset(dotted for dotted, _ in overrides))
    validate(config)
    return config


def _imply(values: dict[str, dict[str, Any]]) -> None:
    """What a key given alone means: a data.path reads files; an mx.skip list adds to the default patterns
    unless mx.skip_replace (so the output layer stays in bf16 when a user skips more)."""
    data, mx = values["data"], values["mx"]
    if data.get("path") and "dataset" not in data:
        data["dataset"] = "files"
    if "skip" in mx and not mx.get("skip_replace", False):
        mx["skip"] = list(dict.fromkeys([*DEFAULT_SKIP, *mx["skip"]]))  # in order, once each


def validate(config: Config) -> None:
    """Value checks beyond types, so that a bad run stops before any model is built."""
    # Imported here: the registries live in the library, the config only reads them.
    from mx_recipe.formats.recipe import NVFP4_RECIPES, RECIPES
    from mx_recipe.models import MODEL_FLAVORS
    from mx_recipe.train.parallel import COMPUTE_DTYPES

    src = config.source

    def fail(key: str, message: str) -> None:  # names the override when the value came from the command line
        where = f"command line --{key}" if key in config.overridden else f"{src}: key '{key}'"
        raise ConfigError(f"{where}: {message}")

    if not 0 <= config.job.seed < 2**32:  # what numpy's seeding takes
        fail("job.seed", f"must be in [0, 2**32), got {config.job.seed}")
    t = config.training
    for key in ("steps", "local_batch_size", "seq_len"):
        if getattr(t, key) <= 0:
            fail(f"training.{key}", f"must be positive, got {getattr(t, key)}")
    if t.warmup_steps < 0:
        fail("training.warmup_steps", f"must be >= 0, got {t.warmup_steps}")
    if t.lr <= 0:
        fail("training.lr", f"must be positive, got {t.lr}")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        fail("training.min_lr_ratio", f"must be in [0, 1], got {t.min_lr_ratio}")
    if t.max_norm < 0:
        fail("training.max_norm", f"must be >= 0, got {t.max_norm}")
    if t.compute_dtype != "auto" and t.compute_dtype not in COMPUTE_DTYPES:
        fail("training.compute_dtype", f"unknown dtype {t.compute_dtype!r}; known: auto, {', '.join(COMPUTE_DTYPES)}")
    if config.metrics.log_freq <= 0:
        fail("metrics.log_freq", f"must be positive, got {config.metrics.log_freq}")
    if config.model.name not in MODEL_FLAVORS:
        fail("model.name", f"unknown model {config.model.name!r}; known: {', '.join(sorted(MODEL_FLAVORS))}")
    flavors = MODEL_FLAVORS[config.model.name]
    if config.model.flavor not in flavors:
        fail("model.flavor", f"unknown {config.model.name} flavor {config.model.flavor!r}; known: {', '.join(flavors)}")
    if config.mx.recipe != "none" and config.mx.recipe not in RECIPES and config.mx.recipe not in NVFP4_RECIPES:
        known = ", ".join(["none", *RECIPES, *NVFP4_RECIPES])
        fail("mx.recipe", f"unknown recipe {config.mx.recipe!r}; known: {known}")
    try:  # the recipe's own checks (e.g. stochastic rounding needs e2m1 gradients), naming the key
        if config.mx.recipe == "none":  # the option keys go unused; a value no recipe takes is still an error
            for key, value in _mx_options(config.mx).items():
                check_option(key, value)
        else:
            build_mx_recipe(config.mx, config.job.seed)
    except RecipeOptionError as e:
        fail("mx" if e.key is None else f"mx.{e.key}", str(e))
    positive = [
        ("training.gradient_accumulation_steps", t.gradient_accumulation_steps),
        ("validation.interval", config.validation.interval),
        ("validation.steps", config.validation.steps),
        ("checkpoint.interval", config.checkpoint.interval),
        ("parallel.dp_replicate", config.parallel.dp_replicate),
    ]
    for key, value in positive:
        if value <= 0:
            fail(key, f"must be positive, got {value}")
    for key, value in (
        ("training.skip_nan_steps", t.skip_nan_steps),
        ("checkpoint.keep_latest_k", config.checkpoint.keep_latest_k),
    ):
        if value < 0:
            fail(key, f"must be >= 0, got {value}")
    if not 0.0 <= config.data.validation_fraction < 1.0:
        fail("data.validation_fraction", f"must be in [0, 1), got {config.data.validation_fraction}")
    _check_mx_all_gather(config, fail)
    if t.cuda_graph not in CUDA_GRAPH_MODES:
        fail("training.cuda_graph", f"unknown mode {t.cuda_graph!r}; known: {', '.join(CUDA_GRAPH_MODES)}")
    if t.cast_weights_once not in CAST_ONCE_MODES:
        fail(
            "training.cast_weights_once",
            f"unknown mode {t.cast_weights_once!r}; known: {', '.join(CAST_ONCE_MODES)}",
        )
    if config.compile.mode == "reduce-overhead":
        fail(
            "compile.mode",
            "reduce-overhead (CUDA graphs per block) re-records its graphs on every step, as each block mutates its "
            "inputs (the MoE's token counts, FSDP2's weights), and runs slower than default: use compile.mode "
            "default with training.cuda_graph, which captures the whole forward and backward",
        )
    if config.compile.mode not in COMPILE_MODES:
        fail("compile.mode", f"unknown mode {config.compile.mode!r}; known: {', '.join(COMPILE_MODES)}")
    if config.activation_checkpoint.mode not in AC_MODES:
        fail(
            "activation_checkpoint.mode",
            f"unknown mode {config.activation_checkpoint.mode!r}; known: {', '.join(AC_MODES)}",
        )
    if config.data.max_bytes <= t.seq_len + 1:
        fail("data.max_bytes", f"must exceed training.seq_len + 1, got {config.data.max_bytes}")
    if config.data.path and config.data.dataset != "files":
        fail(
            "data.path",
            f"{config.data.path!r} is read by data.dataset 'files' only, and data.dataset is "
            f"{config.data.dataset!r}: set data.dataset files, or leave data.path empty",
        )
    from mx_recipe.train.data import check_data_config
    from mx_recipe.train.metrics import check_metrics_config

    # (key, message) of a bad data source, tokenizer or missing logging package, or None
    for problem in (check_data_config(config.data), check_metrics_config(config.metrics)):
        if problem is not None:
            fail(*problem)


def _check_mx_all_gather(config: Config, fail) -> None:
    """parallel.mx_all_gather: a known mode, and "on" only where the config allows it (mx_all_gather.py says why)."""
    from mx_recipe.train.mx_all_gather import MODES, config_problem

    mode = config.parallel.mx_all_gather
    if mode not in MODES:
        fail("parallel.mx_all_gather", f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    if mode != "on":
        return
    recipe = build_mx_recipe(config.mx, config.job.seed)
    problem = config_problem(recipe, config.activation_checkpoint.mode, config.parallel.reshard_after_forward)
    if problem is not None:
        key, why = problem
        fail("parallel.mx_all_gather", f"is on, but {key}: {why}")


def _mx_options(mx: MXConfig) -> dict[str, Any]:
    """The recipe options of [mx], by name."""
    return {key: getattr(mx, key) for key in RECIPE_OPTIONS}


def build_mx_recipe(mx: MXConfig, seed: int = 0) -> MXRecipe | NVFP4Recipe | None:
    """The recipe that [mx] describes, or None for recipe "none": the named recipe with the option keys set
    (``recipe_from_options``; a key at its default keeps the recipe's value, and an option of the other recipe
    class must stay at its default), and ``seed`` (the run's job.seed) for NVFP4's Hadamard signs. A bad value
    is a RecipeOptionError (a ValueError) whose ``key`` names the option."""
    if mx.recipe == "none":
        return None
    return recipe_from_options(mx.recipe, _mx_options(mx), seed)


def config_to_dict(config: Config) -> dict[str, dict[str, Any]]:
    return {name: dataclasses.asdict(getattr(config, name)) for name in _SECTION_TYPES}


def config_to_toml(config: Config) -> str:
    """The resolved config as TOML (flat sections of strings, numbers, bools and string lists)."""

    def fmt(value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, str):
            return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(value, list):
            return "[" + ", ".join(fmt(v) for v in value) + "]"
        return repr(value)

    lines = [f"# resolved from {config.source}"]
    for section, table in config_to_dict(config).items():
        lines.append(f"\n[{section}]")
        lines.extend(f"{key} = {fmt(value)}" for key, value in table.items())
    return "\n".join(lines) + "\n"
