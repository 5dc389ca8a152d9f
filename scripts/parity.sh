#!/usr/bin/env bash
# Loss parity of two configs (bf16 and MX): train both under each seed (for one seed, the same initial
# weights and data order), one run after the other, then compare them with scripts/compare_runs.py.
#
#   scripts/parity.sh CONFIG_BF16 CONFIG_MX [--out DIR] [--nproc N] [--seeds S [S ...]] [--threshold X]
#                     [--smooth N] [--section.key value ...]
#   scripts/parity.sh debug_bf16 debug_mxfp8 --training.steps 20                  # CPU, a minute or so
#   scripts/parity.sh llama_bf16 llama_mxfp8 --nproc 8 --seeds 0 1 2 --model.flavor 1B --validation.enable true
#
# Runs go to DIR/<config name>/seed<S>/ (default DIR: outputs/parity/<bf16 name>_vs_<mx name>); the
# comparison to DIR/summary.md, summary.json and loss.png; the last line printed is compare_runs' verdict
# (a verdict needs two or more seeds and a validation loss), also written to DIR/DONE once all is done.
# Every run is `python train.py --config CONFIG --job.seed S ...` (N = 1, the default) or `torchrun
# --standalone --nproc_per_node N train.py ...`, with the same overrides, seed by seed; the seeds are
# --seeds (--seed S: one), else the first config's job.seed. Both configs are resolved first, so that a bad
# override fails before any training; a warning names the keys (outside [job], [mx], [metrics]) in which
# the two configs differ.
#
# Resuming (SLURM requeue): a run whose directory holds DONE is not run again; DIR/SETTINGS records the
# configs, seeds, process count and overrides, and a rerun into DIR with other ones is refused (exit 2). A USR1 goes on to the
# training processes (they checkpoint at the next step boundary and exit 0); this script then stops without
# comparing, exit 0, and running the same command again resumes (with checkpoint.enable true).
# Environment: PYTHON (python3), MX_TRAIN_SCRIPT (train.py; tests use a stand-in).
set -euo pipefail

usage() { sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[[ $# -ge 2 && $1 != -* && $2 != -* ]] || usage
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
train_script=${MX_TRAIN_SCRIPT:-$repo/train.py}
config_a=$1 config_b=$2
shift 2
name_a=$(basename "${config_a%.toml}") name_b=$(basename "${config_b%.toml}")
out="outputs/parity/${name_a}_vs_${name_b}" nproc=1 seeds="" compare_args=() overrides=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) out=$2; shift 2 ;;
    --nproc) nproc=$2; shift 2 ;;
    --seed) seeds=$2; shift 2 ;;
    --seeds)
      shift
      while [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; do seeds+="${seeds:+ }$1"; shift; done
      [[ -n $seeds ]] || { echo "parity.sh: --seeds needs one or more integers" >&2; exit 2; }
      ;;
    --threshold|--smooth) compare_args+=("$1" "$2"); shift 2 ;;
    *) overrides+=("$1"); shift ;;  # train.py's --section.key value pairs, passed through as they are
  esac
done
if [[ $name_a == "$name_b" ]]; then
  echo "parity.sh: both configs are named $name_a; their runs would share a directory" >&2
  exit 2
fi

stopped=0 launcher_pid=""
forward_usr1() {
  stopped=1
  if [[ -n $launcher_pid ]]; then
    echo "parity.sh: USR1: passing it to the training processes" >&2
    if [[ $nproc == 1 ]]; then kill -USR1 "$launcher_pid" || true; else pkill -USR1 -P "$launcher_pid" || true; fi
  fi
}
trap forward_usr1 USR1

# Resolve both configs with the overrides (train.py's own loader): the seeds, and the keys that differ.
seeds=$(PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$python" - "$config_a" "$config_b" "$seeds" "${overrides[@]}" <<'PY'
import sys
from mx_recipe.train.config import ConfigError, config_to_dict, load_config, parse_overrides

a, b, seeds, *rest = sys.argv[1:]
try:
    overrides = parse_overrides(rest)
    configs = [config_to_dict(load_config(name, overrides)) for name in (a, b)]
except ConfigError as e:
    sys.exit(f"parity.sh: config error: {e}")
if seeds and any(key == "job.seed" for key, _ in overrides):
    sys.exit("parity.sh: give the seeds with --seeds, not --job.seed")
if len(set(seeds.split())) != len(seeds.split()):
    sys.exit(f"parity.sh: --seeds names a seed twice: {seeds}")
differ = [
    f"{section}.{key}"
    for section, table in configs[0].items()
    if section not in ("job", "mx", "metrics")
    for key, value in table.items()
    if configs[1][section][key] != value
]
if differ:
    print(f"parity.sh: warning: {a} and {b} differ in {', '.join(differ)}", file=sys.stderr)
print(seeds or configs[0]["job"]["seed"])
PY
)

# Run "$@" in the background with USR1 ignored, since torchrun would die of it (train.py sets its own
# handler); a USR1 to this shell goes to the training processes: torchrun's children, or with one process
# train.py itself. Returns the launcher's exit status.
run_launcher() {
  (trap '' USR1; exec "$@") &
  launcher_pid=$!
  while kill -0 "$launcher_pid" 2>/dev/null; do wait "$launcher_pid" || true; done  # a trap ends a wait early
  local rc=0
  wait "$launcher_pid" || rc=$?  # bash keeps the exit status
  launcher_pid=""
  return "$rc"
}

# What this comparison is: a rerun into the same --out with other settings would skip the DONE runs and
# report their old verdict, so it is refused; a requeue (the same command) goes on.
settings="configs: $config_a $config_b; seeds: $seeds; nproc: $nproc; overrides: ${overrides[*]}"
mkdir -p "$out"
if [[ -e $out/SETTINGS && $(cat "$out/SETTINGS") != "$settings" ]]; then
  echo "parity.sh: $out holds a comparison with other settings ($(cat "$out/SETTINGS")); now: $settings." \
    "Use another --out, or delete $out" >&2
  exit 2
fi
echo "$settings" >"$out/SETTINGS"
rm -f "$out/DONE"
for seed in $seeds; do
  for config in "$config_a" "$config_b"; do
    name=$(basename "${config%.toml}")
    run_dir="$out/$name/seed$seed"
    if (( stopped )); then
      echo "parity.sh: stopped by USR1 before $name seed $seed; run the same command again to resume" >&2
      exit 0
    fi
    if [[ -e $run_dir/DONE ]]; then
      echo "parity.sh: $run_dir is DONE; not run again"
      continue
    fi
    launcher=("$python" -m torch.distributed.run --standalone --nproc_per_node="$nproc")
    [[ $nproc != 1 ]] || launcher=("$python")  # one process needs no torchrun
    cmd=("${launcher[@]}" "$train_script" --config "$config" --job.output_dir "$run_dir" --job.seed "$seed"
         "${overrides[@]}")
    echo "parity.sh: ${cmd[*]}"
    run_launcher "${cmd[@]}"
    if (( stopped )); then
      echo "parity.sh: stopped by USR1 during $name seed $seed; run the same command again to resume" >&2
      exit 0
    fi
  done
done

"$python" "$repo/scripts/compare_runs.py" "$out/$name_a" "$out/$name_b" --out "$out" --baseline "$out/$name_a" \
  "${compare_args[@]}" | tee "$out/compare.log"
tail -n 1 "$out/compare.log" >"$out/DONE"  # the verdict; DONE tells a requeued job that all is done
