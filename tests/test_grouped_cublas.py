"""mx_grouped_mm's cublas path (sm_100): the MoE forward, grad-input and grad-weight GEMMs on
torch._scaled_grouped_mm, with fp8 casts, blocked scales and token groups padded to 32 rows on
the device.

On the CPU the real op is replaced by the layout-faithful emulator (tests/scaled_mm_emulator.py),
which reads the scales through the blocked layout the way the hardware does, given to a
``CublasBackend`` as tests/test_linear_cublas.py gives it for MXLinear. Against the
emulated backend (fake-quant casts + torch._grouped_mm in bf16), both multiply the same exact
dequantized products; they differ only in the sum: the emulator rounds the exact sum to fp32, the
emulated backend accumulates in fp32 in some order; then both round to bf16. Hence:

* where every fp32 partial sum is exact (block-scaled small integers), bit-identical;
* elsewhere, within the fp32 accumulation bound plus one bf16 rounding:
  |cublas - emulated| <= n * 2**-23 * (|A| @ |B|) + 2**-7 * max(|cublas|, |emulated|), n the
  contraction length. (On this file's data spread over 17 binades, 29 of 939,008 outputs differ,
  each by one bf16 ulp; with cancellation the difference can exceed an ulp, hence the bound.)
"""

from __future__ import annotations

import pytest
import torch
from scaled_mm_emulator import scaled_grouped_mm as emulated_scaled_grouped_mm

import mx_recipe.nn.grouped
import mx_recipe.ops.gemm
from mx_recipe import MXRecipe
from mx_recipe.nn.grouped import mx_grouped_mm
from mx_recipe.ops.backends import resolve_backend
from mx_recipe.ops.gemm import cublas_grouped_available
from mx_recipe.ops.mx_backends import CublasBackend

N, K = 96, 160  # K/32 = 5 scale columns: the blocked layout pads them to 8
# Token group sizes: ragged (not multiples of 32), empty first, in the middle and last, and aligned.
SIZES = [[40, 0, 60, 37], [0, 32, 1, 95], [17, 0, 0, 0], [0, 0, 0, 64], [64, 96, 0, 128]]
RECIPES = ["mxfp8", "mxfp8_rceil"]  # e4m3 everywhere; floor and rceil scales


pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors (conftest.py)


