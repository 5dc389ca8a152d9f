"""Where a shard group is one rank (one process, or dp_replicate = world size) every rank trains the whole model
(mixed_precision), with FSDP2's numerics and checkpoints; the optimizer's implementation follows the config across
a resume; a CUDA graph is refused where it cannot run."""

import dataclasses
import shutil
import subprocess

import torch
from test_train import ENV, REPO, SMALL, TORCHRUN, last_losses, run_in_process

from mx_recipe.train.checkpoint import Checkpointer, TrainState
from mx_recipe.train.config import load_config
from mx_recipe.train.trainer import build_optimizer

TRAINING = load_config("debug_bf16").training

MOE = ["--config", "debug_moe_bf16", "--training.local_batch_size", "2", *SMALL]
BF16 = ["--training.compute_dtype", "bf16", "--training.gradient_accumulation_steps", "2"]  # mixed precision
FSDP = ["--parallel.fsdp_on_one_device", "true"]
CKPT_AT_2 = ["--checkpoint.enable", "true", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]


def _train(out, *args: str) -> str:
    code, stdout, err = run_in_process([*MOE, *args, "--job.output_dir", str(out)])
    assert code == 0, stdout[-2000:] + err[-2000:]
    return stdout


def test_unsharded_one_device_run_matches_fsdp2_bit_for_bit(tmp_path):
    """bf16 compute over fp32 masters, two microbatches a step: the unsharded step casts, accumulates and reduces
    as FSDP2's MixedPrecisionPolicy does on one device, to the bit."""
    plain = _train(tmp_path / "plain", "--training.steps", "3", *BF16)
    sharded = _train(tmp_path / "fsdp", "--training.steps", "3", *BF16, *FSDP)
    assert "unsharded, AdamW fused" in plain and "FSDP2 mesh (1,), all-gather bf16, AdamW fused" in sharded
    assert last_losses(tmp_path / "plain") == last_losses(tmp_path / "fsdp")


def test_replicated_two_process_run_matches_fsdp2_hsdp_bit_for_bit(tmp_path):
    """dp_replicate = 2 on 2 gloo processes: whole models and one gradient all-reduce give the losses of FSDP2's
    HSDP with shard groups of one rank."""
    losses = {}
    for name, extra in {"replicated": [], "hsdp": FSDP}.items():
        out = tmp_path / name
        cmd = [*TORCHRUN, *MOE, "--training.steps", "3", "--parallel.dp_replicate", "2", *extra]
        done = subprocess.run([*cmd, "--job.output_dir", str(out)], cwd=REPO, env=ENV, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert ("replicated on 2 ranks (all-reduce)" in done.stdout) == (name == "replicated")
        losses[name] = last_losses(out)
    assert losses["replicated"] == losses["hsdp"]


def test_checkpoints_move_between_unsharded_and_fsdp2_and_keep_the_configured_adamw(tmp_path):
    """A checkpoint of an unsharded run with the foreach AdamW resumes under FSDP2 to the same losses, and
    resumes with the fused AdamW when the config asks for it (other rounding, so close but not equal)."""
    ref = tmp_path / "ref"
    _train(ref, "--training.steps", "4", "--training.fused_adamw", "false", *CKPT_AT_2)
    expected = last_losses(ref)
    resumed = {}
    for name, args in {"fsdp": [*FSDP, "--training.fused_adamw", "false"], "fused": []}.items():
        copy = tmp_path / name
        shutil.copytree(ref, copy)
        shutil.rmtree(copy / "checkpoints" / "step-4")
        (copy / "DONE").unlink()
        out = _train(copy, "--training.steps", "4", *args)
        assert "resuming from checkpoint" in out and ("AdamW fused" in out) == (name == "fused")
        resumed[name] = last_losses(copy)
    assert resumed["fsdp"] == expected
    assert resumed["fused"] == expected  # on the CPU the fused and foreach AdamW round alike (not on CUDA)


class _Position:
    """A data source's state, as the checkpoint keeps it."""

    def state_dict(self) -> dict:
        return {"position": 7}

    def load_state_dict(self, state: dict) -> None:
        assert state == {"position": 7}


def test_a_load_keeps_the_optimizer_implementation_this_run_built(tmp_path):
    """load_state_dict would take fused/foreach from the checkpoint's param groups: the Checkpointer keeps this
    run's, and moves the step counts where the implementation keeps them."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        cpu = torch.device("cpu")
        saved_by = {}
        for fused in (False, True):
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 4)
            optimizer = build_optimizer(model, dataclasses.replace(TRAINING, fused_adamw=fused))
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)
            saved_by[fused] = (model, optimizer, scheduler)
        model, optimizer, scheduler = saved_by[False]
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        checkpointer = Checkpointer(tmp_path, 0, 0, 1, cpu)
        checkpointer.prepare()
        path = checkpointer.save(model, optimizer, scheduler, _Position(), TrainState(step=1))
        model, optimizer, scheduler = saved_by[True]
        checkpointer.load(path, model, optimizer, scheduler, _Position(), TrainState())
        (group,) = optimizer.param_groups
        assert group["fused"] is True and not group["foreach"]
        assert all(optimizer.state[p]["step"].item() == 1 for p in model.parameters())
        torch.testing.assert_close(model.weight, saved_by[False][0].weight, rtol=0, atol=0)
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()  # the fused AdamW runs on the loaded state
        assert all(optimizer.state[p]["step"].item() == 2 for p in model.parameters())
    finally:
        torch.distributed.destroy_process_group()


def test_a_cuda_graph_asked_for_where_it_cannot_run_is_refused(tmp_path):
    code, out, err = run_in_process([*MOE, "--training.steps", "1", "--training.cuda_graph", "on",
                                     "--job.output_dir", str(tmp_path)])  # fmt: skip
    assert code == 2
    assert "training.cuda_graph is on, but CUDA graphs need a CUDA device, not cpu" in err
    code, out, err = run_in_process([*MOE, "--training.steps", "1", "--job.output_dir", str(tmp_path / "auto")])
    assert code == 0 and "CUDA graph off" in out
