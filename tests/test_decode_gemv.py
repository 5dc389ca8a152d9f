"""The decode step's one-row GEMV (kernels/decode_gemv.py, through mx_recipe.infer.gemv) against x @ w.T in fp64, for
bf16 weights and MXFP8 ones (their dequantized values).

* CPU, in this process: argument errors, the op's fake shape, and the rule (``takes``: one bf16 row on a GPU),
  which leaves the CPU to ``F.linear``; compiled for sm_90a, the first step's weights are read before the PDL wait.
* CPU, Triton interpreter (``test_interp_*``), in a child pytest with TRITON_INTERPRET=1: N not a multiple of the
  tile, K with and without a tail, fp32 and bf16, MXFP8 with its edge codes and scales, and the SwiGLU epilogue.
  (The interpreter converts MXFP8 codes by integer bit operations; the GPU tests check the hardware conversion.)
* GPU (``gpu``): Llama 3 8B's shapes and the MoE 16B's, both weight kinds, NaN and Inf, the epilogue, the kernel
  launched with PDL inside a captured CUDA graph replayed on new inputs, and the decode step taking it.
* Grouped (``grouped_gemv``): each row against its expert's GEMV in fp64, ragged groups with empty ones, rows read
  in place through ``rows`` or not, rows past the last group's end zero, both weight kinds and the epilogue, in the
  interpreter and at the MoE 16B's shapes on the GPU; in a CUDA graph with PDL, new routing on replay; the MoE
  decode step of one token running its bf16 or MXFP8 experts by it (two launches a layer), of five tokens not.

Bound. Products of 16-bit values, and of e4m3 codes with bf16 values, are exact in fp32; the kernel sums them in
fp32 in its own order (MXFP8: each 32-element block's sum times its e8m0 scale, exact), so |y - x w^T| <= 1.05 K
2**-23 (|x| |w|^T) before the output's one rounding, 2**-8 of |x w^T| in bf16 (2**-7 in the interpreter, whose
fp32 -> bf16 cast truncates) and 2**-24 in fp32. The epilogue rounds the gate and up sums to the output dtype and
then computes ``silu_mul``'s two roundings: against the eager expression on the kernel's own unfused outputs,
three roundings (a sum in another order may round to the neighbouring value); in fp32, 1e-6 (the kernel's exp and
torch's may differ in the last bits).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from test_cast_kernels import run_interpreter_tests

from mx_recipe.infer.gemv import GROUPED_MAX_M, MAX_M, apply_linear, linear, takes, use_gemv, use_grouped_gemv
from mx_recipe.infer.weights import quantize

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
interp_only = pytest.mark.skipif(not (INTERP and HAS_TRITON), reason="runs in the Triton interpreter child process")

if INTERP and HAS_TRITON:
    from test_gemm_triton import _install_interpreter_shims  # noqa: F401  (installed on import)


def gemv(x: torch.Tensor, w: torch.Tensor, swiglu: bool = False, scale: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mx_recipe.gemv(x, w, scale, swiglu=swiglu)


def grouped(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, rows: torch.Tensor | None = None,
            swiglu: bool = False, scale: torch.Tensor | None = None, early: int = 0) -> torch.Tensor:  # fmt: skip
    return torch.ops.mx_recipe.grouped_gemv(x, w, offs, rows, scale, swiglu=swiglu, early=early)


def check_early(x: torch.Tensor, w: torch.Tensor, routed: list[list[int]], shared: int,
                scale: torch.Tensor | None = None) -> None:  # fmt: skip
    """Tokens x [T, K] routed to ``routed[t]`` of the first groups of w, the last ``shared`` groups every token in
    order (as ``moe_route`` lays them out): with those groups early, the same bits as without, SwiGLU too."""
    assert len(routed) == x.shape[0]
    e = w.shape[0] - shared
    rows = [t for g in range(e) for t in range(x.shape[0]) if g in routed[t]] + list(range(x.shape[0])) * shared
    counts = [sum(g in r for r in routed) for g in range(e)] + [x.shape[0]] * shared
    offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    rows = torch.tensor(rows, dtype=torch.int32, device=x.device)
    for swiglu in (False, True):
        want = grouped(x, w, offs, rows, swiglu, scale)
        got = grouped(x, w, offs, rows, swiglu, scale, early=shared)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), swiglu


def mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, the dequantized weight in fp32) of w in MXFP8 along K."""
    q = quantize(w.float(), "mxfp8")
    return q.qdata, q.scale, q.dequantize(torch.float32)


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


