"""Provenance of a benchmark run: device, torch, date and commit, written with every result file."""

from __future__ import annotations

import datetime
import os
import subprocess

import torch


def git_commit() -> str:
    """MX_GIT_COMMIT when set (a tree copied to a GPU machine may carry a stale .git), else the checkout's."""
    if os.environ.get("MX_GIT_COMMIT"):
        return os.environ["MX_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
        return out.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_meta(**extra) -> dict:
    return dict(
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        torch=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=git_commit(),
        **extra,
    )
