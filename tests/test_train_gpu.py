"""The one-GPU training step: replayed from a CUDA graph it gives the eager step's losses to the bit, and the
unsharded run gives FSDP2's (bf16, MXFP8 and NVFP4, Llama and MoE; deterministic algorithms)."""

import pytest
from test_train import SMALL, last_losses, run_in_process

pytestmark = pytest.mark.gpu

STEPS = ["--training.steps", "6", "--training.local_batch_size", "2", "--training.gradient_accumulation_steps", "2"]
COMMON = [*SMALL, *STEPS, "--training.deterministic", "true"]
# nvfp4 rounds its gradients stochastically: the replays' seeds come from the CUDA generator's graph-safe Philox
# offsets, which advance as the eager draws do, so its losses match too
CONFIGS = {
    "moe_bf16": ["--config", "debug_moe_bf16"],
    "moe_mxfp8": ["--config", "debug_moe_mxfp8"],
    "llama_mxfp8": ["--config", "debug_mxfp8"],
    "llama_nvfp4": ["--config", "debug_mxfp8", "--mx.recipe", "nvfp4"],
}


def _losses(out, *args: str) -> dict[int, float]:
    code, stdout, err = run_in_process([*COMMON, *args, "--job.output_dir", str(out)])
    assert code == 0, stdout[-2000:] + err[-2000:]
    return last_losses(out), stdout


def _captured_equals_eager(tmp_path, config: list[str], compile_: str) -> None:
    config = [*config, "--compile.enable", compile_]
    eager, log_eager = _losses(tmp_path / "eager", *config, "--training.cuda_graph", "off")
    graph, log_graph = _losses(tmp_path / "graph", *config, "--training.cuda_graph", "on")
    assert "CUDA graph off" in log_eager and "unsharded, AdamW fused, CUDA graph on" in log_graph
    assert graph == eager  # steps 3-6 are replays (two warm-up steps, then the capture)


@pytest.mark.parametrize("name", CONFIGS)
def test_captured_step_gives_the_eager_losses(tmp_path, name):
    _captured_equals_eager(tmp_path, CONFIGS[name], "false")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["moe_mxfp8", "llama_mxfp8"])
def test_captured_compiled_step_gives_the_eager_losses(tmp_path, name):
    _captured_equals_eager(tmp_path, CONFIGS[name], "true")


@pytest.mark.parametrize("name", ["moe_bf16", "llama_mxfp8"])
def test_unsharded_step_gives_fsdp2_losses(tmp_path, name):
    plain, _ = _losses(tmp_path / "plain", *CONFIGS[name], "--training.cuda_graph", "off")
    fsdp, log = _losses(tmp_path / "fsdp", *CONFIGS[name], "--parallel.fsdp_on_one_device", "true")
    assert "FSDP2 mesh (1,)" in log and "CUDA graph off" in log
    assert plain == fsdp
