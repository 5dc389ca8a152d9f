"""The inference roofline: bytes and FLOPs of decode and prefill per weight format, against batch size, on H100,
H200 and B200, and the batch where each format turns compute-bound.

    python scripts/inference_roofline.py [--model llama --flavor 8B] [--context 1024] [--write docs/ROOFLINE.md]

A decode step reads every weight it uses once, whatever the batch, and each sequence's KV cache; it multiplies
2 FLOPs per weight per sequence, plus attention over the context. Its time is the larger of its bytes over the
memory bandwidth and its FLOPs over the tensor-core rate (no overlap loss, no kernel overheads: a bound). A
weight format changes the bytes: bf16 2 bytes an element; MXFP8 1 + 1/32 (an E8M0 scale per 32); MXFP4
0.5 + 1/32; NVFP4 0.5 + 1/16 (an E4M3 scale per 16). The output layer stays bf16 (the converter's default).

Which MMA multiplies them: weight-only kernels upcast the codes in registers ahead of a bf16 MMA (the only way on
Hopper, which has no MX MMA), so their FLOPs run at the bf16 rate; on B200, "+ MX activations" quantizes the
activations too and runs the block-scaled MMA at the fp8 or fp4 rate. Prefill of T tokens reads the weights once
for all T, so it turns compute-bound within a few hundred tokens.

Under each model's table, the newest measured decode points of that model on an H100 and on an H200
(``*_bench_decode*.json`` in docs/results, from benchmarks/bench_decode.py) and the share of that GPU's
weight-only bound each reaches.

MoE: a decode step reads the routed experts that any of its tokens picked; with uniform routing of B tokens to
top_k of E experts, E (1 - (1 - top_k / E)^B) experts per layer. The shared experts, attention and router are
read every step.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere without installing

from roofline_model import DEVICES, Device  # noqa: E402

from mx_recipe.cli import ArgumentParser  # noqa: E402

# Bytes per weight element, scales included.
WEIGHT_BYTES = {"bf16": 2.0, "mxfp8": 1 + 1 / 32, "mxfp4": 0.5 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
# The MMA format a weight format reaches when the activations are quantized too (B200's block-scaled MMA).
MX_MMA = {"bf16": "bf16", "mxfp8": "fp8", "mxfp4": "fp4", "nvfp4": "fp4"}
KV_BYTES = 2  # bf16 cache
BATCHES = (1, 8, 32, 128)
DOC = ROOT / "docs" / "ROOFLINE.md"
BEGIN, END = "<!-- inference roofline: begin -->", "<!-- inference roofline: end -->"
# (model, flavor, vocabulary of the published model, its name)
MODELS = [("llama", "8B", 128256, "Llama 3 8B"), ("moe", "moe_16B", 102400, "DeepSeek-MoE 16B")]


@dataclass(frozen=True)
class ModelCounts:
    """What a decode step of one model reads and multiplies, by kind of weight."""

    name: str
    dense: float  # elements of the converted linears read every step (attention, dense FFNs, shared experts)
    kept: float  # elements kept in bf16 (the output layer, the router gates)
    expert: float  # elements of one routed expert (w1, w2, w3), per MoE layer summed over layers
    n_experts: int  # routed experts per MoE layer (0: a dense model)
    top_k: int
    kv_per_position: float  # KV-cache bytes per position of the context, all layers
    attention_flops_per_position: float  # QK^T and PV FLOPs per token per position of the context, all layers

    def experts_read(self, batch: int) -> float:
        """Expected routed experts a layer reads in a step of ``batch`` tokens (uniform routing)."""
        if not self.n_experts:
            return 0.0
        return self.n_experts * (1 - (1 - self.top_k / self.n_experts) ** batch)


def model_counts(name: str, flavor: str, vocab_size: int, label: str, layers: int | None = None) -> ModelCounts:
    """Count a flavor built on the meta device (no memory), or its first ``layers`` blocks; ``convert_to_mx``'s
    default skip decides what stays bf16."""
    import dataclasses

    import torch
    from torch import nn

    from mx_recipe.models import build_model, model_args
    from mx_recipe.models.moe import GroupedExperts
    from mx_recipe.nn.convert import DEFAULT_SKIP, skip_reason

    args = model_args(name, flavor, vocab_size, 2048)
    if layers is not None:
        args = dataclasses.replace(args, n_layers=layers)
    with torch.device("meta"):
        model = build_model(args)
    dense = kept = expert = 0.0
    n_experts = 0
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear):
            if skip_reason(fqn, (module.out_features, module.in_features), DEFAULT_SKIP, 32) is not None:
                kept += module.weight.numel()
            else:
                dense += module.weight.numel()
        elif isinstance(module, GroupedExperts):
            n_experts = module.w1.shape[0]
            expert += sum(getattr(module, w).numel() for w in ("w1", "w2", "w3")) / n_experts
    kv = 2 * args.n_layers * args.n_kv_heads * args.head_dim * KV_BYTES
    attention = 4 * args.n_layers * args.n_heads * args.head_dim
    return ModelCounts(label, dense, kept, expert, n_experts, getattr(args, "top_k", 0), kv, attention)


@dataclass(frozen=True)
class Step:
    bytes: float
    flops: float
    seconds: float
    compute_bound: bool


def _step(m: ModelCounts, fmt: str, dev: Device, tokens: int, kv_bytes: float, attention_positions: float,
          mx_activations: bool) -> Step:  # fmt: skip
    """``tokens`` through the model reading ``kv_bytes`` of cache, each token attending to ``attention_positions``."""
    weights = (m.dense + m.expert * m.experts_read(tokens)) * WEIGHT_BYTES[fmt] + m.kept * 2
    data = weights + kv_bytes
    converted = 2 * (m.dense + m.expert * m.top_k) * tokens  # each token multiplies only its own experts
    bf16 = 2 * m.kept * tokens + m.attention_flops_per_position * attention_positions * tokens  # output, attention
    mma = MX_MMA[fmt] if mx_activations else "bf16"
    seconds_flops = converted / dev.rate(mma) + bf16 / dev.bf16_flops
    seconds_mem = data / dev.mem_bw
    return Step(data, converted + bf16, max(seconds_mem, seconds_flops), seconds_flops > seconds_mem)


def decode_step(m: ModelCounts, fmt: str, dev: Device, batch: int, context: int, mx_activations: bool = False) -> Step:
    """One decode step of ``batch`` sequences, each reading ``context`` positions of KV cache."""
    return _step(m, fmt, dev, batch, batch * context * m.kv_per_position, context, mx_activations)


def compute_bound_batch(m: ModelCounts, fmt: str, dev: Device, context: int, mx_activations: bool = False) -> int:
    """The smallest batch whose decode step is compute-bound (0: none up to 65536, the KV cache keeps it bound by
    memory)."""
    lo, hi = 1, 65536
    if not decode_step(m, fmt, dev, hi, context, mx_activations).compute_bound:
        return 0
    while lo < hi:
        mid = (lo + hi) // 2
        if decode_step(m, fmt, dev, mid, context, mx_activations).compute_bound:
            hi = mid
        else:
            lo = mid + 1
    return lo


def prefill_tokens_per_second(
    m: ModelCounts, fmt: str, dev: Device, tokens: int, mx_activations: bool = False
) -> float:
    """Prefill of one prompt of ``tokens``: every weight read once, its KV cache written once, causal attention
    over half the prompt on average (in on-chip tiles: no cache reads)."""
    step = _step(m, fmt, dev, tokens, tokens * m.kv_per_position, tokens / 2, mx_activations)
    return tokens / step.seconds


# --- rendering ---


def _cases(dev: Device) -> list[tuple[str, bool]]:
    """(format, with MX activations) rows for a device: weight-only everywhere; on a device with an MX MMA also
    the MX formats with quantized activations."""
    rows = [(fmt, False) for fmt in WEIGHT_BYTES]
    if dev.native_mx:
        rows += [(fmt, True) for fmt in WEIGHT_BYTES if fmt != "bf16"]
    return rows


def latest_decode_result(model: str, flavor: str, device: str = "H200") -> tuple[Path, dict] | None:
    """The newest docs/results/*_bench_decode.json of ``model``/``flavor`` measured on ``device`` (its name), of the
    runs with the output layer in bf16, as this roofline counts it."""
    import json

    found = None
    for path in sorted((ROOT / "docs" / "results").glob("*_bench_decode*.json")):
        data = json.loads(path.read_text())
        meta = data["meta"]
        gpu = meta.get("device", "").split(" (")[0]  # the GPU, without the note on the run
        plain = not meta.get("quantized_output")
        if (meta.get("model"), meta.get("flavor")) == (model, flavor) and device in gpu and plain:
            found = path, data
    return found


def measured_points(m: ModelCounts, model: str, flavor: str, vocab: int, context: int, key: str = "h200"
                    ) -> list[str]:  # fmt: skip
    """The measured decode and prefill points of ``benchmarks/bench_decode.py`` on the GPU ``key`` (h100, h200)
    against this roofline's weight-only rows of that GPU; against the bound of the blocks it kept where it ran
    fewer (``--layers``)."""
    result = latest_decode_result(model, flavor, key.upper())
    if result is None:
        return []
    path, data = result
    meta = data["meta"]
    if meta.get("context", context) != context or meta.get("vocab", vocab) != vocab:
        return []
    layers = meta.get("layers")
    kept = m if layers is None else model_counts(model, flavor, vocab, m.name, layers)
    dev = DEVICES[key]
    rows_of = f"the {dev.name} weight-only rows above" if kept == m else f"the bound of its first {layers} blocks"
    m = kept
    rows = []
    for r in (r for r in data["rows"] if r["mode"] in ("decode", "prefill")):
        if r["mode"] == "decode":
            what, bound = f"decode, batch {r['batch']}", r["batch"] / decode_step(m, r["weights"], dev, r["batch"],
                                                                                  context).seconds  # fmt: skip
        else:
            what, bound = f"prefill, {r['tokens']} tokens", prefill_tokens_per_second(m, r["weights"], dev, r["tokens"])
        rows.append(
            [r["weights"], what, f"{r['tokens_per_s']:,.0f}", f"{bound:,.0f}", f"{r['tokens_per_s'] / bound:.0%}"]
        )
    lines = [
        f"Measured on one {meta['device']} (`{meta['command']}`, `docs/results/{path.name}`, commit "
        f"{str(meta['commit'])[:7]}), against {rows_of}:",
        "",
    ]
    return lines + table(["weights", "step", "measured tok/s", "roofline tok/s", "share"], rows) + [""]


def render(context: int = 1024, prefill: int = 2048) -> list[str]:
    lines = [
        BEGIN,
        "<!-- generated by scripts/inference_roofline.py --write docs/ROOFLINE.md: edit the script, not this -->",
        "",
        "## The inference roofline",
        "",
        f"Decode of a batch of sequences with {context} positions of KV cache each (bf16), and prefill of one",
        f"{prefill}-token prompt; bounds from datasheet peaks (dense FLOPs, datasheet memory bandwidth), so a",
        "measured kernel reaches a fraction of them. Weight bytes count the scales; the output layer stays bf16.",
        '"weight-only": the weights upcast in registers ahead of a bf16 MMA (Hopper\'s only way); "+ MX act.":',
        "activations quantized too, on B200's block-scaled MMA. Tokens/s of decode = batch / step time.",
        "",
    ]
    for model, flavor, vocab, label in MODELS:
        m = model_counts(model, flavor, vocab, label)
        weights = {fmt: (m.dense + m.expert * m.n_experts) * b + m.kept * 2 for fmt, b in WEIGHT_BYTES.items()}
        total = ", ".join(f"{fmt} {w / 1e9:.1f} GB" for fmt, w in weights.items())
        lines += [f"### {label}", "", f"All weights a step can read: {total}.", ""]
        header = ["device", "weights", *(f"decode tok/s, batch {b}" for b in BATCHES)]
        header += [f"compute-bound from batch (context 0 / {context})", f"prefill tok/s ({prefill})"]
        rows = []
        for key in ("h100", "h200", "b200"):
            dev = DEVICES[key]
            for fmt, act in _cases(dev):
                cells = [dev.name, f"{fmt} {'+ MX act.' if act else 'weight-only'}"]
                cells += [f"{b / decode_step(m, fmt, dev, b, context, act).seconds:,.0f}" for b in BATCHES]
                bounds = [compute_bound_batch(m, fmt, dev, c, act) for c in (0, context)]
                cells += [" / ".join(f"{b:,}" if b else "never" for b in bounds)]
                cells += [f"{prefill_tokens_per_second(m, fmt, dev, prefill, act):,.0f}"]
                rows.append(cells)
        lines += table(header, rows) + [""]
        for key in ("h100", "h200"):
            lines += measured_points(m, model, flavor, vocab, context, key)
        one = decode_step(m, "bf16", DEVICES["h200"], 1, context)
        balance = DEVICES["h200"].bf16_flops / DEVICES["h200"].mem_bw
        kv = m.kv_per_position * context / 1e6
        lines += [
            f"Batch 1 on an H200 in bf16 moves {one.bytes / 1e9:.2f} GB a step for {one.flops / 1e9:.1f} GFLOP,",
            f"{one.flops / one.bytes:.1f} FLOP a byte, where the H200 balances at {balance:.0f}: decode is bound by",
            "reading the weights until the batch nears that balance times the bytes of a weight over 2 (context 0).",
            f"Each sequence adds {kv:.0f} MB of KV cache a step at {context} positions, which no batch shares, so",
            'with that context decode never turns compute-bound ("never").',
            "",
        ]
    return lines + [END]


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]


def write(doc: Path, lines: list[str]) -> None:
    """Replace the generated part of ``doc`` (between BEGIN and END), or append it."""
    text = doc.read_text()
    block = "\n".join(lines)
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    doc.write_text(text)


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__)
    p.add_argument("--context", type=int, default=1024, help="KV-cache positions per sequence in decode")
    p.add_argument("--prefill", type=int, default=2048, help="prompt tokens of the prefill column")
    p.add_argument("--write", metavar="DOC", help="replace the generated part of DOC (docs/ROOFLINE.md)")
    args = p.parse_args(argv)
    if args.context < 1 or args.prefill < 2:
        p.error("--context must be >= 1 and --prefill >= 2")
    lines = render(args.context, args.prefill)
    if args.write:
        write(Path(args.write), lines)
        print(f"wrote {args.write}")
    else:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
