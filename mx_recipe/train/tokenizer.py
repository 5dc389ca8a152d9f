"""Tokenizers: byte-level (the offline default) and any Hugging Face ``tokenizer.json``.

Both give ``vocab_size``, ``bos_id``, ``eos_id``, ``encode(text) -> list[int]`` without BOS/EOS
(the packer adds document boundaries) and ``decode(ids) -> str``. ``encode_arrays`` tokenizes
many documents at once into numpy arrays, which is what the packer uses: a list of Python ints
per byte would cost seconds and gigabytes on a 64 MiB corpus.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

# Special tokens of common tokenizer.json files, most specific first. GPT-2 style tokenizers have
# only <|endoftext|>, which then serves as both BOS and EOS.
BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[CLS]", "<|endoftext|>")
EOS_TOKENS = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "[SEP]")
TOKENIZERS_HINT = "pip install tokenizers, or the project's hf or dev extra: pip install -e '.[hf]'"


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int

    def encode(self, text: str | bytes) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def encode_arrays(self, docs: Sequence[str | bytes]) -> list[np.ndarray]: ...


def _as_bytes(text: str | bytes) -> bytes:
    return text.encode("utf-8") if isinstance(text, str) else text


def _as_str(text: str | bytes) -> str:
    return text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text


class ByteTokenizer:
    """Bytes 0..255 (UTF-8 for text), then BOS = 256 and EOS = 257."""

    bos_id = 256
    eos_id = 257
    vocab_size = 258

    def encode(self, text: str | bytes) -> list[int]:
        return list(_as_bytes(text))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")

    def encode_arrays(self, docs: Sequence[str | bytes]) -> list[np.ndarray]:
        return [np.frombuffer(_as_bytes(d), dtype=np.uint8) for d in docs]


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library.

    BOS and EOS are the file's own special tokens (``BOS_TOKENS`` / ``EOS_TOKENS``); a tokenizer
    without them gets new ids past its vocabulary, which ``decode`` drops.
    """

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise ImportError(f"a tokenizer.json needs the tokenizers package: {TOKENIZERS_HINT}") from None
        self.path = Path(path)
        self.tokenizer = _Tokenizer.from_file(str(self.path))
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        self.base_vocab_size = max(vocab.values(), default=-1) + 1  # ids need not be dense
        self.vocab_size = self.base_vocab_size
        self.bos_id = self._special(BOS_TOKENS)
        self.eos_id = self._special(EOS_TOKENS)

    def _special(self, candidates: tuple[str, ...]) -> int:
        for token in candidates:
            token_id = self.tokenizer.token_to_id(token)
            if token_id is not None:
                return token_id
        self.vocab_size += 1
        return self.vocab_size - 1

    def encode(self, text: str | bytes) -> list[int]:
        return self.tokenizer.encode(_as_str(text), add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids if i < self.base_vocab_size], skip_special_tokens=False)

    def encode_arrays(self, docs: Sequence[str | bytes]) -> list[np.ndarray]:
        # encode_batch runs on all cores (the Rust side), in chunks to bound memory.
        dtype = np.uint16 if self.vocab_size <= 2**16 else np.int32
        arrays, chunk = [], 1024
        for i in range(0, len(docs), chunk):
            texts = [_as_str(d) for d in docs[i : i + chunk]]
            for enc in self.tokenizer.encode_batch(texts, add_special_tokens=False):
                arrays.append(np.asarray(enc.ids, dtype=dtype))
        return arrays


def check_tokenizer(spec: str) -> str | None:
    """Why ``spec`` (``byte`` or a tokenizer.json path) cannot be loaded, or None when it can."""
    if spec == "byte":
        return None
    path = Path(spec).expanduser()
    if not path.exists():
        return f"unknown tokenizer {spec!r}: not 'byte' and no such file (give the path of a tokenizer.json)"
    if path.is_dir():
        return f"tokenizer {spec!r} is a directory; give the path of its tokenizer.json"
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return f"tokenizer {spec!r} needs the tokenizers package: {TOKENIZERS_HINT}"
    try:
        HFTokenizer(path)
    except Exception as e:  # the Rust side raises a bare Exception with the parse error
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        return f"tokenizer {spec!r} is not a Hugging Face tokenizer.json: {reason}"
    return None


def build_tokenizer(spec: str) -> Tokenizer:
    """``byte``, or the path of a Hugging Face tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(Path(spec).expanduser())
