"""The decode step's dense GEMV (kernels/decode_gemv.py, through mx_recipe.infer.gemv) against x @ w.T in fp64.

* CPU, in this process: argument errors, the op's fake shape, and the rule (``use_gemv``: bf16 on a GPU, at most
  MAX_M rows), which leaves the CPU to ``F.linear``.
* CPU, Triton interpreter (``test_interp_*``), in a child pytest with TRITON_INTERPRET=1: N not a multiple of the
  tile, K with and without a tail, fp32 and bf16, and the SwiGLU epilogue.
* GPU (``gpu``): Llama 3 8B's shapes and the MoE 16B's, NaN and Inf, the epilogue, and the kernel launched with PDL
  inside a captured CUDA graph replayed on new inputs.

Bound. Products of 16-bit values are exact in fp32; the kernel sums them in fp32 in its own order (cuBLAS in
another), so |y - x w^T| <= 1.05 K 2**-23 (|x| |w|^T) before the output's one rounding, 2**-8 of |x w^T| in bf16
(2**-7 in the interpreter, whose fp32 -> bf16 cast truncates) and 2**-24 in fp32. The epilogue rounds the gate and
up sums to the output dtype and then computes ``silu_mul``'s two roundings: against the eager expression on the
kernel's own unfused outputs, three roundings (a sum in another order may round to the neighbouring value); in
fp32, 1e-6 (the kernel's exp and torch's may differ in the last bits).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from test_cast_kernels import run_interpreter_tests

from mx_recipe.infer.gemv import MAX_M, apply_linear, linear, use_gemv

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
interp_only = pytest.mark.skipif(not (INTERP and HAS_TRITON), reason="runs in the Triton interpreter child process")

if INTERP and HAS_TRITON:
    from test_gemm_triton import _install_interpreter_shims  # noqa: F401  (installed on import)


def gemv(x: torch.Tensor, w: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
    return torch.ops.mx_recipe.gemv(x, w, swiglu=swiglu)


def rounding(dtype: torch.dtype) -> float:
    return 2.0**-24 if dtype == torch.float32 else 2.0**-7 if INTERP else 2.0**-8


def assert_within_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    r, s = x.double() @ w.double().T, x.double().abs() @ w.double().abs().T
    assert y.dtype == x.dtype and y.shape == r.shape
    assert torch.equal(y.isnan(), r.isnan()), "NaN where the reference has none, or the other way"
    finite = r.isfinite()
    assert torch.equal(y[~finite & ~r.isnan()].double(), r[~finite & ~r.isnan()]), "a different infinity"
    bound = rounding(y.dtype) * r.abs() + 1.05 * x.shape[1] * 2.0**-23 * s
    excess = ((y.double() - r).abs() - bound)[finite]
    assert excess.numel() == 0 or excess.max() <= 0, f"{tuple(x.shape)} x {tuple(w.shape)}: past by {excess.max():.3g}"


def check_swiglu(x: torch.Tensor, w: torch.Tensor) -> None:
    h1, h3 = gemv(x, w).chunk(2, dim=-1)
    want = (F.silu(h1.float()).to(x.dtype).float() * h3.float()).to(x.dtype)
    got = gemv(x, w, swiglu=True)
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got.double() - want.double()).abs()
    rel = 1e-6 if x.dtype == torch.float32 else 3 * rounding(x.dtype)  # fp32: exp's last bits differ from torch's
    assert (err <= rel * want.double().abs() + 1e-30).all(), f"past by {err.max():.3g}"


def operands(m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype).to(device)
    return x, w


# ---------------------------------------------------------------------------------------
# CPU, in this process


def test_bad_arguments_are_one_line_errors():
    from mx_kernels.decode_gemv import gemv as kernel

    cases = [
        ((torch.randn(1, 8), torch.randn(4, 6)), "x \\[M, K\\] and w \\[N, K\\] of one dtype"),
        ((torch.randn(1, 8), torch.randn(4, 8).double()), "of one dtype"),
        ((torch.randn(MAX_M + 1, 8), torch.randn(4, 8)), f"rows, at most {MAX_M}"),
        ((torch.randn(8, 2).T[:1], torch.randn(4, 8)), "contiguous"),
        ((torch.randn(1, 8), torch.randn(5, 8), True), "swiglu needs w1 and w3 of one size"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match) as info:
            kernel(*args)
        assert "\n" not in str(info.value)


def test_fake_shape_under_compile_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert gemv(torch.empty(3, 64), torch.empty(96, 64)).shape == (3, 96)
        assert gemv(torch.empty(1, 64), torch.empty(96, 64), swiglu=True).shape == (1, 48)


def test_off_the_gpu_linear_is_f_linear():
    """On the CPU the rule says no, and ``linear`` is F.linear (swiglu: the eager expression), ``apply_linear`` of a
    module its call."""
    x, w = operands(2, 48, 64, torch.float32, "cpu")
    assert not use_gemv(x, w) and not use_gemv(x.bfloat16(), w.bfloat16())
    assert torch.equal(linear(x, w), F.linear(x, w))
    h1, h3 = F.linear(x, w).chunk(2, dim=-1)
    assert torch.equal(linear(x, w, swiglu=True), F.silu(h1) * h3)
    lin = torch.nn.Linear(64, 48, bias=False)
    assert torch.equal(apply_linear(lin, x), lin(x))
    norm = torch.nn.RMSNorm(64)
    assert torch.equal(apply_linear(norm, x), norm(x))


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="this is the parent of the interpreter run")
def test_kernel_in_triton_interpreter():
    run_interpreter_tests(__file__)


# ---------------------------------------------------------------------------------------
# CPU, Triton interpreter (child process)


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_rows_tails_and_swiglu(dtype):
    for n, k in [(37, 1000), (20, 2048), (6, 300)]:
        x, w = operands(1, n, k, dtype, "cpu", seed=n)
        assert_within_bound(gemv(x, w), x, w)
    x, w = operands(1, 40, 1000, dtype, "cpu")
    check_swiglu(x, w)


@interp_only
def test_interp_nan_inf_and_empty():
    x, w = operands(1, 12, 512, torch.float32, "cpu")
    x[0, 3], w[5, 7], w[6, 9] = float("nan"), float("inf"), float("-inf")
    assert_within_bound(gemv(x, w), x, w)
    x[0, 3] = 1.0
    assert_within_bound(gemv(x, w), x, w)
    assert gemv(x[:, :0], w[:, :0]).eq(0).all() and gemv(x[:0], w).shape == (0, 12)


# ---------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
def test_gpu_llama8b_and_moe16b_shapes():
    for n, k in [(6144, 4096), (4096, 4096), (4096, 14336), (128256, 4096), (2816, 2048), (2048, 1408)]:
        x, w = operands(1, n, k, torch.bfloat16, "cuda", seed=n)
        assert use_gemv(x, w) and not use_gemv(torch.cat([x, x]), w)
        assert_within_bound(gemv(x, w), x, w)
    for n, k in [(28672, 4096), (2816, 2048)]:
        check_swiglu(*operands(1, n, k, torch.bfloat16, "cuda"))
    x, w = operands(1, 1001, 1000, torch.float16, "cuda")  # odd N, a K tail; fp16 (off the rule)
    assert_within_bound(gemv(x, w), x, w)


@pytest.mark.gpu
def test_gpu_nan_and_inf():
    x, w = operands(1, 1000, 4096, torch.bfloat16, "cuda")
    w[5, 7], w[6, 9] = float("inf"), float("-inf")
    assert_within_bound(gemv(x, w), x, w)
    x[0, 3] = float("nan")
    assert_within_bound(gemv(x, w), x, w)


@pytest.mark.gpu
def test_gpu_captured_with_pdl_replays_on_new_inputs():
    """A chain of GEMVs, launched with PDL, in a CUDA graph: each reads the one before's output."""
    from mx_kernels import pdl

    x, w1 = operands(1, 4096, 4096, torch.bfloat16, "cuda")
    _, w2 = operands(1, 4096, 4096, torch.bfloat16, "cuda", seed=1)
    with pdl.launching(True):
        gemv(gemv(x, w1), w2)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = gemv(gemv(x, w1), w2)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(y, gemv(gemv(x, w1), w2), rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_bf16_decode_steps_take_the_gemv():
    """A bf16 decode step of one sequence runs every projection by the GEMV (fused QKV, gate/up with its SwiGLU, wo,
    w2 and the output layer), with PDL; of two, none (cuBLAS), without. Both give the full forward's logits
    within bf16 roundings."""
    from mx_recipe.infer import decode, gemv
    from mx_recipe.infer.load import to_compute_dtype
    from mx_recipe.infer.weights import fuse_projections
    from mx_recipe.models import build_model, model_args

    cuda = torch.device("cuda")
    torch.manual_seed(0)
    model = build_model(model_args("llama", "debug", 320, 64)).to(cuda)
    model.init_weights()
    model = fuse_projections(to_compute_dtype(model.eval(), torch.bfloat16))
    rule, taken = gemv.use_gemv, []
    for batch in (1, 2):
        tokens = torch.randint(0, 320, (batch, 12), device=cuda)
        cache = decode.KVCache(model, batch, 12, torch.bfloat16, cuda)
        with torch.no_grad():
            decode.forward(model, tokens[:, :11], torch.arange(11, device=cuda), cache)
            gemv.use_gemv = lambda x, w: taken.append(rule(x, w)) or taken[-1]
            try:
                step = decode.forward(model, tokens[:, 11:], torch.tensor([11], device=cuda), cache)
            finally:
                gemv.use_gemv = rule
            full = model(tokens)[:, 11:]
        assert decode.pdl_pays(model, batch) == (batch == 1)
        assert taken == [batch == 1] * (4 * len(model.layers) + 1), taken  # wqkv, w13, wo, w2 a layer; the output
        taken.clear()
        torch.testing.assert_close(step.float(), full.float(), rtol=2e-2, atol=2e-2)
