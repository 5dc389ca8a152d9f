"""The training loop's features on the CPU: stop signals, NaN handling, validation, activation
checkpointing, gradient accumulation, compile, HSDP and start-up errors.

Most runs go through train.py's main() in this process (tests/test_train.py: run_in_process);
the ones that need a real signal run it as a subprocess. Faults (a NaN loss) are injected through
mx_recipe.train.faults.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import fault_entry
import pytest
import torch
import torch.distributed as dist
from test_train import (
    BF16_ARGS,
    ENV,
    REPO,
    SMALL,
    _metrics,
    bf16_reference,
    last_losses,
    run_in_process,
    train_script,
)
from torch.distributed.fsdp import FSDPModule

from mx_recipe.models import build_model, model_args
from mx_recipe.train.faults import NO_FAULTS, FaultHooks, fault_hooks, set_fault_hooks
from mx_recipe.train.lock import RunLock
from mx_recipe.train.parallel import DistInfo, apply_activation_checkpointing, materialize_and_shard
from mx_recipe.train.step import forward_backward

CPU = torch.device("cpu")


@pytest.fixture
def nan_loss_at():
    """Installs FaultHooks making the loss of the given steps NaN; removes them after the test."""
    yield lambda *steps: set_fault_hooks(FaultHooks(nan_loss_steps=frozenset(steps)))
    set_fault_hooks(None)


def test_a_stop_signal_saves_and_the_same_command_resumes_exactly(tmp_path):
    """SIGUSR1 (SIGTERM takes the same path) from outside part-way: a checkpoint at the step
    boundary even with checkpoint.enable false, exit 0, no DONE; the same command again resumes
    from it, appends to metrics.jsonl and logs the losses of a run that never stopped."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    args = ["--config", "debug_mxfp8", "--training.steps", "8", "--training.local_batch_size", "2", *SMALL]
    cmd = [sys.executable, "train.py", *args, "--job.output_dir", str(run)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step      2/8"):
            proc.send_signal(signal.SIGUSR1)
            break
    seen.append(proc.communicate(timeout=300)[0])
    text = "".join(seen)
    assert proc.returncode == 0, text[-3000:]
    match = re.search(r"received SIGUSR1: stopped after step (\d+) of 8; checkpoint (\S+);", text)
    assert match, text[-3000:]
    stopped = int(match.group(1))
    assert 2 <= stopped < 8 and match.group(2) == str(run / "checkpoints" / f"step-{stopped}")
    assert not (run / "DONE").exists()

    code, out, err = run_in_process([*args, "--job.output_dir", str(run)])
    assert code == 0, err
    assert f"resuming from checkpoint {run / 'checkpoints' / f'step-{stopped}'} (step {stopped} of 8)" in out
    assert (run / "DONE").is_file()
    steps = [r["step"] for r in _metrics(run)]
    assert steps == list(range(1, stopped + 1)) + list(range(stopped + 1, 9))  # appended, not truncated

    code, _, err = run_in_process([*args, "--job.output_dir", str(ref)])
    assert code == 0, err
    assert last_losses(run) == last_losses(ref)


def test_nan_loss_is_skipped_up_to_the_limit_then_stops_naming_the_last_checkpoint(tmp_path, nan_loss_at):
    run = tmp_path / "run"
    nan_loss_at(2, 3)
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    code, out, err = run_in_process([*BF16_ARGS, *ckpt, "--training.skip_nan_steps", "1", "--job.output_dir", str(run)])
    assert code == 1
    assert "step 2: loss is nan: skipped without an update (1 of 1 skips used)" in out
    last = run / "checkpoints" / "step-2"  # saved after the skipped step: its state is still good
    assert f"error: loss is nan at step 3; last good checkpoint: {last} (1 of 1 skips used)\n" in err
    assert [r["step"] for r in _metrics(run)] == [1] and not (run / "DONE").exists()


def test_nan_loss_stops_at_once_without_skips(tmp_path, nan_loss_at):
    nan_loss_at(1)
    code, _, err = run_in_process([*BF16_ARGS, "--job.output_dir", str(tmp_path)])
    assert code == 1
    assert "error: loss is nan at step 1; last good checkpoint: none\n" in err


def test_skipped_nan_steps_leave_the_run_going(tmp_path, nan_loss_at):
    nan_loss_at(2, 3)
    code, out, err = run_in_process([*BF16_ARGS, "--training.skip_nan_steps", "2", "--job.output_dir", str(tmp_path)])
    assert code == 0, err
    assert "step 3: loss is nan: skipped without an update (2 of 2 skips used)" in out
    records = _metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 4] and records[-1]["loss"] < records[0]["loss"]
    assert (tmp_path / "DONE").is_file()


