"""What the dispatching thread issues per step (`programs/dispatch.py`): every metrics.jsonl row counts
the programs its step issued, by kind, as the schedule implies them for an explicit layout (the tiny
decoder over 2 LLM stages, 2-3 microbatches), with its host time per program and the time before
the first device wait (a measured step waits for its sampled microbatch's inputs)."""

import json

import pytest
from trainer_fixtures import decoder_train_config, millisecond_clock

from dflop_jax.train import run


def _expected(m: int, stages: int = 2) -> dict[str, int]:
    """Programs one step of M microbatches issues on a pipeline of `stages` LLM stages, each
    training every leaf, stage-to-stage transfers between disjoint devices whose blocks do not line
    up (the fixture's tp 1 and tp 2 stages: each transfer runs 2 programs, its zero blocks for the
    destination's devices and the transport)."""
    boundaries = stages - 1
    stage = (
        2 * boundaries * m  # inner stages: forward (keeping residuals) + backward per microbatch
        + m  # the last stage's fused forward + loss + backward
        + stages  # a zero accumulator per stage
        + m  # the loss normalizer: the loss tokens of each microbatch added on the last stage
    )
    transfer = 2 * (
        2 * boundaries * m  # activations forward, dL/dx back, per boundary and microbatch
        + 2 * boundaries  # each other stage's squared norm to the last stage, the STATS back
    )
    update = 3 * stages + m + 1  # reduce, norm, AdamW per stage; the loss sum; the STATS vector
    return {"stage": stage, "transfer": transfer, "update": update}


def test_metrics_rows_count_the_programs_each_step_issued(tmp_path):
    run(
        decoder_train_config(tmp_path, "d", steps=4, measure_stage_times_every=2),
        clock=millisecond_clock(),
    )
    rows = [json.loads(r) for r in (tmp_path / "d" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for r in rows:
        want = _expected(r["microbatches"])
        got = {k: r[f"dispatch_{k}_programs"] for k in want}
        assert got == want, r["step"]
        n = sum(want.values())
        assert r["dispatch_programs"] == n
        assert r["dispatch_us_per_program"] == pytest.approx(r["dispatch_s"] / n * 1e6)
        assert r["dispatch_cpu_us_per_program"] == pytest.approx(r["dispatch_cpu_s"] / n * 1e6)
        assert 0 < r["dispatch_cpu_s"] <= r["dispatch_s"] * 1.05 + 1e-3  # the thread's own share
        assert 0 < r["dispatch_first_wait_s"] <= r["dispatch_s"]
        if r["stage_times_measured"]:  # it waited for its sampled microbatch's inputs
            assert r["dispatch_first_wait_s"] < r["dispatch_s"]
        else:  # it never waited
            assert r["dispatch_first_wait_s"] == r["dispatch_s"]
    assert {r["stage_times_measured"] for r in rows} == {True, False}
