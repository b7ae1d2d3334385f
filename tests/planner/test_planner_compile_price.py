"""Compilation priced in the plan: a run's compile time (its programs, `costs/compile.py`) amortized
over its steps joins the expected step time, so a short run takes a shorter bucket ladder than a long
one on the same data; the plan records its programs, compile estimate and the ladders it compared,
and narrows a stage seeing both buckets to the (tile, length) pairs its schedules use."""

import dataclasses

from dflop_jax.planner import PlannerConfig, load_plan, make_plan, save_plan
from dflop_jax.scheduler import llava_ov_mix

SPACE = PlannerConfig(tp=(1,), encoder_pp=(1,), llm_pp=(1,), microbatches=(4,), global_batch=32,
                      samples=2, num_buckets=(1, 2, 3, 4, 6), colocate=True,
                      encoder_stages=False)  # fmt: skip
SHAPES = llava_ov_mix(400, 0)


def _plan(steps: int):
    return make_plan("tiny", "h100", 1, SHAPES, dataclasses.replace(SPACE, steps=steps))


def _chosen(plan) -> dict:
    (row,) = [r for r in plan.ladders if r["chosen"]]
    return row


def test_a_short_run_takes_a_shorter_ladder_than_a_long_one(tmp_path):
    short, long = _plan(20), _plan(20000)
    assert _chosen(short)["num_buckets"] < _chosen(long)["num_buckets"]
    assert short.compile["programs"] < long.compile["programs"]
    for plan in (short, long):
        rows = plan.ladders
        assert sorted(r["num_buckets"] for r in rows) == [1, 2, 3, 4, 6]  # every size compared
        best = min(r["per_step_s"] for r in rows)
        assert _chosen(plan)["per_step_s"] == best  # what the ranking minimized
        for r in rows:  # step time plus the compile time per step of the run
            steps = plan.compile["steps"]
            assert abs(r["per_step_s"] - (r["step_time_s"] + r["compile_s"] / steps)) < 1e-3
        # the colocated stage compiles per pair: only those the schedules used, the largest too
        b = plan.buckets
        assert b.top in b.allowed() and len(b.allowed()) == plan.compile["pairs"]
    # more buckets pad less (the trade the compile time prices)
    rows = sorted(long.ladders, key=lambda r: r["num_buckets"])
    assert rows[-1]["padding_tokens"] < rows[0]["padding_tokens"]
    back = load_plan(save_plan(long, tmp_path / "plan.yaml"))
    assert (back.buckets, back.compile, back.ladders) == (long.buckets, long.compile, long.ladders)


def test_an_unpriced_plan_keeps_the_grid_and_records_no_compile():
    plan = _plan(0)
    assert plan.buckets.grid and plan.compile == {} and plan.ladders == ()


def test_the_plan_records_each_stages_residual_policy_and_plans_its_memory(tmp_path):
    """The planner picks each stage's residual policy with the layout (the run's rule: the least
    backward work that fits), plans its memory under it, records it, and a run of the plan trains
    it (`resolve.plan_sources.stage_residuals`)."""
    from dflop_jax.costs import AnalyticCostProvider, get_arch, get_device, layout_memory
    from dflop_jax.planner.resolve import ResolvedPlan
    from dflop_jax.planner.scoring import in_flight
    from dflop_jax.programs.model_section import model_config_for_arch
    from dflop_jax.resolve import RunContext
    from dflop_jax.resolve.plan_sources import stage_residuals
    from dflop_jax.runtime.config import TrainConfig

    space = dataclasses.replace(SPACE, encoder_stages=True, colocate=False, encoder_pp=(1,),
                                llm_pp=(1, 2))  # fmt: skip
    plan = make_plan("tiny", "h100", 3, SHAPES, space)
    assert len(plan.residuals) == plan.layout.num_stages
    assert set(plan.residuals) <= {"all", "layers", "recompute"}
    provider = AnalyticCostProvider(get_arch("tiny"), get_device("h100"))
    counts = in_flight(plan.layout.num_stages, plan.max_microbatches, plan.schedule)
    want = layout_memory(provider, plan.layout, plan.buckets, counts, plan.residuals)
    assert list(plan.stage_memory_bytes) == [m.total() for m in want]
    back = load_plan(save_plan(plan, tmp_path / "plan.yaml"))
    assert back.residuals == plan.residuals
    resolved = ResolvedPlan.of(back, provider)
    ctx = RunContext.of(TrainConfig(), model_config_for_arch("tiny", "float32"))  # residuals: auto
    assert stage_residuals(ctx, resolved) == plan.residuals


def test_described_plan_names_the_encoders_the_first_llm_stage_runs():
    """A colocated plan says that LLM stage 0 runs the vision encoder (and with audio buckets and no
    audio stages, the audio encoder); a plan with encoder stages says it of no stage."""
    from dflop_jax.costs import AnalyticCostProvider, get_arch, get_device
    from dflop_jax.planner.resolve import ResolvedPlan

    provider = AnalyticCostProvider(get_arch("tiny"), get_device("h100"))
    colocated = _plan(20)
    assert not colocated.layout.encoder_stages
    lines = ResolvedPlan.of(colocated, provider).describe(True)
    assert lines[0].startswith("stage 0: llm + vision encoder layers")
    heard = dataclasses.replace(colocated.buckets, audio=(256,))
    lines = ResolvedPlan.of(dataclasses.replace(colocated, buckets=heard), provider).describe(True)
    assert lines[0].startswith("stage 0: llm + vision encoder + audio encoder layers")
    assert ResolvedPlan.of(colocated, provider).describe(False)[0].startswith("stage 0: llm layers")
    apart = make_plan("tiny", "h100", 3, SHAPES, dataclasses.replace(SPACE, encoder_stages=True,
                                                                     colocate=False))  # fmt: skip
    assert not any("+" in line for line in ResolvedPlan.of(apart, provider).describe(True)[:-2])
