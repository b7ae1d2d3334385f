#!/usr/bin/env bash
# Multi-host training launcher (one call per node), like DFLOP's launchers:
#   scripts/run_training.sh <num_nodes> <rank> <coordinator host:port> [train args...]
# e.g. on node 0:  scripts/run_training.sh 2 0 10.0.0.1:7777 --config configs/x.yaml steps=100
#      on node 1:  scripts/run_training.sh 2 1 10.0.0.1:7777 --config configs/x.yaml steps=100
# Every process runs the same driver loop; the job fails (within distributed.timeout_s) if a peer
# never arrives. Processes ignore SIGTERM after joining: wrap in `timeout -k` when scripting.
# Ports: the coordinator's and the watchdog hub's on the coordinator host (distributed.watchdog_port,
# default coordinator + 1); open both between hosts.
# A lost process stops every other one within seconds with exit status 3 and a line naming it.
set -euo pipefail
if [ "$#" -lt 3 ]; then
  echo "usage: $0 <num_nodes> <rank> <coordinator host:port> [train args...]" >&2
  exit 2
fi
export DFLOP_NUM_PROCESSES="$1" DFLOP_PROCESS_ID="$2" DFLOP_COORDINATOR="$3"
shift 3
PYTHON="${PYTHON:-python}"
exec "$PYTHON" -m dflop_jax.train "$@"
