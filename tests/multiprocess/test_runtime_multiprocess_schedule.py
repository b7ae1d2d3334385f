"""One schedule per global batch across processes: two jax processes (one LLM stage each) train with
measured steps, adaptive correction on and the CP-SAT solver, and agree on every schedule-derived
figure (the corrected predictions depend on every observed stage time, bit for bit); losses equal a
single-process run. Processes whose configs schedule differently stop at step 1 with one clear line.
The owner rule of the shared stage times is checked in-process."""

import time

import numpy as np
import pytest
from multiprocess_launch import REPO, decoder_args, launch, rows, tail

from dflop_jax.config import load_config
from dflop_jax.programs.watchdog import EXIT_CODE
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.runtime.schedule_agreement import _owners_columns
from dflop_jax.train import run

# Figures every process computes from the schedule and the shared observations.
AGREED = ("microbatches", "predicted_step_time_s", "pred_raw_mape", "pred_corrected_mape",
          "correction_observations", "correction_active", "scheduler_solver", "loss")  # fmt: skip
# Even steps measured (step 1 compiles: its times would be left out anyway). Batch k sees the
# observations of steps <= k - 2 (prefetch 2): step 7's batch is the first to see step 4's.
CORRECTION = ["scheduler.solver=cpsat", "scheduler.correction=on", "measure_stage_times_every=2"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_correct_and_schedule_alike(tmp_path):
    run_dir = tmp_path / "mp"
    args = decoder_args(tmp_path, run_dir) + CORRECTION + ["steps=7"]
    procs = launch(tmp_path, 2, args)
    for rank, (proc, log) in procs.items():
        assert proc.wait(timeout=450) == 0, f"process {rank} failed:\n{tail(log)}"
    p0, p1 = rows(run_dir / "metrics.jsonl"), rows(run_dir / "metrics.process1.jsonl")
    assert [r["step"] for r in p0] == [r["step"] for r in p1] == [1, 2, 3, 4, 5, 6, 7]
    for a, b in zip(p0, p1):
        assert {k: a[k] for k in AGREED} == {k: b[k] for k in AGREED}
    # Correction ran: a measured step times one sampled microbatch; steps 2 and 4 reached step 7.
    assert [r["stage_times_measured"] for r in p0] == [False, True] * 3 + [False]
    assert p0[-1]["correction_observations"] == 2

    cfg = load_config(TrainConfig, REPO / "configs" / "demo.yaml",
                      decoder_args(tmp_path, tmp_path / "sp") + CORRECTION + ["steps=7"])  # fmt: skip
    single = run(cfg)
    np.testing.assert_allclose([r["loss"] for r in p0], single.losses, rtol=1e-5)


@pytest.mark.multiprocess
def test_processes_that_schedule_differently_stop_at_step_1(tmp_path):
    # A config that differs between processes (the microbatch count) gives different schedules.
    args = decoder_args(tmp_path, tmp_path / "mm") + ["steps=3", "scheduler.solver=greedy"]
    per_rank = {0: ["layout.microbatches=[2, 2]"], 1: ["layout.microbatches=[3, 3]"]}
    t0 = time.monotonic()
    procs = launch(tmp_path, 2, args, per_rank)
    for rank, (proc, log) in procs.items():
        assert proc.wait(timeout=300) == EXIT_CODE, f"process {rank}:\n{tail(log)}"
        text = log.read_text()
        assert "step 1: the processes scheduled the global batch differently" in text, tail(log)
        assert "process 0: " in text and "process 1: " in text
        assert "Traceback" not in text  # one line, not a traceback
    assert time.monotonic() - t0 < 240


def test_each_stage_time_comes_from_the_process_owning_it():
    m, p = 3, 2
    # process q reports q + 1 everywhere; process 1 saw a compile in microbatch 2
    every = np.stack([np.concatenate([np.full(m * p * 2, q + 1.0), [1, 1, float(q != 1)]])
                      for q in range(3)])  # fmt: skip
    times, valid = _owners_columns(every, m, p, owners=[2, 0])
    np.testing.assert_array_equal(times[:, 0], np.full((m, 2), 3.0))  # stage 0 from process 2
    np.testing.assert_array_equal(times[:, 1], np.full((m, 2), 1.0))  # stage 1 from process 0
    np.testing.assert_array_equal(valid, [True, True, False])
