#!/usr/bin/env bash
# Run GPU suites on a machine that has torch/transformers/onnx but no pip access (the lent GPU
# machine): uses the repo in place (no install), writes each result bundle as a tarball under
# $OUT (or ./device-out), without MLflow; import them later with `bertqa-bench track DIR`.
#   scripts/device_bench.sh [parity/|profile/|loadgen/]SUITE[:ARGS...] ...
# e.g. scripts/device_bench.sh parity/gpu-parity "gpu-timing:--backends eager-fp32-cuda,eager-fp16"
# (parity/ runs `bertqa-bench parity`: the accuracy gate, with the determinism check and exit status;
# loadgen/ runs `bertqa-bench loadgen`, ARGS naming --scenario: after a bench in the same call it
# takes the model that bench trained, so one background job can train, bench and run LoadGen, as
# long as its ARGS repeat the bench's model and training overrides (e.g. --set train.seed=53):
# other ones are another recipe, which trains again into the same model folder)
# Each bundle is written twice: whole (<run>.tgz, with every row's logits) and without them
# (<run>-tables.tgz: no outputs/, no LoadGen accuracy log of every sample's logits), small enough
# for a device call to bring back.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-device-out}
mkdir -p "$out"
# DEVICE_SITE: where ../shared/device/pack-wheels unpacked the wheels that machine lacks
export PYTHONPATH="${DEVICE_SITE:-/root/device-site}:$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
python3 -m bertqa_bench.cli backends 2>&1 | tee "$out/backends.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
status=0
for spec in "$@"; do
  suite=${spec%%:*}; extra=""; [[ "$spec" == *:* ]] && extra=${spec#*:}
  cmd=bench
  if [[ "$suite" == parity/* ]]; then cmd=parity; suite=${suite#parity/}; fi
  if [[ "$suite" == loadgen/* ]]; then cmd=loadgen; suite=${suite#loadgen/}; fi
  if [[ "$suite" == profile/* ]]; then
    suite=${suite#profile/}
    # shellcheck disable=SC2086
    python3 -m bertqa_bench.cli profile --suite "$suite" $extra 2>&1 | tee -a "$out/profile-$suite.log" \
      | tail -40; [[ ${PIPESTATUS[0]} == 0 ]] || status=1
    tar czf "$out/profiles-$suite.tgz" -C results profiles 2>/dev/null
    continue
  fi
  before=$(ls results 2>/dev/null)
  run_id="device-$(date -u +%Y%m%d-%H%M%S)-$suite"
  idarg=(--run-id "$run_id"); [[ $cmd == parity ]] && idarg=()
  # shellcheck disable=SC2086
  python3 -m bertqa_bench.cli $cmd --suite "$suite" --no-mlflow --no-progress "${idarg[@]}" $extra \
    2>&1 | tee -a "$out/$cmd-$suite.log"; [[ ${PIPESTATUS[0]} == 0 ]] || status=1
  for d in $(comm -13 <(echo "$before" | sort) <(ls results | sort)); do
    if [[ -f results/$d/results.csv ]]; then
      tar czf "$out/$d.tgz" -C results "$d"
      tar czf "$out/$d-tables.tgz" --exclude="$d/outputs" --exclude=mlperf_log_accuracy.json -C results "$d"
    fi
  done
done
tar czf "$out/train-metrics.tgz" models/*/train_metrics.json 2>/dev/null || true
exit $status
