"""Checkpoints: atomic commits, a kill in the middle of a save, exact resume over 2 processes, and
a checkpoint written by 2 processes loaded by 1 (DCP resharding). The kill and the signal are
injected by tests/fault_entry.py (mx_recipe/train/faults.py)."""

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_train import (
    BF16_ARGS,
    ENV,
    REPO,
    SMALL,
    TORCHRUN,
    _metrics,
    _run,
    bf16_reference,
    last_losses,
    run_in_process,
)
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from mx_recipe.train.checkpoint import committed_checkpoints, latest_checkpoint

FAULT_ENTRY = "tests/fault_entry.py"  # train.py with faults injected, relative to REPO


def test_latest_is_the_newest_committed_checkpoint(tmp_path):
    for name in ("step-2", "step-10", "step-30.tmp", "step-40.old", "step-50", "notes"):
        (tmp_path / name).mkdir()
    for name in ("step-2", "step-10", "step-30.tmp", "step-40.old"):
        (tmp_path / name / ".metadata").write_bytes(b"")
    # step-50 has no .metadata: not a checkpoint DCP finished writing.
    assert committed_checkpoints(tmp_path) == [(2, tmp_path / "step-2"), (10, tmp_path / "step-10")]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-10"
    assert latest_checkpoint(tmp_path / "absent") is None


def test_kill_during_a_save_leaves_the_previous_checkpoint_latest(tmp_path):
    """SIGKILL after the step-3 shards are written, before the commit: step-2 stays the latest,
    the rerun resumes from it, clears the debris, prunes to keep_latest_k, and logs the losses of
    a run that never stopped."""
    run = tmp_path / "run"
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2"]
    cmd = [sys.executable, FAULT_ENTRY, "--kill-in-save-step", "3", *BF16_ARGS, *ckpt, "--job.output_dir", str(run)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-2000:]
    folder = run / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step-1", "step-2", "step-3.tmp"]
    assert any((folder / "step-3.tmp").iterdir())  # shards written, never committed
    assert latest_checkpoint(folder) == folder / "step-2"

    code, out, err = run_in_process([*BF16_ARGS, *ckpt, "--job.output_dir", str(run)])
    assert code == 0, err
    assert f"resuming from checkpoint {folder / 'step-2'} (step 2 of 4)" in out
    assert sorted(p.name for p in folder.iterdir()) == ["step-3", "step-4"]
    assert (run / "DONE").is_file()
    assert last_losses(run) == bf16_reference()


def _died_after_step_2(finished: Path, copy: Path) -> None:
    """``copy``: ``finished`` as a run that died right after saving step 2 would have left it."""
    shutil.copytree(finished, copy)
    shutil.rmtree(copy / "checkpoints" / "step-4")
    (copy / "DONE").unlink()
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    (copy / "metrics.jsonl").write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] <= 2))


