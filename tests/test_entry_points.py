"""Bad input to a user-facing entry point (train.py, the benchmarks, the scripts) is one line naming the input and
exit 2, never a traceback: each row runs the command as a user would, before any model is built or GPU looked
for. The rows are the cases a sweep found ending in a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LONG = "x" * 300  # longer than a file name may be

# (command, the line on stderr: {tmp} is the test's folder)
ROWS = [
    (
        ["train.py", "--config", "{tmp}/binary.toml"],
        "config error: {tmp}/binary.toml: not a TOML text file (byte 0x89 at offset 0 is not UTF-8)",
    ),
    (
        ["train.py", "--config", "debug_bf16", "--job.output_dir", f"{{tmp}}/{LONG}"],
        f"error: job.output_dir: cannot create {{tmp}}/{LONG} (File name too long): choose another job.output_dir",
    ),
    (
        ["train.py", "--config", "debug_bf16", "--training.lr", "-1"],
        "config error: command line --training.lr: must be positive, got -1.0",
    ),
    (
        ["scripts/roofline.py", "--shape", "4096,4096"],
        "roofline.py: error: argument --shape: expected M,K,N: 3 positive integers separated by commas, got "
        "'4096,4096'",
    ),
    (
        ["scripts/roofline.py", "--model", "llama", "--flavor", "nosuch"],
        "roofline.py: error: argument --flavor: unknown llama flavor 'nosuch'; known: debug, 1B, 8B, 70B",
    ),
    (["scripts/roofline.py", "--flavor", "8B"], "roofline.py: error: argument --flavor: '8B' needs --model"),
    (["scripts/roofline.py", "--recipe", "nosuch"], "roofline.py: error: argument --recipe: unknown recipe 'nosuch'; "),
    (
        ["benchmarks/bench_train.py", "--config", "debug_bf16", "--recipes", "nosuch"],
        "bench_train.py: error: argument --recipes: unknown recipe 'nosuch'; known: mxfp8, ",
    ),
    (
        ["benchmarks/bench_train.py", "--config", "{tmp}/binary.toml"],
        "config error: {tmp}/binary.toml: not a TOML text file (byte 0x89 at offset 0 is not UTF-8)",
    ),
    (
        ["benchmarks/bench_train.py", "--config", "debug_bf16", "--out", f"{{tmp}}/{LONG}.json"],
        f"bench_train.py: error: argument --out: {{tmp}}/{LONG}.json: the name is longer than the file system allows",
    ),
    (["benchmarks/bench_linear.py", "--recipe", "nosuch"], "bench_linear.py: error: argument --recipe: unknown recipe"),
    (
        ["benchmarks/bench_cast.py", "--experts", "1,x"],
        "bench_cast.py: error: argument --experts: expected positive integers separated by commas, got '1,x'",
    ),
]


@pytest.mark.parametrize(("command", "expected"), ROWS, ids=[" ".join(c).replace("{tmp}/", "") for c, _ in ROWS])
def test_bad_input_is_one_line_and_exit_2(tmp_path, command, expected):
    (tmp_path / "binary.toml").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    command = [arg.replace("{tmp}", str(tmp_path)) for arg in command]
    proc = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(expected.replace("{tmp}", str(tmp_path))), (
        proc.stderr
    )
