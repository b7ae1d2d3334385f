"""Checkpoints across processes, process counts and layouts (2 jax processes x 4 CPU devices,
tiny decoder, float32). A stage spanning both processes checkpoints at step 2; both processes are
killed (SIGKILL), a new launch resumes and continues exactly like the straight run. The 2-process
checkpoint resumes in one process (8 devices) on another layout, and a 1-process checkpoint in 2
processes on another layout. `Checkpointer` alone (tests/checkpoint_worker.py) covers several stages
on one process.

Layouts: A (`multiprocess_launch.checkpointed_decoder_args`) is two LLM stages (dp 2 x tp 2), one
per process; SPAN is one stage whose tensor-parallel groups sit on both processes (dp 4 x tp 2).
"""

import json
import os
import shutil
import signal
import time

import checkpoint_worker
import numpy as np
import pytest
from multiprocess_launch import (
    REPO,
    checkpoint_workers,
    checkpointed_decoder_args,
    launch,
    run_checkpointed_decoder,
)

from dflop_jax.config import load_config
from dflop_jax.runtime.checkpoint import Checkpointer
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.train import run

SPAN = ["layout.llm_layers=[2]", "layout.llm_dp=4"]
DETERMINISTIC = ["measure_stage_times_every=0"]  # schedules from predictions only, same every run


def _keep_until(checkpoints, step):
    """Deletes every group's steps after `step`: the state of a run killed right after that save."""
    for group in checkpoints.iterdir():
        for saved in group.iterdir():
            if saved.name.isdigit() and int(saved.name) > step:
                shutil.rmtree(saved)


def _losses(run_dir) -> dict[int, float]:
    """Loss per step from metrics.jsonl (a resumed run's rows replace the earlier ones)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _single(tmp_path, run_dir, extra=()):
    """The run in this pytest process: one process, 8 devices."""
    cfg = load_config(
        TrainConfig,
        REPO / "configs" / "demo.yaml",
        checkpointed_decoder_args(tmp_path, run_dir) + [*extra],
    )
    return run(cfg)


def _kill_after_first_checkpoint(procs, checkpoints, timeout_s=400.0):
    """SIGKILLs both process groups as soon as a complete checkpoint exists; returns its step."""
    deadline = time.monotonic() + timeout_s
    while (step := Checkpointer(checkpoints).latest_step()) is None:
        assert all(p.poll() is None for p in procs), "a process exited before any checkpoint"
        assert time.monotonic() < deadline, "no complete checkpoint within the time limit"
        time.sleep(0.05)
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    return step


@pytest.mark.multiprocess
@pytest.mark.slow
def test_spanning_stage_resumes_identically_and_in_one_process_on_another_layout(tmp_path):
    straight_dir = tmp_path / "straight"
    run_checkpointed_decoder(tmp_path, straight_dir, 6, SPAN + DETERMINISTIC)
    checkpoints = straight_dir / "checkpoints"
    # The spanning stage's state in the {0, 1} group; each process's singleton group holds its meta.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["procs_0", "procs_0-1", "procs_1"]
    for group in checkpoints.iterdir():  # saved at 2, 4, 6; the last checkpoint.keep=2 kept
        assert sorted(p.name for p in group.iterdir()) == ["4", "6"]
    straight = _losses(straight_dir)
    assert sorted(straight) == [1, 2, 3, 4, 5, 6]

    # Checkpoint at step 2 (4 if the kill comes late), kill everything, resume in a new launch.
    run_dir = tmp_path / "killed"
    logs = tmp_path / "killed_logs"
    logs.mkdir()
    started = launch(
        logs, 2, checkpointed_decoder_args(tmp_path, run_dir) + ["steps=6", *SPAN, *DETERMINISTIC]
    )
    saved = _kill_after_first_checkpoint([p for p, _ in started.values()], run_dir / "checkpoints")
    assert saved in (2, 4)
    outs = run_checkpointed_decoder(tmp_path, run_dir, 6, SPAN + DETERMINISTIC)
    assert f"resumed from step {saved}" in outs[0]
    resumed = _losses(run_dir)
    after = range(saved + 1, 7)
    np.testing.assert_allclose([resumed[s] for s in after], [straight[s] for s in after], rtol=1e-6)

    # The straight run's step-4 checkpoint in ONE process on layout A (two stages instead of one).
    other = tmp_path / "one"
    shutil.copytree(checkpoints, other / "checkpoints")
    _keep_until(other / "checkpoints", 4)
    single = _single(tmp_path, other, DETERMINISTIC + ["steps=6"])
    assert single.first_step == 4
    np.testing.assert_allclose(single.losses, [straight[5], straight[6]], rtol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_one_process_checkpoint_resumes_in_two_processes_on_another_layout(tmp_path):
    straight = _single(tmp_path, tmp_path / "sp", DETERMINISTIC)  # layout A, checkpoints at 2, 4
    run_dir = tmp_path / "two"
    shutil.copytree(tmp_path / "sp" / "checkpoints", run_dir / "checkpoints")
    _keep_until(run_dir / "checkpoints", 2)
    outs = run_checkpointed_decoder(tmp_path, run_dir, 4, SPAN + DETERMINISTIC)
    assert "resumed from step 2" in outs[0]
    resumed = _losses(run_dir)
    assert sorted(resumed) == [3, 4]
    np.testing.assert_allclose([resumed[3], resumed[4]], straight.losses[2:], rtol=1e-5)


@pytest.mark.multiprocess
def test_several_stages_per_process_restore_on_other_layouts_and_process_counts(tmp_path, capsys):
    """`Checkpointer` alone (no training; values a formula of the global path): 2 processes save
    two stages on process 0 and one on process 1; one process restores onto two uneven stages, and
    2 processes onto one stage spanning both, each checking the shards of its own devices."""
    directory = tmp_path / "ckpt"
    assert all("saved" in out for out in checkpoint_workers("save", "two_on_p0", str(directory)))
    assert sorted(p.name for p in directory.iterdir()) == ["procs_0", "procs_1"]

    checkpoint_worker.main("check", "uneven", str(directory))  # this process: 8 devices
    # stage 0: 3 layers x (params, opt) x 4 devices; stage 1: 1 x 2 x 2
    assert "checked 28 shards; meta {'process': 0}" in capsys.readouterr().out
    outs = checkpoint_workers("check", "one_wide", str(directory))
    for rank, out in enumerate(outs):  # 4 layers x 2 x 4 own devices; each process's own meta
        assert f"checked 32 shards; meta {{'process': {rank}}}" in out
