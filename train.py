"""Train a Llama or MoE model in bf16 or MX with FSDP2.

python train.py --config debug_mxfp8 --training.steps 40
torchrun --nproc_per_node=8 train.py --config llama_mxfp8.toml
python train.py --config llama_mxfp8.toml --check    # can it start? (before torchrun: see --check)

A run pointed at an output_dir that holds checkpoints resumes from the latest (one at the last step
completes the run, one past training.steps stops: raise training.steps to train on); a finished run
writes <output_dir>/DONE.
Exit status: 0 when done, and also after SIGTERM/SIGUSR1 (a checkpoint is saved at the next step
boundary first, even with checkpoint.enable false; during set-up the run stops before its first step;
so SLURM can requeue; under torchrun, signal its children: torchrun itself exits 1 when signalled);
1 for a NaN/Inf loss, out of memory or a failed checkpoint save; 2 for a bad config or a run that
cannot start.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def end_with_launcher() -> None:
    """Under torchrun, have the kernel SIGKILL this worker when its parent, torchrun, dies: a kill -9 of
    torchrun used to leave the workers training on (or hung at start-up), and a relaunch then had two
    writers in one output_dir. Linux only; elsewhere, and outside torchrun, nothing changes."""
    if "TORCHELASTIC_RUN_ID" in os.environ and sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


if __name__ == "__main__":  # first: a launcher killed during the seconds of imports below takes this process along
    end_with_launcher()

import torch  # noqa: E402

from mx_recipe.cli import ArgumentParser  # noqa: E402
from mx_recipe.train.config import DEFAULT_CONFIG, ConfigError, config_help, load_config, parse_overrides  # noqa: E402
from mx_recipe.train.parallel import destroy_distributed, init_distributed  # noqa: E402
from mx_recipe.train.trainer import StopSignals, TrainingError, check_run, memory_report, train  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        description=__doc__, epilog=config_help(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=None, help=f"configs/NAME[.toml] or a path (default: {DEFAULT_CONFIG})")
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the config, its data files, job.output_dir (created if missing) and the mx.skip patterns, then "
        'exit without training: 0 and "ok: job.output_dir DIR" on stdout, or 2 and one line on stderr',
    )
    args, rest = parser.parse_known_args(argv)
    try:
        config = load_config(args.config, parse_overrides(rest))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.check:  # before a launcher starts the run: under torchrun an exit 2 becomes exit 1 and a traceback
        problem = check_run(config)
        print(
            f"error: {problem}" if problem else f"ok: job.output_dir {config.job.output_dir}",
            file=sys.stderr if problem else sys.stdout,
        )
        return 2 if problem else 0

    signals = StopSignals()
    try:
        with signals:  # from here on a stop signal ends the run cleanly, during set-up too
            info = init_distributed()
            train(config, info, signals)
    except TrainingError as e:  # every rank stops at the same point, for the same reason
        if info.is_main:  # exit 0 (a stop during set-up) is no error
            print(f"error: {e}" if e.exit_code else e, file=sys.stderr if e.exit_code else sys.stdout, flush=True)
        destroy_distributed()
        return e.exit_code
    except torch.OutOfMemoryError:
        print(f"out of memory on rank {info.rank}: {memory_report(info.device)}", file=sys.stderr, flush=True)
        destroy_distributed(barrier=False)
        return 1
    except BaseException:
        destroy_distributed(barrier=False)
        raise
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
