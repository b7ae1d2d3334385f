#!/usr/bin/env bash
# The project's one GPU run: every figure only a GPU can give, under one deadline, into at most 8 small
# files under $OUT (only those come back from the GPU machine). From the repository root:
#
#   source .gpu/device_env.sh && bash scripts/gpu_check.sh      # on the GPU machine (env.log: device_env)
#   GPU_CHECK_DRY=1 bash scripts/gpu_check.sh   (or --dry)       # on CPU, one device: tiny sizes (CI)
#
# Steps, most valuable first; each has its own timeout (max), cut to what is left of the deadline, and a
# step whose minimum (min) no longer fits is skipped and says so. A failing step records its rc and
# output tail and the next one runs. `bench gpu` runs one part per process (a part that times out
# loses only itself); [seconds min/max on the GPU]:
#   preflight       versions, nvidia-smi, every entry point's --help, one bf16 matmul  [20/60]
#   llm_attention   the LLM stage (4 Qwen2.5-7B layers, 8192 tokens) per attention kernel: xla,
#                   cudnn, pallas, and the one `auto` picks (`bench gpu parts=stage stages=llm`) [45/120]
#   vision_ops      the SigLIP tower (16 tiles x 729 tokens) timed and traced: its 20 most
#                   expensive ops by time and share (`bench gpu parts=ops`)  [30/75]
#   model           configs/llava_ov_7b_1gpu.yaml trained 30 steps, plan: auto (`bench gpu
#                   parts=model`): tokens/s, MFU, host share, data wait, compilations after step 1,
#                   memory predicted / compiled / measured, stage-time MAPE raw and corrected [120/240]
#   model_blind     the same on the data-blind plan and scheduler: tokens/s, DFLOP over it  [60/120]
#   host            host dispatch vs step time of a pipelined decoder (`bench gpu parts=host`) [30/60]
#   pytest_gpu      the gpu-marked tests  [30/120]
#   demo            the demo on one device (plan: auto, the encoder colocated)  [60/240]
#   bench_stage, bench_attention, bench_profiler  the other `bench gpu` parts  [45/180,150,150]
#   bench_colocated `bench colocated`  [30/90]
# Files under $OUT (each cut to its last 200 kB; env.log, written by device_env.sh, is the 7th):
#   summary.json    per step: status (ok / failed / timeout / skipped), rc, seconds, timeout; the
#                   preflight; headline figures of each measuring step (llm_attention, vision_ops,
#                   model, model_blind, host, demo), read from what the steps left (a step cut short
#                   keeps what it wrote: the model's figures then come from its metrics.jsonl)
#   check.log       per step: the command, rc, seconds and the last lines of its output
#   bench.json      every `bench gpu` part's report by step, `bench colocated`'s, the demo's
#                   per-step metrics, plan and profile timings
#   vision_ops.md   the vision tower's per-op table (vision_ops)
#   pytest_gpu.log  the gpu-marked tests;  console.log  the demo's and the parts' console output
# Environment: PY (python, default python3), OUT (default /tmp/gpu_out), GPU_CHECK_DEADLINE (seconds,
# default 540; 900 dry), GPU_CHECK_WORK (big files: run dirs, traces, full logs; default a fresh temp
# folder). On the GPU, XLA_PYTHON_CLIENT_MEM_FRACTION defaults to 0.95 (JAX's own default, 0.75, is
# less than the one-GPU config plans for).
set -uo pipefail

