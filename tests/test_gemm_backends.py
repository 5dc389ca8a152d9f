"""GEMM backends on CPU: the cublas path's argument preparation, checked through the sm_100 emulator.

* the emulator's blocked-scale reader against scale_layout.to_blocked (two independent codings
  of the docs/DESIGN.md, Scale layout, formula);
* our casts -> torch._scaled_mm arguments -> emulator, against a direct dequantize-and-matmul
  in fp64 (``to_mx(...).dequantize()``), bit for bit: ragged M and N (scale padding), K a multiple
  of 32 but not of 128, both scale rules, e4m3 and e5m2, the three GEMM orientations of a linear;
* the grouped GEMMs of MoE (2d-3d forward and grad input, 2d-2d grad weight) the same way;
* wrong layouts: rejected where the sizes tell, wrong answers (that these tests see) where not;
* backend resolution and its startup errors.
"""

from __future__ import annotations

import pytest
import scaled_mm_emulator as emu
import torch

from mx_recipe.formats.mx import MXTensor, to_mx
from mx_recipe.formats.recipe import MXRecipe
from mx_recipe.formats.scale_layout import blocked_byte_offset, blocked_numel, to_blocked
from mx_recipe.ops import gemm, mx_backends
from mx_recipe.ops.backends import resolve_backend
from mx_recipe.ops.gemm import (
    blocked_row_groups,
    mx_grouped_mm_2d_2d,
    mx_grouped_mm_2d_3d,
    mx_mm,
    mx_mm_blocked,
    mx_scaled_mm,
)
from mx_recipe.ops.mx_cast import cast_3d_dim0, cast_3d_dim1, cast_dim0, cast_dim1, cast_groups_dim1

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors (conftest.py)


