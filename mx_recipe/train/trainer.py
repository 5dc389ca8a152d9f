"""The training loop: build, convert to MX, shard, resume, train, validate, checkpoint, log.

A run is a function of its config: the initial weights come from the seed, the batches from the
data position, everything else from the checkpoint it resumes from. So a run stopped and resumed
logs the same losses as one that never stopped (exactly, on CPU).
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from mx_recipe.models import build_model, flops_per_token, model_args, moe_layers
from mx_recipe.models.llama import LlamaArgs
from mx_recipe.nn.convert import DEFAULT_SKIP, convert_to_mx, format_conversion_table, unmatched_skip_patterns
from mx_recipe.ops.device import shortfall
from mx_recipe.train.checkpoint import (
    CONFIG,
    DCP_ERRORS,
    Checkpointer,
    CheckpointSaveError,
    TrainState,
    committed_checkpoints,
    latest_checkpoint,
)
from mx_recipe.train.config import (
    Config,
    TrainingConfig,
    build_mx_recipe,
    config_to_dict,
    config_to_toml,
    section_defaults,
)
from mx_recipe.train.data import build_datasets
from mx_recipe.train.faults import fault_hooks
from mx_recipe.train.lock import RunLock
from mx_recipe.train.metrics import MetricsLogger, peak_memory_gib
from mx_recipe.train.mixed_precision import compute_weights
from mx_recipe.train.mx_all_gather import (
    AUTO_ON,
    apply_mx_all_gather,
    config_problem,
    describe_all_gather,
    format_gather_report,
)
from mx_recipe.train.parallel import (
    COMPUTE_DTYPES,
    DistInfo,
    all_reduce_mean,
    apply_activation_checkpointing,
    apply_compile,
    build_mesh,
    materialize_and_shard,
    materialize_unsharded,
    reshard,
    resolve_compute_dtype,
)
from mx_recipe.train.step import TrainStep, can_capture

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class TrainingError(RuntimeError):
    """Stops the run with one line on stderr and ``exit_code``."""

    exit_code = 1


class SetupError(TrainingError):
    """A run that cannot start; raised before any model is built where possible."""

    exit_code = 2


class NonFiniteLossError(TrainingError):
    pass


class SetupStopped(TrainingError):
    """A stop signal during set-up: the run ends before its first step, with exit 0 so that SLURM requeues it."""

    exit_code = 0


class StopSignals:
    """SIGTERM and SIGUSR1 only set a flag: the loop checks it at each step boundary (all ranks
    agree through an all-reduce), saves a checkpoint and returns, so SLURM can requeue the job;
    set-up checks it between its stages. Entered again while entered, it keeps its handler."""

    def __init__(self) -> None:
        self.received = 0  # the signal number, 0 for none
        self._previous: dict[int, object] = {}
        self._depth = 0

    def _handler(self, signum: int, frame) -> None:
        self.received = signum

    def __enter__(self) -> StopSignals:
        if self._depth == 0:
            self._previous = {s: signal.signal(s, self._handler) for s in STOP_SIGNALS}
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            for s, handler in self._previous.items():
                signal.signal(s, handler)


def _stop_if_signalled(signals: StopSignals, info: DistInfo) -> None:
    """Between set-up stages (data, model, resume: minutes for a large model): a stop signal any rank received
    ends the run on every rank (one all-reduce), as at a step boundary. It used to kill the run (exit 143,
    no message), which the SLURM scripts do not requeue."""
    flag = torch.tensor([float(signals.received)], device=info.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if signum := int(flag.item()):
        raise SetupStopped(
            f"received {signal.Signals(signum).name} during set-up: stopped before this run's first step; "
            "exiting 0 for a requeue"
        )


def lr_lambda(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at ``step`` (1-based): linear warmup, then cosine decay to min_lr_ratio."""
    if step <= warmup_steps:
        return step / max(warmup_steps, 1)
    progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


@torch.no_grad()
def update_expert_biases(model: torch.nn.Module) -> None:
    """Auxiliary-loss-free load balancing: one bias update per step from the global expert loads."""
    layers = [m for m in moe_layers(model) if m.bias_update_speed > 0]
    if not layers:
        return
    loads = torch.stack([m.tokens_per_expert for m in layers])
    dist.all_reduce(loads)  # every rank applies the same update
    for m, load in zip(layers, loads, strict=True):
        m.update_expert_bias(load)