DRY=${GPU_CHECK_DRY:-0}
[[ "${1:-}" == "--dry" ]] && DRY=1
PY=${PY:-python3}
OUT=${OUT:-/tmp/gpu_out}
WORK=${GPU_CHECK_WORK:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
export GPU_CHECK_DRY=$DRY GPU_CHECK_WORK=$WORK PY OUT
if [[ "$DRY" == 1 ]]; then
  DEADLINE=${GPU_CHECK_DEADLINE:-900}
  # JAX on CPU with one device, as the GPU machine has one GPU (the parts then take its paths); a
  # count already in XLA_FLAGS (a test process's 8) is replaced.
  flags=$(sed -E 's/--xla_force_host_platform_device_count=[0-9]+//g' <<<"${XLA_FLAGS:-}")
  export JAX_PLATFORMS=cpu XLA_FLAGS="$flags --xla_force_host_platform_device_count=1"
else
  DEADLINE=${GPU_CHECK_DEADLINE:-540}
  export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
fi
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT" "$WORK"
END=$((SECONDS + DEADLINE))
LOG=$OUT/check.log
RESULTS=$WORK/steps.jsonl
MAX_BYTES=200000 # each file under $OUT is cut to its last this many bytes

# step NAME MIN_S MAX_S CMD...: runs CMD (output -> $WORK/NAME.out) under min(MAX_S, time left);
# skipped when less than MIN_S is left. Records one line of $RESULTS and a block of check.log.
step() {
  local name=$1 min=$2 max=$3 left status rc t0 secs limit
  shift 3
  left=$((END - SECONDS))
  if ((left < min)); then
    echo "== $name: skipped: needs >= ${min}s, ${left}s of the deadline left" >>"$LOG"
    echo "{\"step\": \"$name\", \"status\": \"skipped\", \"reason\": \"deadline: needs >= ${min}s, ${left}s left\"}" >>"$RESULTS"
    return 0
  fi
  [[ "$DRY" == 1 ]] && max=$left # dry: the deadline alone (a loaded CPU is no measure of a GPU)
  limit=$((left < max ? left : max))
  echo "== $name (timeout ${limit}s): $*" >>"$LOG"
  t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$WORK/$name.out" 2>&1
  rc=$?
  secs=$((SECONDS - t0))
  case $rc in
    0) status=ok ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
  esac
  tail -n 40 "$WORK/$name.out" | cut -c1-400 >>"$LOG"
  echo "-- $name: $status rc=$rc ${secs}s" >>"$LOG"
  echo "{\"step\": \"$name\", \"status\": \"$status\", \"rc\": $rc, \"seconds\": $secs, \"timeout_s\": $limit}" >>"$RESULTS"
}

# Copies a work file into $OUT, keeping its last MAX_BYTES.
keep() { [[ -s "$1" ]] && tail -c "$MAX_BYTES" "$1" >"$OUT/$2"; }

# The summary is rewritten after every step, so a run cut short still brings back what it measured.
summarize() { $PY scripts/gpu_check.py summary --work "$WORK" --out "$OUT" --dry "$DRY" >>"$LOG" 2>&1; }

if [[ "$DRY" == 1 ]]; then
  MATMUL=256 PYTEST_T=120 DEMO_T=300 BENCH_SIZE=smoke BENCH_RUNS="warmup=0 runs=1" STAGE_ARGS=""
  LLM_ARGS="stages=llm residuals=all remat=none" OPS_RUNS="warmup=0 runs=2"
  COLOCATED_ARGS="rounds=1 runs=1"
  DEMO_ARGS=(steps=3 "profile.encoder_buckets=[1]" "profile.llm_buckets=[256]" data.max_tokens=256
    data.max_grid=1 data.max_frames=2 data.synth_samples=64 profile.warmup=0 profile.runs=1
    planner.samples=1 planner.screen_top=2 planner.top_n=1 "planner.microbatches=[2]")
else
  MATMUL=8192 PYTEST_T=120 DEMO_T=240 BENCH_SIZE=real BENCH_RUNS="warmup=2 runs=5"
  # The LLM stage per kernel at median of 3 (XLA's row is the reference the GPU kernels beat).
  LLM_ARGS="stages=llm attention=xla,cudnn,pallas residuals=all remat=none warmup=1 runs=3"
  OPS_RUNS="warmup=1 runs=3"
  # The rest of the stage part: the GPU kernels, two residual and two remat policies, median of 3.
  STAGE_ARGS="attention=cudnn,pallas residuals=all,recompute remat=none,full warmup=1 runs=3"
  COLOCATED_ARGS="rounds=3 runs=5"
  DEMO_ARGS=(steps=24)
fi
# The demo on one device: one encoder + LLM stage, colocated (what exists today); the bare demo is
# tried when these keys are refused (exit 2, a config error), for a config where they changed.
ONE_DEVICE=("planner.encoder_pp=[1]" "planner.llm_pp=[1]" "planner.tp=[1]" "profile.tps=[1]"
  planner.colocate=true num_cpu_devices=1)
DEMO_COMMON=("run_dir=$WORK/demo" "data.synth_dir=$WORK/synth_demo" checkpoint.every=0
  "compilation_cache=$WORK/jax_cache" "${DEMO_ARGS[@]}")

