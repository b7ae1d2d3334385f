"""The model profiler times an omni model's audio encoder (the audio kinds: the runtime's audio stage
programs over one packed row of mel frames), and a measured provider prices the audio encoder from
those entries, on its own stages and on LLM stage 0, instead of from its analytic fallback.

The profiled FLOPs are checked against XLA's `cost_analysis()` of the same module jitted
independently; the provider's prices against the entries it reads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflop_jax.contracts.profile_settings import ProfileSettings
from dflop_jax.costs import AnalyticCostProvider, StageSpec, arch_of_model, get_device
from dflop_jax.costs.measured import MeasuredCostProvider
from dflop_jax.costs.recipe import colocated_backward
from dflop_jax.profiling.model_profiler import candidate_tps, profile_model
from dflop_jax.profiling.table import AUDIO_KINDS
from tests.pipeline_fixtures import COLOCATED_LLAVA, OMNI

BUCKETS = (128, 256, 512)
SETTINGS = ProfileSettings(tps=(1, 2, 4), audio_buckets=BUCKETS, kinds=AUDIO_KINDS, warmup=0,
                           runs=1, compute_dtype="float32", residuals="recompute")  # fmt: skip


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    out = tmp_path_factory.mktemp("audio_profile") / "cost_table.json"
    return profile_model(OMNI, jax.devices()[:2], SETTINGS, out, plot=False)


def test_audio_kinds_are_profiled_at_the_tps_dividing_the_audio_heads(table):
    """tp 4 does not divide the audio encoder's 2 heads; a model without audio has no audio kinds."""
    assert candidate_tps(OMNI, "audio_layers", (1, 2, 4), 8) == [1, 2]
    assert candidate_tps(COLOCATED_LLAVA, "audio_layers", (1, 2), 8) == []
    for kind in AUDIO_KINDS:
        for tp in (1, 2):
            for n in (1, 2) if kind == "audio_layers" else (0,):
                entries = [table.get(kind, tp, b, n) for b in BUCKETS]
                assert all(e is not None and e.ok and e.compile_s > 0 for e in entries), kind
                # the work follows the frames (one row per shard)
                assert entries[0].flops_fwd < entries[1].flops_fwd < entries[2].flops_fwd
    two, one = table.get("audio_layers", 1, 256, 2), table.get("audio_layers", 1, 256, 1)
    assert two.flops_fwd == pytest.approx(2 * one.flops_fwd, rel=0.05)


