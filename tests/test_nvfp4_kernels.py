"""The NVFP4 fake-quant kernel (mx_kernels/nvfp4/casts.py) against the reference (mx_recipe/formats/nvfp4.py), bit
for bit: along K (1x16 and 16x16 tiles), along M with and without the random Hadamard transform, both at once,
nearest and stochastic rounding (the kernel's Philox draws handed to the reference), the edge cases of
``special_input`` (NaN, +-inf, zero blocks, subnormals, saturation), a NaN-free tensor with an inf, ragged M.

On the CPU the kernel runs in the Triton interpreter (a child pytest with TRITON_INTERPRET=1, as in
test_cast_kernels.py): every step of the kernel is exact fp32 or integer arithmetic with SOFTWARE_ROUND, so
the interpreter checks the bits too. The GPU tests run the hardware conversions.
"""

from __future__ import annotations

import pytest
import torch
from test_cast_kernels import (
    HAS_CUDA,
    HAS_TRITON,
    INTERP,
    assert_values_equal,
    interp_only,
    run_interpreter_tests,
    special_input,
)

from mx_recipe.formats.nvfp4 import random_signs
from mx_recipe.formats.philox import philox_uniform
from mx_recipe.formats.scale_layout import group_row_sources, padded_group_layout
from mx_recipe.ops.nvfp4_cast import cast_nvfp4, reference_cast_nvfp4
from mx_recipe.ops.nvfp4_fake_quant import (
    fake_quant_nvfp4,
    reference_fake_quant_nvfp4,
    reference_fake_quant_nvfp4_groups,
)

# (along_k, along_m, tiles, hadamard): the forward (x; w in tiles or rows), the gradient (both sides, the
# transform on the grad-weight side), the grad-weight x, a 1x16 weight along N
CASES = [
    (True, False, False, False),
    (True, False, True, False),
    (True, True, False, True),
    (False, True, False, True),
    (False, True, False, False),
    (True, True, False, False),
]