def padded_vocab_size(vocab_size: int, multiple: int = 64) -> int:
    return multiple * math.ceil(vocab_size / multiple)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # CPU and every CUDA device


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, device: torch.device) -> float:
    """Mean loss per token over ``batches`` (an iterable of (inputs, targets)) and over all ranks.

    Eval mode and no grad; the model goes back to train mode and its MoE token counts are left as
    they were, so a validation changes nothing a later training step sees.
    """
    was_training = model.training
    model.eval()
    counts = [(m, m.tokens_per_expert.clone()) for m in moe_layers(model)]
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, tokens
    with compute_weights(model):
        for inputs, targets in batches:
            inputs, targets = inputs.to(device), targets.to(device)
            logits = model(inputs)
            totals[0] += F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum").double()
            totals[1] += targets.numel()
    dist.all_reduce(totals)
    for m, saved in counts:
        m.tokens_per_expert.copy_(saved)
    reshard(model)  # a forward without backward leaves the root and the last block gathered
    model.train(was_training)
    return (totals[0] / totals[1]).item()


def memory_report(device: torch.device) -> str:
    """The memory figures an out-of-memory error is reported with."""
    if device.type != "cuda":
        return f"{device}: peak resident memory {peak_memory_gib(device):.2f} GiB"
    gib = 2**30
    total = torch.cuda.get_device_properties(device).total_memory
    return (
        f"{torch.cuda.get_device_name(device)} ({device}): allocated {torch.cuda.memory_allocated(device) / gib:.2f} "
        f"GiB, reserved {torch.cuda.memory_reserved(device) / gib:.2f} GiB, max allocated "
        f"{torch.cuda.max_memory_allocated(device) / gib:.2f} GiB, device total {total / gib:.2f} GiB"
    )


def _agree(loss: torch.Tensor, grad_norm: torch.Tensor, signum: int) -> tuple[bool, bool, int]:
    """(loss non-finite on any rank, grad norm non-finite, the signal any rank received): one
    small all-reduce, so every rank takes the same branch."""
    flags = torch.stack(
        [(~torch.isfinite(loss)).float(), (~torch.isfinite(grad_norm)).float(), torch.full_like(loss, signum)]
    )
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    bad_loss, bad_grad, sig = flags.tolist()
    return bool(bad_loss), bool(bad_grad), int(sig)


def build_optimizer(model: torch.nn.Module, t: TrainingConfig) -> torch.optim.AdamW:
    """AdamW over the model's (fp32 master) parameters, fused unless training.fused_adamw is false: the foreach
    AdamW launches several kernels per parameter group and, over FSDP2's DTensors, costs more host time than the
    GPU time of its math."""
    return torch.optim.AdamW(
        model.parameters(),
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=t.eps,
        weight_decay=t.weight_decay,
        fused=t.fused_adamw,
        foreach=None if t.fused_adamw else True,
    )


def uses_fsdp(config: Config, info: DistInfo) -> bool:
    """Whether the run shards through FSDP2: shard groups of several ranks, or parallel.fsdp_on_one_device; else
    every rank holds the whole model (one process, or dp_replicate = world size)."""
    return info.world_size > config.parallel.dp_replicate or config.parallel.fsdp_on_one_device


STATE_BYTES = 16  # a parameter's fp32 weight, gradient and AdamW's two moments


def memory_problem(config: Config, args: LlamaArgs, info: DistInfo, local_ranks: int = 1) -> str | None:
    """Where the run's fp32 weights, gradients and AdamW moments alone (STATE_BYTES a parameter, split over the
    shard group) cannot fit: on a GPU in each rank's memory, on a CPU in the host's, which its ``local_ranks``
    share. A lower bound, activations and the compute-dtype and MX copies on top: it never stops a run that would
    fit, and stops one that cannot before its model is built (on a CPU the OS would kill it without a line)."""
    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(args).parameters())
    shards = info.world_size // config.parallel.dp_replicate if uses_fsdp(config, info) else 1
    ranks = local_ranks if info.device.type == "cpu" else 1
    split = f", split over {shards} ranks" if shards > 1 else ""
    host = f", {ranks} ranks on this host" if ranks > 1 else ""
    what = (f"model {config.model.name} {config.model.flavor} ({params / 1e6:,.1f}M parameters: fp32 weights, "
            f"gradients and AdamW moments, {STATE_BYTES} bytes each{split}{host})")  # fmt: skip
    problem = shortfall(math.ceil(STATE_BYTES * params / shards) * ranks, info.device, what)
    if problem and info.device.type == "cpu":
        problem += "; the debug configs train on a CPU"
    return problem


