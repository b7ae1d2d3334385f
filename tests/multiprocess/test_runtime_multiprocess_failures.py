"""Failure is loud and bounded: a process killed (SIGKILL) or frozen (SIGSTOP) mid-run, or one that
never starts, makes the other exit with the watchdog's status within 60 s, with one line naming the
lost process and the step; nothing of the surviving rank is left running."""

import os
import signal
import time

import pytest
from multiprocess_launch import decoder_args, group_gone, launch, stop, tail, wait_for_rows

from dflop_jax.programs.watchdog import EXIT_CODE


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "sig, victim, expect",
    [
        (signal.SIGKILL, 1, "lost process 1 (its connection closed"),
        (signal.SIGKILL, 0, "lost process 0 (its connection closed"),
        (signal.SIGSTOP, 1, "lost process 1 (silent for"),
    ],
    ids=["kill-peer", "kill-coordinator", "freeze-peer"],
)
def test_a_lost_process_stops_the_other_within_60s(tmp_path, sig, victim, expect):
    run_dir = tmp_path / "run"
    args = decoder_args(tmp_path, run_dir) + ["steps=100000", "distributed.heartbeat_timeout_s=10"]
    procs = launch(tmp_path, 2, args)
    try:
        wait_for_rows(run_dir / "metrics.jsonl", 2, timeout_s=300, procs=procs)
        survivor, log = procs[1 - victim]
        os.killpg(procs[victim][0].pid, sig)
        t0 = time.monotonic()
        rc = survivor.wait(timeout=90)
        elapsed = time.monotonic() - t0
    finally:
        stop(procs)
    assert rc == EXIT_CODE, tail(log)
    assert elapsed < 60, f"took {elapsed:.0f}s"
    last = log.read_text().strip().splitlines()[-1]
    assert last.startswith(f"process {1 - victim}/2: {expect}"), tail(log)
    assert "this process was at step " in last
    resume = (
        f"python -m dflop_jax.train --config {run_dir / 'config.yaml'} distributed.num_processes=1"
    )
    assert resume in last  # how the process that remains resumes the run
    assert group_gone(survivor.pid)  # no orphan (grain workers, helpers) of the surviving rank


@pytest.mark.multiprocess
@pytest.mark.parametrize("rank, expect", [(0, "process 1 never joined the job within 3s"),
                                          (1, "process 0 (the coordinator) did not answer")])  # fmt: skip
def test_a_peer_that_never_starts_is_named(tmp_path, rank, expect):
    args = decoder_args(tmp_path, tmp_path / "lonely") + ["steps=2", "distributed.timeout_s=3"]
    t0 = time.monotonic()
    proc, log = launch(tmp_path, 2, args, ranks=[rank])[rank]
    assert proc.wait(timeout=120) == EXIT_CODE, tail(log)
    assert time.monotonic() - t0 < 60
    assert expect in log.read_text(), tail(log)
