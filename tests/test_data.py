"""Data sources, tokenizers, packing, sharding, resume and validation splits, on small files the tests make."""

import importlib.util
import json
import sys

import numpy as np
import pytest
import torch

from mx_recipe.train import data as data_module
from mx_recipe.train.config import ConfigError, DataConfig, build_config
from mx_recipe.train.data import StreamBatches, TrainBatches, build_datasets, check_data_config, pack
from mx_recipe.train.tokenizer import ByteTokenizer, build_tokenizer

BOS, EOS = ByteTokenizer.bos_id, ByteTokenizer.eos_id


def _config(seq_len: int = 16, local_batch_size: int = 2, **data):
    if "path" in data:
        data.setdefault("dataset", "files")
    training = {"steps": 2, "local_batch_size": local_batch_size, "seq_len": seq_len, "lr": 1e-3, "warmup_steps": 1}
    raw = {
        "job": {"output_dir": "out", "seed": 0},
        "model": {"name": "llama", "flavor": "debug"},
        "training": training,
        "mx": {"recipe": "none"},
        "metrics": {"log_freq": 1},
        "data": {"max_bytes": 10_000, **data},
    }
    return build_config(raw, "test.toml", [])


def _doc(i: int) -> str:
    """A document that names itself, so that tokens can be traced back to it."""
    return f"<doc{i:03d}>" + "abcdefghij"[i % 10] * (5 + i % 7)


def _write_txt(folder, n: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"{i:03d}.txt").write_text(_doc(i))


def _doc_ids(tokens: torch.Tensor | np.ndarray) -> set[int]:
    text = ByteTokenizer().decode(np.asarray(tokens).ravel().tolist())
    return {int(part[:3]) for part in text.split("<doc")[1:] if part[:3].isdigit()}


def _batches(stream, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [stream.next_batch() for _ in range(n)]


def _assert_same(a, b) -> None:
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


# ----------------------------------------------------------------------------- tokenizers and packing


def test_byte_tokenizer_adds_no_boundaries_and_round_trips():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (258, 256, 257)
    assert tok.encode("hé") == [104, 0xC3, 0xA9] == tok.encode("hé".encode())
    assert tok.decode([BOS, *tok.encode("hé"), EOS]) == "hé"


def test_packing_wraps_each_document_in_bos_eos():
    stream = pack(ByteTokenizer(), [b"ab", "c", b""])
    assert stream.tolist() == [BOS, 97, 98, EOS, BOS, 99, EOS, BOS, EOS]


def _tiny_tokenizer_json(path, specials: list[str]) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["hello world, the quick brown fox"] * 20, trainer)
    tok.save(str(path))


def test_tokenizer_json_uses_its_special_tokens(tmp_path):
    path = tmp_path / "tokenizer.json"
    _tiny_tokenizer_json(path, ["<s>", "</s>"])
    tok = build_tokenizer(str(path))
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    ids = tok.encode("hello world")
    assert ids and tok.bos_id not in ids and tok.eos_id not in ids  # no boundaries added
    assert tok.decode(ids) == "hello world" and tok.decode(tok.encode(b"fox")) == "fox"
    assert tok.vocab_size > max(ids)
    docs = ["hello", "the fox"]
    assert pack(tok, docs).tolist() == [0, *tok.encode("hello"), 1, 0, *tok.encode("the fox"), 1]


def test_tokenizer_json_without_special_tokens_gets_new_ids(tmp_path):
    path = tmp_path / "tokenizer.json"
    _tiny_tokenizer_json(path, [])
    tok = build_tokenizer(str(path))
    base = tok.vocab_size - 2
    assert (tok.bos_id, tok.eos_id) == (base, base + 1)
    assert tok.decode([tok.bos_id, *tok.encode("hello"), tok.eos_id]) == "hello"


def test_files_source_with_tokenizer_json(tmp_path):
    path = tmp_path / "tokenizer.json"
    _tiny_tokenizer_json(path, ["<s>", "</s>"])
    (tmp_path / "a.txt").write_text("hello world " * 20)
    (tmp_path / "b.txt").write_text("the quick brown fox " * 20)
    config = _config(seq_len=8, path=str(tmp_path / "*.txt"), tokenizer=str(path), validation_fraction=0.5)
    ds = build_datasets(config, 0, 1)
    assert ds.tokenizer.bos_id == 0
    inputs, targets = ds.train.next_batch()
    assert inputs.shape == (2, 8) and int(inputs.max()) < ds.tokenizer.vocab_size
    val_inputs, _ = next(ds.validation.batches(1))
    assert "fox" in ds.tokenizer.decode(val_inputs[0].tolist())  # b.txt, the last document, is held out