def test_fault_entry_takes_its_hooks_and_leaves_train_py_its_arguments():
    """tests/fault_entry.py's split of a command line; with no hook installed nothing is injected."""
    assert fault_hooks() == NO_FAULTS and not NO_FAULTS.nan_loss_steps
    args = ["--config", "debug_bf16", "--nan-loss-steps", "2,3", "--training.steps", "4", "--kill-in-save-step", "3"]
    hooks, rest = fault_entry.parse_hooks(args)
    assert hooks == FaultHooks(nan_loss_steps=frozenset({2, 3}), kill_in_save_step=3)
    assert rest == ["--config", "debug_bf16", "--training.steps", "4"]
    assert fault_entry.parse_hooks(["--signal-step", "3"]) == (FaultHooks(signal_step=3), [])
    assert fault_entry.parse_hooks(["--signal-in-setup"]) == (FaultHooks(signal_in_setup=True), [])


def test_a_stop_signal_during_set_up_exits_0_for_a_requeue_and_the_rerun_trains(tmp_path):
    """SIGTERM before the first step used to kill the run (exit 143, no message), which the SLURM scripts do not
    requeue: now set-up stops at its next stage, says so in one line and exits 0, as a stop in the loop does;
    the same command again trains from the start."""
    run = tmp_path / "run"
    cmd = [sys.executable, "tests/fault_entry.py", "--signal-in-setup", *BF16_ARGS, "--job.output_dir", str(run)]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    expected = "received SIGTERM during set-up: stopped before this run's first step; exiting 0 for a requeue"
    assert proc.stdout.splitlines()[-1] == expected and proc.stderr == ""
    assert not (run / "metrics.jsonl").exists() and not (run / "DONE").exists()
    code, _, err = run_in_process([*BF16_ARGS, "--job.output_dir", str(run)])
    assert code == 0, err
    assert last_losses(run) == bf16_reference()


def test_validation_is_logged_and_changes_no_training_step(tmp_path):
    val = ["--validation.enable", "true", "--validation.interval", "2", "--validation.steps", "2"]
    code, out, err = run_in_process([*BF16_ARGS, *val, "--job.output_dir", str(tmp_path)])
    assert code == 0, err
    records = [r for r in _metrics(tmp_path) if "val_loss" in r]
    assert [r["step"] for r in records] == [2, 4]
    assert all(0 < r["val_loss"] < 10 for r in records) and records[1]["val_loss"] < records[0]["val_loss"]
    assert last_losses(tmp_path) == bf16_reference()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--validation.enable", "true", "--data.validation_fraction", "0"], "has no validation split"),
        (["--parallel.dp_replicate", "2"], "parallel.dp_replicate = 2 does not divide the world size 1"),
        (
            ["--mx.recipe", "mxfp8", "--mx.skip", "layers.0.attention"],
            "mx.skip: 'layers.0.attention' matches no linear layer or expert group of llama debug",
        ),
    ],
)
def test_a_run_that_cannot_start_stops_before_the_model_is_built(tmp_path, overrides, message):
    code, out, err = run_in_process([*BF16_ARGS, *overrides, "--job.output_dir", str(tmp_path)])
    assert code == 2 and message in err and err.startswith("error: ")
    assert "parameters" not in out