def uses_cast_weights_once(config: Config, info: DistInfo) -> bool:
    """training.cast_weights_once for an MX run (a bf16 run has no casts): "on" (a SetupError under FSDP2 sharding,
    naming why), "off", or "auto": on where the step reuses its weights' casts (gradient accumulation, activation
    checkpointing) and the ranks hold the whole model (``mx_recipe.nn.weight_casts``)."""
    mode = config.training.cast_weights_once
    if config.mx.recipe == "none":
        return False
    if mode == "on" and uses_fsdp(config, info):
        raise SetupError(
            "training.cast_weights_once is on, but the run shards the model through FSDP2: its unsharded weights "
            "exist only inside each block's forward and backward, and their casts kept for the step would hold "
            "every layer unsharded; set it to auto or off"
        )
    reuse = config.training.gradient_accumulation_steps > 1 or config.activation_checkpoint.mode != "none"
    return mode == "on" or (mode == "auto" and reuse and not uses_fsdp(config, info))


def step_setup(config: Config, info: DistInfo, mesh, cuda_graph: bool, model: torch.nn.Module | None = None) -> str:
    """How a step runs, for the start-up line and the benchmarks: sharding (and, given the FSDP2 ``model``, its
    all-gather), optimizer, CUDA graph, AC, compile."""
    graph = "on" if cuda_graph else "off"
    if uses_fsdp(config, info):
        sharding = f"FSDP2 mesh {tuple(mesh.shape)}"
        if model is not None:
            dtype = resolve_compute_dtype(config.training.compute_dtype, info.device)
            sharding += f", {describe_all_gather(model, dtype)}"
    else:
        sharding = "unsharded" if info.world_size == 1 else f"replicated on {info.world_size} ranks (all-reduce)"
    compiled = f"on ({config.compile.mode})" if config.compile.enable else "off"
    once = ", MX weights cast once a step" if uses_cast_weights_once(config, info) else ""
    return (
        f"{sharding}, AdamW {'fused' if config.training.fused_adamw else 'foreach'}, CUDA graph {graph}, "
        f"activation checkpointing {config.activation_checkpoint.mode}, compile {compiled}{once}"
    )


def uses_cuda_graph(config: Config, model: torch.nn.Module, info: DistInfo) -> bool:
    """training.cuda_graph: "on" (a step that cannot be captured is a SetupError naming why), "off", or "auto":
    on wherever the step can be captured (CUDA, every rank holding the whole model)."""
    mode = config.training.cuda_graph
    reason = can_capture(model, info.device)
    if mode == "on" and reason is not None:
        raise SetupError(f"training.cuda_graph is on, but {reason}: set it to auto or off")
    return mode != "off" and reason is None


def build_training_model(config: Config, args, info: DistInfo, mesh, log) -> torch.nn.Module:
    """The model on the meta device, converted to MX, with activation checkpointing and compile
    per block, then materialized block by block from the seed and sharded (torchtitan's order), or left
    whole on every rank where a shard group is one rank (``uses_fsdp``), to compute in training.compute_dtype."""
    seed_everything(config.job.seed)
    with torch.device("meta"):
        model = build_model(args)
    recipe = build_mx_recipe(config.mx, seed=config.job.seed)  # None for a bf16 run
    if recipe is not None:
        _check_skip_patterns(model, config)
        # The GEMM backend is resolved once, here: one this device or recipe cannot run stops the run.
        try:
            records = convert_to_mx(model, recipe, skip=config.mx.skip, log=False, device=info.device)
        except ValueError as e:
            raise SetupError(f"mx.backend: {e}") from None
        backend = next((r.backend for r in records if r.converted), "none (no layer converted)")
        log(f"mx recipe {recipe.name}: GEMM backend {recipe.backend} -> {backend} on {info.device}")
        log(format_conversion_table(records))
    apply_activation_checkpointing(model, config.activation_checkpoint.mode)
    if config.compile.enable:
        apply_compile(model, config.compile.mode)
    seed_everything(config.job.seed)  # the same initial weights on every world size
    dtype = COMPUTE_DTYPES[resolve_compute_dtype(config.training.compute_dtype, info.device)]
    mx_all_gather = _mx_all_gather_on(config, recipe, model, info, mesh)
    if not uses_fsdp(config, info):
        return materialize_unsharded(model, info, dtype)
    materialize_and_shard(model, info, mesh, dtype, reshard_after_forward=config.parallel.reshard_after_forward)
    gathers = apply_mx_all_gather(model, recipe, mx_all_gather)
    if mx_all_gather:
        log(format_gather_report(gathers))
    return model


