"""The weight-only GEMM (kernels/mx/weight_only.py through mx_recipe.infer.weight_only) against the reference:
dequantize the packed weight, then the GEMM.

* CPU, in this process: argument errors, the reference path of ``QuantizedLinear`` off the GPU, and the
  small-M kernel compiled for sm_90a: a K tail loads as whole tiles do.
* CPU, Triton interpreter (``test_interp_*``), in a child pytest with TRITON_INTERPRET=1 as in
  tests/test_gemm_triton.py (with its shim for the interpreter's int() of a scalar): every format, M in
  {1, 3, 17}, N and K not powers of two, K tails, split K, NaN scales and elements, zeros, grouped with ragged
  and empty groups and with its rows read from the tokens by index; the small-M (FMA) path at M = 1 to 16 with
  odd N, tails and splits, one tensor scale per row (nvfp4 weights concatenated along N), and the SwiGLU
  epilogue against the unfused GEMM then ``silu_mul`` (bit for bit, all paths, grouped too). Run them with
  ``TRITON_INTERPRET=1 pytest tests/test_weight_only_gemm.py -k interp_``.
* GPU (``gpu``): every format at M = 1 to 256 on 4128 x 4128 weights (K = 4112 for nvfp4), grouped with ragged
  groups, split-K determinism, CUDA-graph capture, and ``QuantizedLinear`` taking the kernel; the small-M path's
  every candidate config on Llama 3 8B's wk shape at M = 1 to 16; the SwiGLU epilogue at M = 1 to 33 and as an
  MoE decode step.

Bound. The reference r = sum_k x_k w_k is computed exactly (fp64) from w = ``dequantize(bf16)``. For MXFP8 and
MXFP4 the kernel's upcast weights are those same values (exact in bf16); its products are exact in fp32 and its
fp32 sum, in any order and over any split of K, is within (K - 1) 2**-24 S of the exact one, S = sum_k |x_k w_k|;
2**-23 a step covers an accumulator that truncates. For NVFP4 the kernel sums x_k (e2m1 * e4m3)_k and multiplies
by the tensor scale t once (one more fp32 rounding), while ``dequantize`` rounds each w_k = (e2m1 * e4m3)_k * t to
bf16: |sum_k x_k w_k - t sum_k x_k (e2m1 * e4m3)_k| <= (2**-8 + 2**-23) S. Last, the bf16 output rounds by at most
rho |y| with rho = 2**-8 (nearest), or 2**-7 in the interpreter, whose fp32 -> bf16 cast truncates. With the
second-order terms folded into the constants:

    |y - r| <= rho |r| + (1.05 K 2**-23 + [nvfp4] 2**-7) S
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest
import torch
from test_cast_kernels import run_interpreter_tests

from mx_recipe.infer.weights import PackedWeight, QuantizedLinear, quantize

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
FORMATS = ("mxfp8", "mxfp4", "nvfp4")

interp_only = pytest.mark.skipif(not (INTERP and HAS_TRITON), reason="runs in the Triton interpreter child process")

if INTERP and HAS_TRITON:
    from test_gemm_triton import _install_interpreter_shims  # noqa: F401  (installed on import)


def packed(w: torch.Tensor, fmt: str) -> PackedWeight:
    return PackedWeight(quantize(w, fmt), fmt)


def run(x: torch.Tensor, p: PackedWeight, offs: torch.Tensor | None = None, **kw) -> torch.Tensor:
    from mx_kernels.mx.weight_only import weight_only_mm

    return weight_only_mm(x, p.qdata, p.scale, p.tensor_scale, p.fmt, offs, **kw)


def reference(x: torch.Tensor, p: PackedWeight, offs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, S) of the module doc in fp64: each group's rows by its dequantized weight."""
    w = p.dequantize(torch.bfloat16).double()
    xd = x.double()
    if offs is None:
        return xd @ w.T, xd.abs() @ w.abs().T
    r, s, start = [], [], 0
    for e, end in enumerate(offs.tolist()):
        r.append(xd[start:end] @ w[e].T)
        s.append(xd[start:end].abs() @ w[e].abs().T)
        start = end
    return torch.cat(r), torch.cat(s)


def assert_within_bound(y: torch.Tensor, x: torch.Tensor, p: PackedWeight, offs: torch.Tensor | None = None) -> None:
    r, s = reference(x, p, offs)
    assert y.dtype == torch.bfloat16 and y.shape == r.shape
    rho = 2.0**-7 if INTERP else 2.0**-8
    bound = rho * r.abs() + (1.05 * x.shape[1] * 2.0**-23 + (2.0**-7 if p.fmt == "nvfp4" else 0.0)) * s
    yd = y.double()
    assert torch.equal(yd.isnan(), r.isnan()), "NaN where the reference has none, or the other way"
    excess = ((yd - r).abs() - bound).nan_to_num(0.0)
    assert excess.max() <= 0, f"{p.fmt} {tuple(x.shape)}: past the bound by {excess.max().item():.3g}"


