#!/usr/bin/env bash
# DFLOP step 2 (data-aware 3D-parallelism optimizer): <run_dir>/plan.yaml from the profiles of step 1
# (<run_dir>/auto_plan; a missing one is named in one line and the data's shapes / analytic costs
# stand in).
#   scripts/run_data_aware_optimization.sh <run config.yaml> [key=value ...]
# e.g. scripts/run_data_aware_optimization.sh configs/auto_plan_tiny_cpu.yaml num_devices=64 \
#        device=h100 run_dir=/nfs/runs/tiny
# Runs on one host (pure planning; no accelerators needed). Step 3: scripts/run_training.sh with
# `plan=<run_dir>/plan.yaml`.
set -euo pipefail
if [ "$#" -lt 1 ]; then
  echo "usage: $0 <run config.yaml> [key=value ...]" >&2
  exit 2
fi
config="$1"
shift
PYTHON="${PYTHON:-python}"
exec "$PYTHON" -m dflop_jax.plan --config "$config" --no-progress "$@"
