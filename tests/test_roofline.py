"""The roofline model (scripts/roofline_model.py) on hand-checkable shapes, the GEMM enumeration of the
debug models, and docs/ROOFLINE.md against what scripts/roofline.py renders."""

from pathlib import Path

import pytest
import torch
from script_module import load_script

from mx_recipe.formats.recipe import MXRecipe

roofline_model = load_script("roofline_model")
(
    DEVICES,
    PATHS,
    Gemm,
    bf16_ops,
    cast_op,
    estimate,
    estimate_model,
    implied_other_time,
    linear_speedup,
    model_gemms,
    mx_ops,
    step_time,
) = (
    roofline_model.DEVICES,
    roofline_model.PATHS,
    roofline_model.Gemm,
    roofline_model.bf16_ops,
    roofline_model.cast_op,
    roofline_model.estimate,
    roofline_model.estimate_model,
    roofline_model.implied_other_time,
    roofline_model.linear_speedup,
    roofline_model.model_gemms,
    roofline_model.mx_ops,
    roofline_model.step_time,
)

ROOT = Path(__file__).resolve().parents[1]
B200, H100, H200 = DEVICES["b200"], DEVICES["h100"], DEVICES["h200"]
MXFP8 = MXRecipe.from_name("mxfp8")
NATIVE, FUSED, EMULATED = PATHS["native"], PATHS["native_fused"], PATHS["emulated"]
FAKE_QUANT = PATHS["fake_quant"]


def _script():
    return load_script("roofline")  # with scripts/ on sys.path, as `python scripts/roofline.py` runs it


def _names(ops):
    return [op.name for op in ops]


def test_bf16_gemm_time_on_b200_is_flops_over_peak():
    n = 4096
    fwd = bf16_ops(Gemm("sq", n, n, n))[0]
    assert fwd.flops == 2 * n**3
    assert fwd.bytes == 3 * n * n * 2  # read x and w, write y, all bf16
    assert fwd.time(B200) == pytest.approx(2 * 4096**3 / 2.25e15)
    assert fwd.bound(B200) == "compute"
    assert step_time(bf16_ops(Gemm("sq", n, n, n)), B200) == pytest.approx(3 * 2 * 4096**3 / 2.25e15)


def test_cast_bytes():
    n = 4096 * 4096
    assert cast_op("dim0", n, "e4m3").bytes == n * (2 + 1 + 1 / 32)
    assert cast_op("dim0", n, "e4m3").time(B200) == pytest.approx(n * (2 + 1 + 1 / 32) / 8e12)
    assert cast_op("dim0+dim1", n, "e4m3", fused=True).bytes == n * (2 + 2 * (1 + 1 / 32))
    assert cast_op("dim0", n, "e2m1").bytes == n * (2 + 0.5 + 1 / 32)
    # fused saves the second read of the input: a third of two separate casts' bytes, less the scales
    assert cast_op("f", n, "e4m3", fused=True).bytes / (2 * cast_op("s", n, "e4m3").bytes) == pytest.approx(
        (2 + 2 * (1 + 1 / 32)) / (2 * (2 + 1 + 1 / 32))
    )


def test_mx_linear_counts_six_casts_and_three_gemms():
    g = Gemm("l", 8192, 4096, 4096)
    assert _names(mx_ops(g, MXFP8, NATIVE)) == [
        "cast x dim0",
        "cast x dim1",
        "cast w dim0",
        "cast w dim1",
        "cast g dim0",
        "cast g dim1",
        "forward GEMM",
        "grad-input GEMM",
        "grad-weight GEMM",
    ]
    assert [op.fmt for op in mx_ops(g, MXFP8, NATIVE)][-3:] == ["fp8", "fp8", "fp8"]
    assert _names(mx_ops(g, MXFP8, FUSED))[:3] == ["cast x dim0+dim1", "cast w dim0+dim1", "cast g dim0+dim1"]
    emulated = mx_ops(g, MXFP8, EMULATED)
    assert sum(n.startswith("dequantize") for n in _names(emulated)) == 6  # both operands of three GEMMs
    assert [op.fmt for op in emulated if op.fmt] == ["bf16"] * 3
    # the dequantize pass reads qdata + scales and writes bf16
    assert emulated[6].bytes == 8192 * 4096 * (1 + 1 / 32 + 2)


def test_recipes_change_casts_and_rates():
    g = Gemm("l", 8192, 4096, 4096)
    wgrad_bf16 = mx_ops(g, MXRecipe.from_name("mxfp8_wgrad_bf16"), NATIVE)
    assert _names(wgrad_bf16)[:4] == ["cast x dim0", "cast w dim0", "cast w dim1", "cast g dim0"]
    assert [op.fmt for op in wgrad_bf16][-3:] == ["fp8", "fp8", "bf16"]
    fp4 = mx_ops(g, MXRecipe.from_name("mxfp4"), NATIVE)
    assert [op.fmt for op in fp4][-3:] == ["fp4"] * 3
    assert fp4[0].bytes == 8192 * 4096 * (2 + 0.5 + 1 / 32)