def test_mx_skip_keeps_the_output_layer_in_bf16(tmp_path):
    """--mx.skip adds to the default patterns: the output layer stays in bf16 (it used to be converted)."""
    skip = ["--mx.recipe", "mxfp8", "--mx.skip", "layers.0.attention.wq", "--training.steps", "1"]
    code, out, err = run_in_process([*BF16_ARGS, *skip, "--job.output_dir", str(tmp_path)])
    assert code == 0, err
    assert re.search(r"^output +\S+ +skipped: matches 'output'$", out, re.M), out
    assert "layers.0.attention.wq" in out and "27 of 29 layers converted" in out


def test_out_of_memory_reports_the_memory_figures(monkeypatch, tmp_path):
    def oom(config, info, signals):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(train_script, "train", oom)
    code, _, err = run_in_process([*BF16_ARGS, "--job.output_dir", str(tmp_path)])
    assert code == 1
    assert re.search(r"out of memory on rank 0: cpu: peak resident memory [\d.]+ GiB", err)


@pytest.mark.parametrize(("mode", "calls"), [("none", 1), ("selective", 2), ("full", 2)])
def test_activation_checkpointing_recomputes_blocks_with_the_same_gradients(mode, calls):
    """Every block's feed-forward runs again in backward under selective and full AC; the
    gradients are bit-identical to no AC, and the parameter names do not change."""

    def grads(mode: str) -> tuple[list[str], list[torch.Tensor], int]:
        torch.manual_seed(0)
        model = build_model(model_args("llama", "debug", 320, 32))
        names = list(model.state_dict())
        apply_activation_checkpointing(model, mode)
        count = []
        model.layers["1"].feed_forward.register_forward_pre_hook(lambda *_: count.append(1))
        tokens = torch.randint(0, 320, (2, 32))
        model(tokens).float().logsumexp(-1).mean().backward()
        return names, [p.grad for p in model.parameters()], len(count)

    names, expected, _ = grads("none")
    names_ac, got, count = grads(mode)
    assert count == calls and names_ac == names
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "overrides",
    [
        ["--activation_checkpoint.mode", "selective"],
        ["--activation_checkpoint.mode", "full", "--parallel.reshard_after_forward", "false"],
    ],
)
def test_ac_and_fsdp_knobs_train_the_moe_model_to_the_same_losses(tmp_path, overrides):
    """MoE: recomputing a block runs its router again; the expert loads it adds are counted twice
    for every expert alike, so the balancing update (the sign of mean - load) is unchanged."""
    args = ["--config", "debug_moe_bf16", "--training.steps", "2", "--training.local_batch_size", "2", *SMALL]
    code, _, err = run_in_process([*args, "--job.output_dir", str(tmp_path / "plain")])
    assert code == 0, err
    code, out, err = run_in_process([*args, *overrides, "--job.output_dir", str(tmp_path / "knobs")])
    assert code == 0, err
    assert f"activation checkpointing {overrides[1]}" in out
    assert last_losses(tmp_path / "knobs") == last_losses(tmp_path / "plain")


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield DistInfo(0, 0, 1, CPU)
    dist.destroy_process_group()