def check_swiglu(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    h1, h3 = gemv(x, w, scale=scale).chunk(2, dim=-1)
    want = (F.silu(h1.float()).to(x.dtype).float() * h3.float()).to(x.dtype)
    got = gemv(x, w, swiglu=True, scale=scale)
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got.double() - want.double()).abs()
    rel = 1e-6 if x.dtype == torch.float32 else 3 * rounding(x.dtype)  # fp32: exp's last bits differ from torch's
    assert (err <= rel * want.double().abs() + 1e-30).all(), f"past by {err.max():.3g}"


def check_grouped(
    x: torch.Tensor,
    w: torch.Tensor,
    counts: list[int],
    rows: torch.Tensor | None = None,
    extra: int = 0,
    scale: torch.Tensor | None = None,
    dequantized: torch.Tensor | None = None,
) -> None:
    """``grouped`` of groups of ``counts`` rows (x, or x[rows]) and ``extra`` rows past the last group: each row
    within the bound of its expert's product, the extra rows zero; and the epilogue against the unfused outputs."""
    offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    m = sum(counts) + extra
    ix = torch.arange(m, device=x.device) if rows is None else rows.long()
    y = grouped(x, w, offs, None if rows is None else rows, scale=scale)
    assert y.shape == (m, w.shape[1])
    ref = w if dequantized is None else dequantized
    expert = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    for r, e in enumerate(expert.tolist()):
        assert_within_bound(y[r : r + 1].cpu(), x[ix[r]][None].cpu(), ref[e].cpu())
    assert y[len(expert) :].eq(0).all()
    h1, h3 = y[: len(expert)].chunk(2, dim=-1)
    want = (F.silu(h1.float()).to(x.dtype).float() * h3.float()).to(x.dtype)
    got = grouped(x, w, offs, None if rows is None else rows, swiglu=True, scale=scale)[: len(expert)]
    err = (got.double() - want.double()).abs()
    rel = 1e-6 if x.dtype == torch.float32 else 3 * rounding(x.dtype)
    assert (err <= rel * want.double().abs() + 1e-30).all(), f"past by {err.max():.3g}"


def operands(m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype).to(device)
    return x, w


def mx_operands(n: int, k: int, device: str, seed: int = 0):
    """x [1, K] bf16 and an MXFP8 weight whose blocks span 2**-12 .. 2**6 (scales differ along K and N)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).bfloat16().to(device)
    spread = 2.0 ** torch.randint(-12, 7, (n, k // 32), generator=g).float()
    return x, *mxfp8((torch.randn(n, k, generator=g) * spread.repeat_interleave(32, dim=1)).to(device))


def check_mx_edges(device: str) -> None:
    """NaN codes (0x7F, 0xFF) and a NaN scale (0xFF) make their rows NaN; scale bytes 0 (2**-127) and 254, the
    largest code (448), subnormal codes (0x01-0x07) and zeros give the dequantized weight's products."""
    x, codes, scales, _ = mx_operands(12, 256, "cpu")
    c, e = codes.view(torch.uint8).clone(), scales.view(torch.uint8).clone()
    c[0, 5], c[1, 40], e[2, 3] = 0x7F, 0xFF, 0xFF  # NaN: rows 0, 1, 2
    e[3, :], e[4, 1] = 0, 254  # 2**-127 everywhere; one block at 2**127
    c[4, 32:64] = torch.arange(32, dtype=torch.uint8) % 7 + 1  # subnormal codes under the large scale
    c[5, :], c[6, :32] = 0x7E, 0  # 448 everywhere; a zero block
    codes, scales = c.view(torch.float8_e4m3fn), e.view(torch.float8_e8m0fnu)
    w = mxfp8_dequantized(codes, scales)
    y = gemv(x.to(device), codes.to(device), scale=scales.to(device))
    assert y[:, :3].isnan().all() and not y[:, 3:].isnan().any()
    assert_within_bound(y[:, 3:].cpu(), x, w[3:])


