"""Drift measured in a training run (`planner.replan_every`): every that many steps the run scores its
recent batches under its plan and the planner's best, and logs `plan_regret` to the console,
metrics.jsonl and TensorBoard; with `planner.replan: on_drift` it re-plans at a checkpoint.

The drifting mix below (`DRIFTING`, `check_replan_line`, `check_drift_rows`) trains end to end in
`tests/multiprocess/test_runtime_multiprocess_drift.py`, in 2 jax processes: the same checks as one
process, and both processes deciding alike (the one-process re-plan is trained here, on a decoder)."""

import io
import json
import re

import numpy as np
import pytest
from rich.console import Console
from test_runtime_trainer import _cfg, _clock

from dflop_jax.train import run


def test_plan_regret_is_logged_every_replan_every_steps(tmp_path, caplog):
    drift = {
        "planner.replan_every": 2,
        "planner.replan_batches": 2,
        "planner.microbatches": "[2]",
        "planner.llm_pp": "[1, 2]",
        "planner.samples": 1,
        "planner.num_buckets": "[2]",
        "tensorboard": "true",
    }
    out = io.StringIO()
    report = run(_cfg(tmp_path, "a", steps=4, **drift), console=Console(file=out, width=300),
                 clock=_clock())  # fmt: skip
    rows = [json.loads(r) for r in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    measured = [r for r in rows if r["plan_regret"] is not None]
    # Measured after steps 2 and 4, each on a row read after it finished (of its step or later);
    # the one after step 4 is skipped if the one after step 2 still runs then (never waited for
    # before the last step). The last step waits: step 2's is always logged.
    steps = [r["plan_regret_step"] for r in measured]
    skipped = "the measurement before step 4 still runs" in caplog.text
    assert steps == ([2] if skipped else [2, 4])
    assert all(r["plan_regret"] >= 0 for r in measured)
    assert all(r["plan_regret_step"] <= r["step"] for r in measured)
    log = out.getvalue()
    assert "plan_regret after step 2: " in log and "over the last 2 batches" in log
    assert "planner's pick" in log  # the planner found a plan for the recent batches
    assert "ignored config keys" not in caplog.text  # planner.* is read with replan_every
    assert f"plan regret {measured[-1]['plan_regret']:.1%}" in log
    assert len(report.losses) == 4
    events = list((tmp_path / "a" / "tb").glob("events.*"))
    assert events and b"plan_regret" in events[0].read_bytes()


@pytest.mark.slow
def test_on_drift_replans_once_at_a_checkpoint_and_the_losses_carry_on(tmp_path):
    """Past the threshold (0 here: any plan the planner finds faster) the run re-plans at its next
    checkpoint, rebuilds its stages on the new layout from that checkpoint and goes on: the same
    losses as the run that kept its plan (the same samples form every global batch)."""
    common = {
        "planner.replan_batches": 2,
        "planner.microbatches": "[2]",
        "planner.llm_pp": "[1, 2]",
        "planner.samples": 1,
        "planner.num_buckets": "[2]",
        "checkpoint.every": 3,
    }
    kept = run(_cfg(tmp_path, "kept", steps=4, **common), clock=_clock())
    out = io.StringIO()
    replan = {
        "planner.replan_every": 2,
        "planner.replan": "on_drift",
        "planner.replan_threshold": 0,
    }
    moved = run(_cfg(tmp_path, "moved", steps=4, **common, **replan),
                console=Console(file=out, width=300), clock=_clock())  # fmt: skip
    log = out.getvalue()
    assert log.count("re-plan after step") == 1 and "re-plan after step 3: plan_regret" in log
    assert moved.layout != kept.layout
    np.testing.assert_allclose(moved.losses, kept.losses, rtol=1e-5)
    rows = [json.loads(r) for r in (tmp_path / "moved" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 5))
    # the new plan's programs compile at the re-plan, before its first step: no step compiles
    assert moved.summary["programs_replanned"] > 0
    assert moved.summary["programs_after_precompile"] == 0
    assert [r["recompiles"] for r in rows] == [0] * 4


def test_on_drift_needs_checkpoints_to_replan_at(tmp_path):
    from dflop_jax.config import ConfigError

    with pytest.raises(ConfigError, match=r"planner\.replan.*set checkpoint\.every"):
        _cfg(tmp_path, "x", **{"planner.replan_every": 2, "planner.replan": "on_drift"})


# A curriculum (images first, then video) on a model whose encoder weighs on video: the planner's pick
# for the image batches is the explicit layout below (1 encoder device, LLM dp 3, its ladders; tiles
# count per LLM row); for the video batches it gives the encoder a second device.
DRIFTING = [
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


def _curriculum(tmp_path, batch: int = 8):
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