# ----------------------------------------------------------------------------- sources


def test_txt_source_one_document_per_file_in_path_order(tmp_path):
    _write_txt(tmp_path / "txt", 4)
    config = _config(path=str(tmp_path / "txt" / "*.txt"), validation_fraction=0.0)
    ds = build_datasets(config, 0, 1)
    expected = pack(ByteTokenizer(), [_doc(i) for i in range(4)])
    assert np.array_equal(ds.train.windows.tokens, expected)
    assert ds.validation is None


def test_jsonl_source_one_document_per_line(tmp_path):
    rows = [{"text": _doc(i), "id": i} for i in range(5)]
    lines = [json.dumps(r) for r in rows[:3]] + [""] + [json.dumps(r) for r in rows[3:]]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    ds = build_datasets(_config(path=str(tmp_path / "*.jsonl"), validation_fraction=0.0), 0, 1)
    assert np.array_equal(ds.train.windows.tokens, pack(ByteTokenizer(), [_doc(i) for i in range(5)]))


def test_jsonl_source_names_a_line_without_the_text_field(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:2: no string field 'text'"):
        build_datasets(_config(path=str(tmp_path / "*.jsonl"), validation_fraction=0.0), 0, 1)


def test_parquet_source_one_document_per_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = [_doc(i) for i in range(6)]
    pq.write_table(pa.table({"content": docs[:4], "n": list(range(4))}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"content": docs[4:], "n": [4, 5]}), tmp_path / "b.parquet")
    config = _config(path=str(tmp_path / "*.parquet"), text_field="content", validation_fraction=0.0)
    ds = build_datasets(config, 0, 1)
    assert np.array_equal(ds.train.windows.tokens, pack(ByteTokenizer(), docs))
    config.data.text_field = "text"
    with pytest.raises(ValueError, match=r"a.parquet: no column 'text'"):
        build_datasets(config, 0, 1)


def test_max_bytes_cuts_the_corpus(tmp_path):
    _write_txt(tmp_path, 10)
    config = _config(path=str(tmp_path / "*.txt"), validation_fraction=0.0, max_bytes=30)
    ds = build_datasets(config, 0, 1)
    tokens = ds.train.windows.tokens
    assert int(np.sum(tokens < 256)) == 30  # bytes, not counting the BOS/EOS around each document