def weights(n: int, k: int, device: str = "cpu", lead: tuple[int, ...] = ()) -> torch.Tensor:
    """Normal weights with a spread of block magnitudes (2**-12 to 2**6), so the scales differ along K and N."""
    w = torch.randn(*lead, n, k, device=device)
    spread = 2.0 ** torch.randint(-12, 7, (*lead, n, k // 16), device=device).float()
    return w * spread.repeat_interleave(16, dim=-1)


# ---------------------------------------------------------------------------------------
# CPU, in this process


def test_bad_operands_are_one_line_errors():
    from mx_kernels.mx.weight_only import check

    p = packed(torch.randn(32, 64), "mxfp8")
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    cases = [
        (dict(fmt="fp8"), "unknown format"),
        (dict(x=x.float()), "2D bf16"),
        (dict(x=x[:, :32]), "K a multiple of 32"),
        (dict(tensor_scale=torch.ones(())), "tensor_scale"),
        (dict(qdata=p.qdata[None]), "2D tensors of bytes"),
    ]
    for change, message in cases:
        args = dict(x=x, qdata=p.qdata, scale=p.scale, tensor_scale=None, fmt="mxfp8", grouped=False, op="op")
        with pytest.raises(ValueError, match=message) as info:
            check(**{**args, **change})
        assert "\n" not in str(info.value)


@pytest.mark.skipif(INTERP, reason="the parent process")
def test_off_the_gpu_quantized_linear_is_the_reference():
    lin = torch.nn.Linear(64, 32, bias=False)
    q = QuantizedLinear(lin, "mxfp4")
    x = torch.randn(3, 64)
    assert torch.equal(q(x), torch.nn.functional.linear(x, q.weight_packed.dequantize(torch.float32)))


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="this is the parent of the interpreter run")
def test_kernel_in_triton_interpreter():
    """Run the test_interp_* tests in a child pytest with TRITON_INTERPRET=1 (see module doc)."""
    run_interpreter_tests(__file__)


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="compiles with Triton's CUDA backend")
@pytest.mark.parametrize("fmt", FORMATS)
def test_small_m_k_tail_loads_are_as_wide_as_whole_tiles(fmt, monkeypatch):
    """What the interpreter cannot check: compiled for sm_90a with the arguments the launcher builds, the small-M
    kernel loads a K tail (MoE 16B's down projection, K = 1408: no power-of-two tile divides it) with the
    instructions of a whole tile, a unit of pairs a load, not one byte or one pair of x a load (a mask per pair
    made them that, and the experts' down GEMM 1.7x slower on an H200)."""
    from mx_kernels.gluon.common import compile_for_arch
    from mx_kernels.mx import weight_only

    launches = []

    class Capture:
        def launch(self, grid, kwargs):
            # the GPU's conversions and x's 16-byte loads, as a CUDA launch of these aligned tensors has them
            launches.append(dict(kwargs, HW=True, X_VEC=True))

    monkeypatch.setattr(weight_only, "_FMA_LAUNCHES", Capture())
    monkeypatch.setattr(weight_only, "interpreting", lambda: True)  # CPU tensors past the launcher's check
    config = dict(BLOCK_N=8, BLOCK_K=512, SPLIT_K=1, num_warps=1, UNIT=8)
    loads = {}
    for k in (1536, 1408):  # whole tiles; a tail of 384
        p = packed(torch.randn(8, 256, k), fmt)  # 8 experts, a row each: a decode step's groups
        run(torch.randn(8, k).bfloat16(), p, torch.arange(1, 9, dtype=torch.int32), config=config)
        assert launches[-1]["EVEN_K"] == (k == 1536)
        ptx = compile_for_arch(weight_only._weight_only_fma_kernel, launches[-1], 90).asm["ptx"]
        loads[k] = sorted(re.findall(r"\bld\.global[.\w]*", ptx))  # predicated ones too (the tail's)
    assert loads[1408] == loads[1536], fmt
    assert "ld.global.b8" not in loads[1408] and "ld.global.b16" not in loads[1408]


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="compiles with Triton's CUDA backend")
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("grouped", [False, True, "offs_ready"])
def test_small_m_first_weights_before_the_pdl_wait(fmt, grouped, monkeypatch):
    """Compiled for sm_90a under PDL as the launcher builds it (a decode step's 8 rows, MoE 16B's down projection):
    dense, the first K step's weights are loaded before the wait for the kernel before; grouped right after the
    routing kernel, nothing; grouped where an earlier kernel wrote ``offs`` and ``rows`` (an MoE's w2 after w1/w3),
    those alone, from L2. The next kernel is released right after the wait."""
    from mx_kernels.gluon.common import compile_for_arch
    from mx_kernels.mx import weight_only

    launches = []

    class Capture:
        def launch(self, grid, kwargs):
            launches.append(dict(kwargs, HW=True, X_VEC=fmt != "mxfp8", PDL=True))

    monkeypatch.setattr(weight_only, "_FMA_LAUNCHES", Capture())
    monkeypatch.setattr(weight_only, "interpreting", lambda: True)  # CPU tensors past the launcher's check
    config = dict(BLOCK_N=8, BLOCK_K=512, SPLIT_K=1, num_warps=1, UNIT=8)
    if grouped:
        p = packed(torch.randn(8, 256, 1408), fmt)
        offs, rows = torch.arange(1, 9, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
        run(torch.randn(1, 1408).bfloat16(), p, offs, config=config, rows=rows, offs_ready=grouped == "offs_ready")
    else:
        run(torch.randn(2, 1408).bfloat16(), packed(torch.randn(256, 1408), fmt), config=config)
    ptx = compile_for_arch(weight_only._weight_only_fma_kernel, launches[-1], 90).asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    before, after = ptx[:wait], ptx[wait:]
    assert after.index("griddepcontrol.launch_dependents") < after.index("ld.global")
    loads = set(re.findall(r"\bld\.global[.\w]*", before))
    if not grouped:
        assert any(re.fullmatch(r"ld\.global(\.nc)?\.v\d\.b32", ld) for ld in loads), loads  # codes, 8-16 bytes
        assert "ld.global.nc.v4.u32" not in loads  # x's 16-byte loads (e2m1 weights): the kernel before's output
    else:
        assert loads == ({"ld.global.cg.b32"} if grouped == "offs_ready" else set()), loads


def x_load_layouts(ttgir: str) -> list[tuple[list[int], list[int]]]:
    """(sizePerThread, order) of each 16-byte inline load of x in a small-M kernel's TTGIR."""
    blocked = {name: ([int(v) for v in size.split(",")], [int(v) for v in order.split(",")])
               for name, size, order in re.findall(
                   r"^(#blocked\d*) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\][^}]*order = \[([\d, ]+)\]",
                   ttgir, re.M)}  # fmt: skip
    loads = re.findall(r'elementwise_inline_asm "[^"]*ld\.global\.nc\.v4[^"]*".*-> tensor<[^,]*, (#blocked\d*)>', ttgir)
    return [blocked[name] for name in loads]


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="compiles with Triton's CUDA backend")
@pytest.mark.parametrize("fmt", FORMATS)
def test_small_m_x_loads_skip_shared_memory(fmt, monkeypatch):
    """Compiled for sm_90a as the launcher launches it on a GPU (e2m1 weights; e4m3 ones with X_VEC set), x's rows
    and the weight's 16-byte aligned, every small-M tile, 1 and 3 rows, whole K steps and a tail: x is loaded 16
    bytes at a time in the unit sums' layout (4 or 8 consecutive pairs of K a thread: what the loads' 4 packed
    elements must be), and the K loop stores nothing to shared memory and waits at no barrier (x's tl.load took
    both, every K step). A weight row of 2056 bytes (NVFP4 at K = 4112), which Triton knows only as 8-aligned,
    gets one pair a thread: the tl.load there."""
    from mx_kernels.gluon.common import compile_for_arch
    from mx_kernels.mx import weight_only
    from script_module import load_script

    launches = []

    class Capture:
        def launch(self, grid, kwargs):
            launches.append(kwargs)

    def launch(m: int, k: int, config: dict) -> dict:
        x = torch.empty(m, k, dtype=torch.bfloat16, device="meta")  # aligned addresses, no data
        q = torch.empty(4096, k // weight_only.FORMATS[fmt][1], dtype=torch.uint8, device="meta")
        s = torch.empty(4096, k // weight_only.FORMATS[fmt][0], dtype=torch.uint8, device="meta")
        ts = torch.ones(1, device="meta") if fmt == "nvfp4" else None
        out = torch.empty(m, 4096, dtype=torch.bfloat16, device="meta")
        weight_only._fma_mm(x, q, s, ts, fmt, None, None, out, config, 1)
        return dict(launches[-1], HW=True)

    monkeypatch.setattr(weight_only, "_FMA_LAUNCHES", Capture())
    tiles = {(c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["UNIT"]) for c in weight_only.FMA_CANDIDATES[None]}
    for block_n, block_k, warps, unit in sorted(tiles):
        config = weight_only._fma(block_n, block_k, 1, warps, unit=unit)
        for m, k in ((1, 4096), (3, 4096 + block_k // 2)):
            kwargs = launch(m, k, config)
            assert kwargs["X_VEC"] == (fmt != "mxfp8") and kwargs["EVEN_K"] == (k == 4096)  # e4m3: slower (doc)
            kwargs["X_VEC"] = True
            layouts = x_load_layouts(compile_for_arch(weight_only._weight_only_fma_kernel, kwargs, 90).asm["ttgir"])
            assert layouts and all(size[-1] == unit and order[0] == 2 for size, order in layouts), (config, layouts)
    wq = weight_only._fma(4, 1024, 1, 2, unit=8)  # Llama 3 8B's wq: the K loop with and without x's 16-byte loads
    sass = load_script("sass_loop_count")
    for vec in (True, False):
        cubin = compile_for_arch(weight_only._weight_only_fma_kernel, dict(launch(1, 4096, wq), X_VEC=vec), 90)
        loop = " ".join(sass.loop_instructions(cubin.asm["cubin"]))
        assert ("BAR.SYNC" in loop or "STS" in loop) != vec, (fmt, vec)
        assert ("LDG.E.128.CONSTANT" in loop) == vec, (fmt, vec)
    if fmt == "nvfp4":
        kwargs = dict(launch(1, 4112, wq), X_VEC=True)
        assert not launch(1, 4112, wq)["X_VEC"]
        layouts = x_load_layouts(compile_for_arch(weight_only._weight_only_fma_kernel, kwargs, 90).asm["ttgir"])
        assert all(size[-1] == 1 for size, _ in layouts), layouts  # why the launcher takes the tl.load there


@pytest.mark.skipif(INTERP or not HAS_TRITON, reason="compiles with Triton's CUDA backend")
def test_register_tile_defaults_do_not_spill(monkeypatch):
    """NVFP4's tensor-core tile at 8 and 32 rows (a decode step of 8 or 32 sequences), its default config compiled
    for sm_90a with the launcher's arguments: no spill stack (the tile is the upcast weights held in registers; 128
    columns by 256 of K at 4 warps spills)."""
    import subprocess
    import tempfile

    import triton
    from mx_kernels.gluon.common import compile_for_arch
    from mx_kernels.mx import weight_only

    launches = []

    class Capture:
        def launch(self, grid, kwargs):
            launches.append(dict(kwargs, DOT_BF16=True))  # the bf16 dot a CUDA launch takes

    monkeypatch.setattr(weight_only, "_LAUNCHES", Capture())
    monkeypatch.setattr(weight_only, "interpreting", lambda: True)  # CPU tensors past the launcher's check
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    p = packed(torch.randn(256, 512), "nvfp4")
    for m in (8, 32):
        run(torch.randn(m, 512).bfloat16(), p, config=weight_only.config_for(m, "nvfp4", fma=False, scaled=False))
        cubin = compile_for_arch(weight_only._weight_only_kernel, launches[-1], 90).asm["cubin"]
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        assert launches[-1]["BLOCK_N"] == 128 and re.search(r"\bSTACK:0\b", usage), (m, usage)


# ---------------------------------------------------------------------------------------
# CPU, Triton interpreter (child process)

SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, num_warps=4, num_stages=1)
SMALL_SCALED = dict(SMALL, SCALED=True, STAGES=2)  # tl.dot_scaled (the MX formats)


@interp_only
@pytest.mark.parametrize("fmt", FORMATS)
def test_interp_shapes_tails_and_split_k(fmt):
    """M in {1, 3, 17}; N = 40, 96; K = 96 and 160 (tails of 32 at BLOCK_K 64), K = 80 for nvfp4 (a tail of 16);
    the default tiles, and small ones split 1, 2 and 3 ways over K."""
    torch.manual_seed(0)
    ks = (96, 160, 80) if fmt == "nvfp4" else (96, 160)
    for n, k in [(96, ks[0]), (40, ks[1]), *([(48, 80)] if fmt == "nvfp4" else [])]:
        p = packed(weights(n, k), fmt)
        for m in (1, 3, 17):
            x = torch.randn(m, k).bfloat16()
            assert_within_bound(run(x, p), x, p)
            for split in (1, 2, 3):
                assert_within_bound(run(x, p, config=SMALL, split_k=split), x, p)
                if fmt != "nvfp4":
                    assert_within_bound(run(x, p, config=SMALL_SCALED, split_k=split), x, p)


def check_nan_and_zeros(fmt: str, device: str) -> None:
    """A NaN scale (e8m0 0xFF, e4m3 0x7F) makes its row's outputs NaN, and nothing else; an fp8 NaN element
    with a finite scale too; all-zero weights (the smallest scale) and zero activations give exact zeros. Every
    path: M = 3 (the small-M FMAs) and 17 (the tensor-core tile: tl.dot_scaled for MX, the register tile)."""
    torch.manual_seed(1)
    n, k = 48, 96
    p = packed(weights(n, k, device), fmt)
    p.scale.view(torch.uint8)[5, 1] = 0x7F if fmt == "nvfp4" else 0xFF
    if fmt == "mxfp8":
        p.qdata.view(torch.uint8)[9, 40] = 0xFF
    nan_rows = {5, 9} if fmt == "mxfp8" else {5}
    zero = packed(torch.zeros(n, k, device=device), fmt)
    configs = [None, SMALL] + ([] if fmt == "nvfp4" else [SMALL_SCALED])
    for m in (3, 17):
        x = torch.randn(m, k, device=device).bfloat16()
        for config in configs:
            y = run(x, p, config=config, split_k=2)
            assert_within_bound(y, x, p)
            assert set(y.isnan().all(dim=0).nonzero().flatten().tolist()) == nan_rows
            assert torch.equal(run(x, zero, config=config), torch.zeros(m, n, dtype=torch.bfloat16, device=device))
    assert torch.equal(run(torch.zeros(1, k, dtype=torch.bfloat16, device=device), zero),
                       torch.zeros(1, n, dtype=torch.bfloat16, device=device))  # fmt: skip
    assert run(x[:0], p).shape == (0, n)


@interp_only
@pytest.mark.parametrize("fmt", FORMATS)
def test_interp_nan_and_zeros(fmt):
    check_nan_and_zeros(fmt, "cpu")


@interp_only
def test_interp_scaled_path_takes_only_the_mx_formats():
    p = packed(weights(32, 64), "nvfp4")
    x = torch.randn(17, 64).bfloat16()
    with pytest.raises(ValueError, match="tl.dot_scaled path takes the MX formats"):
        run(x, p, config=SMALL_SCALED)


@interp_only
@pytest.mark.parametrize("fmt", FORMATS)
def test_interp_grouped_ragged_and_empty(fmt):
    """Groups of 0, 3, 0, 20 and 1 rows (empty first, middle and several tiles), split K, groups all empty
    but one, and one row in every group (as many row tiles as rows: the grid's bound); an expert without rows is
    never read (NaN weights there change nothing)."""
    torch.manual_seed(2)
    n, k = 48, 96
    for sizes, config, split in [([0, 3, 0, 20, 1], SMALL, 2), ([2, 0, 0, 1], None, None), ([0, 0, 5], SMALL, 1),
                                 ([0, 3, 0, 20, 1], SMALL if fmt == "nvfp4" else SMALL_SCALED, 2),
                                 ([1, 1, 1, 1, 1], SMALL, 1),
                                 ([1, 1, 1, 1, 1], FMA_CONFIGS[1], 1)]:  # fmt: skip
        p = packed(weights(n, k, lead=(len(sizes),)), fmt)
        for e, size in enumerate(sizes):
            if size == 0:
                p.scale.view(torch.uint8)[e] = 0x7F if fmt == "nvfp4" else 0xFF
        offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
        x = torch.randn(sum(sizes), k).bfloat16()
        y = run(x, p, offs, config=config, split_k=split)
        assert not y.isnan().any()
        assert_within_bound(y, x, p, offs)


@interp_only
@pytest.mark.parametrize("fmt", FORMATS)
def test_interp_grouped_rows_read_in_place(fmt):
    """``rows``: the groups' rows read from the tokens by index give the bits of the gathered copy's GEMM, on the
    small-M path (a decode step's top-3 of 2 tokens) and both tensor-core paths (a token in two groups); a bad
    ``rows`` is a one-line error."""
    torch.manual_seed(4)
    n, k = 40, 96
    tokens = torch.randn(5, k).bfloat16()
    for sizes, rows, config in [([1, 0, 2, 1, 2], [1, 0, 1, 0, 0, 1], FMA_CONFIGS[1]),
                                ([3, 0, 17], [4, 0, 2, *range(5), *range(5), *range(5), 3, 1], SMALL),
                                ([3, 0, 17], [4, 0, 2, *range(5), *range(5), *range(5), 3, 1],
                                 SMALL if fmt == "nvfp4" else SMALL_SCALED)]:  # fmt: skip
        p = packed(weights(n, k, lead=(len(sizes),)), fmt)
        offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
        rows = torch.tensor(rows, dtype=torch.int32)
        y = run(tokens, p, offs, config=config, split_k=2, rows=rows)
        assert torch.equal(y, run(tokens[rows], p, offs, config=config, split_k=2))
    with pytest.raises(ValueError, match="rows must be an int32") as info:
        run(tokens, p, offs, rows=rows.long())
    assert "\n" not in str(info.value)


@interp_only
@pytest.mark.parametrize("fmt", FORMATS)
def test_interp_dequantize_is_the_references_bits(fmt):
    """The large-M path's dequantize kernel gives ``dequantize``'s values bit for bit (fp32 here: the interpreter's
    bf16 cast truncates), 2D and 3D, K short of its power-of-2 tile."""
    from mx_kernels.mx.weight_only import dequantize

    torch.manual_seed(3)
    for shape in [(40, 96), (3, 17, 160), *([(5, 48)] if fmt == "nvfp4" else [])]:
        p = packed(weights(shape[-2], shape[-1], lead=shape[:-2]), fmt)
        p.scale.view(torch.uint8)[..., 0, 0] = 0x7F if fmt == "nvfp4" else 0xFF
        got = dequantize(p.qdata, p.scale, p.tensor_scale, fmt, torch.float32)
        assert torch.equal(got.isnan(), p.dequantize(torch.float32).isnan())
        assert torch.equal(got.nan_to_num(), p.dequantize(torch.float32).nan_to_num())


FMA_CONFIGS = (dict(BLOCK_N=4, BLOCK_K=32, num_warps=1), dict(BLOCK_N=8, BLOCK_K=64, num_warps=2),
               dict(BLOCK_N=4, BLOCK_K=64, num_warps=1, UNIT=8))  # fmt: skip


@interp_only
@pytest.mark.parametrize("fmt", FORMATS)
def test_interp_small_m_path(fmt):
    """The FMA path (configs without BLOCK_M, units of 4 and 8 pairs): M = 1, 2, 5 and 16, N = 37 (odd), K = 96 (a
    tail at BLOCK_K 64; 80 for nvfp4: a tail of 16), split 1 and 3; split K twice gives the same bits; grouped
    with ragged groups."""
    torch.manual_seed(5)
    k = 80 if fmt == "nvfp4" else 96
    p = packed(weights(37, k), fmt)
    for m in (1, 2, 5, 16):
        x = torch.randn(m, k).bfloat16()
        for config in FMA_CONFIGS:
            for split in (1, 3):
                assert_within_bound(run(x, p, config=config, split_k=split), x, p)
    x = torch.randn(3, k).bfloat16()
    assert torch.equal(run(x, p, config=FMA_CONFIGS[0], split_k=3), run(x, p, config=FMA_CONFIGS[0], split_k=3))
    sizes = [0, 2, 1, 0]
    g = packed(weights(24, k, lead=(len(sizes),)), fmt)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x = torch.randn(sum(sizes), k).bfloat16()
    assert_within_bound(run(x, g, offs, config=FMA_CONFIGS[1], split_k=2), x, g, offs)


def check_swiglu_epilogue(x: torch.Tensor, p: PackedWeight, offs: torch.Tensor | None = None, **kw) -> None:
    """``swiglu``'s output is the unfused GEMM's two halves through ``silu_mul``, bit for bit (same tiles, split)."""
    from mx_kernels.decode_fused import silu_mul

    y = run(x, p, offs, swiglu=True, **kw)
    h1, h3 = run(x, p, offs, **kw).chunk(2, dim=1)
    assert y.shape == h1.shape and torch.equal(y, silu_mul(h1, h3)), kw


@interp_only
@pytest.mark.parametrize("fmt", FORMATS)
def test_interp_swiglu_epilogue(fmt):
    """``swiglu`` (w1 and w3 along N; out silu(x w1^T) * (x w3^T)) against the unfused GEMM then ``silu_mul``: the
    small-M path (in its epilogue) and both tensor-core paths (the GEMM, then silu_mul), N / 2 = 21 (odd: a partial
    tile), K tails, split 1 and 2 ways; grouped with empty groups and rows read in place. An odd N is a one-line
    error."""
    torch.manual_seed(9)
    k = 80 if fmt == "nvfp4" else 96
    p = packed(weights(42, k), fmt)
    tiles = [(1, c) for c in FMA_CONFIGS] + [(3, FMA_CONFIGS[1]), (3, SMALL), (17, SMALL)]
    tiles += [] if fmt == "nvfp4" else [(3, SMALL_SCALED)]
    for m, config in tiles:
        x = torch.randn(m, k).bfloat16()
        for split in (1, 2):
            check_swiglu_epilogue(x, p, config=config, split_k=split)
    g = packed(weights(42, k, lead=(4,)), fmt)
    offs = torch.tensor([1, 1, 3, 4], dtype=torch.int32)
    tokens = torch.randn(2, k).bfloat16()
    rows = torch.tensor([1, 0, 1, 0], dtype=torch.int32)
    for config in (FMA_CONFIGS[1], SMALL):
        check_swiglu_epilogue(tokens, g, offs, config=config, split_k=2, rows=rows)
    # the custom ops (what QuantizedExperts and FusedLinear call), their default tiles
    from mx_recipe.infer.weight_only import weight_only_grouped_mm, weight_only_mm

    y = weight_only_mm(tokens, p.qdata, p.scale, p.tensor_scale, fmt, swiglu=True)
    assert y.shape == (2, 21) and torch.equal(y, run(tokens, p, swiglu=True))
    y = weight_only_grouped_mm(tokens, g.qdata, g.scale, g.tensor_scale, fmt, offs, rows, swiglu=True)
    assert torch.equal(y, run(tokens, g, offs, rows=rows, swiglu=True))
    with pytest.raises(ValueError, match="even N") as info:
        run(tokens, packed(weights(40, k)[:39], fmt), swiglu=True)
    assert "\n" not in str(info.value)


@interp_only
@pytest.mark.parametrize("config", [FMA_CONFIGS[0], SMALL])
def test_interp_tensor_scale_per_row(config):
    """nvfp4 weights concatenated along N keep each part's tensor scale, one per row: the GEMM on the concatenation
    is each part's GEMM (both paths), and ``dequantize`` scales each row by its own."""
    from mx_kernels.mx.weight_only import dequantize, weight_only_mm

    torch.manual_seed(6)
    a, b = packed(weights(24, 64) * 8, "nvfp4"), packed(weights(16, 64), "nvfp4")
    assert a.tensor_scale.item() != b.tensor_scale.item()
    qdata, scale = torch.cat([a.qdata, b.qdata]), torch.cat([a.scale, b.scale])
    ts = torch.cat([a.tensor_scale.expand(24), b.tensor_scale.expand(16)])[:, None]
    x = torch.randn(2, 64).bfloat16()
    y = weight_only_mm(x, qdata, scale, ts, "nvfp4", config=config, split_k=1)
    assert torch.equal(y, torch.cat([run(x, a, config=config, split_k=1), run(x, b, config=config, split_k=1)], 1))
    got = dequantize(qdata, scale, ts, "nvfp4", torch.float32)
    assert torch.equal(got, torch.cat([a.dequantize(torch.float32), b.dequantize(torch.float32)]))


@interp_only
@pytest.mark.parametrize("config", [FMA_CONFIGS[1], SMALL])
def test_interp_tensor_scale_per_group_and_row(config):
    """Grouped nvfp4 weights with a tensor scale per group and row ([E, N, 1]: experts with shared experts of
    their own scale folded in): each group's rows are that group's dense GEMM with its own scales (both paths,
    the SwiGLU epilogue too), and ``dequantize`` scales each group's rows by its own."""
    from mx_kernels.mx.weight_only import dequantize, weight_only_mm

    torch.manual_seed(8)
    parts = [packed(weights(24, 64) * 4.0**e, "nvfp4") for e in range(3)]
    qdata, scale = torch.stack([p.qdata for p in parts]), torch.stack([p.scale for p in parts])
    ts = torch.stack([p.tensor_scale.expand(24, 1) for p in parts])
    sizes = [2, 0, 3]
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x = torch.randn(sum(sizes), 64).bfloat16()
    for swiglu in (False, True):
        y = weight_only_mm(x, qdata, scale, ts, "nvfp4", offs, config=config, split_k=1, swiglu=swiglu)
        dense = [run(x[:2], parts[0], config=config, split_k=1, swiglu=swiglu),
                 run(x[2:], parts[2], config=config, split_k=1, swiglu=swiglu)]  # fmt: skip
        assert torch.equal(y, torch.cat(dense)), swiglu
    got = dequantize(qdata, scale, ts, "nvfp4", torch.float32)
    assert torch.equal(got, torch.stack([p.dequantize(torch.float32) for p in parts]))


# ---------------------------------------------------------------------------------------
# GPU

CUDA = "cuda"


def cuda_kernels(call) -> list[str]:
    """The names of the CUDA kernels ``call()`` launches, sorted (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return sorted(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


GPU_MS = (1, 2, 7, 16, 33, 64, 128, 256)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_every_m(fmt):
    """4128 x 4128 weights (K = 4112 for nvfp4: a multiple of 16, not 32), M = 1 to 256, default configs."""
    torch.manual_seed(0)
    n, k = 4128, 4112 if fmt == "nvfp4" else 4128
    p = packed(weights(n, k, CUDA) * 0.02, fmt)
    for m in GPU_MS:
        x = torch.randn(m, k, device=CUDA).bfloat16()
        assert_within_bound(run(x, p), x, p)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_nan_and_zeros(fmt):
    check_nan_and_zeros(fmt, CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_grouped_ragged(fmt):
    torch.manual_seed(1)
    sizes = [0, 1, 7, 0, 33, 130, 2, 0]
    p = packed(weights(1408, 2048, CUDA, lead=(len(sizes),)) * 0.02, fmt)
    offs = torch.tensor(sizes, device=CUDA).cumsum(0).to(torch.int32)
    x = torch.randn(sum(sizes), 2048, device=CUDA).bfloat16()
    assert_within_bound(run(x, p, offs), x, p, offs)
    decode = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2], device=CUDA, dtype=torch.int32)  # top-2 of one token
    assert_within_bound(run(x[:2], p, decode), x[:2], p, decode)
    rows = torch.randint(0, 3, (x.shape[0],), device=CUDA, dtype=torch.int32)  # read in place: the copy's bits
    assert torch.equal(run(x[:3], p, offs, rows=rows), run(x[:3][rows], p, offs))
    rows = torch.tensor([1, 0], device=CUDA, dtype=torch.int32)
    assert torch.equal(run(x[:2], p, decode, rows=rows), run(x[:2][rows], p, decode))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_large_m_dequantizes_then_cublas(fmt):
    """Past LARGE_M rows QuantizedLinear writes the bf16 weight (the reference's bits) and multiplies with cuBLAS."""
    from mx_kernels.mx.weight_only import dequantize

    from mx_recipe.infer.weight_only import LARGE_M

    torch.manual_seed(4)
    lin = QuantizedLinear(torch.nn.Linear(4096, 1024, bias=False, device=CUDA), fmt)
    w = lin.weight_packed
    assert torch.equal(dequantize(w.qdata, w.scale, w.tensor_scale, fmt), w.dequantize(torch.bfloat16))
    x = torch.randn(2, (LARGE_M + 64) // 2, 4096, device=CUDA).bfloat16()
    assert torch.equal(lin(x), torch.nn.functional.linear(x, w.dequantize(torch.bfloat16)))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_dequantize_is_the_references_bits(fmt):
    """The dequantize kernel on a stack of experts (K short of its tile) and a 2D weight with a K tail past 2048,
    NaN scales included: the reference's bf16 bits."""
    from mx_kernels.mx.weight_only import dequantize

    torch.manual_seed(5)
    for shape in [(3, 256, 1408), (40, 2080)]:
        p = packed(weights(shape[-2], shape[-1], CUDA, lead=shape[:-2]), fmt)
        p.scale.view(torch.uint8)[..., 0, 0] = 0x7F if fmt == "nvfp4" else 0xFF
        got, want = dequantize(p.qdata, p.scale, p.tensor_scale, fmt), p.dequantize(torch.bfloat16)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.gpu
def test_gpu_split_k_deterministic_and_graph_capture():
    """Split K sums its partials in split order: bit-identical results, also replayed from a CUDA graph."""
    torch.manual_seed(2)
    p = packed(weights(4096, 4096, CUDA) * 0.02, "mxfp4")
    x = torch.randn(1, 4096, device=CUDA).bfloat16()
    first = run(x, p)
    assert all(torch.equal(run(x, p), first) for _ in range(20))
    lin = QuantizedLinear(torch.nn.Linear(4096, 4096, bias=False, device=CUDA), "mxfp4")
    lin.weight_packed = p
    assert torch.equal(lin(x), first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lin(x)
    graph.replay()
    assert torch.equal(out, first)


@pytest.mark.gpu
def test_gpu_tuned_configs_stay_within_the_bound():
    """set_tuning times the candidates once per shape; whichever it keeps computes the same GEMM."""
    from mx_kernels.mx import weight_only

    torch.manual_seed(3)
    p = packed(weights(1024, 4096, CUDA) * 0.02, "mxfp4")
    x = torch.randn(1, 4096, device=CUDA).bfloat16()
    weight_only.set_tuning(True)
    try:
        assert_within_bound(run(x, p), x, p)
        assert any(key[:4] == ("mxfp4", 1, 1024, 4096) for key in weight_only._TUNED)
        assert_within_bound(run(x, p), x, p)
    finally:
        weight_only.set_tuning(False)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1024, 4096 * 6])
def test_gpu_cold_copies_read_twice_the_l2(n):
    """Tuning times a GEMM over copies of its weight that together hold twice the L2, the originals first, each
    copy equal to them in its own memory: every timed call reads its weight from memory, as a model's layers do."""
    from mx_kernels.mx import weight_only

    p = packed(weights(n, 4096, CUDA) * 0.02, "mxfp4")
    copies = weight_only.cold_copies((p.qdata, p.scale))
    l2 = torch.cuda.get_device_properties(CUDA).L2_cache_size
    nbytes = p.qdata.numel() + p.scale.numel()
    assert copies[0][0] is p.qdata and copies[0][1] is p.scale
    assert len(copies) == min(weight_only.MAX_COLD_COPIES, -(-2 * l2 // nbytes))
    assert len(copies) * nbytes >= 2 * l2 or len(copies) == weight_only.MAX_COLD_COPIES
    ptrs = {c[0].data_ptr() for c in copies}
    assert len(ptrs) == len(copies)
    for q, s in copies[1:]:
        assert torch.equal(q.view(torch.uint8), p.qdata.view(torch.uint8))
        assert torch.equal(s.view(torch.uint8), p.scale.view(torch.uint8))
    x = torch.randn(1, 4096, device=CUDA).bfloat16()
    runs = [lambda q=q, s=s: weight_only.weight_only_mm(x, q, s, None, "mxfp4") for q, s in copies]
    assert weight_only.time_us(runs, calls=len(runs), rounds=1) > 0


@pytest.mark.gpu
def test_gpu_graph_capture_takes_the_tuned_config():
    """With tuning on, a call captured in a CUDA graph launches the kernels the tuned eager call launches, and gives
    its bits (the runs before capture tune; capture only looks up). At M = 32 on Llama 3 8B's fused w1/w3 shape the
    tuned config differs from the default on an H200 (the Gluon kernel at 8 warps against the default's 4)."""
    from mx_kernels.mx import weight_only

    torch.manual_seed(4)
    p = packed(weights(28672, 4096, CUDA) * 0.02, "mxfp4")
    x = torch.randn(32, 4096, device=CUDA).bfloat16()
    weight_only.set_tuning(True)
    try:
        eager = run(x, p)
        launched = cuda_kernels(lambda: run(x, p))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(x, p)
        assert cuda_kernels(graph.replay) == launched
        assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
    finally:
        weight_only.set_tuning(False)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_swiglu_epilogue(fmt):
    """``swiglu`` against the unfused GEMM then ``silu_mul``, bit for bit, on the default tiles of M = 1, 3, 8 and
    33 (small-M and tensor-core paths) split 2 ways, N / 2 = 1000 (a partial tile); grouped as an MoE decode step
    (top-6 of one token over 8 of 16 experts, rows read in place)."""
    from mx_kernels.mx.weight_only import config_for

    torch.manual_seed(10)
    k = 2048
    p = packed(weights(2000, k, CUDA) * 0.02, fmt)
    for m in (1, 3, 8, 33):
        x = torch.randn(m, k, device=CUDA).bfloat16()
        check_swiglu_epilogue(x, p, config=config_for(m, fmt, 2000, k), split_k=2)
    g = packed(weights(2816, k, CUDA, lead=(16,)) * 0.02, fmt)
    offs = torch.tensor([0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 6, 6, 6, 7, 8, 8], device=CUDA, dtype=torch.int32)
    rows = torch.zeros(8, device=CUDA, dtype=torch.int32)
    x = torch.randn(1, k, device=CUDA).bfloat16()
    check_swiglu_epilogue(x, g, offs, config=config_for(1, fmt, 2816, k), split_k=1, rows=rows)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("ms", [(3,), pytest.param((1, 8, 16), marks=pytest.mark.slow)], ids=["3_rows", "more_rows"])
def test_gpu_small_m_every_candidate(fmt, ms):
    """Every small-M candidate config of the 1024 x 4096 (wk, wv) table entry, M = 1, 3, 8, 16 (the fast tier 3),
    within the bound; a split config gives the same bits run after run."""
    from mx_kernels.mx.weight_only import candidates

    torch.manual_seed(7)
    p = packed(weights(1024, 4096, CUDA) * 0.02, fmt)
    for m in ms:
        x = torch.randn(m, 4096, device=CUDA).bfloat16()
        for config in candidates(m, fmt, 1024, 4096, fma=True):
            assert_within_bound(run(x, p, config=config), x, p)
    x = torch.randn(1, 4096, device=CUDA).bfloat16()
    config = dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4)
    first = run(x, p, config=config, split_k=4)
    assert all(torch.equal(run(x, p, config=config, split_k=4), first) for _ in range(10))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_dot_path_every_candidate(fmt):
    """Every tl.dot candidate config of each M bucket, M = 5 to 128, on a
    1056 x 4128 weight (K = 4112 for nvfp4: a K tail), the default split (the first config split 1 and 3 ways),
    within the bound; a NaN scale makes its column NaN and no other."""
    from mx_kernels.mx.weight_only import candidates

    torch.manual_seed(8)
    k = 4112 if fmt == "nvfp4" else 4128
    p = packed(weights(1056, k, CUDA) * 0.02, fmt)
    p.scale.view(torch.uint8)[7, 3] = 0x7F if fmt == "nvfp4" else 0xFF
    for m in (5, 32, 33, 128):
        x = torch.randn(m, k, device=CUDA).bfloat16()
        for i, config in enumerate(candidates(m, fmt, fma=False)):
            for split in (1, 3) if i == 0 else (None,):
                y = run(x, p, config=config, split_k=split)
                assert_within_bound(y, x, p)
                assert y.isnan().sum().item() == m, config
