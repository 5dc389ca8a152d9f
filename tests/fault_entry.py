"""train.py with faults injected (mx_recipe/train/faults.py), for the tests that need a process of its own:

    python tests/fault_entry.py [--nan-loss-steps 2,3] [--signal-step 3] [--kill-in-save-step 3] [--signal-in-setup]
        TRAIN_ARGS...

Also as torchrun's script; every rank installs the same hooks. The other arguments go to train.py's main.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mx_recipe.train.faults import FaultHooks, set_fault_hooks  # noqa: E402
from train import end_with_launcher, main  # noqa: E402


def parse_hooks(argv: list[str]) -> tuple[FaultHooks, list[str]]:
    """(the hooks named in ``argv``, the arguments left for train.py)."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--nan-loss-steps", default="", help="comma-separated steps whose loss is made NaN")
    parser.add_argument("--signal-step", type=int, help="rank 0 sends itself SIGTERM during this step")
    parser.add_argument("--signal-in-setup", action="store_true", help="rank 0 sends itself SIGTERM as set-up starts")
    parser.add_argument("--kill-in-save-step", type=int, help="SIGKILL inside this step's save, before the commit")
    args, rest = parser.parse_known_args(argv)
    nan_steps = frozenset(int(s) for s in args.nan_loss_steps.split(",") if s.strip())
    hooks = FaultHooks(
        nan_loss_steps=nan_steps,
        signal_step=args.signal_step,
        signal_in_setup=args.signal_in_setup,
        kill_in_save_step=args.kill_in_save_step,
    )
    return hooks, rest


if __name__ == "__main__":
    end_with_launcher()
    hooks, rest = parse_hooks(sys.argv[1:])
    set_fault_hooks(hooks)
    sys.exit(main(rest))
