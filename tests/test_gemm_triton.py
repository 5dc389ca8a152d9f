"""The triton MX GEMM backend: ``mx_recipe.ops.gemm.mx_mm_triton`` -> ``torch.ops.mx_recipe.mx_gemm`` ->
kernels/mx/gemm.py (``tl.dot_scaled``), against the emulated backend.

Three groups of tests:

* CPU, in this process: backend resolution and its startup errors, argument checks, the custom op
  traced by torch.compile(fullgraph=True), benchmarks/bench_gemm.py's rows and their rendering by
  scripts/perf_report.py.
* CPU, Triton interpreter (``test_interp_*``), in a child pytest with TRITON_INTERPRET=1 as in
  tests/test_cast_kernels.py: the kernel's addressing, tile masks, fp4 byte offsets and K tails.
  Triton 3.6's interpreter has no ``dot_scaled`` (its builder lacks ``create_dot_scaled``), so the
  child installs one that does what the op's documentation says (``_interp_dot_scaled``), and
  makes the interpreter's int() of a scalar (which it keeps as a 1-element array, and numpy 2.4
  refuses to convert) work for the runtime-bound K loop. What ``dot_scaled`` itself computes on a
  GPU only the ``gpu`` tests check. Outputs are fp32 there: the interpreter's fp32 -> bf16
  conversion truncates instead of rounding to nearest even. Run them directly with
  ``TRITON_INTERPRET=1 pytest tests/test_gemm_triton.py -k interp_``.
* GPU (``gpu``; ``sm100`` for the native path): e4m3, e5m2, e2m1, mixed pairs, both scale rules,
  ragged M and N, K tails, edge blocks, the cast outputs of the three linear GEMMs.

Tolerance. Each product of two dequantized MX values is exact in fp32: at most 4 x 4 significant
bits, and the scales only add exponents. On sm_90 Triton upcasts each element * 2**e to bf16,
exactly while it stays in bf16's normal range (these tests' data does), then runs a bf16 MMA with
fp32 accumulation. So the triton result and the emulated one (fp32 matmul of the same exact values)
differ only in summation order. Each side's fp32 sum is within (K - 1) * 2**-24 * sum_k |a_k b_k| of
the exact one, so they are within ``K * 2**-23 * (|A| @ |B|.T)`` of each other, plus one rounding to
the output type (2**-8 relative for bf16). On integer data whose partial sums stay below 2**24 every
order gives the exact sum: there the results are bit-identical.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from test_cast_kernels import run_interpreter_tests, traced_ops

from mx_recipe.formats.mx import E2M1_VALUES, MXTensor, to_mx, unpack_fp4
from mx_recipe.formats.recipe import MXRecipe
from mx_recipe.ops import mx_backends
from mx_recipe.ops.backends import resolve_backend
from mx_recipe.ops.gemm import mx_mm, mx_mm_triton, triton_available
from mx_recipe.ops.mx_cast import cast_dim0, cast_dim1

ROOT = Path(__file__).resolve().parents[1]
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)

interp_only = pytest.mark.skipif(not (INTERP and HAS_TRITON), reason="runs in the Triton interpreter child process")

ELEM_PAIRS = [
    ("e4m3", "e4m3"),
    ("e5m2", "e5m2"),
    ("e2m1", "e2m1"),
    ("e4m3", "e5m2"),
    ("e5m2", "e4m3"),
    ("e4m3", "e2m1"),
    ("e2m1", "e5m2"),
]
RULES = ["floor", "rceil"]


# ---------------------------------------------------------------------------------------
# the interpreter's dot_scaled (child process only)


def _interp_decode(data, fmt, k_axis: int) -> torch.Tensor:
    """Element bytes as dot_scaled reads them -> fp64 values (torch's fp8 decode is exact)."""
    import numpy as np
    from triton._C.libtriton import ir

    t = torch.from_numpy(np.ascontiguousarray(data))
    fp8 = {ir.ScaleDotElemTypeTY.E4M3: torch.float8_e4m3fn, ir.ScaleDotElemTypeTY.E5M2: torch.float8_e5m2}
    if fmt in fp8:
        return t.view(fp8[fmt]).to(torch.float64)
    assert fmt == ir.ScaleDotElemTypeTY.E2M1, fmt
    codes = unpack_fp4(t.movedim(k_axis, -1)).movedim(-1, k_axis)  # packed along K, low nibble first
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float64)[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def _interp_scale(data) -> torch.Tensor:
    """[rows, K/32] E8M0 bytes -> fp64 factors [rows, K], NaN for 0xFF."""
    import numpy as np

    b = torch.from_numpy(np.ascontiguousarray(data)).to(torch.float64)
    return torch.where(b == 255, torch.nan, torch.exp2(b - 127)).repeat_interleave(32, dim=1)


def _interp_dot_scaled(self, lhs, lhs_scale, lhs_format, rhs, rhs_scale, rhs_format, fast_math, *packs_and_acc):
    """acc + (lhs * lhs_scale) @ (rhs * rhs_scale): lhs [M, K], rhs [K, N] (fp4 packed along K),
    scales [M, K/32] and [N, K/32] (tl.dot_scaled's documentation); fp64 products and sums. A bf16 lhs (raw
    uint16 in the interpreter) comes without scales."""
    import numpy as np
    from triton._C.libtriton import ir
    from triton.runtime.interpreter import TensorHandle

    lhs_k_pack, rhs_k_pack, acc = packs_and_acc  # the builder's order
    assert lhs_k_pack and rhs_k_pack and not fast_math
    if lhs_format == ir.ScaleDotElemTypeTY.BF16:
        assert lhs_scale is None
        raw = torch.from_numpy(np.ascontiguousarray(lhs.data).view(np.int16))
        a = raw.view(torch.bfloat16).to(torch.float64)
    else:
        a = _interp_decode(lhs.data, lhs_format, 1) * _interp_scale(lhs_scale.data)
    b = _interp_decode(rhs.data, rhs_format, 0) * _interp_scale(rhs_scale.data).t()
    return TensorHandle((a @ b).to(torch.float32).numpy() + acc.data, acc.dtype.scalar)


def _install_interpreter_shims() -> None:
    from triton.runtime import interpreter

    interpreter.InterpreterBuilder.create_dot_scaled = _interp_dot_scaled
    patch_tensor = interpreter._patch_lang_tensor

    def patch_with_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_with_index


if INTERP and HAS_TRITON:
    _install_interpreter_shims()


# ---------------------------------------------------------------------------------------
# inputs and checks, shared by the interpreter and GPU tests


def _data(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Normal data whose 32-element blocks span 2**-8 .. 2**8: every dequantized value is a bf16 normal."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    exps = torch.randint(-8, 9, (rows, cols // 32), generator=g).repeat_interleave(32, dim=1)
    return (x * torch.exp2(exps.float())).to(torch.bfloat16)


def _integers(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-16, 17, (rows, cols), generator=g).to(torch.bfloat16)


def _to(mx: MXTensor, device: torch.device | str) -> MXTensor:
    return MXTensor(mx.qdata.to(device), mx.scale.to(device), mx.elem, mx.dim)


def _operands(m: int, n: int, k: int, elems: tuple[str, str], rule: str, device, seed: int = 0, ints: bool = False):
    """a [M, K] and b [N, K] cast along K by the reference (exact on every device), on ``device``."""
    make = _integers if ints else _data
    a = to_mx(make(m, k, seed), elems[0], rule)
    b = to_mx(make(n, k, seed + 1), elems[1], rule)
    return _to(a, device), _to(b, device)


def _bound(a: MXTensor, b: MXTensor) -> torch.Tensor:
    """K * 2**-23 * (|A| @ |B|.T) of the exact dequantized operands (module doc), fp64 on the CPU."""
    ad, bd = _to(a, "cpu").dequantize(torch.float64), _to(b, "cpu").dequantize(torch.float64)
    return torch.nan_to_num(ad.abs() @ bd.abs().t(), nan=0.0) * ad.shape[1] * 2.0**-23


def assert_matches_emulated(out: torch.Tensor, a: MXTensor, b: MXTensor, what: str) -> None:
    """``out`` (bf16/fp16/fp32) against the emulated backend in fp32, within the module doc's bound."""
    ref = mx_mm(a, b, torch.float32, "emulated").cpu().double()
    got = out.cpu().double()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    nan_ref, nan_got = ref.isnan(), got.isnan()
    assert torch.equal(nan_ref, nan_got), f"{what}: NaN at {nan_got.nonzero()[:4].tolist()} vs {nan_ref.nonzero()[:4]}"
    rounding = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[out.dtype]
    tol = 2 * _bound(a, b) + rounding * ref.abs()
    err = torch.where(nan_ref, 0.0, (got - ref).abs())
    # A sum past the output type's max rounds to inf of its sign (fp16 overflows at 65520): that is right.
    limit = torch.finfo(out.dtype).max
    overflow = got.isinf() & ref.isfinite() & (ref.abs() + tol >= limit) & (got.sign() == ref.sign())
    err = torch.where(overflow, 0.0, err)
    bad = (err > torch.where(nan_ref, 0.0, tol)).nonzero()
    if len(bad):
        i, j = bad[0].tolist()
        raise AssertionError(
            f"{what}: {len(bad)} outputs outside the bound; first [{i}, {j}]: got {got[i, j].item()}, "
            f"emulated {ref[i, j].item()}, bound {tol[i, j].item()}"
        )


def assert_exact(out: torch.Tensor, a: MXTensor, b: MXTensor, what: str) -> None:
    """Integer data: the exact sums, bit for bit, rounded once to the output type."""
    ref = mx_mm(a, b, torch.float32, "emulated").to(out.dtype)
    torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=0, atol=0, msg=what)


def check_pairs_and_shapes(device, shapes, config: dict | None = None) -> None:
    """Every element pair on ``shapes``, the scale rules taking turns (the kernel only reads scale
    bytes); through the launcher when ``config`` is set (small tiles: many programs, wrap-around
    rows), else through mx_mm_triton and the custom op."""
    for s, (m, n, k) in enumerate(shapes):
        for i, elems in enumerate(ELEM_PAIRS):
            rule = RULES[(s + i) % 2]
            a, b = _operands(m, n, k, elems, rule, device, seed=m + n + k)
            if config is None:
                out = mx_mm_triton(a, b, torch.float32)
            else:
                from mx_kernels.mx.gemm import mx_gemm

                out = mx_gemm(a.qdata, a.scale, a.elem, b.qdata, b.scale, b.elem, torch.float32, config)
            assert_matches_emulated(out, a, b, f"{(m, n, k)} {elems} {rule} {config}")


def edge_operands(elem_a: str, elem_b: str, rule: str, device) -> tuple[MXTensor, MXTensor]:
    """Zero and NaN blocks, saturating blocks (floor), huge and tiny (but bf16-normal) blocks."""
    x, w = _data(96, 128, seed=3).float(), _data(80, 128, seed=4).float()
    x[3, :32] = 0.0  # all-zero block: e = -127, zero elements
    x[5, 32:64] = float("nan")  # NaN block: row 5 of the output is NaN
    x[7, 64:96] = torch.linspace(-500.0, 500.0, 32)  # floor saturates these to the max normal
    x[9, 96:] = 2.0**60 * torch.linspace(-1.0, 1.0, 32)
    x[11, :32] *= 2.0**-60
    w[2, 32:64] = 0.0
    w[4, 96:] = float("nan")  # column 4 of the output is NaN
    w[6, :32] = 1e30  # a constant block: one scale, equal elements
    return _to(to_mx(x, elem_a, rule), device), _to(to_mx(w, elem_b, rule), device)


def check_edges(device) -> None:
    for elems in [("e4m3", "e4m3"), ("e5m2", "e5m2"), ("e2m1", "e2m1"), ("e4m3", "e2m1")]:
        for rule in RULES:
            a, b = edge_operands(*elems, rule, device)
            out = mx_mm_triton(a, b, torch.float32)
            assert_matches_emulated(out, a, b, f"edges {elems} {rule}")
            nan = torch.zeros(out.shape, dtype=torch.bool)
            nan[5, :] = nan[:, 4] = True  # the NaN blocks' row and column, nothing else
            assert torch.equal(out.isnan().cpu(), nan)


def check_exact_integers(device, out_dtype: torch.dtype) -> None:
    for elems in [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e2m1", "e2m1")]:
        a, b = _operands(200, 136, 1024, elems, "floor", device, seed=7, ints=True)
        assert_exact(mx_mm_triton(a, b, out_dtype), a, b, f"integers {elems} {out_dtype}")


def check_strided(device) -> None:
    """Operands that are views: the first 96 elements of K of wider tensors (rows strided wider
    than they are long), and a column-major copy (K strided)."""
    for elem in ("e4m3", "e2m1"):
        wide_a = _to(to_mx(_data(64, 256, seed=8), elem), device)
        wide_b = _to(to_mx(_data(48, 256, seed=9), elem), device)
        cut = 96 // (2 if elem == "e2m1" else 1)  # bytes of 96 elements
        a = MXTensor(wide_a.qdata[:, :cut], wide_a.scale[:, :3], elem, 1)
        b = MXTensor(wide_b.qdata[:, :cut], wide_b.scale[:, :3], elem, 1)
        assert not a.qdata.is_contiguous() and not b.scale.is_contiguous()
        assert_matches_emulated(mx_mm_triton(a, b, torch.float32), a, b, f"strided {elem}")
        col_major = MXTensor(a.qdata.t().contiguous().t(), a.scale.t().contiguous().t(), elem, 1)
        assert col_major.qdata.stride() == (1, 64)
        assert_matches_emulated(mx_mm_triton(col_major, b, torch.float32), col_major, b, f"column-major {elem}")


def check_linear_orientations(device, out_dtype: torch.dtype) -> None:
    """The three GEMMs of an MX linear from the casts MXLinear uses (plain scales): forward
    x @ w.T (dim0, dim0), grad input g @ w (dim0, dim1), grad weight g.T @ x (dim1, dim1)."""
    x, w, g = (_data(*shape, seed=i).to(device) for i, shape in enumerate([(96, 160), (64, 160), (96, 64)]))
    for elem in ("e4m3", "e2m1"):
        for a, b in [
            (cast_dim0(x, elem), cast_dim0(w, elem)),
            (cast_dim0(g, elem), cast_dim1(w, elem)),
            (cast_dim1(g, elem), cast_dim1(x, elem)),
        ]:
            assert_matches_emulated(mx_mm_triton(a, b, out_dtype), a, b, f"linear {elem} {tuple(a.shape)}")


# ---------------------------------------------------------------------------------------
# CPU, this process


def backend_of(name: str, device: torch.device, grouped: bool = False, **overrides) -> str:
    return resolve_backend(MXRecipe.from_name(name, **overrides), device, grouped).name


def test_resolve_triton_on_cpu_names_the_device():
    assert not triton_available(CPU)
    with pytest.raises(ValueError, match=r"'triton' needs .*compute capability 8\.9.*cpu is not an NVIDIA CUDA device"):
        backend_of("mxfp8", CPU, backend="triton")
    a, b = to_mx(_data(32, 64, seed=1)), to_mx(_data(16, 64, seed=2))
    with pytest.raises(ValueError, match="'triton' needs"):
        mx_mm(a, b, torch.float32, "triton")


@pytest.mark.parametrize("capability", [(7, 0), (8, 0), (8, 6)])
def test_resolve_triton_too_old(pretend_gpu, capability):
    pretend_gpu(capability)
    sm = f"sm_{capability[0]}{capability[1]}"
    with pytest.raises(ValueError, match=rf"cuda:0 has compute capability .*\({sm}\)"):
        backend_of("mxfp8", CUDA, backend="triton")


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0), (12, 0)])
def test_resolve_triton_forced(pretend_gpu, capability):
    pretend_gpu(capability)
    assert triton_available(CUDA)
    assert type(resolve_backend(MXRecipe.from_name("mxfp8", backend="triton"), CUDA)) is mx_backends.TritonBackend
    # auto never picks triton: cublas on sm_100 and later, emulated below (gemm._resolve_name says why)
    assert backend_of("mxfp8", CUDA) == ("cublas" if capability >= (10, 0) else "emulated")


