"""Stochastic rounding of MXFP4 on the Triton fake-quant kernel (mx_kernels/mx/fake_quant_2d.py) and on the Triton
casts (mx_kernels/mx/casts.py, packed codes and e8m0 scales) against the reference (``formats.fake_quant``
and ``formats.to_mx`` with ``rounding="stochastic"``), bit for bit: the kernels' Philox draws
(``philox.philox_uniform``, each element by its row-major index in x, or in the zero-padded fake-quant along M,
stream 0 along K and 1 along M) handed to the reference as its ``uniform``. Along K, along M (the fake-quant also
both from one read), 3D experts, gathered token groups, both scale rules, plain and blocked scales, the edge
cases of ``special_input``; a cast and the fake-quant give the same values for the same seed.

On the CPU the kernel runs in the Triton interpreter (a child pytest), where every step is exact; the GPU
tests run the same checks on the hardware. The dispatch sends stochastic e2m1 fake-quants of bf16 on CUDA to
this kernel (``dispatch.rule``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_cast_kernels import (
    HAS_CUDA,
    HAS_TRITON,
    INTERP,
    MODES,
    assert_values_equal,
    group_sources,
    interp_only,
    run_interpreter_tests,
    special_input,
)

from mx_recipe.formats.mx import MXTensor, fake_quant, to_mx
from mx_recipe.formats.philox import philox_uniform
from mx_recipe.formats.scale_layout import to_blocked, to_blocked_3d


def _seed(device, seed: int = 0) -> torch.Tensor:
    return torch.tensor([0x2468_ACE0_1357_9BDF + seed], dtype=torch.int64, device=device)


def check_2d(x: torch.Tensor, mode: str, along_k: bool, along_m: bool, seed: int = 0) -> None:
    from mx_kernels.mx.fake_quant_2d import fake_quant_2d

    key = _seed(x.device, seed)
    got_k, got_m = fake_quant_2d(x, "e2m1", mode, along_k, along_m, key)
    xc, what = x.cpu(), f"mxfp4 SR {tuple(x.shape)} {mode} k={along_k} m={along_m}"
    if along_k:
        u = philox_uniform(int(key.item()), 0, tuple(x.shape))
        want = fake_quant(xc, "e2m1", mode, dim=-1, rounding="stochastic", uniform=u)
        assert_values_equal(got_k, want, what + " along K")
    if along_m:
        padded = F.pad(xc, (0, 0, 0, -x.shape[-2] % 32))
        u = philox_uniform(int(key.item()), 1, tuple(padded.shape))
        want = fake_quant(padded, "e2m1", mode, dim=-2, rounding="stochastic", uniform=u)
        assert_values_equal(got_m, want, what + " along M")


def check_groups(sizes: list[int], mode: str, device) -> None:
    """Each row draws by its own index in the [M, K] output, wherever its group puts it."""
    from mx_kernels.mx.fake_quant_2d import fake_quant_groups_along_m

    x = special_input((sum(sizes), 96), torch.bfloat16, device, seed=len(sizes)).nan_to_num(nan=1.0)
    src, key = group_sources(sizes, device), _seed(device, len(sizes))
    got = fake_quant_groups_along_m(x, src, "e2m1", mode, key)
    u = philox_uniform(int(key.item()), 1, tuple(x.shape))
    rows = src.cpu().long()
    laid = torch.cat([x.cpu(), x.new_zeros(1, 96).cpu()])[rows]  # -1 picks the zero row
    laid_u = torch.cat([u, u.new_zeros(1, 96)])[rows]
    fq = fake_quant(laid, "e2m1", mode, dim=0, rounding="stochastic", uniform=laid_u)
    want = torch.empty_like(x.cpu())
    want[rows[rows >= 0]] = fq[rows >= 0]
    assert_values_equal(got, want, f"mxfp4 SR groups {sizes} {mode}")


PARTS = ("codes along K", "scales along K", "codes along M", "scales along M")


def check_casts(x: torch.Tensor, mode: str, blocked: bool, seed: int = 0) -> None:
    """``cast_dim0`` and ``cast_dim1`` rounded stochastically, against ``to_mx`` with the kernel's draws: x's
    row-major order, stream 0 along K and 1 along M."""
    from mx_kernels.mx import casts as triton_casts

    key = _seed(x.device, seed)
    xc, what = x.cpu(), f"mxfp4 SR cast {tuple(x.shape)} {x.dtype} {mode} blocked={blocked}"
    u_k = philox_uniform(int(key.item()), 0, tuple(x.shape))
    u_m = philox_uniform(int(key.item()), 1, tuple(x.shape))
    block = to_blocked_3d if x.dim() == 3 else to_blocked
    want_k = to_mx(xc, "e2m1", mode, dim=-1, rounding="stochastic", uniform=u_k)
    want_m = to_mx(xc.transpose(-2, -1).contiguous(), "e2m1", mode, dim=-1, rounding="stochastic",
                   uniform=u_m.transpose(-2, -1).contiguous())  # fmt: skip
    wants = [want_k.qdata, want_k.scale, want_m.qdata, want_m.scale]
    wants = [block(w) if blocked and i % 2 else w for i, w in enumerate(wants)]
    got = [
        *triton_casts.cast_dim0(x, "e2m1", mode, blocked, key),
        *triton_casts.cast_dim1(x, "e2m1", mode, blocked, key),
    ]
    for name, a, b in zip(PARTS, got, wants, strict=True):
        assert a.shape == b.shape and torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8)), f"{what}: {name}"


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="this is the parent of the interpreter run")
def test_mxfp4_stochastic_kernel_in_triton_interpreter():
    run_interpreter_tests(__file__)


@interp_only
@pytest.mark.parametrize("mode", MODES)
def test_interp_mxfp4_stochastic_fake_quant(mode):
    x = special_input((96, 160), torch.bfloat16, "cpu")  # NaN, inf, zero blocks, subnormals
    for along_k, along_m in ((True, False), (False, True), (True, True)):
        check_2d(x, mode, along_k, along_m)
    check_2d(special_input((2, 70, 96), torch.bfloat16, "cpu", 1), mode, True, True)  # 3D, M padded along M
    check_groups([40, 0, 33, 1, 64], mode, "cpu")


@interp_only
@pytest.mark.parametrize("mode", MODES)
def test_interp_mxfp4_stochastic_casts(mode):
    x = special_input((96, 160), torch.bfloat16, "cpu")  # NaN, inf, zero blocks, subnormals
    check_casts(x, mode, blocked=False)
    check_casts(x.float(), mode, blocked=True, seed=1)
    check_casts(special_input((2, 64, 96), torch.bfloat16, "cpu", 2), mode, blocked=True, seed=2)  # 3D experts


@interp_only
def test_interp_mxfp4_stochastic_cast_matches_the_fake_quant():
    """For one seed, the packed cast dequantized is the fake-quant: the same draws for the same element."""
    from mx_kernels.mx import casts as triton_casts
    from mx_kernels.mx import fake_quant_2d

    x, key = special_input((64, 96), torch.bfloat16, "cpu", 4).nan_to_num(nan=1.0), _seed("cpu", 4)
    fq_k, fq_m = fake_quant_2d.fake_quant_2d(x, "e2m1", "floor", True, True, key)
    q0, s0 = triton_casts.cast_dim0(x, "e2m1", "floor", False, key)
    q1, s1 = triton_casts.cast_dim1(x, "e2m1", "floor", False, key)
    along_k = MXTensor(q0, s0, "e2m1", dim=-1).dequantize(torch.bfloat16)
    along_m = MXTensor(q1, s1, "e2m1", dim=-1).dequantize(torch.bfloat16).t()
    assert_values_equal(along_k, fq_k, "cast along K against the fake-quant")
    assert_values_equal(along_m, fq_m, "cast along M against the fake-quant")


@interp_only
def test_interp_mxfp4_stochastic_errors():
    from mx_kernels.mx.fake_quant_2d import fake_quant_2d

    x = torch.randn(64, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="e2m1 kernels only"):
        fake_quant_2d(x, "e4m3", "floor", True, False, _seed("cpu"))
    with pytest.raises(ValueError, match="multiple of 8"):
        fake_quant_2d(torch.randn(64, 20, dtype=torch.bfloat16), "e2m1", "floor", False, True, _seed("cpu"))
    from mx_kernels.mx.casts import cast_dim0, cast_dim1

    with pytest.raises(ValueError, match="e2m1 kernels only"):
        cast_dim0(x, "e4m3", "floor", False, _seed("cpu"))
    with pytest.raises(ValueError, match="multiple of 8"):
        cast_dim1(torch.randn(64, 20, dtype=torch.bfloat16), "e2m1", "floor", False, _seed("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", MODES)
def test_gpu_mxfp4_stochastic_fake_quant_bit_exact(mode):
    for shape in [(96, 160), (4130, 160), (1024, 4096), (3, 224, 96)]:
        x = special_input(shape, torch.bfloat16, "cuda")
        for along_k, along_m in ((True, False), (False, True), (True, True)):
            check_2d(x, mode, along_k, along_m)
    check_groups([40, 0, 33, 1, 64], mode, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", MODES)
def test_gpu_mxfp4_stochastic_casts_bit_exact(mode):
    for shape, blocked in [((96, 160), False), ((4096, 1024), True), ((1024, 4096), False), ((3, 256, 96), True)]:
        check_casts(special_input(shape, torch.bfloat16, "cuda"), mode, blocked)
    check_casts(special_input((256, 512), torch.float32, "cuda"), mode, True, seed=1)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_stochastic_e2m1_entry_points_take_the_kernel():
    """The public fake-quants send stochastic e2m1 on CUDA to the kernel: its draws, not the reference's."""
    from mx_recipe.ops import dispatch
    from mx_recipe.ops.mx_cast import fake_quant_dim0

    x = special_input((256, 512), torch.bfloat16, "cuda").nan_to_num(nan=1.0)
    assert dispatch.implementation("fake_quant_2d", x, "e2m1", "stochastic") == "triton"
    generator = torch.Generator("cuda").manual_seed(3)
    got = fake_quant_dim0(x, "e2m1", "floor", rounding="stochastic", generator=generator)
    key = torch.randint(
        0, 2**62, (1,), device="cuda", dtype=torch.int64, generator=torch.Generator("cuda").manual_seed(3)
    )
    u = philox_uniform(int(key.item()), 0, tuple(x.shape))
    want = fake_quant(x.cpu(), "e2m1", "floor", dim=-1, rounding="stochastic", uniform=u)
    assert_values_equal(got, want, "fake_quant_dim0 stochastic on CUDA")


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="compiles with Triton's CUDA backend")
@pytest.mark.parametrize("arch", [90, 100])
def test_stochastic_variants_compile_for_hopper_and_blackwell(arch):
    """What the interpreter cannot check: the stochastic kernel (2D both sides, 3D, gathered, along M alone) compiles
    to cubin, its Philox in wide multiplies (``mx_quantize.philox``) but along M alone, where they cost occupancy."""
    from mx_kernels.gluon.common import compile_for_arch
    from mx_kernels.mx import fake_quant_2d as fq

    seed = torch.empty(1, dtype=torch.int64, device="meta")
    for shape, gather in (((4096, 4096), False), ((8, 512, 1024), False), ((4096, 1024), True)):
        x = torch.empty(shape, dtype=torch.bfloat16, device="meta")
        out = torch.empty(16, dtype=torch.bfloat16, device="meta")
        row_src = torch.empty(4096, dtype=torch.int32, device="meta") if gather else None
        along_k = not gather
        m = shape[-2]
        for along_m_only in (False, True):
            k_side = along_k and not along_m_only
            _, kwargs = fq._kernel_launch(x, row_src, out, out, "e2m1", "floor", k_side, True, m, m, False, seed)
            kernel = compile_for_arch(fq._fake_quant_2d_kernel, kwargs, arch)
            assert kernel.asm["cubin"] and ("mul.wide.u32 t, " in kernel.asm["ptx"]) == k_side, (shape, k_side)