def test_gradient_accumulation_equals_one_large_batch(one_process_group, monkeypatch):
    """Two microbatches of 2 give the loss and gradients of one batch of 4 (fp32 parameters and
    compute, so within fp32 rounding); FSDP syncs gradients only on the last microbatch."""

    def fsdp_model() -> torch.nn.Module:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = build_model(model_args("llama", "debug", 320, 32))
        torch.manual_seed(0)
        materialize_and_shard(model, one_process_group, param_dtype=torch.float32)
        return model

    syncs = []
    original = FSDPModule.set_requires_gradient_sync

    def recording(self, flag: bool, **kwargs) -> None:
        syncs.append(flag)
        original(self, flag, **kwargs)

    monkeypatch.setattr(FSDPModule, "set_requires_gradient_sync", recording)
    torch.manual_seed(1)
    windows = torch.randint(0, 258, (4, 33))
    inputs, targets = windows[:, :-1], windows[:, 1:]
    one, two = fsdp_model(), fsdp_model()
    loss_one = forward_backward(one, [(inputs, targets)], CPU)
    syncs.clear()
    loss_two = forward_backward(two, [(inputs[:2], targets[:2]), (inputs[2:], targets[2:])], CPU)
    assert syncs == [False, True]
    torch.testing.assert_close(loss_two, loss_one, rtol=1e-6, atol=0)
    for a, b in zip(two.parameters(), one.parameters(), strict=True):
        torch.testing.assert_close(a.grad.full_tensor(), b.grad.full_tensor(), rtol=1e-5, atol=1e-7)


def test_gradient_accumulation_run_counts_every_microbatch(tmp_path):
    args = [*BF16_ARGS, "--training.steps", "2", "--training.gradient_accumulation_steps", "2"]
    code, out, err = run_in_process([*args, "--job.output_dir", str(tmp_path)])
    assert code == 0, err
    assert "global batch 4 x 64 tokens" in out
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in _metrics(tmp_path))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inside inductor
def test_compile_with_selective_ac_trains_like_eager(tmp_path):
    """torch.compile per block on the CPU (inductor's C++ backend): 20 s on two idle cores, over a
    minute on busy ones, mostly the first compile. Recipe none only: inductor's CPU code generation
    has no float8_e8m0fnu (the MX scales), so MX + compile is for GPUs (scripts/gpu_resume_check.sh)."""
    args = [*BF16_ARGS, "--training.steps", "2", "--compile.enable", "true"]
    args += ["--activation_checkpoint.mode", "selective"]
    try:
        code, out, err = run_in_process([*args, "--job.output_dir", str(tmp_path)])
    finally:
        torch._dynamo.reset()
    assert code == 0, err
    assert "compile on" in out
    losses, expected = last_losses(tmp_path), bf16_reference()
    assert sorted(losses) == [1, 2]
    for step, loss in losses.items():  # compiled kernels round differently: close, not equal
        assert abs(loss - expected[step]) <= 1e-2 * expected[step]


def test_deterministic_run_gives_the_reference_losses_and_restores_the_mode(tmp_path):
    """training.deterministic turns torch's deterministic algorithms on for the run (for comparing two runs
    bit for bit on a GPU) and back off after it; on the CPU the losses are the plain run's."""
    assert not torch.are_deterministic_algorithms_enabled()
    code, _, err = run_in_process([*BF16_ARGS, "--training.deterministic", "true", "--job.output_dir", str(tmp_path)])
    assert code == 0, err
    assert not torch.are_deterministic_algorithms_enabled()
    assert last_losses(tmp_path) == bf16_reference()


def test_a_finished_run_without_checkpoints_is_not_overwritten(tmp_path):
    """Run again into the output_dir of a finished run that left no checkpoint: refused (exit 2, one line naming
    the folder), and its metrics.jsonl, config.toml and DONE are kept as they were."""
    args = [*BF16_ARGS, "--training.steps", "2", "--job.output_dir", str(tmp_path)]
    code, _, err = run_in_process(args)
    assert code == 0, err
    before = {name: (tmp_path / name).read_bytes() for name in ("metrics.jsonl", "config.toml", "DONE")}
    code, _, err = run_in_process([*args, "--training.lr", "1e-3"])
    assert code == 2
    assert f"job.output_dir {tmp_path} holds the metrics of a finished run (2 records in metrics.jsonl)" in err
    assert len(err.strip().splitlines()) == 1
    assert {name: (tmp_path / name).read_bytes() for name in before} == before


