#!/usr/bin/env bash
# GPU smoke run: debug_bf16 and debug_mxfp8 on one GPU, then debug_mxfp8 with
# FSDP2 over NCCL on two GPUs at the same global batch, and a check that the first-step losses
# agree. Usage: scripts/smoke_gpu.sh [OUT_DIR] [STEPS]
set -euo pipefail
out=${1:-outputs/smoke}
steps=${2:-50}
mkdir -p "$out"
for cfg in debug_bf16 debug_mxfp8; do
  CUDA_VISIBLE_DEVICES=0 python3 train.py --config "$cfg" --training.steps "$steps" \
    --job.output_dir "$out/${cfg}_1gpu" 2>&1 | tee "$out/${cfg}_1gpu.log" | grep -E "^step|^model|^done"
done
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  torchrun --standalone --nproc_per_node=2 train.py --config debug_mxfp8 --training.steps "$steps" \
    --training.local_batch_size 4 --job.output_dir "$out/debug_mxfp8_2gpu" 2>&1 \
    | tee "$out/debug_mxfp8_2gpu.log" | grep -E "^step|^model|^done"
  python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
read = lambda name: [json.loads(l) for l in (out / name / "metrics.jsonl").read_text().splitlines()]
one, two = read("debug_mxfp8_1gpu"), read("debug_mxfp8_2gpu")
for a, b in zip(one, two):
    print(f"step {a['step']:4d}  1 GPU {a['loss']:.6f}  2 GPUs {b['loss']:.6f}  rel diff {abs(a['loss'] - b['loss']) / a['loss']:.2e}")
PY
fi
