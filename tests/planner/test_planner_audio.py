"""The planner with an audio encoder: the cost model prices it where it runs (its own stages, or
LLM stage 0), the search places it (on LLM stage 0 or on stages of its own at their tp and dp), the
simulation runs the two encoder branches as an in-tree, and a plan.yaml keeps the placement."""

import dataclasses

import numpy as np
import pytest

from dflop_jax.contracts import BucketSet
from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.costs import (
    AnalyticCostProvider,
    AudioArch,
    colocated_audio_stage,
    get_arch,
    get_device,
    layout_memory,
    layout_stage_costs,
    layout_transfer_costs,
)
from dflop_jax.costs.recipe import colocated_backward
from dflop_jax.planner import LayoutCosts, PlannerConfig, describe_layout, make_plan
from dflop_jax.planner.candidates import enumerate_candidates, module_stages
from dflop_jax.planner.plan_file import load_plan, save_plan
from dflop_jax.scheduler import omni_mix
from dflop_jax.sim import simulate

# the tiny demo model with a 4-layer audio encoder wider than its LLM: where it runs matters
ARCH = dataclasses.replace(get_arch("tiny"), audio=AudioArch("audio", 4, 256, 4, 1024, 80))
H100 = get_device("h100")
CONFIG = PlannerConfig(global_batch=32, microbatches=(4, 8), samples=2, llm_pp=(1, 2),
                       encoder_pp=(1,), tp=(1, 2), num_buckets=(3,))  # fmt: skip


def _layout(audio_dp: int | None, llm_dp: int = 2) -> Layout:
    enc = module_stages("encoder", 2, 1, 1, 2)
    llm = module_stages("llm", 4, 1, 2, llm_dp)
    audio = module_stages("audio", 4, 1, 1, audio_dp) if audio_dp else ()
    return Layout(enc, llm, audio_stages=audio)


def test_audio_stages_are_priced_at_their_rows_frames_and_send_their_features():
    provider = AnalyticCostProvider(ARCH, H100)
    lay = _layout(audio_dp=1, llm_dp=2)  # one audio replica encodes both LLM rows
    assert lay.audio_frames(1000) == 2000
    costs = layout_stage_costs(provider, lay)
    audio = lay.stages[1]
    got = costs(4, 256, 1000)
    assert tuple(got[1]) == provider.audio_time(audio, 2000)
    assert got[1].sum() > 0 and not costs(4, 256, 0)[1].any()
    # the vision and LLM stages do not see the audio bucket
    np.testing.assert_array_equal(np.delete(got, 1, axis=0), np.delete(costs(4, 256), 1, axis=0))
    xfer = layout_transfer_costs(provider, lay)(4, 256, 1000)
    # the audio stage's projector output: 2000 frames -> 500 features of the LLM's width, bf16,
    # within the host (all 8 devices on one)
    assert xfer[1] == pytest.approx(500 * ARCH.llm.hidden_size * 2 / H100.intra_host_bandwidth)
    assert xfer[0] > 0  # the vision stage feeds LLM stage 0, past the audio stage


def test_audio_on_llm_stage_0_is_priced_in_that_stage():
    """Without audio stages the first LLM stage runs the audio encoder at its tp, one row per
    shard, a frozen encoder re-run forward in its backward (the colocated rule)."""
    provider = AnalyticCostProvider(ARCH, H100, trainable=("projector", "llm"))
    lay = _layout(audio_dp=None)
    stage = colocated_audio_stage(ARCH, lay)
    assert (stage.tp, stage.dp, stage.num_layers) == (1, 2, 4) and stage.has_head
    costs = layout_stage_costs(provider, lay)
    added = costs(4, 256, 1000)[lay.first_llm] - costs(4, 256, 0)[lay.first_llm]
    fwd, bwd = provider.audio_time(stage, 1000, colocated_backward)
    np.testing.assert_allclose(added, [fwd, bwd], rtol=1e-12)
    assert fwd > 0 and bwd == pytest.approx(fwd)  # frozen: its forward again, no gradients
    buckets = BucketSet((4,), (256,), audio=(1000,))
    with_audio = layout_memory(provider, lay, buckets)[lay.first_llm].total()
    without = layout_memory(provider, lay, (4, 256))[lay.first_llm].total()
    assert with_audio > without  # the encoder's weights and activations live there too


