"""The MX cast kernels (mx_kernels) and their dispatch (mx_recipe.ops.dispatch, mx_recipe.ops.mx_cast), bit for bit
vs ``to_mx``.

Three groups of tests:

* CPU, in this process: argument errors, the dispatch layer's reference path, and the custom
  ops traced by torch.compile(fullgraph=True) through their fake implementations.
* CPU, Triton interpreter (``test_interp_*``): the kernels themselves with SOFTWARE_ROUND. The
  interpreter is chosen when a kernel module is imported (TRITON_INTERPRET=1 must be set
  before that), so ``test_kernels_in_triton_interpreter`` runs these tests in a child pytest
  with the variable set; this process and the rest of the suite never see it. Run them
  directly with ``TRITON_INTERPRET=1 pytest tests/test_cast_kernels.py -k interp_``.
* GPU (``@pytest.mark.gpu``): the kernels on the hardware fp8 conversion path, same checks, more shapes, each
  family under both implementations (the ``impl`` fixture: the Triton kernels, and on Hopper the Gluon ones);
  what is particular to the Gluon kernels is in test_gluon_kernels.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import mx_recipe.ops.mx_cast as mx_cast
from mx_recipe.formats.mx import MXTensor, to_mx
from mx_recipe.formats.scale_layout import blocked_numel, to_blocked, to_blocked_3d, to_blocked_groups
from mx_recipe.ops.mx_cast import (
    BlockedMXTensor,
    cast_dim0,
    cast_dim0_dim1,
    cast_dim1,
    cast_groups_dim1,
    fake_quant_along_m,
    fake_quant_dim0,
    fake_quant_dim0_dim1,
)

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()

interp_only = pytest.mark.skipif(not (INTERP and HAS_TRITON), reason="runs in the Triton interpreter child process")

DTYPES = [torch.bfloat16, torch.float32]
# on the GPU, fp32 input (which training never casts) runs in the full tier only: each case compiles kernels
GPU_DTYPES = [torch.bfloat16, pytest.param(torch.float32, marks=pytest.mark.slow)]
ELEMS = ["e4m3", "e5m2"]
FAKE_QUANT_ELEMS = [*ELEMS, "e2m1"]  # the Triton fake-quants take MXFP4 too
CAST_ELEMS = [*ELEMS, "e2m1"]  # and so do the Triton casts (packed codes)
MODES = ["floor", "rceil"]


# ---------------------------------------------------------------------------------------
# inputs and comparisons


def special_input(
    shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> torch.Tensor:
    """Random data over a wide dynamic range, with the cases the contract names planted where
    blocks along both the last and the second-to-last dim see them: NaN, +-inf, an all-zero
    block, fp32/bf16 subnormals, -0, the largest finite values (saturation under floor)."""
    g = torch.Generator().manual_seed(seed)
    *batch, m, k = shape
    x = torch.randn(*batch, m, k, generator=g)
    # per-row and per-column magnitudes from 2**-100 to 2**100: scale exponents near both ends
    x *= torch.exp2(torch.randint(-100, 100, (*batch, m, 1), generator=g).float())
    x *= torch.exp2(torch.randint(-8, 8, (*batch, 1, k), generator=g).float())
    x = x.to(dtype).to(torch.float32)
    if m >= 32 and k >= 96:
        x[..., 0, 0] = float("nan")
        x[..., 1, 33] = float("inf")
        x[..., 2, 34] = -float("inf")
        x[..., 3, 64:96] = 0.0  # an all-zero dim0 block
        x[..., 32:64, 64] = 0.0  # an all-zero dim1 block (if m >= 64)
        x[..., 4, 35:40] = torch.tensor([1e-39, -3e-40, 5e-45, -0.0, 2e-38])  # subnormals, -0
        x[..., 5, 40:44] = torch.tensor([3.3e38, -3.38e38, 1.0, 2.0**-126])  # near fp32 max
        x[..., 6:10, 70] = torch.tensor([448.0, 480.0, -57344.0, 61440.0])  # max normals, ties above them
    return x.to(dtype).to(device)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Compare raw bytes (NaN-safe, -0 vs +0 distinguished); report the first mismatch."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.contiguous().view(torch.uint8).cpu(), expected.contiguous().view(torch.uint8).cpu()
    bad = (a != e).nonzero()
    if len(bad):
        idx = tuple(bad[0].tolist())
        raise AssertionError(
            f"{what}: {len(bad)} bytes differ; first at {idx}: got {a[idx].item()}, want {e[idx].item()}"
        )


def check_mx(actual: MXTensor | BlockedMXTensor, expected: MXTensor, blocked_ref: torch.Tensor | None, what: str):
    assert actual.dim == expected.dim, f"{what}: dim {actual.dim} != {expected.dim}"
    assert actual.qdata.dtype == expected.qdata.dtype, what
    assert_bits_equal(actual.qdata, expected.qdata, f"{what} qdata")
    if blocked_ref is None:
        assert isinstance(actual, MXTensor)
        assert actual.scale.dtype == torch.float8_e8m0fnu
        assert_bits_equal(actual.scale, expected.scale, f"{what} scale")
    else:
        assert isinstance(actual, BlockedMXTensor)
        assert_bits_equal(actual.scale, blocked_ref, f"{what} blocked scale")
        assert_bits_equal(actual.unblocked().scale, expected.scale, f"{what} unblocked scale")


# ---------------------------------------------------------------------------------------
# the kernel checks, shared by the interpreter and GPU tests: they call a launcher directly (``impl``: "triton",
# the only one the interpreter runs, or "gluon" on a Hopper GPU), on CUDA and in the interpreter child alike

KERNEL_OPS = {
    "dim0": "cast_dim0",
    "dim1": "cast_dim1",
    "dim0_dim1": "cast_dim0_dim1",
    "groups_dim1": "cast_groups_dim1",
}


def _launch_all(name: str, impl: str = "triton"):
    """The raw launcher of one kernel (so interpreter tests exercise the kernels on CPU tensors)."""
    from mx_recipe.ops import dispatch

    return dispatch.launcher(KERNEL_OPS[name], impl)


def run_dim0(x: torch.Tensor, elem: str, mode: str, blocked: bool, impl: str = "triton"):
    q, s = _launch_all("dim0", impl)(x, elem, mode, blocked)
    shape = (*x.shape[:-1], x.shape[-1] // 32)
    return BlockedMXTensor(q, s, elem, x.dim() - 1, shape) if blocked else MXTensor(q, s, elem, x.dim() - 1)


def run_dim1(x: torch.Tensor, elem: str, mode: str, blocked: bool, impl: str = "triton"):
    q, s = _launch_all("dim1", impl)(x, elem, mode, blocked)
    shape = (*x.shape[:-2], x.shape[-1], x.shape[-2] // 32)
    return BlockedMXTensor(q, s, elem, x.dim() - 1, shape) if blocked else MXTensor(q, s, elem, x.dim() - 1)


def run_dim0_dim1(x: torch.Tensor, elem: str, mode: str, blocked: bool, impl: str = "triton"):
    q0, s0, q1, s1 = _launch_all("dim0_dim1", impl)(x, elem, mode, blocked)
    m, k = x.shape
    if blocked:
        return BlockedMXTensor(q0, s0, elem, 1, (m, k // 32)), BlockedMXTensor(q1, s1, elem, 1, (k, m // 32))
    return MXTensor(q0, s0, elem, 1), MXTensor(q1, s1, elem, 1)


def run_groups(x: torch.Tensor, offs: torch.Tensor, elem: str, mode: str, impl: str = "triton"):
    q, s = _launch_all("groups_dim1", impl)(x, offs, elem, mode)
    return BlockedMXTensor(q, s, elem, 1, (x.shape[1], x.shape[0] // 32), group_offs=offs)


def ref_scale_blocked(scale: torch.Tensor) -> torch.Tensor:
    return to_blocked(scale) if scale.dim() == 2 else to_blocked_3d(scale)


def check_dim0(shape, dtype, elem, mode, blocked, device, seed=0, impl="triton"):
    x = special_input(shape, dtype, device, seed)
    ref = to_mx(x.cpu(), elem, mode, dim=-1)
    out = run_dim0(x, elem, mode, blocked, impl)
    what = f"{impl} dim0 {shape} {dtype} {elem} {mode}"
    check_mx(out, ref, ref_scale_blocked(ref.scale) if blocked else None, what)


def check_dim1(shape, dtype, elem, mode, blocked, device, seed=0, impl="triton"):
    x = special_input(shape, dtype, device, seed)
    ref = to_mx(x.cpu().transpose(-2, -1).contiguous(), elem, mode, dim=-1)
    out = run_dim1(x, elem, mode, blocked, impl)
    what = f"{impl} dim1 {shape} {dtype} {elem} {mode}"
    check_mx(out, ref, ref_scale_blocked(ref.scale) if blocked else None, what)


def check_dim0_dim1(shape, dtype, elem, mode, blocked, device, seed=0, impl="triton"):
    x = special_input(shape, dtype, device, seed)
    ref0 = to_mx(x.cpu(), elem, mode, dim=-1)
    ref1 = to_mx(x.cpu().t().contiguous(), elem, mode, dim=-1)
    out0, out1 = run_dim0_dim1(x, elem, mode, blocked, impl)
    what = f"{impl} dim0_dim1 {shape} {dtype} {elem} {mode}"
    check_mx(out0, ref0, to_blocked(ref0.scale) if blocked else None, what + " (dim0)")
    check_mx(out1, ref1, to_blocked(ref1.scale) if blocked else None, what + " (dim1)")


def check_groups(group_sizes, k, dtype, elem, mode, device, seed=0, impl="triton"):
    offs = torch.tensor(group_sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
    m = int(offs[-1])
    x = special_input((m, k), dtype, device, seed)
    ref = to_mx(x.cpu().t().contiguous(), elem, mode, dim=-1)
    out = run_groups(x, offs.to(device), elem, mode, impl)
    what = f"{impl} groups {group_sizes} k={k} {dtype} {elem} {mode}"
    check_mx(out, ref, to_blocked_groups(ref.scale, offs), what)
    # each group's slice is that group's own dim1 cast (e2m1: two rows a byte)
    start, per_byte = 0, 2 if elem == "e2m1" else 1
    for end in offs.tolist():
        if end > start:
            ref_g = to_mx(x.cpu()[start:end].t().contiguous(), elem, mode, dim=-1)
            got_g = out.qdata[:, start // per_byte : end // per_byte]
            assert_bits_equal(got_g, ref_g.qdata, f"{what} group qdata [{start}, {end})")
        start = end


def assert_values_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Same NaN positions, and the same bits everywhere else (-0 vs +0 distinguished). NaN
    payloads are not compared: CPU and GPU multiplies produce different NaN bit patterns."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    nan_a, nan_e = actual.isnan().cpu(), expected.isnan().cpu()
    assert torch.equal(nan_a, nan_e), f"{what}: NaN positions differ"
    assert_bits_equal(actual.cpu().masked_fill(nan_a, 0), expected.cpu().masked_fill(nan_e, 0), what)


def ref_along_m(x: torch.Tensor, elem: str, mode: str) -> torch.Tensor:
    """x zero-padded along M to a multiple of 32, fake-quantized along M, in x's layout (row-major)."""
    x = x.cpu()
    pad = x.new_zeros(*x.shape[:-2], -x.shape[-2] % 32, x.shape[-1])
    xt = torch.cat([x, pad], dim=-2).transpose(-2, -1).contiguous()
    return to_mx(xt, elem, mode, dim=-1).dequantize(x.dtype).transpose(-2, -1).contiguous()


