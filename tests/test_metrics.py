"""MetricsLogger: metrics.jsonl (fresh or appended), validation records, progress with an ETA,
TensorBoard event files, wandb (offline without a key, a clear message when it is missing)."""

import json
import struct
import sys
import time
from pathlib import Path

import pytest
import torch

from mx_recipe.train.config import MetricsConfig
from mx_recipe.train.metrics import MetricsLogger, check_metrics_config, wandb_mode

CPU = torch.device("cpu")
TRAIN_KEYS = {"step", "loss", "tokens_per_sec", "tflops", "mfu", "memory_gib", "time", "elapsed_s"}


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _logger(out, **kw) -> MetricsLogger:
    return MetricsLogger(out, CPU, 1e6, True, **kw)


def _log(logger: MetricsLogger, step: int, loss: float = 2.0) -> dict:
    logger.add_tokens(128)
    return logger.log(step, loss, {"lr": 1e-3, "grad_norm": 0.5})


def test_log_keeps_every_key_and_a_fresh_run_truncates(tmp_path):
    logger = _logger(tmp_path)
    record = _log(logger, 1)
    assert TRAIN_KEYS | {"lr", "grad_norm"} == set(record)
    assert record["tokens_per_sec"] > 0 and record["mfu"] is None
    _log(logger, 2)
    logger.close()
    assert [r["step"] for r in _records(tmp_path)] == [1, 2]
    _log(_logger(tmp_path), 1)
    assert [r["step"] for r in _records(tmp_path)] == [1]


def test_resumed_run_appends(tmp_path):
    first = _logger(tmp_path)
    _log(first, 1)
    _log(first, 2)
    first.close()
    resumed = _logger(tmp_path, append=True)
    _log(resumed, 3)
    resumed.log_validation(3, 1.5)
    resumed.close()
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 3]
    assert set(records[-1]) == {"step", "val_loss", "time"} and records[-1]["val_loss"] == 1.5


def test_a_resumed_run_sets_aside_the_records_of_the_steps_it_trains_again(tmp_path, capsys):
    """Resumed from its checkpoint of step 2, a run logs steps 3 and 4 again: their first records, validation
    and a line a crash cut short included, move to metrics.redone.jsonl, so each step is in metrics.jsonl once."""
    first = _logger(tmp_path)
    for step in (1, 2, 3, 4):
        _log(first, step)
    first.log_validation(2, 1.75)
    first.log_validation(4, 1.5)
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # killed mid-write
    capsys.readouterr()
    resumed = _logger(tmp_path, append=True, resumed_step=2)
    assert "moved 4 records logged after step 2 to metrics.redone.jsonl" in capsys.readouterr().out
    for step in (3, 4):
        _log(resumed, step)
    resumed.close()
    assert [(r["step"], "val_loss" in r) for r in _records(tmp_path)] == [(1, 0), (2, 0), (2, 1), (3, 0), (4, 0)]
    redone = (tmp_path / "metrics.redone.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in redone[:3]] == [3, 4, 4] and redone[3] == '{"step": 5, "lo'


def test_validation_record_and_line(tmp_path, capsys):
    logger = _logger(tmp_path)
    record = logger.log_validation(10, 2.25)
    assert record["step"] == 10 and record["val_loss"] == 2.25
    assert _records(tmp_path) == [record]
    assert "validation loss   2.2500" in capsys.readouterr().out


def test_progress_and_eta(tmp_path, capsys):
    logger = _logger(tmp_path, total_steps=100)
    _log(logger, 1)
    _log(logger, 50)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step      1/100 (  1%)") and "eta" in lines[0]
    assert lines[1].startswith("step     50/100 ( 50%)") and "eta 0:00:00" in lines[1]
    resumed = _logger(tmp_path, append=True, total_steps=100)
    _log(resumed, 51)  # the steps before were not timed by this process: no ETA yet
    _log(resumed, 60)
    lines = capsys.readouterr().out.splitlines()
    assert "eta" not in lines[0] and "eta" in lines[1]
    _log(_logger(tmp_path), 1)  # without total_steps the line is as before
    assert capsys.readouterr().out.startswith("step      1  loss")


def test_only_rank_zero_writes(tmp_path, capsys):
    out = tmp_path / "run"
    logger = MetricsLogger(out, CPU, 1e6, False, metrics_config=MetricsConfig(log_freq=1, tensorboard=True))
    _log(logger, 1)
    logger.log_validation(1, 1.0)
    logger.close()
    assert not out.exists() and capsys.readouterr().out == ""


def test_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = _logger(tmp_path, metrics_config=MetricsConfig(log_freq=1, tensorboard=True))
    _log(logger, 1, loss=3.0)
    _log(logger, 2, loss=2.5)
    logger.log_validation(2, 2.75)
    logger.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 3.0), (2, 2.5)]
    assert [(e.step, e.value) for e in events.Scalars("val/loss")] == [(2, 2.75)]
    assert {"train/tokens_per_sec", "train/lr", "train/grad_norm"} <= set(events.Tags()["scalars"])


