"""The drifting-mix re-plan (`tests/runtime/test_runtime_drift.py`; the mix: tests/drift_fixtures.py)
in 2 jax processes x 2 CPU devices: the LLM stage spans both processes before the re-plan. Both
processes take the same decision at the same checkpoint (each measures on its own; the planner is
deterministic): both finish, and each process's checkpoint after the re-plan records the new layout.
The one run of the drifting mix: its checks are those of a one-process run (the re-plan line, the
regrets under and over the threshold, the new layout) and the processes' agreement."""

import json

import pytest
from drift_fixtures import DRIFTING_MIX, check_drift_rows, check_replan_line, write_curriculum
from multiprocess_launch import finish, launch


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_drifting_mix_replans_once_on_every_process_alike(tmp_path):
    run_dir = tmp_path / "run"
    args = [*DRIFTING_MIX, "num_cpu_devices=2", f"data.source={write_curriculum(tmp_path)}",
            f"run_dir={run_dir}", "compilation_cache=", "data.cache_dir=",
            "distributed.timeout_s=120"]  # fmt: skip
    outs = finish(launch(tmp_path, 2, args, limit_s=900), limit_s=920)
    new_layout = check_replan_line(outs[0])
    assert "encoder[0..1 dp2" in new_layout
    check_drift_rows(run_dir)
    for process in (0, 1):
        meta = run_dir / "checkpoints" / f"procs_{process}" / "6" / "meta" / "meta.json"
        text = json.dumps(json.loads(meta.read_text()))
        assert '"module": "encoder", "first_layer": 0, "num_layers": 2, "tp": 1, "dp": 2' in text, (
            text
        )