def check_fake_quant_2d(shape, dtype, elem, mode, device, seed=0, impl="triton"):
    """The fused fake-quant kernel (both outputs, and each alone) against the reference."""
    from mx_recipe.ops import dispatch

    x = special_input(shape, dtype, device, seed)
    launch = dispatch.launcher("fake_quant_2d", impl)
    ref_k = to_mx(x.cpu(), elem, mode, dim=-1).dequantize(dtype) if shape[-1] % 32 == 0 else None
    ref_m = ref_along_m(x, elem, mode)
    what = f"{impl} fake quant 2d {shape} {dtype} {elem} {mode}"
    if ref_k is not None:
        along_k, along_m = launch(x, elem, mode, True, True)
        assert_values_equal(along_k, ref_k, what + " along K")
        assert_values_equal(along_m, ref_m, what + " along M")
        along_k, along_m = launch(x, elem, mode, True, False)  # along K alone: fake_quant_dim0
        assert_values_equal(along_k, ref_k, what + " along K alone")
        assert along_m.numel() == 0
    along_k, along_m = launch(x, elem, mode, False, True)
    assert along_k.numel() == 0
    assert_values_equal(along_m, ref_m, what + " along M alone")


def group_sources(sizes: list[int], device) -> torch.Tensor:
    """row_src of token groups of ``sizes`` each padded to a multiple of 32 (-1 for padding rows)."""
    src, start = [], 0
    for size in sizes:
        src += list(range(start, start + size)) + [-1] * (-size % 32)
        start += size
    return torch.tensor(src + [-1] * 32, dtype=torch.int32, device=device)  # and a spare all-padding block


