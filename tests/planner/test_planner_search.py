"""Planner search: memory rejection, infeasible-request explanations, determinism, tie-break, scoring path."""

import dataclasses

import numpy as np
import pytest

from dflop_jax.costs import AnalyticCostProvider, StageMemory, get_arch, get_device
from dflop_jax.planner import PlannerConfig, PlanningError, make_plan
from dflop_jax.planner.buckets import ShapeStats, bucket_set, ladder
from dflop_jax.planner.candidates import enumerate_candidates, enumerate_uniform, split_layers
from dflop_jax.planner.scoring import LayoutCosts, problem_for, simulate_schedule
from dflop_jax.planner.search import Evaluated
from dflop_jax.scheduler import SampleShape, SchedulerConfig, sample_global_batch, schedule_batch
from dflop_jax.sim import simulate

ARCH, DEVICE = get_arch("tiny"), get_device("cpu")
_GIB = 2**30


def _shapes(n=300, seed=0):
    rng = np.random.default_rng(seed)
    return [
        SampleShape(i, int(t), int(64 + 16 * t + rng.integers(10, 400)), "image" if t else "text")
        for i, t in enumerate(rng.integers(0, 9, size=n))
    ]


SMALL = PlannerConfig(
    global_batch=16, microbatches=(2, 4), samples=2, screen_top=3, top_n=3, llm_pp=(1, 2)
)


class HugeMemory:
    """Delegates to the analytic provider, but `stage_memory` reports `scale` x the real figure, plus
    `extra` bytes on stages with more than `max_layers` layers."""

    def __init__(self, scale=1.0, extra=0.0, max_layers=None):
        self.inner = AnalyticCostProvider(ARCH, DEVICE)
        self.name, self.arch, self.device = "huge-memory", ARCH, DEVICE
        self.compute_bytes = self.inner.compute_bytes
        self.scale, self.extra, self.max_layers = scale, extra, max_layers

    def stage_time(self, stage, bucket):
        return self.inner.stage_time(stage, bucket)

    def transfer_time(self, stage, bucket, cross_host=True):
        return self.inner.transfer_time(stage, bucket, cross_host)

    def stage_memory(self, stage, bucket):
        m = self.inner.stage_memory(stage, bucket)
        big = (
            self.max_layers is not None
            and stage.module == "llm"
            and stage.num_layers > self.max_layers
        )
        return StageMemory(m.params * self.scale + (self.extra if big else 0.0), m.grads, m.optimizer,
                           m.activations_per_microbatch, m.temp)  # fmt: skip


def test_all_layouts_over_memory_is_explained():
    with pytest.raises(PlanningError) as e:
        make_plan(ARCH, DEVICE, 8, _shapes(), SMALL, provider=HugeMemory(scale=1e6))
    msg = str(e.value)
    assert msg.startswith("no layout fits in memory")
    assert "GiB per device on stage" in msg and "usable" in msg and "over by" in msg
    assert "memory_margin 0.1" in msg


def test_over_memory_layouts_rejected_and_listed():
    # Any LLM stage holding all 4 layers gets +100 GiB: only pp=2 layouts fit.
    provider = HugeMemory(extra=100 * _GIB, max_layers=2)
    plan = make_plan(ARCH, DEVICE, 8, _shapes(), SMALL, provider=provider)
    assert len(plan.layout.llm_stages) == 2
    assert max(plan.stage_memory_bytes) <= plan.memory_capacity_bytes
    assert plan.search["over_memory"] > 0
    # the unconstrained best is a pp=1 layout, so it shows up as rejected for memory
    free = make_plan(ARCH, DEVICE, 8, _shapes(), SMALL)
    assert len(free.layout.llm_stages) == 1
    assert any("over memory by" in a.reason for a in plan.alternatives)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_devices": 0}, "num_devices=0: need at least 1 device"),
        ({"shapes": []}, "shape distribution is empty"),
        (
            {"config": dataclasses.replace(SMALL, tp=(3,))},
            "no tensor-parallel degree fits: planner.tp=\\[3\\]",
        ),
        ({"config": dataclasses.replace(SMALL, global_batch=1)}, "global_batch=1 is smaller than"),
        (
            {"config": dataclasses.replace(SMALL, colocate=False), "num_devices": 1},
            "separate encoder needs at least 2",
        ),
        ({"mode": "bogus"}, "mode='bogus'"),
    ],
)
def test_infeasible_requests_are_explained(kwargs, match):
    args = {"num_devices": 8, "shapes": _shapes(), "config": SMALL, "mode": "dflop"} | kwargs
    with pytest.raises(PlanningError, match=match):
        make_plan(
            ARCH, DEVICE, args["num_devices"], args["shapes"], args["config"], mode=args["mode"]
        )


