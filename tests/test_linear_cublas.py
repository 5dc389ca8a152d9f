"""MXLinear's cublas path (sm_100) on the CPU: the real op is replaced by the layout-faithful
emulator (tests/scaled_mm_emulator.py), which reads the scales through the blocked layout the
way the hardware does. The three GEMMs must agree with the emulated backend up to summation
order (the emulator sums exactly, the emulated backend in fp32)."""

import pytest
import torch
from scaled_mm_emulator import scaled_mm as emulated_scaled_mm

from mx_recipe import MXLinear, MXRecipe
from mx_recipe.ops.mx_backends import CublasBackend


def _run(recipe: MXRecipe, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, backend=None):
    layer = MXLinear(w.shape[1], w.shape[0], bias=False, recipe=recipe, backend=backend, dtype=x.dtype)
    with torch.no_grad():
        layer.weight.copy_(w)
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad


@pytest.mark.parametrize("name", ["mxfp8", "mxfp8_rceil", "mxfp8_e5m2_grads", "mxfp8_wgrad_bf16"])
@pytest.mark.parametrize("m", [64, 200])  # 200: rows not a multiple of 128 (scale padding) nor 32 (gw pad)
def test_cublas_path_matches_emulated_backend(name, m):
    torch.manual_seed(0)
    k, n = 160, 96  # K/32 = 5 scale columns: the blocked layout pads them to 8
    x = torch.randn(m, k, dtype=torch.bfloat16)
    w = (torch.randn(n, k) / k**0.5).to(torch.bfloat16)
    g = torch.randn(m, n, dtype=torch.bfloat16)
    recipe = MXRecipe.from_name(name)
    expected = _run(recipe, x, w, g)

    calls = []

    def fake_op(a, b, scale_a, scale_b, out_dtype):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype)

    got = _run(recipe, x, w, g, CublasBackend(scaled_mm=fake_op))
    assert len(calls) == (2 if name == "mxfp8_wgrad_bf16" else 3)  # one op per MX GEMM
    for what, a, e in zip(("y", "gx", "gw"), got, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1.6e-2, atol=1e-2, msg=what)


def test_forced_cublas_is_a_clear_error_off_sm100():
    layer = MXLinear(64, 64, recipe=MXRecipe.from_name("mxfp8", backend="cublas"))
    with pytest.raises(ValueError, match=r"backend 'cublas' needs .*sm_100"):
        layer(torch.randn(32, 64))


@pytest.mark.parametrize("config", ["debug_mxfp8", "debug_moe_mxfp8"])
def test_train_py_forced_cublas_stops_at_startup(tmp_path, config):
    """Forcing a backend the device lacks (a dense model, and one with MoE experts, whose grouped GEMMs need
    more) is one clear line and exit 2, before any step runs."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "train.py", "--config", config, "--mx.backend", "cublas",
           "--job.output_dir", str(tmp_path / "run"), "--data.max_bytes", "2000000"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "mx.backend: MX GEMM backend 'cublas' needs" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or (tmp_path / "run" / "metrics.jsonl").read_text() == ""