def check(shape, device, along_k, along_m, tiles, hadamard, stochastic, seed=0, x=None):
    from mx_kernels.nvfp4.casts import fake_quant_nvfp4 as launch

    if x is None:
        x = special_input(shape, torch.bfloat16, device, seed)
    signs = random_signs(seed + 7, device) if hadamard else None
    key = torch.tensor([0x1234_5678_9ABC_DEF0 + seed], dtype=torch.int64, device=device) if stochastic else None
    k, m, s_dec = launch(x, along_k, along_m, tiles, signs, key)
    m_pad = -(-x.shape[0] // 16) * 16
    uniforms = (
        philox_uniform(int(key.item()), 0, tuple(x.shape)) if stochastic else None,
        philox_uniform(int(key.item()), 1, (m_pad, x.shape[1]), along_rows=True) if stochastic else None,
    )
    ref = reference_fake_quant_nvfp4(
        x.cpu(), along_k, along_m, tiles, None if signs is None else signs.cpu(),
        "stochastic" if stochastic else "nearest", uniforms=uniforms,
    )  # fmt: skip
    what = f"nvfp4 {tuple(x.shape)} k={along_k} m={along_m} tiles={tiles} rht={hadamard} sr={stochastic}"
    if along_k:
        assert_values_equal(k, ref.along_k, what + " along K")
    else:
        assert k.numel() == 0
    if along_m:
        assert_values_equal(m, ref.along_m, what + " along M")
    else:
        assert m.numel() == 0
    # the decode scales the GEMM multiplies by, as the reference's
    if along_k:
        assert_values_equal(s_dec[:1], ref.s_dec_k.reshape(1), what + " s_dec along K")
    if along_m:
        assert_values_equal(s_dec[1:], ref.s_dec_m.reshape(1), what + " s_dec along M")


# (along_k, along_m, hadamard): the MoE forward's x, the backward's g (both with the transform), one side alone
GROUP_CASES = [(True, True, True), (True, True, False), (False, True, True), (True, False, False)]


def check_groups(x, offs, along_k, along_m, hadamard, stochastic, seed=0):
    """The token-group kernel (``fake_quant_nvfp4_groups``) against the reference entry point, bit for bit: along K
    on the rows of the groups, along M on the padded groups, and both decode scales."""
    from mx_kernels.nvfp4.casts import fake_quant_nvfp4_groups as launch

    device = x.device
    offs = offs.to(device)
    layout = padded_group_layout(offs, x.shape[0], 16)
    signs = random_signs(seed + 7, device) if hadamard else None
    key = torch.tensor([0x2468_ACE0_1357_9BDF + seed], dtype=torch.int64, device=device) if stochastic else None
    k, m, s_dec = launch(x, group_row_sources(layout[0], layout[2]), offs[-1:], along_k, along_m, signs, key)
    uniforms = (None, None)
    if stochastic:  # along K over x's [M, K] rows, along M over the padded groups
        uniforms = (
            philox_uniform(int(key.item()), 0, tuple(x.shape)),
            philox_uniform(int(key.item()), 1, (layout[2], x.shape[1]), along_rows=True),
        )
    ref = reference_fake_quant_nvfp4_groups(
        x.cpu(), offs.cpu(), layout[0].cpu(), layout[2], along_k, along_m, None if signs is None else signs.cpu(),
        "stochastic" if stochastic else "nearest", uniforms=uniforms,
    )  # fmt: skip
    end = int(offs[-1])
    what = f"nvfp4 groups {offs.tolist()} of {tuple(x.shape)} k={along_k} m={along_m} rht={hadamard} sr={stochastic}"
    if along_k:
        assert_values_equal(k[:end], ref.along_k[:end], what + " along K")
        assert_values_equal(s_dec[:1], ref.s_dec_k.reshape(1), what + " s_dec along K")
    else:
        assert k.numel() == 0
    if along_m:
        assert m.shape == ref.along_m.shape, what
        assert_values_equal(m, ref.along_m, what + " along M")
        assert_values_equal(s_dec[1:], ref.s_dec_m.reshape(1), what + " s_dec along M")
    else:
        assert m.numel() == 0


def group_inputs(device):
    """(x, offs) pairs: ragged groups, an empty one, rows past the last group holding the largest value (which
    must reach no scale), the edge values of ``special_input``, one group of all rows."""
    x = special_input((100, 96), torch.bfloat16, "cpu", 3).nan_to_num(nan=1.0)
    x[95] = 1e4  # past the groups
    ragged = torch.tensor([7, 7, 40, 71, 90], dtype=torch.int32)
    yield x.to(device), ragged.to(device)
    yield special_input((64, 48), torch.bfloat16, device, 4), torch.tensor([64], dtype=torch.int32, device=device)
    yield x[:40].to(device), torch.tensor([16, 33, 40], dtype=torch.int32, device=device)


def tiny_input(device: str = "cpu") -> torch.Tensor:
    """A tensor below 2**-116, rows from 2**-118 down to 2**-131 (bf16 subnormals): its decode scale is an fp32
    subnormal, and so is its small blocks' scale * s_dec, whose reciprocal the kernels take on the GPU."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    return (x * torch.exp2(-118.0 - torch.arange(64) % 14)[:, None]).to(torch.bfloat16).to(device)


def check_packed(x, along_k, along_m, tiles, hadamard, stochastic, pad_m, seed=0):
    """The kernel's packed cast (codes, e4m3 scales, decode scales) against ``to_nvfp4`` through the reference
    entry point, bit for bit; the along-M side transposed with its rows zero-padded to ``pad_m``."""
    from mx_kernels.nvfp4.casts import cast_nvfp4 as launch

    signs = random_signs(seed + 7, x.device) if hadamard else None
    key = torch.tensor([0x0FED_CBA9_8765_4321 + seed], dtype=torch.int64, device=x.device) if stochastic else None
    q_k, scale_k, q_m, scale_m, s_dec = launch(x, along_k, along_m, tiles, signs, key, pad_m)
    m_pad = -(-x.shape[0] // pad_m) * pad_m
    uniforms = (None, None)
    if stochastic:  # the kernel's draws, in each reference operand's layout (along M: [K, M_pad])
        u_m = philox_uniform(int(key.item()), 1, (m_pad, x.shape[1]), along_rows=True)
        uniforms = (philox_uniform(int(key.item()), 0, tuple(x.shape)), u_m.t().contiguous())
    ref_k, ref_m = reference_cast_nvfp4(
        x.cpu(), along_k, along_m, tiles, None if signs is None else signs.cpu(),
        "stochastic" if stochastic else "nearest", pad_m, uniforms=uniforms,
    )  # fmt: skip
    what = f"packed nvfp4 {tuple(x.shape)} k={along_k} m={along_m} tiles={tiles} rht={hadamard} sr={stochastic}"
    sides = (("along K", q_k, scale_k, s_dec[0], ref_k), ("along M", q_m, scale_m, s_dec[1], ref_m))
    for side, q, scale, s, ref in sides:
        if ref is None:
            assert q.numel() == 0 and scale.numel() == 0, f"{what} {side}: asked for nothing"
            continue
        assert q.shape == ref.qdata.shape and torch.equal(q.cpu(), ref.qdata), f"{what} {side}: codes"
        assert torch.equal(scale.cpu().view(torch.uint8), ref.scale.view(torch.uint8)), f"{what} {side}: scales"
        assert_values_equal(s.reshape(1), ref.per_tensor_scale.reshape(1), f"{what} {side}: s_dec")


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="this is the parent of the interpreter run")
def test_nvfp4_kernel_in_triton_interpreter():
    run_interpreter_tests(__file__)


@interp_only
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_interp_nvfp4_fake_quant(case, stochastic):
    check((96, 160), "cpu", *case, stochastic)
    check((48, 48) if case[2] else (40, 48), "cpu", *case, stochastic, seed=1)  # ragged M where allowed


@interp_only
def test_interp_nvfp4_edge_tensors():
    for x in (
        torch.zeros(32, 32, dtype=torch.bfloat16),  # amax 0: s_enc is the fp32 max
        torch.full((32, 32), float("inf"), dtype=torch.bfloat16),  # amax inf: s_enc = 1
        special_input((64, 128), torch.bfloat16, "cpu").nan_to_num(nan=1.0),  # infinities, no NaN
    ):
        for case in CASES:
            check(None, "cpu", *case, False, x=x)
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).reshape(-1, 512).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # every finite value
    check(None, "cpu", True, True, False, False, False, x=x)


@interp_only
def test_interp_nvfp4_scratch_is_left_zeroed_for_the_next_call():
    """The calls on one stream share a kept scratch: the maxima kernel's last program zeroes the maxima and the
    count it took, so a call after one with a larger maximum (inf here) scales by its own."""
    from mx_kernels.nvfp4.casts import _scratch

    big = torch.full((32, 32), float("inf"), dtype=torch.bfloat16)
    small = special_input((64, 128), torch.bfloat16, "cpu").nan_to_num(nan=1.0, posinf=2.0, neginf=-2.0)
    for case in CASES:
        check(None, "cpu", *case, False, x=big)
        assert not _scratch(small)[:3].any(), f"{case}: the maxima or the count were left behind"
        check(None, "cpu", *case, False, x=small)


@interp_only
def test_interp_nvfp4_maxima_fold_tiles(monkeypatch):
    """The maxima kernel folds several tiles down each strip (unrolled; with the transform, a loop over 16-row
    tiles), past x's rows at the end: 8 tiles a program here, over 6.5 tiles of 32 rows (13 of 16, two strips).
    The tensor's largest value sits in the last tile of rows, and the decode scales must see it."""
    import mx_kernels.nvfp4.casts as kernel

    monkeypatch.setattr(kernel, "AMAX_PROGRAMS", 1)
    assert kernel.amax_row_tiles(7, 2) == 8 and kernel.amax_row_tiles(13, 1) == 8
    x = torch.randn(208, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    x[205, 3] = -3e4
    for case in CASES:
        check(None, "cpu", *case, False, x=x)
    check_groups(x, torch.tensor([60, 60, 207], dtype=torch.int32), True, True, True, False)


@interp_only
@pytest.mark.parametrize("case", GROUP_CASES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_interp_nvfp4_token_groups(case, stochastic):
    for x, offs in group_inputs("cpu"):
        check_groups(x, offs, *case, stochastic)


@interp_only
@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_1d_weights"])
def test_interp_compiled_linear_casts_its_weight_tiles_once(name, monkeypatch):
    """What docs/DESIGN.md says of the weight's casts under torch.compile: with 16x16 tiles the backward's cast of w
    is the forward's call with the same arguments, and the partitioner Inductor uses keeps the forward's output
    instead of casting again (the tiles held in bf16 until backward); 1x16 weight blocks cast w along N in
    backward. Counted in the graphs AOTAutograd hands to the compilers (the kernel path, in the interpreter)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    import mx_recipe.ops.nvfp4_fake_quant as nvfp4_fake_quant
    from mx_recipe import mx_linear
    from mx_recipe.formats.recipe import NVFP4Recipe

    monkeypatch.setattr(nvfp4_fake_quant, "uses_kernel", lambda x: True)  # the custom op, as on CUDA
    casts = {}

    def counting(side):
        def compiler(gm, _):
            casts[side] = sum(n.op == "call_function" and "fake_quant_nvfp4" in str(n.target) for n in gm.graph.nodes)
            return gm

        return compiler

    backend = aot_autograd(
        fw_compiler=counting("forward"), bw_compiler=counting("backward"),
        partition_fn=min_cut_rematerialization_partition,
    )  # fmt: skip
    recipe = NVFP4Recipe.from_name(name, grad_rounding="nearest")
    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    torch.compile(lambda a, b: mx_linear(a, b, None, recipe), backend=backend)(x, w).sum().backward()
    torch._dynamo.reset()
    # forward: x (along K and M) and w; backward: g, and w along N only with 1x16 blocks
    assert casts == {"forward": 2, "backward": 1 if recipe.weight_tiles else 2}, casts


@interp_only
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_interp_nvfp4_packed_cast(case, stochastic):
    check_packed(special_input((96, 160), torch.bfloat16, "cpu"), *case, stochastic, 16)  # NaN: every scale NaN
    x = special_input((48, 48) if case[2] else (40, 48), torch.bfloat16, "cpu", 1).nan_to_num(nan=1.0)
    check_packed(x, *case, stochastic, 32, seed=1)  # ragged M where allowed, padded to 32 along M


@interp_only
def test_interp_dispatch_and_errors():
    x = torch.randn(32, 48, dtype=torch.bfloat16)
    out = torch.ops.mx_recipe.fake_quant_nvfp4(x, True, True, False, None, None)  # the op's CPU kernel
    ref = reference_fake_quant_nvfp4(x, True, True, False, None, "nearest")
    assert_values_equal(out[0], ref.along_k, "op along K")
    assert_values_equal(out[1], ref.along_m, "op along M")
    with pytest.raises(ValueError, match="ask for along_k, along_m or both"):
        fake_quant_nvfp4(x, False, False)
    with pytest.raises(ValueError, match="must be multiples of 16"):
        fake_quant_nvfp4(torch.randn(24, 40), True, False, tiles=True)
    packed = torch.ops.mx_recipe.cast_nvfp4(x, True, True, False, None, None, 32)  # the op's CPU kernel
    ref_k, ref_m = reference_cast_nvfp4(x, True, True, False, None, "nearest", 32)
    assert torch.equal(packed[0], ref_k.qdata) and torch.equal(packed[2], ref_m.qdata)
    with pytest.raises(ValueError, match="pad_m must be one of"):
        cast_nvfp4(x, pad_m=8)


def test_philox_uniform_is_uniform_and_reproducible():
    u = philox_uniform(5, 0, (256, 64))
    assert u.dtype == torch.float32 and u.shape == (256, 64)
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean().item() - 0.5) < 0.01
    assert torch.equal(u, philox_uniform(5, 0, (256, 64)))
    assert not torch.equal(u, philox_uniform(5, 1, (256, 64)))
    assert not torch.equal(u, philox_uniform(6, 0, (256, 64)))
    assert torch.equal((u * 2**16).floor(), u * 2**16)  # multiples of 2**-16
    with pytest.raises(ValueError, match="multiple of 8"):
        philox_uniform(0, 0, (4, 12))
    # along rows, column 0's groups of eight rows are counters (g, 0): the row-major stream's first calls
    v = philox_uniform(5, 1, (64, 24), along_rows=True)
    assert torch.equal(v[:, 0], philox_uniform(5, 1, (64,)))
    assert not torch.equal(v[:, 1], v[:, 0]) and abs(v.mean().item() - 0.5) < 0.02
    with pytest.raises(ValueError, match="along_rows takes a 2D shape"):
        philox_uniform(0, 0, (12, 8), along_rows=True)


def test_reference_path_off_cuda():
    x = torch.randn(40, 32, dtype=torch.bfloat16)
    ops = fake_quant_nvfp4(x, True, True, signs=random_signs(0))
    assert ops.along_k.shape == (40, 32) and ops.along_m.shape == (48, 32) and ops.along_m.dtype == torch.bfloat16
    assert ops.s_dec_k.dim() == 0 and ops.s_dec_m.dim() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_gpu_nvfp4_fake_quant_bit_exact(case, stochastic):
    check((96, 160), "cuda", *case, stochastic)  # NaN, inf, zero blocks: every block of the tensor is NaN
    for shape in [(96, 160), (4128, 256), (1024, 4096)]:  # the same without the NaN
        check(None, "cuda", *case, stochastic, x=special_input(shape, torch.bfloat16, "cuda").nan_to_num(nan=1.0))
    if not case[2]:
        check((40, 48), "cuda", *case, stochastic, seed=1)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", GROUP_CASES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_gpu_nvfp4_token_groups_bit_exact(case, stochastic):
    for x, offs in group_inputs("cuda"):
        check_groups(x, offs, *case, stochastic)
    x = torch.randn(4096, 512, dtype=torch.bfloat16, device="cuda")  # many tiles, 64 experts, the last empty
    offs = torch.sort(torch.randint(0, 4000, (64,), device="cuda")).values.to(torch.int32)
    offs[-1] = offs[-2]
    check_groups(x, offs, *case, stochastic, seed=2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_nvfp4_edge_tensors_and_dispatch():
    for x in (
        torch.zeros(32, 32, dtype=torch.bfloat16),
        torch.full((32, 32), float("inf"), dtype=torch.bfloat16),
        special_input((64, 128), torch.bfloat16, "cpu").nan_to_num(nan=1.0),
        tiny_input(),
    ):
        for case in CASES:
            check(None, "cuda", *case, False, x=x.cuda())
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).reshape(-1, 512).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    check(None, "cuda", True, True, False, False, False, x=x.cuda())
    # the public entry point takes the kernel on CUDA, also under torch.compile
    x, signs = special_input((256, 512), torch.bfloat16, "cuda"), random_signs(1, "cuda")
    eager = fake_quant_nvfp4(x, True, True, signs=signs)
    compiled = torch.compile(lambda t, s: fake_quant_nvfp4(t, True, True, signs=s), fullgraph=True)
    for a, b in zip(eager, compiled(x, signs), strict=True):  # operands, and the 0-d decode scales as 1-d
        assert_values_equal(a.reshape(-1), b.reshape(-1), "compiled")


def test_along_m_holds_whole_blocks_in_each_thread_with_or_without_the_transform():
    """Along M the blocks' rows reach one thread by the butterflies' data movement, with the transform's
    arithmetic or without it: no warp shuffles for the blocks' maxima and no more shared-memory traffic than
    the transform's, to nearest and stochastic (as loaded, x's rows lie across threads: 32 shuffles). Along M
    alone to nearest (ALONG_M_TILE) each lane loads whole columns of a block, 8 bytes a row: no shared memory."""
    from mx_kernels.nvfp4.casts import ALONG_M_TILE, compile_for_target

    for stochastic in (False, True):
        ptx = {
            hadamard: compile_for_target((4096, 4096), False, True, False, hadamard, stochastic, 90)[1].asm["ptx"]
            for hadamard in (False, True)
        }
        for hadamard, text in ptx.items():
            assert "shfl.sync" not in text, f"rht={hadamard} sr={stochastic}: the blocks' rows span threads"
            if not stochastic:
                assert "st.shared" not in text and "bar.sync" not in text, f"rht={hadamard}: moved through smem"
                assert text.count("ld.global.v2.b32") == ALONG_M_TILE[0], f"rht={hadamard}: one load a row"
        assert ptx[False].count("st.shared") <= ptx[True].count("st.shared")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["nvfp4_nearest_grads", "nvfp4_1d_weights"])
def test_gpu_nvfp4_linear_on_the_kernels_matches_the_cpu_reference(name):
    """The linear's wiring on the kernel path (which operand, which orientation, which decode scale): the CUDA
    layer against the CPU reference pieces, nearest rounding, equal up to the GEMMs' summation order."""
    from test_nvfp4_linear import _expected

    from mx_recipe import mx_linear
    from mx_recipe.formats.recipe import NVFP4Recipe

    recipe = NVFP4Recipe.from_name(name, hadamard_seed=3, grad_rounding="nearest")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(200, 256, generator=generator).to(torch.bfloat16)
    w = (torch.randn(128, 256, generator=generator) * 0.1).to(torch.bfloat16)
    g = torch.randn(200, 128, generator=generator).to(torch.bfloat16)
    xc, wc = x.cuda().requires_grad_(), w.cuda().requires_grad_()
    y = mx_linear(xc, wc, None, recipe)
    y.backward(g.cuda())
    expected = _expected(x, w, g, recipe, seed=0)
    for got, want, what in zip((y, xc.grad, wc.grad), expected, ("y", "gx", "gw"), strict=True):
        err = (got.float().cpu() - want.float()).abs().max() / want.float().abs().max()
        assert err < 1e-2, f"{name} {what}: max error {err:.3g} of the largest value"


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="compiles with Triton's CUDA backend")
@pytest.mark.parametrize("arch", [90, 100])
def test_kernels_compile_for_hopper_and_blackwell(arch):
    """What the interpreter cannot check: the kernels compile to cubin (constexpr globals, layouts of the
    butterflies and joins) for every case the layers launch, stochastic rounding included, its Philox in wide
    multiplies."""
    from mx_kernels.nvfp4.casts import compile_for_target

    for along_k, along_m, tiles, hadamard in CASES:
        for stochastic in (False, True):
            for packed in (False, True):
                amax_kernel, kernel = compile_for_target(
                    (4096, 4096), along_k, along_m, tiles, hadamard, stochastic, arch, packed
                )
                assert amax_kernel.asm["cubin"] and kernel.asm["cubin"]
                # Philox's products as wide multiplies (mx_quantize.philox), its multiplier in the inline PTX
                assert ("mul.wide.u32 t, " in kernel.asm["ptx"]) == stochastic, (along_k, along_m, stochastic)
    for along_k, along_m, hadamard in GROUP_CASES:  # the token-group kernels
        for stochastic in (False, True):
            amax_kernel, kernel = compile_for_target(
                (4096, 4096), along_k, along_m, False, hadamard, stochastic, arch, gather=True
            )
            assert amax_kernel.asm["cubin"] and kernel.asm["cubin"]


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="compiles with Triton's CUDA backend")
def test_casts_along_k_and_m_fit_their_register_cap_without_spills():
    """Along K and M with the transform, to nearest, the quantizing kernel launches capped at
    BOTH_SIDES_MAX_REGISTERS (6 programs of 4 warps an SM on Hopper instead of 5), and ptxas fits the cap with no
    local memory: the fake-quant, the packed cast and the token groups' fake-quant (sm_90). Stochastic rounding
    keeps its registers (capped, Philox spills)."""
    from mx_kernels.nvfp4.casts import BOTH_SIDES_MAX_REGISTERS, compile_for_target
    from test_gluon_kernels import resource_usage

    for packed, gather in ((False, False), (True, False), (False, True)):
        _, kernel = compile_for_target((4096, 4096), True, True, False, True, False, 90, packed, gather)
        assert kernel.metadata.maxnreg == BOTH_SIDES_MAX_REGISTERS, (packed, gather)
        usage = resource_usage(kernel.asm["cubin"])
        if usage is not None:
            assert usage["REG"] <= BOTH_SIDES_MAX_REGISTERS and usage["LOCAL"] == 0, (packed, gather, usage)
    _, kernel = compile_for_target((4096, 4096), True, True, False, True, True, 90)
    assert kernel.metadata.maxnreg is None


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["nvfp4_nearest_grads", "nvfp4_1d_weights"])
def test_gpu_nvfp4_grouped_on_the_kernels_matches_the_cpu_reference(name):
    """The MoE grouped GEMM's wiring on the kernel path, ragged groups (an empty one, rows past the last group):
    the CUDA layer against the CPU reference pieces, nearest rounding, equal up to the GEMMs' summation order."""
    from test_nvfp4_grouped import _expected

    from mx_recipe import mx_grouped_mm
    from mx_recipe.formats.recipe import NVFP4Recipe

    recipe = NVFP4Recipe.from_name(name, hadamard_seed=3, grad_rounding="nearest")
    generator = torch.Generator().manual_seed(0)
    offs = torch.tensor([100, 100, 333, 500], dtype=torch.int32)
    x = torch.randn(512, 256, generator=generator).to(torch.bfloat16)
    w = (torch.randn(4, 128, 256, generator=generator) * 0.1).to(torch.bfloat16)
    g = torch.randn(512, 128, generator=generator).to(torch.bfloat16)
    xc, wc = x.cuda().requires_grad_(), w.cuda().requires_grad_()
    y = mx_grouped_mm(xc, wc, offs.cuda(), recipe)
    y.backward(g.cuda())
    expected = _expected(x, w, offs, g, recipe, seed=0)  # rows past the last group count as zeros there
    for got, want, what in zip((y, xc.grad, wc.grad), expected, ("y", "gx", "gw"), strict=True):
        err = (got.float().cpu() - want.float()).abs().max() / want.float().abs().max()
        assert err < 1e-2, f"{name} {what}: max error {err:.3g} of the largest value"
    assert (y[500:] == 0).all() and (xc.grad[500:] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_gpu_nvfp4_packed_cast_bit_exact(case, stochastic):
    check_packed(special_input((96, 160), torch.bfloat16, "cuda"), *case, stochastic, 16)
    check_packed(tiny_input("cuda"), *case, stochastic, 16)
    for shape in [(96, 160), (4128, 256), (1024, 4096)]:
        x = special_input(shape, torch.bfloat16, "cuda").nan_to_num(nan=1.0)
        check_packed(x, *case, stochastic, 32)
    if not case[2]:
        check_packed(special_input((40, 48), torch.bfloat16, "cuda", 1).nan_to_num(nan=1.0), *case, stochastic, 32, 1)