def _mx_all_gather_on(config: Config, recipe, model: torch.nn.Module, info: DistInfo, mesh) -> bool:
    """parallel.mx_all_gather resolved for this run: "on" where the config allows it (validate checked) and FSDP2
    has several ranks to gather from, a SetupError where it has not; "auto" is AUTO_ON where everything allows it."""
    mode = config.parallel.mx_all_gather
    if mode == "off" or (mode == "auto" and not AUTO_ON):
        return False
    problem = config_problem(recipe, config.activation_checkpoint.mode, config.parallel.reshard_after_forward)
    if problem is None and (not uses_fsdp(config, info) or mesh.shape[-1] == 1):
        problem = ("the world size", "FSDP2 gathers nothing where a shard group is one rank")
    emulated = any(getattr(getattr(m, "backend", None), "name", "") == "emulated" for m in model.modules())
    if problem is None and not emulated:
        problem = ("mx.backend", "the MX all-gather serves the emulated GEMM backend only")
    if problem is not None and mode == "on":
        raise SetupError(f"parallel.mx_all_gather is on, but {problem[0]}: {problem[1]}")
    return problem is None


def _check_skip_patterns(model: torch.nn.Module, config: Config) -> None:
    """An mx.skip pattern of the user's that matches no layer is a SetupError: a misspelt one would convert
    the layer it meant to keep in bf16. The default patterns need not match (a dense model has no router)."""
    unmatched = [p for p in unmatched_skip_patterns(model, config.mx.skip) if p not in DEFAULT_SKIP]
    if unmatched:
        raise SetupError(
            f"mx.skip: {unmatched[0]!r} matches no linear layer or expert group of {config.model.name} "
            f"{config.model.flavor} (a pattern matches whole names, such as layers.0.attention.wq): fix or remove it"
        )


def _write_config(path: Path, text: str) -> None:
    """The run's resolved config; one that a resumed run changed is kept as config-N.toml (N = 1, 2, ...)."""
    if path.is_file() and path.read_text().splitlines()[1:] != text.splitlines()[1:]:  # line 0: a timestamp
        n = 1 + sum(1 for _ in path.parent.glob("config-*.toml"))
        path.rename(path.with_name(f"config-{n}.toml"))
    path.write_text(text)


def _output_dir_problem(output_dir: Path, checkpoint_folder: Path, lock: RunLock) -> str | None:
    """Why a run cannot start in ``output_dir`` (None: it can; the folder is created and ``lock`` taken, before
    anything is written there). A new run there would replace the metrics of an earlier one that left no
    checkpoint to resume from: refused, so nothing is lost."""
    try:
        if output_dir.exists() and not output_dir.is_dir():
            return f"job.output_dir {output_dir} is a file, not a folder: choose another job.output_dir"
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only disk, a name too long for the file system
        return f"job.output_dir: cannot create {output_dir} ({e.strerror}): choose another job.output_dir"
    if not os.access(output_dir, os.W_OK):
        return f"job.output_dir {output_dir} is not writable: choose another job.output_dir"
    holder = lock.acquire(output_dir)  # one run per output_dir: a second one would interleave their files
    if holder is not None:
        return holder
    metrics = output_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size and latest_checkpoint(checkpoint_folder) is None:
        records = sum(1 for line in metrics.read_text().splitlines() if line.strip())
        finished = "a finished run" if (output_dir / "DONE").exists() else "an earlier run"
        return (
            f"job.output_dir {output_dir} holds the metrics of {finished} ({records} records in metrics.jsonl) and no "
            "checkpoint to resume from, so a new run would replace them: choose another job.output_dir, or delete "
            f"{metrics} to start over"
        )
    return None