@pytest.mark.slow
def test_two_process_resume_is_exact_and_reshards(tmp_path):
    """MoE (its expert biases are model state), FSDP2 over 2 gloo processes, checkpoints at steps
    2 and 4. From step 2:
    - 2 processes resume to the uninterrupted run's losses bit for bit;
    - 1 process at the same global batch (DCP reshards) stays within 1e-3 relative: only the
      order of the reductions differs (measured: about 1e-4 after 4 steps);
    - 2 processes with dp_replicate 2 (each holding the whole model, no FSDP2) resume the FSDP2
      checkpoint too, and when rank 0 alone gets SIGTERM in step 3, both ranks stop after it and save."""
    ref, run, one, hsdp = (tmp_path / name for name in ("ref", "run", "one", "hsdp"))
    args = ["--config", "debug_moe_bf16", "--training.steps", "4", *SMALL]
    two = [*TORCHRUN, *args, "--training.local_batch_size", "2"]
    # the same, with tests/fault_entry.py for train.py: rank 0 sends itself SIGTERM in step 3
    two_signalled = [*TORCHRUN[:-1], FAULT_ENTRY, "--signal-step", "3", *args, "--training.local_batch_size", "2"]
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]
    _run([*two, *ckpt, "--job.output_dir", str(ref)])
    expected = last_losses(ref)
    for copy in (run, one, hsdp):
        _died_after_step_2(ref, copy)

    # The expert biases are in the checkpoint and have moved from their initial zeros.
    dcp_to_torch_save(ref / "checkpoints" / "step-2", tmp_path / "step-2.pt")
    saved = torch.load(tmp_path / "step-2.pt", weights_only=False)
    assert saved["model"]["layers.1.moe.expert_bias"].abs().sum() > 0

    # The two 2-process resumes side by side: each torchrun leaves a core idle much of the time.
    procs = [
        subprocess.Popen([*two, "--job.output_dir", str(run)], **_POPEN),
        subprocess.Popen([*two_signalled, "--parallel.dp_replicate", "2", "--job.output_dir", str(hsdp)], **_POPEN),
    ]
    (out_run, err_run), (out_hsdp, err_hsdp) = (p.communicate(timeout=300) for p in procs)
    assert procs[0].returncode == 0, out_run[-3000:] + err_run[-3000:]
    assert procs[1].returncode == 0, out_hsdp[-3000:] + err_hsdp[-3000:]

    assert f"resuming from checkpoint {run / 'checkpoints' / 'step-2'} (step 2 of 4)" in out_run
    assert (run / "DONE").is_file()
    assert last_losses(run) == expected

    assert "2 x cpu" in out_hsdp and "replicated on 2 ranks (all-reduce)" in out_hsdp
    assert "received SIGTERM: stopped after step 3 of 4" in out_hsdp
    assert latest_checkpoint(hsdp / "checkpoints") == hsdp / "checkpoints" / "step-3"
    assert not (hsdp / "DONE").exists()
    assert abs(last_losses(hsdp)[3] - expected[3]) <= 1e-3 * expected[3]

    code, out, err = run_in_process([*args, "--training.local_batch_size", "4", "--job.output_dir", str(one)])
    assert code == 0, err
    assert "checkpoint written by 2 ranks, loaded by 1" in out
    resharded = last_losses(one)
    assert sorted(resharded) == sorted(expected)
    for step, loss in expected.items():
        assert abs(resharded[step] - loss) <= 1e-3 * loss, (step, resharded[step], loss)