def _spread(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Normal data whose 32-element blocks span 17 binades, so that scale bytes differ block to block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    exps = torch.randint(-8, 9, (rows, -(-cols // 32)), generator=g).repeat_interleave(32, dim=1)[:, :cols]
    return (x * torch.exp2(exps.float())).to(torch.bfloat16)


def _block_scaled_ints(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Integers in [-8, 8] times 2**(a + b), a per 32-row block and b per 32-column block, both in
    {0, 1, 2}. Every 32-element block, along either dim and across group boundaries, holds values of
    at most 4 significant bits within 2**5 of its amax: e4m3 holds them exactly under either rule.
    Products are integers below 2**6 times 2**(0..8), so each GEMM's sums (at most a few hundred
    terms) stay integers below 2**24 times a common power of two: exact in fp32, in any order."""
    g = torch.Generator().manual_seed(seed)
    ints = torch.randint(-8, 9, (rows, cols), generator=g).float()
    a = torch.randint(0, 3, (-(-rows // 32),), generator=g).repeat_interleave(32)[:rows]
    b = torch.randint(0, 3, (-(-cols // 32),), generator=g).repeat_interleave(32)[:cols]
    return (ints * torch.exp2((a[:, None] + b[None, :]).float())).to(torch.bfloat16)


def _problem(sizes: list[int], make) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    m, e = sum(sizes), len(sizes)
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    return make(m, K, 1), make(e * N, K, 2).view(e, N, K), offs, make(m, N, 3)


def _run(recipe: MXRecipe, x, w, offs, g) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = mx_grouped_mm(x, w, offs, recipe)
    y.backward(g)
    return y.detach(), x.grad, w.grad


def _cublas_run(monkeypatch, recipe: MXRecipe, x, w, offs, g, op=emulated_scaled_grouped_mm):
    """``_run`` on the cublas path with ``op`` as torch._scaled_grouped_mm; also the op's calls
    (kind, rows of the token-group operand)."""
    calls = []

    def fake_op(a, b, scale_a, scale_b, offs, out_dtype=torch.bfloat16):
        calls.append(("2d-3d", a.shape[0]) if b.dim() == 3 else ("2d-2d", b.shape[0]))
        return op(a, b, scale_a, scale_b, offs, out_dtype)

    def forced(recipe, device, grouped=False):
        assert grouped, "the MoE grouped GEMM must resolve its backend with grouped=True"
        return CublasBackend(scaled_grouped_mm=fake_op)

    with monkeypatch.context() as m:
        m.setattr(mx_recipe.nn.grouped, "default_backend", forced)
        return _run(recipe, x, w, offs, g), calls


def _padded_rows(sizes: list[int]) -> int:
    """The static size of the padded token buffer: ceil32(M_total) + 32 * E, whatever the group sizes."""
    return -(-sum(sizes) // 32) * 32 + 32 * len(sizes)


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("sizes", SIZES, ids=str)
def test_cublas_path_is_bit_exact_where_sums_are_exact(monkeypatch, sizes, name):
    recipe = MXRecipe.from_name(name)
    x, w, offs, g = _problem(sizes, _block_scaled_ints)
    expected = _run(recipe, x, w, offs, g)
    got, calls = _cublas_run(monkeypatch, recipe, x, w, offs, g)
    # one op per MX GEMM, each on the static-size padded buffer (no host sync for its size)
    size = _padded_rows(sizes)
    assert calls == [("2d-3d", size), ("2d-3d", size), ("2d-2d", size)]
    for what, a, e in zip(("y", "gx", "gw"), got, expected, strict=True):
        assert a.dtype == e.dtype == torch.bfloat16 and a.shape == e.shape, what
        assert torch.equal(a, e), f"{what}: {(a != e).sum().item()} of {a.numel()} elements differ"
    for e, size in enumerate(sizes):
        if size == 0:
            assert torch.count_nonzero(got[2][e]) == 0  # an empty expert gets a zero gradient


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("sizes", SIZES, ids=str)
def test_cublas_path_matches_emulated_up_to_summation_order(monkeypatch, sizes, name):
    recipe = MXRecipe.from_name(name)
    x, w, offs, g = _problem(sizes, _spread)
    expected = _run(recipe, x, w, offs, g)
    got, _ = _cublas_run(monkeypatch, recipe, x, w, offs, g)
    # |A| @ |B| of the dequantized operands: the emulated path on |x|, |w|, |g| (quantizing commutes with abs)
    magnitude = _run(recipe, x.abs(), w.abs(), offs, g.abs())
    lengths = (K, N, max(sizes))  # contraction length of y, gx, gw
    for what, a, e, mag, n in zip(("y", "gx", "gw"), got, expected, magnitude, lengths, strict=True):
        a, e = a.double(), e.double()
        bound = n * 2.0**-23 * mag.double() + 2.0**-7 * torch.maximum(a.abs(), e.abs())
        excess = (a - e).abs() - bound
        assert (excess <= 0).all(), f"{what}: off by up to {excess.max().item()} beyond the bound"


def test_cublas_path_with_grad_weight_in_bf16(monkeypatch):
    """mxfp8_wgrad_bf16: two MX GEMMs on the op; grad weight as in the emulated path, bit for bit."""
    recipe = MXRecipe.from_name("mxfp8_wgrad_bf16")
    sizes = [40, 0, 60, 37]
    x, w, offs, g = _problem(sizes, _block_scaled_ints)
    expected = _run(recipe, x, w, offs, g)
    got, calls = _cublas_run(monkeypatch, recipe, x, w, offs, g)
    assert [kind for kind, _ in calls] == ["2d-3d", "2d-3d"]
    for what, a, e in zip(("y", "gx", "gw"), got, expected, strict=True):
        assert torch.equal(a, e), what


def test_cublas_path_fp32_activations(monkeypatch):
    """The op writes bf16 only: fp32 inputs get fp32 results that carry one bf16 rounding."""
    recipe = MXRecipe.from_name("mxfp8")
    x, w, offs, g = (t.float() if t.is_floating_point() else t for t in _problem([17, 0, 0, 95], _spread))
    expected = _run(recipe, x, w, offs, g)
    got, _ = _cublas_run(monkeypatch, recipe, x, w, offs, g)
    for what, a, e in zip(("y", "gx", "gw"), got, expected, strict=True):
        assert a.dtype == torch.float32, what
        torch.testing.assert_close(a, e, rtol=2**-7, atol=1e-3 * e.abs().max().item(), msg=what)


# --- startup errors ---


@pytest.mark.parametrize(
    "backend, match",
    [
        ("cublas", r"backend 'cublas' needs .*compute capability 10\.0.*cpu is not an NVIDIA CUDA"),
        ("triton", r"backend 'triton' needs .*cpu is not an NVIDIA CUDA"),
    ],
)
def test_forced_backend_off_sm100_is_a_clear_error(backend, match):
    recipe = MXRecipe.from_name("mxfp8", backend=backend)
    x, w, offs, _ = _problem([40, 0, 60, 37], _spread)
    with pytest.raises(ValueError, match=match):
        mx_grouped_mm(x, w, offs, recipe)


def test_forced_cublas_on_hopper_names_the_device(pretend_gpu):
    pretend_gpu((9, 0))
    recipe = MXRecipe.from_name("mxfp8", backend="cublas")
    with pytest.raises(ValueError, match=r"'cublas' needs .*cuda:0 has compute capability 9\.0 \(sm_90\)"):
        resolve_backend(recipe, torch.device("cuda", 0), grouped=True)
    assert resolve_backend(MXRecipe.from_name("mxfp8"), torch.device("cuda", 0), grouped=True).name == "emulated"


# --- on the GPU ---


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", SIZES[:2], ids=str)
def test_cublas_path_on_cuda_matches_cpu(monkeypatch, sizes):
    """The Triton cast kernels (blocked scales written by the kernels, the per-group cast with its
    tail group) feeding the emulator on CUDA: the CPU answers bit for bit. The emulator sums exactly
    in fp64 (these products span few enough binades), so the device's order cannot show."""
    recipe = MXRecipe.from_name("mxfp8")
    x, w, offs, g = _problem(sizes, _spread)
    cpu, _ = _cublas_run(monkeypatch, recipe, x, w, offs, g)
    cuda, _ = _cublas_run(monkeypatch, recipe, x.cuda(), w.cuda(), offs.cuda(), g.cuda())
    for what, c, d in zip(("y", "gx", "gw"), cpu, cuda, strict=True):
        assert d.is_cuda and torch.equal(d.cpu(), c), what


@pytest.mark.gpu
@pytest.mark.sm100
@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("sizes", SIZES, ids=str)
def test_real_op_matches_emulator(monkeypatch, sizes, name):
    """The real torch._scaled_grouped_mm against the emulator, both through mx_grouped_mm's cublas
    path (the backend resolved for real): bit-exact on block-scaled integers, whose fp32 sums are
    exact in any order; elsewhere within the fp32 accumulation bound plus one bf16 rounding."""
    if not cublas_grouped_available(torch.device("cuda")):
        pytest.skip("this torch build has no MXFP8 torch._scaled_grouped_mm (needs MSLK / FBGEMM GenAI)")
    recipe = MXRecipe.from_name(name, backend="cublas")
    x, w, offs, g = (t.cuda() for t in _problem(sizes, _block_scaled_ints))
    real = _run(recipe, x, w, offs, g)
    with monkeypatch.context() as m:
        m.setattr(mx_recipe.ops.gemm, "_torch_scaled_grouped_mm", emulated_scaled_grouped_mm)
        emulated = _run(recipe, x, w, offs, g)
    for what, r, e in zip(("y", "gx", "gw"), real, emulated, strict=True):
        assert torch.equal(r, e), f"{what} (integer data): {(r != e).sum().item()} elements differ"

    x, w, offs, g = (t.cuda() for t in _problem(sizes, _spread))
    real = _run(recipe, x, w, offs, g)
    with monkeypatch.context() as m:
        m.setattr(mx_recipe.ops.gemm, "_torch_scaled_grouped_mm", emulated_scaled_grouped_mm)
        emulated = _run(recipe, x, w, offs, g)
        magnitude = _run(recipe, x.abs(), w.abs(), offs, g.abs())  # |A| @ |B|, exact sums rounded once
    for what, r, e, mag, n in zip(("y", "gx", "gw"), real, emulated, magnitude, (K, N, max(sizes)), strict=True):
        r, e = r.double(), e.double()
        bound = n * 2.0**-23 * mag.double() + 2.0**-7 * torch.maximum(r.abs(), e.abs())
        assert ((r - e).abs() <= bound).all(), what