def test_resolve_triton_not_importable(pretend_gpu, monkeypatch):
    pretend_gpu((9, 0))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"triton is not importable \(cuda:0 has compute capability 9\.0"):
        backend_of("mxfp8", CUDA, backend="triton")


def test_resolve_backend_triton(pretend_gpu):
    pretend_gpu((9, 0))
    for name in ("mxfp8", "mxfp8_rceil", "mxfp8_wgrad_bf16", "mxfp8_e5m2_grads", "mxfp4"):
        assert backend_of(name, CUDA, backend="triton") == "triton"
    assert backend_of("mxfp4", CUDA) == "emulated"
    with pytest.raises(ValueError, match=r"'mxfp8' cannot use backend 'triton'.*no MoE grouped GEMM"):
        backend_of("mxfp8", CUDA, grouped=True, backend="triton")


def test_recipe_accepts_triton():
    from mx_recipe.formats.recipe import BACKENDS

    assert "triton" in BACKENDS
    assert MXRecipe(backend="triton").backend == "triton"


def _mx(rows: int, k: int, elem: str = "e4m3", seed: int = 0) -> MXTensor:
    return to_mx(_data(rows, k, seed), elem)


def test_mx_mm_triton_argument_errors():
    a, b = _mx(64, 96), _mx(32, 96, seed=1)
    with pytest.raises(TypeError, match="MXTensor with plain scales"):
        mx_mm_triton(cast_dim0(_data(64, 96, 0), blocked_scales=True), b, torch.float32)
    with pytest.raises(ValueError, match="quantized along its last dim"):
        mx_mm_triton(to_mx(_data(64, 96, 0), dim=0), b, torch.float32)
    with pytest.raises(ValueError, match="must be 2D"):
        mx_mm_triton(to_mx(_data(64, 96, 0).view(2, 32, 96)), b, torch.float32)
    with pytest.raises(ValueError, match="K differs"):
        mx_mm_triton(a, _mx(32, 64), torch.float32)
    with pytest.raises(ValueError, match="K differs"):
        mx_mm_triton(_mx(64, 64, "e2m1"), _mx(32, 128), torch.float32)  # same bytes per row, different K
    with pytest.raises(ValueError, match="out_dtype"):
        mx_mm_triton(a, b, torch.float8_e4m3fn)
    odd = MXTensor(a.qdata, a.scale, "e3m2", 1)
    with pytest.raises(ValueError, match="element format 'e3m2'"):
        mx_mm_triton(odd, b, torch.float32)


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="needs triton, outside the interpreter")
def test_launcher_argument_errors():
    from mx_kernels.mx.gemm import mx_gemm

    a, b = _mx(64, 96), _mx(32, 96, seed=1)
    f32 = torch.float32
    with pytest.raises(TypeError, match="a_q for e5m2 must be torch.float8_e5m2"):
        mx_gemm(a.qdata, a.scale, "e5m2", b.qdata, b.scale, "e4m3", f32)
    with pytest.raises(TypeError, match="b_q for e2m1 must be torch.uint8"):
        mx_gemm(a.qdata, a.scale, "e4m3", b.qdata, b.scale, "e2m1", f32)
    with pytest.raises(TypeError, match="a_scale must be float8_e8m0fnu"):
        mx_gemm(a.qdata, a.scale.float(), "e4m3", b.qdata, b.scale, "e4m3", f32)
    with pytest.raises(ValueError, match=r"scales \[rows, K/32\]"):
        mx_gemm(a.qdata, a.scale[:, :2], "e4m3", b.qdata, b.scale, "e4m3", f32)
    with pytest.raises(ValueError, match="K a multiple of 32"):
        mx_gemm(a.qdata[:, :48], a.scale[:, :1], "e4m3", b.qdata, b.scale, "e4m3", f32)
    with pytest.raises(ValueError, match="K differs"):
        mx_gemm(a.qdata[:, :64], a.scale[:, :2], "e4m3", b.qdata, b.scale, "e4m3", f32)
    with pytest.raises(ValueError, match="BLOCK_K must be a multiple of 64"):
        mx_gemm(a.qdata, a.scale, "e4m3", b.qdata, b.scale, "e4m3", f32, dict(BLOCK_K=32))
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        mx_gemm(a.qdata, a.scale, "e4m3", b.qdata, b.scale, "e4m3", f32)