def test_an_output_dir_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "taken"
    path.write_text("not a folder")
    code, _, err = run_in_process([*BF16_ARGS, "--job.output_dir", str(path)])
    assert code == 2 and f"job.output_dir {path} is a file, not a folder" in err and path.read_text() == "not a folder"


def test_a_second_run_in_a_busy_output_dir_is_refused_and_the_first_resumes_after_a_kill(tmp_path):
    """Two runs in one output_dir: the second is refused with one line naming the first's pid and host, and
    writes nothing. kill -9 of the first leaves no stale lock: the rerun resumes from its checkpoint, logs each
    step once and ends with the losses of a run that never stopped."""
    run = tmp_path / "run"
    args = [*BF16_ARGS, "--checkpoint.enable", "true", "--checkpoint.interval", "1", "--job.output_dir", str(run)]
    cmd = [sys.executable, "train.py", *args]
    first = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in first.stdout:
            if line.startswith("saved checkpoint"):
                first.send_signal(signal.SIGSTOP)  # holds the lock, mid-run
                break
        before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
        code, out, err = run_in_process(args)
        assert code == 2 and out == ""
        holder = f"pid {first.pid} on host {socket.gethostname()}"
        assert err.startswith(f"error: job.output_dir {run} is in use by the run of {holder} (it holds {run}/run.lock)")
        assert len(err.splitlines()) == 1
        assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    finally:
        first.kill()
        first.wait(timeout=60)
    code, out, err = run_in_process(args)
    assert code == 0, err
    assert "resuming from checkpoint" in out
    assert [r["step"] for r in _metrics(run)] == [1, 2, 3, 4]  # the steps logged after its checkpoint set aside
    assert last_losses(run) == bf16_reference()


