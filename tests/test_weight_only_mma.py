"""The Gluon weight-only GEMM on wgmma (MXFP8, MXFP4, NVFP4) (kernels/gluon/weight_only_mma.py) against the
reference, within the bound of tests/test_weight_only_gemm.py's module doc.

* CPU: compiled for sm_90a at every BLOCK_M, the upcast weights reach wgmma as its register operand (the kernel's
  layout conversion is asserted trivial at compile time; no shared-memory copy of them), and bad operands are
  one-line errors.
* GPU (``gpu``): every format, M = 1 to 64, N not a multiple of the 64-row tile, 4 and 8 warps, K split 1, 3
  and 32 ways (deterministic), NaN scales, zeros, an e4m3 NaN code, NVFP4 tensor scales per row.
"""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
from test_weight_only_gemm import assert_within_bound, cuda_kernels, packed, weights

from mx_recipe.infer.weights import PackedWeight

HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = "cuda"
FORMATS = ("mxfp8", "mxfp4", "nvfp4")


def mma(x: torch.Tensor, p, num_warps: int = 4, split_k: int = 1) -> torch.Tensor:
    from mx_kernels.gluon.weight_only_mma import wgmma_weight_only

    return wgmma_weight_only(x, p.qdata, p.scale, p.tensor_scale, p.fmt, num_warps, split_k)