def test_audio_head_flops_equal_cost_analysis_of_the_same_module(table):
    """The profiled projector head (pool + norm + projector) is the module jitted on its own."""
    from models.qwen2_audio import AudioEncoderStage

    stage = AudioEncoderStage(OMNI.audio, first_layer=OMNI.audio.audio.num_layers, num_layers=0,
                              has_embedding=False, has_head=True, rngs=nnx.Rngs(0))  # fmt: skip
    graphdef, params = nnx.split(stage)
    frames = 512
    x = jnp.zeros((1, frames // 2, OMNI.audio.audio.hidden_size), jnp.float32)
    windows = jnp.ones((1, frames), jnp.int32)
    valid = jnp.ones((1, frames), bool)
    ref = jax.jit(lambda p, x, w, v: nnx.merge(graphdef, p)(x, None, w, v))
    flops = ref.lower(params, x, windows, valid).compile().cost_analysis()["flops"]
    entry = table.get("audio_head", 1, frames, 0)
    assert entry.flops_fwd == pytest.approx(flops, rel=1e-6)
    d, out = OMNI.audio.audio.hidden_size, OMNI.audio.text.hidden_size
    assert entry.flops_fwd > 2 * (frames // 4) * d * out  # the projector's matmul at least


def _provider(table, **kw):
    arch = arch_of_model(OMNI, "omni-tiny")
    device = get_device("cpu")
    fallback = AnalyticCostProvider(arch, device)
    return MeasuredCostProvider(table, arch, device, fallback=fallback, fit="interpolate", **kw)


def test_a_measured_table_prices_the_audio_encoder_from_its_entries(table):
    """At a profiled bucket the price is the parts' measured times, their program's fixed cost
    counted once; k rows of a shard cost k rows' work and one fixed cost; no fallback is used."""
    provider = _provider(table)
    whole = StageSpec("audio", 0, 2, tp=2, has_embedding=True, has_head=True)
    fwd, bwd = provider.audio_time(whole, 256)
    parts = [table.get(k, 2, 256, n) for k, n in
             (("audio_embedding", 0), ("audio_layers", 2), ("audio_head", 0))]  # fmt: skip
    one, two = table.get("audio_layers", 2, 256, 1), table.get("audio_layers", 2, 256, 2)
    base = (max(2 * one.fwd_s - two.fwd_s, 0.0), max(2 * one.bwd_s - two.bwd_s, 0.0))
    fixed = [min(base[0], *(p.fwd_s for p in parts)), min(base[1], *(p.bwd_s for p in parts))]
    assert fwd == pytest.approx(sum(p.fwd_s for p in parts) - 2 * fixed[0], rel=1e-9)
    assert bwd == pytest.approx(sum(p.bwd_s for p in parts) - 2 * fixed[1], rel=1e-9)
    f3, b3 = provider.audio_time(whole, 256, rows=3)
    rows_fixed = (min(base[0], fwd), min(base[1], bwd))
    assert (f3, b3) == pytest.approx((3 * fwd - 2 * rows_fixed[0], 3 * bwd - 2 * rows_fixed[1]))
    sources = provider.sources()
    assert "audio_encoder" not in sources
    assert sources["audio_layers"] == {"measured": 2} == sources["audio_embedding"]
    # a tp the table lacks: the whole encoder by the fallback, said so
    four = StageSpec("audio", 0, 2, tp=4, has_embedding=True, has_head=True)
    assert provider.audio_time(four, 256) == provider.fallback.audio_time(four, 256)
    assert provider.sources()["audio_encoder"] == {"fallback": 1}


def test_a_frozen_audio_tower_on_llm_stage_0_costs_its_projector_backward(table):
    """Trained projector, frozen tower, a "recompute" table: inside LLM stage 0's program the tower
    is re-run forward in the backward and the projector differentiated (`colocated_backward`)."""
    provider = _provider(table, trainable=("projector", "llm"))
    whole = StageSpec("audio", 0, 2, tp=1, has_embedding=True, has_head=True)
    fwd, bwd = provider.audio_time(whole, 512, colocated_backward)
    head = table.get("audio_head", 1, 512, 0)
    assert bwd == pytest.approx(head.bwd_s + (fwd - head.fwd_s), rel=1e-9)
    assert 0 < bwd < _provider(table).audio_time(whole, 512)[1] + fwd
    np.testing.assert_array_less(0, [fwd, bwd])


def test_a_model_without_vision_profiles_and_prices_its_audio_and_llm_parts_only(tmp_path):
    """A Qwen2-Audio model (`plan: auto`): the profiler times its audio and LLM parts, no vision
    kind (there is no tower to time), and a layout without encoder stages is priced from those
    entries alone: no colocated vision encoder, no analytic fallback."""
    from dflop_jax.contracts.layout import Layout
    from dflop_jax.costs import colocated_encoder_stage
    from dflop_jax.costs.provider import layout_stage_costs
    from tests.pipeline_fixtures import QWEN2_AUDIO

    settings = ProfileSettings(tps=(1,), llm_buckets=(64, 128), audio_buckets=(128, 256),
                               warmup=0, runs=1, compute_dtype="float32", residuals="recompute")  # fmt: skip
    t = profile_model(QWEN2_AUDIO, jax.devices()[:1], settings, tmp_path / "t.json", plot=False)
    kinds = {k for k, *_ in t.entries}
    assert kinds == {*AUDIO_KINDS, "llm_embedding", "llm_layers", "llm_head"}
    arch = arch_of_model(QWEN2_AUDIO)
    assert not arch.has_vision and arch.audio is not None
    provider = MeasuredCostProvider(t, arch, get_device("cpu"))  # a missing entry raises
    lay = Layout((), (StageSpec("llm", 0, 3, tp=1, dp=1, has_embedding=True, has_head=True),))
    assert colocated_encoder_stage(arch, lay) is None
    with_audio, text_only = layout_stage_costs(provider, lay)(1, 128, 256), layout_stage_costs(
        provider, lay)(1, 128, 0)  # fmt: skip
    assert with_audio[0, 0] > text_only[0, 0] > 0  # the audio encoder runs on the one stage
    assert "fallback" not in str(provider.sources())
