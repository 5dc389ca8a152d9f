"""Data: a byte-level tokenizer and a deterministic offline corpus every machine with Python has.

The corpus is the Python installation's own standard library sources (sorted by path, each
file wrapped in BOS/EOS), so a run needs no download. Batches are drawn by *global* sample
index from a generator seeded by (seed, step): rank r of W takes its slice of the global
batch, so runs at equal global batch see the same tokens whatever the world size.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


class ByteTokenizer:
    """Bytes 0..255, then BOS and EOS."""

    bos_id = 256
    eos_id = 257
    vocab_size = 258

    def encode(self, data: bytes) -> list[int]:
        return [self.bos_id, *data, self.eos_id]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def python_stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def load_python_stdlib(tokenizer: ByteTokenizer, max_bytes: int) -> np.ndarray:
    """The stdlib sources as one token stream (uint16), at most ``max_bytes`` tokens."""
    chunks, total = [], 0
    for path in python_stdlib_files():
        ids = np.asarray(tokenizer.encode(path.read_bytes()), dtype=np.uint16)
        chunks.append(ids[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no Python sources found under {sysconfig.get_paths()['stdlib']}")
    return np.concatenate(chunks)


DATASETS = {"python_stdlib": load_python_stdlib}


def check_data_config(data) -> tuple[str, str] | None:
    """(key, message) for a data source or tokenizer that cannot work, checked before any model
    is built; None when the data config is usable."""
    if data.dataset not in DATASETS:
        return "data.dataset", f"unknown dataset {data.dataset!r}; known: {', '.join(DATASETS)}"
    if data.tokenizer != "byte":
        return "data.tokenizer", f"unknown tokenizer {data.tokenizer!r}; known: byte"
    return None


class TokenBatches:
    """Random windows of ``seq_len + 1`` tokens, indexed by step; deterministic and resumable."""

    def __init__(self, tokens: np.ndarray, seq_len: int, local_batch_size: int, rank: int, world_size: int, seed: int):
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"corpus of {len(tokens)} tokens is too short for seq_len {seq_len}")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets [local_batch_size, seq_len] (int64, CPU) for ``step``."""
        rng = np.random.default_rng([self.seed, step])
        global_batch = self.local_batch_size * self.world_size
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=global_batch)
        mine = starts[self.rank * self.local_batch_size : (self.rank + 1) * self.local_batch_size]
        windows = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in mine])
        return windows[:, :-1], windows[:, 1:]


class TrainBatches:
    """The training stream of one rank: ``next_batch()`` and a resumable position.

    The interface every data source keeps: next_batch() -> (inputs, targets) int64 CPU tensors
    [local_batch_size, seq_len]; state_dict() / load_state_dict() hold the position, so that a
    resumed run continues with exactly the batches an uninterrupted run would have seen.
    """

    def __init__(self, windows: TokenBatches):
        self.windows, self.step = windows, 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.step += 1
        return self.windows.batch(self.step)

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


@dataclass
class Datasets:
    tokenizer: ByteTokenizer
    train: TrainBatches
    validation: None = None  # held-out batches: not built yet for this source


def build_datasets(config, rank: int, world_size: int) -> Datasets:
    """The tokenizer and this rank's training (and validation) batches for ``config`` (a Config)."""
    t = config.training
    tokenizer = ByteTokenizer()
    tokens = DATASETS[config.data.dataset](tokenizer, config.data.max_bytes)
    windows = TokenBatches(tokens, t.seq_len, t.local_batch_size, rank, world_size, config.job.seed)
    return Datasets(tokenizer, TrainBatches(windows))
