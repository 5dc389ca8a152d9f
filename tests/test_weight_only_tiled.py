"""The weight-only GEMM over tiled weights (kernels/gluon/weight_only_tiled.py) and ``PackedWeight.tile``,
against the reference, within the bound of tests/test_weight_only_gemm.py's module doc.

* CPU: packing round-trips (codes, scales, SwiGLU's row order, padding rows) and leaves ``dequantize`` bit for
  bit; every bit of a code word lands where the upcast reads it (e2m1 and e4m3 words); compiled for sm_90a, the
  upcast weights and x reach mma.sync and wgmma as register operands without moves; the launch configs; bad
  operands, NaN e4m3 codes included, are one-line errors.
* GPU (``gpu``): MXFP4, NVFP4 and MXFP8, M = 1 to 128 (launches of 64), N not a multiple of 16, both MMAs, K
  split (the same bits every call), scales past 2**1 (MXFP4) or 2**7 (MXFP8: the second multiply), NaN, 2**-127
  and 2**-126 scales, zeros, NVFP4 tensor scales per row; the SwiGLU epilogue bit for bit the GEMM then
  ``silu_mul``; the split-K partials, added by ``add_rms_norm``, bit for bit its norm of the GEMM's output; a
  decode step of the Llama debug model with tiled weights, replayed from a CUDA graph under PDL, against the
  untiled one (MXFP8 tiled only for more than one sequence), at 2 sequences and at 8 (wqkv's and wo's partials);
  the QKV GEMM's partials, added by the decode attention, bit for bit its attention of the GEMM's output.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import re

import pytest
import torch
from test_weight_only_gemm import assert_within_bound, packed, weights

from mx_recipe.formats.mx import MXTensor
from mx_recipe.formats.nvfp4 import NVFP4Tensor
from mx_recipe.infer.weights import PackedWeight

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = "cuda"
FORMATS = ("mxfp4", "nvfp4", "mxfp8")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="the kernel module imports Triton")
interp_only = pytest.mark.skipif(not (INTERP and HAS_TRITON), reason="runs in the Triton interpreter child process")


def hopper() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU (wgmma)")


def tiled(w: torch.Tensor, fmt: str, swiglu: bool = False) -> PackedWeight:
    p = packed(w, fmt)
    p.tile(swiglu)
    return p


def grouped(x: torch.Tensor, p: PackedWeight, offs: torch.Tensor, rows: torch.Tensor | None = None,
            swiglu: bool = False, kw: int | None = None) -> torch.Tensor:  # fmt: skip
    from mx_kernels.gluon.weight_only_tiled import tiled_weight_only_grouped_mm

    return tiled_weight_only_grouped_mm(x, p.qdata, p.scale, p.tensor_scale_tiled, p.fmt, p.wide_scales, offs, rows,
                                        swiglu, kw)  # fmt: skip


def experts(w: torch.Tensor, fmt: str, row_scales: bool = False) -> PackedWeight:
    """Experts w [E, N, K] in ``fmt``; NVFP4 with ``row_scales``: a tensor scale per expert and row (0.5 to 1.5), as
    experts with shared ones folded in."""
    p = packed(w, fmt)
    if fmt == "nvfp4" and row_scales:
        ts = torch.rand(*w.shape[:2], 1, device=w.device) + 0.5
        p = PackedWeight(NVFP4Tensor(p.qdata, p.scale, ts, 2), fmt)
    return p


def mm(x: torch.Tensor, p: PackedWeight, swiglu: bool = False, cfg: dict | None = None, partials: bool = False
       ) -> torch.Tensor:  # fmt: skip
    from mx_kernels.gluon.weight_only_tiled import tiled_weight_only_mm

    return tiled_weight_only_mm(x, p.qdata, p.scale, p.tensor_scale_tiled, p.rows, p.fmt, p.wide_scales, swiglu, cfg,
                                partials=partials)  # fmt: skip


@needs_triton
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "k", "swiglu"), [(100, 256, False), (48, 512, True), (16, 128, False)])
def test_tiling_round_trips_and_keeps_dequantize(fmt, n, k, swiglu):
    """Codes and scales unpack to the formats' own bytes (SwiGLU's rows back in order, the padding rows of a
    partial 16-row tile dropped), so ``dequantize`` is bit for bit the untiled weight's; NVFP4 tensor scales per row
    follow the packed row order."""
    torch.manual_seed(0)
    parts = [weights(n // 2, k) * s for s in (0.02, 3.0)]
    p = PackedWeight.cat([packed(w, fmt) for w in parts]) if fmt == "nvfp4" else packed(torch.cat(parts), fmt)
    want_q, want_s, want = p.qdata.clone(), p.scale.clone(), p.dequantize(torch.float32)
    untiled_bytes = p.nbytes()
    p.tile(swiglu)
    per_byte = 1 if fmt == "mxfp8" else 2
    assert p.tiled and p.qdata.dtype == torch.int32 and p.qdata.shape == (-(-n // 16) * 16, k // (4 * per_byte))
    padding = (p.qdata.shape[0] - n) * (k // per_byte + want_s.shape[1])  # zero rows up to the 16-row tile
    assert p.nbytes() == untiled_bytes + padding  # the kernel's tensor scale counted once, as the untiled one
    q, s = p.natural_codes()
    assert torch.equal(q, want_q) and torch.equal(s.view(torch.uint8), want_s.view(torch.uint8))
    assert torch.equal(p.dequantize(torch.float32), want)
    if fmt == "nvfp4":
        from mx_kernels.gluon.weight_only_tiled import swiglu_rows

        order = swiglu_rows(n) if swiglu else torch.arange(n)
        assert torch.equal(p.tensor_scale_tiled, p.tensor_scale.reshape(-1)[order])


@needs_triton
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("swiglu", [False, True])
def test_experts_tile_each_as_its_own_weight(fmt, swiglu):
    """Experts [E, N, K] tile as E weights stacked, each ``pack``'s own (SwiGLU's row order per expert, NVFP4's
    tensor scale per expert and row in that order); codes and scales unpack to the formats' bytes and
    ``dequantize`` is bit for bit the untiled one's; the last groups (folded shared experts) stay tiled views."""
    from mx_kernels.gluon.weight_only_tiled import pack

    torch.manual_seed(3)
    e, n, k = 3, 32, 256
    p = experts(weights(n, k, lead=(e,)), fmt, row_scales=True)
    want_q, want_s, want = p.qdata.clone(), p.scale.clone(), p.dequantize(torch.float32)
    p.tile(swiglu)
    assert p.qdata.shape == (e, n, k // (4 if fmt == "mxfp8" else 8)) and p.in_features == k
    for i in range(e):
        words, scales, ts = pack(want_q[i], want_s[i], None if fmt != "nvfp4" else p.tensor_scale[i], fmt, swiglu)
        assert torch.equal(p.qdata[i], words) and torch.equal(p.scale[i], scales)
        if fmt == "nvfp4":
            assert torch.equal(p.tensor_scale_tiled.view(e, n)[i], ts)
    q, s = p.natural_codes()
    assert torch.equal(q, want_q) and torch.equal(s.view(torch.uint8), want_s.view(torch.uint8))
    assert torch.equal(p.dequantize(torch.float32), want)
    last = p.last_groups(2)
    assert last.tiled and torch.equal(last.dequantize(torch.float32), want[-2:])
    with pytest.raises(ValueError, match="whole 16-row tiles"):
        packed(weights(24, k, lead=(2,)), fmt).tile()


@needs_triton
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_grouped_programs_wait_for_the_routing_before_any_read(fmt):
    """Compiled for sm_90a, the grouped kernel (a token's rows read in place, 4 warps splitting K's 3 steps, the
    last warp's masked) waits for the kernel before it (PDL), which wrote its rows' experts, before its first
    global load, and still reads words and x 16 bytes a load."""
    over = dict(GROUPED=True, GATHER=True, RAGGED=True, E=8, E_POW2=8, T=1, W=4, KW=4, SPLIT=False, K=384,
                K_SPLIT=384, SPLIT_K=1, UNROLL=0)  # fmt: skip
    _, ptx = compiled_kernel(1, False, fmt, **over)
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    assert "ld.global.v4.b32" in ptx and "ld.global.v2" not in ptx


@needs_triton
def test_grouped_early_shared_tiles_release_without_waiting():
    """Compiled for sm_90a with two early groups (folded shared experts over 3 tokens): the shared tiles' path
    releases the next kernel and reads nothing before the one wait, which the routed tiles' path takes before
    reading ``offs``; the rows' load (written by the routing) is predicated: the shared tiles skip it."""
    over = dict(GROUPED=True, GATHER=True, RAGGED=False, E=8, E_POW2=8, T=1, W=2, KW=2, SPLIT=False, K=2048,
                K_SPLIT=2048, SPLIT_K=1, UNROLL=0, EARLY=2, TOKENS=3, M=24, BLOCK_M=8, PARTIALS=False,
                num_warps=2)  # fmt: skip
    _, ptx = compiled_kernel(1, False, "mxfp4", **over)
    before_wait = ptx[: ptx.index("griddepcontrol.wait")]
    assert ptx.count("griddepcontrol.wait") == 1 and ptx.count("griddepcontrol.launch_dependents") == 2
    assert "griddepcontrol.launch_dependents" in before_wait and "ld.global" not in before_wait
    scalar_loads = [line.strip() for line in ptx.splitlines() if "ld.global.b32 {" in line]
    assert len(scalar_loads) == 3 and all(line.startswith("@%p") for line in scalar_loads)


@needs_triton
def test_grouped_bad_operands_are_one_line_errors():
    from mx_kernels.gluon.weight_only_tiled import tiled_weight_only_grouped_mm as launch

    p = experts(weights(32, 256, lead=(2,)), "mxfp4")
    p.tile()
    x = torch.randn(3, 256).bfloat16()
    offs = torch.tensor([1, 3], dtype=torch.int32)
    args = dict(x=x, words=p.qdata, scales=p.scale, tensor_scale=None, fmt="mxfp4", wide=False, offs=offs)
    cases = [
        (dict(x=x.float()), "x bf16"),
        (dict(fmt="int4"), "mxfp4, nvfp4 or mxfp8"),
        (dict(words=p.qdata[0]), r"pack's words \[E, N, 32\]"),
        (dict(x=torch.randn(3, 128).bfloat16()), "K = 128"),
        (dict(offs=offs.long()), "offs must be int32"),
        (dict(early=1), "early groups are shared experts"),
        (dict(offs=offs[:1]), "for E = 2 experts"),
        (dict(rows=torch.tensor([0, 1])), "rows must be an int32"),
        (dict(tensor_scale=torch.ones(1)), "nvfp4 takes a tensor scale"),
        (dict(kw=3), "a power of 2 up to 16"),
    ]
    for over, match in cases:
        with pytest.raises(ValueError, match=match):
            launch(**{**args, **over})


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="this is the parent of the interpreter run")
def test_kernels_in_triton_interpreter():
    """Run the test_interp_* tests in a child pytest with TRITON_INTERPRET=1."""
    from test_cast_kernels import run_interpreter_tests

    run_interpreter_tests(__file__)


