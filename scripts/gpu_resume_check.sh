#!/usr/bin/env bash
# Resume check on 2 GPUs with torch.compile and selective activation checkpointing, for a Llama
# (debug_mxfp8) and a MoE (debug_moe_mxfp8) config. For each config:
#   1. an uninterrupted run of STEPS steps (FSDP2 over NCCL, 2 GPUs);
#   2. the same command in a second output_dir, sent SIGTERM (to torchrun, as a scheduler would)
#      once step STOP is logged: the workers save a checkpoint at the step boundary and exit 0;
#   3. the same command again in that output_dir: it resumes from that checkpoint.
# Then per-step losses of 3 vs 1 side by side, and a summary table (tokens/s per GPU: median
# over the steps after the first 5 of each run, which hold the compiles).
#
# Usage: scripts/gpu_resume_check.sh [OUT_DIR] [STEPS] [STOP]    (defaults: outputs/gpu_resume_check 30 15)
# About 6 torchrun launches of a few tens of seconds each; the inductor cache makes the later
# compiles cheaper. Needs 2 GPUs; works with torch 2.11 and later. MoE blocks: compile meets a
# graph break at torch.bincount (data-dependent shape) inside the checkpointed block, so under AC
# those blocks run eagerly; the dense blocks compile.
# A dry run of the script's mechanics on a CPU (gloo, no compile: inductor's CPU backend has no
# MX scale dtype): CONFIGS="debug_bf16 debug_moe_bf16" COMPILE=false CPU_OK=1 scripts/gpu_resume_check.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${1:-outputs/gpu_resume_check}
steps=${2:-30}
stop=${3:-15}
limit=150  # seconds: no single launch may take longer
read -r -a configs <<< "${CONFIGS:-debug_mxfp8 debug_moe_mxfp8}"
compile=${COMPILE:-true}
rm -rf "$out"
mkdir -p "$out"

if ! CPU_OK=${CPU_OK:-0} python3 - <<'PY'
import os
import torch
if os.environ["CPU_OK"] != "1":
    assert torch.cuda.device_count() >= 2, "gpu_resume_check.sh needs 2 GPUs"
    print(f"torch {torch.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
else:
    print(f"torch {torch.__version__}, dry run on the CPU")
PY
then
  exit 1
fi

launch() {  # launch CONFIG OUTPUT_DIR: one torchrun in the background, its log in OUTPUT_DIR.log; sets $pid
  python3 -m torch.distributed.run --standalone --nproc_per_node=2 train.py --config "$1" --job.output_dir "$2" \
    --training.steps "$steps" --metrics.log_freq 1 --compile.enable "$compile" \
    --activation_checkpoint.mode selective --checkpoint.enable true --checkpoint.interval 10 \
    >> "$2.log" 2>&1 &
  pid=$!
}

wait_for() {  # wait_for PID: wait with the time limit; prints and returns the exit status
  local waited=0
  while kill -0 "$1" 2> /dev/null && [ $waited -lt $limit ]; do sleep 1; waited=$((waited + 1)); done
  if kill -0 "$1" 2> /dev/null; then
    echo "  (over ${limit}s: killed)"
    kill -KILL "$1"
  fi
  wait "$1"
}

for cfg in "${configs[@]}"; do
  ref="$out/$cfg/uninterrupted" run="$out/$cfg/resumed"
  mkdir -p "$out/$cfg"
  echo "== $cfg: uninterrupted run"
  start=$(date +%s)
  launch "$cfg" "$ref"
  wait_for $pid
  echo "  exit $?, $(($(date +%s) - start)) s"

  echo "== $cfg: SIGTERM once step $stop is logged"
  start=$(date +%s)
  launch "$cfg" "$run"
  waited=0  # in tenths of a second
  until grep -qE "^step +$stop/" "$run.log" 2> /dev/null || ! kill -0 $pid 2> /dev/null || [ $waited -ge $((limit * 10)) ]; do
    sleep 0.1
    waited=$((waited + 1))
  done
  kill -TERM $pid 2> /dev/null
  wait_for $pid  # torchrun itself exits non-zero after forwarding a signal; the workers exit 0
  echo "  torchrun exit $?, $(($(date +%s) - start)) s"
  grep -E "received SIGTERM|saved checkpoint" "$run.log" | sed 's/^/  /'

  echo "== $cfg: the same command again (resumes)"
  start=$(date +%s)
  launch "$cfg" "$run"
  wait_for $pid
  echo "  exit $?, $(($(date +%s) - start)) s"
  grep -E "resuming from" "$run.log" | sed 's/^/  /'
done

python3 - "$out" "$stop" "${configs[@]}" <<'PY'
import json
import re
import statistics
import sys
from pathlib import Path

out, stop, configs = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def last_losses(recs: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def median_tps(recs: list[dict]) -> float:
    values = [r["tokens_per_sec"] for r in recs if "tokens_per_sec" in r][5:]
    return statistics.median(values) if values else float("nan")


rows = []
for cfg in configs:
    ref_recs, run_recs = records(out / cfg / "uninterrupted"), records(out / cfg / "resumed")
    ref, run = last_losses(ref_recs), last_losses(run_recs)
    log = (out / cfg / "resumed.log").read_text() if (out / cfg / "resumed.log").is_file() else ""
    stopped = re.search(r"received SIGTERM: stopped after step (\d+)", log)
    resumed = re.search(r"resuming from checkpoint \S+ \(step (\d+)", log)
    resumed_at = int(resumed.group(1)) if resumed else None
    print(f"\n{cfg}: per-step loss, uninterrupted vs stopped + resumed")
    print(f"{'step':>5} {'uninterrupted':>14} {'resumed':>14} {'rel diff':>9}")
    worst, equal = 0.0, True
    for step in sorted(ref):
        a, b = ref[step], run.get(step)
        rel = float("nan") if b is None else abs(a - b) / abs(a)
        mark = " <- resumed here" if resumed_at is not None and step == resumed_at + 1 else ""
        print(f"{step:5d} {a:14.6f} {'missing' if b is None else f'{b:14.6f}':>14} {rel:9.2e}{mark}")
        if b is None or rel != rel:
            equal = False
            continue
        equal &= a == b
        worst = max(worst, rel)
    after = [r for r in run_recs if resumed_at is not None and r.get("step", 0) > resumed_at]
    rows.append(
        (
            cfg,
            stopped.group(1) if stopped else "-",
            str(resumed_at) if resumed_at is not None else "-",
            f"{len(run)}/{len(ref)}",
            "yes" if equal and len(run) == len(ref) else "no",
            f"{worst:.2e}",
            f"{median_tps(ref_recs):,.0f}",
            f"{median_tps(after):,.0f}",
        )
    )

head = ("config", "stopped", "resumed", "steps", "bit-equal", "max rel diff", "tok/s/GPU ref", "tok/s/GPU resumed")
widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
print("\nsummary (2 ranks, selective AC; resumed vs uninterrupted losses)")
print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
for r in rows:
    print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
PY