def test_choice_is_deterministic_and_fastest():
    a = make_plan(ARCH, DEVICE, 8, _shapes(), SMALL)
    b = make_plan(ARCH, DEVICE, 8, _shapes(), SMALL)
    strip = lambda p: dataclasses.replace(
        p, search={k: v for k, v in p.search.items() if k != "wall_time_s"}
    )
    assert strip(a) == strip(b)
    scored = [x.step_time_s for x in a.alternatives if x.step_time_s is not None]
    assert all(a.step_time_mean_s <= s for s in scored)
    assert a.layout.num_devices == 8


def test_tie_break_prefers_fewer_idle_devices_then_fewer_microbatches():
    cands = enumerate_candidates(ARCH, 8, 8, dataclasses.replace(SMALL, max_idle_devices=4))
    by = {(c.layout.num_devices, c.microbatches): c for c in cands}
    full, part = by[8, 4], by[6, 2]
    ev = lambda c: Evaluated(c, None, None, [0.0], 1.0, 1.0)
    order = sorted([ev(part), ev(full)], key=lambda e: e.rank_key(8, 1.0))
    assert order[0].cand is full  # same step time: fewer unused devices wins
    same_dev = [c for c in cands if c.layout == full.layout]
    order = sorted([ev(c) for c in reversed(same_dev)], key=lambda e: e.rank_key(8, 1.0))
    assert order[0].cand.microbatches == min(c.microbatches for c in same_dev)


def test_plan_score_is_scheduler_then_simulator():
    """The plan's prediction equals schedule_batch + simulate (with the step's update after the
    pipeline) on the same sampled batches."""
    shapes = _shapes()
    plan = make_plan(ARCH, DEVICE, 8, shapes, SMALL)
    costs = LayoutCosts.build(AnalyticCostProvider(ARCH, DEVICE), plan.layout)
    problem = problem_for(costs, plan.microbatch_range, plan.buckets)
    rng = np.random.default_rng(SMALL.seed)
    steps = []
    for _ in range(SMALL.samples):
        batch = sample_global_batch(shapes, SMALL.global_batch, rng)
        sched = schedule_batch(
            batch, problem, SchedulerConfig(solver="greedy", correction="off", seed=SMALL.seed)
        )
        times = np.stack(
            [problem.stage_costs(m.tile_bucket, m.length_bucket) for m in sched.microbatches]
        )
        xfer = np.stack(
            [costs.transfer(m.tile_bucket, m.length_bucket) for m in sched.microbatches]
        )
        steps.append(simulate(times, xfer, update=costs.update).step_time)
        assert steps[-1] > simulate(times, xfer).step_time  # the update is paid
        assert simulate_schedule(sched, costs).step_time == pytest.approx(steps[-1])
    assert plan.step_time_mean_s == pytest.approx(np.mean(steps))


def test_uniform_mode_is_colocated_single_bucket():
    plan = make_plan(ARCH, DEVICE, 8, _shapes(), SMALL, mode="uniform")
    assert plan.mode == "uniform" and not plan.layout.encoder_stages
    assert len(plan.buckets.tiles) == 1 and len(plan.buckets.lengths) == 1
    assert len({s.tp for s in plan.layout.stages}) == 1 and plan.layout.num_devices == 8


def test_enumeration_rules():
    cfg = PlannerConfig(tp=(1, 2, 4, 8), llm_pp=(1, 2, 4, 8), global_batch=64)
    cands = enumerate_candidates(ARCH, 8, 4, cfg)
    for c in cands:
        for s in c.layout.stages:
            heads = ARCH.vision.num_heads if s.module == "encoder" else ARCH.llm.num_kv_heads
            assert heads % s.tp == 0 and s.tp <= 4
        assert c.layout.num_devices == 8
        assert sum(s.num_layers for s in c.layout.llm_stages) == ARCH.llm.num_layers
        assert c.microbatches * c.layout.llm_dp <= 64
    assert all(not c.layout.encoder_stages for c in enumerate_uniform(ARCH, 8, 4, cfg))
    assert split_layers(28, 3) == [(0, 10), (10, 9), (19, 9)]
    with pytest.raises(ValueError, match="pp=5"):
        split_layers(4, 5)


