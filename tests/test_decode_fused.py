"""The decode step's fused kernels (kernels/decode_fused.py, through mx_recipe.infer.fused) against the model's
own modules: ``nn.RMSNorm`` after the residual add, SwiGLU's ``F.silu(h1) * h3``.

* CPU, in this process: argument errors and the ops' fake shapes.
* CPU, Triton interpreter (``test_interp_*``), in a child pytest with TRITON_INTERPRET=1: fp32 (equal to the
  reference within fp32 roundings) and bf16 (within one rounding of the reference's value) at several row
  counts and widths, with strided rows (views of one fused projection's output, as decode.py passes them).
* GPU (``gpu``): the same comparisons in bf16 at Llama 3 8B's and the MoE 16B's shapes, and the norm inside a
  captured CUDA graph replayed on new inputs.
* The norm of a GEMM's split-K partials is bit for bit the norm of their sum as the GEMM rounds it: fp32 rows in
  the interpreter, bf16 on the GPU.

Bounds. The kernels compute in fp32 as the reference does, but may contract a product and a sum into one FMA,
and the norm multiplies x * rstd * weight before its one rounding where nn.RMSNorm may round between: fp32
results agree within a few fp32 ulps (RTOL 1e-6 of the operands' magnitude), bf16 results within one bf16
rounding of the reference's (2**-8 relative, 2**-7 in the interpreter, whose fp32 -> bf16 cast truncates).
silu_mul rounds twice as the eager expression does, and its exp may differ from torch's in the last fp32 bit,
which can flip silu's rounding: within three roundings of the reference's.
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest
import torch
from test_cast_kernels import run_interpreter_tests

from mx_recipe.infer.fused import add_rms_norm, silu_mul

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
interp_only = pytest.mark.skipif(not (INTERP and HAS_TRITON), reason="runs in the Triton interpreter child process")

if INTERP and HAS_TRITON:
    from test_gemm_triton import _install_interpreter_shims  # noqa: F401  (installed on import)


def rel(dtype: torch.dtype) -> float:
    return 1e-6 if dtype == torch.float32 else 2.0**-7 if INTERP else 2.0**-8


def assert_close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | float) -> None:
    """|got - want| <= rel * (|want| + scale), ``scale`` the operands' magnitude (an FMA's lost bits)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.double() - want.double()).abs()
    bound = rel(got.dtype) * (want.double().abs() + scale)
    assert (err <= bound).all(), f"past the bound by {(err - bound).max().item():.3g}"


def check_norm(t, d, dtype, device, with_delta):
    torch.manual_seed(t + d)
    h = (torch.randn(t, d, device=device) * 3).to(dtype)
    delta = torch.randn(t, d, device=device).to(dtype) if with_delta else None
    norm = torch.nn.RMSNorm(d, eps=1e-5, device=device)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(d) + 0.5)
    weight = norm.weight.detach().to(dtype)
    want_h = h + delta if with_delta else h
    got_h, got = add_rms_norm(h, delta, weight, 1e-5)
    # the norm of the kernel's own sum (checked below), in fp32, rounded once
    want = torch.nn.functional.rms_norm(got_h.float(), (d,), weight.float(), 1e-5).to(dtype)
    assert got_h.data_ptr() != h.data_ptr()
    if INTERP and dtype == torch.bfloat16:  # the interpreter's cast of the fp32 sum truncates
        assert_close(got_h, want_h, 0.0)
    else:
        assert torch.equal(got_h, want_h)
    assert_close(got, want, 0.0)