def test_op_traces_fullgraph_without_running():
    """torch.compile(fullgraph=True) sees mx_mm_triton as one custom-op node (shape and dtype from
    its fake implementation); the backend stops before anything runs."""

    def f(aq, a_s, bq, b_s):
        out = mx_mm_triton(MXTensor(aq, a_s, "e4m3", 1), MXTensor(bq, b_s, "e2m1", 1), torch.bfloat16)
        assert out.shape == (64, 32) and out.dtype == torch.bfloat16
        return out * 2

    a, b = _mx(64, 96), _mx(32, 96, "e2m1", seed=1)
    ops = traced_ops(f, a.qdata, a.scale, b.qdata, b.scale, name="mx_gemm")
    assert len(ops) == 1, ops


@pytest.mark.skipif(not HAS_TRITON, reason="benchmarks/timing.py imports triton.testing")
def test_bench_gemm_rows_render(tmp_path):
    """benchmarks/bench_gemm.py's row for one small shape on the CPU (emulated only, a stand-in timer),
    with a made-up triton figure added, written as its --out file, rendered by perf_report.py."""
    from script_module import load_benchmark, load_script

    bench, report = load_benchmark("bench_gemm"), load_script("perf_report")
    row = bench.bench_shape(64, 96, 32, "e4m3", "floor", compiled=False, device=CPU, timer=lambda f: 0.5)
    assert set(row["mx"]) == {"emulated", "emulated_mm"}
    assert row["mx"]["emulated"]["rel_err"] < 2**-7 and row["mx"]["emulated_mm"]["ratio"] == 1.0
    other = bench.make_row(128, 64, 32, 0.5, {"emulated": (0.6, 0.0), "triton": (2.0, 1e-3)})
    meta = {"device": "NVIDIA H200", "torch": "2.11.0", "date": "2026-11-22T00:00:00", "commit": "0123456789abcdef"}
    path = tmp_path / "2026-11-22_h200_bench_gemm.json"
    data = {"meta": {**meta, "elem": "e4m3", "rule": "floor", "compiled": True}, "rows": [row, other]}
    path.write_text(json.dumps({**data, "backends": ["emulated", "emulated_mm", "triton"]}))
    text = "\n".join(report.gemm_section([path]))
    assert "| M x K x N | bf16 TFLOP/s | emulated (dequantize + mm) | emulated, mm alone | triton dot_scaled |" in text
    assert "| 64x96x32 | 0 | 1.00x | 1.00x | n/a |" in text
    assert "| 128x64x32 | 0 | 1.20x | n/a | 4.00x |" in text
    assert "Source: `docs/results/2026-11-22_h200_bench_gemm.json`: NVIDIA H200, torch 2.11.0" in text
    assert list(bench.BACKEND_TITLES) == list(report.GEMM_TITLES)


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="this is the parent of the interpreter run")
def test_kernel_in_triton_interpreter():
    """Run the test_interp_* tests in a child pytest with TRITON_INTERPRET=1 (see module doc)."""
    run_interpreter_tests(__file__)


