"""Fault injection for the tests of the failure paths: a NaN loss, a stop signal, a kill inside a save.

The trainer and the checkpointer read the installed ``FaultHooks`` at fixed points. Nothing is
installed by default, and then nothing is injected: each check is a set lookup or an integer
comparison. Tests install hooks with ``set_fault_hooks``, in this process, or run
``tests/fault_entry.py`` (train.py's main with hooks from its command line) as a subprocess.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FaultHooks:
    nan_loss_steps: frozenset[int] = frozenset()  # the loss of these steps is made NaN, on every rank
    signal_step: int | None = None  # rank 0 sends itself SIGTERM during this step
    signal_in_setup: bool = False  # rank 0 sends itself SIGTERM as set-up starts, before the data are read
    kill_in_save_step: int | None = None  # SIGKILL inside this step's save, shards written, before the commit


NO_FAULTS = FaultHooks()
_hooks = NO_FAULTS


def set_fault_hooks(hooks: FaultHooks | None) -> None:
    """Install ``hooks`` (None: remove them). The trainer reads them when a run starts, the
    checkpointer at each save."""
    global _hooks
    _hooks = hooks or NO_FAULTS


def fault_hooks() -> FaultHooks:
    """The installed hooks (``NO_FAULTS`` unless a test installed some)."""
    return _hooks
