"""Data: document sources, sequence packing with document boundaries, and per-rank batches.

Sources (``data.dataset``):
- ``python_stdlib``: the Python installation's own standard library sources (sorted by path,
  site-packages excluded), one document per file: a deterministic offline corpus on every machine.
- ``files``: a glob (``data.path``) of local ``.txt`` (one document per file), ``.jsonl`` (one
  document per line, its ``data.text_field``) and ``.parquet`` files (one per row, the
  ``data.text_field`` column, read with pyarrow), in sorted path order.
- ``hf``: a Hugging Face dataset streamed by name (``datasets.load_dataset(..., streaming=True)``,
  e.g. ``hf_name = "allenai/c4"``, ``hf_config = "en"``); needs the ``hf`` extra and the network.

Every document is tokenized and wrapped BOS ... EOS; documents are concatenated and cut into
windows of ``seq_len + 1`` tokens (inputs and targets shifted by one).

In-memory sources (python_stdlib, files) read at most ``data.max_bytes`` of text and hold out
the last ``ceil(validation_fraction * documents)`` documents for validation. Training windows are
drawn at random by *global* sample index from a generator seeded by (seed, step): rank r of W
takes its slice of each global batch, so runs at equal global batch see the same tokens whatever
the world size, and the resumable position is just the step.

The hf source is a stream: documents go round-robin to the ranks (document i to rank i % W), each
rank packs its own into consecutive windows, and the position is (documents consumed, tokens of
the current document already used), so a resumed run continues where it stopped (it re-reads the
stream up to there). Validation uses the dataset's ``validation`` split if it has one, else the
first ``HF_HELDOUT_DOCUMENTS`` documents of the training split, which training then skips.
"""

from __future__ import annotations

import glob
import importlib.util
import itertools
import json
import math
import os
import sysconfig
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mx_recipe.train.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer, check_tokenizer

DATASETS = ("python_stdlib", "files", "hf")
FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")
HF_HELDOUT_DOCUMENTS = 10_000  # validation documents taken from an hf training split without a validation split
PYARROW_HINT = "pip install pyarrow, or the project's hf or dev extra: pip install -e '.[hf]'"
DATASETS_HINT = "pip install -e '.[hf]' (the hf extra: datasets, tokenizers, pyarrow)"

Document = str | bytes
OpenDocuments = Callable[[], Iterator[Document]]  # a fresh iterator over the same documents on each call

__all__ = [
    "ByteTokenizer",
    "Datasets",
    "StreamBatches",
    "TokenBatches",
    "TrainBatches",
    "ValidationBatches",
    "build_datasets",
    "check_data_config",
    "pack",
]


# ----------------------------------------------------------------------------- sources


def python_stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def python_stdlib_documents() -> Iterator[bytes]:
    files = python_stdlib_files()
    if not files:
        raise FileNotFoundError(f"no Python sources found under {sysconfig.get_paths()['stdlib']}")
    for path in files:
        yield path.read_bytes()


def data_files(pattern: str) -> list[Path]:
    """The files matching ``pattern`` (``**`` recurses), sorted: the document order is the path order."""
    return sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {e}") from None
            text = row.get(text_field) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: no string field {text_field!r} (data.text_field)")
            yield text


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError; its message names no file
        raise ValueError(f"{path}: not a readable parquet file ({e})") from e
    if text_field not in parquet.schema_arrow.names:
        names = ", ".join(parquet.schema_arrow.names)
        raise ValueError(f"{path}: no column {text_field!r} (data.text_field); columns: {names}")
    for batch in parquet.iter_batches(batch_size=1024, columns=[text_field]):
        yield from (text for text in batch.column(0).to_pylist() if text is not None)


def file_documents(pattern: str, text_field: str) -> Iterator[Document]:
    files = data_files(pattern)
    if not files:
        raise FileNotFoundError(f"data.path {pattern!r} matches no file")
    for path in files:
        if path.suffix == ".txt":
            yield path.read_bytes()
        elif path.suffix == ".jsonl":
            yield from _jsonl_documents(path, text_field)
        elif path.suffix == ".parquet":
            yield from _parquet_documents(path, text_field)
        else:
            raise ValueError(f"{path}: unsupported file type; known: {', '.join(FILE_SUFFIXES)}")


