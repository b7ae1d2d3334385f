"""Drift measured in a training run (`planner.replan_every`): every that many steps the run scores its
recent batches under its plan and the planner's best, and logs `plan_regret` to the console,
metrics.jsonl and TensorBoard; with `planner.replan: on_drift` it re-plans at a checkpoint.

The drifting mix (tests/drift_fixtures.py) trains end to end in
`tests/multiprocess/test_runtime_multiprocess_drift.py`, in 2 jax processes: the same checks as one
process, and both processes deciding alike (the one-process re-plan is trained here, on a decoder)."""

import io
import json

import numpy as np
import pytest
from rich.console import Console
from trainer_fixtures import decoder_train_config, millisecond_clock

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
    report = run(decoder_train_config(tmp_path, "a", steps=4, **drift),
                 console=Console(file=out, width=300), clock=millisecond_clock())  # fmt: skip
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
    kept = run(decoder_train_config(tmp_path, "kept", steps=4, **common), clock=millisecond_clock())
    out = io.StringIO()
    replan = {
        "planner.replan_every": 2,
        "planner.replan": "on_drift",
        "planner.replan_threshold": 0,
    }
    moved = run(decoder_train_config(tmp_path, "moved", steps=4, **common, **replan),
                console=Console(file=out, width=300), clock=millisecond_clock())  # fmt: skip
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
        decoder_train_config(
            tmp_path, "x", **{"planner.replan_every": 2, "planner.replan": "on_drift"}
        )
