"""The Gluon MXFP4 cast along M (mx_kernels.gluon.e2m1_casts): what is particular to it.

Its bits against ``to_mx`` (special values, every bf16 value, 2D and 3D, both scale rules, plain and blocked scales)
are checked with the other casts' in test_cast_kernels.py (``impl`` "gluon", e2m1 along M). Here:

* CPU: launch facts from ``kernel_launch`` on meta tensors (grid, word strides, EVEN, OFFS64, BATCHED), argument
  errors, and the kernel compiled for sm_90 without a GPU: 16-byte loads of x and stores of the codes, the rounding
  in packed bf16, the row blocks' maxima by warp shuffles, no local memory;
* GPU (Hopper): against the Triton word kernel byte for byte, and which kernel the public API runs.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from mx_kernels.gluon import e2m1_casts as gluon_e2m1_casts  # noqa: E402
from mx_kernels.mx import casts as triton_casts  # noqa: E402
from mx_kernels.spec import blocked_numel  # noqa: E402
from test_cast_kernels import assert_bits_equal, special_input  # noqa: E402
from test_gluon_kernels import loads_and_stores, ptx_ops, resource_usage  # noqa: E402

from mx_recipe.formats.mx import to_mx  # noqa: E402
from mx_recipe.ops import dispatch, kernel_settings  # noqa: E402
from mx_recipe.ops.mx_cast import cast_3d_dim1, cast_dim1  # noqa: E402

IS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
BF16 = torch.bfloat16


def launch(x: torch.Tensor, mode: str = "floor") -> tuple[tuple[int, ...], dict]:
    q = torch.empty(4, dtype=torch.int32, device="meta")
    s = torch.empty(16, dtype=torch.uint8, device="meta")
    return gluon_e2m1_casts.kernel_launch(x, q, s, mode)


def test_launch_facts():
    """128 x 128 tiles (8 warps) over M and K rounded up to 128, so that every blocked scale tile is written; x's
    strides and the per-expert code stride in int32 words; int64 offsets only where one expert passes 2**31
    elements; grids past CUDA's limits refused."""
    grid, kw = launch(torch.empty(1024, 512, dtype=BF16, device="meta"), "rceil")
    assert grid == (1024 // 128, 512 // 128) and kw["EVEN"] and not kw["BATCHED"] and not kw["OFFS64"], kw
    assert (kw["M"], kw["K"], kw["stride_xm"], kw["S_COLS"], kw["RCEIL"], kw["num_warps"]) == (1024, 512, 256, 32,
                                                                                               True, 8)  # fmt: skip
    grid, kw = launch(torch.empty(96, 160, dtype=BF16, device="meta"))
    assert grid == (1, 2) and not kw["EVEN"] and not kw["RCEIL"], kw
    wide = torch.empty(64, 1024, dtype=BF16, device="meta")[:, :512]  # row stride 1024 elements, 512 words
    assert launch(wide)[1]["stride_xm"] == 512
    grid, kw = launch(torch.empty(3, 224, 96, dtype=BF16, device="meta"))
    assert grid == (2, 1, 3) and kw["BATCHED"] and not kw["EVEN"], kw
    assert (kw["stride_xb"], kw["stride_qb"], kw["stride_sb"]) == (224 * 96 // 2, 224 * 96 // 8, blocked_numel(96, 7))
    assert not launch(torch.empty(64, 8192, 5120, dtype=BF16, device="meta"))[1]["OFFS64"]
    assert launch(torch.empty(2, 65536, 32768, dtype=BF16, device="meta"))[1]["OFFS64"]
    with pytest.raises(ValueError, match=r"65537 tiles along K"):
        launch(torch.empty(32, 128 * 65537, dtype=BF16, device="meta"))
    with pytest.raises(ValueError, match=r"65536 experts"):
        launch(torch.empty(65536, 32, 32, dtype=BF16, device="meta"))


def test_argument_errors():
    """Refused before any launch: the reference's errors, x that cannot be read as words, CPU tensors."""
    with pytest.raises(ValueError, match="dim 0 of shape"):
        gluon_e2m1_casts.cast_dim1(torch.zeros(33, 64, dtype=BF16), "floor")
    with pytest.raises(ValueError, match="unknown MX scale rule"):
        gluon_e2m1_casts.cast_dim1(torch.zeros(32, 64, dtype=BF16), "nearest")
    with pytest.raises(RuntimeError, match="need a CUDA tensor"):
        gluon_e2m1_casts.cast_dim1(torch.zeros(32, 64, dtype=BF16), "floor")
    assert gluon_e2m1_casts.takes(torch.zeros(32, 64, dtype=BF16))
    for x in (torch.zeros(32, 64), torch.zeros(64, 32, dtype=BF16).t(), torch.zeros(32, 65, dtype=BF16)[:, 1:]):
        assert not gluon_e2m1_casts.takes(x), (x.dtype, x.stride(), x.storage_offset())


@pytest.mark.parametrize("shape", [(16384, 16384), (96, 160), (16, 8192, 5120)])
def test_compiles_to_16_byte_loads_and_stores(shape):
    """Each thread loads its 8 rows of 4 words as 16-byte loads and stores its 8 words of codes (16 contiguous bytes
    of a column, after the move through shared memory) as two 16-byte stores, and one 16-byte row of the blocked
    scale tile; the rounding runs in packed bf16; a column block's maximum crosses its 4 lanes by warp shuffles; no
    local memory, at most 128 registers."""
    kernel = gluon_e2m1_casts.compile_for_target(shape, arch=90)
    ptx = kernel.asm["ptx"]
    ops = ptx_ops(ptx)
    loads, stores = loads_and_stores(ops)
    assert loads == {"ld.global.v4.b32": 8}, ops
    assert stores == {"st.global.v4.b32": 3}, ops
    assert ptx.count("add.rn.bf16x2") == 32 and ops.get("shfl.sync.bfly.b32", 0) > 0, ops
    assert not any(".local" in op for op in ops), ops
    usage = resource_usage(kernel.asm["cubin"])
    if usage is not None:
        assert usage["LOCAL"] == 0 and usage["REG"] <= 128, usage


# ---------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper GPU: the Gluon kernels run on compute capability 9.x")
def test_gpu_matches_the_triton_kernel():
    """Byte for byte the Triton word kernel's outputs, 2D and 3D, ragged and whole tiles, both rules and scale
    layouts; the public API runs this kernel on Hopper for bf16 it can read as words (the custom op checks the
    strides at run time), and the Triton one otherwise."""
    for shape in [(4128, 160), (256, 4096), (2, 1024, 640), (1, 96, 160)]:
        x = special_input(shape, BF16, "cuda", seed=3)
        assert dispatch.implementation("cast_dim1", x, "e2m1") == "gluon"
        for mode in ("floor", "rceil"):
            for blocked in (False, True):
                got = gluon_e2m1_casts.cast_dim1(x, mode, blocked)
                want = triton_casts.cast_dim1(x, "e2m1", mode, blocked)
                for g, w, name in zip(got, want, ("codes", "scales"), strict=True):
                    assert_bits_equal(g, w, f"{shape} {mode} blocked={blocked} {name}")
    x = special_input((512, 256), BF16, "cuda")
    xt = x.t()  # [256, 512] with stride (1, 256): not words along its last dim
    assert dispatch._kernel("cast_dim1", xt, "e2m1") is dispatch.launcher("cast_dim1", "triton")
    ref = to_mx(x.cpu(), "e2m1", "floor")
    out = cast_dim1(xt, "e2m1", "floor")
    assert_bits_equal(out.qdata, ref.qdata, "strided codes")
    assert_bits_equal(out.scale, ref.scale, "strided scales")
    w = special_input((3, 224, 96), BF16, "cuda")
    out = cast_3d_dim1(w, "e2m1", "rceil")
    ref = to_mx(w.cpu().transpose(1, 2).contiguous(), "e2m1", "rceil")
    assert_bits_equal(out.qdata, ref.qdata, "3D codes")
    with kernel_settings(gluon=False):
        assert dispatch.implementation("cast_dim1", x, "e2m1") == "triton"