def test_bucket_ladder_covers_mean_and_largest():
    sizes = ladder(mean_load=1000, largest_item=4000, n=5, align=64)
    assert list(sizes) == sorted(sizes) and all(s % 64 == 0 for s in sizes)
    assert sizes[0] >= 800 and sizes[-1] == 4032  # max(largest, 1.5 x mean), aligned up
    assert ladder(1000, 100, 1, 1) == (1500,)
    stats = ShapeStats.of(_shapes())
    b = bucket_set(stats, 16, 4, 2, 2, 6, 64)
    assert b.lengths[-1] >= stats.max_tokens and b.tiles[-1] * 2 >= stats.max_tiles


def test_config_validation():
    from dflop_jax.config import ConfigError

    with pytest.raises(ConfigError, match="planner.memory_margin=1.5"):
        PlannerConfig(memory_margin=1.5)
    with pytest.raises(ConfigError, match="planner.num_buckets"):
        PlannerConfig(num_buckets=(0,))
    with pytest.raises(ConfigError, match="planner.tp"):
        PlannerConfig(tp=())


def test_refinement_never_worsens_the_choice():
    greedy = make_plan(ARCH, DEVICE, 8, _shapes(), SMALL)
    cfg = dataclasses.replace(SMALL, refine_top=1, refine_time_limit_s=0.2)
    refined = make_plan(ARCH, DEVICE, 8, _shapes(), cfg)
    assert refined.step_time_mean_s <= greedy.step_time_mean_s + 1e-12


class PerLayer:
    """A provider whose LLM stage costs one second per layer (forward), nothing else."""

    def stage_time(self, stage, bucket):
        return float(stage.num_layers), 0.0


def test_balanced_split_offloads_the_stage_running_the_encoder():
    from dflop_jax.contracts.layout import Layout
    from dflop_jax.planner.balance import balanced_layout
    from dflop_jax.planner.candidates import module_stages

    layout = Layout((), module_stages("llm", 6, 1, 2, 1))  # 3 + 3 layers
    # stage 0 also runs the encoder (2 s): [2 + 3, 3] -> balanced [2 + 2, 4]
    out = balanced_layout(PerLayer(), layout, np.array([[5.0, 0.0], [3.0, 0.0]]), (4, 128))
    assert [s.num_layers for s in out.llm_stages] == [2, 4]
    assert [s.first_layer for s in out.llm_stages] == [0, 2]
    assert out.llm_stages[0].has_embedding and out.llm_stages[1].has_head
    same = balanced_layout(PerLayer(), layout, np.array([[3.0, 0.0], [3.0, 0.0]]), (4, 128))
    assert same is layout


def test_balanced_split_moves_encoder_layers_off_the_projector_stage_only_within_the_encoder():
    from dflop_jax.contracts.layout import Layout
    from dflop_jax.planner.balance import balanced_layout
    from dflop_jax.planner.candidates import module_stages

    # encoder 4 + 4 layers, its last stage also runs the projector (2 s); LLM 3 + 3, already even
    layout = Layout(module_stages("encoder", 8, 1, 2, 1), module_stages("llm", 6, 1, 2, 1))
    costs = np.array([[4.0, 0.0], [6.0, 0.0], [3.0, 0.0], [3.0, 0.0]])
    out = balanced_layout(PerLayer(), layout, costs, (4, 128))
    assert [s.num_layers for s in out.encoder_stages] == [5, 3]
    assert [s.first_layer for s in out.encoder_stages] == [0, 5]
    assert out.encoder_stages[1].has_head and out.llm_stages == layout.llm_stages


class LayerMemory:
    """A provider whose stage memory is 1 byte of state + 1 byte of activations per layer."""

    def stage_memory(self, stage, bucket):
        from dflop_jax.costs.memory import StageMemory

        n = float(stage.num_layers)
        return StageMemory(n, 0.0, 0.0, n, 0.0)