def read_documents(documents: Iterable[Document], max_bytes: int) -> list[bytes]:
    """Non-empty documents as UTF-8 bytes, until ``max_bytes`` in all (the last one cut to fit)."""
    out, total = [], 0
    for doc in documents:
        data = doc.encode("utf-8") if isinstance(doc, str) else doc
        data = data[: max_bytes - total]
        if data:
            out.append(data)
            total += len(data)
        if total >= max_bytes:
            break
    return out


def open_hf_dataset(data) -> Mapping[str, Iterable[dict[str, Any]]]:
    """The splits of a Hugging Face dataset, streamed: nothing is downloaded up front.

    The seam the tests replace with in-memory rows (the network is not there in tests)."""
    import datasets

    return datasets.load_dataset(data.hf_name, data.hf_config or None, streaming=True)


def _texts(rows: Iterable[dict[str, Any]], text_field: str, source: str) -> Iterator[str]:
    for i, row in enumerate(rows):
        if text_field not in row:
            raise ValueError(f"{source} row {i}: no field {text_field!r} (data.text_field); fields: {', '.join(row)}")
        if row[text_field]:
            yield row[text_field]


# ----------------------------------------------------------------------------- packing


def token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 2**16 else np.int32


def pack(tokenizer: Tokenizer, documents: Sequence[Document]) -> np.ndarray:
    """One token stream: every document tokenized and wrapped BOS ... EOS, concatenated."""
    dtype = token_dtype(tokenizer.vocab_size)
    bos, eos = np.array([tokenizer.bos_id], dtype), np.array([tokenizer.eos_id], dtype)
    parts = []
    for ids in tokenizer.encode_arrays(documents):
        parts += [bos, ids.astype(dtype, copy=False), eos]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def _to_batch(windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, seq_len + 1] windows -> inputs and targets [B, seq_len], int64 on the CPU."""
    windows = torch.from_numpy(windows.astype(np.int64))
    return windows[:, :-1], windows[:, 1:]


# ----------------------------------------------------------------------------- training batches


class TokenBatches:
    """Random windows of ``seq_len + 1`` tokens of an in-memory stream, indexed by step: deterministic."""

    def __init__(self, tokens: np.ndarray, seq_len: int, local_batch_size: int, rank: int, world_size: int, seed: int):
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"training corpus of {len(tokens)} tokens is too short for seq_len {seq_len}")
        self.tokens = tokens
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets [local_batch_size, seq_len] (int64, CPU) for ``step``."""
        # Draw the whole global batch and keep this rank's slice: the same tokens at any world size.
        rng = np.random.default_rng([self.seed, step])
        global_batch = self.local_batch_size * self.world_size
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=global_batch)
        mine = starts[self.rank * self.local_batch_size : (self.rank + 1) * self.local_batch_size]
        return _to_batch(np.stack([self.tokens[s : s + self.seq_len + 1] for s in mine]))


class TrainBatches:
    """The training stream of one rank over an in-memory source: ``next_batch()`` and a resumable position.

    The interface every data source keeps: next_batch() -> (inputs, targets) int64 CPU tensors
    [local_batch_size, seq_len]; state_dict() / load_state_dict() hold the position, so that a
    resumed run continues with exactly the batches an uninterrupted run would have seen. The
    position (the step) is the same on every rank and valid at any world size.
    """

    def __init__(self, windows: TokenBatches):
        self.windows, self.step = windows, 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.step += 1
        return self.windows.batch(self.step)

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


class _PackedDocuments:
    """What a packer of a document stream into ``seq_len + 1`` windows for one rank needs."""

    def __init__(
        self,
        open_documents: OpenDocuments,
        tokenizer: Tokenizer,
        seq_len: int,
        local_batch_size: int,
        rank: int,
        world_size: int,
    ):
        self.open_documents, self.tokenizer = open_documents, tokenizer
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.rank, self.world_size = rank, world_size


