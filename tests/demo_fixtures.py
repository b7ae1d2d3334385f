"""The demo (configs/demo.yaml) at the least it allows, for the tests that train it with `plan: auto`
where neither the profile grid nor the search is the subject: one tp, one profiled bucket per part,
a few samples (of the demo's sizes: shorter ones would skip most records), one planner sample, one
bucket per ladder (a run compiles its stages once: most of its time), no checkpoints.

Every such test passes the same list (plus its own keys after it), so their programs are the same
where their layouts are, and the run's one compilation cache (tests/conftest.py) compiles each once:
`compilation_cache=` leaves the cache to the JAX_COMPILATION_CACHE_DIR the run set (in-process and in
the jax processes a test starts). The cache finds a program only in a process with the same number
of (simulated) devices: on CPU its key holds the client's whole topology (docs/design.md)."""

import subprocess
import sys
from pathlib import Path

import pytest
from multiprocess_launch import own_devices_env

REPO = Path(__file__).resolve().parents[1]

SMALL_DEMO = [
    "data.synth_samples=48",
    "data.cache_dir=",
    "global_batch=4",
    "profile.tps=[1]",
    "profile.encoder_buckets=[4]",
    "profile.llm_buckets=[512]",
    "profile.warmup=0",
    "profile.runs=1",
    "planner.tp=[1]",
    "planner.microbatches=[2]",
    "planner.samples=1",
    "planner.num_buckets=[1]",
    "planner.screen_top=2",
    "planner.top_n=1",
    "checkpoint.every=0",
    "compilation_cache=",
]

# The one trained demo run of a test session (`demo_run`): the README's demo command on the demo's
# own 8 devices, at `SMALL_DEMO` with more steps, a larger learning rate and every step timed. Tests
# that only inspect a trained demo's outputs read it instead of training their own.
DEMO_RUN = ["num_cpu_devices=8", "steps=6", "optimizer.lr=0.01", "measure_stage_times_every=1",
            "device.peak_flops=1000000000.0", *SMALL_DEMO]  # fmt: skip


def train_demo_once(root: Path, timeout_s: int = 1800) -> Path:
    """The run directory of the demo trained with `DEMO_RUN` under `root`, trained by the first
    caller: the others (other xdist workers share `root`) wait on a file lock and read it. A failed
    run fails every caller with its output, without training again."""
    from filelock import FileLock

    root.mkdir(parents=True, exist_ok=True)
    run_dir, failed = root / "run", root / "failed.txt"
    with FileLock(str(root / "lock"), timeout=timeout_s + 60):
        if not (run_dir / "metrics.jsonl").is_file() and not failed.is_file():
            argv = [sys.executable, "-m", "dflop_jax.train", f"run_dir={run_dir}",
                    f"data.synth_dir={root / 'synth'}", *DEMO_RUN]  # fmt: skip
            out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                                 env=own_devices_env(), timeout=timeout_s)  # fmt: skip
            if out.returncode != 0:
                failed.write_text(
                    f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
                )
    if failed.is_file():
        pytest.fail(f"the shared demo run failed: {failed.read_text()}")
    return run_dir
