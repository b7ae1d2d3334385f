#!/usr/bin/env bash
# DFLOP step 1 (profiling engine): data profile (shape distribution) + model profile (cost table, PNG),
# into <run_dir>/auto_plan.
#   scripts/run_profiling_engine.sh <run config.yaml> [key=value ...]
# e.g. scripts/run_profiling_engine.sh configs/auto_plan_tiny_cpu.yaml run_dir=/nfs/runs/tiny
# Multi-host: run it on ONE host of the kind you train on (a stage's tp stays within a host, so a host's
# devices are what the tables need), with run_dir on storage every host can read. Re-running reuses
# fresh outputs (same config and code) and resumes an interrupted model profile entry by entry.
set -euo pipefail
if [ "$#" -lt 1 ]; then
  echo "usage: $0 <run config.yaml> [key=value ...]" >&2
  exit 2
fi
config="$1"
shift
PYTHON="${PYTHON:-python}"
exec "$PYTHON" -m dflop_jax.profile auto --config "$config" --profile-only "$@"