_POPEN = {"cwd": REPO, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": ENV}


CKPT_EVERY_2 = ["--checkpoint.enable", "true", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]


@pytest.fixture(scope="module")
def died_after_step_4(tmp_path_factory) -> Path:
    """A 4-step run with checkpoints at steps 2 and 4, as it would be had it died right after saving step 4."""
    run = tmp_path_factory.mktemp("ckpt") / "run"
    code, _, err = run_in_process([*BF16_ARGS, *CKPT_EVERY_2, "--job.output_dir", str(run)])
    assert code == 0, err
    (run / "DONE").unlink()
    return run


def _damage(run: Path, tmp_path: Path, how: str) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (shard,) = (copy / "checkpoints" / "step-4").glob("__0_*.distcp")
    data = bytearray(shard.read_bytes())
    if how == "truncated":
        shard.write_bytes(data[: len(data) // 2])
    else:  # 256 bytes in the middle overwritten: the size stays, the tensors change
        middle = len(data) // 2
        data[middle : middle + 256] = bytes(256)
        shard.write_bytes(data)
    return copy


def test_checkpoints_carry_checksums_and_their_config(died_after_step_4):
    from mx_recipe.train.checkpoint import damaged_files

    for step in (2, 4):
        folder = died_after_step_4 / "checkpoints" / f"step-{step}"
        listing = json.loads((folder / "checksums.json").read_text())
        assert ".metadata" in listing and any(name.endswith(".distcp") for name in listing)
        assert damaged_files(folder) == [] and "[model]" in (folder / "config.toml").read_text()


@pytest.mark.parametrize("how", ["truncated", "overwritten"])
def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_resumes(died_after_step_4, tmp_path, how):
    """Truncated or 256 bytes overwritten: the checksum names the file, the run resumes from step 2 and
    ends with the losses of a run that never stopped (an overwrite used to resume silently and diverge)."""
    run = _damage(died_after_step_4, tmp_path, how)
    code, out, err = run_in_process([*BF16_ARGS, *CKPT_EVERY_2, "--job.output_dir", str(run)])
    assert code == 0, err
    folder = run / "checkpoints"
    problem = "has" if how == "truncated" else "does not match its checksum"
    assert f"warning: checkpoint {folder / 'step-4'} is damaged: __0_0.distcp {problem}" in out
    assert f"resuming from checkpoint {folder / 'step-2'} (step 2 of 4)" in out
    assert last_losses(run) == bf16_reference()


def test_a_damaged_checkpoint_without_checksums_falls_back_too(died_after_step_4, tmp_path):
    """A checkpoint written before checksums were (no checksums.json) and truncated: DCP's load fails with its
    CheckpointException, a BaseException, and the run still names it and resumes from step 2."""
    run = _damage(died_after_step_4, tmp_path, "truncated")
    for step in (2, 4):
        (run / "checkpoints" / f"step-{step}" / "checksums.json").unlink()
    code, out, err = run_in_process([*BF16_ARGS, *CKPT_EVERY_2, "--job.output_dir", str(run)])
    assert code == 0, err
    assert f"warning: checkpoint {run / 'checkpoints' / 'step-4'} is damaged: CheckpointException" in out
    assert last_losses(run) == bf16_reference()


def test_strict_stops_at_a_damaged_checkpoint_and_all_damaged_stops_too(died_after_step_4, tmp_path):
    run = _damage(died_after_step_4, tmp_path, "overwritten")
    strict = ["--checkpoint.strict", "true", "--job.output_dir", str(run)]
    code, _, err = run_in_process([*BF16_ARGS, *CKPT_EVERY_2, *strict])
    assert code == 2 and f"checkpoint {run / 'checkpoints' / 'step-4'} is damaged" in err and "strict" in err
    (shard,) = (run / "checkpoints" / "step-2").glob("__0_*.distcp")
    shard.write_bytes(shard.read_bytes()[:100])
    code, _, err = run_in_process([*BF16_ARGS, *CKPT_EVERY_2, "--job.output_dir", str(run)])
    assert code == 2 and "every checkpoint under" in err and "(step-4, step-2)" in err
    assert len(err.strip().splitlines()) == 1


def test_resume_under_another_model_or_recipe_is_refused_unless_allowed(died_after_step_4, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(died_after_step_4, run)
    moe = [*BF16_ARGS, *CKPT_EVERY_2, "--job.output_dir", str(run), "--model.name", "moe"]
    moe += ["--model.flavor", "debug_moe"]
    code, _, err = run_in_process(moe)
    assert code == 2 and "model.name: 'llama' -> 'moe'; model.flavor: 'debug' -> 'debug_moe'" in err
    assert "checkpoint.allow_config_change true" in err
    mx = [*BF16_ARGS, *CKPT_EVERY_2, "--job.output_dir", str(run), "--mx.recipe", "mxfp8", "--training.steps", "5"]
    code, _, err = run_in_process(mx)
    assert code == 2 and "mx.recipe: 'none' -> 'mxfp8'" in err
    code, out, err = run_in_process([*mx, "--checkpoint.allow_config_change", "true"])
    assert code == 0, err
    assert "resuming from checkpoint" in out and "config changed: mx.recipe: 'none' -> 'mxfp8'" in out
    # the history of the run's config: the earlier one kept beside the current one
    assert 'recipe = "none"' in (run / "config-1.toml").read_text()
    assert 'recipe = "mxfp8"' in (run / "config.toml").read_text()


def test_a_resume_with_nothing_left_to_train_says_so_unless_the_steps_were_raised(died_after_step_4, tmp_path):
    """A checkpoint past training.steps: exit 2 and one line saying so (it used to print "done" and exit 0 having
    trained nothing), metrics.jsonl untouched. One at the last step is a finished run (it died before writing
    DONE): it says so, writes DONE and exits 0, so a requeue ends cleanly. With training.steps raised the run
    trains on from it."""
    run = tmp_path / "run"
    shutil.copytree(died_after_step_4, run)
    before = (run / "metrics.jsonl").read_bytes()
    step_4 = run / "checkpoints" / "step-4"
    args = [*BF16_ARGS, *CKPT_EVERY_2, "--job.output_dir", str(run)]
    for extra in ([], ["--check"]):  # the same, before a launcher
        code, out, err = run_in_process([*args, "--training.steps", "3", *extra])
        assert code == 2 and err == (
            f"error: checkpoint {step_4} is at step 4, past training.steps = 3: nothing left to train; raise "
            "training.steps above 4 to train on, or choose another job.output_dir\n"
        )
        assert "done" not in out and (run / "metrics.jsonl").read_bytes() == before
    code, out, err = run_in_process([*args, "--training.steps", "4"])
    assert code == 0 and f"done: checkpoint {step_4} is at step 4, the last of training.steps: the run is" in out
    assert (run / "DONE").is_file() and (run / "metrics.jsonl").read_bytes() == before
    (run / "DONE").unlink()
    code, out, err = run_in_process([*args, "--training.steps", "5"])
    assert code == 0, err
    assert f"resuming from checkpoint {step_4} (step 4 of 5)" in out and [r["step"] for r in _metrics(run)][-1] == 5


def test_after_a_resume_each_step_is_logged_once(died_after_step_4, tmp_path):
    """The run died after logging step 4 with step-2 its newest checkpoint: the resume trains steps 3 and 4 again,
    and their first records move to metrics.redone.jsonl (they used to appear twice in metrics.jsonl)."""
    run = tmp_path / "run"
    shutil.copytree(died_after_step_4, run)
    shutil.rmtree(run / "checkpoints" / "step-4")
    code, out, err = run_in_process([*BF16_ARGS, *CKPT_EVERY_2, "--job.output_dir", str(run)])
    assert code == 0, err
    assert "moved 2 records logged after step 2 to metrics.redone.jsonl" in out
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3, 4] and last_losses(run) == bf16_reference()
    assert [json.loads(line)["step"] for line in (run / "metrics.redone.jsonl").read_text().splitlines()] == [3, 4]


def test_a_checkpoint_written_before_a_key_existed_resumes_as_unchanged(died_after_step_4, tmp_path):
    """A key added to [mx] since the checkpoint was written (its config.toml lacks it) counts as at its default,
    so the resume is no config change."""
    run = tmp_path / "run"
    shutil.copytree(died_after_step_4, run)
    saved = run / "checkpoints" / "step-4" / "config.toml"
    saved.write_text("".join(line for line in saved.read_text().splitlines(True) if "skip_replace" not in line))
    code, out, err = run_in_process([*BF16_ARGS, *CKPT_EVERY_2, "--job.output_dir", str(run), "--training.steps", "5"])
    assert code == 0, err
    assert "resuming from checkpoint" in out and "config changed" not in out


def test_a_save_on_a_full_disk_says_so_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """DCP on a full disk fails with "unexpected pos 704 vs 598"; the run stops with one line that says the disk is
    full and names the checkpoint still intact, and the partial save is removed. The disk is made full by stand-ins
    for DCP's write at step 4 and for the disk's free space."""
    import collections

    from torch.distributed.checkpoint.api import CheckpointException

    from mx_recipe.train import checkpoint

    real_save = checkpoint.dcp.save

    def save(state, checkpoint_id):
        if Path(checkpoint_id).name == "step-4.tmp":  # what DCP raises there: a BaseException, not an Exception
            failure = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
            raise CheckpointException("CheckpointException ranks:dict_keys([0])", {0: (failure, None)})
        return real_save(state, checkpoint_id=checkpoint_id)

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.dcp, "save", save)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: usage(100 * 2**30, 100 * 2**30, 2**20))
    run = tmp_path / "run"
    code, _, err = run_in_process([*BF16_ARGS, *CKPT_EVERY_2, "--job.output_dir", str(run)])
    folder = run / "checkpoints"
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert f"cannot save checkpoint {folder / 'step-4'}: no space left on the disk of {folder} (0.00 GiB free)" in err
    assert f"the newest intact checkpoint is {folder / 'step-2'}" in err
    assert sorted(p.name for p in folder.iterdir()) == ["step-2"]