def test_python_stdlib_default_corpus():
    ds = build_datasets(_config(max_bytes=200_000), 0, 1)
    inputs, targets = ds.train.next_batch()
    assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == (2, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert ds.validation is not None and next(ds.validation.batches(1))[0].shape == (2, 16)


# ----------------------------------------------------------------------------- batches: determinism, sharding, resume


def test_batches_are_deterministic_and_shifted(tmp_path):
    _write_txt(tmp_path, 20)
    config = _config(path=str(tmp_path / "*.txt"))
    a, b = build_datasets(config, 0, 1), build_datasets(config, 0, 1)
    batches = _batches(a.train, 3)
    _assert_same(batches, _batches(b.train, 3))
    assert not torch.equal(batches[0][0], batches[1][0])
    for inputs, targets in batches:
        assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_equal_global_batch_gives_the_same_tokens_at_any_world_size(tmp_path):
    _write_txt(tmp_path, 30)
    glob = str(tmp_path / "*.txt")
    one = build_datasets(_config(path=glob, local_batch_size=4, validation_fraction=0.2), 0, 1)
    two = [build_datasets(_config(path=glob, local_batch_size=2, validation_fraction=0.2), r, 2) for r in range(2)]
    for _ in range(3):
        inputs, targets = one.train.next_batch()
        parts = [ds.train.next_batch() for ds in two]
        assert not torch.equal(parts[0][0], parts[1][0])  # each rank its own slice
        assert torch.equal(inputs, torch.cat([p[0] for p in parts]))
        assert torch.equal(targets, torch.cat([p[1] for p in parts]))
    (val_one,) = one.validation.batches(1)
    val_two = [next(ds.validation.batches(1)) for ds in two]
    assert torch.equal(val_one[0], torch.cat([v[0] for v in val_two]))


def test_resume_from_state_dict_continues_exactly(tmp_path):
    _write_txt(tmp_path, 20)
    config = _config(path=str(tmp_path / "*.txt"))
    straight = build_datasets(config, 1, 2).train
    expected = _batches(straight, 5)
    first = build_datasets(config, 1, 2).train
    _batches(first, 2)
    state = first.state_dict()
    assert isinstance(first, TrainBatches) and state == {"step": 2}
    resumed = build_datasets(config, 1, 2).train
    resumed.load_state_dict(state)
    _assert_same(_batches(resumed, 3), expected[2:])


# ----------------------------------------------------------------------------- validation split


def test_validation_split_is_the_last_documents_and_disjoint_from_training(tmp_path):
    _write_txt(tmp_path, 20)
    config = _config(seq_len=8, path=str(tmp_path / "*.txt"), validation_fraction=0.1)
    ds = build_datasets(config, 0, 1)
    assert _doc_ids(ds.train.windows.tokens) == set(range(18))  # ceil(0.1 * 20) = 2 held out
    val = [x for x, _ in ds.validation.batches(20)]
    assert _doc_ids(torch.cat([x for x in val])) <= {18, 19}
    config.data.validation_fraction = 0.001  # still at least one document
    assert _doc_ids(build_datasets(config, 0, 1).train.windows.tokens) == set(range(19))


def test_validation_batches_are_identical_on_every_call(tmp_path):
    _write_txt(tmp_path, 40)
    config = _config(seq_len=8, path=str(tmp_path / "*.txt"), validation_fraction=0.25)
    validation = build_datasets(config, 0, 1).validation
    first = list(validation.batches(3))
    _assert_same(list(validation.batches(3)), first)
    _assert_same(list(validation.batches(6))[:3], first)  # reading further does not move the start
    many = list(validation.batches(200))  # more than the split holds: cycled, still n batches
    assert len(many) == 200


def test_validation_split_too_small_for_a_window(tmp_path):
    _write_txt(tmp_path, 4)
    config = _config(seq_len=64, path=str(tmp_path / "*.txt"), validation_fraction=0.25, max_bytes=10_000)
    (tmp_path / "000.txt").write_text("x" * 500)  # enough training tokens, a tiny held-out document
    ds = build_datasets(config, 0, 1)
    with pytest.raises(ValueError, match="validation split has .* tokens, fewer than seq_len"):
        next(ds.validation.batches(1))


# ----------------------------------------------------------------------------- hf streaming (a fake dataset)


class FakeRows:
    """Stands in for a streamed Hugging Face split: re-iterable rows, counting how often it is opened."""

    def __init__(self, texts: list[str]):
        self.texts, self.opened = texts, 0

    def __iter__(self):
        self.opened += 1
        return iter([{"text": t, "meta": 0} for t in self.texts])


def _hf(monkeypatch, splits: dict, seq_len: int = 8, local_batch_size: int = 2, **data):
    config = _config(seq_len=seq_len, local_batch_size=local_batch_size, **data)
    config.data.dataset = "hf"  # set after validation: `datasets` need not be installed for the fake
    monkeypatch.setattr(data_module, "open_hf_dataset", lambda data: splits)
    return config


def test_hf_stream_packs_documents_round_robin_across_ranks(monkeypatch):
    docs = [_doc(i) for i in range(60)]
    config = _hf(monkeypatch, {"train": FakeRows(docs), "validation": FakeRows(docs[:5])})
    ranks = [build_datasets(config, r, 2) for r in range(2)]
    assert all(isinstance(ds.train, StreamBatches) for ds in ranks)
    seen = [_doc_ids(torch.cat([x for x, _ in _batches(ds.train, 12)])) for ds in ranks]
    assert seen[0] and seen[1] and all(i % 2 == 0 for i in seen[0]) and all(i % 2 == 1 for i in seen[1])
    # Packing: consecutive windows of one rank continue one another, documents wrapped BOS ... EOS.
    single = build_datasets(config, 0, 1).train
    windows = torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in _batches(single, 4)])
    assert windows.flatten().tolist() == pack(ByteTokenizer(), docs)[: windows.numel()].tolist()


def test_hf_stream_resumes_exactly_mid_document(monkeypatch):
    docs = [_doc(i) * 3 for i in range(80)]  # documents longer than a window
    config = _hf(monkeypatch, {"train": FakeRows(docs)}, validation_fraction=0.0)
    expected = _batches(build_datasets(config, 1, 2).train, 9)
    first = build_datasets(config, 1, 2).train
    _batches(first, 4)
    state = first.state_dict()
    assert state["offset"] > 0 and state["documents"] > 0  # stopped inside a document
    resumed = build_datasets(config, 1, 2).train
    resumed.load_state_dict(state)
    _assert_same(_batches(resumed, 5), expected[4:])
    with pytest.raises(ValueError, match="cannot be resumed at another world size"):
        build_datasets(config, 0, 1).train.load_state_dict(state)


