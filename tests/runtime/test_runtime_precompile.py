"""What the runtime compiles before step 1 is what the planner prices: the programs
`precompile` lowers for a layout and a (sparse) set of bucket pairs, counted without compiling, equal
`costs.compile.program_counts` for separate encoder stages (tp 2 LLM stages), a colocated stage and
a colocated pipeline, also for an omni model; a stage compiles once per bucket it sees (an encoder
stage per tile bucket, a later LLM stage per length bucket, the first LLM stage per pair, and with
audio per pair and audio bucket)."""

import dataclasses

import jax
import pytest
from models_fixtures import tiny_llava_ov_config
from pipeline_fixtures import OMNI

from dflop_jax.contracts import BucketSet, ScheduleProblem
from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.costs.compile import program_counts
from dflop_jax.data.config import DataConfig
from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.programs.stage_builder import build_stages
from dflop_jax.runtime.optimizer_config import OptimizerConfig
from dflop_jax.runtime.precompile import bucket_microbatches, pipeline_lowerings
from dflop_jax.runtime.train_state import StageOptimizer, lower_update

SEPARATE = Layout(
    (StageSpec("encoder", 0, 2, tp=1, dp=2, has_embedding=True, has_head=True),),
    (
        StageSpec("llm", 0, 1, tp=2, dp=1, has_embedding=True),
        StageSpec("llm", 1, 1, tp=1, dp=1, has_head=True),
    ),
)
COLOCATED = Layout((), (StageSpec("llm", 0, 2, tp=1, dp=2, has_embedding=True, has_head=True),))
COLOCATED_PP = Layout(
    (),
    (
        StageSpec("llm", 0, 1, tp=2, dp=1, has_embedding=True),
        StageSpec("llm", 1, 1, tp=2, dp=1, has_head=True),
    ),
)
BUCKETS = BucketSet((2, 4), (64, 128), ((2, 64), (4, 64), (4, 128)))
DATA = DataConfig(tile_size=28, patch_size=7)


OMNI_BUCKETS = dataclasses.replace(BUCKETS, audio=(64, 128))
# the audio encoder on a stage of its own, beside the vision encoder's
AUDIO_APART = dataclasses.replace(
    SEPARATE,
    audio_stages=(StageSpec("audio", 0, 2, tp=1, dp=1, has_embedding=True, has_head=True),),
)
OMNI_DATA = dataclasses.replace(DATA, audio_mels=OMNI.audio.audio.num_mel_bins)


@pytest.mark.parametrize(
    "layout,omni",
    [(SEPARATE, False), (COLOCATED, False), (COLOCATED_PP, False), (SEPARATE, True),
     (COLOCATED_PP, True), (AUDIO_APART, True), (dataclasses.replace(SEPARATE, pooled_tiles=True), False)],
    ids=["separate", "colocated", "pp", "omni-separate", "omni-pp", "omni-audio-stage", "pooled"],
)  # fmt: skip
def test_precompile_lowers_what_the_planner_counts(layout, omni):
    """With audio buckets (omni) only the first LLM stage multiplies its signatures, by the audio
    buckets and none: 3 pairs x 3; with the audio encoder on a stage of its own, every microbatch
    has audio: the audio stage sees the 2 audio buckets, the first LLM stage 3 pairs x 2."""
    model_cfg = OMNI if omni else tiny_llava_ov_config()
    buckets, data = (OMNI_BUCKETS, OMNI_DATA) if omni else (BUCKETS, DATA)
    stages = build_stages(model_cfg, layout, stage_meshes(layout), 0, compute_dtype=jax.numpy.float32,
                          residuals=["all"] * layout.num_stages)  # fmt: skip
    problem = ScheduleProblem(layout.encoder_dp, layout.llm_dp, layout.num_stages, (1, 2), buckets,
                              lambda t, s: None, tiles_by_row=layout.tiles_by_row,
                              row_align=layout.row_align,
                              audio_always=bool(layout.audio_stages))  # fmt: skip
    seen, lowered = set(), []
    for batch in bucket_microbatches(problem, data):
        lowered += pipeline_lowerings(stages, batch, seen=seen)
    # a forward keeping residuals is followed, once compiled, by its backward from them
    runtime = len(lowered) + sum(lw.then is not None for lw in lowered)
    opts = [StageOptimizer(s, OptimizerConfig().build()) for s in stages]
    step = sum(len(o.lower()) for o in opts) + len(lower_update(opts, 1.0)) + 1  # + the rate
    counts = program_counts(layout, buckets)
    assert (runtime, step) == (counts.bucket_programs, counts.step)
    kinds = [s.module for s in layout.stages]
    first = 3 * (1 + len(buckets.audio) - bool(layout.audio_stages))
    for i, stage in enumerate(stages):  # signatures per stage: tiles, audio, pairs or lengths
        sigs = {sig[1:] for sig in stage.signatures if sig[0] in ("fwd_res", "last", "fwd")}
        want = 2 if kinds[i] != "llm" else first if i == layout.first_llm else 2
        assert len(sigs) == want, (i, sigs)


def test_stages_on_other_hosts_transfer_by_program():
    """Two LLM stages at the same dp and tp copy between them on one host (the runtime's count,
    above); on hosts of their own every transfer is a program and its zero blocks: each of the 2
    length buckets forward and back, the norm in and the statistics out."""
    one = program_counts(COLOCATED_PP, BUCKETS)
    apart = program_counts(COLOCATED_PP, BUCKETS, devices_per_host=2)
    assert one.transfers == 0 and apart.transfers == 2 * 2 * 2
    assert apart.step - one.step == 2 * 2
    assert apart.stage == one.stage and apart.count == one.count