def test_memory_bound_and_compute_bound_mx_gemms():
    big = mx_ops(Gemm("big", 16384, 16384, 16384), MXFP8, NATIVE)[-3]
    assert big.bound(B200) == "compute"
    small = mx_ops(Gemm("small", 64, 8192, 8192), MXFP8, NATIVE)[-3]
    assert small.bound(B200) == "memory"  # the weight read dominates at 64 rows
    # at small M the weight casts dominate too: MX loses on B200
    assert linear_speedup(128, 8192, 8192, B200, MXFP8, NATIVE) < 1


@pytest.mark.parametrize("n", [4096, 8192, 16384])
def test_b200_speedup_of_large_square_linears(n):
    for path in (NATIVE, FUSED):
        s = linear_speedup(n, n, n, B200, MXFP8, path)
        assert 1 < s <= 2  # fp8 is twice the bf16 rate, and the casts only take away
    assert 1 < linear_speedup(n, n, n, B200, MXRecipe.from_name("mxfp4"), NATIVE) <= 4
    assert linear_speedup(n, n, n, B200, MXFP8, FUSED) > linear_speedup(n, n, n, B200, MXFP8, NATIVE)


@pytest.mark.parametrize("dev", [H100, H200, H200.measured()])
@pytest.mark.parametrize("path", ["emulated", "emulated_fused"])
def test_hopper_emulated_is_slower_than_bf16(dev, path):
    for m, k, n in ((128, 4096, 4096), (16384, 4096, 14336), (65536, 16384, 16384)):
        assert linear_speedup(m, k, n, dev, MXFP8, PATHS[path]) < 1


def test_hopper_has_no_native_mx_gemm():
    with pytest.raises(ValueError, match="no MX GEMM in hardware"):
        estimate(Gemm("l", 4096, 4096, 4096), H200, MXFP8, NATIVE)
    assert H100.measured().mem_bw == 3.0e12 and H200.measured().mem_bw == 4.225e12


def test_debug_llama_enumeration():
    mg = model_gemms("llama", "debug", batch=2, seq_len=64, vocab_size=320)
    mx = [g for _, g in mg.gemms if g.mx]
    kept = [g for _, g in mg.gemms if not g.mx]
    assert len(mx) == 4 * 7  # wq, wk, wv, wo, w1, w2, w3 in each of 4 layers
    assert [g.name for g in kept] == ["output"]  # convert_to_mx's default skip
    assert all(g.m == 128 and g.groups == 1 for g in mx)
    assert {(g.k, g.n) for g in mx if g.name.endswith("attention.wk")} == {(256, 128)}  # 4 kv heads of 32


def test_debug_moe_enumeration():
    mg = model_gemms("moe", "debug_moe", batch=2, seq_len=64, vocab_size=320)
    mx = [g for _, g in mg.gemms if g.mx]
    kept = sorted(g.name for _, g in mg.gemms if not g.mx)
    # layer 0 dense (7 linears); layers 1-3: 4 attention + 3 shared-expert linears + 3 expert weights
    assert len(mx) == 7 + 3 * (4 + 3 + 3)
    assert kept == ["layers.1.moe.router.gate", "layers.2.moe.router.gate", "layers.3.moe.router.gate", "output"]
    experts = [g for g in mx if g.groups > 1]
    assert len(experts) == 9 and all(g.groups == 8 and g.m == 128 * 2 for g in experts)  # tokens * top_k rows
    w2 = next(g for g in experts if g.name == "layers.1.moe.experts.w2")
    assert (w2.k, w2.n) == (128, 256)  # [E, dim, hidden]: K = hidden, N = dim
    # each expert sees top_k / E of the tokens: the grouped GEMM has the FLOPs of m rows in all
    assert w2.flops == 3 * 2 * 256 * 128 * 256


def test_grouped_grad_weight_pads_groups():
    g = Gemm("experts", 49152, 2048, 1408, groups=64)
    ops = {op.name: op for op in mx_ops(g, MXFP8, NATIVE)}
    m_pad = 49152 + 32 * 64  # grouped.py's static buffer
    assert ops["pad g, x rows"].bytes == (m_pad + 2 * 49152) * (2048 + 1408) * 2
    assert ops["cast x dim1"].bytes == m_pad * 2048 * (2 + 1 + 1 / 32)
    assert ops["cast w dim0"].bytes == 64 * 1408 * 2048 * (2 + 1 + 1 / 32)  # the whole [E, N, K] weight
    assert "pad g, x rows" not in _names(mx_ops(g, MXFP8, FUSED))