def ref_groups_along_m(x: torch.Tensor, src: torch.Tensor, elem: str, mode: str) -> torch.Tensor:
    """Each group padded (src), fake-quantized along M, and its rows put back in x's row order."""
    padded = torch.cat([x.cpu(), x.new_zeros(1, x.shape[1]).cpu()])[src.cpu().long()]
    fq = ref_along_m(padded, elem, mode)
    valid = src.cpu() >= 0
    out = torch.empty_like(fq[valid])
    out[src.cpu()[valid].long()] = fq[valid]
    return out


def check_fake_quant_groups_along_m(sizes, dtype, elem, mode, device, flip_first=False, impl="triton"):
    """The group-aware along-M fake-quant (MoE groups padded on the way, unpadded result) against
    pad, then the reference, then drop the padding rows. ``flip_first``: the first group's rows
    listed in reverse (each must still come back to its own row)."""
    from mx_recipe.ops import dispatch

    x = special_input((sum(sizes), 96), dtype, device, seed=len(sizes))
    src = group_sources(sizes, device)
    if flip_first:
        src[: sizes[0]] = src[: sizes[0]].flip(0)
    got = dispatch.launcher("fake_quant_groups_along_m", impl)(x, src, elem, mode)
    assert got.shape == x.shape
    what = f"{impl} groups along M {sizes} {dtype} {elem} {mode}"
    want = ref_groups_along_m(x, src, elem, mode)
    assert_values_equal(got, want, what)
    # fake_quant_groups: along K too, from the same read (each row to its own row, like along M)
    along_k, along_m = dispatch.launcher("fake_quant_groups", impl)(x, src, elem, mode)
    assert_values_equal(along_m, want, what + " (with along K)")
    want_k = to_mx(x.cpu(), elem, mode, dim=-1).dequantize(dtype)
    assert_values_equal(along_k, want_k, what + " along K")
    if impl == "triton" and x.shape[0]:  # the routed rows read from tokens through their indices (Triton's kernel)
        from mx_kernels.mx.fake_quant_2d import fake_quant_routed_groups

        perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1)).to(x.device)
        tokens = torch.cat([x[perm], x[:3]])  # shuffled, and rows no group reads
        routed = torch.argsort(perm)  # tokens[routed] == x
        along_k, along_m = fake_quant_routed_groups(tokens, routed, src, elem, mode)
        assert_values_equal(along_m, want, what + " routed")
        assert_values_equal(along_k, want_k, what + " routed, along K")


# ---------------------------------------------------------------------------------------
# CPU, this process


def test_dispatch_reference_path_types():
    x = special_input((64, 96), torch.bfloat16, "cpu")
    a = cast_dim0(x, "e4m3", "rceil")
    assert isinstance(a, MXTensor) and a.qdata.shape == (64, 96) and a.scale.shape == (64, 3)
    b = cast_dim1(x, "e5m2", "floor", blocked_scales=True)
    assert isinstance(b, BlockedMXTensor) and b.qdata.shape == (96, 64) and b.scale.shape == (blocked_numel(96, 2),)
    check_mx(b, to_mx(x.t().contiguous(), "e5m2", "floor"), to_blocked(to_mx(x.t().contiguous(), "e5m2").scale), "b")
    w = special_input((2, 64, 96), torch.float32, "cpu")
    c = mx_cast.cast_3d_dim1(w, blocked_scales=True)
    assert c.qdata.shape == (2, 96, 64) and c.scale.shape == (2, blocked_numel(96, 2))
    d0, d1 = cast_dim0_dim1(x, "e2m1")  # the reference on the CPU
    assert d0.qdata.shape == (64, 48) and d1.qdata.shape == (96, 32)


