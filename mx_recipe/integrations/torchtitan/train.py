"""torchtitan 0.2.x's own trainer on a model flavor with its layers cut, for runs of a large model's dimensions on a
few GPUs:

    torchrun --nproc_per_node=1 -m mx_recipe.integrations.torchtitan.train --layers 4 \\
        --job.config_file configs/torchtitan/llama3_8b_mxfp8.toml

torchtitan 0.2 has no flag for the layer count: the flavor (``--model.flavor``, a key of the model's args, such as
``llama3_args``) fixes it. ``--layers N`` keeps the flavor's first N blocks and every other dimension: its
``n_layers`` becomes N, and a model with leading dense blocks before its MoE blocks (DeepSeek-V3's
``n_dense_layers``: one in 16B) keeps them all, so N must exceed their count. The launcher parses the other
arguments as torchtitan does, registers the model's own train spec with the cut flavor under the model's name
(``register_train_spec``: torchtitan looks registered specs up before its own), then runs ``torchtitan.train``'s
``main`` on the other arguments. The trainer, its config, parallelism, compile, metrics and model converters are
torchtitan's; torchtitan's log shows the cut in the model args it builds (``n_layers``) and in its parameter count
and MFU. Without ``--layers`` it is ``python -m torchtitan.train``.

A bad ``--layers`` (below 1, above the flavor's layers, leaving no MoE block), an unknown model or flavor: one line
on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from typing import Any

import torchtitan

try:
    import torchtitan.train
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec, register_train_spec
    from torchtitan.tools.logging import init_logger, logger
except ImportError as e:  # torchtitan 0.3 names models by config functions: --module, --config
    raise ImportError(
        f"mx_recipe.integrations.torchtitan.train is for torchtitan 0.2.x; torchtitan "
        f"{getattr(torchtitan, '__version__', '?')} is installed ({e})"
    ) from e

PROG = "python -m mx_recipe.integrations.torchtitan.train"


class LayerCutError(ValueError):
    """A cut that cannot be made; its message is one line."""


def cut_layers(model_args: Any, layers: int, what: str) -> Any:
    """A copy of a flavor's model args with ``layers`` blocks (``what`` names the flavor in errors)."""
    total = getattr(model_args, "n_layers", None)
    if not isinstance(total, int):
        raise LayerCutError(f"{what} has no n_layers to cut")
    if layers < 1:
        raise LayerCutError(f"--layers must be at least 1, got {layers}")
    if layers > total:
        raise LayerCutError(f"--layers {layers}: {what} has {total} layers")
    dense = getattr(model_args, "n_dense_layers", 0)
    if dense and layers <= dense:
        raise LayerCutError(
            f"--layers {layers}: {what} keeps its {dense} dense layer{'s' if dense > 1 else ''} ahead of its MoE "
            f"layers, so --layers must be at least {dense + 1}"
        )
    cut = copy.deepcopy(model_args)  # torchtitan updates a flavor's args in place from the job config
    cut.n_layers = layers
    return cut


def register_cut(name: str, flavor: str, layers: int) -> tuple[int, int]:
    """Register model ``name``'s train spec with ``flavor`` cut to ``layers`` blocks; returns (layers, of total)."""
    try:
        spec = get_train_spec(name)
    except ValueError as e:
        raise LayerCutError(f"model.name {name!r}: {e}") from None
    if flavor not in spec.model_args:
        raise LayerCutError(f"{name} has no flavor {flavor!r} (it has {', '.join(spec.model_args)})")
    args = spec.model_args[flavor]
    cut = cut_layers(args, layers, f"{name} {flavor}")
    try:
        register_train_spec(name, dataclasses.replace(spec, model_args={**spec.model_args, flavor: cut}))
    except ValueError as e:  # a train spec of this name is registered already
        raise LayerCutError(f"model.name {name!r}: {e}") from None
    return layers, args.n_layers


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False)  # --help is torchtitan's
    parser.add_argument("--layers", type=int, help="keep the flavor's first N layers")
    ours, rest = parser.parse_known_args(argv)
    init_logger()
    if ours.layers is not None:
        config = ConfigManager().parse_args(rest)
        name, flavor = config.model.name, config.model.flavor
        try:
            layers, total = register_cut(name, flavor, ours.layers)
        except LayerCutError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        logger.info(f"{name} {flavor}: the first {layers} of its {total} layers (--layers {layers})")
    # torchtitan.train.main parses ConfigManager.parse_args's default argument, sys.argv[1:] as it was when
    # torchtitan was imported: it gets the arguments without ours.
    sys.argv[1:] = rest
    ConfigManager.parse_args.__defaults__ = (rest,)
    torchtitan.train.main(torchtitan.train.Trainer)


if __name__ == "__main__":
    main()
