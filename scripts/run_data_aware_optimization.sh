#!/usr/bin/env bash
# DFLOP step 2 (data-aware 3D-parallelism optimizer): plan.yaml from the profiles of step 1.
#   scripts/run_data_aware_optimization.sh <auto-plan config.yaml> [key=value ...]
# e.g. scripts/run_data_aware_optimization.sh configs/auto_plan_tiny_cpu.yaml auto.num_devices=64 \
#        auto.device=h100 cache_dir=/nfs/profiles/tiny
# Runs on one host (pure planning; no accelerators needed once the profiles exist — missing or stale
# profiles are redone first). Step 3: scripts/run_training.sh with `plan: <cache_dir>/plan.yaml`.
set -euo pipefail
if [ "$#" -lt 1 ]; then
  echo "usage: $0 <auto-plan config.yaml> [key=value ...]" >&2
  exit 2
fi
config="$1"
shift
PYTHON="${PYTHON:-python}"
exec "$PYTHON" -m dflop_jax.profile auto --config "$config" "$@"