class StreamBatches(_PackedDocuments):
    """One rank's share of a document stream (documents i with i % world_size == rank), packed into
    consecutive windows of ``seq_len + 1`` tokens; same interface as TrainBatches.

    Position: ``documents`` (this rank's documents wholly used) and ``offset`` (tokens of the next
    one already used, BOS included). Documents shorter than a window share it with the next ones.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.documents, self.offset = 0, 0
        self._reset()

    def _reset(self) -> None:
        self._iter: Iterator[Document] | None = None  # opened lazily, at the position
        self._buffer = np.zeros(0, token_dtype(self.tokenizer.vocab_size))  # tokens not yet used
        self._lengths: deque[int] = deque()  # token counts of the documents in the buffer, oldest first

    def _read_document(self) -> None:
        if self._iter is None:
            start = self.documents * self.world_size + self.rank
            self._iter = itertools.islice(self.open_documents(), start, None, self.world_size)
        doc = next(self._iter, None)
        if doc is None:
            consumed = self.documents + len(self._lengths)
            raise RuntimeError(f"rank {self.rank}: the data stream ended after {consumed} of its documents")
        tokens = pack(self.tokenizer, [doc])
        skip = self.offset if not self._lengths else 0  # resuming inside this document
        self._lengths.append(len(tokens))
        self._buffer = np.concatenate([self._buffer, tokens[skip:]])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        need = self.local_batch_size * (self.seq_len + 1)
        while len(self._buffer) < need:
            self._read_document()
        windows, self._buffer = self._buffer[:need], self._buffer[need:]
        self.offset += need
        while self._lengths and self.offset >= self._lengths[0]:
            self.offset -= self._lengths.popleft()
            self.documents += 1
        return _to_batch(windows.reshape(self.local_batch_size, self.seq_len + 1))

    def state_dict(self) -> dict[str, int]:
        return {"documents": self.documents, "offset": self.offset, "rank": self.rank, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if (int(state["rank"]), int(state["world_size"])) != (self.rank, self.world_size):
            raise ValueError(
                f"a streamed dataset's position belongs to rank {state['rank']} of {state['world_size']}; "
                f"this is rank {self.rank} of {self.world_size} (a stream cannot be resumed at another world size)"
            )
        self.documents, self.offset = int(state["documents"]), int(state["offset"])
        self._reset()


# ----------------------------------------------------------------------------- validation batches


class ValidationBatches(_PackedDocuments):
    """Held-out documents packed into consecutive ``seq_len + 1`` windows. ``batches(n)`` yields the
    same n batches on every call; rank r takes its slice of each global batch, so every world size
    sees the same windows at equal global batch. A split smaller than n global batches is cycled."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._iter: Iterator[Document] | None = None
        self._parts: list[np.ndarray] = []
        self._length, self._exhausted = 0, False

    def _windows(self, count: int) -> np.ndarray:
        """At least ``count`` windows [_, seq_len + 1] when the split has that many (read lazily, kept)."""
        width = self.seq_len + 1
        if self._iter is None:
            self._iter = self.open_documents()
        while self._length < count * width and not self._exhausted:
            doc = next(self._iter, None)
            if doc is None:
                self._exhausted = True
                break
            self._parts.append(pack(self.tokenizer, [doc]))
            self._length += len(self._parts[-1])
        if len(self._parts) > 1:
            self._parts = [np.concatenate(self._parts)]
        tokens = self._parts[0] if self._parts else np.zeros(0, np.int64)
        n = len(tokens) // width
        if n == 0:
            raise ValueError(
                f"the validation split has {len(tokens)} tokens, fewer than seq_len + 1 = {width}: "
                "raise data.validation_fraction, or set it to 0 for no validation"
            )
        return tokens[: n * width].reshape(n, width)

    def batches(self, n: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        global_batch = self.local_batch_size * self.world_size
        windows = self._windows(n * global_batch)
        first = self.rank * self.local_batch_size
        for j in range(n):
            index = (j * global_batch + first + np.arange(self.local_batch_size)) % len(windows)
            yield _to_batch(windows[index])


# ----------------------------------------------------------------------------- building


@dataclass
class Datasets:
    tokenizer: Tokenizer
    train: TrainBatches | StreamBatches
    validation: ValidationBatches | None = None  # None: no held-out split (validation_fraction = 0)


def held_out_count(num_documents: int, validation_fraction: float) -> int:
    """Documents held out for validation: the last ceil(fraction * n), at least one when fraction > 0."""
    return math.ceil(validation_fraction * num_documents) if validation_fraction > 0 else 0


def _build_in_memory(config, tokenizer: Tokenizer, rank: int, world_size: int) -> Datasets:
    data, t = config.data, config.training
    if data.dataset == "python_stdlib":
        source = python_stdlib_documents()
    else:
        source = file_documents(data.path, data.text_field)
    documents = read_documents(source, data.max_bytes)
    if not documents:  # nothing to train on, whatever data.validation_fraction is
        raise ValueError(f"data.path {data.path!r}: every document is empty: there is no text to train on")
    n_val = held_out_count(len(documents), data.validation_fraction)
    if len(documents) - n_val < 1:
        raise ValueError(
            f"data.dataset {data.dataset!r} has {len(documents)} document(s): too few to hold out "
            f"{n_val} for validation; set data.validation_fraction = 0 or add documents"
        )
    train_docs, val_docs = documents[: len(documents) - n_val], documents[len(documents) - n_val :]
    windows = TokenBatches(
        pack(tokenizer, train_docs), t.seq_len, t.local_batch_size, rank, world_size, config.job.seed
    )
    validation = None
    if val_docs:
        validation = ValidationBatches(
            lambda: iter(val_docs), tokenizer, t.seq_len, t.local_batch_size, rank, world_size
        )
    return Datasets(tokenizer, TrainBatches(windows), validation)


def _build_hf(config, tokenizer: Tokenizer, rank: int, world_size: int) -> Datasets:
    data, t = config.data, config.training
    splits = open_hf_dataset(data)
    if data.hf_split not in splits:
        raise ValueError(f"data.hf_split {data.hf_split!r}: {data.hf_name} has splits {', '.join(splits)}")
    rows, name = splits[data.hf_split], f"{data.hf_name}[{data.hf_split}]"

    def train_documents(skip: int) -> OpenDocuments:
        return lambda: itertools.islice(_texts(rows, data.text_field, name), skip, None)

    open_train, validation = train_documents(0), None
    if data.validation_fraction > 0:
        if "validation" in splits and data.hf_split != "validation":
            val_rows, val_name = splits["validation"], f"{data.hf_name}[validation]"
            open_val = lambda: _texts(val_rows, data.text_field, val_name)
        else:  # no validation split: hold out the first documents of the training split
            held_out = HF_HELDOUT_DOCUMENTS
            open_val = lambda: itertools.islice(_texts(rows, data.text_field, name), held_out)
            open_train = train_documents(held_out)
        validation = ValidationBatches(open_val, tokenizer, t.seq_len, t.local_batch_size, rank, world_size)
    train = StreamBatches(open_train, tokenizer, t.seq_len, t.local_batch_size, rank, world_size)
    return Datasets(tokenizer, train, validation)


def build_datasets(config, rank: int, world_size: int) -> Datasets:
    """The tokenizer and this rank's training (and validation) batches for ``config`` (a Config)."""
    tokenizer = build_tokenizer(config.data.tokenizer)
    if config.data.dataset == "hf":
        return _build_hf(config, tokenizer, rank, world_size)
    return _build_in_memory(config, tokenizer, rank, world_size)


def _missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


def check_data_config(data) -> tuple[str, str] | None:
    """(key, message) for a data source or tokenizer that cannot work, checked before any model
    is built; None when the data config is usable. Cheap: it globs and looks for packages, and
    loads a tokenizer.json, but reads no corpus and touches no network."""
    if data.dataset not in DATASETS:
        return "data.dataset", f"unknown dataset {data.dataset!r}; known: {', '.join(DATASETS)}"
    if data.dataset == "files":
        if not data.path:
            return "data.path", f"dataset 'files' needs data.path, a glob of {', '.join(FILE_SUFFIXES)} files"
        files = data_files(data.path)
        if not files:
            return "data.path", f"{data.path!r} matches no file"
        unknown = [p for p in files if p.suffix not in FILE_SUFFIXES]
        if unknown:
            return "data.path", f"{unknown[0]}: unsupported file type; known: {', '.join(FILE_SUFFIXES)}"
        if any(p.suffix == ".parquet" for p in files) and _missing("pyarrow"):
            return "data.path", f"parquet files need the pyarrow package: {PYARROW_HINT}"
        if len(files) == 1 and files[0].suffix == ".txt" and data.validation_fraction > 0:
            return (
                "data.validation_fraction",
                f"{files[0]} is a single document (one .txt file): nothing is left to hold out "
                "for validation; set it to 0 or give more files",
            )
    if data.dataset == "hf":
        if _missing("datasets"):
            return "data.dataset", f"dataset 'hf' needs the datasets package: {DATASETS_HINT}"
        if not data.hf_name:
            return "data.hf_name", "dataset 'hf' needs a dataset name, e.g. allenai/c4"
    problem = check_tokenizer(data.tokenizer)
    if problem is not None:
        return "data.tokenizer", problem
    return None