def check_norm_partials(t, d, splits, dtype, device, per_column):
    """A GEMM's split-K partials as the branch's output: the same outputs, bit for bit, as the norm of their sum in
    split order from 0, times the scale, rounded to h's dtype (what the GEMM's own epilogue writes); the partials
    span the fp32 range, zeros of both signs among them."""
    torch.manual_seed(t + d + splits)
    h = (torch.randn(t, d, device=device) * 3).to(dtype)
    parts = torch.randn(splits, t, d, device=device) * torch.exp2(torch.randint(-20, 20, (splits, t, d), device=device))
    parts[0, :, :4] = torch.tensor([0.0, -0.0, -0.0, 0.0])
    parts[1:, :, :4] = -0.0
    scale = (torch.rand(d if per_column else 1, device=device) + 0.5) * 256.0
    weight = (torch.rand(d, device=device) + 0.5).to(dtype)
    total = torch.zeros(t, d, device=device)
    for part in parts:
        total = total + part
    for sc in (None, scale):
        delta = (total if sc is None else total * sc).to(dtype)
        got = add_rms_norm(h, parts, weight, 1e-5, sc)
        want = add_rms_norm(h, delta, weight, 1e-5)
        assert all(torch.equal(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
                   for a, b in zip(got, want, strict=True))  # fmt: skip


def check_silu_mul(t, h, dtype, device):
    """h1 and h3 as views of one fused GEMM's output [T, 2H] (strided rows), and as two tensors."""
    torch.manual_seed(t + h)
    fused = (torch.randn(t, 2 * h, device=device) * 4).to(dtype)
    h1, h3 = fused.split([h, h], dim=-1)
    want = torch.nn.functional.silu(h1) * h3
    for a, b in ((h1, h3), (h1.contiguous(), h3.contiguous())):
        got = silu_mul(a, b)
        assert_close(got, want, 2 * want.abs())


# ---------------------------------------------------------------------------------------
# CPU, in this process


def test_bad_arguments_are_one_line_errors():
    from mx_kernels.decode_fused import add_rms_norm as norm_kernel
    from mx_kernels.decode_fused import silu_mul as silu_kernel

    with pytest.raises(ValueError, match="weight \\[D\\]"):
        norm_kernel(torch.randn(2, 8), None, torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        norm_kernel(torch.randn(8, 2).T, None, torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="fp32 split-K partials \\[S, T, D\\]"):
        norm_kernel(torch.randn(2, 8), torch.randn(3, 2, 8).bfloat16(), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="fp32 split-K partials \\[S, T, D\\]"):
        norm_kernel(torch.randn(2, 8), torch.randn(3, 2, 4), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="delta_scale is fp32, one or one per column, for split-K partials"):
        norm_kernel(torch.randn(2, 8), torch.randn(2, 8), torch.ones(8), 1e-5, torch.ones(1))
    with pytest.raises(ValueError, match="delta_scale is fp32, one or one per column"):
        norm_kernel(torch.randn(2, 8), torch.randn(3, 2, 8), torch.ones(8), 1e-5, torch.ones(4))
    with pytest.raises(ValueError, match="h1 and h3 must be \\[T, H\\] alike"):
        silu_kernel(torch.randn(2, 8), torch.randn(2, 4))
    with pytest.raises(ValueError, match="contiguous"):
        silu_kernel(torch.randn(8, 2).T, torch.randn(2, 8))


def test_fake_shapes_under_compile_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        h, out = torch.ops.mx_recipe.add_rms_norm(torch.empty(3, 64), None, torch.empty(64), 1e-5)
        assert h.shape == out.shape == (3, 64)
        assert torch.ops.mx_recipe.silu_mul(torch.empty(3, 64), torch.empty(3, 64)).shape == (3, 64)


def compiled_norm(rows: int, splits: int):
    """The add + RMSNorm kernel compiled for sm_90a under PDL, offline: ``rows`` rows 4096 wide (Llama 3 8B's) and a
    bf16 delta, or (``splits`` > 0) that many fp32 split-K partials."""
    from mx_kernels.decode_fused import _add_rms_norm_kernel
    from mx_kernels.gluon.common import compile_for_arch

    d, meta = 4096, dict(device="meta")
    bf16 = dict(dtype=torch.bfloat16, **meta)
    delta = torch.empty(splits, rows, d, **meta) if splits else torch.empty(rows, d, **bf16)
    kwargs = dict(
        h_ptr=torch.empty(rows, d, **bf16), delta_ptr=delta, scale_ptr=torch.empty(d, **meta),
        w_ptr=torch.empty(d, **bf16), h_out_ptr=torch.empty(rows, d, **bf16), out_ptr=torch.empty(rows, d, **bf16),
        stride_h=d, stride_d=d, stride_ds=rows * d if splits else 0, stride_sc=int(splits > 0), stride_ho=d,
        stride_o=d, D=d, eps=1e-5, HAS_DELTA=True, SPLITS=splits, HAS_SCALE=False, BLOCK=d, PDL=True, num_warps=16,
    )  # fmt: skip
    return compile_for_arch(_add_rms_norm_kernel, kwargs, 90)


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="the kernel compiled for sm_90a, offline")
def test_norm_issues_every_splits_loads_before_adding():
    """Compiled for sm_90a, the norm of 8 splits of a 4096-wide row (a decode step's wo or w2 at Llama 3 8B dims)
    issues all 16 of a thread's 16-byte partial loads before its first add: in flight together, one wait."""
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    tool = triton.knobs.nvidia.nvdisasm.path
    if not tool or not Path(tool).exists():
        pytest.skip("Triton's nvdisasm is missing")
    cubin = compiled_norm(rows=32, splits=8).asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout
    ops = [op.split()[0] for op in re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][^;]*);", sass)]
    first_add = ops.index("FADD")
    assert ops[:first_add].count("LDG.E.128") >= 16, ops[: first_add + 1]


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="the kernel compiled for sm_90a, offline")
def test_norm_reads_its_weight_before_the_pdl_wait():
    """Compiled for sm_90a under PDL, the norm loads its weight before it waits for the kernel before (no kernel of
    a step writes it) and the rows after, and releases the next kernel right after the wait."""
    ptx = compiled_norm(rows=1, splits=0).asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    before, after = ptx[:wait], ptx[wait:]
    assert before.count("ld.global") == 1  # the weight
    assert after.count("ld.global") == 2  # h and delta
    assert after.index("griddepcontrol.launch_dependents") < after.index("ld.global")


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="this is the parent of the interpreter run")
def test_kernels_in_triton_interpreter():
    run_interpreter_tests(__file__)