def mxfp8_dequantized(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    from mx_recipe.formats.mx import MXTensor

    return MXTensor(codes, scales, "e4m3", 1).dequantize(torch.float32)


# ---------------------------------------------------------------------------------------
# CPU, in this process


def test_bad_arguments_are_one_line_errors():
    from mx_kernels.decode_gemv import gemv as kernel

    cases = [
        ((torch.randn(1, 8), torch.randn(4, 6)), "x \\[M, K\\] and w \\[N, K\\]"),
        ((torch.randn(1, 8), torch.randn(4, 8).double()), "of one dtype"),
        ((torch.randn(1, 64), torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, 3, dtype=torch.uint8)), "scales"),
        ((torch.randn(1, 48), torch.zeros(4, 48, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8)), "K a mul"),
        ((torch.randn(1, 64), torch.zeros(4, 64), torch.zeros(4, 2, dtype=torch.uint8)), "codes \\[N, K\\]"),
        ((torch.randn(MAX_M + 1, 8), torch.randn(4, 8)), f"rows, at most {MAX_M}"),
        ((torch.randn(8, 2).T[:1], torch.randn(4, 8)), "contiguous"),
        ((torch.randn(1, 8), torch.randn(5, 8), None, True), "swiglu needs w1 and w3 of one size"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match) as info:
            kernel(*args)
        assert "\n" not in str(info.value)


def test_grouped_bad_arguments_are_one_line_errors():
    from mx_kernels.decode_gemv import grouped_gemv as kernel

    x, w, offs = torch.randn(3, 64), torch.randn(4, 6, 64), torch.tensor([1, 1, 2, 3], dtype=torch.int32)
    cases = [
        ((x, w[0], offs), "w \\[E, N, K\\]"),
        ((x, w[..., :32], offs), "x \\[M, K\\]"),
        ((x, w, offs.long()), "offs int32"),
        ((x, w, offs[:3]), "offs int32 \\[E\\] \\(E = 4\\)"),
        ((x, w, offs, torch.zeros(2, dtype=torch.int64)), "rows int32"),
        ((x, w, offs, torch.zeros(GROUPED_MAX_M + 1, dtype=torch.int32)), f"at most {GROUPED_MAX_M}"),
        ((x, w.double(), offs), "of one dtype"),
        ((x, torch.zeros(4, 6, 64, dtype=torch.uint8), offs, None, torch.zeros(4, 6, 3, dtype=torch.uint8)), "scales"),
        ((x, w[:, :5], offs, None, None, True), "swiglu needs"),
        ((x, w, offs, None, None, False, False, 1), "early groups are shared experts"),
        ((x, w, offs, torch.zeros(4, dtype=torch.int32), None, False, False, 4), "early groups are shared experts"),
        ((x[:1], w, offs, torch.zeros(4, dtype=torch.int32), None, False, True, 1), "not both"),
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
        offs, rows = torch.empty(4, dtype=torch.int32), torch.empty(6, dtype=torch.int32)
        assert grouped(torch.empty(5, 64), torch.empty(4, 96, 64), offs).shape == (5, 96)
        assert grouped(torch.empty(2, 64), torch.empty(4, 96, 64), offs, rows, swiglu=True).shape == (6, 48)


def test_off_the_gpu_linear_is_f_linear():
    """On the CPU the rule says no, and ``linear`` is F.linear (swiglu: the eager expression), ``apply_linear`` of a
    module its call."""
    x, w = operands(2, 48, 64, torch.float32, "cpu")
    assert not use_gemv(x, w) and not use_gemv(x[:1].bfloat16(), w.bfloat16()) and not takes(x[:1].bfloat16())
    assert not use_grouped_gemv(x.bfloat16(), w.bfloat16()[None], 2)
    assert torch.equal(linear(x, w), F.linear(x, w))
    h1, h3 = F.linear(x, w).chunk(2, dim=-1)
    assert torch.equal(linear(x, w, swiglu=True), F.silu(h1) * h3)
    lin = torch.nn.Linear(64, 48, bias=False)
    assert torch.equal(apply_linear(lin, x), lin(x))
    norm = torch.nn.RMSNorm(64)
    assert torch.equal(apply_linear(norm, x), norm(x))


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="compiles for sm_90a")
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("grouped", [False, True, "offs_ready", "early"])
def test_first_step_is_read_before_the_pdl_wait(scaled, grouped):
    """Compiled for sm_90a under PDL: the first step's weights (and MXFP8's scales) are loaded before the wait for
    the kernel before, MXFP8's codes evict-first, and the next kernel is released right after the wait; grouped,
    whose expert the kernel before chooses, every load comes after the wait, but where an earlier kernel wrote
    ``offs`` (w2's). With early groups (folded shared experts) their rows' path releases the next kernel and waits
    for none."""
    from mx_kernels.decode_gemv import _gemv_kernel
    from mx_kernels.gluon.common import compile_for_arch

    n, k, meta = 4096, 4096, dict(device="meta")
    w = torch.empty(n, k, dtype=torch.uint8 if scaled else torch.bfloat16, **meta)
    out = torch.empty(1, n, dtype=torch.bfloat16, **meta)
    ints = torch.empty(8, dtype=torch.int32, **meta)
    kwargs = dict(x_ptr=torch.empty(1, k, dtype=torch.bfloat16, **meta), w_ptr=w,
                  s_ptr=torch.empty(n, k // 32, dtype=torch.uint8, **meta) if scaled else w, out_ptr=out,
                  offs_ptr=ints, rows_ptr=ints, N=n, K=k, E=8, TOKENS=1, stride_xm=k, stride_om=n, stride_we=n * k,
                  stride_wn=k, stride_se=n * k // 32, stride_sn=k // 32 if scaled else 0, BLOCK_N=4, BLOCK_K=1024,
                  EVEN_K=True, SCALED=scaled, HW_FP8=True, SWIGLU=False, GROUPED=bool(grouped), GATHER=bool(grouped),
                  E_POW2=8, OFFS_READY=grouped == "offs_ready", EARLY=2 if grouped == "early" else 0, PDL=True,
                  num_warps=4)  # fmt: skip
    ptx = compile_for_arch(_gemv_kernel, kwargs, 90).asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    before, after = ptx[:wait], ptx[wait:]
    assert after.index("griddepcontrol.launch_dependents") < after.index("ld.global")
    assert ptx.count("griddepcontrol.wait") == 1
    assert ptx.count("griddepcontrol.launch_dependents") == 1 + (grouped == "early")
    if grouped == "early":  # two paths, the shared rows' without the wait, joined before any load; the routing's
        # offs and rows read on the routed rows' only
        assert ptx.rindex("griddepcontrol") < ptx.index("ld.global")
        scalar = [line.strip() for line in ptx.splitlines() if "ld.global.cg.b32" in line]
        assert len(scalar) == 2 and all(line.startswith("@%p") for line in scalar)
    elif grouped is True:
        assert "ld.global" not in before
    else:  # 16-byte weight loads, evict-first for MXFP8 codes (module doc), and the scales
        evict_first = "ld.global.L1::evict_first.L2::cache_hint.v4.b32"
        assert (evict_first if scaled else "ld.global.v4.b32") in before and (evict_first in ptx) == scaled
        assert ("ld.global.b8" in before) == scaled
        assert ("ld.global.cg" in before) == bool(grouped)  # offs and rows, from L2 (another kernel wrote them)


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
def test_interp_mxfp8_tails_edges_and_swiglu():
    for n, k in [(37, 992), (20, 4096), (6, 96)]:
        x, codes, scales, w = mx_operands(n, k, "cpu", seed=n)
        assert_within_bound(gemv(x, codes, scale=scales), x, w)
    x, codes, scales, _ = mx_operands(40, 992, "cpu")
    check_swiglu(x, codes, scales)
    check_mx_edges("cpu")


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_grouped_ragged_gathered_and_past_the_end(dtype):
    x, w = operands(7, 5 * 40, 1000, dtype, "cpu", seed=4)
    w = w.view(5, 40, 1000)
    check_grouped(x, w, [2, 0, 3, 0, 1], extra=1)  # x's rows by expert, the last past the groups' end
    check_grouped(x, w, [0, 0, 0, 0, 7])  # every row the last expert's
    check_grouped(x[:3], w, [1, 2, 0, 2, 1], rows=torch.tensor([2, 0, 1, 2, 0, 1], dtype=torch.int32))
    check_early(x[:3], w, [[1], [0], [1]], shared=1)  # 3 tokens top-1, one shared group
    check_early(x[:2], w, [[0, 2], [2, 1]], shared=2)  # 2 tokens top-2, two shared groups


@interp_only
def test_interp_grouped_mxfp8():
    x, codes, scales, w = mx_operands(3 * 40, 992, "cpu", seed=5)
    x = torch.cat([x, -x, 2 * x])
    view = (3, 40, 992)
    check_grouped(x, codes.view(view), [1, 0, 2], rows=torch.tensor([0, 2, 1], dtype=torch.int32),
                  scale=scales.view(3, 40, 31), dequantized=w.view(view))  # fmt: skip
    check_early(x[:2], codes.view(view), [[1], [0]], shared=1, scale=scales.view(3, 40, 31))


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
        with torch.enable_grad():  # the op has no backward: a GEMM that needs one is F.linear's
            assert not use_gemv(x, w.clone().requires_grad_()) and use_gemv(x, w)
        assert_within_bound(gemv(x, w), x, w)
    for n, k in [(28672, 4096), (2816, 2048)]:
        check_swiglu(*operands(1, n, k, torch.bfloat16, "cuda"))
    x, w = operands(1, 1001, 1000, torch.float16, "cuda")  # odd N, a K tail; fp16 (off the rule)
    assert_within_bound(gemv(x, w), x, w)


@pytest.mark.gpu
def test_gpu_mxfp8_shapes_tails_and_edges():
    for n, k in [(6144, 4096), (4096, 4096), (4096, 14336), (2816, 2048), (2048, 1408), (1001, 992)]:
        x, codes, scales, w = mx_operands(n, k, "cuda", seed=n)
        assert_within_bound(gemv(x, codes, scale=scales).cpu(), x.cpu(), w.cpu())
    for n, k in [(28672, 4096), (2816, 2048)]:
        x, codes, scales, _ = mx_operands(n, k, "cuda", seed=n)
        check_swiglu(x, codes, scales)
    check_mx_edges("cuda")


@pytest.mark.gpu
def test_gpu_grouped_moe16b_shapes():
    """The MoE 16B's experts at one token: 6 of 64 (its fused w1/w3 and w2), read from the token in place, and the
    shared experts' 2 groups of every row after them; MXFP8 codes too."""
    g = torch.Generator().manual_seed(6)
    chosen = torch.randperm(64, generator=g)[:6].sort().values
    counts = torch.zeros(64, dtype=torch.int64).index_fill_(0, chosen, 1).tolist()
    for n, k in [(2816, 2048), (2048, 1408)]:
        x, w = operands(1, 64 * n, k, torch.bfloat16, "cuda", seed=n)
        w = w.view(64, n, k)
        check_grouped(x, w, counts, rows=torch.zeros(6, dtype=torch.int32, device="cuda"))
        check_grouped(torch.cat([x, -x]), w[:2], [1, 1])
    x, codes, scales, w = mx_operands(8 * 2816, 2048, "cuda", seed=7)
    view = (8, 2816, 2048)
    check_grouped(x, codes.view(view), [1, 0, 1, 1, 0, 1, 1, 1], rows=torch.zeros(6, dtype=torch.int32, device="cuda"),
                  scale=scales.view(8, 2816, 64), dequantized=w.view(view))  # fmt: skip
    from mx_kernels import pdl

    for on in (False, True):  # the shared groups early, with and without PDL: one token (top-4 of 6), and two
        with pdl.launching(on):
            check_early(x[:1], codes.view(view), [[0, 2, 3, 5]], shared=2, scale=scales.view(8, 2816, 64))
            check_early(torch.cat([x, -x]), codes.view(view), [[0, 5], [1, 5]], shared=2,
                        scale=scales.view(8, 2816, 64))  # fmt: skip


@pytest.mark.gpu
def test_gpu_grouped_captured_with_pdl_follows_new_routing():
    """A GEMV then the grouped GEMV on its output, with PDL, in a CUDA graph: replayed with other experts and rows
    (written between replays), the grouped GEMV reads the new routing and the GEMV's new output."""
    from mx_kernels import pdl

    x, w1 = operands(1, 2048, 2048, torch.bfloat16, "cuda")
    _, w = operands(1, 8 * 512, 2048, torch.bfloat16, "cuda", seed=1)
    w = w.view(8, 512, 2048)
    offs = torch.tensor([0, 1, 1, 1, 2, 2, 2, 2], dtype=torch.int32, device="cuda")
    rows = torch.zeros(2, dtype=torch.int32, device="cuda")
    with pdl.launching(True):
        grouped(gemv(x, w1), w, offs, rows)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = grouped(gemv(x, w1), w, offs, rows)
    x.copy_(torch.randn_like(x))
    offs.copy_(torch.tensor([0, 0, 0, 0, 0, 1, 1, 2], dtype=torch.int32))
    graph.replay()
    h = gemv(x, w1)
    torch.testing.assert_close(y, grouped(h, w, offs, rows), rtol=0, atol=0)
    assert_within_bound(y[1:].cpu(), h.cpu(), w[7].cpu())


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


def decode_model(name: str, flavor: str, fmt: str) -> torch.nn.Module:
    """A debug model on the GPU, bf16, its weights in ``fmt`` and its projections fused, as a decode step takes it."""
    from mx_recipe.infer.load import to_compute_dtype
    from mx_recipe.infer.weights import fuse_projections, quantize_model
    from mx_recipe.models import build_model, model_args

    torch.manual_seed(0)
    model = build_model(model_args(name, flavor, 320, 64)).to("cuda")
    model.init_weights()
    return fuse_projections(quantize_model(to_compute_dtype(model.eval(), torch.bfloat16), fmt))


def decode_step(model: torch.nn.Module, batch: int, calls: list) -> list:
    """One decode step of ``batch`` sequences after an 11-token prefill, ``calls`` cleared before it: its logits
    against the full forward's within bf16 roundings. Returns what ``calls`` held after the step (the full forward
    may add to it)."""
    from mx_recipe.infer import decode

    cuda = torch.device("cuda")
    tokens = torch.randint(0, 320, (batch, 12), device=cuda)
    cache = decode.KVCache(model, batch, 12, torch.bfloat16, cuda)
    with torch.no_grad():
        decode.forward(model, tokens[:, :11], torch.arange(11, device=cuda), cache)
        calls.clear()
        step = decode.forward(model, tokens[:, 11:], torch.tensor([11], device=cuda), cache)
        step_calls = list(calls)
        full = model(tokens)[:, 11:]
    torch.testing.assert_close(step.float(), full.float(), rtol=2e-2, atol=2e-2)
    return step_calls


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_gpu_decode_steps_take_the_gemv(fmt, monkeypatch):
    """A decode step of one sequence runs every projection by the GEMV (fused QKV, gate/up with its SwiGLU, wo, w2
    and the bf16 output layer), with PDL; of two, none. Both give the full forward's logits within bf16 roundings."""
    from mx_recipe.infer import decode

    model = decode_model("llama", "debug", fmt)
    op, calls = torch.ops.mx_recipe.gemv, []
    monkeypatch.setattr(torch.ops.mx_recipe, "gemv", lambda x, w, scale, swiglu: calls.append(scale is not None)
                        or op(x, w, scale, swiglu=swiglu))  # fmt: skip
    for batch in (1, 2):
        decode_step(model, batch, calls)
        assert decode.pdl_pays(model, batch) == (batch == 1 or fmt != "bf16")  # quantized: up to PDL_MAX_BATCH
        want = ([fmt == "mxfp8"] * 4 * len(model.layers) + [False]) if batch == 1 else []  # a layer's 4; the output
        assert calls == want, calls


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_gpu_moe_decode_step_takes_the_grouped_gemv(fmt, monkeypatch):
    """An MoE decode step of one token runs each MoE block's experts by the grouped GEMV, w1/w3 with SwiGLU in its
    epilogue and w2, over its 3 rows (top-2, and the shared expert folded in, bf16 and MXFP8 alike); of five tokens
    (15 rows) by the grouped GEMMs. Both give the full forward's logits within bf16 roundings."""
    model = decode_model("moe", "debug_moe", fmt)
    op, calls = torch.ops.mx_recipe.grouped_gemv, []

    def recorded(x, w, offs, rows=None, scale=None, swiglu=False, offs_ready=False, early=0):
        calls.append((rows is not None, swiglu, scale is not None, offs_ready, early))
        return op(x, w, offs, rows, scale, swiglu=swiglu, offs_ready=offs_ready, early=early)

    monkeypatch.setattr(torch.ops.mx_recipe, "grouped_gemv", recorded)
    moe_layers = sum(getattr(layer, "moe_enabled", False) for layer in model.layers.values())
    scaled = fmt == "mxfp8"
    for batch in (1, 5):
        decode_step(model, batch, calls)
        # w1/w3's folded shared group runs early; w2 after w1/w3 on the same offs reads them and its first weights
        # before its PDL wait
        expected = [(True, True, scaled, False, 1), (False, False, scaled, True, 0)] * moe_layers
        assert calls == (expected if batch == 1 else []), calls