@interp_only
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "swiglu"), [(100, False), (48, True)])
def test_interp_dequantize_reads_the_tiles(fmt, n, swiglu):
    """The tiled weight's dequantize (what a prefill hands to cuBLAS), in the interpreter: bit for bit the untiled
    weight's (mx_kernels.mx.weight_only.dequantize), in the formats' row order, with a NaN, 2**-127, 2**-126 and
    2**113 scale (MXFP4, MXFP8), and a 448 scale and a tensor scale per row (NVFP4)."""
    from mx_kernels.gluon.weight_only_tiled import dequantize, pack
    from mx_kernels.mx.weight_only import dequantize as natural

    w = weights(n, 512)
    p = PackedWeight.cat([packed(w[: n // 2] * 0.02, fmt), packed(w[n // 2 :] * 3.0, fmt)])
    scales = p.scale.view(torch.uint8)
    if fmt != "nvfp4":
        scales[3, 1], scales[4, 0], scales[5, 2], scales[6, 1] = 0xFF, 0, 1, 240
    else:
        scales[6, 1] = 0x7E
    words, tiled_scales, _ = pack(p.qdata, p.scale, p.tensor_scale, fmt, swiglu)
    got = dequantize(words, tiled_scales, p.tensor_scale, n, fmt, swiglu)
    assert torch.equal(got.view(torch.int16), natural(p.qdata, p.scale, p.tensor_scale, fmt).view(torch.int16))


@needs_triton
def test_every_code_bit_lands_where_the_upcast_reads_it():
    """Each word's 32 bits are a permutation (``stored_bit``), and the upcast's rotations and masks (pairs 0-2 by
    0, 4 and 10 bits, pair 3's mantissas by 14 and the rest by 6) bring each pair of a packed word to the bf16x2
    bits sign | exponent and mantissa << 6 of its codes: their values times 2**-126. Every byte value at every
    place of a word."""
    from mx_kernels.gluon.weight_only_tiled import pack, stored_bit

    assert sorted(stored_bit(p, b) for p in range(4) for b in range(8)) == list(range(32))
    codes = (torch.arange(1024) // 4 % 256).to(torch.uint8).view(16, 64)  # byte value v at each place of a word
    words, _, _ = pack(codes, torch.zeros(16, 4, dtype=torch.uint8), None, "mxfp4")
    full = 0xFFFFFFFF

    def rot(w: int, r: int) -> int:
        return ((w >> r) | (w << (32 - r))) & full if r else w

    def bf16_bits(c: int) -> int:
        return ((c & 8) << 12) | ((c & 7) << 6)

    seen = set()
    for w in (x & full for x in words.view(-1).tolist()):
        natural = sum(((w >> stored_bit(p, b)) & 1) << (8 * p + b) for p in range(4) for b in range(8))
        pairs = [w & 0x81C081C0, rot(w, 4) & 0x81C081C0, rot(w, 10) & 0x81C081C0,
                 (rot(w, 6) & 0x81808180) | (rot(w, 14) & 0x00400040)]  # fmt: skip
        for p, got in enumerate(pairs):
            byte = (natural >> (8 * p)) & 0xFF
            assert got == bf16_bits(byte & 0xF) | (bf16_bits(byte >> 4) << 16), (hex(w), p)
            seen.add((p, byte))
    assert len(seen) == 4 * 256


@needs_triton
def test_every_e4m3_code_bit_lands_where_the_upcast_reads_it():
    """MXFP8: each word of 4 codes is a permutation of its 32 bits (``stored_bit_e4m3``), and the upcast (pair 0
    masked in place; pair 1's signs and mantissas' low bit rotated left by 4, the rest by 8) brings each pair to the
    bf16x2 bits sign << 15 | magnitude << 4 of its codes: their values times 2**-120. Every byte value that is not
    NaN at every place of a word, and NaN codes refused."""
    from mx_kernels.gluon.weight_only_tiled import pack, stored_bit_e4m3

    assert sorted(stored_bit_e4m3(c, b) for c in range(4) for b in range(8)) == list(range(32))
    codes = (torch.arange(1024) // 4 % 256).to(torch.uint8).view(8, 128)  # byte value v at each place of a word
    codes[(codes & 0x7F) == 0x7F] = 0
    codes = torch.cat([codes, codes.flip(0)])
    words, _, _ = pack(codes, torch.zeros(16, 4, dtype=torch.uint8), None, "mxfp8")
    full = 0xFFFFFFFF

    def rotl(w: int, r: int) -> int:
        return ((w << r) | (w >> (32 - r))) & full

    def bf16_bits(c: int) -> int:
        return ((c & 0x80) << 8) | ((c & 0x7F) << 4)

    seen = set()
    for w in (x & full for x in words.view(-1).tolist()):
        natural = sum(((w >> stored_bit_e4m3(c, b)) & 1) << (8 * c + b) for c in range(4) for b in range(8))
        pairs = [w & 0x87F087F0, (rotl(w, 4) & 0x80808080) | (rotl(w, 8) & 0x07700770)]
        for p, got in enumerate(pairs):
            lo, hi = (natural >> (16 * p)) & 0xFF, (natural >> (16 * p + 8)) & 0xFF
            assert got == bf16_bits(lo) | (bf16_bits(hi) << 16), (hex(w), p)
            seen.update({(2 * p, lo), (2 * p + 1, hi)})
    assert len(seen) == 4 * 254
    with pytest.raises(ValueError, match=r"NaN \(0x7F, 0xFF\)"):
        pack(codes.index_fill(1, torch.tensor([5]), 0xFF), torch.zeros(16, 4, dtype=torch.uint8), None, "mxfp8")


def compiled_kernel(m: int, wgmma: bool, fmt: str, **over):
    """The kernel compiled for sm_90a on a 1024 x 512 weight, K split 2 ways, SwiGLU, PDL; ``over`` replaces
    arguments: (TTGIR, PTX)."""
    from mx_kernels.gluon.common import compile_for_arch
    from mx_kernels.gluon.weight_only_tiled import tiled_weight_only_kernel

    n, k, sb = 1024, 512, 2 if fmt == "nvfp4" else 1
    words = k // (4 if fmt == "mxfp8" else 8)
    meta = dict(device="meta")
    kwargs = dict(
        x_ptr=torch.empty(m, k, dtype=torch.bfloat16, **meta), w_ptr=torch.empty(n, words, dtype=torch.int32, **meta),
        s_ptr=torch.empty(n, k // 32 * sb, dtype=torch.uint8, **meta), ts_ptr=torch.empty(n, **meta),
        out_ptr=torch.empty(m, n, dtype=torch.bfloat16, **meta), ws_ptr=torch.empty(2, m, n, **meta),
        cnt_ptr=torch.empty(64, dtype=torch.int32, **meta), offs_ptr=torch.empty(8, dtype=torch.int32, **meta),
        rows_ptr=torch.empty(m, dtype=torch.int32, **meta), M=m, N=n, K=k, K_SPLIT=k // 2, SPLIT_K=2, stride_xm=k,
        stride_om=n, stride_tn=1, E=1, stride_we=0, stride_se=0, stride_te=0, TOKENS=0, FMT=fmt, BLOCK_M=max(8, m),
        T=1 if wgmma else 2, W=4, SPLIT=True, WIDE=False, SWIGLU=True, PDL=True, WGMMA=wgmma, UNROLL=2, KW=1,
        num_warps=4,
    )  # fmt: skip
    compiled = compile_for_arch(tiled_weight_only_kernel, kwargs | over, 90)
    return compiled.asm["ttgir"], compiled.asm["ptx"]


@needs_triton
@pytest.mark.parametrize(("m", "wgmma", "fmt", "wide"), [(1, False, "mxfp4", False), (8, False, "nvfp4", False),
                                                         (32, True, "mxfp4", True), (64, True, "nvfp4", True),
                                                         (1, False, "mxfp8", False),
                                                         (32, True, "mxfp8", True)])  # fmt: skip
def test_operands_reach_the_mma_without_moves(m, wgmma, fmt, wide):
    """Compiled for sm_90a: the upcast weights are the MMA's register operand and x (mma.sync) its other one, each
    layout conversion asserted trivial at compile time; mma.sync takes no shared memory, wgmma only x^T's. A lane
    reads its words and x 16 bytes a load, MXFP8's words evict-first and 4-bit ones plainly. Under PDL the next
    kernel is released right after the wait, before the first MMA. A scale's factor: one multiply-add unless
    ``wide``."""
    ttgir, ptx = compiled_kernel(m, wgmma, fmt, WIDE=wide)
    assert "ld.global.v4.b32" in ptx and "ld.global.v2" not in ptx
    evict_first = re.findall(r"ld\.global\.L1::evict_first\.L2::cache_hint\.v4\.b32", ptx)
    assert bool(evict_first) == (fmt == "mxfp8")
    if fmt == "nvfp4":  # positive normal e4m3 scales: one multiply-add each, not the hardware's conversion
        assert ("cvt.rn.f16x2.e4m3x2" in ptx) == wide and ("0x00100010" in ptx) != wide
    else:  # e8m0 scales: no test for NaN's 0xFF unless wide (a NaN scale is a wide one)
        assert ("0x7FC07FC0" in ptx) == wide and "0x00800080" in ptx
    # PDL: the next kernel is released right after the wait, before the main loop's first MMA (mx_kernels.pdl)
    mma = ptx.index("wgmma.mma_async" if wgmma else "mma.sync")
    assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents") < mma
    if wgmma:
        assert re.search(r"ttng\.warp_group_dot %\S+, %\S+, .*? : tensor<64x128xbf16, #ttg\.dot_op<\{opIdx = 0", ttgir)
        assert ttgir.count("ttg.local_alloc") == 1 and "ttg.local_load" not in ttgir
    else:
        assert re.search(r"tt\.dot %\S+, %\S+, .*? : tensor<128x128xbf16, #ttg\.dot_op<\{opIdx = 0", ttgir)
        assert "ttg.local_alloc" not in ttgir


@needs_triton
@pytest.mark.parametrize("fmt", FORMATS)
def test_warps_splitting_k_read_16_bytes_and_add_in_shared_memory(fmt):
    """With 4 warps splitting K (KW) the weights and x still reach the MMA as registers and every global load is as
    wide as with one warp (each warp's offset along K keeps x's 16-byte alignment); the warps' sums meet in shared
    memory, its one allocation."""
    ttgir, ptx = compiled_kernel(1, False, fmt, T=1, KW=4)
    assert re.search(r"tt\.dot %\S+, %\S+, .*? : tensor<64x128xbf16, #ttg\.dot_op<\{opIdx = 0", ttgir)
    assert ttgir.count("ttg.local_alloc") == 1
    loads = re.compile(r"ld\.global[.\w]*")
    assert sorted(loads.findall(ptx)) == sorted(loads.findall(compiled_kernel(1, False, fmt, T=1)[1]))


@needs_triton
def test_wide_scales_take_the_longer_factor():
    """e8m0 scales past 2**1 (MXFP4) or 2**7 (MXFP8), NaN's 0xFF among them, and e4m3 scales other than positive
    normal ones (zero, subnormal, negative, NaN) take the kernel's longer factor."""
    from mx_kernels.gluon.weight_only_tiled import wide_scales

    def wide(values: list[int], fmt: str) -> bool:
        return wide_scales(torch.tensor(values, dtype=torch.uint8), fmt)

    assert not wide([0, 1, 127, 128], "mxfp4") and wide([129], "mxfp4") and wide([0, 255], "mxfp4")
    assert not wide([0, 134], "mxfp8") and wide([135], "mxfp8") and wide([0, 255], "mxfp8")
    assert not wide([0x08, 0x38, 0x7E], "nvfp4")
    for odd in (0x00, 0x01, 0x07, 0x80, 0xB8, 0x7F, 0xFF):
        assert wide([0x38, odd], "nvfp4"), hex(odd)


@needs_triton
def test_config_splits_k_by_the_sm_count():
    """Llama 3 8B's projections (wqkv, wo and w2, w13) on an H200's 132 SMs: mma.sync a program of 16 rows up to 4
    rows, wgmma 4 warps to 16 and 8 past that, K split to about 24 warps, 4, 2 (to 32 rows) or 1 programs an SM; on
    mma.sync the split is the program's warps."""
    from mx_kernels.gluon.weight_only_tiled import config

    warps = dict(t=1, split_k=1, wgmma=False)
    for m in (1, 4):
        assert config(m, 6144, 132) == dict(w=8, kw=8, **warps) and config(m, 28672, 132) == dict(w=2, kw=2, **warps)
        assert config(m, 4096, 132) == dict(w=16, kw=16, **warps)
        assert config(m, 128256, 132) == dict(w=1, kw=1, **warps)
    assert {n: config(8, n, 132)["split_k"] for n in (6144, 4096, 28672)} == {6144: 4, 4096: 8, 28672: 1}
    assert not config(4, 4096, 132)["wgmma"] and config(5, 4096, 132) == dict(t=1, w=4, split_k=8, wgmma=True)
    assert {n: config(33, n, 132)["split_k"] for n in (6144, 4096, 28672)} == {6144: 2, 4096: 4, 28672: 1}
    assert {n: config(17, n, 132)["split_k"] for n in (6144, 4096, 28672)} == {6144: 4, 4096: 8, 28672: 1}
    assert config(128, 4096, 132)["w"] == 8 and config(32, 4096, 132)["w"] == 8 and config(16, 4096, 132)["w"] == 4
    assert config(1, 16, 132)["kw"] == 16 and config(64, 28672, 16)["split_k"] == 1


@needs_triton
def test_grouped_warps_by_the_sm_count():
    """A token's rows of the MoE 16B's experts (8 groups of 66) on an H200's 132 SMs: 2 warps split K, for w1/w3
    and w2 alike; never more warps than K's steps."""
    from mx_kernels.gluon.weight_only_tiled import grouped_kw

    assert grouped_kw(8, 2816, 2048, 66, 132) == grouped_kw(8, 2048, 1408, 66, 132) == 2
    assert grouped_kw(1, 16, 256, 4, 132) == 2 and grouped_kw(3, 256, 128, 9, 132) == 1
    assert grouped_kw(64, 2816, 2048, 66, 132) == 1


@needs_triton
def test_partials_where_one_launch_splits_k_over_programs():
    """``partial_splits``: Llama 3 8B's wo/w2 and wqkv at 8 and 32 rows split over programs (the splits ``config``
    asks, or K's steps where fewer); at 1 row a program's warps split K (no partials); past MAX_M rows or on a
    custom launch of fewer rows than M, no partials."""
    from mx_kernels.gluon.weight_only_tiled import MAX_M, partial_splits

    assert [partial_splits(m, 4096, 4096, 132) for m in (1, 4, 8, 32)] == [1, 1, 8, 8]
    assert partial_splits(32, 6144, 4096, 132) == 4 and partial_splits(32, 28672, 4096, 132) == 1
    assert partial_splits(8, 4096, 512, 132) == 4  # 4 steps of K: 4 splits, not 8
    assert partial_splits(MAX_M + 1, 4096, 4096, 132) == 1 and partial_splits(0, 4096, 4096, 132) == 1
    assert partial_splits(65, 4096, 4096, 132, dict(t=1, w=4, split_k=2, wgmma=False)) == 1  # 64-row launches
    assert partial_splits(8, 4096, 4096, 132, dict(t=1, w=4, split_k=2, wgmma=False)) == 2
    # compiled for sm_90a, a launch with partials stores them and takes no arrival counter
    _, ptx = compiled_kernel(32, True, "mxfp4", PARTIALS=True, SWIGLU=False)
    _, summed = compiled_kernel(32, True, "mxfp4", SWIGLU=False)
    assert "atom." not in ptx and "atom." in summed and "st.global" in ptx


@needs_triton
def test_bad_operands_are_one_line_errors():
    from mx_kernels.gluon.weight_only_tiled import pack, tiled_weight_only_mm

    p = tiled(torch.randn(64, 256), "mxfp4")
    x = torch.randn(4, 256).bfloat16()
    with pytest.raises(ValueError, match="mxfp4, nvfp4 or mxfp8 and x bf16"):
        tiled_weight_only_mm(x.float(), p.qdata, p.scale, None, 64, "mxfp4", False)
    with pytest.raises(ValueError, match=r"pack's words \[64, 32\] and scales \[64, 8\] for n = 64"):
        tiled_weight_only_mm(x, p.qdata[:, :16], p.scale, None, 64, "mxfp4", False)
    nv = tiled(torch.randn(64, 256), "nvfp4")
    with pytest.raises(ValueError, match="nvfp4 takes a tensor scale"):
        tiled_weight_only_mm(x, nv.qdata, nv.scale, None, 64, "nvfp4", False)
    with pytest.raises(ValueError, match="partials are a plain GEMM's, not the SwiGLU epilogue's"):
        tiled_weight_only_mm(x, p.qdata, p.scale, None, 64, "mxfp4", False, swiglu=True, partials=True)
    q = packed(torch.randn(32, 160), "mxfp4")
    with pytest.raises(ValueError, match="K a multiple of 128"):
        pack(q.qdata, q.scale, None, "mxfp4")
    with pytest.raises(ValueError, match=r"not tiled yet, got mxfp4 \(64, 32\) \(tiled\)"):
        p.tile()
    nan = packed(torch.randn(64, 256), "mxfp8")
    nan.qdata.view(torch.uint8)[5, 7] = 0x7F
    with pytest.raises(ValueError, match="MXFP8 codes with NaN"):
        nan.tile()
    with pytest.raises(ValueError, match="concatenate before tiling"):
        PackedWeight.cat([p, p])
    with pytest.raises(ValueError, match="a tiled 2D weight is a dense one"):
        p.grouped_mm(x, torch.tensor([4], dtype=torch.int32), kernel=False)


@needs_triton
def test_tile_weights_leaves_a_cpu_model_as_it_is():
    """Off an sm_90 GPU nothing is tiled: the formats' layout, the reference GEMM."""
    from mx_recipe.infer.weights import fuse_projections, quantize_model, tile_weights
    from mx_recipe.models import build_model, model_args

    model = fuse_projections(quantize_model(build_model(model_args("llama", "debug", 320, 64)), "mxfp4"))
    tile_weights(model, 8)
    assert not any(m.tiled for m in model.modules() if isinstance(m, PackedWeight))


# ---------------------------------------------------------------------------------------
# GPU


def edge_cases(fmt: str, n: int, k: int) -> list[PackedWeight]:
    """Tiled n x k weights (seeded): scales from 2**-12 to 2**6 and a zero row 7; the same weight clamped to [-1, 1]
    with a NaN scale in row 3 (NVFP4: NaN, zero, subnormal, largest and negative e4m3 scales), 2**-127 and 2**-126
    ones; MXFP8 with one scale of 2**23; NVFP4 also with a tensor scale per row (two parts); and one with none of
    the wide scales (the one-instruction factor: not ``wide_scales``): MXFP4 and MXFP8 the clamped weight without its
    NaN, NVFP4 positive normal scales only, the smallest and the largest among them."""
    torch.manual_seed(21)
    w = weights(n, k, CUDA)
    w[7] = 0.0
    clamped = w.clamp(-2.0, 2.0) * 0.5
    cases = [packed(w, fmt), packed(clamped, fmt)]
    scales = cases[1].scale.view(torch.uint8)
    if fmt == "nvfp4":
        cases.append(PackedWeight.cat([packed(w[: n // 2] * 0.02, fmt), packed(w[n // 2 :] * 3.0, fmt)]))
        # e4m3 scales: NaN, zero, the smallest subnormal and normal, the largest, a negative one
        scales[3, 5], scales[4, 0], scales[5, 2], scales[6, 1], scales[8, 3], scales[9, 4] = 0x7F, 0, 1, 8, 0x7E, 0xB8
        normal = torch.randn(n, k, device=CUDA) * (1 + torch.arange(n, device=CUDA)[:, None] % 5)
        cases.append(PackedWeight.cat([packed(normal[: n // 2] * 0.02, fmt), packed(normal[n // 2 :] * 3.0, fmt)]))
        cases[-1].scale.view(torch.uint8)[3, 5], cases[-1].scale.view(torch.uint8)[4, 0] = 0x08, 0x7E
    else:
        cases.append(packed(clamped, fmt))  # the clamped weight again, without the NaN
        for p in cases[1:]:
            p.scale.view(torch.uint8)[4, 0], p.scale.view(torch.uint8)[5, 2] = 0, 1
        scales[3, 5] = 0xFF
    if fmt == "mxfp8":
        cases[0].scale.view(torch.uint8)[10, 2] = 150
    for p in cases:
        p.tile()
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("ms", [(1, 13), pytest.param((3, 4, 5, 8, 32, 64, 65, 128), marks=pytest.mark.slow)],
                         ids=["one_and_13_rows", "more_rows"])  # fmt: skip
def test_gpu_every_m_within_the_bound(fmt, ms):
    """M = 1 to 128 on a 1000 x 2048 weight (N past a multiple of 16; the fast tier takes 1 and 13 rows, both MMAs
    padding rows), the default launch and both MMAs with K split 3 ways, mma.sync with 4 warps splitting each of 2
    splits (the same bits every call); scales from 2**-12 to 2**6 (MXFP4's second multiply; MXFP8's with one scale of
    2**23) and below 2**1 (one), a NaN scale, 2**-127 and 2**-126 scales, a zero row; NVFP4 with a NaN, zero, subnormal,
    largest and negative e4m3 scale, and a tensor scale per row too, each on the hardware's e4m3 conversion, and
    positive normal scales on the one-instruction factor."""
    hopper()
    n, k = 1000, 2048
    cases = edge_cases(fmt, n, k)
    assert [p.wide_scales for p in cases] == ([True, True, True, False] if fmt == "nvfp4" else [True, True, False])
    configs = [None, dict(t=2, w=2, split_k=3, wgmma=False), dict(t=1, w=8, split_k=3, wgmma=True),
               dict(t=1, w=4, kw=4, split_k=2, wgmma=False)]  # fmt: skip
    for m in ms:
        x = torch.randn(m, k, device=CUDA).bfloat16()
        for p in cases:
            for cfg in configs:
                y = mm(x, p, cfg=cfg)
                assert_within_bound(y, x, p)
                if cfg is not None:
                    assert torch.equal(mm(x, p, cfg=cfg).view(torch.int16), y.view(torch.int16))
        assert mm(x, cases[1]).isnan().all(dim=0).nonzero().flatten().tolist() == [3]
        assert not mm(x, cases[0])[:, 7].any()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_few_rows_split_k_by_warps_or_by_programs(fmt):
    """At 1 and 4 rows the default launch of a weight with few programs' worth of tiles splits K by a program's 8
    warps (K = 2048: 16 steps), and by programs where the warps cannot split K's steps evenly (K = 384: 3 steps);
    both within the bound and the same bits every call."""
    hopper()
    from mx_kernels.gluon.weight_only_tiled import config

    torch.manual_seed(23)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = 16 * 3 * sms  # 3 tiles an SM: the split is 8 ways
    assert config(1, n, sms).get("kw") == config(4, n, sms).get("kw") == 8
    for k in (2048, 384):
        p = tiled(weights(n, k, CUDA), fmt)
        for m in (1, 4):
            x = torch.randn(m, k, device=CUDA).bfloat16()
            y = mm(x, p)
            assert_within_bound(y, x, p)
            assert torch.equal(mm(x, p).view(torch.int16), y.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_split_k_partials_summed_by_the_norm_are_the_gemm(fmt):
    """A GEMM whose launch splits K over programs returns its splits' fp32 sums [splits, M, N] (``partial_splits``
    of them) with ``partials``, and ``add_rms_norm`` of them (times ``partials_scale``) is bit for bit
    ``add_rms_norm`` of the GEMM's output, on both MMAs, for ``edge_cases``' weights (NaN, 2**-127 and 2**-126 scales,
    a zero row, an NVFP4 tensor scale per row); ``PackedWeight.mm_partials`` takes the same path and returns the
    output where nothing splits."""
    hopper()
    from mx_kernels.gluon.weight_only_tiled import partial_splits

    from mx_recipe.infer.fused import add_rms_norm

    n, k = 1000, 2048
    cases = edge_cases(fmt, n, k)
    norm_w = torch.rand(n, device=CUDA).bfloat16() + 0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m, cfg in ((8, None), (32, None), (5, dict(t=1, w=8, split_k=3, wgmma=True)),
                   (3, dict(t=2, w=2, split_k=3, wgmma=False))):  # fmt: skip
        x = torch.randn(m, k, device=CUDA).bfloat16()
        h = torch.randn(m, n, device=CUDA).bfloat16()
        for p in cases:
            parts = mm(x, p, cfg=cfg, partials=True)
            assert parts.dtype == torch.float32 and parts.shape == (partial_splits(m, n, k, sms, cfg), m, n)
            assert parts.shape[0] > 1
            got = add_rms_norm(h, parts, norm_w, 1e-5, p.partials_scale)
            want = add_rms_norm(h, mm(x, p, cfg=cfg), norm_w, 1e-5)
            assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))
            assert torch.equal(got[1].view(torch.int16), want[1].view(torch.int16))
    x = torch.randn(32, k, device=CUDA).bfloat16()
    out, scale = cases[0].mm_partials(x, kernel=True)
    assert out.shape[0] == partial_splits(32, n, k, sms) and (scale is None) == (fmt != "nvfp4")
    one, scale = cases[0].mm_partials(x[:1], kernel=True)  # a program's warps split K: the output
    assert scale is None and torch.equal(one.view(torch.int16), mm(x[:1], cases[0]).view(torch.int16))


def group_bounds(sizes: list[int]) -> list[tuple[int, int]]:
    ends = torch.tensor(sizes).cumsum(0).tolist()
    return [(end - size, end) for size, end in zip(sizes, ends, strict=True)]


def expert(p: PackedWeight, i: int) -> PackedWeight:
    """Expert ``i`` of untiled experts ``p`` as a dense tiled weight."""
    q, s = p.qdata[i], p.scale[i]
    if p.fmt == "nvfp4":
        ts = p.tensor_scale if p.tensor_scale.numel() == 1 else p.tensor_scale[i]
        one = PackedWeight(NVFP4Tensor(q, s, ts, 1), p.fmt)
    else:
        one = PackedWeight(MXTensor(q, s, "e4m3" if p.fmt == "mxfp8" else "e2m1", 1), p.fmt)
    one.tile()
    return one


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_grouped_experts_within_the_bound(fmt):
    """Tiled experts by the grouped kernel: ragged and empty groups, groups past a row tile (8 rows); K of 16 steps
    (the warps split it evenly: bit for bit the dense kernel on each expert with as many warps) and of 11 (the last
    warps' steps masked); a NaN, 2**-127 and 2**-126 scale and a zero row in one expert (NVFP4: NaN, zero,
    subnormal, largest and negative e4m3 scales, and a tensor scale per expert and row); within the bound of the
    reference, the same bits every call; a token's rows read in place, the copy's bits."""
    hopper()
    torch.manual_seed(31)
    sizes = [0, 1, 7, 0, 9, 20, 2, 0, 1, 1]
    e, bounds = len(sizes), group_bounds(sizes)
    offs = torch.tensor(sizes, device=CUDA).cumsum(0).to(torch.int32)
    for n, k in ((256, 2048), (160, 1408)):
        w = weights(n, k, CUDA, lead=(e,)) * 0.02
        w[4, 7] = 0.0
        plain = experts(w, fmt, row_scales=True)
        s = plain.scale.view(torch.uint8)
        if fmt == "nvfp4":
            s[5, 3, 5], s[5, 4, 0], s[5, 5, 2], s[5, 6, 1], s[5, 8, 3], s[5, 9, 4] = 0x7F, 0, 1, 8, 0x7E, 0xB8
        else:
            s[5, 3, 5], s[5, 4, 0], s[5, 5, 2] = 0xFF, 0, 1
        t = copy.deepcopy(plain)
        t.tile()
        x = torch.randn(sum(sizes), k, device=CUDA).bfloat16()
        for kw in (None, 1, 4, 8):
            y = grouped(x, t, offs, kw=kw)
            assert_within_bound(y, x, plain, offs)
            assert torch.equal(grouped(x, t, offs, kw=kw).view(torch.int16), y.view(torch.int16))
            if kw is not None and (k // 128) % kw == 0:
                cfg = dict(t=1, w=kw, kw=kw, split_k=1, wgmma=False)
                for i, (a, b) in enumerate(bounds):
                    if b > a:
                        assert torch.equal(mm(x[a:b], expert(plain, i), cfg=cfg).view(torch.int16),
                                           y[a:b].view(torch.int16))  # fmt: skip
        rows = torch.randint(0, 5, (x.shape[0],), device=CUDA, dtype=torch.int32)
        in_place, copied = grouped(x[:5], t, offs, rows), grouped(x[:5][rows], t, offs)
        assert torch.equal(in_place.view(torch.int16), copied.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gpu_grouped_early_shared_groups_are_the_same_bits(fmt):
    """The last groups as shared experts over every token, laid out as ``moe_route`` lays them (``early``: their
    tiles first, run without the PDL wait): the same bits as the same launch without ``early``, with and without
    SwiGLU and PDL, for 1, 3 and 11 tokens (a shared group past one row tile), K of 16 and of 11 steps."""
    hopper()
    from mx_kernels.gluon.weight_only_tiled import tiled_weight_only_grouped_mm as launch

    torch.manual_seed(34)
    routed, shared, top_k = 6, 2, 2
    for n, k, swiglu in ((64, 2048, True), (32, 1408, False)):
        p = experts(weights(n, k, CUDA, lead=(routed + shared,)) * 0.02, fmt, row_scales=True)
        p.tile(swiglu)
        for tokens in (1, 3, 11):
            picks = [torch.randperm(routed)[:top_k].tolist() for _ in range(tokens)]
            rows = [t for e in range(routed) for t in range(tokens) if e in picks[t]] + list(range(tokens)) * shared
            counts = [sum(e in c for c in picks) for e in range(routed)] + [tokens] * shared
            offs = torch.tensor(counts, device=CUDA).cumsum(0).to(torch.int32)
            rows = torch.tensor(rows, device=CUDA, dtype=torch.int32)
            x = torch.randn(tokens, k, device=CUDA).bfloat16()
            args = (x, p.qdata, p.scale, p.tensor_scale_tiled, fmt, p.wide_scales, offs, rows, swiglu)
            want = launch(*args)
            for pdl in (False, True):
                got = launch(*args, pdl=pdl, early=shared)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (n, tokens, pdl)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_grouped_swiglu_epilogue_and_prefill(fmt):
    """Experts' w1 and w3 tiled in SwiGLU's row order: the grouped kernel's epilogue is bit for bit ``silu_mul`` of
    the same launch on the experts in plain row order, and ``PackedWeight.grouped_mm`` takes it; past LARGE_M rows
    (prefill) the experts dequantize in their packed order for cuBLAS, bit for bit the untiled experts' GEMM and
    SwiGLU; asked without the epilogue, the reference."""
    hopper()
    from mx_kernels.decode_fused import silu_mul

    from mx_recipe.infer.weight_only import swiglu_of

    torch.manual_seed(32)
    sizes, n, k = [1, 0, 3, 9, 1, 2], 256, 1408
    offs = torch.tensor(sizes, device=CUDA).cumsum(0).to(torch.int32)
    untiled = experts(weights(n, k, CUDA, lead=(len(sizes),)) * 0.02, fmt, row_scales=True)
    plain, fused = copy.deepcopy(untiled), copy.deepcopy(untiled)
    plain.tile()
    fused.tile(swiglu=True)
    x = torch.randn(sum(sizes), k, device=CUDA).bfloat16()
    for kw in (None, 2, 8):
        y = grouped(x, plain, offs, kw=kw)
        assert torch.equal(grouped(x, fused, offs, swiglu=True, kw=kw), silu_mul(y[:, : n // 2], y[:, n // 2 :]))
    assert torch.equal(fused.grouped_mm(x, offs, kernel=True, swiglu=True), grouped(x, fused, offs, swiglu=True))
    reference = torch._grouped_mm(x, untiled.dequantize(torch.bfloat16).transpose(-2, -1), offs=offs)
    assert torch.equal(fused.grouped_mm(x, offs, kernel=True), reference)
    big = torch.randn(300, k, device=CUDA).bfloat16()
    big_offs = torch.tensor([40, 40, 100, 250, 260, 300], device=CUDA, dtype=torch.int32)
    want = swiglu_of(torch._grouped_mm(big, untiled.dequantize(torch.bfloat16).transpose(-2, -1), offs=big_offs))
    assert torch.equal(fused.grouped_mm(big, big_offs, kernel=True, swiglu=True), want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", pytest.param("nvfp4", marks=pytest.mark.slow)])
def test_gpu_moe_decode_step_takes_the_tiled_experts(fmt, monkeypatch):
    """``tile_weights`` for one sequence tiles an MoE's 4-bit w1/w3 experts in SwiGLU's row order, the shared expert
    folded in (w2 stays in the formats' layout), for two it leaves them; a decode step of one token (3 rows) and of
    five (15) runs each MoE block's w1/w3 with SwiGLU by the tiled grouped kernel and gives the full forward's logits
    within bf16 roundings; replayed from a CUDA graph under PDL, the untiled model's step up to summation order."""
    hopper()
    from mx_kernels import pdl
    from test_decode_gemv import decode_model, decode_step

    from mx_recipe.infer import decode
    from mx_recipe.infer.weights import tile_weights

    model = tile_weights(decode_model("moe", "debug_moe", fmt), 1)
    blocks = [layer.moe.experts for layer in model.layers.values() if getattr(layer, "moe_enabled", False)]
    assert blocks and all(b.shared and b.w13_packed.tiled and b.w13_packed.swiglu_rows and not b.w2_packed.tiled
                          for b in blocks)  # fmt: skip
    two = tile_weights(decode_model("moe", "debug_moe", fmt), 2)
    assert not any(layer.moe.experts.w13_packed.tiled for layer in two.layers.values() if layer.moe_enabled)
    op, calls = torch.ops.mx_recipe.weight_only_tiled_grouped_mm, []

    def recorded(x, words, scales, tensor_scale, fmt, wide_scales, offs, rows=None, swiglu=False, early=0):
        calls.append((rows is not None, swiglu, early))
        return op(x, words, scales, tensor_scale, fmt, wide_scales, offs, rows, swiglu=swiglu, early=early)

    monkeypatch.setattr(torch.ops.mx_recipe, "weight_only_tiled_grouped_mm", recorded)
    cuda = torch.device(CUDA)
    for batch in (1, 5):  # the shared groups run early: x came before the routing's launch
        assert decode_step(model, batch, calls) == [(True, True, b.shared) for b in blocks], (batch, calls)
    monkeypatch.undo()
    plain = decode_model("moe", "debug_moe", fmt)
    tokens = torch.randint(0, 320, (1, 12), device=cuda)
    logits = []
    for m in (plain, model):
        cache = decode.KVCache(m, 1, 16, torch.bfloat16, cuda)
        with torch.no_grad(), pdl.launching(True):
            decode.forward(m, tokens[:, :11], torch.arange(11, device=cuda), cache)
            step = decode.DecodeGraph(m, cache, tokens[:, 11:], torch.tensor([11], device=cuda))
            logits.append(step(tokens[:, 11:], torch.tensor([11], device=cuda)).clone())
    torch.testing.assert_close(logits[1].float(), logits[0].float(), atol=0.05, rtol=0.05)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same bits, NaNs (whose payloads a rounding may not keep) at the same places."""
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num().view(torch.int16), want.nan_to_num().view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_split_k_partials_in_the_attention_are_the_gemm(fmt):
    """A QKV GEMM's split-K partials handed to the decode attention (times ``partials_scale``) give the output and
    caches, bit for bit, of the attention fed the GEMM's output: their sum as the attention kernel forms it is the
    GEMM's output, on both MMAs, for ``edge_cases``' weights (a NaN scale in q's columns, an NVFP4 tensor scale per
    column); chunks of one tile and of several, per-sequence positions."""
    hopper()
    from test_decode_attention import append_split_sums, summed_as_kernel

    from mx_recipe.models.llama import rope_tables

    hkv, reps, d, k = 2, 4, 128, 2048
    cases = edge_cases(fmt, hkv * (reps + 2) * d, k)
    for m, cfg, cache_len in ((32, None, 1024), (5, dict(t=1, w=8, split_k=3, wgmma=True), 256),
                              (3, dict(t=2, w=2, split_k=3, wgmma=False), 256)):  # fmt: skip
        cos, sin = rope_tables(d, cache_len, 500000.0, CUDA)
        x = torch.randn(m, k, device=CUDA).bfloat16()
        caches = torch.randn(2, m, hkv, cache_len, d, device=CUDA).bfloat16().unbind(0)
        length = torch.randint(1, cache_len + 1, (m,), device=CUDA)
        for p in cases:
            parts = mm(x, p, cfg=cfg, partials=True)
            assert parts.shape[0] > 1
            assert_same_bits(summed_as_kernel(parts, p.partials_scale, torch.bfloat16), mm(x, p, cfg=cfg))
            got, want = append_split_sums(parts, p.partials_scale, hkv, reps, d, *caches, length, cos, sin)
            assert_same_bits(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_swiglu_epilogue_is_the_gemm_then_silu_mul(fmt):
    """With w1 and w3 tiled in SwiGLU's row order, the epilogue's output is bit for bit ``silu_mul`` of the same
    GEMM's output (the same launch on the weight in plain row order), on both MMAs, K split or not (by programs or
    by a program's warps), and
    ``PackedWeight.mm`` takes it; asked without the epilogue, the weight is dequantized for cuBLAS."""
    hopper()
    from mx_kernels.decode_fused import silu_mul

    torch.manual_seed(22)
    n, k = 512, 1024
    w = weights(n, k, CUDA) * 0.02
    plain, fused = tiled(w, fmt), tiled(w, fmt, swiglu=True)
    for m, cfg in ((1, dict(t=1, w=1, split_k=4, wgmma=False)), (8, dict(t=2, w=2, split_k=1, wgmma=False)),
                   (40, dict(t=1, w=4, split_k=2, wgmma=True)),
                   (1, dict(t=1, w=2, kw=2, split_k=1, wgmma=False))):  # fmt: skip
        x = torch.randn(m, k, device=CUDA).bfloat16()
        y = mm(x, plain, cfg=cfg)
        assert torch.equal(mm(x, fused, swiglu=True, cfg=cfg), silu_mul(y[:, : n // 2], y[:, n // 2 :]))
    x = torch.randn(2, k, device=CUDA).bfloat16()
    assert torch.equal(fused.mm(x, kernel=True, swiglu=True), mm(x, fused, swiglu=True))
    reference = torch.nn.functional.linear(x, packed(w, fmt).dequantize(torch.bfloat16))
    assert torch.equal(fused.mm(x, kernel=True), reference)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_decode_step_with_tiled_weights(fmt):
    """The Llama debug model with quantized weights: ``tile_weights`` for two sequences tiles its dense projections
    but w2 (K = 704, not a multiple of 128), w13 for the SwiGLU epilogue (MXFP8 ones only past one sequence and
    without NaN codes); its prefill (past LARGE_M rows: the formats' layout) gives the untiled model's logits bit for
    bit, and a decode step replayed from a CUDA graph under PDL up to summation order, at one sequence and at eight
    (where the QKV and wo GEMMs hand their split-K partials to the attention and the add + norm kernels)."""
    hopper()
    from mx_kernels import pdl
    from mx_kernels.gluon.weight_only_tiled import codes_per_word, partial_splits

    from mx_recipe.infer import decode
    from mx_recipe.infer.weights import FusedLinear, QuantizedLinear, fuse_projections, quantize_model, tile_weights
    from mx_recipe.models import build_model, model_args

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        m = build_model(model_args("llama", "debug", 320, 256)).to(CUDA)
        m.init_weights()
        return fuse_projections(quantize_model(m.eval().bfloat16(), fmt))

    plain, tiled_model = model(), tile_weights(model(), 2)
    one = tile_weights(model(), 1)
    assert any(m.tiled for m in one.modules() if isinstance(m, PackedWeight)) == (fmt != "mxfp8")
    if fmt == "mxfp8":  # a weight with a NaN code keeps the formats' layout, the others are tiled
        nan_model = model()
        packs = {name: mod.weight_packed for name, mod in nan_model.named_modules()
                 if isinstance(mod, QuantizedLinear | FusedLinear) and mod.weight_packed is not None}  # fmt: skip
        packs["layers.0.attention.wo"].qdata.view(torch.uint8)[3, 5] = 0x7F
        tile_weights(nan_model, 2)
        assert not packs["layers.0.attention.wo"].tiled and packs["layers.1.attention.wo"].tiled
    found = {name: mod.weight_packed for name, mod in tiled_model.named_modules()
             if isinstance(mod, QuantizedLinear | FusedLinear) and mod.weight_packed is not None}  # fmt: skip
    assert found and all(p.tiled != name.endswith("w2") for name, p in found.items())
    assert all(p.swiglu_rows == name.endswith("w13") for name, p in found.items() if p.tiled)
    # at 8 sequences the QKV and wo GEMMs split K over programs: their partials go to the attention and the norm
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name in ("wqkv", "wo"):
        p = found[f"layers.0.attention.{name}"]
        assert partial_splits(8, p.rows, p.qdata.shape[1] * codes_per_word(fmt), sms) > 1
    for batch in (1, 8):
        tokens = torch.randint(0, 320, (batch, 200), device=CUDA)
        logits = []
        for m in (plain, tiled_model):
            cache = decode.KVCache(m, batch, 256, torch.bfloat16, torch.device(CUDA))
            with torch.no_grad(), pdl.launching(True):
                first = decode.forward(m, tokens, torch.arange(200, device=CUDA), cache)
                step = decode.DecodeGraph(m, cache, tokens[:, -1:], torch.tensor([200], device=CUDA))
                logits.append((first, step(tokens[:, -1:], torch.tensor([200], device=CUDA)).clone()))
        assert torch.equal(logits[0][0], logits[1][0])
        torch.testing.assert_close(logits[1][1].float(), logits[0][1].float(), atol=0.05, rtol=0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_dequantize_is_the_untiled_weights(fmt):
    """On the GPU a tiled weight dequantizes (one kernel) to the untiled weight's bits and unpacks to its bytes,
    SwiGLU's row order and a partial 16-row tile too."""
    hopper()
    for n, swiglu in ((1000, False), (512, True)):
        p = packed(weights(n, 1024, CUDA), fmt)
        want, codes = p.dequantize(torch.bfloat16), p.qdata.clone()
        p.tile(swiglu)
        assert torch.equal(p.dequantize(torch.bfloat16).view(torch.int16), want.view(torch.int16))
        assert torch.equal(p.natural_codes()[0], codes)
