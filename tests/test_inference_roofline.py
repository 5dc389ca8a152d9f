"""The inference roofline (scripts/inference_roofline.py) on hand-checkable counts, the counts of the published
models, and docs/ROOFLINE.md against what the script renders."""

import math
import subprocess
import sys

import pytest
from script_module import REPO, load_script

roofline = load_script("inference_roofline")
DEVICES = load_script("roofline_model").DEVICES
H200 = DEVICES["h200"]


def dense_model(params: float, kv: float = 0.0) -> object:
    return roofline.ModelCounts("toy", params, 0.0, 0.0, 0, 0, kv, 0.0)


def test_a_decode_step_reads_each_weight_once_whatever_the_batch():
    m = dense_model(1e9)
    for fmt, per_weight in (("bf16", 2.0), ("mxfp8", 1.03125), ("mxfp4", 0.53125), ("nvfp4", 0.5625)):
        one, many = (roofline.decode_step(m, fmt, H200, b, context=0) for b in (1, 64))
        assert one.bytes == many.bytes == 1e9 * per_weight
        assert one.seconds == pytest.approx(1e9 * per_weight / H200.mem_bw)
        assert many.flops == 64 * one.flops == 64 * 2e9


def test_the_compute_bound_batch_is_the_balance_point_of_the_weight_bytes():
    """Without KV cache, bytes / bandwidth = 2 * params * B / rate at B = rate * bytes_per_weight / (2 * bandwidth)."""
    m = dense_model(1e9)
    for fmt in ("bf16", "mxfp8", "mxfp4"):
        expected = H200.bf16_flops * roofline.WEIGHT_BYTES[fmt] / (2 * H200.mem_bw)
        assert roofline.compute_bound_batch(m, fmt, H200, context=0) == math.floor(expected) + 1
    b200 = DEVICES["b200"]  # activations in MX: the fp8 rate doubles the balance batch of MXFP8
    assert (
        roofline.compute_bound_batch(m, "mxfp8", b200, 0, mx_activations=True)
        == math.floor(b200.fp8_flops * roofline.WEIGHT_BYTES["mxfp8"] / (2 * b200.mem_bw)) + 1
    )


def test_a_kv_cache_that_grows_with_the_batch_keeps_decode_memory_bound():
    """Each sequence's cache costs as many bytes per FLOP as it brings: past a context, no batch is compute-bound."""
    m = dense_model(1e9, kv=131072.0)  # Llama 3 8B's bytes per position
    assert roofline.compute_bound_batch(m, "bf16", H200, context=16) > 0
    assert roofline.compute_bound_batch(m, "bf16", H200, context=1024) == 0


def test_experts_read_by_a_step_follow_uniform_routing():
    m = roofline.ModelCounts("moe", 0.0, 0.0, 1.0, 64, 6, 0.0, 0.0)
    assert m.experts_read(1) == pytest.approx(6)
    assert m.experts_read(2) == pytest.approx(64 * (1 - (58 / 64) ** 2))
    assert m.experts_read(10_000) == pytest.approx(64)


def test_llama3_8b_counts_match_its_published_sizes():
    """32 layers of 218.1M converted weights, a 4096 x 128256 output layer in bf16, 128 KiB of KV per position."""
    m = roofline.model_counts("llama", "8B", 128256, "Llama 3 8B")
    assert m.dense == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert m.kept == 4096 * 128256 and m.n_experts == 0
    assert m.kv_per_position == 2 * 32 * 8 * 128 * 2
    bf16 = roofline.decode_step(m, "bf16", H200, 1, context=0)
    assert bf16.bytes / 1e9 == pytest.approx(15.0, abs=0.05)  # the 15.0 GB of a bf16 decode step
    mx = roofline.decode_step(m, "mxfp8", H200, 1, context=0)
    assert bf16.bytes / mx.bytes == pytest.approx(1.82, abs=0.01)


def test_a_model_cut_to_its_first_blocks_counts_only_those_blocks():
    """bench_decode --layers N keeps the first N blocks; its measured points are compared with their bound."""
    full, cut = (roofline.model_counts("llama", "8B", 128256, "Llama 3 8B", layers) for layers in (None, 8))
    assert cut.dense == full.dense / 4 and cut.kv_per_position == full.kv_per_position / 4
    assert cut.kept == full.kept  # the output layer stays whole


def test_rooflines_doc_holds_what_the_script_renders():
    text = (REPO / "docs" / "ROOFLINE.md").read_text()
    block = "\n".join(roofline.render())
    assert block in text, "run: python scripts/inference_roofline.py --write docs/ROOFLINE.md"


def test_measured_prefill_is_set_against_the_prefill_roofline():
    """A recorded bench_decode run's prefill rows appear beside its decode rows, against the prefill bound of that
    prompt length (compute-bound: far above the decode rows' bound)."""
    m = roofline.model_counts("llama", "8B", 128256, "Llama 3 8B")
    lines = roofline.measured_points(m, "llama", "8B", 128256, 1024, "h200")
    prefill = [line.split(" | ") for line in lines if "| prefill, " in line]
    assert prefill and any("| decode, batch 1 |" in line for line in lines)
    for cells in prefill:
        tokens = int(cells[1].split()[1])
        bound = roofline.prefill_tokens_per_second(m, cells[0].strip("| "), roofline.DEVICES["h200"], tokens)
        assert cells[3] == f"{bound:,.0f}"


def test_bad_arguments_are_one_line():
    done = subprocess.run([sys.executable, "scripts/inference_roofline.py", "--context", "0"], cwd=REPO,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and done.stderr.strip().endswith("--context must be >= 1 and --prefill >= 2")
