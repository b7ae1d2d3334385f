"""The drifting mix (a curriculum of single images, then video, under `planner.replan: on_drift`) that
tests/multiprocess/test_runtime_multiprocess_drift.py trains: the run's config overrides, its
curriculum, and the checks of its console and metrics.jsonl that a one-process run passes too."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

# A curriculum (images first, then video) on a model whose encoder weighs on video: the planner's pick
# for the image batches is the explicit layout below (1 encoder device, LLM dp 3, its ladders; tiles
# count per LLM row); for the video batches it gives the encoder a second device.
DRIFTING_MIX = [
    "plan=explicit", "num_cpu_devices=4", "global_batch=8", "steps=6", "compute_dtype=float32",
    "model.vision_hidden_size=192", "model.vision_intermediate_size=768", "model.vision_num_heads=4",
    "data.max_frames=16", "layout.encoder_layers=[2]", "layout.encoder_tp=[1]",
    "layout.encoder_dp=1", "layout.llm_layers=[4]", "layout.llm_tp=[1]", "layout.llm_dp=3",
    "layout.tiles=[5, 9, 64]", "layout.lengths=[640, 1152, 1536]", "layout.microbatches=[2, 3]",
    "planner.tp=[1]", "planner.encoder_pp=[1]", "planner.llm_pp=[1]", "planner.colocate=false",
    "planner.microbatches=[2]", "planner.num_buckets=[2]", "planner.samples=1",
    "planner.replan_every=2", "planner.replan_batches=2", "planner.replan=on_drift",
    "planner.replan_threshold=0.2", "checkpoint.every=2", "measure_stage_times_every=0",
    "device.peak_flops=1000000000.0", "scheduler.solver=greedy",
]  # fmt: skip


def write_curriculum(tmp_path: Path, batch: int = 8) -> Path:
    """A mix YAML: 2 global batches of single images, then 4 of video."""
    import yaml

    from dflop_jax.data.synth import synth_dataset

    img = synth_dataset(tmp_path / "img", 2 * batch, "single-image", tile=56).parent
    vid = synth_dataset(tmp_path / "vid", 4 * batch, "video", tile=56).parent
    mix = {
        "datasets": [{"path": str(img / "single_image.jsonl")}, {"path": str(vid / "video.jsonl")}],
        "phases": [{"samples": 2 * batch, "weights": [1, 0]}, {"samples": 4 * batch, "weights": [0, 1]}],
    }  # fmt: skip
    path = tmp_path / "curriculum.yaml"
    path.write_text(yaml.safe_dump(mix))
    return path


def check_replan_line(log: str) -> str:
    """The one re-plan line of a drifting-mix run's console: after step 4, from the explicit layout,
    with the regret the two predicted step times give, the new one lower; returns the new layout."""
    assert log.count("re-plan after step") == 1, log
    line = next(ln for ln in log.splitlines() if ln.startswith("re-plan after step"))
    # e.g. "re-plan after step 4: plan_regret 29.3% (measured after step 4) over the threshold;
    # old encoder[0..1 dp1 tp1] + llm[0..3 dp3 tp1] 938 ms/step on the recent data -> new
    # encoder[0..1 dp2 tp1] + llm[0..3 dp2 tp1] 725 ms/step, buckets ..."
    m = re.match(
        r"re-plan after step 4: plan_regret ([\d.]+)% \(measured after step 4\) over the threshold; "
        r"old encoder\[0\.\.1 dp1 tp1\] \+ llm\[0\.\.3 dp3 tp1\] ([\d.e+]+) ms/step on the recent "
        r"data -> new (.*) ([\d.e+]+) ms/step, buckets",
        line,
    )
    assert m, line
    regret, old_ms, new_layout, new_ms = float(m[1]), float(m[2]), m[3], float(m[4])
    assert regret > 20 and new_ms < old_ms
    assert regret == pytest.approx((old_ms / new_ms - 1) * 100, rel=0.01)
    return new_layout


def check_drift_rows(run_dir) -> None:
    """Steps 1..6 logged; regret under the threshold on the image batches, over it on the first
    video batches, under it again on the new layout."""
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(np.isfinite(r["loss"]) for r in rows)
    regrets = {
        r["plan_regret_step"]: r["plan_regret"] for r in rows if r["plan_regret"] is not None
    }
    assert sorted(regrets) == [2, 4, 6]
    assert regrets[2] < 0.2 < regrets[4] and regrets[6] < 0.2