@pytest.mark.skipif(not HAS_TRITON, reason="compiles with Triton's CUDA backend")
@pytest.mark.parametrize("block_m", [8, 16, 32, 64])
@pytest.mark.parametrize("num_warps", [4, 8])
@pytest.mark.parametrize("fmt", FORMATS)
def test_upcast_weights_are_the_mma_register_operand(block_m, num_warps, fmt):
    from mx_kernels.gluon import weight_only_mma
    from mx_kernels.gluon.common import compile_for_arch

    n, k = 4096, 1024
    meta = dict(device="meta")
    kwargs = dict(
        x_ptr=torch.empty(block_m, k, dtype=torch.bfloat16, **meta), w_ptr=torch.empty(n, k, dtype=torch.uint8,
        **meta), s_ptr=torch.empty(n, k // 16, dtype=torch.uint8, **meta), ts_ptr=torch.empty(n, **meta),
        out_ptr=torch.empty(block_m, n, dtype=torch.bfloat16, **meta), ws_ptr=torch.empty(2, block_m, n, **meta),
        cnt_ptr=torch.empty(64, dtype=torch.int32, **meta), M=block_m, N=n, K=k, K_SPLIT=k // 2, SPLIT_K=2,
        stride_xm=k, stride_wn=k, stride_sn=k // 16, stride_tn=1, stride_om=n, FMT=fmt, BLOCK_M=block_m,
        NUM_WARPS=num_warps, SPLIT=True, UNROLL=2, num_warps=num_warps,
    )  # fmt: skip
    ttgir = compile_for_arch(weight_only_mma.weight_only_wgmma_kernel, kwargs, 90).asm["ttgir"]
    a_operand = rf"ttng\.warp_group_dot %\S+, %\S+, .*? : tensor<{16 * num_warps}x128xbf16, #ttg\.dot_op<\{{opIdx = 0"
    assert len(re.findall(a_operand, ttgir)) == 1, "wgmma's A operand is not a register tensor"
    assert "ttg.local_load" not in ttgir and ttgir.count("ttg.local_alloc") == 1  # x^T's buffers only


def test_bad_operands_are_one_line_errors():
    from mx_kernels.gluon.weight_only_mma import wgmma_weight_only

    p = packed(torch.randn(64, 256), "mxfp4")
    with pytest.raises(ValueError, match="1 <= M <= 64"):
        wgmma_weight_only(torch.randn(65, 256).bfloat16(), p.qdata, p.scale, None, "mxfp4")
    with pytest.raises(ValueError, match="bf16"):
        wgmma_weight_only(torch.randn(4, 256), p.qdata, p.scale, None, "mxfp4")
    with pytest.raises(ValueError, match="nvfp4 .with one"):
        wgmma_weight_only(torch.randn(4, 256).bfloat16(), p.qdata, p.scale, None, "nvfp4")
    with pytest.raises(ValueError, match=r"codes \[N, K/1\]"):
        wgmma_weight_only(torch.randn(4, 256).bfloat16(), p.qdata, p.scale, None, "mxfp8")
    with pytest.raises(ValueError, match="out must be bf16 \\[4, 64\\]"):
        wgmma_weight_only(torch.randn(4, 256).bfloat16(), p.qdata, p.scale, None, "mxfp4", out=torch.empty(4, 32))
    nv = packed(torch.randn(64, 256), "nvfp4")
    with pytest.raises(ValueError, match="one tensor scale or one per row of N .64., got 3"):
        wgmma_weight_only(torch.randn(4, 256).bfloat16(), nv.qdata, nv.scale, torch.ones(3), "nvfp4")
    q = packed(torch.randn(64, 160), "mxfp4")
    with pytest.raises(ValueError, match="multiple of 128"):
        wgmma_weight_only(torch.randn(4, 160).bfloat16(), q.qdata, q.scale, None, "mxfp4")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("ms", [(1, 17), pytest.param((3, 8, 9, 16, 32, 33, 64), marks=pytest.mark.slow)],
                         ids=["one_and_17_rows", "more_rows"])  # fmt: skip
def test_gpu_every_m_within_the_bound(fmt, ms):
    """M = 1 to 64 (the fast tier 1 and 17: a padded row tile, then whole and ragged ones) on a 1056 x 4096 weight (N:
    16 rows past a multiple of 64), 4 and 8 warps, K split 1, 3 and 32 ways (the same bits every call), a NaN scale in
    one row, zeros; nvfp4 with one tensor scale and with one per row (weights concatenated along N)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs an sm_90 GPU (wgmma)")
    torch.manual_seed(11)
    n, k = 1056, 4096
    p = packed(weights(n, k, CUDA) * 0.02, fmt)
    p.scale.view(torch.uint8)[1040, 5] = 0x7F if fmt == "nvfp4" else 0xFF
    nan_cols = {1040}
    if fmt == "mxfp8":  # an e4m3 NaN code with a finite scale
        p.qdata.view(torch.uint8)[17, 300] = 0xFF
        nan_cols.add(17)
    zero = packed(torch.zeros(n, k, device=CUDA), fmt)
    weights_ = [p]
    if fmt == "nvfp4":  # two weights concatenated along N, each its own tensor scale
        halves = [packed(weights(n // 2, k, CUDA) * scale, fmt) for scale in (0.02, 3.0)]
        weights_.append(PackedWeight.cat(halves))
    for m in ms:
        x = torch.randn(m, k, device=CUDA).bfloat16()
        for warps, split in ((4, 1), (8, 1), (4, 3), (8, 32)):
            for w in weights_:
                y = mma(x, w, warps, split)
                assert_within_bound(y, x, w)
                if split > 1:  # the partials summed in split order: the same bits every call (NaN too)
                    bits = y.view(torch.int16)
                    assert all(torch.equal(mma(x, w, warps, split).view(torch.int16), bits) for _ in range(3))
            y = mma(x, p, warps, split)
            assert set(y.isnan().all(dim=0).nonzero().flatten().tolist()) == nan_cols
            assert y.isnan().sum().item() == m * len(nan_cols)
            assert torch.equal(mma(x, zero, warps, split), torch.zeros(m, n, dtype=torch.bfloat16, device=CUDA))


def test_gluon_config_splits_k_to_fill_the_gpu():
    """Untuned, the Gluon kernel takes 4 warps and splits K (powers of 2, at most 8) while the programs stay
    within GLUON_PROGRAMS_PER_SM an SM: Llama 3 8B's projections on an H200's 132 SMs, and a GPU of 16."""
    from mx_kernels.mx.weight_only import gluon_config

    splits = {n: gluon_config(n, 132)["SPLIT_K"] for n in (28672, 6144, 4096, 1024)}
    assert splits == {28672: 1, 6144: 4, 4096: 8, 1024: 8}
    assert gluon_config(4096, 16) == dict(GLUON=True, num_warps=4, SPLIT_K=1)
    assert gluon_config(1024, 16)["SPLIT_K"] == 4


def test_weight_only_mm_offers_the_kernel_only_where_it_applies():
    """Tuning candidates past the small-M path up to GLUON_MAX_M rows; a Gluon config off the GPU is a one-line
    error."""
    from mx_kernels.mx.weight_only import GLUON_MAX_M, candidates, gluon_ok, weight_only_mm

    assert any(c.get("GLUON") for c in candidates(32, "mxfp4", 4096, 4096, gluon=True))
    assert not any(c.get("GLUON") for c in candidates(32, "mxfp4", 4096, 4096))
    assert not any(c.get("GLUON") for c in candidates(GLUON_MAX_M + 1, "nvfp4", 4096, 4096, gluon=True))
    assert not any(c.get("GLUON") for c in candidates(1, "mxfp4", 4096, 4096, gluon=True))  # the FMA path's
    assert not gluon_ok("mxfp8", 4096, False, False, torch.device("cpu"))
    p = packed(torch.randn(64, 256), "mxfp4")
    if HAS_TRITON:
        with pytest.raises((ValueError, RuntimeError), match="Gluon kernel takes|needs CUDA"):
            weight_only_mm(torch.randn(8, 256).bfloat16(), p.qdata, p.scale, None, "mxfp4",
                           config=dict(GLUON=True, num_warps=4, SPLIT_K=1))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("ms", [(100,), pytest.param((5, 8, 32), marks=pytest.mark.slow)], ids=["100_rows", "fewer"])
def test_gpu_weight_only_mm_takes_the_gluon_configs(fmt, ms):
    """Through the weight-only GEMM's public entry: every Gluon candidate at M = 5, 8, 32 and 100 (the fast tier
    100: two launches, the second of 36 rows) within the bound; with SwiGLU, the GEMM then ``silu_mul`` as the
    tensor-core path does."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs an sm_90 GPU (wgmma)")
    from mx_kernels.decode_fused import silu_mul
    from mx_kernels.mx.weight_only import candidates, weight_only_mm

    torch.manual_seed(12)
    n, k = 512, 2048
    p = packed(weights(n, k, CUDA) * 0.02, fmt)
    for m in ms:
        x = torch.randn(m, k, device=CUDA).bfloat16()
        gluon = [c for c in candidates(m, fmt, n, k, gluon=True) if c.get("GLUON")]
        assert gluon
        for config in gluon:
            assert_within_bound(weight_only_mm(x, p.qdata, p.scale, p.tensor_scale, fmt, config=config), x, p)
        y = weight_only_mm(x, p.qdata, p.scale, p.tensor_scale, fmt, config=gluon[0])
        h = weight_only_mm(x, p.qdata, p.scale, p.tensor_scale, fmt, config=gluon[0], swiglu=True)
        assert torch.equal(h, silu_mul(y[:, : n // 2], y[:, n // 2 :]))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_untuned_gemm_takes_the_gluon_kernel_on_hopper(fmt):
    """Untuned (generate.py), 5 to 128 rows of a dense GEMM on Hopper run the Gluon kernel with ``gluon_config``:
    its bits, within the bound; 1-4 rows stay on the small-M kernel."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU (wgmma)")
    from mx_kernels.mx.weight_only import gluon_config, weight_only_mm

    torch.manual_seed(13)
    n, k = 1000, 1024
    p = packed(weights(n, k, CUDA) * 0.02, fmt)
    sms = torch.cuda.get_device_properties(CUDA).multi_processor_count
    for m in (2, 8, 33, 128):
        x = torch.randn(m, k, device=CUDA).bfloat16()
        y = weight_only_mm(x, p.qdata, p.scale, p.tensor_scale, fmt)
        assert_within_bound(y, x, p)
        launched = cuda_kernels(lambda x=x: weight_only_mm(x, p.qdata, p.scale, p.tensor_scale, fmt))
        assert any("wgmma" in name for name in launched) == (m > 4), (m, launched)
        if m > 4:
            tuned = weight_only_mm(x, p.qdata, p.scale, p.tensor_scale, fmt, config=gluon_config(n, sms))
            assert torch.equal(y.view(torch.int16), tuned.view(torch.int16))