def test_the_search_places_the_audio_encoder_on_stages_dividing_the_llm_rows():
    cands = enumerate_candidates(ARCH, 8, 8, CONFIG)
    placed = [c.layout for c in cands if c.layout.audio_stages]
    assert placed and len(placed) < len(cands)
    for lay in placed:
        assert lay.llm_dp % lay.audio_stages[0].dp == 0 and lay.num_devices == 8
    # LLM stage 0 runs the audio encoder only at a tp dividing its heads (4: tp 8 would not)
    heads3 = dataclasses.replace(ARCH, audio=dataclasses.replace(ARCH.audio, num_heads=3))
    for c in enumerate_candidates(heads3, 8, 8, CONFIG):
        assert c.layout.audio_stages or c.layout.llm_stages[0].tp == 1
    no_stages = dataclasses.replace(CONFIG, audio_stages=False)
    assert not any(c.layout.audio_stages for c in enumerate_candidates(ARCH, 8, 8, no_stages))


def test_the_plan_follows_the_audio_share():
    """The same model and devices: with a tenth of the samples holding audio the encoder rides on
    LLM stage 0; with nine tenths it gets stages of its own beside the vision encoder's."""
    light = make_plan(ARCH, H100, 8, omni_mix(400, 0, 0.1), CONFIG)
    heavy = make_plan(ARCH, H100, 8, omni_mix(400, 0, 0.9), CONFIG)
    assert not light.layout.audio_stages and light.buckets.audio
    assert heavy.layout.audio_stages, describe_layout(heavy.layout)
    assert "| aud tp" in describe_layout(heavy.layout)
    # the chosen placement beats the other one on the same data (both scored by the search)
    forced = make_plan(ARCH, H100, 8, omni_mix(400, 0, 0.9),
                       dataclasses.replace(CONFIG, audio_stages=False))  # fmt: skip
    assert heavy.step_time_mean_s < forced.step_time_mean_s


def test_branched_layouts_simulate_as_an_in_tree_and_round_trip_plan_files(tmp_path):
    provider = AnalyticCostProvider(ARCH, H100)
    lay = _layout(audio_dp=1)
    costs = LayoutCosts.build(provider, lay)
    times = np.stack([costs.stage(4, 256, 1000), costs.stage(2, 128, 500)])
    xfer = np.stack([costs.transfer(4, 256, 1000), costs.transfer(2, 128, 500)])
    got = costs.simulate(times, xfer, "1f1b").step_time
    tree = simulate(times, xfer, "1f1b", update=costs.update, children=lay.children).step_time
    chain = simulate(times, xfer, "1f1b", update=costs.update).step_time
    assert got == tree and tree < chain  # the branches run side by side

    plan = make_plan(ARCH, H100, 8, omni_mix(400, 0, 0.9), CONFIG)
    back = load_plan(save_plan(plan, tmp_path / "plan.yaml"))
    assert back.layout == plan.layout and back.layout.audio_stages
    assert back.buckets.audio == plan.buckets.audio
    assert [s.module for s in back.layout.stages][:2] == ["encoder", "audio"]
    assert isinstance(back.layout.audio_stages[0], StageSpec)


def test_a_measured_table_without_audio_entries_prices_the_audio_encoder_by_its_fallback():
    """A table without the audio kinds (profiled without them): a measured provider prices the
    audio encoder, on its own stages or on LLM stage 0, as its analytic fallback does, and its
    sources say so."""
    from dflop_jax.costs import MeasuredCostProvider
    from dflop_jax.profiling.table import CostEntry, ProfiledCostTable

    table = ProfiledCostTable("h100", "h100", 8, "h", "c", model=ARCH.name)
    for b in (256, 512):
        for kind, n in (
            ("llm_layers", 1),
            ("llm_layers", 2),
            ("llm_embedding", 0),
            ("llm_head", 0),
        ):
            table.add(CostEntry(kind, 1, b, n, fwd_s=1e-3 * b, bwd_s=2e-3 * b, param_bytes=1.0))
    fallback = AnalyticCostProvider(ARCH, H100)
    measured = MeasuredCostProvider(table, ARCH, H100, fallback=fallback)
    lay = _layout(audio_dp=None)
    on_llm = layout_stage_costs(measured, lay)
    added = on_llm(4, 256, 1000)[lay.first_llm] - on_llm(4, 256, 0)[lay.first_llm]
    stage = colocated_audio_stage(ARCH, lay)
    np.testing.assert_allclose(added, fallback.audio_time(stage, 1000, colocated_backward))
    assert measured.sources()["audio_encoder"] == {"fallback": 1}
    own = _layout(audio_dp=2)
    assert layout_stage_costs(measured, own)(4, 256, 1000)[1].sum() > 0