# ---------------------------------------------------------------------------------------
# CPU, Triton interpreter (child process)


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_add_rms_norm(dtype):
    for t, d in [(1, 64), (3, 100), (2, 4096)]:
        for with_delta in (False, True):
            check_norm(t, d, dtype, "cpu", with_delta)


@interp_only
def test_interp_add_rms_norm_sums_split_k_partials():
    """fp32 rows: the interpreter's fp32 -> bf16 cast truncates, so the bit-for-bit bf16 check runs on the GPU."""
    for t, d, splits in [(1, 64, 2), (3, 100, 3), (2, 512, 8)]:
        check_norm_partials(t, d, splits, torch.float32, "cpu", per_column=t != 1)


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_silu_mul(dtype):
    for t, h in [(1, 64), (3, 100), (2, 4096)]:
        check_silu_mul(t, h, dtype, "cpu")


# ---------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
def test_gpu_llama8b_shapes():
    for b in (1, 32):
        check_norm(b, 4096, torch.bfloat16, "cuda", True)
    check_norm(1, 4096, torch.bfloat16, "cuda", False)
    for t, splits in [(5, 8), (32, 8), (32, 4), (128, 2)]:
        check_norm_partials(t, 4096, splits, torch.bfloat16, "cuda", per_column=True)
        check_norm_partials(t, 4096, splits, torch.bfloat16, "cuda", per_column=False)
    for t, h in [(1, 14336), (32, 14336), (6, 1408)]:
        check_silu_mul(t, h, torch.bfloat16, "cuda")
        check_silu_mul(t, h, torch.float32, "cuda")


@pytest.mark.gpu
def test_gpu_captured_graph_replays_on_new_inputs():
    h, delta = torch.randn(2, 4096, device="cuda").bfloat16(), torch.randn(2, 4096, device="cuda").bfloat16()
    weight = torch.rand(4096, device="cuda").bfloat16()
    add_rms_norm(h, delta, weight, 1e-5)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h_out, _ = add_rms_norm(h, delta, weight, 1e-5)
    h.copy_(torch.randn_like(h))
    graph.replay()
    assert torch.equal(h_out, h + delta)
