#!/usr/bin/env bash
# torchtitan 0.2.x's own trainer on NGPUS GPUs, bf16 against MXFP8 (the mx converter): Llama 3 8B and DeepSeek-V3
# 16B dims cut to 4 layers (configs/torchtitan/), then each run's median tokens/s and MFU and compare_runs' verdicts.
#   scripts/torchtitan_gpu.sh OUT_DIR [NGPUS] [torchtitan flags for every run, e.g. --training.steps 200]
# Writes OUT_DIR/assets/ (scripts/torchtitan_assets.py), OUT_DIR/<run>.log (rank 0's output), OUT_DIR/<run>/
# (torchtitan's dump folder: config.json, tb/), OUT_DIR/compare_<model>/ (compare_runs.py) and OUT_DIR/summary.md.
# Installs nothing: torchtitan 0.2.x and its dependencies must be installed (pip install --no-deps .whl/*.whl).
set -uo pipefail
out=${1:?usage: scripts/torchtitan_gpu.sh OUT_DIR [NGPUS] [torchtitan flags]}
ngpus=${2:-1}
shift $(($# < 2 ? $# : 2))
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/.pypath${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
python -c "import torchtitan, sys; sys.exit(not torchtitan.__version__.startswith('0.2'))" || {
  echo "torchtitan 0.2.x is not installed: pip install --no-deps .whl/*.whl" >&2
  exit 2
}
mkdir -p "$out"
start=$SECONDS
python scripts/torchtitan_assets.py --out "$out/assets" --max-mib 16 || exit 1
echo "assets: $((SECONDS - start)) s"

runs="llama3_8b_bf16 llama3_8b_mxfp8 deepseek_v3_16b_bf16 deepseek_v3_16b_mxfp8"
failed=()
: >"$out/wall_s.tsv"
for run in $runs; do
  t0=$SECONDS
  echo "== $run on $ngpus GPU(s)"
  torchrun --standalone --nproc_per_node="$ngpus" --local-ranks-filter 0 --role rank --tee 3 \
    -m mx_recipe.integrations.torchtitan.train --layers 4 --job.config_file "configs/torchtitan/$run.toml" \
    --job.dump_folder "$out/$run" --model.hf_assets_path "$out/assets/tokenizer" \
    --training.dataset_path "$out/assets/data" "$@" >"$out/$run.log" 2>&1
  rc=$?
  grep -E "step: |Error|error:" "$out/$run.log" | tail -n 4
  echo "== $run: exit status $rc, $((SECONDS - t0)) s"
  printf '%s\t%s\n' "$run" "$((SECONDS - t0))" >>"$out/wall_s.tsv"
  [ "$rc" -eq 0 ] || failed+=("$run")
done

for model in llama3_8b deepseek_v3_16b; do  # their tables in OUT_DIR/compare_<model>/summary.md
  python scripts/compare_runs.py "$out/${model}_bf16.log" "$out/${model}_mxfp8.log" --out "$out/compare_$model" \
    >/dev/null
done
python - "$out" $runs <<'PY' | tee "$out/summary.md"
import json, sys
from pathlib import Path

sys.path.insert(0, "scripts")
from compare_runs import CompareError, median_of, peak_memory_gib, read_run

out, runs = Path(sys.argv[1]), sys.argv[2:]
wall = dict(line.split("\t") for line in (out / "wall_s.tsv").read_text().splitlines())
fmt = lambda v, spec, unit="": "n/a" if v is None else format(v, spec) + unit
print("| run | last step | final loss | tokens/s/GPU (median) | MFU (median) | peak memory (GiB) | wall time (s) |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for name in runs:
    try:
        run = read_run(out / f"{name}.log")
    except CompareError as e:
        print(f"| {name} | {e} | | | | | {wall.get(name, 'n/a')} |")
        continue
    last = next(reversed(run.train.values()))
    print(f"| {run.label} | {last['step']} | {fmt(last['loss'], '.4f')} | "
          f"{fmt(median_of(run, 'tokens_per_sec'), ',.0f')} | {fmt(median_of(run, 'mfu'), '.1f', '%')} | "
          f"{fmt(peak_memory_gib(run), '.1f')} | {wall.get(name, 'n/a')} |")
print("\nMedians leave out step 1 (start-up and compile); wall time includes them.\n")
for model in ("llama3_8b", "deepseek_v3_16b"):
    path = out / f"compare_{model}" / "summary.json"
    if not path.is_file():
        print(f"{model}: no comparison")
        continue
    summary = json.loads(path.read_text())
    deviation = next(a["max_rel_deviation_after_warmup"] for a in summary["arms"] if not a["is_baseline"])
    print(f"{summary['verdict_line']}\n  largest gap of the train loss after warm-up: {fmt(deviation, '.2%')}")
PY
echo "total: $((SECONDS - start)) s"
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]} (see $out/<run>.log)" >&2
  exit 1
fi