def test_hf_validation_uses_the_validation_split(monkeypatch):
    train, val = FakeRows([_doc(i) for i in range(40)]), FakeRows([_doc(100 + i) for i in range(10)])
    ds = build_datasets(_hf(monkeypatch, {"train": train, "validation": val}), 0, 1)
    batches = list(ds.validation.batches(2))
    assert _doc_ids(torch.cat([x for x, _ in batches])) <= set(range(100, 110))
    _assert_same(list(ds.validation.batches(2)), batches)
    assert 0 in _doc_ids(ds.train.next_batch()[0])  # training starts at the first document


def test_hf_without_validation_split_holds_out_the_first_documents(monkeypatch):
    monkeypatch.setattr(data_module, "HF_HELDOUT_DOCUMENTS", 5)
    ds = build_datasets(_hf(monkeypatch, {"train": FakeRows([_doc(i) for i in range(60)])}), 0, 1)
    assert _doc_ids(torch.cat([x for x, _ in ds.validation.batches(3)])) <= set(range(5))
    trained = _doc_ids(torch.cat([x for x, _ in _batches(ds.train, 10)]))
    assert min(trained) == 5


def test_hf_unknown_split_and_end_of_stream(monkeypatch):
    config = _hf(monkeypatch, {"train": FakeRows(["a", "b"])}, hf_split="test", validation_fraction=0.0)
    with pytest.raises(ValueError, match="data.hf_split 'test'.* splits train"):
        build_datasets(config, 0, 1)
    config.data.hf_split = "train"
    with pytest.raises(RuntimeError, match="data stream ended after 2"):
        build_datasets(config, 0, 1).train.next_batch()


# ----------------------------------------------------------------------------- clear errors before any model


def _data(**kw) -> DataConfig:
    return DataConfig(**kw)


def test_check_data_config_names_each_problem(tmp_path):
    _write_txt(tmp_path / "two", 2)
    (tmp_path / "one.txt").write_text("x")
    (tmp_path / "d.csv").write_text("x")
    (tmp_path / "garbage.json").write_text("not a tokenizer")
    assert check_data_config(_data()) is None
    assert check_data_config(_data(dataset="files", path=str(tmp_path / "two" / "*.txt"))) is None
    cases = [
        (_data(dataset="imagenet"), "data.dataset", "unknown dataset 'imagenet'"),
        (_data(dataset="files"), "data.path", "needs data.path"),
        (_data(dataset="files", path=str(tmp_path / "nope" / "*.txt")), "data.path", "matches no file"),
        (_data(dataset="files", path=str(tmp_path / "*.csv")), "data.path", "d.csv: unsupported file type"),
        (_data(dataset="files", path=str(tmp_path / "one.txt")), "data.validation_fraction", "single document"),
        (_data(tokenizer=str(tmp_path / "missing.json")), "data.tokenizer", "no such file"),
        (_data(tokenizer=str(tmp_path)), "data.tokenizer", "is a directory"),
    ]
    if importlib.util.find_spec("tokenizers") is not None:
        cases.append(
            (_data(tokenizer=str(tmp_path / "garbage.json")), "data.tokenizer", "not a Hugging Face tokenizer.json")
        )
    for data, key, message in cases:
        problem = check_data_config(data)
        assert problem is not None and problem[0] == key and message in problem[1], (data, problem)


def test_check_data_config_names_the_extra_of_a_missing_package(tmp_path, monkeypatch):
    (tmp_path / "t.parquet").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    cases = [
        (_data(dataset="files", path=str(tmp_path / "*.parquet")), "data.path", "pyarrow"),
        (_data(dataset="hf"), "data.dataset", "datasets package: pip install -e '.[hf]'"),
        (_data(tokenizer=str(tmp_path / "tokenizer.json")), "data.tokenizer", "tokenizers package"),
    ]
    for data, key, message in cases:
        problem = check_data_config(data)
        assert problem is not None and problem[0] == key and message in problem[1], problem
        assert "extra" in problem[1]


def test_bad_data_path_stops_the_config(tmp_path):
    with pytest.raises(ConfigError, match=r"test.toml: key 'data.path': .* matches no file"):
        _config(dataset="files", path=str(tmp_path / "*.jsonl"))
    with pytest.raises(ConfigError, match=r"key 'data.tokenizer': unknown tokenizer"):
        _config(tokenizer="llama3")
