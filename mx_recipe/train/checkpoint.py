"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, loadable at another world size, atomic.

Under ``<job.output_dir>/<checkpoint.folder>``:

    step-N/        a committed checkpoint: DCP shards and .metadata
    step-N.tmp/    being written; never loaded, removed by the next run
    step-N.old/    being pruned; never loaded

A save writes ``step-N.tmp`` on every rank, waits until every rank has finished, then rank 0
renames it to ``step-N``. The rename is atomic, so a crash in the middle of a save leaves the
previous checkpoint the latest.

What a checkpoint holds: the model and optimizer (``get_state_dict``: FSDP2's sharded DTensors,
so DCP reshards them on load; the model's persistent buffers, such as the MoE expert biases,
come with it), the LR scheduler, the train state (step, NaN skips), and per rank a pickled blob
of its data position and RNG states. Beside them, ``checksums.json`` (size and CRC-32 of every
file, each rank hashing the shards it wrote) and ``config.toml`` (the run's resolved config).

``verify(path)`` checks the files against ``checksums.json`` before a load: a damaged checkpoint
(a truncated, overwritten or missing file) is reported by name, and the trainer falls back to the
newest intact one, or stops when ``checkpoint.strict`` asks.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from mx_recipe.train.faults import fault_hooks

_COMMITTED = re.compile(r"step-(\d+)")
_RANK_KEY = re.compile(r"rank_(\d+)")


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken (skipped NaN steps count)
    nan_skips: int = 0  # NaN/Inf steps skipped so far


def committed_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every committed checkpoint under ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = _COMMITTED.fullmatch(path.name)
        if match and (path / ".metadata").is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(folder: Path) -> Path | None:
    found = committed_checkpoints(folder)
    return found[-1][1] if found else None


CHECKSUMS = "checksums.json"
CONFIG = "config.toml"


def file_checksum(path: Path, chunk: int = 1 << 24) -> dict[str, int]:
    """Size and CRC-32 of a file (CRC-32: any burst of 32 bits or fewer changes it, and it runs at GB/s)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return {"size": size, "crc32": crc}


def damaged_files(path: Path, names: list[str] | None = None) -> list[str]:
    """What is wrong with checkpoint ``path`` (empty: intact), for the files ``names`` of its checksums.json
    (None: all of them)."""
    listing = path / CHECKSUMS
    if not listing.is_file():  # written before checksums were: unverified, not damaged
        return []
    expected = json.loads(listing.read_text())
    problems = []
    for name in expected if names is None else names:
        file = path / name
        if not file.is_file():
            problems.append(f"{name} is missing")
            continue
        got = file_checksum(file)
        if got["size"] != expected[name]["size"]:
            problems.append(f"{name} has {got['size']} bytes, {expected[name]['size']} were written")
        elif got["crc32"] != expected[name]["crc32"]:
            problems.append(f"{name} does not match its checksum")
    return problems


# What DCP raises when a rank fails to read or write: its CheckpointException derives from BaseException, not
# Exception, so an `except Exception` lets it through.
DCP_ERRORS = (Exception, CheckpointException)


class CheckpointSaveError(RuntimeError):
    """A save that failed; its message says why in one line and which checkpoint is still intact."""


def _save_failure(final: Path, error: BaseException, intact: Path | None) -> str:
    """One line for a failed save: a full disk said as such (DCP's own message is about stream positions)."""
    usage = shutil.disk_usage(final.parent)
    if isinstance(error, CheckpointException) and error.failures:  # the first rank's own error says more
        failure = next(iter(error.failures.values()))
        error = failure[0] if isinstance(failure, tuple) else failure
    text = f"{error!r} {error.__cause__!r} {error.__context__!r}"
    if "No space left" in text or "Errno 28" in text or usage.free < 0.01 * usage.total:
        why = f"no space left on the disk of {final.parent} ({usage.free / 2**30:.2f} GiB free)"
    else:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        why = f"{type(error).__name__}: {first}"
    return f"cannot save checkpoint {final}: {why}; the newest intact checkpoint is {intact or 'none (no save yet)'}"


def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Rename, then delete: a half-deleted directory never looks like a checkpoint."""
    doomed = path.with_name(path.name + ".old")
    shutil.rmtree(doomed, ignore_errors=True)
    path.rename(doomed)
    shutil.rmtree(doomed)


# How the optimizer runs, not what it learned: load_state_dict takes these from the checkpoint's param groups, and
# they stay as this run built them (a checkpoint of the foreach AdamW resumes fused, and back).
_OPTIMIZER_IMPLEMENTATION = ("fused", "foreach", "capturable")


@torch.no_grad()
def _keep_implementation(optimizer: torch.optim.Optimizer, kept: list[dict[str, Any]]) -> None:
    """Put back the implementation flags ``kept`` from before a load, and each parameter's step count where that
    implementation keeps it: on the parameter's device for fused and capturable AdamW, on the CPU otherwise."""
    for group, flags in zip(optimizer.param_groups, kept, strict=True):
        group.update(flags)
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor):
                optimizer.state[p]["step"] = step.to(p.device if on_device else "cpu", torch.float32)


class Checkpointer:
    """Saves and loads checkpoints for one run; every method is collective (all ranks call it)."""

    def __init__(self, folder: Path, keep_latest_k: int, rank: int, world_size: int, device: torch.device):
        self.folder, self.keep_latest_k = Path(folder), keep_latest_k
        self.rank, self.world_size, self.device = rank, world_size, device
        self.last: Path | None = None  # the latest committed checkpoint, saved or loaded by this run
        self.last_step = -1
        self.config_text: str | None = None  # the run's resolved config, saved with each checkpoint

    def verify(self, path: Path) -> list[str]:
        """``damaged_files(path)``, the files shared out among the ranks; every rank gets the whole list."""
        names = sorted(json.loads((path / CHECKSUMS).read_text())) if (path / CHECKSUMS).is_file() else []
        mine = damaged_files(path, names[self.rank :: self.world_size])
        every = [None] * self.world_size
        dist.all_gather_object(every, mine)
        return [problem for part in every for problem in part]

    def committed(self) -> list[Path]:
        """Every committed checkpoint, newest first, as rank 0 sees them."""
        found = committed_checkpoints(self.folder) if self.rank == 0 else []
        return self._broadcast([path for _, path in reversed(found)])

    def _broadcast(self, value: Any) -> Any:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def prepare(self) -> bool:
        """Create the folder and clear what an interrupted save or prune left; True when the
        folder can be written. Rank 0 decides, every rank gets the answer."""
        ok = True
        if self.rank == 0:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                for path in self.folder.iterdir():
                    if path.is_dir() and path.suffix in (".tmp", ".old"):
                        shutil.rmtree(path, ignore_errors=True)
                ok = os.access(self.folder, os.W_OK)
            except OSError:
                ok = False
        return self._broadcast(ok)

    def latest(self) -> Path | None:
        """The latest committed checkpoint, as rank 0 sees it."""
        return self._broadcast(latest_checkpoint(self.folder) if self.rank == 0 else None)

    def _state(self, model, optimizer, scheduler, train_state: TrainState) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": scheduler.state_dict(),
            "train_state": asdict(train_state),
        }

    def save(self, model, optimizer, scheduler, data, train_state: TrainState) -> Path:
        step = train_state.step
        final = self.folder / f"step-{step}"
        tmp = self.folder / f"step-{step}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        state = self._state(model, optimizer, scheduler, train_state)
        # Each rank's data position and RNG: a leaf of bytes, so its structure is the data source's business.
        state[f"rank_{self.rank}"] = pickle.dumps({"data": data.state_dict(), "rng": _rng_state(self.device)})
        try:
            dcp.save(state, checkpoint_id=tmp)
        except DCP_ERRORS as e:  # DCP raises on every rank when one fails to write
            message = _save_failure(final, e, self.last)  # while the partial save still fills the disk
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # give back what the partial save took
            raise CheckpointSaveError(message) from e
        if step == fault_hooks().kill_in_save_step:  # tests only (faults.py)
            os.kill(os.getpid(), signal.SIGKILL)  # no handler, no cleanup, as a node failure
        dist.barrier()  # every rank's shards are on disk
        # each rank hashes its own shards (DCP names them __RANK_*), rank 0 the metadata too
        mine = {f.name: file_checksum(f) for f in sorted(tmp.iterdir()) if f.name.startswith(f"__{self.rank}_")}
        if self.rank == 0:
            mine[".metadata"] = file_checksum(tmp / ".metadata")
        every = [None] * self.world_size
        dist.all_gather_object(every, mine)
        if self.rank == 0:
            (tmp / CHECKSUMS).write_text(json.dumps({k: v for part in every for k, v in part.items()}, indent=0))
            if self.config_text is not None:
                (tmp / CONFIG).write_text(self.config_text)
            if final.exists():  # only from a run that ended at this very step: replace it
                _remove(final)
            tmp.rename(final)
            _fsync_dir(self.folder)
            self._prune()
        dist.barrier()
        self.last, self.last_step = final, step
        return final

    def _prune(self) -> None:
        if self.keep_latest_k <= 0:
            return
        for _, path in committed_checkpoints(self.folder)[: -self.keep_latest_k]:
            _remove(path)

    def load(self, path: Path, model, optimizer, scheduler, data, train_state: TrainState) -> str | None:
        """Load ``path`` into the given objects in place. Returns a note when the checkpoint was
        written at another world size (data position and RNG then come from its rank 0)."""
        saved_ranks = sorted(
            int(m.group(1))
            for key in dcp.FileSystemReader(path).read_metadata().state_dict_metadata
            if (m := _RANK_KEY.fullmatch(key))
        )
        source = self.rank if len(saved_ranks) == self.world_size else 0
        state = self._state(model, optimizer, scheduler, train_state)
        state[f"rank_{source}"] = b""
        dcp.load(state, checkpoint_id=path)
        kept = [{key: group.get(key) for key in _OPTIMIZER_IMPLEMENTATION} for group in optimizer.param_groups]
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        _keep_implementation(optimizer, kept)
        scheduler.load_state_dict(state["scheduler"])
        for key, value in state["train_state"].items():
            setattr(train_state, key, value)
        blob = pickle.loads(state[f"rank_{source}"])
        data.load_state_dict(blob["data"])
        _set_rng_state(blob["rng"], self.device)
        self.last, self.last_step = path, train_state.step
        if len(saved_ranks) != self.world_size:
            return (
                f"checkpoint written by {len(saved_ranks)} ranks, loaded by {self.world_size}: "
                "model and optimizer resharded; data position and RNG from its rank 0"
            )
        return None
