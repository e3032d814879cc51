#!/usr/bin/env bash
# Run GPU suites on a machine that has torch/transformers/onnx but no pip access (the lent GPU
# machine): uses the repo in place (no install), writes each result bundle as a tarball under
# $OUT (or ./device-out), without MLflow; import them later with `bertqa-bench track DIR`.
#   scripts/device_bench.sh SUITE[:ARGS...] ...
# e.g. scripts/device_bench.sh gpu-parity "gpu-timing:--backends eager-fp32-cuda,eager-fp16"
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-device-out}
mkdir -p "$out"
export PYTHONPATH="/root/device-site:$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
python3 -m bertqa_bench.cli backends 2>&1 | tee "$out/backends.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
status=0
for spec in "$@"; do
  suite=${spec%%:*}; extra=""; [[ "$spec" == *:* ]] && extra=${spec#*:}
  run_id="device-$(date -u +%Y%m%d-%H%M%S)-$suite"
  # shellcheck disable=SC2086
  python3 -m bertqa_bench.cli bench --suite "$suite" --no-mlflow --no-progress --run-id "$run_id" $extra \
    2>&1 | tee "$out/$suite.log" || status=1
  tar czf "$out/$run_id.tgz" -C results "$run_id" 2>/dev/null || true
done
tar czf "$out/train-metrics.tgz" models/*/train_metrics.json 2>/dev/null || true
exit $status