def _nothing_left(checkpoint: Path, step: int, steps: int) -> str:
    """Why a resume from ``checkpoint``, past training.steps, cannot run: it used to print "done" and exit 0, so a
    user who lowered training.steps, or meant to train on, learnt nothing. (A checkpoint at the last step is a
    finished run: ``_train`` says so and exits 0, so that a requeue after a crash between that checkpoint and the
    DONE file ends cleanly.)"""
    return (
        f"checkpoint {checkpoint} is at step {step}, past training.steps = {steps}: nothing left to train; "
        f"raise training.steps above {step} to train on, or choose another job.output_dir"
    )


def _config_changes(saved: Path, config: Config) -> list[str]:
    """The [model] and [mx] keys whose values differ from those of the checkpoint's saved config."""
    if not saved.is_file():  # written before checkpoints kept their config
        return []
    before, now = tomllib.loads(saved.read_text()), config_to_dict(config)
    changes = []
    for section in ("model", "mx"):
        # a key the saved config lacks was added since; the checkpoint's run had its default
        saved_values = section_defaults(section) | before.get(section, {})
        changes += [
            f"{section}.{key}: {saved_values.get(key)!r} -> {value!r}"
            for key, value in now[section].items()
            if saved_values.get(key) != value
        ]
    return changes


