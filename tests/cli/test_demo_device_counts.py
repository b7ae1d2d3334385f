"""The demo trains on the devices it finds: `python -m dflop_jax.train num_cpu_devices=N` on 1 (one
GPU's case: the encoder colocated, one stage) and 3 (an odd count) simulated CPU devices, and on its
own 8 (the session's shared demo run), profiles, plans a layout that fits N (the planner's search
space is fitted to the count) and finishes its steps. Sizes are cut to the least the demo config
allows (`SMALL_DEMO`). Plans fitted to other counts are the planner's tests
(`tests/planner/test_planner_space.py`)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from demo_fixtures import SMALL_DEMO
from multiprocess_launch import own_devices_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 3])
def test_the_demo_trains_on_any_device_count(devices, tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "dflop_jax.train", f"num_cpu_devices={devices}", "steps=3",
            f"run_dir={run_dir}", f"data.synth_dir={tmp_path / 'synth'}", *SMALL_DEMO]  # fmt: skip
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=own_devices_env(),
                         timeout=1800)  # fmt: skip
    assert out.returncode == 0, f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    _check_run(run_dir, devices, steps=3)


@pytest.mark.slow
def test_the_demo_trains_on_its_own_8_devices(demo_run):
    _check_run(demo_run, 8, steps=6)


def _check_run(run_dir, devices: int, steps: int) -> None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(losses) == list(range(1, steps + 1))  # metrics count steps from 1
    assert all(math.isfinite(v) for v in losses.values())

    plan = yaml.safe_load((run_dir / "auto_plan" / "plan.yaml").read_text())
    assert plan["num_devices"] == devices
    assert all(s["devices"] == s["tp"] * s["dp"] for s in plan["layout"])
    assert sum(s["devices"] for s in plan["layout"]) == plan["devices_used"] <= devices
