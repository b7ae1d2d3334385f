"""Checkpoints across processes, process counts and layouts (2 jax processes x 4 CPU devices, tiny
decoder, float32). A stage spanning both processes checkpoints at step 2; after the run is gone, a new
launch resumes and continues exactly like the straight run. The 2-process checkpoint resumes in one
process (8 devices) on another layout, and a 1-process checkpoint in 2 processes on another layout.

Layouts: A (in `_args`) is two LLM stages (dp 2 x tp 2), one per process; SPAN is one stage whose
tensor-parallel groups sit on both processes (dp 4 x tp 2).
"""

import json
import shutil

import numpy as np
import pytest
from test_runtime_multiprocess import REPO, _args, _launch

from dflop_jax.config import load_config
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
        TrainConfig, REPO / "configs" / "demo.yaml", _args(tmp_path, run_dir) + [*extra]
    )
    return run(cfg)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_spanning_stage_resumes_identically_and_in_one_process_on_another_layout(tmp_path):
    run_dir = tmp_path / "span"
    _launch(tmp_path, run_dir, 4, SPAN + DETERMINISTIC)
    checkpoints = run_dir / "checkpoints"
    # The spanning stage's state in the {0, 1} group; each process's singleton group holds its meta.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["procs_0", "procs_0-1", "procs_1"]
    straight = _losses(run_dir)
    assert sorted(straight) == [1, 2, 3, 4]

    other = tmp_path / "one"
    shutil.copytree(checkpoints, other / "checkpoints")
    _keep_until(checkpoints, 2)
    outs = _launch(tmp_path, run_dir, 4, SPAN + DETERMINISTIC)
    assert "resumed from step 2" in outs[0]
    resumed = _losses(run_dir)
    np.testing.assert_allclose([resumed[3], resumed[4]], [straight[3], straight[4]], rtol=1e-6)

    # The same step-2 checkpoint in ONE process on layout A (two stages instead of one).
    _keep_until(other / "checkpoints", 2)
    single = _single(tmp_path, other, DETERMINISTIC)
    assert single.first_step == 2
    np.testing.assert_allclose(single.losses, [straight[3], straight[4]], rtol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_one_process_checkpoint_resumes_in_two_processes_on_another_layout(tmp_path):
    straight = _single(tmp_path, tmp_path / "sp", DETERMINISTIC)  # layout A, checkpoints at 2, 4
    run_dir = tmp_path / "two"
    shutil.copytree(tmp_path / "sp" / "checkpoints", run_dir / "checkpoints")
    _keep_until(run_dir / "checkpoints", 2)
    outs = _launch(tmp_path, run_dir, 4, SPAN + DETERMINISTIC)
    assert "resumed from step 2" in outs[0]
    resumed = _losses(run_dir)
    assert sorted(resumed) == [3, 4]
    np.testing.assert_allclose([resumed[3], resumed[4]], straight.losses[2:], rtol=1e-5)