def test_fake_quant_linear_reads_x_and_g_once():
    m, k, n, m_pad = 8200, 4096, 1024, 8224  # M not a multiple of 32: along M, ceil32(M) rows
    ops = {op.name: op for op in mx_ops(Gemm("l", m, k, n), MXFP8, FAKE_QUANT)}
    # linear.py's backward: one kernel reads g and writes both fake-quants in bf16 (fake_quant_dim0_dim1)
    assert [name for name in ops if "cast g" in name] == ["cast g dim0+dim1"]
    assert ops["cast g dim0+dim1"].bytes == (m * n + m * n + m_pad * n) * 2
    # x likewise in forward (fuse_x_casts); w: a read per cast. The kernels write the zero rows (no padding
    # copy), and the GEMM runs over them
    assert [name for name in ops if "cast x" in name] == ["cast x dim0+dim1"]
    assert ops["cast x dim0+dim1"].bytes == (m * k + m * k + m_pad * k) * 2
    assert {"cast w dim0", "cast w dim1"} <= ops.keys() and "pad g, x rows" not in ops
    assert ops["grad-weight GEMM"].flops == 2 * m_pad * k * n
    # with grad weight in bf16, g has one cast left
    wgrad_bf16 = _names(mx_ops(Gemm("l", m, k, n), MXRecipe.from_name("mxfp8_wgrad_bf16"), FAKE_QUANT))
    assert [name for name in wgrad_bf16 if "cast g" in name] == ["cast g dim0"]


def test_fake_quant_grouped_gemm_runs_unpadded():
    m, k, n, e = 49160, 2048, 1408, 64  # groups quantized in place (fake_quant_groups_along_m): M rows
    ops = {op.name: op for op in mx_ops(Gemm("experts", m, k, n, groups=e), MXFP8, FAKE_QUANT)}
    assert "pad g, x rows" not in ops
    assert ops["cast g dim0"].bytes == ops["cast g dim1"].bytes == 2 * m * n * 2  # two reads of g
    assert ops["cast x dim1"].bytes == 2 * m * k * 2
    gw = ops["grad-weight GEMM"]
    assert gw.flops == 2 * m * k * n
    assert gw.bytes == (m * n + m * k + e * n * k) * 2  # bf16 operands, the [E, N, K] gradient written


def test_model_speedup_is_diluted_by_unchanged_time():
    mg = model_gemms("llama", "1B", batch=1, seq_len=8192, vocab_size=128256)
    e = estimate_model(mg, B200, MXFP8, NATIVE)
    assert e.unchanged_s > 0
    assert 1 < e.speedup < e.gemm_speedup <= 2
    assert e.bf16_step_s == pytest.approx(e.converted_bf16_s + e.unchanged_s)
    other = implied_other_time(e.bf16_step_s, e.mx_step_s, 1.1)
    assert (e.bf16_step_s + other) / (e.mx_step_s + other) == pytest.approx(1.1)


def test_roofline_doc_matches_script():
    script = _script()
    text = script.DOC.read_text()
    generated = text.split(script.BEGIN, 1)[1].split(script.END, 1)[0]
    assert generated == "\n" + script.render(), "run: python scripts/roofline.py --project --write docs/ROOFLINE.md"


def test_plot_is_committed_and_small():
    png = ROOT / "docs" / "roofline_speedup.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size < 150 * 1024


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_observe_without_cuda_is_a_clear_error():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        _script().main(["--observe"])


def test_nvfp4_ops_add_the_amax_reads_and_run_at_the_fp4_rate():
    from mx_recipe.formats.recipe import NVFP4Recipe

    g = Gemm("w1", 8192, 4096, 14336)
    ops = {op.name: op for op in mx_ops(g, NVFP4Recipe(), PATHS["native"])}
    assert ops["amax x"].bytes == 8192 * 4096 * 2 and ops["amax g"].bytes == 8192 * 14336 * 2
    assert ops["cast w dim0"].bytes == 4096 * 14336 * (2 + 0.5 + 1 / 16)  # e2m1 and an e4m3 scale per 16
    assert {ops[f"{n} GEMM"].fmt for n in ("forward", "grad-input", "grad-weight")} == {"fp4"}
    b200 = DEVICES["b200"]
    mxfp4 = estimate(g, b200, MXRecipe.from_name("mxfp4"), PATHS["native"])
    nvfp4 = estimate(g, b200, NVFP4Recipe(), PATHS["native"])
    assert mxfp4.bf16_s == nvfp4.bf16_s and mxfp4.mx_s < nvfp4.mx_s  # the same GEMMs, more bytes around them
