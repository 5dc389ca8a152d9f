"""Inference on the CPU: the KV-cache decode gives the full forward's logits, the quantized weights are the
formats' own bits kept packed, and generate.py continues a prompt from a train.py checkpoint."""

import copy
import dataclasses
import subprocess
import sys

import pytest
import torch
from test_train import BF16_ARGS, REPO, run_in_process

from mx_recipe.formats.mx import fake_quant
from mx_recipe.formats.nvfp4 import to_nvfp4
from mx_recipe.infer.decode import (
    PDL_MAX_BATCH,
    PDL_MAX_BATCH_TILED,
    STOP_CHECK,
    KVCache,
    forward,
    generate,
    pdl_pays,
    prefill,
)
from mx_recipe.infer.gemv import MAX_M as GEMV_MAX_M
from mx_recipe.infer.load import load_run, random_model, to_compute_dtype
from mx_recipe.infer.weights import (
    FusedExperts,
    FusedLinear,
    FusedPart,
    PackedWeight,
    QuantizedExperts,
    QuantizedLinear,
    fuse_projections,
    quantize_model,
    tile_weights,
    weight_bytes,
)
from mx_recipe.models import build_model, model_args
from mx_recipe.ops import kernel_settings

CPU = torch.device("cpu")


def _model(name: str, flavor: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(model_args(name, flavor, 320, 64))
    model.init_weights()
    return model.eval()


@pytest.mark.parametrize(("name", "flavor"), [("llama", "debug"), ("moe", "debug_moe")])
def test_decoding_with_the_kv_cache_gives_the_full_forward_logits(name, flavor):
    model = _model(name, flavor)
    tokens = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(model, 2, 16, torch.float32, CPU)
        steps = [forward(model, tokens[:, :8], torch.arange(8), cache)]
        steps += [forward(model, tokens[:, i : i + 1], torch.tensor([i]), cache) for i in range(8, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    new, timing = generate(model, tokens[:, :8], 4)  # greedy: each new token is the argmax of the logits so far
    assert torch.equal(new[:, 0], full[:, 7].argmax(-1)) and timing.decode_steps == 2  # the first step untimed


@pytest.mark.parametrize(("name", "flavor"), [("llama", "debug"), ("moe", "debug_moe")])
def test_prompts_of_different_lengths_decode_as_if_alone(name, flavor):
    """Prompts of different lengths, right-padded, with their ``lengths``: each continues from its own last token.
    A decode step at each sequence's own position gives the full forward's logits of that prompt and token, and
    greedy generation gives each prompt's tokens alone; lengths out of range are an error."""
    model = _model(name, flavor)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 320, (n,), generator=gen) for n in (3, 9, 6)]
    batch = torch.stack([torch.cat([p, torch.full((9 - len(p),), 7)]) for p in prompts])
    lengths = torch.tensor([len(p) for p in prompts])
    nxt = torch.randint(0, 320, (3, 1), generator=gen)
    with torch.no_grad():
        cache = KVCache(model, 3, 12, torch.float32, CPU)
        forward(model, batch, torch.arange(9), cache)
        step = forward(model, nxt, lengths[:, None], cache)[:, 0]
        with pytest.raises(ValueError, match="per-sequence positions are"):
            forward(model, batch, lengths[:, None], cache)
        for i, p in enumerate(prompts):
            full = model(torch.cat([p, nxt[i]])[None])[0, -1]
            torch.testing.assert_close(step[i], full, rtol=1e-5, atol=1e-5)
    batched, _ = generate(model, batch, 5, lengths=lengths)
    for row, p in zip(batched, prompts, strict=True):
        assert torch.equal(row, generate(model, p[None], 5)[0][0])
    with pytest.raises(ValueError, match="lengths must be"):
        generate(model, batch, 2, lengths=torch.tensor([0, 9, 6]))


@pytest.mark.parametrize(("name", "flavor"), [("llama", "debug"), ("moe", "debug_moe")])
def test_prefill_gives_each_prompts_last_logits(name, flavor):
    """A prefill's logits are the full forward's at each prompt's last token (its own length), the output layer
    applied to those rows only; the cache holds what the full forward writes."""
    model = _model(name, flavor)
    tokens = torch.randint(0, 320, (3, 10), generator=torch.Generator().manual_seed(4))
    lengths = torch.tensor([10, 4, 7])
    with torch.no_grad():
        full_cache, cache = KVCache(model, 3, 12, torch.float32, CPU), KVCache(model, 3, 12, torch.float32, CPU)
        full = forward(model, tokens, torch.arange(10), full_cache)
        got = prefill(model, tokens, cache, lengths)
        torch.testing.assert_close(got, full[torch.arange(3), lengths - 1], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(prefill(model, tokens, cache), full[:, -1], rtol=1e-6, atol=1e-6)
    assert torch.equal(cache.k, full_cache.k) and torch.equal(cache.v, full_cache.v)


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "flavor"), [("llama", "debug"), ("moe", "debug_moe")])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_gpu_prefill_through_the_kernels_gives_the_forward_logits(name, flavor, fmt):
    """On CUDA a prefill runs the decode step's fused kernels over the prompt's rows (RoPE and the cache write in
    one kernel, causal SDPA): each prompt's last logits and the caches as ``forward``'s within bf16 rounding, at few
    rows (the weight-only kernels, the fused MoE routing) and at more than the kernels' LARGE_M (cuBLAS)."""
    cuda = torch.device("cuda")
    model = fuse_projections(quantize_model(to_compute_dtype(_model(name, flavor).to(cuda), torch.bfloat16), fmt))
    tile_weights(model, 1)
    gen = torch.Generator().manual_seed(5)
    for lengths in ([9, 6], [60, 57, 31]):  # 18 and 180 rows
        b, s = len(lengths), lengths[0]
        tokens = torch.randint(0, 320, (b, s), generator=gen).to(cuda)
        lengths = torch.tensor(lengths, device=cuda)
        with torch.no_grad():
            want_cache, cache = (KVCache(model, b, s + 4, torch.bfloat16, cuda) for _ in range(2))
            want = forward(model, tokens, torch.arange(s, device=cuda), want_cache)[torch.arange(b), lengths - 1]
            got = prefill(model, tokens, cache, lengths)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(cache.k, want_cache.k, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(cache.v, want_cache.v, rtol=2e-2, atol=2e-2)


def test_a_sequence_ends_at_its_stop_token():
    """A sequence that samples ``stop_token`` has ended: its later tokens are that token, the others' are as without
    it, and decoding stops at the first check after every sequence has ended."""
    model = _model("llama", "debug")
    prompts = torch.randint(0, 320, (2, 5), generator=torch.Generator().manual_seed(3))
    free, _ = generate(model, prompts, 24)
    stop = int(free[0, 2])
    ends = [row.index(stop) if stop in row else None for row in free.tolist()]
    out, _ = generate(model, prompts, 24, stop_token=stop)
    for row, want, end in zip(out.tolist(), free.tolist(), ends, strict=True):
        if end is None:
            assert row == want
        else:
            assert row[: end + 1] == want[: end + 1] and set(row[end + 1 :]) <= {stop}
    one, timing = generate(model, prompts[:1], 24, stop_token=stop)  # ends by token 3: stops at the first check
    assert one.shape == (1, STOP_CHECK) and one[0].tolist() == out[0, :STOP_CHECK].tolist()
    assert timing.decode_steps == STOP_CHECK - 2


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_quantized_weights_are_the_formats_bits_kept_packed(fmt):
    """Each linear keeps its weight packed (bytes as the format says) and multiplies by exactly its dequantized
    value: the bits the training fake-quant gives along K."""
    model = _model("moe", "debug_moe")
    wq = model.layers["0"].attention.wq.weight.detach().clone()
    w1 = model.layers["1"].moe.experts.w1.detach().clone()
    before = weight_bytes(model)
    quantize_model(model, fmt)
    linear, experts = model.layers["0"].attention.wq, model.layers["1"].moe.experts
    assert isinstance(linear, QuantizedLinear) and isinstance(experts, QuantizedExperts)
    assert type(model.output) is torch.nn.Linear and type(model.layers["1"].moe.router.gate) is torch.nn.Linear
    if fmt == "nvfp4":
        expected = to_nvfp4(wq, dim=-1).dequantize(wq.dtype)
    else:
        expected = fake_quant(wq, {"mxfp8": "e4m3", "mxfp4": "e2m1"}[fmt], "floor", dim=-1)
    assert torch.equal(linear.weight_packed.dequantize(torch.float32), expected)
    per_element = {"mxfp8": 1 + 1 / 32, "mxfp4": 0.5 + 1 / 32, "nvfp4": 0.5 + 1 / 16}[fmt]
    assert linear.weight_packed.nbytes() == pytest.approx(wq.numel() * per_element, abs=4)
    assert experts.w1_packed.nbytes() == pytest.approx(w1.numel() * per_element, abs=4)
    x = torch.randn(3, wq.shape[1])
    assert torch.equal(linear(x), torch.nn.functional.linear(x, expected))
    assert weight_bytes(model) < before / 2


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_the_output_layer_is_quantized_on_request(fmt):
    """``output=True`` keeps the output layer in the format too (its logits: the dequantized weight's), the router
    gates still in bf16; the default leaves it as it trained."""
    model = _model("moe", "debug_moe")
    w = model.output.weight.detach().clone()
    quantize_model(model, fmt, output=True)
    assert isinstance(model.output, QuantizedLinear) and type(model.layers["1"].moe.router.gate) is torch.nn.Linear
    expected = to_nvfp4(w, dim=-1).dequantize(w.dtype) if fmt == "nvfp4" else fake_quant(w, "e4m3", "floor", dim=-1)
    assert torch.equal(model.output.weight_packed.dequantize(torch.float32), expected)
    h = torch.randn(2, w.shape[1])
    assert torch.equal(model.output(h), torch.nn.functional.linear(h, expected))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_gpu_quantized_output_layer_of_llama3_8b_dims(fmt):
    """``output=True`` at Llama 3 8B's output layer (128256 x 4096) on CUDA, tiled as a one-sequence decode tiles it:
    a decode row takes the kernel (MXFP8's GEMV on the formats' layout, the tiled GEMM for 4-bit) on the packed
    weight, within the weight-only GEMM's bound of the dequantized weight's product (summation order)."""
    from test_weight_only_gemm import assert_within_bound

    cuda = torch.device("cuda")
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.output = torch.nn.Linear(4096, 128256, bias=False, device=cuda, dtype=torch.bfloat16)
    tile_weights(quantize_model(holder, fmt, output=True), 1)
    packed = holder.output.weight_packed
    assert isinstance(holder.output, QuantizedLinear) and packed.tiled == (fmt != "mxfp8")
    x = torch.randn(1, 4096, device=cuda, dtype=torch.bfloat16)
    assert_within_bound(holder.output(x), x, packed)


@pytest.mark.parametrize(("name", "flavor"), [("llama", "debug"), ("moe", "debug_moe")])
def test_random_model_is_init_weights_block_by_block(name, flavor):
    """random_model materializes and initializes one block at a time (the fp32 model is never whole): the values
    of ``init_weights`` on the whole model, and with a dtype those values cast (expert biases stay fp32)."""
    whole = build_model(model_args(name, flavor, 320, 64))
    torch.manual_seed(3)
    whole.init_weights()
    for dtype in (None, torch.bfloat16):
        got = random_model(name, flavor, 320, 64, CPU, seed=3, dtype=dtype)
        want = whole if dtype is None else to_compute_dtype(copy.deepcopy(whole), dtype)
        assert list(got.state_dict()) == list(want.state_dict())
        for key, value in want.state_dict().items():
            assert torch.equal(got.state_dict()[key], value) and got.state_dict()[key].dtype == value.dtype, key
        assert torch.equal(got.rope_cos, want.rope_cos) and torch.equal(got.rope_sin, want.rope_sin)


def test_pdl_is_for_steps_of_few_sequences():
    """The decode step's PDL rule (mx_recipe.infer.decode): bf16 projections up to the GEMV's rows, quantized ones
    up to PDL_MAX_BATCH sequences, PDL_MAX_BATCH_TILED where every quantized weight is tiled, the setting on; the
    kernels' own gate keeps it off on the CPU."""
    from mx_kernels import pdl

    model = build_model(dataclasses.replace(model_args("llama", "debug", 320, 64), multiple_of=128))  # tiles: K % 128
    assert pdl_pays(model, GEMV_MAX_M) and not pdl_pays(model, GEMV_MAX_M + 1)  # bf16: past the GEMV's rows, cuBLAS
    quantize_model(model, "mxfp4")
    assert pdl_pays(model, 1) and pdl_pays(model, PDL_MAX_BATCH) and not pdl_pays(model, PDL_MAX_BATCH + 1)
    packed = [m for m in model.modules() if isinstance(m, PackedWeight)]
    for p in packed[:-1]:
        p.tile()
    assert not pdl_pays(model, PDL_MAX_BATCH + 1)  # one weight left in the formats' layout
    packed[-1].tile()
    assert pdl_pays(model, PDL_MAX_BATCH_TILED) and not pdl_pays(model, PDL_MAX_BATCH_TILED + 1)
    with kernel_settings(pdl=False):
        assert not pdl_pays(model, 1)
    assert not pdl.enabled(torch.device("cuda"))  # outside a decode step: plain launches
    with pdl.launching(True):
        assert pdl.options(CPU) == {"PDL": False}


def _decode_logits(model: torch.nn.Module, tokens: torch.Tensor, device: torch.device, dtype: torch.dtype
                   ) -> list[torch.Tensor]:  # fmt: skip
    """A prefill of all but the last token, then one decode step."""
    cache = KVCache(model, tokens.shape[0], tokens.shape[1], dtype, device)
    n = tokens.shape[1] - 1
    with torch.no_grad():
        return [
            forward(model, tokens[:, :n], torch.arange(n, device=device), cache),
            forward(model, tokens[:, n:], torch.tensor([n], device=device), cache),
        ]


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize(("name", "flavor"), [("llama", "debug"), ("moe", "debug_moe")])
def test_fused_projections_give_the_unfused_logits(name, flavor, fmt):
    """wq/wk/wv and w1/w3 (dense, shared and routed experts) as one GEMM each, the shared expert folded into the
    routed ones' GEMMs: the same logits, bit for bit, and the same weight bytes (NVFP4: plus one fp32 tensor scale
    per fused row, and the folded experts' one per group and row)."""
    import copy

    unfused = quantize_model(_model(name, flavor), fmt)
    fused = fuse_projections(copy.deepcopy(unfused))
    attention = fused.layers["0"].attention
    assert isinstance(attention.wqkv, FusedLinear) and isinstance(attention.wk, FusedPart)
    assert isinstance(fused.layers["0"].feed_forward.w13, FusedLinear)
    if fmt != "bf16" and name == "moe":
        assert hasattr(fused.layers["1"].moe.experts, "w13_packed")
        assert fused.layers["1"].moe.experts.shared == 1  # the shared expert folded in
    elif name == "moe":  # one grouped GEMM for w1 and w3
        experts = fused.layers["1"].moe.experts
        assert isinstance(experts, FusedExperts) and not hasattr(experts, "w1")
        assert experts.shared == 1 and experts.w13.shape[0] == 9  # the shared expert folded in after the 8 routed
    extra = 0  # NVFP4: one fp32 tensor scale per fused row in place of one per part
    if fmt == "nvfp4":
        extra = sum(4 * (m.out_features - len(m.sizes)) for m in fused.modules() if isinstance(m, FusedLinear))
        experts = [m for m in fused.modules() if isinstance(m, QuantizedExperts)]
        # in place of one scale for each of the experts' and the shared expert's w1, w3 and w2
        extra += sum(4 * (m.w13_packed.tensor_scale.numel() + m.w2_packed.tensor_scale.numel() - 6) for m in experts)
    assert weight_bytes(fused) == weight_bytes(unfused) + extra
    tokens = torch.randint(0, 320, (2, 7), generator=torch.Generator().manual_seed(2))
    for a, b in zip(_decode_logits(unfused, tokens, CPU, torch.float32),
                    _decode_logits(fused, tokens, CPU, torch.float32), strict=True):  # fmt: skip
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4", "nvfp4"])
def test_fused_gate_up_swiglu_is_silu_of_gate_times_up(fmt):
    """``swiglu`` of a fused w1/w3 (dense, and the grouped experts) is ``F.silu(h1) * h3`` of its two outputs;
    the decode step runs it in the GEMM's epilogue for packed weights on the kernel and for bf16 experts on the
    grouped GEMV (``fuses_swiglu``). A
    FusedLinear of other parts refuses it in one line."""
    fused = fuse_projections(quantize_model(_model("moe", "debug_moe"), fmt))
    x = torch.randn(3, fused.args.dim)
    w13 = fused.layers["0"].feed_forward.w13
    h1, h3 = w13(x)
    assert torch.equal(w13.swiglu(x), torch.nn.functional.silu(h1) * h3)
    assert w13.fuses_swiglu == (fmt != "bf16")
    assert w13.swiglu_in_epilogue(x) == (fmt != "bf16")  # bf16: the GEMV's epilogue, on a GPU only
    experts = fused.layers["1"].moe.experts
    groups = (experts.w2.shape[0] if fmt == "bf16" else experts.w2_packed.qdata.shape[0]) - experts.shared
    offs = torch.tensor([1, 1, 3] + [3] * (groups - 3), dtype=torch.int32)
    h1, h3 = experts.gate_up(x, offs)
    assert torch.equal(experts.swiglu(x, offs), torch.nn.functional.silu(h1) * h3)
    assert experts.fuses_swiglu
    with pytest.raises(ValueError, match="w1 and w3 of one size") as info:
        fused.layers["0"].attention.wqkv.swiglu(x)
    assert "\n" not in str(info.value)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8", "mxfp4", "nvfp4"])
def test_gpu_fused_projections_give_the_unfused_logits(fmt):
    """On CUDA (the weight-only kernel, bf16): at the debug dims every GEMM reads K in one split, fused or not, so
    the logits match bit for bit; bf16 (cuBLAS) within rounding."""
    cuda = torch.device("cuda")
    model = to_compute_dtype(_model("moe", "debug_moe").to(cuda), torch.bfloat16)
    unfused = quantize_model(model, fmt)
    fused = fuse_projections(copy.deepcopy(unfused))
    tokens = torch.randint(0, 320, (1, 7), generator=torch.Generator().manual_seed(3)).to(cuda)
    for a, b in zip(_decode_logits(unfused, tokens, cuda, torch.bfloat16),
                    _decode_logits(fused, tokens, cuda, torch.bfloat16), strict=True):  # fmt: skip
        if fmt == "bf16":
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
        else:
            assert torch.equal(a, b)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("gen") / "run"
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "4"]
    code, _, err = run_in_process([*BF16_ARGS, *ckpt, "--job.output_dir", str(run)])
    assert code == 0, err
    return run