# ---------------------------------------------------------------------------------------
# CPU, Triton interpreter (child process)

SMALL_TILES = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, GROUP_M=2, num_warps=4, num_stages=1)


@interp_only
def test_interp_pairs_small_tiles():
    """Several programs per dim, rows past M / N wrapping, GROUP_M ordering, K tails (96, 160)."""
    check_pairs_and_shapes("cpu", [(70, 40, 96), (33, 65, 160), (64, 96, 128)], SMALL_TILES)


@interp_only
def test_interp_pairs_default_tiles():
    check_pairs_and_shapes("cpu", [(1, 16, 32), (130, 200, 192)])


@interp_only
def test_interp_edges_integers_strides():
    check_edges("cpu")
    check_exact_integers("cpu", torch.float32)
    check_strided("cpu")


@interp_only
def test_interp_linear_orientations():
    check_linear_orientations("cpu", torch.float32)


@interp_only
def test_interp_empty_and_k_zero():
    a, b = _mx(0, 64), _mx(16, 64, seed=1)
    assert mx_mm_triton(a, b, torch.float32).shape == (0, 16)
    empty_k = MXTensor(
        torch.empty(8, 0, dtype=torch.float8_e4m3fn), torch.empty(8, 0, dtype=torch.float8_e8m0fnu), "e4m3", 1
    )
    assert torch.equal(mx_mm_triton(empty_k, empty_k, torch.float32), torch.zeros(8, 8))


