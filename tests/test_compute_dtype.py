"""training.compute_dtype: fp32 compute on a CPU without native bf16 matmul gives the MX values of bf16.

The emulated MX layers quantize in their input's dtype, so a run that computes in fp32 on such a CPU (where
bf16 matmuls are 16-33x slower) is the same recipe only if the fake-quant gives the same values in fp32 as
in bf16 for the same (bf16-representable) inputs. Then the rule that picks the dtype, and its config key.
"""

import os
import subprocess
import sys

import pytest
import torch
from test_config import MINIMAL, _with
from test_train import SMALL, run_in_process

from mx_recipe.formats.nvfp4 import random_signs
from mx_recipe.ops.mx_cast import fake_quant_along_m, fake_quant_dim0, fake_quant_dim0_dim1
from mx_recipe.ops.nvfp4_fake_quant import fake_quant_nvfp4
from mx_recipe.train.config import ConfigError, build_config
from mx_recipe.train.parallel import cpu_has_native_bf16, resolve_compute_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _bf16_values(m: int, k: int, spread: int = 30, seed: int = 0) -> torch.Tensor:
    """fp32 [m, k] of bf16-representable normal values: rows whose magnitudes span 2**-spread..2**spread,
    so blocks get scales far apart; one block all zero and one with a large outlier."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-spread, spread + 1, (m, 1), generator=g).float())
    x[1, :32] = 0.0
    x[2, 5] *= 1000.0
    return x.bfloat16().float()


def _assert_same(from_bf16: torch.Tensor, from_fp32: torch.Tensor) -> None:
    assert from_bf16.dtype == torch.bfloat16 and from_fp32.dtype == torch.float32
    torch.testing.assert_close(from_bf16.float(), from_fp32, rtol=0, atol=0)


MX_CASES = [(elem, mode) for elem in ("e4m3", "e5m2", "e2m1") for mode in ("floor", "rceil")]


@pytest.mark.parametrize("elem, mode", MX_CASES)
def test_mx_fake_quant_is_the_same_in_fp32_and_bf16(elem, mode):
    x = _bf16_values(80, 128)  # 80 rows: the casts along M pad to 96
    _assert_same(fake_quant_dim0(x.bfloat16(), elem, mode), fake_quant_dim0(x, elem, mode))
    _assert_same(fake_quant_along_m(x.bfloat16(), elem, mode), fake_quant_along_m(x, elem, mode))
    for a, b in zip(fake_quant_dim0_dim1(x.bfloat16(), elem, mode), fake_quant_dim0_dim1(x, elem, mode), strict=True):
        _assert_same(a, b)


@pytest.mark.parametrize("tiles", [False, True])
@pytest.mark.parametrize("hadamard", [False, True])
def test_nvfp4_fake_quant_is_the_same_in_fp32_and_bf16(tiles, hadamard):
    x = _bf16_values(64, 128, spread=3, seed=1)  # NVFP4's two-level scales cover a narrower range than MX's
    signs = random_signs(0) if hadamard else None
    from_bf16 = fake_quant_nvfp4(x.bfloat16(), along_k=True, along_m=True, tiles=tiles, signs=signs)
    from_fp32 = fake_quant_nvfp4(x, along_k=True, along_m=True, tiles=tiles, signs=signs)
    _assert_same(from_bf16.along_k, from_fp32.along_k)
    _assert_same(from_bf16.along_m, from_fp32.along_m)
    assert torch.equal(from_bf16.s_dec_k, from_fp32.s_dec_k) and torch.equal(from_bf16.s_dec_m, from_fp32.s_dec_m)


def test_named_dtypes_and_cuda_auto_are_fixed():
    assert resolve_compute_dtype("bf16", CPU) == "bf16" and resolve_compute_dtype("fp32", CUDA) == "fp32"
    assert resolve_compute_dtype("auto", CUDA) == "bf16"  # the device is not touched: no GPU needed
    with pytest.raises(ValueError, match="unknown compute dtype 'fp16'"):
        resolve_compute_dtype("fp16", CPU)


@pytest.mark.parametrize(
    "capability, avx512_bf16, amx, expected",
    [
        ("AVX512", True, False, "bf16"),
        ("AVX512", False, True, "bf16"),
        ("AVX512", False, False, "fp32"),  # AVX512 without BF16 (Skylake-X): bf16 converted in software
        ("AVX2", True, True, "fp32"),  # ATEN_CPU_CAPABILITY=avx2 on a bf16 CPU: ATen's kernels are AVX2 ones
        ("SVE256", False, False, "fp32"),
        ("DEFAULT", False, False, "fp32"),
    ],
)
def test_auto_on_cpu_follows_the_cpu_flags(monkeypatch, capability, avx512_bf16, amx, expected):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert resolve_compute_dtype("auto", CPU) == expected


def test_auto_on_cpu_without_the_flag_functions_is_fp32(monkeypatch):
    """A torch without the private flag functions: fp32, the safe choice, rather than an AttributeError."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert not cpu_has_native_bf16() and resolve_compute_dtype("auto", CPU) == "fp32"


def test_auto_under_an_avx2_capability_is_fp32():
    """What CI machines and laptops without AVX512-BF16 see, simulated on any x86 CPU."""
    code = "import torch; from mx_recipe.train.parallel import resolve_compute_dtype; "
    code += "print(resolve_compute_dtype('auto', torch.device('cpu')))"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "fp32"


@pytest.mark.parametrize(
    "value, message",
    [
        ("fp16", r"mem.toml: key 'training.compute_dtype': unknown dtype 'fp16'; known: auto, bf16, fp32"),
        ("bfloat16", r"mem.toml: key 'training.compute_dtype': unknown dtype 'bfloat16'"),
        (32, r"mem.toml: key 'training.compute_dtype': expected a string, got 32"),
    ],
)
def test_bad_compute_dtype_names_the_key_and_file(value, message):
    with pytest.raises(ConfigError, match=message):
        build_config(_with("training", "compute_dtype", value), "mem.toml", [])


def test_compute_dtype_defaults_to_auto_and_takes_overrides():
    assert build_config(MINIMAL, "mem.toml", []).training.compute_dtype == "auto"
    config = build_config(MINIMAL, "mem.toml", [("training.compute_dtype", "fp32")])
    assert config.training.compute_dtype == "fp32"
    with pytest.raises(ConfigError, match=r"command line --training.compute_dtype: unknown dtype 'half'"):
        build_config(MINIMAL, "mem.toml", [("training.compute_dtype", "half")])


@pytest.mark.parametrize("asked", ["auto", "fp32"])
def test_a_run_says_what_it_computed_in(tmp_path, asked):
    out = tmp_path / "run"
    argv = ["--config", "debug_mxfp8", "--training.steps", "1", "--training.local_batch_size", "1", *SMALL]
    code, stdout, err = run_in_process([*argv, "--training.compute_dtype", asked, "--job.output_dir", str(out)])
    assert code == 0, err
    resolved = resolve_compute_dtype(asked, CPU)
    assert f"compute dtype {resolved}{' (auto)' if asked == 'auto' else ''}," in stdout
    assert f'compute_dtype = "{resolved}"' in (out / "config.toml").read_text()