def test_offs_validation():
    x = torch.randn(96, 64)
    ok = torch.tensor([32, 32, 96], dtype=torch.int32)
    cast_groups_dim1(x, ok)
    with pytest.raises(ValueError, match="int32"):
        cast_groups_dim1(x, ok.long())
    with pytest.raises(ValueError, match="non-decreasing"):
        cast_groups_dim1(x, torch.tensor([64, 32, 96], dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of 32"):
        cast_groups_dim1(x, torch.tensor([48, 96], dtype=torch.int32))
    with pytest.raises(ValueError, match="M_total = 96"):
        cast_groups_dim1(x, torch.tensor([32, 64], dtype=torch.int32))
    with pytest.raises(ValueError, match="non-empty"):
        cast_groups_dim1(x, torch.tensor([], dtype=torch.int32))


def test_kernel_argument_errors():
    from mx_kernels.common import check_cast

    x = torch.randn(33, 64)
    with pytest.raises(ValueError, match=r"dim 0 of shape \(33, 64\) has size 33"):
        check_cast(x, "e4m3", "floor", ndims=(2,), qdim=-2, op="cast_dim1")
    check_cast(x, "e4m3", "floor", ndims=(2,), qdim=-1, op="cast_dim0")  # 33 rows are fine along K
    with pytest.raises(ValueError, match="e2m1 is not supported"):
        check_cast(x, "e2m1", "floor", ndims=(2,), qdim=-1, op="cast_dim0")
    with pytest.raises(ValueError, match="unknown MX element format"):
        check_cast(x, "e3m4", "floor", ndims=(2,), qdim=-1, op="cast_dim0")
    with pytest.raises(ValueError, match="unknown MX scale rule"):
        check_cast(x, "e4m3", "ceil", ndims=(2,), qdim=-1, op="cast_dim0")
    with pytest.raises(TypeError, match="bf16 or fp32"):
        check_cast(x.half(), "e4m3", "floor", ndims=(2,), qdim=-1, op="cast_dim0")
    with pytest.raises(ValueError, match="2D or 3D"):
        check_cast(torch.randn(32), "e4m3", "floor", ndims=(2, 3), qdim=-1, op="cast_dim0")
    with pytest.raises(ValueError, match="has size 33"):
        cast_dim1(torch.randn(33, 64))  # the reference path raises the same error


def test_fake_impls_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(96, 160, dtype=torch.bfloat16)
        q, s = torch.ops.mx_recipe.cast_dim0(x, "e4m3", "floor", True)
        assert q.shape == (96, 160) and q.dtype == torch.float8_e4m3fn and s.shape == (blocked_numel(96, 5),)
        q, s = torch.ops.mx_recipe.cast_dim1(x, "e5m2", "rceil", False)
        assert q.shape == (160, 96) and q.dtype == torch.float8_e5m2 and s.shape == (160, 3)
        w = torch.empty(4, 96, 160)
        q, s = torch.ops.mx_recipe.cast_dim1(w, "e4m3", "floor", True)
        assert q.shape == (4, 160, 96) and s.shape == (4, blocked_numel(160, 3))
        outs = torch.ops.mx_recipe.cast_dim0_dim1(x, "e4m3", "floor", False)
        assert [tuple(t.shape) for t in outs] == [(96, 160), (96, 5), (160, 96), (160, 3)]
        offs = torch.empty(3, dtype=torch.int32)
        q, s = torch.ops.mx_recipe.cast_groups_dim1(x, "e4m3", "floor", offs)
        assert q.shape == (160, 96) and s.shape == (256 * 4 * (1 + 3),)
        a, b = torch.ops.mx_recipe.fake_quant_2d(w, "e5m2", "rceil", True, False)
        assert a.shape == (4, 96, 160) and a.dtype == torch.float32 and b.numel() == 0
        a, b = torch.ops.mx_recipe.fake_quant_2d(x, "e4m3", "floor", True, True)
        assert a.shape == (96, 160) and b.shape == (96, 160) and a.dtype == b.dtype == torch.bfloat16
        a, b = torch.ops.mx_recipe.fake_quant_2d(torch.empty(2, 40, 48), "e4m3", "rceil", False, True)
        assert a.numel() == 0 and b.shape == (2, 64, 48) and b.dtype == torch.float32


def test_fake_quant_groups_along_m_reference_path_and_errors():
    """Off CUDA: pad, fake_quant_along_m, unpad; a row_src that is not a padded layout of x's rows is
    named in the error; the fake implementation gives x's shape."""
    from mx_recipe.ops.mx_cast import fake_quant_groups_along_m

    x = special_input((70, 64), torch.bfloat16, "cpu")
    src = group_sources([40, 0, 30], "cpu")
    want = ref_groups_along_m(x, src, "e4m3", "rceil")
    assert_values_equal(fake_quant_groups_along_m(x, src, "e4m3", "rceil"), want, "ref")
    # the same padded layout with the rows listed in another order: each row still comes back to its place
    perm = src.clone()
    perm[:40] = src[:40].flip(0)
    got = fake_quant_groups_along_m(x, perm, "e4m3", "rceil")
    assert_values_equal(got, ref_groups_along_m(x, perm, "e4m3", "rceil"), "rows listed out of order")
    with pytest.raises(ValueError, match="multiple of 32"):
        fake_quant_groups_along_m(x, src[:40], "e4m3", "floor")
    with pytest.raises(ValueError, match="1D int32"):
        fake_quant_groups_along_m(x, src.long(), "e4m3", "floor")
    for bad in (
        torch.full((96,), -1, dtype=torch.int32),
        torch.where(src == 5, 6, src),
        torch.where(src == -1, -2, src),
    ):
        with pytest.raises(ValueError, match="must list each of x's 70 rows once"):
            fake_quant_groups_along_m(x, bad, "e4m3", "floor")
    y = torch.ops.mx_recipe.fake_quant_groups_along_m(x.to("meta"), "e4m3", "floor", src.to("meta"))
    assert y.shape == (70, 64) and y.dtype == torch.bfloat16  # the fake implementation


def test_fake_quant_reference_path():
    """Off CUDA the dispatch layer's fake quant is the reference's dequantize, in the input dtype."""
    x = special_input((96, 160), torch.bfloat16, "cpu")
    assert_values_equal(fake_quant_dim0(x), to_mx(x).dequantize(torch.bfloat16), "cpu fake quant dim0")
    w = special_input((2, 64, 96), torch.float32, "cpu")
    assert_values_equal(fake_quant_dim0(w, "e5m2"), to_mx(w, "e5m2").dequantize(torch.float32), "cpu 3D fp32")


def test_fake_quant_along_m_and_dim0_dim1_reference_path():
    """Off CUDA: fake_quant_along_m is the reference along M of the zero-padded input, in a
    row-major [Mp, K]; fake_quant_dim0_dim1 is the pair (dim0, along M)."""
    for shape in [(96, 160), (40, 64), (2, 70, 96)]:
        x = special_input(shape, torch.bfloat16, "cpu")
        along_m = fake_quant_along_m(x, "e5m2", "rceil")
        assert along_m.is_contiguous() and along_m.shape[-2] == -(-shape[-2] // 32) * 32
        assert_values_equal(along_m, ref_along_m(x, "e5m2", "rceil"), f"along m {shape}")
        d0, dm = fake_quant_dim0_dim1(x, "e4m3", "floor")
        assert_values_equal(d0, fake_quant_dim0(x, "e4m3", "floor"), f"dim0 of pair {shape}")
        assert_values_equal(dm, ref_along_m(x, "e4m3", "floor"), f"along m of pair {shape}")


class _GraphCaptured(Exception):
    pass


def traced_ops(f, *args, name: str = "mx_recipe") -> list[str]:
    """The ``name`` ops of the one graph torch.compile(fullgraph=True) traces for f(*args); the backend stops
    before anything runs, so no kernel (and no Triton) is needed: shapes come from the fake implementations."""
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)

        def stop(*args):
            raise _GraphCaptured

        return stop

    torch._dynamo.reset()
    with pytest.raises(_GraphCaptured):
        torch.compile(f, backend=backend, fullgraph=True)(*args)
    assert len(graphs) == 1
    return [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function" and name in str(n.target)]


def test_ops_trace_fullgraph_without_running():
    def f(x, w, offs):
        a = torch.ops.mx_recipe.cast_dim0(x, "e4m3", "rceil", True)
        b = torch.ops.mx_recipe.cast_dim0_dim1(x, "e5m2", "floor", False)
        c = torch.ops.mx_recipe.cast_dim1(w, "e4m3", "floor", True)
        d = torch.ops.mx_recipe.cast_groups_dim1(x, "e4m3", "floor", offs)
        return a[0].float().sum() + b[2].float().sum(), a[1], c, d

    args = torch.randn(96, 160), torch.randn(2, 64, 96), torch.tensor([32, 96], dtype=torch.int32)
    ops = traced_ops(f, *args)
    assert len(ops) == 4, ops


def run_interpreter_tests(test_file: str) -> None:
    """Run ``test_file``'s test_interp_* tests in a child pytest with TRITON_INTERPRET=1; none may skip."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", "interp_"]
    proc = subprocess.run(cmd, env=env, cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-3000:]


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="this is the parent of the interpreter run")
def test_kernels_in_triton_interpreter():
    """Run the test_interp_* tests in a child pytest with TRITON_INTERPRET=1 (see module doc)."""
    run_interpreter_tests(__file__)


# ---------------------------------------------------------------------------------------
# CPU, Triton interpreter (child process): the kernels with SOFTWARE_ROUND


@interp_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("elem", CAST_ELEMS)
@pytest.mark.parametrize("mode", MODES)
def test_interp_all_kernels(dtype, elem, mode):
    for blocked in (False, True):
        check_dim0((96, 160), dtype, elem, mode, blocked, "cpu")
        check_dim1((96, 160), dtype, elem, mode, blocked, "cpu")
        check_dim0_dim1((64, 96), dtype, elem, mode, blocked, "cpu")
    check_groups([32, 0, 160, 0, 64], 96, dtype, elem, mode, "cpu")


@interp_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("elem", FAKE_QUANT_ELEMS)
@pytest.mark.parametrize("mode", MODES)
def test_interp_fake_quant(dtype, elem, mode):
    check_fake_quant_2d((96, 160), dtype, elem, mode, "cpu")
    check_fake_quant_2d((2, 64, 96), dtype, elem, mode, "cpu")


@interp_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("elem", FAKE_QUANT_ELEMS)
@pytest.mark.parametrize("mode", MODES)
def test_interp_fake_quant_2d_ragged(dtype, elem, mode):
    check_fake_quant_2d((2, 70, 96), dtype, elem, mode, "cpu")  # M not a multiple of 32: along M zero-pads
    check_fake_quant_2d((40, 80), dtype, elem, mode, "cpu")  # K not a multiple of 32: along M only


@interp_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("elem", FAKE_QUANT_ELEMS)
@pytest.mark.parametrize("mode", MODES)
def test_interp_fake_quant_groups_along_m(dtype, elem, mode):
    check_fake_quant_groups_along_m([40, 0, 33, 1, 64], dtype, elem, mode, "cpu")
    check_fake_quant_groups_along_m([0, 0], dtype, elem, mode, "cpu")  # no tokens: all padding
    check_fake_quant_groups_along_m([45, 3], dtype, elem, mode, "cpu", flip_first=True)


@interp_only
def test_interp_fake_quant_2d_strided_and_errors():
    import mx_kernels.mx.fake_quant_2d

    x = special_input((160, 96), torch.bfloat16, "cpu").t()  # [96, 160], column-major
    along_k, along_m = mx_kernels.mx.fake_quant_2d.fake_quant_2d(x, "e4m3", "floor", True, True)
    assert_values_equal(along_k, to_mx(x.contiguous(), "e4m3", "floor").dequantize(torch.bfloat16), "strided K")
    assert_values_equal(along_m, ref_along_m(x, "e4m3", "floor"), "strided M")
    with pytest.raises(ValueError, match="ask for along_k, along_m or both"):
        mx_kernels.mx.fake_quant_2d.fake_quant_2d(x, "e4m3", "floor", False, False)
    with pytest.raises(ValueError, match="multiple of the block size"):
        mx_kernels.mx.fake_quant_2d.fake_quant_2d(torch.zeros(32, 48), "e4m3", "floor", True, True)


@interp_only
def test_interp_ragged_3d_and_strided():
    check_dim0((33, 96), torch.bfloat16, "e4m3", "rceil", True, "cpu")  # 33 rows: fine along K
    check_dim0((2, 40, 64), torch.bfloat16, "e4m3", "floor", True, "cpu")
    check_dim1((3, 64, 96), torch.float32, "e5m2", "rceil", True, "cpu")
    check_dim1((1, 32, 32), torch.bfloat16, "e4m3", "floor", False, "cpu")
    check_dim0((2, 40, 64), torch.bfloat16, "e2m1", "rceil", True, "cpu")  # packed e2m1, 3D, ragged rows
    check_dim1((3, 64, 96), torch.float32, "e2m1", "floor", False, "cpu")
    x = special_input((96, 64), torch.bfloat16, "cpu").t()  # non-contiguous: read through strides
    q, s = _launch_all("dim0")(x, "e4m3", "floor")
    ref = to_mx(x, "e4m3", "floor")
    assert_bits_equal(q, ref.qdata, "strided dim0 qdata")
    assert_bits_equal(s, ref.scale, "strided dim0 scale")
    with pytest.raises(ValueError, match=r"dim 0 of shape \(33, 64\)"):
        _launch_all("dim1")(torch.randn(33, 64), "e4m3", "floor")


@interp_only
def test_interp_every_bf16_value_rounds_like_the_reference():
    """All 65536 bf16 bit patterns, in blocks that share one scale, through the software rounding."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).reshape(-1, 32 * 16)  # [128, 512]: 16 blocks per row
    for elem in ELEMS:
        for mode in MODES:
            q, s = _launch_all("dim0")(x, elem, mode)
            ref = to_mx(x, elem, mode)
            assert_bits_equal(q, ref.qdata, f"all bf16 {elem} {mode} qdata")
            assert_bits_equal(s, ref.scale, f"all bf16 {elem} {mode} scale")


@interp_only
def test_interp_every_bf16_value_fake_quantizes_like_the_reference_in_e2m1():
    import mx_kernels.mx.fake_quant_2d

    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).reshape(-1, 32 * 16)
    for mode in MODES:
        along_k, along_m = mx_kernels.mx.fake_quant_2d.fake_quant_2d(x, "e2m1", mode, True, True)
        assert_values_equal(along_k, to_mx(x, "e2m1", mode).dequantize(torch.bfloat16), f"all bf16 e2m1 {mode} K")
        assert_values_equal(along_m, ref_along_m(x, "e2m1", mode), f"all bf16 e2m1 {mode} M")


@interp_only
def test_interp_opcheck():
    x = torch.randn(64, 96, dtype=torch.bfloat16)  # no NaN: opcheck compares outputs by value
    torch.library.opcheck(torch.ops.mx_recipe.cast_dim0.default, (x, "e4m3", "floor", True))
    torch.library.opcheck(torch.ops.mx_recipe.cast_dim0_dim1.default, (x, "e5m2", "rceil", False))
    src = group_sources([40, 0, 24], "cpu")
    torch.library.opcheck(torch.ops.mx_recipe.fake_quant_groups_along_m.default, (x, "e4m3", "floor", src))
    torch.library.opcheck(torch.ops.mx_recipe.fake_quant_2d.default, (x, "e4m3", "rceil", True, True))


# [rows, cols] scale matrices for unblock_scales: exact tiles, row and column padding, one byte
UNBLOCK_SHAPES = [(128, 4), (1, 1), (130, 5), (300, 160), (128, 132), (4096, 36)]


def check_unblock_scales(rows: int, cols: int, experts: int | None, device: str) -> None:
    """unblock_scales == scale_layout.from_blocked (1D) / from_blocked_3d ([E, n]), byte for byte."""
    from mx_kernels.mx.unblock_scales import unblock_scales

    from mx_recipe.formats.scale_layout import from_blocked, from_blocked_3d

    g = torch.Generator().manual_seed(rows * 7 + cols)
    plain = torch.randint(0, 256, (experts or 1, rows, cols), dtype=torch.uint8, generator=g)
    plain = plain.view(torch.float8_e8m0fnu)
    blocked = to_blocked_3d(plain) if experts is not None else to_blocked(plain[0])
    got = unblock_scales(blocked.to(device), rows, cols)
    want = from_blocked_3d(blocked, rows, cols) if experts is not None else from_blocked(blocked, rows, cols)
    assert got.dtype == torch.float8_e8m0fnu and got.shape == want.shape
    assert_bits_equal(got, want, f"unblock_scales {experts} x [{rows}, {cols}]")
    assert_bits_equal(got, plain if experts is not None else plain[0], "unblock_scales round trip")


@interp_only
@pytest.mark.parametrize("rows, cols", UNBLOCK_SHAPES)
def test_interp_unblock_scales(rows, cols):
    for experts in (None, 1, 3):
        check_unblock_scales(rows, cols, experts, "cpu")
    check_unblock_scales(rows, cols, 0, "cpu")  # no experts: nothing launched


def test_unblock_scales_rejects_a_wrong_size():
    pytest.importorskip("triton")
    from mx_kernels.mx.unblock_scales import unblock_scales

    with pytest.raises(ValueError, match=r"does not hold 1 blocked \[128, 4\] matrices"):
        unblock_scales(torch.zeros(100, dtype=torch.uint8), 128, 4)
    with pytest.raises(ValueError, match=r"does not hold 2 blocked"):
        unblock_scales(torch.zeros(2, 1024, dtype=torch.uint8), 128, 4)
    with pytest.raises(ValueError, match="1D or \\[E, n\\]"):
        unblock_scales(torch.zeros(1, 1, 512, dtype=torch.uint8), 128, 4)


# ---------------------------------------------------------------------------------------
# GPU: the hardware cvt.rn.satfinite path, each kernel family under both implementations

IMPLS = ["gluon", "triton"]


@pytest.fixture(params=IMPLS)
def impl(request) -> Iterator[str]:
    """The implementation under test: its launchers are called directly, and the kernel setting ``gluon`` makes
    the public API's dispatch pick it too. The Gluon kernels are Hopper's: elsewhere that case skips."""
    from mx_recipe.ops import kernel_settings

    if request.param == "gluon" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels run on compute capability 9.x (Hopper)")
    with kernel_settings(gluon=request.param == "gluon"):
        yield request.param


def skip_fp4_on_gluon(elem: str, impl: str, along_m_of_bf16: bool = False) -> None:
    if elem == "e2m1" and impl == "gluon" and not along_m_of_bf16:
        pytest.skip("the Gluon kernels write fp8, and e2m1 along M of bf16; the rest runs on the Triton kernels")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("elem", CAST_ELEMS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("kernel", ["dim0", "dim1", "dim0_dim1", "3d_dim0", "3d_dim1"])
def test_gpu_bit_exact(kernel, blocked, mode, elem, dtype, impl):
    skip_fp4_on_gluon(elem, impl, kernel in ("dim1", "3d_dim1") and dtype == torch.bfloat16)
    if kernel == "dim0":
        for shape in [(96, 160), (4128, 160), (33, 96), (1000, 4096)]:
            check_dim0(shape, dtype, elem, mode, blocked, "cuda", impl=impl)
    elif kernel == "dim1":
        for shape in [(96, 160), (4128, 160), (160, 4128), (1024, 4096)]:
            check_dim1(shape, dtype, elem, mode, blocked, "cuda", impl=impl)
    elif kernel == "dim0_dim1":
        for shape in [(96, 160), (4128, 160), (160, 4128), (1024, 4096)]:
            check_dim0_dim1(shape, dtype, elem, mode, blocked, "cuda", impl=impl)
    elif kernel == "3d_dim0":
        for shape in [(1, 96, 160), (3, 200, 96), (5, 128, 256)]:
            check_dim0(shape, dtype, elem, mode, blocked, "cuda", impl=impl)
    else:
        for shape in [(1, 96, 160), (3, 224, 96), (5, 128, 256)]:
            check_dim1(shape, dtype, elem, mode, blocked, "cuda", impl=impl)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("elem", CAST_ELEMS)
@pytest.mark.parametrize("mode", MODES)
def test_gpu_groups_bit_exact(mode, elem, dtype, impl):
    skip_fp4_on_gluon(elem, impl)
    # (the Gluon kernel's tile follows the average group size: these cases run both of its tiles)
    check_groups([32, 0, 160, 0, 64], 96, dtype, elem, mode, "cuda", impl=impl)
    check_groups([0, 0, 4096, 256, 32, 0], 160, dtype, elem, mode, "cuda", impl=impl)
    check_groups([128] * 7 + [96], 4128, dtype, elem, mode, "cuda", seed=1, impl=impl)
    check_groups([2048, 0, 1056], 256, dtype, elem, mode, "cuda", seed=2, impl=impl)
    # plain scales: the dim1 cast, through the public API's dispatch
    offs = torch.tensor([64, 64, 192], dtype=torch.int32, device="cuda")
    x = special_input((192, 96), dtype, "cuda")
    out = cast_groups_dim1(x, offs, elem, mode)
    check_mx(out, to_mx(x.cpu().t().contiguous(), elem, mode), None, f"{impl} groups plain")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("elem", FAKE_QUANT_ELEMS)
@pytest.mark.parametrize("mode", MODES)
def test_gpu_fake_quant_2d_bit_exact(mode, elem, impl):
    from mx_recipe.ops import dispatch

    skip_fp4_on_gluon(elem, impl)
    for shape in [(96, 160), (4130, 160), (160, 4128), (1024, 4096), (3, 224, 96), (5, 100, 256), (64, 80)]:
        check_fake_quant_2d(shape, torch.bfloat16, elem, mode, "cuda", impl=impl)
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).reshape(-1, 32 * 16)
    launch = dispatch.launcher("fake_quant_2d", impl)
    for t in (x, x.reshape(32 * 16, -1)):  # every bf16 value in blocks along K, then along M
        along_k, along_m = launch(t.cuda(), elem, mode, True, True)
        what = f"{impl} all bf16 {elem} {mode}"
        assert_values_equal(along_k, to_mx(t, elem, mode).dequantize(torch.bfloat16), f"{what} along K")
        assert_values_equal(along_m, ref_along_m(t, elem, mode), f"{what} along M")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("elem", FAKE_QUANT_ELEMS)
@pytest.mark.parametrize("mode", MODES)
def test_gpu_fake_quant_groups_along_m_bit_exact(mode, elem, impl):
    skip_fp4_on_gluon(elem, impl)
    for sizes in ([40, 0, 33, 1, 64], [1040] * 4 + [0, 7], [0, 0], [4096], [100, 3, 0, 29]):
        check_fake_quant_groups_along_m(sizes, torch.bfloat16, elem, mode, "cuda", impl=impl)
    check_fake_quant_groups_along_m([45, 3], torch.bfloat16, elem, mode, "cuda", flip_first=True, impl=impl)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_fake_quant_fp32_refused_by_kernel_and_exact_through_dispatch(impl):
    """The fp32 GPU fake-quant path gave wrong values on an H200: both launchers refuse it and the
    dispatch takes the reference, so fp32 results stay exact."""
    from mx_recipe.ops import dispatch

    x = special_input((96, 160), torch.float32, "cuda")
    with pytest.raises(NotImplementedError, match="takes bf16 input"):
        dispatch.launcher("fake_quant_2d", impl)(x, "e4m3", "floor", True, False)
    assert dispatch.implementation("fake_quant_2d", x, "e4m3") == "reference"
    ref = to_mx(x.cpu(), "e4m3", "floor").dequantize(torch.float32)
    assert_values_equal(fake_quant_dim0(x, "e4m3", "floor"), ref, "fp32 dispatch")
    assert_values_equal(fake_quant_along_m(x, "e4m3", "floor"), ref_along_m(x, "e4m3", "floor"), "fp32 along M")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_every_bf16_value_and_rejections(impl):
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).reshape(-1, 32 * 16)
    for elem in ELEMS:
        for mode in MODES:
            ref0, ref1 = to_mx(x, elem, mode), to_mx(x.t().contiguous(), elem, mode)
            what = f"{impl} all bf16 {elem} {mode}"
            check_mx(run_dim0(x.cuda(), elem, mode, False, impl), ref0, None, f"{what} dim0")
            check_mx(run_dim1(x.cuda(), elem, mode, False, impl), ref1, None, f"{what} dim1")
            out0, out1 = run_dim0_dim1(x.cuda(), elem, mode, True, impl)
            check_mx(out0, ref0, to_blocked(ref0.scale), f"{what} fused (dim0)")
            check_mx(out1, ref1, to_blocked(ref1.scale), f"{what} fused (dim1)")
    for mode in MODES:  # e2m1 along M: a Gluon kernel too
        ref = to_mx(x.t().contiguous(), "e2m1", mode)
        check_mx(run_dim1(x.cuda(), "e2m1", mode, False, impl), ref, None, f"{impl} all bf16 e2m1 {mode} dim1")
    with pytest.raises(ValueError, match=r"dim 0 of shape \(33, 64\) has size 33"):
        cast_dim1(torch.randn(33, 64, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dim 1 of shape"):
        mx_cast.cast_3d_dim1(torch.randn(2, 33, 64, device="cuda", dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_strided_input_and_compile(impl):
    from mx_recipe.ops import dispatch

    x = special_input((256, 512), torch.bfloat16, "cuda")
    assert dispatch.implementation("cast_dim0_dim1", x, "e4m3") == impl  # the public API runs this implementation
    xt = x.t()  # non-contiguous [512, 256]
    check_mx(cast_dim0(xt, "e4m3", "rceil"), to_mx(xt.cpu(), "e4m3", "rceil"), None, f"{impl} strided dim0")
    check_mx(cast_dim1(xt, "e4m3", "rceil"), to_mx(x.cpu(), "e4m3", "rceil"), None, f"{impl} strided dim1")

    def f(x):
        a, b = cast_dim0_dim1(x, "e4m3", "floor", blocked_scales=True)
        return a.qdata, a.scale, b.qdata, b.scale

    torch._dynamo.reset()
    outs = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    ref0, ref1 = to_mx(x.cpu(), "e4m3", "floor"), to_mx(x.cpu().t().contiguous(), "e4m3", "floor")
    assert_bits_equal(outs[0], ref0.qdata, f"{impl} compiled q0")
    assert_bits_equal(outs[1], to_blocked(ref0.scale), f"{impl} compiled s0")
    assert_bits_equal(outs[2], ref1.qdata, f"{impl} compiled q1")
    assert_bits_equal(outs[3], to_blocked(ref1.scale), f"{impl} compiled s1")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows, cols", UNBLOCK_SHAPES + [(16384, 512), (512, 16384)])
def test_gpu_unblock_scales(rows, cols):
    for experts in (None, 3):
        check_unblock_scales(rows, cols, experts, "cuda")


def _capture_cast_launches(monkeypatch, module=None) -> list:
    """Make a cast launcher module (``triton_casts`` by default) record ((grid, kwargs), x_ptr) of its launches
    instead of launching, taking the GPU's path (no interpreter rounding) on CPU or meta tensors."""
    from mx_kernels.mx import casts as triton_casts

    module = module or triton_casts
    launches = []

    class Capture:
        def launch_keyed(self, key, build, **kwargs):
            launches.append((build(), kwargs["x_ptr"]))

    monkeypatch.setattr(module, "_LAUNCHES", Capture())
    monkeypatch.setattr(module, "software_round", lambda x, op: False)  # as on the GPU
    return launches


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="compiles with Triton's CUDA backend")
@pytest.mark.parametrize("arch", [90, 100])
def test_e2m1_casts_compile_for_hopper_and_blackwell(arch, monkeypatch):
    """What the interpreter cannot check: the packed e2m1 casts (dim0, dim1, both; one-sided stochastically too;
    per group; blocked scales) compile to cubin with the arguments their launcher builds, and a bf16 x to nearest
    is read as int32 words and rounded in packed bf16 (``mx_quantize.e2m1_words_along_k`` and
    ``e2m1_words_along_m``; the GPU tests check their bits). Along M alone, and per group, each lane loads 2 words
    of every row, so that it holds whole columns as loaded: no warp shuffle, one 8-byte load a row."""
    from mx_kernels.gluon.common import compile_for_arch
    from mx_kernels.mx import cast_groups_dim1
    from mx_kernels.mx import casts as triton_casts

    launches = _capture_cast_launches(monkeypatch)
    x = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")
    seed = torch.empty(1, dtype=torch.int64, device="meta")
    for dim0, dim1, stochastic in ((True, False, False), (False, True, False), (True, True, False), (True, False, True),
                                   (False, True, True)):  # fmt: skip
        launches.clear()
        triton_casts._cast(x, "e2m1", "floor", True, dim0, dim1, "cast", seed if stochastic else None)
        (_, kwargs), _ = launches[0]
        ptx = compile_for_arch(triton_casts._cast_kernel, kwargs, arch).asm["ptx"]
        # the word path rounds in packed bf16 (exact: the scaled values are bf16); stochastically in fp32, Philox's
        # products as wide multiplies (along K capped at 80 registers for them)
        assert ("add.rn.bf16x2" in ptx) == (not stochastic) == kwargs["WORDS"], (dim0, dim1, stochastic)
        assert ("mul.wide.u32 t, " in ptx) == stochastic, (dim0, dim1, stochastic)
        assert kwargs.get("maxnreg") == (80 if stochastic and dim0 else None), (dim0, dim1, stochastic)
        if kwargs["LANE_WORDS"]:
            assert (dim0, dim1) == (False, True)
            assert "shfl.sync" not in ptx
            assert ptx.count("ld.global.v2.b32") == 32 * kwargs["NUM_SUB"] and "ld.global.v4" not in ptx
            # each of a lane's 2 * LANE_WORDS columns stores its NUM_SUB * 16 bytes of codes 16 at a time
            assert ptx.count("st.global.v4.b32") == 2 * kwargs["LANE_WORDS"] * kwargs["NUM_SUB"]
    group_launches = _capture_cast_launches(monkeypatch, cast_groups_dim1)
    cast_groups_dim1.cast_groups_dim1(x, torch.empty(8, dtype=torch.int32, device="meta"), "e2m1", "floor")
    (((_, kwargs), _),) = group_launches
    ptx = compile_for_arch(cast_groups_dim1._cast_groups_dim1_kernel, kwargs, arch).asm["ptx"]
    assert kwargs["WORDS"] and "add.rn.bf16x2" in ptx  # per group along M: the word path, whole columns as loaded
    assert ptx.count("ld.global.v2.b32") == kwargs["ROWS"] and "ld.global.v4" not in ptx


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="builds launch arguments only")
def test_e2m1_cast_reads_bf16_as_words(monkeypatch):
    """The launch arguments of the packed e2m1 casts on the GPU: bf16 to nearest is read as int32 words, along K,
    along M and both (x's sizes, not the words', set the grid and M, K; along M alone each lane loads 2 words a
    row); fp32, stochastic rounding and a view whose words would straddle elements take x as it is."""
    from mx_kernels.mx import casts as triton_casts

    launches = _capture_cast_launches(monkeypatch)
    x = torch.randn(96, 1040, dtype=torch.bfloat16)
    seed = torch.zeros(1, dtype=torch.int64)
    cases = {
        "dim0": (x, True, False, None, True),
        "dim0 3D": (x.reshape(2, 48, 1040), True, False, None, True),
        "dim1": (x, False, True, None, True),
        "dim1 3D": (x.reshape(3, 32, 1040), False, True, None, True),
        "dim0_dim1": (x, True, True, None, True),
        "dim1 stochastic": (x, False, True, seed, False),
        "dim0 fp32": (x.float(), True, False, None, False),
        "dim0 stochastic": (x, True, False, seed, False),
        "dim0 odd offset": (torch.randn(96 * 1040 + 1).to(torch.bfloat16)[1:].view(96, 1040), True, False, None, False),
    }
    for name, (t, dim0, dim1, s, words) in cases.items():
        launches.clear()
        triton_casts._cast(t, "e2m1", "floor", False, dim0, dim1, name, s)
        (grid, kwargs), x_ptr = launches[0]
        assert kwargs["WORDS"] is words and (x_ptr.dtype == torch.int32) is words, name
        assert (kwargs["M"], kwargs["K"]) == tuple(t.shape[-2:]), name
        assert grid[:2] == (-(-t.shape[-2] // (32 * kwargs["NUM_SUB"])), -(-t.shape[-1] // kwargs["BLOCK_K"])), name
        if words:
            assert kwargs["stride_xm"] == t.stride(-2) // 2 and x_ptr.data_ptr() == t.data_ptr(), name
        assert kwargs["LANE_WORDS"] == (2 if words and not dim0 else 0), name


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="compiles with Triton's CUDA backend")
def test_fake_quant_along_m_holds_whole_blocks_in_each_thread():
    """The MX fake-quant along M (plain and gathered token groups, rounding to nearest) moves the blocks' rows
    into threads (``mx_quantize.column_blocks``): the blocks' maxima need no warp shuffles (as loaded, 18 a
    tile). With stochastic rounding the rows stay as loaded, where the row-major draws are."""
    from mx_kernels.gluon.common import compile_for_arch
    from mx_kernels.mx import fake_quant_2d

    x = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")
    out = torch.empty(16, dtype=torch.bfloat16, device="meta")
    row_src = torch.empty(16, dtype=torch.int32, device="meta")
    for src in (None, row_src):
        along_m_only = (False, True, 4096, 4096, False, None)  # along_k, along_m, m, m_pad, software, seed
        _, kwargs = fake_quant_2d._kernel_launch(x, src, out, out, "e2m1", "floor", *along_m_only)
        ptx = compile_for_arch(fake_quant_2d._fake_quant_2d_kernel, kwargs, 90).asm["ptx"]
        assert "shfl.sync" not in ptx, f"gathered={src is not None}: the blocks' rows span threads"
