"""The MX all-gather under FSDP2 (parallel.mx_all_gather): the fake-quant it relies on is idempotent, a gather of
MX shards gives the cast-after-gather weight in both orientations, and two gloo processes train bit for bit as with
the bf16 all-gather (Llama and MoE, floor and rceil), with checkpoints that move between the two."""

import pickle
import shutil
import subprocess

import pytest
import torch
from test_train import ENV, REPO, SMALL, TORCHRUN, last_losses
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

from mx_recipe.formats.mx import ELEM_FORMATS, SCALE_RULES, fake_quant
from mx_recipe.ops.mx_cast import fake_quant_along_m, fake_quant_dim0
from mx_recipe.train.config import ConfigError, load_config
from mx_recipe.train.mx_all_gather import MXGather


def _every_bf16_value() -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


@pytest.mark.parametrize("elem", ELEM_FORMATS)
@pytest.mark.parametrize("rule", SCALE_RULES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fake_quant_of_a_fake_quant_gives_it_back(elem, rule, dtype):
    """fq(fq(w)) == fq(w) for every bf16 value, in blocks of neighbouring values, of random companions, and beside
    a large value (so that it lands among e4m3's subnormals at scales near -127); NaN, Inf, -0 and zeros included.
    So the GEMM's own cast of a gathered fake-quant weight changes no bit."""
    values = _every_bf16_value().to(dtype)
    torch.manual_seed(0)
    scaled = values * torch.exp2(torch.randint(0, 12, values.shape)).to(dtype)
    arrangements = [values, values[torch.randperm(values.numel())], torch.stack([values, scaled], -1).flatten()]
    for x in arrangements:
        blocks = x.reshape(-1, 32)
        once = fake_quant(blocks, elem, rule)
        # Where rceil's scale for a block near the top of fp32 (amax > 448 * 2**119, 2.98e38, for e4m3) times the
        # element overflows, the emulated fake-quant itself is infinite: the one exception, far from any weight.
        overflowed = once.isinf().any(-1) & ~blocks.isinf().any(-1)
        assert (blocks[overflowed].float().abs().amax(-1) > 2.0**127).all()
        assert rule == "rceil" or not overflowed.any()
        kept = ~overflowed
        assert torch.equal(_bits(fake_quant(once[kept], elem, rule)), _bits(once[kept]))


class _Group:
    """What MXGather reads of an FSDP2 parameter group: its training state and post-forward mesh."""

    def __init__(self):
        self._training_state, self.post_forward_mesh_info = TrainingState.FORWARD, object()


def _gather(w: torch.Tensor, ranks: int, elem: str, rule: str, backward: bool, out=None) -> torch.Tensor:
    """What FSDP2 does with MXGather over ``ranks`` shards of ``w`` on dim 0: each rank's pre-all-gather, the
    all-gather (a concatenation along dim 0 of each input), the post-all-gather."""
    group = _Group()
    group._training_state = TrainingState.PRE_BACKWARD if backward else TrainingState.FORWARD
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    inputs = []
    for shard in w.chunk(ranks):
        gather = MXGather(shard, group, elem, rule, tuple(w.shape))
        inputs.append(gather.fsdp_pre_all_gather(None, w.shape, w.stride(), None, policy))
    (_, along_n), sizes = inputs[0], [t.shape for t in inputs[0][0]]
    outputs = tuple(torch.cat([i[0][j] for i in inputs]).view(-1, *sizes[j][1:]) for j in range(2))
    result = gather.fsdp_post_all_gather(outputs, along_n, torch.bfloat16, out=out)
    assert all(t.untyped_storage().nbytes() == 0 for t in outputs)  # freed: only the weight is held
    return out if out is not None else result[0]


@pytest.mark.parametrize("shape", [(128, 64), (4, 64, 96)])
@pytest.mark.parametrize("elem", ["e4m3", "e2m1"])
@pytest.mark.parametrize("rule", SCALE_RULES)
def test_a_gather_of_mx_shards_is_the_cast_after_the_gather(shape, elem, rule):
    """Forward's gather gives fake_quant_dim0 of the bf16 weight, backward's fake_quant_along_m (along N), bit for
    bit, for 2D weights sharded along N and experts sharded on E; again in place (FSDP2's later gathers)."""
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.exp2(torch.randint(-20, 20, shape[:-1] + (1,)).float())
    w_bf16 = w.to(torch.bfloat16)
    expected = {False: fake_quant_dim0(w_bf16, elem, rule), True: fake_quant_along_m(w_bf16, elem, rule)}
    out = torch.empty(shape, dtype=torch.bfloat16)
    for backward in (False, True):
        assert torch.equal(_gather(w, 2, elem, rule, backward).view(torch.int16), expected[backward].view(torch.int16))
        _gather(w, 4, elem, rule, backward, out=out)
        assert torch.equal(out.view(torch.int16), expected[backward].view(torch.int16))


# --- two gloo processes ---

ARGS = [*SMALL, "--training.local_batch_size", "2", "--training.steps", "4"]
CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]