def test_missing_tensorboard_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match="needs the tensorboard package: pip install tensorboard"):
        _logger(tmp_path, metrics_config=MetricsConfig(log_freq=1, tensorboard=True))
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    key, message = check_metrics_config(MetricsConfig(log_freq=1, tensorboard=True))
    assert key == "metrics.tensorboard" and "dev extra" in message


def test_missing_wandb_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ImportError, match=r"needs the wandb package: pip install -e '.\[wandb\]' \(the wandb extra\)"):
        _logger(tmp_path, metrics_config=MetricsConfig(log_freq=1, wandb=True))
    key, message = check_metrics_config(MetricsConfig(log_freq=1, wandb=True))
    assert key == "metrics.wandb" and "wandb extra" in message
    assert check_metrics_config(MetricsConfig(log_freq=1)) is None


def wandb_records(output_dir: Path) -> tuple[str, list[dict], list[str]]:
    """(run id, history rows, record kinds) of the one offline run wandb wrote under output_dir, read from its
    .wandb file: a log of 32 KiB blocks of records (7-byte header: crc32, length, kind 1 full / 2 first /
    3 middle / 4 last), each a wandb_internal_pb2.Record, after a 7-byte file header that starts ":W&B"."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = (output_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, parts, records = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # no room for a header: the block's tail is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if (kind, length) == (0, 0):
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            records.append(pb.Record.FromString(parts))
    run_ids = [r.run.run_id for r in records if r.WhichOneof("record_type") == "run"]
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    return (run_ids or [None])[0], history, [r.WhichOneof("record_type") for r in records]


def finished_wandb_records(output_dir: Path, timeout_s: float = 30.0) -> tuple[str, list[dict], list[str]]:
    """``wandb_records`` once the file holds the run and its exit: wandb's service process writes the file
    on its own, and under load it was seen without them right after ``finish()`` returned."""
    deadline = time.monotonic() + timeout_s
    while True:
        run_id, history, kinds = wandb_records(output_dir)
        if (run_id is not None and "exit" in kinds) or time.monotonic() > deadline:
            return run_id, history, kinds
        time.sleep(0.2)


def test_wandb_offline_without_a_key_and_resumed_into_the_same_run(tmp_path, monkeypatch):
    """The real wandb package, offline (no WANDB_API_KEY, no network): the run is named after output_dir, logs
    train/ and val/ numbers by step, and a resumed run continues the same wandb run; a fresh one starts another."""
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "my_run"
    config = MetricsConfig(log_freq=1, wandb=True, wandb_project="proj")
    logger = _logger(out, metrics_config=config)
    assert logger.wandb.settings.mode == "offline" and logger.wandb.project == "proj" and logger.wandb.name == "my_run"
    _log(logger, 1, loss=3.0)
    logger.log_validation(1, 2.0)
    logger.close()
    run_id = (out / "wandb_run_id").read_text().strip()
    got_id, history, kinds = finished_wandb_records(out)
    assert got_id == run_id and "exit" in kinds  # finished
    assert history[0]["_step"] == 1 and history[0]["train/loss"] == 3.0 and history[0]["val/loss"] == 2.0
    assert "train/mfu" not in history[0]  # no MFU on the CPU
    resumed = _logger(out, append=True, metrics_config=config)
    assert resumed.wandb.id == run_id
    resumed.close()
    fresh = _logger(out, metrics_config=config)  # a fresh run in the same folder is a new wandb run
    assert fresh.wandb.id != run_id and (out / "wandb_run_id").read_text().strip() == fresh.wandb.id
    fresh.close()


def test_wandb_goes_online_with_a_key(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x")
    assert wandb_mode() == "online"