def _data(rows: int, cols: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Normal data whose 32-element blocks span many binades, so that every scale byte differs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    exps = torch.randint(-20, 21, (rows, -(-cols // 32)), generator=g).repeat_interleave(32, dim=1)[:, :cols]
    return (x * torch.exp2(exps.float())).to(dtype)


def _ref(a: MXTensor, b: MXTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The direct route: dequantize both, matmul in fp64, round to fp32 (the accumulator), then out_dtype."""
    return (a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()).to(torch.float32).to(out_dtype)


def _assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


# --- the blocked-scale reader ---


@pytest.mark.parametrize("rows, cols", [(1, 1), (65, 3), (128, 4), (200, 7), (300, 9)])
def test_blocked_reader_matches_to_blocked(rows, cols):
    scale = torch.randint(0, 256, (rows, cols), dtype=torch.uint8)
    blocked = to_blocked(scale)
    assert torch.equal(emu.read_blocked_scales(blocked, rows, cols), scale)
    index = emu.blocked_byte_index(rows, cols)
    for r, c in [(0, 0), (rows - 1, cols - 1), (rows // 2, cols // 2), (min(rows - 1, 33), 0)]:
        assert index[r, c].item() == blocked_byte_offset(r, c, cols)


# --- dense: cast outputs -> _scaled_mm arguments -> emulator ---

SHAPES = [(1, 16, 32), (65, 48, 96), (200, 112, 160), (130, 272, 224), (256, 128, 512)]  # (M, N, K)
ELEM_PAIRS = [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e5m2", "e5m2")]


@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("elems", ELEM_PAIRS)
def test_forward_gemm_matches_dequantize_and_matmul(m, n, k, rule, elems):
    """y = x @ w.T: x [M, K] and w [N, K], both cast along K (cast_dim0)."""
    x, w = _data(m, k, seed=m + k), _data(n, k, seed=n * 7 + k)
    a, b = cast_dim0(x, elems[0], rule, blocked_scales=True), cast_dim0(w, elems[1], rule, blocked_scales=True)
    out = mx_mm_blocked(a, b, torch.bfloat16, scaled_mm=emu.scaled_mm)
    _assert_same(out, _ref(to_mx(x, elems[0], rule), to_mx(w, elems[1], rule), torch.bfloat16))


@pytest.mark.parametrize("m, n, k", [(65, 64, 48), (200, 96, 112), (130, 160, 272)])
@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("elems", ELEM_PAIRS)
def test_grad_input_gemm_matches(m, n, k, rule, elems):
    """gx = g @ w: g [M, N] along N (dim0), w [N, K] along N (dim1, stored as the MX form of w.T)."""
    g, w = _data(m, n, seed=3 * m + n), _data(n, k, seed=n + 5 * k)
    a, b = cast_dim0(g, elems[0], rule, blocked_scales=True), cast_dim1(w, elems[1], rule, blocked_scales=True)
    out = mx_mm_blocked(a, b, torch.float32, scaled_mm=emu.scaled_mm)
    expected = _ref(to_mx(g, elems[0], rule), to_mx(w.t().contiguous(), elems[1], rule), torch.float32)
    _assert_same(out, expected)


@pytest.mark.parametrize("m, n, k", [(64, 48, 96), (160, 112, 32), (256, 16, 224)])
@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("elems", ELEM_PAIRS)
def test_grad_weight_gemm_matches(m, n, k, rule, elems):
    """gw = g.T @ x: g [M, N] and x [M, K] both along M (dim1); the GEMM's ragged M is N here."""
    g, x = _data(m, n, seed=m + 11 * n), _data(m, k, seed=m + 13 * k)
    a, b = cast_dim1(g, elems[0], rule, blocked_scales=True), cast_dim1(x, elems[1], rule, blocked_scales=True)
    out = mx_mm_blocked(a, b, torch.bfloat16, scaled_mm=emu.scaled_mm)
    expected = _ref(to_mx(g.t().contiguous(), elems[0], rule), to_mx(x.t().contiguous(), elems[1], rule), out.dtype)
    _assert_same(out, expected)


def _exact_dequantize(mx: MXTensor) -> torch.Tensor:
    """fp64 element * 2**e with no fp32 step (MXTensor.dequantize overflows fp32 for e = 127 blocks)."""
    biased = mx.scale.view(torch.uint8).to(torch.float64)
    factor = torch.where(biased == 255, torch.nan, torch.exp2(biased - 127)).repeat_interleave(32, dim=-1)
    return mx.qdata.to(torch.float64) * factor


@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_edge_blocks(rule, elem, out_dtype):
    """Zero, NaN, Inf, huge and tiny blocks, in rows that cross the 128-row tile boundary."""
    x, w = _data(160, 128, seed=1, dtype=torch.float32), _data(48, 128, seed=2, dtype=torch.float32)
    x[3, :32] = 0.0
    x[5, 32:64] = float("nan")
    x[130, 64:96] = float("inf")
    x[131, 96:] = 2.0**120
    x[140, :32] *= 2.0**-120
    w[7, 32:64] = 0.0
    w[9, 96:] = -(2.0**-126)
    a, b = cast_dim0(x, elem, rule, blocked_scales=True), cast_dim0(w, elem, rule, blocked_scales=True)
    out = mx_mm_blocked(a, b, out_dtype, scaled_mm=emu.scaled_mm)
    xa, wb = to_mx(x, elem, rule), to_mx(w, elem, rule)
    expected = (_exact_dequantize(xa) @ _exact_dequantize(wb).t()).to(torch.float32).to(out_dtype)
    _assert_same(out, expected)
    assert out[5].isnan().all() and not out[4].isnan().any()


# --- wrong layouts and arguments ---


def _aligned_operands(seed: int = 0):
    """M = N = 256 and K = 512: 2x4 tiles of scales, every byte different, so any misread shows."""
    x, w = _data(256, 512, seed=seed), _data(256, 512, seed=seed + 1)
    return to_mx(x), to_mx(w)


def _tile_col_major(scale: torch.Tensor) -> torch.Tensor:
    """The blocked bytes with tiles in column-major tile order: a plausible, wrong, layout."""
    rows, cols = scale.shape
    tiles = to_blocked(scale).view(rows // 128, cols // 4, 512)
    return tiles.transpose(0, 1).contiguous().view(-1)


def _tile_inner_transposed(scale: torch.Tensor) -> torch.Tensor:
    """Inside each tile (r % 32, r // 32) swapped: byte (r // 32) * 128 + (r % 32) * 4 + c."""
    rows, cols = scale.shape
    tiles = to_blocked(scale).view(rows // 128, cols // 4, 32, 4, 4)
    return tiles.permute(0, 1, 3, 2, 4).contiguous().view(-1)


@pytest.mark.parametrize(
    "layout",
    [
        lambda s: s.contiguous().view(-1),  # plain row-major scales: same size when M % 128 == 0, cols % 4 == 0
        lambda s: s.t().contiguous().view(-1),
        _tile_col_major,
        _tile_inner_transposed,
    ],
    ids=["plain", "plain_transposed", "tile_col_major", "tile_inner_transposed"],
)
def test_wrong_layout_of_the_same_size_gives_wrong_answers(layout):
    a, b = _aligned_operands()
    expected = _ref(a, b, torch.float32)
    right = mx_scaled_mm(a.qdata, to_blocked(a.scale), b.qdata, to_blocked(b.scale), torch.float32, emu.scaled_mm)
    _assert_same(right, expected)
    wrong = mx_scaled_mm(a.qdata, layout(a.scale), b.qdata, to_blocked(b.scale), torch.float32, emu.scaled_mm)
    assert (wrong != expected).float().mean() > 0.5
    wrong_b = mx_scaled_mm(a.qdata, to_blocked(a.scale), b.qdata, layout(b.scale), torch.float32, emu.scaled_mm)
    assert (wrong_b != expected).float().mean() > 0.5


def _dense_args(m: int = 65, n: int = 48, k: int = 96):
    a, b = to_mx(_data(m, k, seed=3)), to_mx(_data(n, k, seed=4))
    return a.qdata, b.qdata.t(), to_blocked(a.scale), to_blocked(b.scale)


def _bad_dense_calls():
    qa, qb, sa, sb = _dense_args()
    bf16 = torch.bfloat16
    return [
        ("plain scales", (qa, qb, to_mx(_data(65, 96, seed=3)).scale, sb, bf16), "scale_a has 195 elements.*needs 512"),
        ("b row-major", (qa, qb.contiguous(), sa, sb, bf16), "b must be column-major"),
        ("b not transposed", (qa, qb.t(), sa, sb, bf16), "do not share K"),
        ("a column-major", (qa.t().contiguous().t(), qb, sa, sb, bf16), "a must be row-major"),
        ("bf16 operand", (qa.to(bf16), qb, sa, sb, bf16), "float8_e4m3fn or float8_e5m2"),
        ("uint8 scales", (qa, qb, sa.view(torch.uint8), sb, bf16), "scale_a must be float8_e8m0fnu"),
        ("fp32 scales", (qa, qb, sa, torch.ones(512), bf16), "scale_b must be float8_e8m0fnu"),
        ("fp8 output", (qa, qb, sa, sb, torch.float8_e4m3fn), "out_dtype"),
        ("3D operand", (qa[None], qb, sa, sb, bf16), "must be 2D"),
        ("non-contiguous scale", (qa, qb, torch.cat([sa, sa]).view(-1, 2)[:, 0], sb, bf16), "must be contiguous"),
        ("scale_b for K/32 unpadded", (qa, qb, sa, sb[: 128 * 3], bf16), "scale_b has 384 elements.*needs 512"),
    ]


@pytest.mark.parametrize("case", _bad_dense_calls(), ids=lambda c: c[0])
def test_emulator_rejects_what_the_op_rejects(case):
    _, args, match = case
    with pytest.raises((ValueError, TypeError), match=match):
        emu.scaled_mm(*args)


def test_emulator_rejects_k_and_n_not_multiples_of_16():
    a = torch.zeros(32, 40, dtype=torch.float8_e4m3fn)
    b = torch.zeros(24, 40, dtype=torch.float8_e4m3fn).t()
    sa = torch.zeros(emu.blocked_scale_count(32, 40), dtype=torch.float8_e8m0fnu)
    sb = torch.zeros(emu.blocked_scale_count(24, 40), dtype=torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match="multiples of 16"):
        emu.scaled_mm(a, b, sa, sb, torch.bfloat16)


def test_mx_mm_blocked_rejects_plain_and_fp4_operands():
    x = _data(64, 64, seed=5)
    plain = cast_dim0(x)
    with pytest.raises(TypeError, match="BlockedMXTensor"):
        mx_mm_blocked(plain, cast_dim0(x, blocked_scales=True), torch.bfloat16, emu.scaled_mm)
    fp4 = cast_dim0(x, blocked_scales=True)
    fp4.elem = "e2m1"
    with pytest.raises(ValueError, match="fp8 MX elements"):
        mx_mm_blocked(fp4, cast_dim0(x, blocked_scales=True), torch.bfloat16, emu.scaled_mm)


# --- grouped (MoE) ---

OFFS_CASES = [[64, 64, 160], [32, 96, 288], [128, 256, 416], [0, 0, 96]]  # an empty group, ragged, 128-aligned


@pytest.mark.parametrize("offs", OFFS_CASES, ids=str)
@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_grouped_forward_2d_3d(offs, rule):
    """MoE forward: x [M_total, K] along K per token group, w [E, N, K] along K per expert."""
    m_total, n, k = offs[-1], 48, 96
    x, w = _data(m_total, k, seed=6), _data(3 * n, k, seed=7).view(3, n, k)
    offs_t = torch.tensor(offs, dtype=torch.int32)
    out = mx_grouped_mm_2d_3d(
        cast_dim0(x, "e4m3", rule),
        cast_3d_dim0(w, "e4m3", rule, blocked_scales=True),
        offs_t,
        scaled_grouped_mm=emu.scaled_grouped_mm,
    )
    xd, wd = to_mx(x, "e4m3", rule).dequantize(torch.float64), to_mx(w, "e4m3", rule).dequantize(torch.float64)
    expected, start = torch.zeros(m_total, n, dtype=torch.float64), 0
    for e, end in enumerate(offs):
        expected[start:end] = xd[start:end] @ wd[e].t()
        start = end
    _assert_same(out, expected.to(torch.float32).to(torch.bfloat16))


@pytest.mark.parametrize("offs", OFFS_CASES[:2], ids=str)
def test_grouped_grad_input_2d_3d(offs):
    """MoE grad input: g [M_total, N] along N, each w[e] [N, K] along N (the 3D dim1 cast, [E, K, N])."""
    m_total, n, k = offs[-1], 64, 80
    g, w = _data(m_total, n, seed=8), _data(3 * n, k, seed=9).view(3, n, k)
    offs_t = torch.tensor(offs, dtype=torch.int32)
    out = mx_grouped_mm_2d_3d(
        cast_dim0(g), cast_3d_dim1(w, blocked_scales=True), offs_t, scaled_grouped_mm=emu.scaled_grouped_mm
    )
    gd = to_mx(g).dequantize(torch.float64)
    wd = to_mx(w.transpose(-2, -1).contiguous()).dequantize(torch.float64)  # [E, K, N]
    expected, start = torch.zeros(m_total, k, dtype=torch.float64), 0
    for e, end in enumerate(offs):
        expected[start:end] = gd[start:end] @ wd[e].t()
        start = end
    _assert_same(out, expected.to(torch.float32).to(torch.bfloat16))


@pytest.mark.parametrize("offs", OFFS_CASES, ids=str)
@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_grouped_grad_weight_2d_2d(offs, rule):
    """MoE grad weight: per expert g_e.T @ x_e, g and x along M inside each token group -> [E, N, K]."""
    m_total, n, k = offs[-1], 48, 160
    g, x = _data(m_total, n, seed=10), _data(m_total, k, seed=11)
    offs_t = torch.tensor(offs, dtype=torch.int32)
    a = cast_groups_dim1(g, offs_t, "e4m3", rule, blocked_scales=True)
    b = cast_groups_dim1(x, offs_t, "e4m3", rule, blocked_scales=True)
    out = mx_grouped_mm_2d_2d(a, b, scaled_grouped_mm=emu.scaled_grouped_mm)
    gd = to_mx(g.t().contiguous(), "e4m3", rule).dequantize(torch.float64)  # [N, M]
    xd = to_mx(x.t().contiguous(), "e4m3", rule).dequantize(torch.float64)  # [K, M]
    expected, start = torch.zeros(len(offs), n, k, dtype=torch.float64), 0
    for e, end in enumerate(offs):
        expected[e] = gd[:, start:end] @ xd[:, start:end].t()
        start = end
    _assert_same(out, expected.to(torch.float32).to(torch.bfloat16))


@pytest.mark.parametrize("offs", OFFS_CASES, ids=str)
def test_blocked_row_groups_is_per_group_to_blocked(offs):
    """Each token group's scales blocked on their own, group after group (pytorch's 2d-3d test layout)."""
    cols = 5
    scale = torch.randint(0, 256, (offs[-1], cols), dtype=torch.uint8)
    out = blocked_row_groups(scale, torch.tensor(offs, dtype=torch.int32))
    assert out.shape == (offs[-1] + 128 * len(offs), 8)
    parts, start = [], 0
    for end in offs:
        if end > start:
            parts.append(to_blocked(scale[start:end]))
        start = end
    expected = torch.cat(parts)
    flat = out.reshape(-1)
    assert torch.equal(flat[: expected.numel()], expected)
    assert not flat[expected.numel() :].any()


def test_whole_matrix_blocked_scales_are_wrong_for_ragged_token_groups():
    """cast_dim0(..., blocked_scales=True) blocks all M_total rows as one matrix: right only when every
    token group is a multiple of 128 rows. The emulator shows the difference."""
    offs, n, k = [32, 96, 288], 48, 128
    x, w = _data(288, k, seed=12), _data(3 * n, k, seed=13).view(3, n, k)
    offs_t = torch.tensor(offs, dtype=torch.int32)
    w_b = cast_3d_dim0(w, blocked_scales=True)
    right = mx_grouped_mm_2d_3d(cast_dim0(x), w_b, offs_t, scaled_grouped_mm=emu.scaled_grouped_mm)
    qa, qb = cast_dim0(x).qdata, w_b.qdata.transpose(-2, -1)
    whole = cast_dim0(x, blocked_scales=True).scale.view(-1, 4)  # [384, 4]: too few bytes for 3 padded groups
    with pytest.raises(ValueError, match="need 2048 bytes, the buffer has 1536"):
        emu.scaled_grouped_mm(qa, qb, whole, w_b.scale, offs_t)
    padded = torch.cat([whole.view(torch.uint8), whole.new_zeros(256, 4).view(torch.uint8)]).view(whole.dtype)
    wrong = emu.scaled_grouped_mm(qa, qb, padded, w_b.scale, offs_t)
    assert (wrong != right).float().mean() > 0.5


def _grouped_args():
    offs = torch.tensor([32, 96], dtype=torch.int32)
    x, w = _data(96, 64, seed=14), _data(96, 64, seed=15).view(2, 48, 64)
    a = cast_dim0(x)
    w_b = cast_3d_dim0(w, blocked_scales=True)
    return a.qdata, w_b.qdata.transpose(-2, -1), blocked_row_groups(a.scale, offs), w_b.scale, offs


def _bad_grouped_calls():
    qa, qb, sa, sb, offs = _grouped_args()
    return [
        ("e5m2 operand", (qa.to(torch.float8_e5m2), qb, sa, sb, offs), {}, "float8_e4m3fn operands"),
        ("fp32 output", (qa, qb, sa, sb, offs), {"out_dtype": torch.float32}, "only bf16"),
        ("int64 offs", (qa, qb, sa, sb, offs.long()), {}, "int32"),
        ("groups not multiples of 32", (qa, qb, sa, sb, torch.tensor([40, 96], dtype=torch.int32)), {}, "multiple"),
        ("offs past M_total", (qa, qb, sa, sb, torch.tensor([32, 128], dtype=torch.int32)), {}, "past"),
        ("one group end for two experts", (qa, qb, sa, sb, offs[1:]), {}, "1 group ends for 2 groups"),
        ("b row-major", (qa, qb.contiguous(), sa, sb, offs), {}, "column-major"),
        ("scale_b unblocked", (qa, qb, sa, sb[:, :96], offs), {}, "needs scale_b of shape"),
        ("scale_a 1D", (qa, qb, sa.reshape(-1), sb, offs), {}, "2D"),
        ("scale_a too few rows", (qa, qb, sa[:64], sb, offs), {}, "at least 96 rows"),
        ("scale_a too small for the groups", (qa, qb, sa[:96], sb, offs), {}, "need .* bytes"),
        ("uint8 scales", (qa, qb, sa.view(torch.uint8), sb, offs), {}, "float8_e8m0fnu"),
    ]


@pytest.mark.parametrize("case", _bad_grouped_calls(), ids=lambda c: c[0])
def test_grouped_emulator_rejects(case):
    _, args, kwargs, match = case
    with pytest.raises((ValueError, TypeError), match=match):
        emu.scaled_grouped_mm(*args, **kwargs)


# --- backend resolution ---


@pytest.fixture
def fake_gpu(pretend_gpu, monkeypatch):
    """Pretend cuda:0 has a given compute capability (and, optionally, the grouped MXFP8 build)."""

    def install(capability: tuple[int, int], grouped_build: bool = True) -> None:
        pretend_gpu(capability)
        monkeypatch.setattr(gemm, "cublas_grouped_available", lambda d: grouped_build and capability[0] == 10)

    return install


def backend_of(name: str, device: torch.device, grouped: bool = False, **overrides) -> str:
    return resolve_backend(MXRecipe.from_name(name, **overrides), device, grouped).name


def test_resolve_on_cpu():
    assert backend_of("mxfp8", CPU, backend="emulated") == "emulated"
    assert backend_of("mxfp8", CPU) == "emulated"
    assert type(resolve_backend(MXRecipe.from_name("mxfp8"), CPU)) is mx_backends.EmulatedBackend
    with pytest.raises(ValueError, match=r"'cublas' needs .*compute capability 10\.0.*cpu is not an NVIDIA CUDA"):
        backend_of("mxfp8", CPU, backend="cublas")
    with pytest.raises(ValueError, match=r"'triton' needs .*cpu is not an NVIDIA CUDA"):  # tests/test_gemm_triton.py
        backend_of("mxfp8", CPU, backend="triton")
    with pytest.raises(ValueError, match="unknown MX GEMM backend 'tpu'"):
        mx_mm(to_mx(_data(32, 32, seed=1)), to_mx(_data(32, 32, seed=2)), torch.float32, "tpu")


def test_resolve_on_hopper_names_the_device(fake_gpu):
    fake_gpu((9, 0))
    assert backend_of("mxfp8", CUDA) == "emulated"
    with pytest.raises(ValueError, match=r"cuda:0 has compute capability 9\.0 \(sm_90\)"):
        backend_of("mxfp8", CUDA, backend="cublas")


@pytest.mark.parametrize("capability", [(10, 0), (10, 3), (12, 0)])
def test_resolve_on_blackwell(fake_gpu, capability):
    fake_gpu(capability)
    assert backend_of("mxfp8", CUDA) == "cublas"
    assert backend_of("mxfp8", CUDA, backend="cublas") == "cublas"
    assert type(resolve_backend(MXRecipe.from_name("mxfp8"), CUDA)) is mx_backends.CublasBackend


def test_resolve_backend_by_recipe(fake_gpu):
    fake_gpu((10, 0))
    forced = dict(backend="cublas")
    assert backend_of("mxfp8_wgrad_bf16", CUDA, **forced) == "cublas"
    assert backend_of("mxfp8_e5m2_grads", CUDA, **forced) == "cublas"  # dense, v1 op
    assert backend_of("mxfp8_e5m2_grads", CUDA) == "emulated"  # auto: e4m3 only
    assert backend_of("mxfp8", CUDA, grouped=True) == "cublas"
    assert backend_of("mxfp4", CUDA) == "emulated"
    with pytest.raises(ValueError, match=r"'mxfp4' cannot use backend 'cublas'.*e2m1"):
        backend_of("mxfp4", CUDA, **forced)
    with pytest.raises(ValueError, match="float8_e4m3fn operands only"):
        backend_of("mxfp8_e5m2_grads", CUDA, grouped=True, **forced)


def test_resolve_backend_grouped_needs_the_build(fake_gpu):
    """A torch without the grouped kernel: auto keeps a model with experts emulated, dense layers included."""
    fake_gpu((10, 0), grouped_build=False)
    assert backend_of("mxfp8", CUDA, grouped=True) == "emulated"
    assert backend_of("mxfp8", CUDA) == "cublas"
    with pytest.raises(ValueError, match="built with MSLK"):
        backend_of("mxfp8", CUDA, grouped=True, backend="cublas")


def test_recipe_backends():
    assert MXRecipe(backend="cublas").backend == "cublas"
    assert MXRecipe(backend="triton").backend == "triton"
    with pytest.raises(ValueError, match=r"MXRecipe\.backend='tpu'"):
        MXRecipe(backend="tpu")


def test_mx_mm_backends_on_cpu():
    a, b = to_mx(_data(64, 96, seed=16)), to_mx(_data(32, 96, seed=17))
    emulated = mx_mm(a, b, torch.float32, "emulated")
    assert torch.equal(emulated, mx_mm(a, b, torch.float32, "auto"))
    assert torch.equal(emulated, torch.mm(a.dequantize(), b.dequantize().t()))
    with pytest.raises(ValueError, match="sm_100"):
        mx_mm(a, b, torch.float32, "cublas")


def test_mx_scaled_mm_shape_errors():
    qa, _, sa, sb = _dense_args()
    with pytest.raises(ValueError, match=r"expected a \[M, K\] and b \[N, K\]"):
        mx_scaled_mm(qa, sa, qa[:, :64], sb, torch.bfloat16, emu.scaled_mm)
    assert blocked_numel(65, 3) == sa.numel() == emu.blocked_scale_count(65, 96)
