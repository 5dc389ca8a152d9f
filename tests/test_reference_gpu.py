"""The reference on the GPU: to_mx on CUDA equals to_mx on the CPU bit for bit, and MXLinear
on CUDA computes the same casts as on the CPU (the GEMM itself may differ in summation order)."""

import pytest
import torch

from mx_recipe import MXLinear, MXRecipe, to_mx

pytestmark = pytest.mark.gpu


def _edge_case_matrix(dtype: torch.dtype) -> torch.Tensor:
    """Rows of 64: random normals, zeros, subnormals, saturating, NaN, Inf and tiny blocks."""
    torch.manual_seed(0)
    rows = [torch.randn(64) * 10.0 ** torch.randint(-6, 6, (1,)).item() for _ in range(58)]
    rows.append(torch.zeros(64))
    rows.append(torch.full((64,), 1e-40))  # fp32 subnormals (flush to 0 in bf16)
    nan_row = torch.randn(64)
    nan_row[3] = float("nan")
    rows.append(nan_row)
    inf_row = torch.randn(64)
    inf_row[40] = -float("inf")
    rows.append(inf_row)
    rows.append(torch.randn(64) * 2.0**-130)
    rows.append(torch.tensor([500.0, 57345.0, 7.0, -6.5] * 16))
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("elem", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("dim", [0, 1])
def test_to_mx_cuda_equals_cpu(dtype, elem, mode, dim):
    x = _edge_case_matrix(dtype)
    cpu, gpu = to_mx(x, elem, mode, dim=dim), to_mx(x.cuda(), elem, mode, dim=dim)
    assert torch.equal(cpu.qdata.view(torch.uint8), gpu.qdata.cpu().view(torch.uint8))
    assert torch.equal(cpu.scale.view(torch.uint8), gpu.scale.cpu().view(torch.uint8))
    torch.testing.assert_close(cpu.dequantize(), gpu.dequantize().cpu(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", ["mxfp8", "mxfp8_rceil", "mxfp4"])
def test_mx_linear_cuda_close_to_cpu(name):
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 128, bias=True)
    x = torch.randn(96, 256)
    outs = []
    for device in ("cpu", "cuda"):
        mx = MXLinear.from_linear(torch.nn.Linear(256, 128).to(device), MXRecipe.from_name(name))
        with torch.no_grad():
            mx.weight.copy_(lin.weight)
            mx.bias.copy_(lin.bias)
        xd = x.to(device, torch.bfloat16).requires_grad_()
        y = mx.to(torch.bfloat16)(xd)
        y.float().square().sum().backward()
        outs.append([t.detach().float().cpu() for t in (y, xd.grad, mx.weight.grad)])
    for cpu_t, gpu_t in zip(*outs, strict=True):
        # Same MX operands; only the bf16 GEMM's summation order differs between devices.
        torch.testing.assert_close(gpu_t, cpu_t, rtol=2e-2, atol=2e-2)
