"""What serving a trained model with MX or NVFP4 weights costs in loss: a train.py run's held-out loss with its
weights kept in bf16 and in each quantized form.

    python scripts/weight_quality.py --checkpoint outputs/parity_llama1b/none_seed0 [--weights bf16,mxfp8,mxfp4,nvfp4]
        [--activations] [--quantize-output] [--steps N] [--out FILE]

Loads the run's newest checkpoint (any world size; ``mx_recipe.infer.load``) and builds the run's own held-out
split from its config.toml: the batches its validation read, in the same order. For each format the weights are
kept in that form as generate.py keeps them (``infer.weights.quantize_model``: packed codes and scales, the
output layer and router gates in bf16); with ``--activations`` each quantized GEMM also reads its input
quantized, as a B200's MX GEMM would (a second row per format); with ``--quantize-output`` the output layer is
also kept in the format (``quantize_model(output=True)``: generate.py's --quantize-output), a row for each row
above. Each row is the mean loss per token over
``--steps`` batches (default: the run's ``validation.steps``) and its difference to the bf16 weights' loss.
The weights are computed in the run's compute dtype (``training.compute_dtype``, resolved for the device), so
the bf16 row is the loss the run's own validation reports for that checkpoint. ``--out`` writes the rows as
JSON with provenance for docs/results/.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing
from mx_recipe.cli import ArgumentParser, names, output_file  # noqa: E402
from mx_recipe.infer.load import load_run, to_compute_dtype  # noqa: E402
from mx_recipe.infer.weights import WEIGHT_FORMATS, quantize_model  # noqa: E402
from mx_recipe.train.config import ConfigError, load_config  # noqa: E402
from mx_recipe.train.data import build_datasets  # noqa: E402
from mx_recipe.train.parallel import COMPUTE_DTYPES, resolve_compute_dtype  # noqa: E402


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, batches: list, device: torch.device) -> float:
    """Mean loss per token over ``batches``, summed in fp64 as the trainer's validation sums it."""
    total, tokens = torch.zeros((), dtype=torch.float64, device=device), 0
    for inputs, targets in batches:
        logits = model(inputs.to(device))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.to(device).flatten(), reduction="sum")
        total += loss.double()
        tokens += targets.numel()
    return (total / tokens).item()


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__)
    p.add_argument("--checkpoint", required=True, help="a train.py job.output_dir")
    p.add_argument("--weights", type=names(WEIGHT_FORMATS), default=WEIGHT_FORMATS, help="comma-separated")
    p.add_argument("--activations", action="store_true", help="also each format with the GEMM inputs quantized")
    p.add_argument("--quantize-output", action="store_true", help="also each with the output layer in the format")
    p.add_argument("--steps", type=int, help="held-out batches (default: the run's validation.steps)")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument("--out", type=output_file, help="write the rows as JSON here, with provenance")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config_file = Path(args.checkpoint) / "config.toml"
    try:
        if not config_file.is_file():
            raise ValueError(f"{args.checkpoint}: no config.toml: not the job.output_dir of a train.py run")
        config = load_config(str(config_file))
    except (ValueError, ConfigError) as e:
        print(f"error: --checkpoint {e}", file=sys.stderr)
        return 2
    data = build_datasets(config, rank=0, world_size=1)
    if data.validation is None:
        print(f"error: --checkpoint {args.checkpoint}: the run holds out no data (data.validation_fraction = 0)",
              file=sys.stderr)  # fmt: skip
        return 2
    steps = args.steps or config.validation.steps
    batches = list(data.validation.batches(steps))
    dtype = COMPUTE_DTYPES[resolve_compute_dtype(config.training.compute_dtype, device)]
    variants = [(fmt, False, False) for fmt in args.weights]
    variants += [(fmt, True, False) for fmt in args.weights if args.activations and fmt != "bf16"]
    if args.quantize_output:
        variants += [(fmt, activations, True) for fmt, activations, _ in variants if fmt != "bf16"]
    try:
        trained, _, _ = load_run(args.checkpoint, device, max_len=config.training.seq_len)
    except ValueError as e:
        print(f"error: --checkpoint {e}", file=sys.stderr)
        return 2
    rows, base = [], None
    for fmt, activations, output in variants:  # each from a copy of the fp32 weights: read from disk once
        model = to_compute_dtype(copy.deepcopy(trained).eval(), dtype)
        model = quantize_model(model, fmt, activations=activations, output=output)
        loss = held_out_loss(model, batches, device)
        base = loss if fmt == "bf16" else base
        rows.append(dict(weights=fmt, activations="mx" if activations else "bf16",
                         output_layer="quantized" if output else "bf16", loss=loss))  # fmt: skip
        del model
    print(f"{args.checkpoint}: held-out loss over {steps} batches of {config.training.local_batch_size} x "
          f"{config.training.seq_len} tokens, {device.type}, compute {dtype}")  # fmt: skip
    print(f"{'weights':>8} {'activations':>12} {'output layer':>13} {'loss':>10} {'to bf16':>9}")
    for r in rows:
        r["vs_bf16"] = None if base is None else r["loss"] / base - 1
        delta = "" if r["vs_bf16"] is None else f"{r['vs_bf16']:+.2%}"
        print(f"{r['weights']:>8} {r['activations']:>12} {r['output_layer']:>13} {r['loss']:>10.4f} {delta:>9}")
    if args.out:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
        from timing import run_meta

        meta = run_meta(checkpoint=str(args.checkpoint), recipe=config.mx.recipe, steps=steps)
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
