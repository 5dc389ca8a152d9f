"""The offline assets a torchtitan run needs on a machine that cannot download anything: a byte-level BPE tokenizer
trained on this project's corpus, and that corpus as a local dataset that torchtitan's ``c4_test`` loader reads.

    python scripts/torchtitan_assets.py --out outputs/torchtitan_assets [--vocab-size 16384] [--max-mib 64]

The corpus is train.py's ``python_stdlib`` dataset (the Python installation's standard-library sources, sorted by
path; ``mx_recipe.train.data``), read up to ``--max-mib``. It writes

- ``<out>/tokenizer/tokenizer.json`` and ``tokenizer_config.json``: byte-level BPE (every byte in the base vocabulary,
  so no text is out of vocabulary) with Llama 3's BOS ``<|begin_of_text|>`` and EOS ``<|end_of_text|>``, BOS
  added to each document;
- ``<out>/data/train.jsonl``: one JSON object a document, its source in ``text``;

and torchtitan takes them as ``--model.hf_assets_path <out>/tokenizer --training.dataset c4_test
--training.dataset_path <out>/data``. The same inputs give the same files (the BPE trainer is deterministic).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mx_recipe.cli import ArgumentParser  # noqa: E402
from mx_recipe.train.data import python_stdlib_documents, read_documents  # noqa: E402

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def train_tokenizer(documents: list[str], vocab_size: int):
    """A byte-level BPE tokenizer of ``vocab_size`` entries (the 256 bytes and the two special tokens included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator(documents, trainer)
    return tokenizer


def write_assets(out: Path, vocab_size: int, max_bytes: int) -> tuple[Path, Path]:
    """Write the tokenizer and the dataset under ``out``; returns their folders."""
    documents = [doc.decode("utf-8", errors="replace") for doc in read_documents(python_stdlib_documents(), max_bytes)]
    tokenizer_dir, data_dir = out / "tokenizer", out / "data"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    train_tokenizer(documents, vocab_size).save(str(tokenizer_dir / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": False}
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    with open(data_dir / "train.jsonl", "w", encoding="utf-8") as f:
        for doc in documents:
            f.write(json.dumps({"text": doc}) + "\n")
    return tokenizer_dir, data_dir


def main() -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder to write tokenizer/ and data/ into")
    parser.add_argument("--vocab-size", type=int, default=16384, help="BPE vocabulary entries (>= 258)")
    parser.add_argument("--max-mib", type=float, default=64, help="corpus MiB read")
    args = parser.parse_args()
    if args.vocab_size < 258:
        parser.error(f"--vocab-size must be at least 258 (256 bytes and 2 special tokens), got {args.vocab_size}")
    if args.max_mib <= 0:
        parser.error(f"--max-mib must be positive, got {args.max_mib}")
    tokenizer_dir, data_dir = write_assets(args.out, args.vocab_size, int(args.max_mib * 2**20))
    print(f"tokenizer: {tokenizer_dir} ({args.vocab_size} entries); data: {data_dir}/train.jsonl")
    flags = f"--model.hf_assets_path {tokenizer_dir} --training.dataset c4_test --training.dataset_path {data_dir}"
    print(f"torchtitan: {flags}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
