"""The per-step update after the pipeline (costs/update.py, sim.StepUpdate): hand-computed figures,
its place in the simulated step, and what it costs a plan leaning to high data parallelism."""

import pytest

from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.costs import AnalyticCostProvider, StageMemory, get_arch, get_device
from dflop_jax.costs.update import layout_update_times, norm_barrier_time, stage_update_time
from dflop_jax.planner.scoring import LayoutCosts
from dflop_jax.sim import StepUpdate, simulate

H100 = get_device("h100")  # 450 GB/s intra-host, 50 GB/s inter-host, 3.35 TB/s HBM, 20 us latency


class _Stub:
    """A provider whose every stage trains 1e9 parameters per device (4 GB of fp32 accumulator)."""

    arch = get_arch("siglip-so400m+qwen2.5-7b")
    device = H100
    compute_bytes = 2

    def __init__(self, grads: float = 4e9):
        self.grads = grads

    def stage_memory(self, stage, bucket):
        return StageMemory(params=self.grads, grads=self.grads, optimizer=0.0,
                           activations_per_microbatch=0.0, temp=0.0)  # fmt: skip


def _llm(tp: int, dp: int, **kw) -> StageSpec:
    return StageSpec("llm", 0, 4, tp=tp, dp=dp, **kw)


def test_stage_update_time_by_hand():
    # N = 1e9 trained parameters per device, dp 4 on one host:
    # reduce = 3/4 x 4e9 B / 450e9 B/s + 3 x 20 us + 4e9 / 4 B / 3.35e12 B/s
    #        = 6.666667e-3 + 6e-5 + 2.985075e-4 = 7.025174e-3 s
    # apply  = 28e9 / 4 B / 3.35e12 B/s + 3/4 x 4e9 / 450e9 + 3 x 20 us
    #          + (4 + 2) x 1e9 B / 3.35e12 B/s (the bf16 copies of the new params)
    #        = 2.089552e-3 + 6.666667e-3 + 6e-5 + 1.791045e-3 = 10.607264e-3 s
    reduce, apply = stage_update_time(_Stub(), _llm(2, 4), multi_host=False)
    assert reduce == pytest.approx(7.025174e-3, rel=1e-6)
    assert apply == pytest.approx(10.607264e-3, rel=1e-6)
    # across hosts the ring runs at 50 GB/s: 3/4 x 4e9 / 50e9 = 0.06 s each way
    reduce, apply = stage_update_time(_Stub(), _llm(2, 4), multi_host=True)
    assert reduce == pytest.approx(0.06 + 6e-5 + 2.985075e-4, rel=1e-6)
    assert apply == pytest.approx(2.089552e-3 + 0.06 + 6e-5 + 1.791045e-3, rel=1e-6)
    # dp 1: no collective, the whole optimizer step and norm on the device
    reduce, apply = stage_update_time(_Stub(), _llm(8, 1), multi_host=False)
    assert reduce == pytest.approx(4e9 / 3.35e12, rel=1e-9)
    assert apply == pytest.approx((28e9 + 6e9) / 3.35e12, rel=1e-9)
    # nothing trained (a frozen stage): nothing to reduce or apply
    assert stage_update_time(_Stub(0.0), _llm(2, 4), multi_host=True) == (0.0, 0.0)
    assert norm_barrier_time(_Stub()) == pytest.approx(40e-6)


def test_layout_update_times_hosts_and_colocated_encoder():
    # encoder stage on devices 0-7 (one host), LLM stage on 8-23 (two hosts): intra- vs inter-host
    lay = Layout((StageSpec("encoder", 0, 4, tp=2, dp=4, has_embedding=True),), (_llm(2, 8),))
    stub = _Stub()
    (r0, a0), (r1, a1) = layout_update_times(stub, lay)
    assert (r0, a0) == stage_update_time(stub, lay.stages[0], False)
    assert (r1, a1) == stage_update_time(stub, lay.stages[1], True)
    assert r1 > 6 * r0  # 7/8 x 4 GB at 50 GB/s vs 3/4 x 4 GB at 450 GB/s
    # a colocated encoder's parameters are reduced and updated with LLM stage 0's: twice the bytes
    colocated = Layout((), (_llm(2, 4, has_embedding=True),))
    assert layout_update_times(stub, colocated) == [
        stage_update_time(_Stub(8e9), colocated.stages[0], False)
    ]
    # interleaved: a device group's chunks add up (virtual stages 0 and 2 on group 0, with the
    # colocated encoder; 1 and 3 on group 1)
    chunked = Layout((), tuple(StageSpec("llm", 4 * i, 4, tp=2, dp=4) for i in range(4)))
    one = stage_update_time(stub, chunked.stages[0], False)
    first = stage_update_time(_Stub(8e9), chunked.stages[0], False)
    assert layout_update_times(stub, chunked, chunks=2) == [
        pytest.approx((first[0] + one[0], first[1] + one[1])),
        pytest.approx((2 * one[0], 2 * one[1])),
    ]


def test_update_follows_each_group_and_the_barrier():
    # 2 stages, 1 microbatch, f = 1, b = 2: stage 1 ends at 4 (F0 F1 B1), stage 0 at 6 (B0)
    times = [[[1.0, 2.0], [1.0, 2.0]]]
    plain = simulate(times)
    assert plain.step_time == plain.pipeline_time == 6.0
    update = StepUpdate(reduce=(1.0, 3.0), apply=(2.0, 1.0), barrier=0.5)
    res = simulate(times, update=update)
    # ready = max(6 + 1, 4 + 3) = 7, + barrier 0.5, + slowest apply 2
    assert res.step_time == pytest.approx(9.5)
    assert res.pipeline_time == 6.0
    assert res.idle_fraction == plain.idle_fraction  # bubbles of the pipeline alone
    with pytest.raises(ValueError, match="device groups"):
        simulate(times, update=StepUpdate((1.0,), (1.0,)))


def test_high_dp_pays_for_its_update():
    """Same 32 H100s, model and rows: tp 1 x dp 32 runs its pipeline faster than tp 4 x pp 2 x dp 4,
    but its update (7B + vision fp32 gradients, unsplit by tp, over 4 hosts) now costs it the step."""
    provider = AnalyticCostProvider(get_arch("siglip-so400m+qwen2.5-7b"), H100, remat=True)
    wide = Layout((), (StageSpec("llm", 0, 28, tp=1, dp=32, has_embedding=True, has_head=True),))
    deep = Layout((), (StageSpec("llm", 0, 14, tp=4, dp=4, has_embedding=True),
                       StageSpec("llm", 14, 14, tp=4, dp=4, has_head=True)))  # fmt: skip
    wide_c, deep_c = LayoutCosts.build(provider, wide), LayoutCosts.build(provider, deep)
    # the same 64 rows of (8 tiles, 8192 tokens) per step: 2 per replica at dp 32, 16 through the
    # dp-4 pipeline
    wide_res = wide_c.simulate([wide_c.stage(8, 8192)] * 2, wide_c.transfer(8, 8192), "1f1b")
    deep_res = deep_c.simulate([deep_c.stage(8, 8192)] * 16, deep_c.transfer(8, 8192), "1f1b")
    assert wide_res.pipeline_time < deep_res.pipeline_time  # without the update, dp wins
    assert wide_res.step_time > deep_res.step_time  # with it, it loses
    assert wide_res.step_time - wide_res.pipeline_time == pytest.approx(wide_c.update.tail)
    assert wide_c.update.tail > 5 * deep_c.update.tail
