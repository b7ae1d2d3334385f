"""Resuming on another cluster shape.

Scheduler corrections (`runtime/resume.py`): a new layout keeps the factors of the stages that run the
same programs on the same submesh shape and resets the others. End to end (slow): a run trained on 8
simulated devices resumes on 4 devices with another explicit layout (a layer boundary moved, tp
changed) and then on 2 (one stage), and its per-step losses equal an uninterrupted 8-device run's.
"""

import dataclasses
import io
import json

import numpy as np
import pytest
from rich.console import Console

from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.runtime.resume import carry_corrections, layout_from_dict, same_buckets, stage_map

OLD = Layout(
    (StageSpec("encoder", 0, 2, tp=1, dp=2, has_embedding=True, has_head=True),),
    (
        StageSpec("llm", 0, 2, tp=2, dp=1, has_embedding=True),
        StageSpec("llm", 2, 2, tp=2, dp=1),
        StageSpec("llm", 4, 2, tp=2, dp=1, has_head=True),
    ),
)
# The boundary between LLM stages 0 and 1 moved; the encoder and the last stage are unchanged.
NEW = Layout(
    (StageSpec("encoder", 0, 2, tp=1, dp=2, has_embedding=True, has_head=True),),
    (
        StageSpec("llm", 0, 3, tp=2, dp=1, has_embedding=True),
        StageSpec("llm", 3, 1, tp=1, dp=1),
        StageSpec("llm", 4, 2, tp=2, dp=1, has_head=True),
    ),
)


def _sched_state(stages: int, value: float, tiles=(4,), lengths=(128, 256)) -> dict:
    factors = np.full((len(tiles), len(lengths), stages, 2), value)
    factors[..., :, 0] += np.arange(stages)[None, None, :]  # each stage's own factor
    return {
        "version": 1, "tiles": list(tiles), "lengths": list(lengths), "factors": factors.tolist(),
        "counts": [[3, 2]], "active": True, "steps": 7, "observations": 5,
        "raw_err": [0.3] * 5, "corr_err": [0.1] * 5,
    }  # fmt: skip


def _lagged(sched: dict) -> dict:
    return {"scheduler": sched, "through": 4, "step": 7, "observations": {"6": {"x": 1}}}


def test_stage_map_pairs_stages_with_the_same_spec():
    assert stage_map(OLD, NEW) == [0, None, None, 3]
    assert stage_map(OLD, OLD) == [0, 1, 2, 3]
    assert layout_from_dict(dataclasses.asdict(NEW)) == NEW
    # LLM stage 0 also runs a colocated encoder: with another encoder it means something else.
    plain = Layout((), (StageSpec("llm", 0, 6, tp=2, dp=1, has_embedding=True, has_head=True),))
    own_tp = Layout(plain.encoder_stages, plain.llm_stages, colocated_encoder_tp=1)
    assert stage_map(plain, own_tp) == [None]


def test_corrections_kept_where_a_stage_means_the_same_else_reset():
    fresh = _sched_state(4, 1.0)
    fresh.update(factors=np.ones((1, 2, 4, 2)).tolist(), active=False, steps=0, observations=0)
    fresh.update(counts=[[0, 0]], raw_err=[], corr_err=[])
    carried = carry_corrections(_lagged(_sched_state(4, 2.0)), OLD, NEW, fresh)
    assert (carried.kept, carried.reset) == ((0, 3), (1, 2))
    f = np.asarray(carried.state["scheduler"]["factors"])
    np.testing.assert_array_equal(f[:, :, 0, 0], 2.0)  # old stage 0
    np.testing.assert_array_equal(f[:, :, 3, 0], 5.0)  # old stage 3
    np.testing.assert_array_equal(f[:, :, 1:3], 1.0)
    s = carried.state["scheduler"]
    assert s["counts"] == [[3, 2]] and s["observations"] == 5 and s["steps"] == 7
    # Errors and pending observations were measured per old stage: dropped.
    assert s["raw_err"] == [] and carried.state["observations"] == {}
    assert carried.state["through"] == 4 and carried.state["step"] == 7
    assert "kept for stages [0, 3], reset for stages [1, 2]" in carried.message()


def test_other_buckets_reset_every_stage():
    fresh = _sched_state(4, 1.0, lengths=(128, 512))
    carried = carry_corrections(_lagged(_sched_state(4, 2.0)), OLD, OLD, fresh)
    assert carried.kept == () and carried.reset == (0, 1, 2, 3)
    assert carried.state["scheduler"]["factors"] == fresh["factors"]
    assert carried.message() == (
        "the checkpoint's plan has other buckets; every stage's scheduler corrections reset"
    )
    # A re-plan may keep the layout and change only the buckets: the trainer asks this, not the layout.
    assert not same_buckets(_sched_state(4, 2.0), fresh)
    assert same_buckets(_sched_state(4, 2.0), _sched_state(3, 1.0))


LAYOUT_8 = {"layout.llm_layers": "[1, 2]", "layout.llm_tp": "[2, 2]", "layout.llm_dp": 2}
LAYOUT_4 = {"layout.llm_layers": "[2, 1]", "layout.llm_tp": "[1, 1]", "layout.llm_dp": 2}
LAYOUT_2 = {"layout.llm_layers": "[3]", "layout.llm_tp": "[1]", "layout.llm_dp": 2}


@pytest.mark.slow
def test_resume_on_4_then_2_devices_with_other_layouts_equals_the_8_device_run(tmp_path):
    from trainer_fixtures import decoder_train_config, millisecond_clock

    from dflop_jax.train import run

    def leg(name, steps, layout):
        out = io.StringIO()
        cfg = decoder_train_config(tmp_path, name, steps=steps, **{"model.num_layers": 3},
                                   **layout, **{"checkpoint.every": 3})  # fmt: skip
        report = run(cfg, console=Console(file=out, width=200), clock=millisecond_clock())
        return report, out.getvalue()

    straight, _ = leg("straight", 8, LAYOUT_8)
    first, _ = leg("elastic", 3, LAYOUT_8)
    second, log4 = leg("elastic", 6, LAYOUT_4)
    third, log2 = leg("elastic", 8, LAYOUT_2)
    assert (second.first_step, third.first_step) == (3, 6)
    assert second.layout.num_devices == 4 and third.layout.num_devices == 2
    assert "scheduler corrections kept for stages none, reset for stages [0, 1]" in log4
    assert "scheduler corrections kept for stages none, reset for stages [0]" in log2
    resumed = first.losses + second.losses + third.losses
    assert len(resumed) == 8
    np.testing.assert_allclose(resumed, straight.losses, rtol=1e-5)
    rows = (tmp_path / "elastic" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == list(range(1, 9))
