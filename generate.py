"""Generate text from a train.py run, with the weights kept in bf16, MXFP8, MXFP4 or NVFP4.

    python generate.py --checkpoint outputs/debug_mxfp8 --weights mxfp8 --prompt "def main("
    python generate.py --checkpoint DIR --prompt "a" --prompt "b" --temperature 0.8 --top-k 50
    python generate.py --model llama --flavor 8B --weights mxfp4 --batch 8 --max-new-tokens 256   # random weights

--checkpoint: a train.py job.output_dir; its newest committed checkpoint is loaded whatever world size wrote
it, with the run's tokenizer. Without it, --model and --flavor build a model at random for speed runs (byte
tokenizer). The weights are quantized along K and kept packed (mx_recipe.infer.weights); on a GPU each GEMM
reads them packed and upcasts them in registers (the weight-only kernel), on the CPU it dequantizes them first;
--activations mx quantizes each GEMM's input too, as a B200's MX GEMM reads it. The output layer stays in bf16
as it trained (--quantize-output: in the --weights format too, its cost in loss measured in docs/RESULTS.md;
at one sequence of Llama 3 8B it is a seventh of the bf16 bytes a step reads). Decoding keeps a static KV
cache; the projections that read one input run as one GEMM (wq/wk/wv, w1/w3; --no-fuse: one each); --compile
compiles the decode step; on CUDA each decode step replays a CUDA graph (--no-cuda-graph: each step launches
its kernels). Greedy at --temperature 0 (the default), else sampling over the --top-k most likely
tokens. Several --prompt give a batch, each continued from its own last token as if alone (prompts of different
lengths are right-padded, the padding never attended); --batch N repeats one prompt N times. A continuation ends
at the tokenizer's EOS (decoding stops once every sequence has ended; --ignore-eos: --max-new-tokens each). Prints
the continuations and one line with prefill time and decode tokens/s (from the second decode step on: the first
compiles or captures). Exit 2 for bad arguments.
"""

from __future__ import annotations

import sys

import torch

from mx_recipe.cli import ArgumentParser
from mx_recipe.infer.decode import forward, generate
from mx_recipe.infer.load import load_run, random_model, to_compute_dtype
from mx_recipe.infer.weights import WEIGHT_FORMATS, fuse_projections, quantize_model, tile_weights, weight_bytes
from mx_recipe.models import MODEL_FLAVORS
from mx_recipe.train.tokenizer import ByteTokenizer
from mx_recipe.train.trainer import padded_vocab_size


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__)
    p.add_argument("--checkpoint", help="a train.py job.output_dir to load")
    p.add_argument("--model", choices=sorted(MODEL_FLAVORS), help="without --checkpoint: a model at random")
    p.add_argument("--flavor", help="with --model: its size")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default="bf16", help="the format the weights are kept in")
    p.add_argument("--activations", choices=("bf16", "mx"), default="bf16", help="mx: quantize GEMM inputs too")
    p.add_argument("--quantize-output", action="store_true", help="the output layer in --weights too (not bf16)")
    p.add_argument("--prompt", action="append", help="a prompt; several make a batch")
    p.add_argument("--batch", type=int, default=1, help="with one prompt: decode it this many times at once")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, help="with --temperature: sample among the k most likely tokens")
    p.add_argument("--seed", type=int, default=0, help="the random weights and the sampling")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    p.add_argument("--no-cuda-graph", action="store_true", help="on CUDA: launch each decode step's kernels")
    p.add_argument("--no-fuse", action="store_true", help="wq/wk/wv and w1/w3 as separate GEMMs")
    p.add_argument("--ignore-eos", action="store_true", help="decode --max-new-tokens past the tokenizer's EOS")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    args = p.parse_args(argv)
    if (args.checkpoint is None) == (args.model is None):
        p.error("give --checkpoint DIR, or --model and --flavor for a model at random")
    if args.model and (args.flavor not in MODEL_FLAVORS[args.model]):
        p.error(f"--flavor: unknown {args.model} flavor {args.flavor!r}; known: {', '.join(MODEL_FLAVORS[args.model])}")
    if args.max_new_tokens < 1 or args.batch < 1 or args.temperature < 0 or (args.top_k is not None and args.top_k < 1):
        p.error("--max-new-tokens, --batch and --top-k must be >= 1 and --temperature >= 0")
    if args.activations == "mx" and args.weights == "bf16":
        p.error("--activations mx needs --weights mxfp8, mxfp4 or nvfp4")
    if args.quantize_output and args.weights == "bf16":
        p.error("--quantize-output needs --weights mxfp8, mxfp4 or nvfp4")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.compile and device.type == "cpu" and args.weights in ("mxfp8", "mxfp4"):
        p.error("--compile: Inductor's CPU code has no float8_e8m0fnu, the MX scales' type: decode MX weights eagerly")
    prompts = args.prompt or [""]
    if len(prompts) > 1 and args.batch != 1:
        p.error("--batch repeats one --prompt: give one prompt, or several and no --batch")

    tokenizer = ByteTokenizer()
    # RoPE tables for the longest prompt in bytes (no tokenizer makes more tokens than bytes, plus BOS)
    max_len = max(len(text.encode()) for text in prompts) + 1 + args.max_new_tokens
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.checkpoint:
        try:
            model, tokenizer, _ = load_run(args.checkpoint, device, max_len=max(max_len, 64))
        except ValueError as e:
            print(f"error: --checkpoint {e}", file=sys.stderr)
            return 2
    else:
        vocab = padded_vocab_size(tokenizer.vocab_size)
        try:
            model = random_model(args.model, args.flavor, vocab, max_len, device, args.seed, dtype)
        except ValueError as e:
            print(f"error: --model {e}", file=sys.stderr)
            return 2
    model = to_compute_dtype(model.eval(), dtype)
    model = quantize_model(model, args.weights, activations=args.activations == "mx", output=args.quantize_output)
    if not args.no_fuse:
        model = fuse_projections(model)
    ids = [[tokenizer.bos_id, *tokenizer.encode(text)] for text in prompts] * args.batch
    model = tile_weights(model, len(ids))
    width = max(len(x) for x in ids)
    if width + args.max_new_tokens > model.args.max_seq_len:
        p.error(f"prompt + --max-new-tokens = {width + args.max_new_tokens} tokens, past {model.args.max_seq_len}")
    tokens = torch.tensor([x + [tokenizer.bos_id] * (width - len(x)) for x in ids], device=device)
    lengths = torch.tensor([len(x) for x in ids], device=device) if any(len(x) < width for x in ids) else None
    step = torch.compile(forward) if args.compile else forward
    generator = torch.Generator(device).manual_seed(args.seed)
    graph = device.type == "cuda" and not args.no_cuda_graph
    eos = None if args.ignore_eos else tokenizer.eos_id
    new, timing = generate(model, tokens, args.max_new_tokens, args.temperature, args.top_k, generator, step, graph,
                           lengths, eos)  # fmt: skip
    for prompt, row in zip(prompts * args.batch, new.tolist(), strict=True):
        print(f"{prompt}{tokenizer.decode(row[: row.index(eos)] if eos in row else row)}")
    print(
        f"{device.type} {args.weights} weights{' and output layer' if args.quantize_output else ''} "
        f"({weight_bytes(model) / 2**20:,.1f} MiB), activations "
        f"{args.activations}, batch {tokens.shape[0]}: prefill {tokens.shape[1]} tokens in "
        f"{timing.prefill_s * 1e3:,.1f} ms, decode {timing.tokens_per_second(tokens.shape[0]):,.1f} tokens/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
