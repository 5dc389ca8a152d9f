"""MX weight casts made once a step (``mx_recipe.nn.weight_casts``, ``training.cast_weights_once``): inside
``weight_casts_once`` no GEMM casts a weight, across microbatches and activation-checkpoint recomputes, and the
outputs and gradients are bit for bit those of the casts each GEMM makes: every MX recipe, NVFP4, linears and
expert groups, the cublas path through the emulator, and train.py with gradient accumulation and AC."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scaled_mm_emulator import scaled_grouped_mm as emulated_scaled_grouped_mm
from scaled_mm_emulator import scaled_mm as emulated_scaled_mm
from torch import nn
from torch.utils.checkpoint import checkpoint

from mx_recipe import convert_to_mx
from mx_recipe.formats.recipe import NVFP4Recipe
from mx_recipe.models.moe import MoE, MoEArgs
from mx_recipe.nn.weight_casts import mx_layers, weight_casts_once
from mx_recipe.ops.mx_backends import CublasBackend

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ["mxfp8", "mxfp8_rceil", "mxfp8_wgrad_bf16", "mxfp8_e5m2_grads", "mxfp4", "mxfp4_sr", "nvfp4"]


class Block(nn.Module):
    """Two linears and a MoE: every kind of MX weight (2D, and 3D experts)."""

    def __init__(self):
        super().__init__()
        args = MoEArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, multiple_of=32, vocab_size=64, max_seq_len=16,
                       n_routed_experts=4, top_k=2, n_shared_experts=1, moe_hidden_dim=32)  # fmt: skip
        self.up = nn.Linear(64, 96, bias=False)
        self.down = nn.Linear(96, 64, bias=False)
        self.moe = MoE(args)
        self.moe.init_weights(0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(self.down(torch.relu(self.up(x))))


def make_block(recipe, backend=None) -> Block:
    torch.manual_seed(0)
    block = Block().to(torch.bfloat16)
    convert_to_mx(block, recipe, log=False)
    for layer in mx_layers(block):
        layer.backend = backend or layer.backend
    return block


def step(block: Block, xs: list[torch.Tensor], once: bool, ac: bool) -> list[torch.Tensor]:
    """Losses and gradients of one step of two microbatches."""
    block.zero_grad(set_to_none=True)
    losses = []
    with weight_casts_once(block) if once else contextlib.nullcontext():
        for x in xs:
            torch.manual_seed(1)  # stochastic rounding's draws, the same for both
            out = checkpoint(block, x, use_reentrant=False) if ac else block(x)
            loss = out.float().square().mean()
            loss.backward()
            losses.append(loss.detach())
    return losses + [p.grad for p in block.parameters() if p.grad is not None]


def recipe_of(name: str):
    return NVFP4Recipe.from_name(name) if name == "nvfp4" else name


def assert_bits_equal(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    assert len(a) == len(b), what
    for i, (u, v) in enumerate(zip(a, b, strict=True)):
        bits = torch.int16 if u.element_size() == 2 else torch.int32
        assert u.dtype == v.dtype and torch.equal(u.reshape(-1).view(bits), v.reshape(-1).view(bits)), (what, i)


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("ac", [False, True])
def test_casts_made_once_give_the_bits_of_casts_per_use(name, ac):
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(2, 16, 64, generator=gen).to(torch.bfloat16) for _ in range(2)]
    block = make_block(recipe_of(name))
    want = step(block, xs, once=False, ac=ac)
    got = step(block, xs, once=True, ac=ac)
    assert_bits_equal(got, want, f"{name} ac={ac}")


def test_casts_made_once_on_the_cublas_path():
    backend = CublasBackend(emulated_scaled_mm, emulated_scaled_grouped_mm)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, 16, 64, generator=gen).to(torch.bfloat16) for _ in range(2)]
    block = make_block("mxfp8", backend)
    assert_bits_equal(step(block, xs, once=True, ac=True), step(block, xs, once=False, ac=True), "cublas")


def test_no_weight_is_cast_inside_the_step(monkeypatch):
    """Entering casts each MX weight once (both orientations from one read); two microbatches with activation
    checkpointing then cast no weight; leaving drops the casts."""
    import mx_recipe.ops.mx_backends as backends

    cast, cast_both = backends.EmulatedBackend.cast, backends.EmulatedBackend.cast_both
    seen = []
    monkeypatch.setattr(
        backends.EmulatedBackend, "cast", lambda s, t, *a, **k: seen.append(id(t)) or cast(s, t, *a, **k)
    )
    monkeypatch.setattr(
        backends.EmulatedBackend, "cast_both", lambda s, t, *a, **k: seen.append(id(t)) or cast_both(s, t, *a, **k)
    )
    block = make_block("mxfp8")
    experts = block.moe.experts
    linears = [block.up, block.down, *block.moe.shared_experts.children()]  # the router gate stays bf16
    mx_weights = {id(w) for w in (*(lin.weight for lin in linears), experts.w1, experts.w2, experts.w3)}
    with weight_casts_once(block):
        assert sorted(seen) == sorted(mx_weights)  # each once, both orientations in one cast
        seen.clear()
        for _ in range(2):
            x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
            checkpoint(block, x, use_reentrant=False).float().sum().backward()
        assert seen and not mx_weights & set(seen)  # inputs and gradients cast, no weight
    assert block.up.weight_casts is None and experts.weight_casts is None


def test_inputs_of_another_dtype_cast_as_usual():
    block = make_block("mxfp8")
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    with weight_casts_once(block):
        block.float()  # the casts were made for bf16 weights: fp32 inputs take their own
        got = block(x.float())
    want = block(x.float())
    assert torch.equal(got, want)


def train(tmp_path: Path, name: str, *overrides: str) -> list[float]:
    out = tmp_path / name
    cmd = [sys.executable, "train.py", "--config", "debug_moe_mxfp8", "--training.steps", "3",
           "--training.gradient_accumulation_steps", "2", "--activation_checkpoint.mode", "full",
           "--checkpoint.enable", "false", "--validation.enable", "false", "--metrics.log_freq", "1",
           "--job.output_dir", str(out), *overrides]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in records if "loss" in r], run.stdout + run.stderr


def test_train_py_casts_once_with_the_same_losses(tmp_path):
    on, log_on = train(tmp_path, "on", "--training.cast_weights_once", "auto")
    off, log_off = train(tmp_path, "off", "--training.cast_weights_once", "off")
    assert "MX weights cast once a step" in log_on and "MX weights cast once a step" not in log_off
    assert on == off and len(on) == 3


def test_cast_weights_once_is_refused_under_fsdp2(tmp_path):
    cmd = [sys.executable, "train.py", "--config", "debug_moe_mxfp8", "--training.steps", "1",
           "--parallel.fsdp_on_one_device", "true", "--training.cast_weights_once", "on",
           "--job.output_dir", str(tmp_path / "fsdp")]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "training.cast_weights_once is on, but the run shards the model through FSDP2" in run.stderr


def test_compiled_layers_take_each_steps_casts_without_recompiling():
    """Under torch.compile the casts are inputs of the graph: a new step's casts reuse it, same bits as eager."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.ReLU(), nn.Linear(96, 64, bias=False)).to(torch.bfloat16)
    convert_to_mx(model, "mxfp8", log=False)
    compiled = torch.compile(model, fullgraph=True)
    gen = torch.Generator().manual_seed(5)
    torch._dynamo.reset()
    for i in range(2):
        with torch.no_grad():
            for p in model.parameters():  # the optimizer's step: new weights, new casts
                p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.01)
        x = torch.randn(32, 64, generator=gen).to(torch.bfloat16)
        with torch._dynamo.config.patch(error_on_recompile=i > 0), weight_casts_once(model):
            got = compiled(x)
        assert torch.equal(got, model(x)), i