# ---------------------------------------------------------------------------------------
# GPU

GPU_SHAPES = [(200, 96, 160), (129, 257, 512), (64, 64, 4096)]  # K tail; ragged M and N; long K


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", GPU_SHAPES)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("elems", ELEM_PAIRS, ids="x".join)
def test_gpu_matches_emulated(m, n, k, rule, elems):
    a, b = _operands(m, n, k, elems, rule, CUDA, seed=m + n + k)
    assert_matches_emulated(mx_mm_triton(a, b, torch.float32), a, b, f"{(m, n, k)} {elems} {rule}")
    assert torch.equal(mx_mm(a, b, torch.float32, "triton"), mx_mm_triton(a, b, torch.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("elems", [("e4m3", "e4m3"), ("e2m1", "e4m3")], ids="x".join)
def test_gpu_output_dtypes(elems, out_dtype):
    a, b = _operands(300, 136, 256, elems, "rceil", CUDA, seed=5)
    out = mx_mm_triton(a, b, out_dtype)
    assert out.dtype == out_dtype
    assert_matches_emulated(out, a, b, f"{elems} {out_dtype}")


@pytest.mark.gpu
def test_gpu_edges():
    check_edges(CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_exact_on_integer_data(out_dtype):
    check_exact_integers(CUDA, out_dtype)


@pytest.mark.gpu
def test_gpu_strided_operands():
    check_strided(CUDA)


@pytest.mark.gpu
def test_gpu_linear_orientations():
    """The cast kernels' outputs (fp8) and the reference casts (e2m1) on CUDA, as MXLinear feeds them."""
    check_linear_orientations(CUDA, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_under_torch_compile():
    a, b = _operands(256, 128, 512, ("e4m3", "e4m3"), "floor", CUDA, seed=6)

    def f(aq, a_s, bq, b_s):
        return mx_mm_triton(MXTensor(aq, a_s, "e4m3", 1), MXTensor(bq, b_s, "e4m3", 1), torch.bfloat16)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)(a.qdata, a.scale, b.qdata, b.scale)
    assert torch.equal(compiled, mx_mm_triton(a, b, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.sm100
@pytest.mark.parametrize("elems", ELEM_PAIRS, ids="x".join)
def test_sm100_native_matches_emulated(elems):
    """UNTESTED on hardware: the native tcgen05 block-scaled MMA path, same bound (fp32 accumulation
    in some order), its tiles from SM100_CONFIGS."""
    for m, n, k in GPU_SHAPES:
        a, b = _operands(m, n, k, elems, "rceil", CUDA, seed=m + k)
        assert_matches_emulated(mx_mm_triton(a, b, torch.float32), a, b, f"sm100 {(m, n, k)} {elems}")
    check_exact_integers(CUDA, torch.bfloat16)
