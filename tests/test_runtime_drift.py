"""Drift measured in a training run (`planner.replan_every`): every that many steps the run scores its
recent batches under its plan and the planner's best, and logs `plan_regret` to the console,
metrics.jsonl and TensorBoard."""

import io
import json

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
    assert "best found" in log  # the planner found a plan for the recent batches
    assert "ignored config keys" not in caplog.text  # planner.* is read with replan_every
    assert f"plan regret {measured[-1]['plan_regret']:.1%}" in log
    assert len(report.losses) == 4
    events = list((tmp_path / "a" / "tb").glob("events.*"))
    assert events and b"plan_regret" in events[0].read_bytes()