def _torchrun(out, *args: str) -> str:
    done = subprocess.run([*TORCHRUN, *ARGS, *args, "--job.output_dir", str(out)], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _final_state(out) -> dict:
    path = out / "final.pt"
    dcp_to_torch_save(out / "checkpoints" / "step-4", path)
    return torch.load(path, weights_only=False)


def _assert_same_bits(a, b, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same_bits(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, bytes):  # a rank's pickled data position and RNG states
        _assert_same_bits(pickle.loads(a), pickle.loads(b), where)
    else:
        assert a == b, where


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, recipe", [("debug_mxfp8", "mxfp8"), ("debug_mxfp8", "mxfp8_rceil"),
                       ("debug_moe_mxfp8", "mxfp8"), ("debug_moe_mxfp8", "mxfp8_rceil")],
)  # fmt: skip
def test_mx_all_gather_trains_bit_for_bit_as_the_bf16_all_gather(tmp_path, config, recipe):
    """Every step's loss and the final weights and optimizer state, with the MX all-gather on and off."""
    runs = {}
    for mode in ("on", "off"):
        log = _torchrun(tmp_path / mode, "--config", config, "--mx.recipe", recipe, "--parallel.mx_all_gather", mode,
                        "--training.compute_dtype", "bf16", *CKPT)  # fmt: skip
        assert ("MX all-gather for" in log) == (mode == "on") and ("all-gather bf16" in log) == (mode == "off")
        runs[mode] = last_losses(tmp_path / mode), _final_state(tmp_path / mode)
    assert runs["on"][0] == runs["off"][0] and len(runs["on"][0]) == 4
    _assert_same_bits(runs["on"][1], runs["off"][1])


@pytest.mark.slow
def test_checkpoints_move_between_mx_and_bf16_all_gather(tmp_path):
    """A checkpoint saved with the MX all-gather on resumes with it off, and the other way round, to the losses of
    the run that never stopped."""
    common = ["--config", "debug_moe_mxfp8", "--training.compute_dtype", "bf16", *CKPT]
    reference = {}
    for mode in ("on", "off"):
        _torchrun(tmp_path / mode, *common, "--parallel.mx_all_gather", mode)
        reference[mode] = last_losses(tmp_path / mode)
    assert reference["on"] == reference["off"]
    for saved, resumed in (("on", "off"), ("off", "on")):
        copy = tmp_path / f"{saved}_then_{resumed}"
        shutil.copytree(tmp_path / saved, copy)
        shutil.rmtree(copy / "checkpoints" / "step-4")
        (copy / "DONE").unlink()
        log = _torchrun(copy, *common, "--parallel.mx_all_gather", resumed)
        assert "resuming from checkpoint" in log and "step-2" in log
        assert last_losses(copy) == reference[saved]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([("mx.recipe", "none")], "is on, but mx.recipe: the MX all-gather needs an MX recipe, got no MX recipe"),
        ([("mx.recipe", "nvfp4")], "NVFP4 recipe 'nvfp4' (its per-tensor scale)"),
        ([("activation_checkpoint.mode", "full")], "is on, but activation_checkpoint.mode: 'full' recomputes"),
        ([("parallel.reshard_after_forward", "false")], "is on, but parallel.reshard_after_forward: false keeps"),
    ],
)
def test_a_config_that_rules_the_mx_all_gather_out_is_an_error_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config("debug_mxfp8", [("parallel.mx_all_gather", "on"), *overrides])
    assert "command line --parallel.mx_all_gather: is on, but" in str(e.value) and message in str(e.value)
    with pytest.raises(ConfigError, match="parallel.mx_all_gather: unknown mode 'yes'; known: auto, on, off"):
        load_config("debug_mxfp8", [("parallel.mx_all_gather", "yes")])
    assert load_config("debug_mxfp8", [*overrides, ("parallel.mx_all_gather", "auto")])  # auto: off where it can't


def test_the_mx_all_gather_on_one_process_is_a_setup_error(tmp_path):
    from test_train import run_in_process

    code, out, err = run_in_process(["--config", "debug_mxfp8", *ARGS, "--parallel.mx_all_gather", "on",
                                     "--job.output_dir", str(tmp_path)])  # fmt: skip
    assert code == 2 and "parallel.mx_all_gather is on, but the world size: FSDP2 gathers nothing" in err


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("config", ["debug_mxfp8", "debug_moe_mxfp8"])
def test_mx_all_gather_on_two_gpus_gives_the_bf16_all_gather_losses(tmp_path, config):
    """NCCL, the GPU casts of the shards: the same loss at every step, deterministic algorithms on."""
    losses = {}
    for mode in ("on", "off"):
        _torchrun(tmp_path / mode, "--config", config, "--parallel.mx_all_gather", mode, "--training.steps", "6",
                  "--training.deterministic", "true")  # fmt: skip
        losses[mode] = last_losses(tmp_path / mode)
    assert losses["on"] == losses["off"] and len(losses["on"]) == 6