def output_dir_holder(output_dir: Path) -> str | None:
    """Who holds ``output_dir`` now (None: nobody; the lock is left free)."""
    lock = RunLock()
    try:
        return lock.acquire(output_dir)
    finally:
        lock.release()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_workers_end_when_their_torchrun_is_killed(tmp_path):
    """kill -9 of torchrun alone used to leave its worker training on; now the kernel ends it with its parent.
    The worker's lock on its output_dir, released only when the process is gone, shows it ended."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train.py"]
    cmd += [*BF16_ARGS, "--training.steps", "100000", "--job.output_dir", str(run)]
    launcher = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in launcher.stdout:
            if line.startswith("step      1/"):
                break
        assert output_dir_holder(run) is not None, "the worker holds its output_dir"
        launcher.kill()
        launcher.wait(timeout=60)
        deadline = time.monotonic() + 60
        while output_dir_holder(run) is not None:
            assert time.monotonic() < deadline, "the worker outlived its torchrun"
            time.sleep(0.1)
    finally:
        launcher.kill()
        launcher.stdout.close()


def test_check_says_whether_a_run_can_start_without_starting_it(tmp_path):
    """train.py --check, for launchers to run before torchrun: exit 0 and the output_dir for a run that can start,
    else exit 2 and one line (a config error, a busy output_dir, a skip pattern that matches nothing); no model
    is trained and nothing but the folder is written."""
    run = tmp_path / "run"
    args = [*BF16_ARGS, "--job.output_dir", str(run), "--check"]
    assert run_in_process(args) == (0, f"ok: job.output_dir {run}\n", "")
    assert [p.name for p in run.iterdir()] == ["run.lock"]
    code, out, err = run_in_process([*args, "--training.lr", "0"])
    assert code == 2 and err == "config error: command line --training.lr: must be positive, got 0.0\n"
    code, _, err = run_in_process([*args, "--mx.recipe", "mxfp8", "--mx.skip", "layers.0.ffn"])
    assert (
        code == 2 and err.startswith("error: mx.skip: 'layers.0.ffn' matches no linear layer") and err.count("\n") == 1
    )
    lock = RunLock()
    assert lock.acquire(run) is None
    try:
        code, _, err = run_in_process(args)
        assert code == 2 and err.startswith(f"error: job.output_dir {run} is in use by the run of pid {os.getpid()}")
    finally:
        lock.release()


@pytest.mark.parametrize("case", ["max_bytes", "short_corpus", "bad_jsonl", "bad_parquet", "empty"])
def test_data_that_cannot_make_a_run_is_one_line_and_exit_2(tmp_path, case):
    """The README's promise for a run that cannot start: exit 2 and one line that names the problem."""
    args = [*BF16_ARGS, "--job.output_dir", str(tmp_path / "run")]
    if case == "max_bytes":  # one document: none to hold out for validation
        args += ["--data.max_bytes", "300", "--validation.enable", "true"]
        expected = "data: data.dataset 'python_stdlib' has 1 document(s): too few to hold out 1 for validation"
    else:
        args += ["--data.validation_fraction", "0"]
    if case == "short_corpus":
        (tmp_path / "tiny.txt").write_text("too short")
        args += ["--data.dataset", "files", "--data.path", str(tmp_path / "tiny.txt")]
        expected = "is too short for seq_len"
    elif case == "bad_jsonl":
        (tmp_path / "docs.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
        args += ["--data.dataset", "files", "--data.path", str(tmp_path / "docs.jsonl")]
        expected = f"data: {tmp_path / 'docs.jsonl'}:2: not valid JSON"
    elif case == "empty":  # it used to say "set data.validation_fraction = 0", which cannot help
        for name in ("a.txt", "b.txt"):
            (tmp_path / name).write_text("")
        args += ["--data.path", str(tmp_path / "*.txt")]
        expected = f"data: data.path '{tmp_path / '*.txt'}': every document is empty"
    elif case == "bad_parquet":
        pytest.importorskip("pyarrow")
        (tmp_path / "docs.parquet").write_bytes(b"PAR1 this is not parquet PAR1")
        args += ["--data.dataset", "files", "--data.path", str(tmp_path / "docs.parquet")]
        expected = f"data: {tmp_path / 'docs.parquet'}: not a readable parquet file"
    code, _, err = run_in_process(args)
    assert code == 2, err
    assert expected in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no folder can be made")
def test_an_output_dir_that_cannot_be_created_is_refused(tmp_path):
    """As on a read-only disk (as root, permissions do not stop a write: /proc refuses it)."""
    code, _, err = run_in_process([*BF16_ARGS, "--job.output_dir", "/proc/mx_recipe_run"])
    assert code == 2 and "job.output_dir: cannot create /proc/mx_recipe_run" in err
    assert len(err.strip().splitlines()) == 1


def test_an_output_dir_too_long_for_the_file_system_is_one_line(tmp_path):
    """A name longer than the file system allows was an OSError traceback (Errno 36) on rank 0."""
    long = tmp_path / ("x" * 300)
    code, _, err = run_in_process([*BF16_ARGS, "--job.output_dir", str(long)])
    assert (
        code == 2
        and err == f"error: job.output_dir: cannot create {long} (File name too long): choose another job.output_dir\n"
    )


def test_a_model_whose_training_state_cannot_fit_stops_before_it_is_built(tmp_path, monkeypatch):
    """fp32 weights, gradients and AdamW's moments (16 bytes a parameter) on a device offering less: the run stops
    with one line and exit 2 before the model is built (on a CPU the OS would kill it without a line)."""
    from mx_recipe.ops import device

    monkeypatch.setattr(device, "memory_bytes", lambda d: 10**6)
    dims = model_args("llama", "debug", 320, 64)
    with torch.device("meta"):
        need = 16 * sum(p.numel() for p in build_model(dims).parameters())
    code, out, err = run_in_process([*BF16_ARGS, "--job.output_dir", str(tmp_path / "run")])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "model llama" not in out, err
    assert f"fp32 weights, gradients and AdamW moments, 16 bytes each) needs at least {need / 1e6:,.1f} MB" in err
    assert re.search(r"more than this .+'s 1\.0 MB", err), err
