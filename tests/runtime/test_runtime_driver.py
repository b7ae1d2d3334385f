"""Pipeline dispatch orders (1F1B, GPipe) and device layouts; no compilation needed."""

import jax
import pytest

from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.programs.meshes import LayoutError, stage_meshes
from dflop_jax.runtime.driver import Op, pipeline_order, stage_ops


def test_stage_ops_1f1b_bounds_in_flight():
    ops = stage_ops(0, 4, 6, "1f1b")
    assert [(o.kind, o.mb) for o in ops[:5]] == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0)]
    in_flight = peak = 0
    for o in ops:
        in_flight += 1 if o.kind == "F" else -1
        peak = max(peak, in_flight)
    assert peak == 4  # P - stage for stage 0; GPipe holds all 6
    gpipe = stage_ops(0, 4, 6, "gpipe")
    assert [o.kind for o in gpipe] == ["F"] * 6 + ["B"] * 6


@pytest.mark.parametrize("order", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages, mbs", [(3, 5), (4, 2), (1, 3), (5, 1)])
def test_pipeline_order_is_complete_and_respects_dependencies(order, stages, mbs):
    seq = pipeline_order(stages, mbs, order)
    # Every stage but the last runs F and B per microbatch; the last fuses them.
    assert len(seq) == len(set(seq)) == (2 * (stages - 1) + 1) * mbs
    pos = {op: i for i, op in enumerate(seq)}
    last = stages - 1
    for op in seq:
        if op.kind == "F" and op.stage > 0:
            assert pos[Op(op.stage - 1, op.mb, "F")] < pos[op]
        if op.kind == "B":
            nxt = Op(op.stage + 1, op.mb, "F" if op.stage + 1 == last else "B")
            assert pos[nxt] < pos[op]


# Two encoder branches joining at the first LLM stage: vision 0 -> 1 -> LLM 3, audio 2 -> LLM 3,
# then LLM 3 -> 4 (`Layout.children`).
BRANCHED = Layout(
    (StageSpec("encoder", 0, 1, has_embedding=True), StageSpec("encoder", 1, 1, has_head=True)),
    (StageSpec("llm", 0, 1, has_embedding=True), StageSpec("llm", 1, 1, has_head=True)),
    audio_stages=(StageSpec("audio", 0, 2, has_embedding=True, has_head=True),),
)


@pytest.mark.parametrize("order", ["1f1b", "gpipe"])
@pytest.mark.parametrize("mbs", [1, 3, 6])
def test_branched_pipeline_order_joins_both_branches(order, mbs):
    """The first LLM stage runs a microbatch's forward only after BOTH branches' last stages ran
    theirs, each branch stage's backward follows the joining stage's; under 1F1B a stage keeps at
    most its depth (stages from it to the last) microbatches in flight, like the chain stage as far
    from the end: the audio stage (depth 3) as the vision encoder's second stage, not its first."""
    children = BRANCHED.children
    assert children == (1, 3, 3, 4, -1) and BRANCHED.parents(3) == (1, 2)
    seq = pipeline_order(5, mbs, order, children=children)
    assert len(seq) == len(set(seq)) == (2 * 4 + 1) * mbs
    pos = {op: i for i, op in enumerate(seq)}
    for op in seq:
        for p in BRANCHED.parents(op.stage):
            if op.kind == "F":
                assert pos[Op(p, op.mb, "F")] < pos[op]
        if op.kind == "B":
            c = children[op.stage]
            assert pos[Op(c, op.mb, "F" if c == 4 else "B")] < pos[op]
    if order == "1f1b":
        for stage, depth in enumerate((4, 3, 3, 2)):  # the last stage fuses F and B
            live = peak = 0
            for op in (o for o in seq if o.stage == stage):
                live += 1 if op.kind == "F" else -1
                peak = max(peak, live)
            assert peak == min(depth, mbs), stage


def test_meshes_disjoint_and_shaped():
    layout = Layout(
        (StageSpec("encoder", 0, 1, tp=1, dp=2, has_embedding=True, has_head=True),),
        (
            StageSpec("llm", 0, 1, tp=2, dp=1, has_embedding=True),
            StageSpec("llm", 1, 1, tp=2, dp=1, has_head=True),
        ),
    )
    meshes = stage_meshes(layout)
    assert [m.devices.shape for m in meshes] == [(2, 1), (1, 2), (1, 2)]
    assert all(m.axis_names == ("data", "model") for m in meshes)
    ids = [d.id for m in meshes for d in m.devices.flat]
    assert len(ids) == len(set(ids)) == 6
    assert all(isinstance(d, jax.Device) for m in meshes for d in m.devices.flat)


def test_layout_too_big_is_one_line_error():
    big = Layout((), (StageSpec("llm", 0, 2, tp=4, dp=3, has_embedding=True, has_head=True),))
    with pytest.raises(LayoutError, match="needs 12 devices") as e:
        stage_meshes(big)
    assert "\n" not in str(e.value)