def _resume(checkpointer: Checkpointer, config: Config, model, optimizer, scheduler, data, state, log) -> Path | None:
    """Load the newest intact checkpoint (None: there is none, a fresh run). A damaged one is reported by name
    and the one before it tried, unless checkpoint.strict; one written under another model or recipe is
    refused unless checkpoint.allow_config_change."""
    ckpt, damaged = config.checkpoint, []
    for path in checkpointer.committed():
        problems = checkpointer.verify(path)
        changed = [] if problems else _config_changes(path / CONFIG, config)
        if changed and not ckpt.allow_config_change:
            raise SetupError(
                f"checkpoint {path} was written under another model or recipe ({'; '.join(changed)}): resume with "
                "the config it was written with, or set checkpoint.allow_config_change true"
            )
        if not problems:
            try:
                note = checkpointer.load(path, model, optimizer, scheduler, data, state)
            except ValueError as e:  # e.g. a data position that cannot move to this world size
                raise SetupError(f"cannot resume from {path}: {e}") from None
            except DCP_ERRORS as e:  # unreadable without a checksum to tell (written before checksums were)
                problems = [f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"]
            else:
                notes = [note] if note else []
                notes += [f"config changed: {'; '.join(changed)}"] if changed else []
                log(
                    f"resuming from checkpoint {path} (step {state.step} of {config.training.steps})"
                    + "".join(f"; {n}" for n in notes)
                )
                return path
        what = f"checkpoint {path} is damaged: {'; '.join(problems[:3])}"
        if ckpt.strict:
            raise SetupError(f"{what}; checkpoint.strict is true: delete it to resume from the one before it")
        log(f"warning: {what}; trying the checkpoint before it")
        damaged.append(path.name)
    if damaged:  # a fresh start would replace this run's metrics and, in time, prune its checkpoints
        raise SetupError(
            f"every checkpoint under {checkpointer.folder} is damaged ({', '.join(damaged)}): nothing to resume from; "
            "delete them to start over"
        )
    return None


def check_run(config: Config) -> str | None:
    """What ``train.py --check`` adds to the config's own checks, in one process, without building the model or
    starting a process group, so that a launcher can run it first (under torchrun a clean exit 2 becomes exit 1
    and a traceback): job.output_dir can be created (it is) and written, no run holds it, it holds no run that a
    new one would overwrite or that has nothing left to train, and each mx.skip pattern matches a layer. (Not
    ``memory_problem``: the world size it needs is the launcher's.) None: the run can start; else why not, in one
    line."""
    output_dir = Path(config.job.output_dir)
    folder = output_dir / config.checkpoint.folder
    lock = RunLock()
    try:
        problem = _output_dir_problem(output_dir, folder, lock)
    finally:
        lock.release()
    if problem is not None:
        return problem
    found = committed_checkpoints(folder)  # the newest: the one the run will resume from, unless it is damaged
    if found and found[-1][0] > config.training.steps:
        return _nothing_left(found[-1][1], found[-1][0], config.training.steps)
    if config.mx.recipe != "none":
        with torch.device("meta"):  # the layers' names, no memory
            model = build_model(model_args(config.model.name, config.model.flavor, 256, config.training.seq_len))
        try:
            _check_skip_patterns(model, config)
        except SetupError as e:
            return str(e)
    return None


def train(config: Config, info: DistInfo, signals: StopSignals | None = None) -> list[dict]:
    """Run ``config`` on this rank; returns the logged records (identical on every rank).

    Returns early, after saving a checkpoint, when SIGTERM or SIGUSR1 arrives (``signals``: the
    caller's, entered before this, so that one that came earlier counts too). Raises TrainingError
    (one-line message, exit code) for a run that cannot go on, SetupStopped for a stop signal
    before the first step. With ``training.deterministic`` the run uses deterministic algorithms
    (restored after it).
    """
    previous = torch.are_deterministic_algorithms_enabled()
    if config.training.deterministic:  # flash attention's backward and index_add_ otherwise race
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts, after this
        torch.use_deterministic_algorithms(True)
    lock = RunLock()  # rank 0 takes it in _output_dir_problem
    signals = signals if signals is not None else StopSignals()
    try:
        with signals:
            return _train(config, info, lock, signals)
    finally:
        lock.release()
        torch.use_deterministic_algorithms(previous)


def _train(config: Config, info: DistInfo, lock: RunLock, signals: StopSignals) -> list[dict]:
    log = print if info.is_main else (lambda *a, **k: None)
    # "auto" resolved here, so that the config.toml of the run names the dtype it computed in
    asked = config.training.compute_dtype
    dtype = resolve_compute_dtype(asked, info.device)
    config = dataclasses.replace(config, training=dataclasses.replace(config.training, compute_dtype=dtype))
    t, ckpt = config.training, config.checkpoint
    output_dir = Path(config.job.output_dir)
    if fault_hooks().signal_in_setup and info.is_main:  # tests only (faults.py)
        os.kill(os.getpid(), signal.SIGTERM)
    problem = _output_dir_problem(output_dir, output_dir / ckpt.folder, lock) if info.is_main else None
    box = [problem]
    dist.broadcast_object_list(box, src=0)  # rank 0 looked: every rank stops, or none
    if box[0] is not None:
        raise SetupError(box[0])
    if lock.unsupported:
        log(f"warning: {lock.unsupported}: a second run in this job.output_dir would not be refused")
    if info.is_main:
        _write_config(output_dir / "config.toml", config_to_toml(config))

    # Everything that can fail fast does so before the model is built.
    try:
        data = build_datasets(config, info.rank, info.world_size)
    except (ValueError, OSError) as e:  # a missing or malformed file, a corpus too short (pyarrow's are ValueErrors)
        raise SetupError(f"data: {e}") from None
    if config.validation.enable and data.validation is None:
        raise SetupError(
            f"validation.enable is true but data.dataset {config.data.dataset!r} has no validation split "
            f"(data.validation_fraction = {config.data.validation_fraction}); raise it or set validation.enable false"
        )
    _stop_if_signalled(signals, info)
    try:
        mesh = build_mesh(info, config.parallel.dp_replicate)
    except ValueError as e:
        raise SetupError(str(e)) from None
    checkpointer = Checkpointer(output_dir / ckpt.folder, ckpt.keep_latest_k, info.rank, info.world_size, info.device)
    can_checkpoint = checkpointer.prepare()
    if ckpt.enable and not can_checkpoint:
        raise SetupError(f"checkpoint.folder: cannot write {checkpointer.folder}")

    args = model_args(config.model.name, config.model.flavor, padded_vocab_size(data.tokenizer.vocab_size), t.seq_len)
    problem = memory_problem(config, args, info, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if problem is not None:
        raise SetupError(problem)
    model = build_training_model(config, args, info, mesh, log)
    _stop_if_signalled(signals, info)
    num_params = sum(p.numel() for p in model.parameters())  # DTensors: numel() is the global size
    global_batch = t.local_batch_size * info.world_size * t.gradient_accumulation_steps
    optimizer = build_optimizer(model, t)
    cuda_graph = uses_cuda_graph(config, model, info)
    once = uses_cast_weights_once(config, info)
    train_step = TrainStep(model, optimizer, info.device, t.max_norm, cuda_graph=cuda_graph, cast_weights_once=once)
    log(
        f"model {config.model.name} {config.model.flavor}: {num_params / 1e6:.1f}M parameters, "
        f"mx recipe {config.mx.recipe}, compute dtype {dtype}{' (auto)' if asked == 'auto' else ''}, "
        f"{info.world_size} x {info.device.type}, global batch {global_batch} x {t.seq_len} tokens, "
        + step_setup(config, info, mesh, cuda_graph, model)
    )

    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: lr_lambda(i + 1, t.warmup_steps, t.steps, t.min_lr_ratio)
    )
    state = TrainState()
    checkpointer.config_text = config_to_toml(config)
    resume_from = _resume(checkpointer, config, model, optimizer, scheduler, data.train, state, log)
    if resume_from is not None and state.step > t.steps:
        raise SetupError(_nothing_left(resume_from, state.step, t.steps))
    if resume_from is not None and state.step == t.steps:
        if info.is_main:
            (output_dir / "DONE").write_text(f"{t.steps} steps\n")
        log(
            f"done: checkpoint {resume_from} is at step {t.steps}, the last of training.steps: the run is complete "
            f"(raise training.steps above {t.steps} to train on)"
        )
        return []
    _stop_if_signalled(signals, info)
    metrics = MetricsLogger(
        output_dir,
        info.device,
        flops_per_token(args, model, t.seq_len),
        info.is_main,
        append=resume_from is not None,
        total_steps=t.steps,
        metrics_config=config.metrics,
        resumed_step=state.step if resume_from is not None else None,
    )
    done_file = output_dir / "DONE"
    if info.is_main:
        done_file.unlink(missing_ok=True)

    faults = fault_hooks()  # tests only (faults.py); by default nothing is injected
    records: list[dict] = []
    try:
        with signals:
            for step in range(state.step + 1, t.steps + 1):
                microbatches = [data.train.next_batch() for _ in range(t.gradient_accumulation_steps)]
                loss, grad_norm = train_step(microbatches, inject_nan=step in faults.nan_loss_steps)
                if step == faults.signal_step and info.is_main:
                    os.kill(os.getpid(), signal.SIGTERM)
                bad_loss, bad_grad, signum = _agree(loss, grad_norm, signals.received)
                state.step = step
                skipped = bad_loss or bad_grad
                if skipped:
                    what = "loss" if bad_loss else "gradient norm"
                    value = all_reduce_mean(loss).item() if bad_loss else grad_norm.item()
                    if state.nan_skips >= t.skip_nan_steps:
                        raise NonFiniteLossError(
                            f"{what} is {value} at step {step}; last good checkpoint: {checkpointer.last or 'none'}"
                            + (f" ({state.nan_skips} of {t.skip_nan_steps} skips used)" if t.skip_nan_steps else "")
                        )
                    state.nan_skips += 1
                    log(
                        f"step {step}: {what} is {value}: skipped without an update "
                        f"({state.nan_skips} of {t.skip_nan_steps} skips used)"
                    )
                    for m in moe_layers(model):
                        m.tokens_per_expert.zero_()
                else:
                    train_step.update()
                    update_expert_biases(model)
                train_step.zero_grad()
                lr = scheduler.get_last_lr()[0]
                scheduler.step()
                metrics.add_tokens(sum(inputs.numel() for inputs, _ in microbatches))
                if not skipped and (step % config.metrics.log_freq == 0 or step == 1 or step == t.steps):
                    extra = {"lr": lr, "grad_norm": grad_norm.item()}
                    records.append(metrics.log(step, all_reduce_mean(loss).item(), extra))
                if config.validation.enable and step % config.validation.interval == 0:
                    val_loss = evaluate(model, data.validation.batches(config.validation.steps), info.device)
                    metrics.log_validation(step, val_loss)
                periodic = ckpt.enable and (step % ckpt.interval == 0 or step == t.steps)
                if (periodic or signum) and can_checkpoint and checkpointer.last_step != step:
                    try:
                        path = checkpointer.save(model, optimizer, scheduler, data.train, state)
                    except CheckpointSaveError as e:
                        raise TrainingError(str(e)) from None
                    log(f"saved checkpoint {path}")
                if signum and step < t.steps:
                    name = signal.Signals(signum).name
                    saved = f"checkpoint {checkpointer.last}" if can_checkpoint else "no checkpoint (cannot write one)"
                    log(f"received {name}: stopped after step {step} of {t.steps}; {saved}; exiting 0 for a requeue")
                    return records
    finally:
        metrics.close()
    dist.barrier()
    if info.is_main:
        done_file.write_text(f"{t.steps} steps\n")
    log(f"done: {t.steps} steps in {time.perf_counter() - metrics.start:.1f} s, metrics in {metrics.path}")
    return records