demo() { # MFU against the preflight's peak (the GPU's preset); 0 = the detected device's preset
  local peak
  peak=$($PY -c "import json, sys; print(json.load(open(sys.argv[1]))['peak']['peak_flops'])" \
    "$WORK/preflight.json" 2>/dev/null) || peak=0
  DEMO_COMMON+=("device.peak_flops=$peak")
  $PY -m dflop_jax.train "${DEMO_COMMON[@]}" "${ONE_DEVICE[@]}"
  local rc=$?
  if ((rc == 2)); then
    echo "gpu_check: the one-device overrides were refused (rc 2); the demo as configured:"
    $PY -m dflop_jax.train "${DEMO_COMMON[@]}"
    rc=$?
  fi
  return $rc
}

# bench NAME PART [ARGS...]: one `bench gpu` part in its own process, its JSON bench_gpu_NAME.json
# (later words win: a step's warmup / runs replace BENCH_RUNS). The parts share one folder: the
# model_blind part reads the model part's run there.
bench() {
  local name=$1 part=$2
  shift 2
  $PY -m dflop_jax.bench gpu "parts=$part" "size=$BENCH_SIZE" $BENCH_RUNS "$@" "out=$WORK/bench_runs" \
    "json_out=$WORK/bench_gpu_$name.json"
}

# `timeout` runs programs, not shell functions: a step that is a function below re-invokes this script.
if [[ "${1:-}" == __call ]]; then
  shift
  "$@"
  exit $?
fi
: >"$RESULTS"
echo "gpu_check: dry=$DRY deadline=${DEADLINE}s work=$WORK python=$PY $(date -u +%FT%TZ)" >"$LOG"

# Files that come back as the steps finish (summarize rewrites summary.json, bench.json and
# vision_ops.md from what the steps left).
CONSOLE_STEPS="llm_attention vision_ops model model_blind host demo bench_stage bench_attention
  bench_profiler bench_colocated"
console() { # each step's console, its last 200 lines (the loader's per-sample warnings left out)
  for name in $CONSOLE_STEPS; do
    [[ -s "$WORK/$name.out" ]] || continue
    echo "==== $name"
    grep -v "skipping sample" "$WORK/$name.out" | tail -n 200
  done >"$WORK/console.all" 2>/dev/null
  keep "$WORK/console.all" console.log
}
after() { console; summarize; }

step preflight 20 60 $PY scripts/gpu_check.py preflight --out "$WORK/preflight.json" --matmul $MATMUL
summarize
# (a)-(d): the figures only a GPU gives that no run has measured yet, most valuable first.
step llm_attention 45 120 bash "$0" __call bench llm_attention stage $LLM_ARGS
after
step vision_ops 30 75 bash "$0" __call bench vision_ops ops $OPS_RUNS
after
step model 120 240 bash "$0" __call bench model model
after
step model_blind 60 120 bash "$0" __call bench model_blind model_blind
after
step host 30 60 bash "$0" __call bench host host
after
# Then the earlier checks. Only the files holding gpu-marked tests: collecting the whole suite costs
# more than it checks.
GPU_TESTS=$(grep -rl --include="test_*.py" "pytest.mark.gpu" tests | tr '\n' ' ')
step pytest_gpu 30 $PYTEST_T $PY -m pytest -q -p no:cacheprovider -p no:xdist -m gpu -rA $GPU_TESTS
keep "$WORK/pytest_gpu.out" pytest_gpu.log
summarize
step demo 60 $DEMO_T bash "$0" __call demo
after
for part_s in stage:180 attention:150 profiler:150; do
  part=${part_s%%:*}
  extra=""
  [[ "$part" == stage ]] && extra=$STAGE_ARGS
  step "bench_$part" 45 "${part_s##*:}" bash "$0" __call bench "$part" "$part" $extra
  after
done
step bench_colocated 30 90 $PY -m dflop_jax.bench colocated $COLOCATED_ARGS "json_out=$WORK/bench_colocated.json"
after
echo "gpu_check: done in $((SECONDS - END + DEADLINE))s; files: $(ls "$OUT" | tr '\n' ' ')" >>"$LOG"
tail -c "$MAX_BYTES" "$LOG" >"$LOG.tmp" && mv "$LOG.tmp" "$LOG"
tail -n 3 "$LOG"
