"""scripts/slurm/*.sbatch: syntax, headers, and their launch lines run here without SLURM.

MX_LOCAL=1 runs a script's own launch line on the CPU; a stand-in `scontrol`/`srun` on PATH runs the
SLURM path (requeue included); a stand-in trainer (MX_TRAIN_SCRIPT) waits for USR1, to check that the
signal reaches the training processes through the launchers and that torchrun survives it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "scripts" / "slurm"
SBATCH = ["train_1node.sbatch", "train_multinode.sbatch", "parity_1node.sbatch"]
SMALL = ["--training.seq_len", "64", "--data.max_bytes", "2000000", "--metrics.log_freq", "1"]

# Records its argv, environment and pids; then, by FAKE_MODE: "done" logs 4 steps and writes DONE like
# train.py; "wait" waits for USR1 and exits 0 without DONE, as train.py does after its checkpoint
# ("wait:NAME" only in an output directory called NAME, "done" elsewhere).
FAKE_TRAINER = r"""
import json, os, signal, sys, time
from pathlib import Path

args = sys.argv[1:]
out = Path(args[args.index("--job.output_dir") + 1])
rank = int(os.environ.get("RANK", 0))  # no RANK: one process, started without torchrun
received = []
signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
out.mkdir(parents=True, exist_ok=True)
info = {"argv": args, "pid": os.getpid(), "ppid": os.getppid()}
info.update({k: os.environ.get(k) for k in ("WORLD_SIZE", "LOCAL_RANK", "OMP_NUM_THREADS")})
(out / f"rank{rank}.json").write_text(json.dumps(info))
mode, _, only_in = os.environ["FAKE_MODE"].partition(":")
if mode == "wait" and (not only_in or only_in in out.parts):
    while not received:
        time.sleep(0.02)
    (out / f"usr1.rank{rank}").touch()
    sys.exit(0)
if rank == 0:
    with open(out / "metrics.jsonl", "a") as f:
        for step in range(1, 5):
            f.write(json.dumps({"step": step, "loss": 6.0 - step, "tokens_per_sec": 100.0, "memory_gib": 0.1}) + "\n")
    (out / "DONE").write_text("4 steps\n")
"""


@pytest.fixture
def fake(tmp_path: Path) -> dict[str, str]:
    """An environment with the stand-in trainer, `scontrol` (logs its calls; `show hostnames` says
    localhost) and `srun` (runs its command here, once)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "fake_train.py").write_text(FAKE_TRAINER)
    scontrol_log = tmp_path / "scontrol.log"
    (bin_dir / "scontrol").write_text(
        f'#!/bin/bash\nif [[ $1 == show ]]; then echo localhost; else echo "$*" >>{scontrol_log}; fi\n'
    )
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nexec "$@"\n')
    # PYTHON for a launcher that exits FAKE_LAUNCHER_RC at once; train.py --check runs for real
    (bin_dir / "fake_launcher").write_text(
        f'#!/bin/bash\nfor arg; do [[ $arg == --check ]] && exec {sys.executable} "$@"; done\nexit $FAKE_LAUNCHER_RC\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        PYTHON=sys.executable,
        OMP_NUM_THREADS="1",
        MX_TRAIN_SCRIPT=str(tmp_path / "fake_train.py"),
        MX_NPROC="2",
        MX_RDZV_PORT=str(free_port()),
        SCONTROL_LOG=str(scontrol_log),
    )
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def scontrol_calls(env: dict[str, str]) -> list[str]:
    path = Path(env["SCONTROL_LOG"])
    return path.read_text().splitlines() if path.exists() else []