def test_memory_balanced_split_minimizes_the_peak_over_all_splits():
    import itertools

    from dflop_jax.contracts.layout import Layout
    from dflop_jax.planner.balance import memory_balanced_layout
    from dflop_jax.planner.candidates import module_stages

    # 12 LLM layers on 3 stages, 1F1B in flight [3, 2, 1]: a layer costs 1 + in_flight bytes there;
    # stage 0 also holds a 2-byte colocated encoder. Even split [4, 4, 4] peaks at 2 + 16 = 18.
    layout = Layout((), module_stages("llm", 12, 1, 3, 1))
    in_flight, extra = [3, 2, 1], [2.0, 0.0, 0.0]

    def peak(split):
        return max(extra[s] + n * (1 + in_flight[s]) for s, n in enumerate(split))

    even = [extra[s] + 4 * (1 + in_flight[s]) for s in range(3)]
    out = memory_balanced_layout(LayerMemory(), layout, even, (1, 64), in_flight)
    split = [s.num_layers for s in out.llm_stages]
    best = min(
        peak(c) for c in itertools.product(range(1, 11), repeat=3) if sum(c) == 12
    )  # brute force over every split
    assert sum(split) == 12 and peak(split) == best < peak([4, 4, 4])
    assert [s.first_layer for s in out.llm_stages] == [0, split[0], split[0] + split[1]]
    assert out.llm_stages[0].has_embedding and out.llm_stages[2].has_head


def test_colocated_encoder_at_its_own_tp_costs_like_that_encoder_stage():
    from dflop_jax.contracts.layout import Layout, StageSpec
    from dflop_jax.costs import layout_memory, layout_stage_costs
    from dflop_jax.planner.candidates import module_stages

    arch = get_arch("siglip-6b+qwen2.5-7b")
    provider = AnalyticCostProvider(arch, get_device("h100"), remat=True)
    llm = module_stages("llm", arch.llm.num_layers, 4, 1, 8)
    own = Layout((), llm, colocated_encoder_tp=1)
    assert (own.encoder_dp, own.encoder_tp, own.num_devices) == (32, 1, 32)
    enc = StageSpec("encoder", 0, arch.vision.num_layers, tp=1, dp=32, has_embedding=True,
                    has_head=True)  # fmt: skip
    got = layout_stage_costs(provider, own)(3, 4096)
    llm_only = layout_stage_costs(provider, Layout((enc,), llm))(3, 4096)[1]
    np.testing.assert_allclose(got[0], llm_only + np.asarray(provider.stage_time(enc, 3)))
    mem = layout_memory(provider, own, (3, 4096), 1)[0]
    sep = layout_memory(provider, Layout((enc,), llm), (3, 4096), 1)
    assert mem.params == pytest.approx(sep[0].params + sep[1].params)
    with pytest.raises(ValueError, match="colocated_encoder_tp=3"):
        Layout((), llm, colocated_encoder_tp=3)
    with pytest.raises(ValueError, match="colocated_encoder_tp=1"):
        Layout((enc,), llm, colocated_encoder_tp=1)


def test_planner_colocates_the_encoder_at_a_smaller_tp_when_faster(tmp_path):
    """SigLIP-6B + Qwen2.5-7B on 32 H100s: the LLM at tp 4 and the 2.4B encoder on the same devices at
    tp 2 (twice the replicas, less tp communication) beat the encoder at tp 4; the plan file keeps it."""
    from dflop_jax.planner import load_plan, save_plan
    from dflop_jax.scheduler import llava_ov_mix

    cfg = PlannerConfig(global_batch=128, samples=1, tp=(1, 2, 4), llm_pp=(1,), encoder_pp=(1,),
                        microbatches=(8,), remat=(True,))  # fmt: skip
    plan = make_plan("siglip-6b+qwen2.5-7b", "h100", 32, llava_ov_mix(500, 0), cfg)
    lay = plan.layout
    assert not lay.encoder_stages and lay.llm_stages[0].tp == 4
    assert (
        lay.colocated_encoder_tp in (1, 2) and lay.encoder_dp == 8 * 4 // lay.colocated_encoder_tp
    )
    save_plan(plan, tmp_path / "plan.yaml")
    assert load_plan(tmp_path / "plan.yaml").layout == lay