def test_generate_continues_a_prompt_from_a_train_py_checkpoint(trained_run):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    model, tokenizer, config = load_run(trained_run, CPU, max_len=64)
    dcp_to_torch_save(trained_run / "checkpoints" / "step-4", trained_run / "step-4.pt")
    saved = torch.load(trained_run / "step-4.pt", weights_only=False)["model"]
    for name, p in model.state_dict().items():
        assert torch.equal(p, saved[name]), name
    cmd = [sys.executable, "generate.py", "--checkpoint", str(trained_run), "--weights", "mxfp8", "--prompt", "def "]
    cmd += ["--max-new-tokens", "8"]
    runs = [subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300) for _ in range(2)]
    for done in runs:
        assert done.returncode == 0 and "Warning:" not in done.stderr, done.stderr  # nothing to alarm a reader
        text, summary = done.stdout.rstrip("\n").rsplit("\n", 1)
        assert text.startswith("def ") and "cpu mxfp8 weights" in summary and "decode" in summary
    assert runs[0].stdout.split("\n")[0] == runs[1].stdout.split("\n")[0]  # greedy: the same continuation


def test_generate_py_continues_each_prompt_of_a_batch_as_alone():
    """Several --prompt of different lengths print what each prompt alone prints (greedy, random weights)."""
    cmd = [sys.executable, "generate.py", "--model", "llama", "--flavor", "debug", "--max-new-tokens", "16"]
    prompts = ["x", "the quick brown fox jumps over the lazy dog"]  # left-padding the short one changed its text

    def text(*args: str) -> str:
        done = subprocess.run(cmd + list(args), cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout.rstrip("\n").rsplit("\n", 1)[0]  # the continuations, without the summary line

    batched = text("--prompt", prompts[0], "--prompt", prompts[1])
    assert batched == "\n".join(text("--prompt", p) for p in prompts)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "llama"], "--flavor: unknown llama flavor None"),
        (["--checkpoint", "/no/such/run"], "error: --checkpoint /no/such/run: no config.toml"),
        (["--model", "llama", "--flavor", "debug", "--activations", "mx"], "--activations mx needs --weights"),
        (["--model", "llama", "--flavor", "debug", "--quantize-output"], "--quantize-output needs --weights"),
        (["--model", "llama", "--flavor", "debug", "--weights", "fp6"], "argument --weights: invalid choice"),
        ([], "give --checkpoint DIR, or --model and --flavor"),
        (
            ["--model", "llama", "--flavor", "debug", "--weights", "mxfp8", "--compile", "--device", "cpu"],
            "--compile: Inductor's CPU code has no float8_e8m0fnu",
        ),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args, message):
    done = subprocess.run([sys.executable, "generate.py", *args], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_model_that_cannot_fit_is_one_line_and_exit_2(trained_run, monkeypatch, capsys):
    """Weights that cannot fit in the device's memory are named before any is made (on a CPU the OS would kill the
    process without a line): load_run (fp32) and random_model (its dtype) raise ValueError, generate.py exits 2
    with one line."""
    import importlib.util

    from mx_recipe.ops import device

    monkeypatch.setattr(device, "memory_bytes", lambda d: 10**6)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"^llama debug \(.*M parameters, 4 bytes each\) needs at least .* MB, more"):
        load_run(trained_run, cpu, 64)
    with pytest.raises(ValueError, match=r"^llama debug \(.*M parameters, 2 bytes each\) needs at least .*'s 1\.0 MB$"):
        random_model("llama", "debug", 320, 64, cpu, dtype=torch.bfloat16)
    spec = importlib.util.spec_from_file_location("generate_script", REPO / "generate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--model", "llama", "--flavor", "debug", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model llama debug (") and len(err.strip().splitlines()) == 1, err


def test_help_prints_the_examples_one_a_line():
    """--help keeps the docstring's line breaks: its example commands stay one a line, as written."""
    done = subprocess.run([sys.executable, "generate.py", "--help"], cwd=REPO, capture_output=True, text=True)
    example = '    python generate.py --checkpoint outputs/debug_mxfp8 --weights mxfp8 --prompt "def main("\n'
    assert done.returncode == 0 and example in done.stdout


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (('name = "moe"', 'flavor = "debug_moe"'), "has layers.1.moe.expert_bias [8], the checkpoint has no such"),
        (('name = "llama"', 'flavor = "1B"'), "has tok_embeddings.weight [320, 2048], the checkpoint holds it as"),
    ],
)
def test_a_checkpoint_of_another_model_is_one_line_and_exit_2(trained_run, tmp_path, model, message):
    """config.toml naming another model or size than the checkpoint holds: named before anything is read."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    config = (run / "config.toml").read_text().replace('name = "llama"', model[0]).replace('flavor = "debug"', model[1])
    (run / "config.toml").write_text(config)
    cmd = [sys.executable, "generate.py", "--checkpoint", str(run), "--prompt", "def ", "--max-new-tokens", "2"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and message in errors[0], done.stderr
    assert "is not a checkpoint of" in errors[0] and "Traceback" not in done.stderr


def test_weight_quality_reports_the_runs_own_validation_loss_for_bf16(tmp_path):
    """scripts/weight_quality.py: the bf16 row is the held-out loss the run logged for its last checkpoint; the
    quantized rows differ from it (and each other) as their weights do; JSON rows with provenance."""
    import json

    run = tmp_path / "run"
    args = [*BF16_ARGS, "--checkpoint.enable", "true", "--checkpoint.interval", "4", "--validation.enable", "true"]
    args += ["--validation.interval", "4", "--validation.steps", "2", "--training.compute_dtype", "fp32"]
    code, _, err = run_in_process([*args, "--job.output_dir", str(run)])
    assert code == 0, err
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val_loss = next(r["val_loss"] for r in logged if r.get("step") == 4 and "val_loss" in r)
    out = tmp_path / "quality.json"
    cmd = [sys.executable, "scripts/weight_quality.py", "--checkpoint", str(run), "--weights", "bf16,mxfp8"]
    done = subprocess.run([*cmd, "--activations", "--quantize-output", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    variants = [("bf16", "bf16", "bf16"), ("mxfp8", "bf16", "bf16"), ("mxfp8", "mx", "bf16")]
    variants += [("mxfp8", "bf16", "quantized"), ("mxfp8", "mx", "quantized")]
    assert [(r["weights"], r["activations"], r["output_layer"]) for r in rows] == variants
    assert rows[0]["loss"] == pytest.approx(val_loss, rel=1e-6) and rows[0]["vs_bf16"] == 0
    assert len({r["loss"] for r in rows}) == 5 and all(abs(r["vs_bf16"]) < 0.05 for r in rows)
    assert "mxfp8           mx          bf16" in done.stdout and "mxfp8         bf16     quantized" in done.stdout
    bad = subprocess.run([*cmd[:3], str(tmp_path / "nothing")], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --checkpoint") and "no config.toml" in bad.stderr
