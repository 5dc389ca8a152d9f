"""The model to decode with: a train.py run's latest checkpoint (DCP, written at any world size), or a model
built at random for speed runs."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from mx_recipe.models import build_model, model_args
from mx_recipe.models.llama import Transformer
from mx_recipe.ops.device import shortfall
from mx_recipe.train.checkpoint import latest_checkpoint
from mx_recipe.train.config import Config, ConfigError, load_config
from mx_recipe.train.tokenizer import Tokenizer, build_tokenizer
from mx_recipe.train.trainer import padded_vocab_size


def _meta_model(name: str, flavor: str, vocab_size: int, max_len: int, device: torch.device, itemsize: int
                ) -> Transformer:  # fmt: skip
    """The model's shapes without memory; raises ValueError where its weights, ``itemsize`` bytes each, cannot fit
    in ``device``'s memory (on a CPU the OS would kill the process without a line)."""
    with torch.device("meta"):
        model = build_model(model_args(name, flavor, vocab_size, max_len))
    params = sum(p.numel() for p in model.parameters())
    what = f"{name} {flavor} ({params / 1e6:,.1f}M parameters, {itemsize} bytes each)"
    problem = shortfall(params * itemsize, device, what)
    if problem is not None:
        raise ValueError(problem)
    return model


def _check_holds(checkpoint: Path, model_state: dict[str, torch.Tensor], model: str) -> None:
    """Raise ValueError unless the checkpoint holds every tensor of ``model_state`` at its shape (the metadata
    only: a checkpoint of another model or size is named before DCP reads anything)."""
    saved = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    for name, tensor in model_state.items():
        meta = saved.get(f"model.{name}")
        size = getattr(meta, "size", None)
        if meta is None or (size is not None and tuple(size) != tuple(tensor.shape)):
            found = "has no such tensor" if meta is None else f"holds it as {list(size)}"
            raise ValueError(
                f"{checkpoint} is not a checkpoint of {model}, the model its config.toml names: {model} has "
                f"{name} {list(tensor.shape)}, the checkpoint {found}"
            )


def load_run(output_dir: str | Path, device: torch.device, max_len: int) -> tuple[Transformer, Tokenizer, Config]:
    """The model of the newest committed checkpoint of the train.py run in ``output_dir`` (fp32), its tokenizer and
    its config; RoPE tables for ``max_len`` positions. Raises ValueError naming what is missing, or where the fp32
    model cannot fit in ``device``'s memory."""
    output_dir = Path(output_dir)
    config_file = output_dir / "config.toml"
    if not config_file.is_file():
        raise ValueError(f"{output_dir}: no config.toml: not the job.output_dir of a train.py run")
    try:
        config = load_config(str(config_file))
    except ConfigError as e:
        raise ValueError(str(e)) from None
    checkpoint = latest_checkpoint(output_dir / config.checkpoint.folder)
    if checkpoint is None:
        raise ValueError(f"{output_dir}: no committed checkpoint under {config.checkpoint.folder}/")
    tokenizer = build_tokenizer(config.data.tokenizer)
    vocab = padded_vocab_size(tokenizer.vocab_size)
    model = _meta_model(config.model.name, config.model.flavor, vocab, max_len, device, 4).to_empty(device=device)
    state = {"model": model.state_dict()}
    _check_holds(checkpoint, state["model"], f"{config.model.name} {config.model.flavor}")
    # the model's tensors only; DCP reshards from any world size
    single = not torch.distributed.is_initialized()
    with warnings.catch_warnings():
        if single:  # one process is what this load asks for: DCP warns that it assumes so even when told
            warnings.filterwarnings("ignore", message="torch.distributed is .*to load in a single process")
        dcp.load(state, checkpoint_id=checkpoint, no_dist=single)
    model.load_state_dict(state["model"])
    model.init_rope()  # not in the state dict
    return model, tokenizer, config


def random_model(name: str, flavor: str, vocab_size: int, max_len: int, device: torch.device, seed: int = 0,
                 dtype: torch.dtype | None = None) -> Transformer:  # fmt: skip
    """A model of ``name``/``flavor`` with its training initialization from ``seed``: for speed runs (``dtype``:
    as ``init_random``'s). Raises ValueError where it cannot fit in ``device``'s memory."""
    itemsize = (dtype or torch.float32).itemsize
    return init_random(_meta_model(name, flavor, vocab_size, max_len, device, itemsize), device, seed, dtype)


@torch.no_grad()
def init_random(model: Transformer, device: torch.device, seed: int = 0, dtype: torch.dtype | None = None
                ) -> Transformer:  # fmt: skip
    """``model`` (on the meta device) materialized on ``device`` with its training initialization from ``seed``,
    the same values as ``init_weights`` gives; ``dtype``: then in the compute dtype (``to_compute_dtype``). Block
    by block, each cast as soon as it is initialized: the fp32 model is never whole in memory (an MoE 16B's fp32
    weights alone are 66 GB)."""
    torch.manual_seed(seed)
    for layer in model.layers.values():  # init_weights' order: the blocks, then the rest
        layer.to_empty(device=device)
        layer.init_weights()
        if dtype is not None:
            _parameters_to(layer, dtype)
    model.to_empty(device=device, recurse=False)  # the RoPE tables
    for name, child in model.named_children():
        if name != "layers":
            child.to_empty(device=device)
    model.init_root_weights()
    return to_compute_dtype(model, dtype) if dtype is not None else model


def _parameters_to(module: torch.nn.Module, dtype: torch.dtype) -> None:
    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None:
                sub._parameters[name] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)


@torch.no_grad()
def to_compute_dtype(model: Transformer, dtype: torch.dtype) -> Transformer:
    """Parameters and RoPE tables in ``dtype``, as training computed (FSDP2's mixed precision casts the
    parameters and the blocks' inputs); other buffers (the MoE's expert biases) stay fp32 as in training."""
    _parameters_to(model, dtype)
    model.rope_cos, model.rope_sin = model.rope_cos.to(dtype), model.rope_sin.to(dtype)
    return model