def run(cmd: list[str], env: dict[str, str], timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def start_and_signal(
    cmd: list[str], env: dict[str, str], out: Path, targets: str = "script", nranks: int = 2
) -> tuple[int, str]:
    """Start ``cmd``; once both stand-in ranks are up, send USR1 to the script (as SLURM's B: does) or to
    torchrun and the ranks (as SLURM does to every process of a step); return its exit status and output."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 180  # generous: on a loaded 2-core machine the launchers take a while
        while not all((out / f"rank{r}.json").exists() for r in range(nranks)):
            assert proc.poll() is None and time.time() < deadline, "the stand-in ranks did not start"
            time.sleep(0.05)
        time.sleep(0.2)  # the files are written after the handler is set; let the writes finish
        if targets == "script":
            os.kill(proc.pid, signal.SIGUSR1)
        else:
            ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nranks)]
            for pid in {ranks[0]["ppid"], *(r["pid"] for r in ranks)}:  # torchrun, then the ranks
                os.kill(pid, signal.SIGUSR1)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, output


@pytest.mark.parametrize("name", [*SBATCH, "../parity.sh"])
def test_scripts_parse(name):
    proc = subprocess.run(["bash", "-n", str(SLURM / name)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", SBATCH)
def test_sbatch_headers_requeue_through_the_checkpoint_path(name):
    text = (SLURM / name).read_text()
    for line in ("#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --output=logs/%x-%j.out"):
        assert line in text
    assert "USR1@180" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert "# export NCCL_NVLS_ENABLE=0" in text  # optional, with its reason above it


def test_train_1node_local_runs_debug_mxfp8_on_two_processes(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "MX_LOCAL": "1", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "MX_OUTPUT_DIR": str(out)}
    cmd = ["bash", str(SLURM / "train_1node.sbatch"), "debug_mxfp8", "--training.steps", "2"]
    proc = run([*cmd, "--training.local_batch_size", "2", *SMALL], env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--standalone --nproc_per_node=2" in proc.stdout and "2 x cpu" in proc.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert (out / "DONE").exists() and f"finished: {out}/DONE" in proc.stdout


def test_train_1node_usr1_reaches_the_ranks_then_requeues(tmp_path, fake):
    out = tmp_path / "run"
    env = {**fake, "SLURM_JOB_ID": "4242", "FAKE_MODE": "wait"}
    cmd = ["bash", str(SLURM / "train_1node.sbatch"), "debug_mxfp8", "--job.output_dir", str(out)]
    rc, output = start_and_signal(cmd, env, out)
    assert rc == 0, output
    assert (out / "usr1.rank0").exists() and (out / "usr1.rank1").exists()
    assert "USR1: passing it to the training processes" in output
    assert scontrol_calls(env) == ["requeue 4242"]


def test_train_1node_failure_or_too_many_restarts_is_not_requeued(tmp_path, fake):
    env = {**fake, "SLURM_JOB_ID": "7", "FAKE_MODE": "done", "MX_OUTPUT_DIR": str(tmp_path / "run")}
    cmd = ["bash", str(SLURM / "train_1node.sbatch"), "debug_mxfp8"]
    proc = run([*cmd, "--training.stepz", "3"], {**env, "MX_OUTPUT_DIR": ""})  # bad key: caught before launch
    assert proc.returncode == 2 and proc.stderr.startswith("config error: command line --training.stepz: unknown key")
    # A launcher that exits 0 without DONE, the 21st time; then one that fails.
    launcher = {"PYTHON": str(tmp_path / "bin" / "fake_launcher")}
    proc = run(cmd, {**env, **launcher, "FAKE_LAUNCHER_RC": "0", "SLURM_RESTART_COUNT": "20"})
    assert proc.returncode == 1 and "not requeued again" in proc.stdout
    proc = run(cmd, {**env, **launcher, "FAKE_LAUNCHER_RC": "1"})
    assert proc.returncode == 1 and "launcher failed (exit 1): not requeued" in proc.stdout
    assert scontrol_calls(env) == []


@pytest.mark.parametrize("name", ["train_1node.sbatch", "train_multinode.sbatch"])
def test_a_run_that_cannot_start_stops_before_torchrun(tmp_path, fake, name):
    """train.py --check runs first: a busy output_dir (another run holds it) stops the script with that one line
    and exit 2, before torchrun, which would turn the exit 2 into exit 1 and a ChildFailedError traceback."""
    from mx_recipe.train.lock import RunLock

    out = tmp_path / "run"
    out.mkdir()
    env = {**fake, "SLURM_JOB_ID": "3", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "localhost", "FAKE_MODE": "done"}
    lock = RunLock()
    assert lock.acquire(out) is None
    try:
        proc = run(["bash", str(SLURM / name), "debug_mxfp8", "--job.output_dir", str(out)], env)
    finally:
        lock.release()
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: job.output_dir {out} is in use by the run of pid ")
    assert proc.stderr.count("\n") == 1 and "launch" not in proc.stdout and not (out / "rank0.json").exists()


def test_train_multinode_launch_line(tmp_path, fake):
    env = {**fake, "SLURM_JOB_ID": "99", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]", "MX_DRY_RUN": "1"}
    env["MX_OUTPUT_DIR"] = str(tmp_path / "run")
    env.pop("MX_NPROC")
    proc = run(["bash", str(SLURM / "train_multinode.sbatch"), "llama_mxfp8", "--training.steps", "5"], env)
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert line.startswith("srun --nodes=2 --ntasks-per-node=1")
    for part in ("--nnodes=2", "--nproc_per_node=8", "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:"):
        assert part in line
    assert line.endswith("--parallel.dp_replicate 2 --training.steps 5")


def test_train_multinode_slurm_path_torchrun_survives_the_step_signal(tmp_path, fake):
    """SLURM signals every process of the step: torchrun ignores USR1, the ranks stop, the job requeues."""
    out = tmp_path / "run"
    env = {**fake, "SLURM_JOB_ID": "5", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "localhost", "FAKE_MODE": "wait"}
    cmd = ["bash", str(SLURM / "train_multinode.sbatch"), "debug_mxfp8", "--job.output_dir", str(out)]
    rc, output = start_and_signal(cmd, env, out, targets="step")
    assert rc == 0, output
    assert (out / "usr1.rank0").exists() and (out / "usr1.rank1").exists()
    rank0 = json.loads((out / "rank0.json").read_text())
    assert rank0["WORLD_SIZE"] == "2" and "--parallel.dp_replicate 1" in " ".join(rank0["argv"])
    assert scontrol_calls(env) == ["requeue 5"]


def test_parity_1node_stops_on_usr1_then_resumes_to_a_verdict(tmp_path, fake):
    out = tmp_path / "parity"
    env = {**fake, "MX_LOCAL": "1", "MX_OUTPUT_DIR": str(out), "FAKE_MODE": "wait:debug_mxfp8"}
    cmd = ["bash", str(SLURM / "parity_1node.sbatch"), "debug_bf16", "debug_mxfp8", "--training.steps", "4"]
    rc, output = start_and_signal(cmd, env, out / "debug_mxfp8" / "seed0")  # the bf16 run is done by then
    assert rc == 0, output
    assert (out / "debug_bf16" / "seed0" / "DONE").exists()
    assert (out / "debug_mxfp8" / "seed0" / "usr1.rank1").exists()
    assert "under SLURM this job would requeue" in output and not (out / "DONE").exists()
    # The requeued job: the finished run is not run again, the stopped one goes on, then the comparison.
    proc = run(cmd, {**env, "FAKE_MODE": "done"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "debug_bf16/seed0 is DONE; not run again" in proc.stdout
    verdict = proc.stdout.splitlines()[-1]
    # One seed, no validation: compare_runs gives no verdict, and says why.
    assert verdict.startswith("PARITY INCONCLUSIVE: debug_mxfp8 vs debug_bf16: no verdict: no validation loss")
    assert (out / "DONE").read_text().strip() == verdict and (out / "summary.md").exists()
    for name in ("debug_bf16", "debug_mxfp8"):  # the same seed, the same overrides
        argv = json.loads((out / name / "seed0" / "rank0.json").read_text())["argv"]
        assert argv[argv.index("--job.seed") + 1] == "0" and argv[-2:] == ["--training.steps", "4"]


def test_parity_sh_runs_each_seed_of_both_configs(tmp_path, fake):
    out = tmp_path / "parity"
    cmd = ["bash", "scripts/parity.sh", "debug_bf16", "debug_mxfp8", "--out", str(out), "--seeds", "3", "5"]
    proc = run([*cmd, "--training.steps", "4"], {**fake, "FAKE_MODE": "done"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    launched = [
        line.split("--job.output_dir ")[1].split()[0] for line in proc.stdout.splitlines() if "--job.seed" in line
    ]
    assert [Path(d).relative_to(out).as_posix() for d in launched] == [
        "debug_bf16/seed3", "debug_mxfp8/seed3", "debug_bf16/seed5", "debug_mxfp8/seed5"
    ]  # fmt: skip
    for d in launched:
        argv = json.loads((Path(d) / "rank0.json").read_text())["argv"]
        assert argv[argv.index("--job.seed") + 1] == Path(d).name.removeprefix("seed")
    summary = json.loads((out / "summary.json").read_text())
    assert [a["seeds"] for a in summary["arms"]] == [[3, 5], [3, 5]]
    assert (out / "SETTINGS").read_text().startswith("configs: debug_bf16 debug_mxfp8; seeds: 3 5;")
    bad = run(["bash", "scripts/parity.sh", "debug_bf16", "debug_mxfp8", "--seeds", "1", "--job.seed", "2"], fake)
    assert bad.returncode != 0 and "give the seeds with --seeds, not --job.seed" in bad.stderr


def test_parity_sh_one_process_passes_usr1_to_train_py(tmp_path, fake):
    """With --nproc 1 parity.sh starts train.py itself, without torchrun: USR1 goes to that process."""
    out = tmp_path / "parity"
    env = {**fake, "FAKE_MODE": "wait"}
    cmd = ["bash", "scripts/parity.sh", "debug_bf16", "debug_mxfp8", "--out", str(out), "--nproc", "1"]
    rc, output = start_and_signal(cmd, env, out / "debug_bf16" / "seed0", nranks=1)
    assert rc == 0, output
    assert (out / "debug_bf16" / "seed0" / "usr1.rank0").exists() and not (out / "debug_mxfp8").exists()
    assert "stopped by USR1 during debug_bf16" in output and not (out / "DONE").exists()


def test_parity_sh_refuses_other_settings_in_a_finished_out(tmp_path, fake):
    """A requeue (the same command) skips the DONE runs; the same --out with other settings is refused, naming both,
    where it used to skip both runs and report the old verdict."""
    out = tmp_path / "parity"
    env = {**fake, "FAKE_MODE": "done"}
    cmd = ["bash", "scripts/parity.sh", "debug_bf16", "debug_mxfp8", "--out", str(out), "--nproc", "1"]
    assert run(cmd, env).returncode == 0 and (out / "DONE").exists()
    verdict = (out / "DONE").read_text()
    again = run(cmd, env)
    assert again.returncode == 0 and again.stdout.count("is DONE; not run again") == 2
    other = run([*cmd, "--training.lr", "1e-3"], env)
    assert other.returncode == 2
    assert f"parity.sh: {out} holds a comparison with other settings" in other.stderr
    assert "overrides: --training.lr 1e-3" in other.stderr and (out / "DONE").read_text() == verdict
