"""Encoder branches in the pipeline simulator (`simulate(..., children=...)`): two encoders on their own
stages feed the first LLM stage. Checked against a naive relaxation of the same operations and
dependencies written out here, against the chain when a branch costs nothing, and for the 1F1B bound
on what each stage keeps in flight."""

import itertools

import numpy as np
import pytest

from dflop_jax.contracts.pipeline_order import chain_position, depths, stage_order
from dflop_jax.sim.pipeline import simulate


def _tree(vision: int, audio: int, llm: int) -> tuple[int, ...]:
    """Stages: vision 0..v-1, audio v..v+a-1, then LLM; each branch's last stage feeds LLM 0."""
    v, a = vision, audio
    first_llm = v + a
    children = [j + 1 for j in range(v - 1)] + [first_llm]
    children += [v + j + 1 for j in range(a - 1)] + [first_llm]
    children += [first_llm + j + 1 for j in range(llm - 1)] + [-1]
    return tuple(children)


def _relaxed(times, transfer, children, schedule):
    """Start and end of every (kind, microbatch, stage) by relaxation to a fixed point: each op
    starts when its stage's previous op and its inputs have ended."""
    m, p, _ = times.shape
    depth = depths(children)
    orders = [stage_order(schedule, chain_position(depth[s], p), p, m) for s in range(p)]
    parents = [[i for i in range(p) if children[i] == s] for s in range(p)]
    end: dict[tuple[str, int, int], float] = {}
    start: dict[tuple[str, int, int], float] = {}
    for _ in range(4 * m * p + 4):
        changed = False
        for s in range(p):
            prev = 0.0
            for kind, k in orders[s]:
                need = [prev]
                if kind == "F":
                    need += [end.get(("F", k, u), np.inf) + transfer[k, u] for u in parents[s]]
                else:
                    need.append(end.get(("F", k, s), np.inf))
                    c = children[s]
                    if c >= 0:
                        need.append(end.get(("B", k, c), np.inf) + transfer[k, s])
                t0 = max(need)
                t1 = t0 + times[k, s, int(kind == "B")]
                if start.get((kind, k, s)) != t0:
                    start[kind, k, s], end[kind, k, s], changed = t0, t1, True
                prev = t1
        if not changed:
            break
    return start, end


@pytest.mark.parametrize(("shape", "schedule", "m", "seed"), [
    (s, sched, m, seed)
    for s in [(1, 1, 1), (2, 1, 2), (1, 2, 3), (2, 2, 1)]
    for sched in ("1f1b", "gpipe")
    for m, seed in [(1, 0), (3, 1), (6, 2)]
])  # fmt: skip
def test_branches_match_a_naive_relaxation(shape, schedule, m, seed):
    children = _tree(*shape)
    p = len(children)
    rng = np.random.default_rng(seed)
    times = rng.uniform(0.1, 1.0, (m, p, 2))
    transfer = rng.uniform(0.0, 0.2, (m, p - 1))
    res = simulate(times, transfer, schedule, children=children)
    start, end = _relaxed(times, np.pad(transfer, [(0, 0), (0, 1)]), children, schedule)
    assert res.pipeline_time == pytest.approx(max(end.values()))
    for s, stage_events in enumerate(res.events):
        for e in stage_events:
            assert (e.start, e.end) == pytest.approx((start[e.kind, e.microbatch, s],
                                                      end[e.kind, e.microbatch, s]))  # fmt: skip


def test_a_branch_that_costs_nothing_leaves_the_chain():
    rng = np.random.default_rng(7)
    m = 5
    chain = rng.uniform(0.2, 1.0, (m, 3, 2))  # vision, llm0, llm1
    times = np.concatenate([chain[:, :1], np.zeros((m, 1, 2)), chain[:, 1:]], axis=1)
    tree = simulate(times, 0.0, "1f1b", children=_tree(1, 1, 2))
    assert tree.pipeline_time == pytest.approx(simulate(chain, 0.0, "1f1b").pipeline_time)


def test_the_slower_branch_sets_the_pace_and_in_flight_follows_depth():
    m = 8
    children = _tree(1, 2, 2)  # vision 0; audio 1, 2; llm 3, 4
    times = np.ones((m, 5, 2))
    times[:, 1:3] *= 3.0  # the audio branch is three times slower per stage
    res = simulate(times, 0.0, "1f1b", children=children)
    fast = simulate(np.ones((m, 5, 2)), 0.0, "1f1b", children=children)
    assert res.pipeline_time > fast.pipeline_time
    assert res.pipeline_time >= m * 3.0 * 2  # the audio stages are busy for m x (f + b)
    d = depths(children)
    assert d == (3, 4, 3, 2, 1)
    assert res.peak_in_flight() == [min(x, m) for x in d]
    # the memory model's bound is the simulated one
    from dflop_jax.costs import one_f_one_b_in_flight

    assert one_f_one_b_in_flight(5, m, children) == res.peak_in_flight()
    assert one_f_one_b_in_flight(5, 3, children) == [3, 3, 3, 2, 1]


def test_bad_branches_are_refused():
    times = np.ones((2, 4, 2))
    with pytest.raises(ValueError, match="each stage but the last feeds one later stage"):
        simulate(times, children=(3, 3, 1, -1))
    with pytest.raises(ValueError, match="at most two parents"):
        simulate(times, children=(3, 3, 3, -1))
    with pytest.raises(ValueError, match="not interleaved"):
        simulate(np.ones((4, 4, 2)), schedule="interleaved", chunks=2, children=(2, 2, 3, -1))
    with pytest.raises(ValueError, match="children has 3 stages"):
        simulate(times, children=(1, 2, -1))


def test_a_chain_given_as_children_is_the_chain():
    rng = np.random.default_rng(3)
    for m, p in itertools.product((1, 4), (1, 3)):
        times = rng.uniform(0.1, 1.0, (m, p, 2))
        chain = tuple(list(range(1, p)) + [-1])
        a = simulate(times, 0.05, "1f1b")
        b = simulate(times, 0.05, "1f1b", children=chain)
        assert a.events == b.events and a.step_time == b.step_time
