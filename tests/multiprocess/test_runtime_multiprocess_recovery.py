"""Recovery after a lost process: one of two jax processes is killed (SIGKILL) mid-run; the other
exits with the watchdog's status and a last line naming the command that resumes on the process that
remains; that command, with a layout that fits one process's 4 devices (one LLM stage instead of one
per process), resumes from the run's last complete checkpoint, and its per-step losses equal an
uninterrupted run's (the same samples form every global batch whatever the layout)."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from multiprocess_launch import REPO, decoder_args, env, launch, stop, tail

from dflop_jax.config import load_config
from dflop_jax.programs.watchdog import EXIT_CODE
from dflop_jax.runtime.checkpoint import Checkpointer
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.train import run

# Layout A (decoder_args): two LLM stages of dp 2 x tp 2, one per process. Schedules from predictions
# only (no measured times), so every run schedules alike.
ARGS = ["scheduler.solver=greedy", "steps=8", "checkpoint.every=2", "measure_stage_times_every=0"]
ONE_PROCESS = ["layout.llm_layers=[2]", "layout.llm_tp=[2]", "layout.llm_dp=2"]


def _losses(run_dir) -> dict[int, float]:
    """Loss per step from metrics.jsonl (a resumed run's rows replace the earlier ones)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _kill_after_a_checkpoint(procs, run_dir, victim: int, timeout_s: float = 400.0) -> None:
    """SIGKILLs process `victim` once a complete checkpoint exists (the run goes on to step 8)."""
    deadline = time.monotonic() + timeout_s
    while Checkpointer(run_dir / "checkpoints").latest_step() is None:
        assert all(p.poll() is None for p, _ in procs.values()), "a process exited early"
        assert time.monotonic() < deadline, "no complete checkpoint within the time limit"
        time.sleep(0.05)
    os.killpg(procs[victim][0].pid, signal.SIGKILL)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_run_that_lost_a_process_resumes_on_the_other_with_a_new_layout(tmp_path):
    run_dir = tmp_path / "run"
    args = decoder_args(tmp_path, run_dir) + ARGS + ["distributed.heartbeat_timeout_s=10"]
    procs = launch(tmp_path, 2, args)
    survivor, log = procs[0]
    try:
        _kill_after_a_checkpoint(procs, run_dir, victim=1)
        rc = survivor.wait(timeout=90)
    finally:
        stop(procs)
    assert rc == EXIT_CODE, tail(log)
    lines = log.read_text().strip().splitlines()
    last = next((line for line in reversed(lines) if "to resume on the" in line), lines[-1])
    m = re.search(r"to resume on the 1 process\(es\) that remain: (.*?) \(coordinator", last)
    assert m, tail(log)
    command = m[1]
    assert command == (
        f"python -m dflop_jax.train --config {run_dir / 'config.yaml'} distributed.num_processes=1"
    )
    saved = Checkpointer(run_dir / "checkpoints").latest_step()
    assert saved is not None and saved < 8

    # The printed command on the process that remains, with a layout that fits its 4 devices.
    argv = [sys.executable, *shlex.split(command)[1:], *ONE_PROCESS]
    resumed = subprocess.run(["timeout", "-k", "10", "400", *argv], env=env(), cwd=REPO,
                             capture_output=True, text=True, timeout=420)  # fmt: skip
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-3000:]
    assert f"resumed from step {saved}" in out, out[-3000:]
    assert "the checkpoint comes from another layout" in out  # one stage instead of two
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, 9))

    # The uninterrupted run: layout A in this process (8 devices), no checkpoints.
    cfg = load_config(TrainConfig, REPO / "configs" / "demo.yaml",
                      decoder_args(tmp_path, tmp_path / "straight") + ARGS + ["checkpoint.every=0"])  # fmt: skip
    straight = run(cfg).losses
    after = range(saved + 1, 9)
    np.testing.assert_allclose([losses[s] for s in after], straight[saved:], rtol=1e-5)
