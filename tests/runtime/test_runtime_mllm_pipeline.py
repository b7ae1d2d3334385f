"""LLaVA-OV-style MLLM pipelined over 2 encoder + 2 LLM stages (encoder dp=2, LLM dp=1 x tp=2) ==
single-device jax.grad of the unsplit model + the same optax update, for 1F1B and GPipe orders; and
over 1 encoder + 2 LLM stages with the first at dp=2 x tp=2, per residual policy, and 1 encoder +
1 LLM stage at dp=3 x tp=2. Tiles are packed by row as the data layer packs them (row r's tiles in
its own block of slots, its feature indices into that block): each LLM row receives only its block,
split over its tp devices, and gathers it over them; the reference gathers from the whole
microbatch's features with the same global indices.

The 48-token microbatches carry exact LLaVA-OV feature taps (4 taps with fractional weights, as the
data path packs for interpolated image features); the 32-token one only a plain feature_index, so one
step covers both placements of the first LLM stage."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pipeline_fixtures import (
    MLLM_TEXT,
    SEPARATE_LAYOUT,
    SEPARATE_ROWS,
    SEPARATE_TPT,
    SEPARATE_VISION,
    as_pool,
    mllm_loss_sum,
    separate_batch,
    separate_model,
    separate_stages,
)
from pipeline_reference import assert_trees_close, no_host_round_trip, reference_step

from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.programs.stage_builder import build_stages
from dflop_jax.runtime.checkpoint import model_tree
from dflop_jax.runtime.driver import run_pipeline
from dflop_jax.runtime.optimizer_config import OptimizerConfig
from dflop_jax.runtime.train_state import StageOptimizer, apply_updates
from models.llava_onevision import llava_onevision_config

OPT = OptimizerConfig(lr=1e-2, warmup_steps=1, decay_steps=10, clip_norm=1.0)
WIDE = Layout(
    (StageSpec("encoder", 0, 3, tp=1, dp=2, has_embedding=True, has_head=True),),
    (
        StageSpec("llm", 0, 2, tp=2, dp=2, has_embedding=True),
        StageSpec("llm", 2, 1, tp=1, dp=2, has_head=True),
    ),
)
THREE_ROWS = Layout(
    (StageSpec("encoder", 0, 3, tp=1, dp=1, has_embedding=True, has_head=True),),
    (StageSpec("llm", 0, 3, tp=2, dp=3, has_embedding=True, has_head=True),),
)


def _reference(rows):
    mbs = separate_batch(rows)
    norm = sum(float(m["loss_mask"].sum()) for m in mbs)
    loss, new, _ = reference_step(separate_model(), mbs, norm, OPT, mllm_loss_sum)
    tree = model_tree(
        [StageSpec("encoder", 0, 3), StageSpec("llm", 0, 3)], [new["encoder"], new["llm"]], [{}, {}]
    )
    return loss, tree


@pytest.fixture(scope="module")
def reference():
    return _reference(SEPARATE_ROWS)


@pytest.fixture(scope="module")
def reference_two_rows():
    return _reference(2)


def _pipelined_step(layout, rows, residuals="recompute", mbs=None):
    """(loss, updated model tree) of one step of `layout` on `mbs` (`separate_batch(rows)`)."""
    cfg = llava_onevision_config(SEPARATE_VISION, MLLM_TEXT)
    stages = build_stages(cfg, layout, stage_meshes(layout), 0, compute_dtype=jnp.float32,
                          residuals=[residuals] * layout.num_stages)  # fmt: skip
    opts = [StageOptimizer(s, OPT.build()) for s in stages]
    mbs = separate_batch(rows) if mbs is None else mbs
    with no_host_round_trip():
        out = run_pipeline(stages, mbs, sum(float(m["loss_mask"].sum()) for m in mbs))
    apply_updates(opts, out.grads, OPT.clip_norm)
    tree = model_tree(list(layout.stages), [s.params for s in stages], [{} for _ in stages])
    return sum(float(x) for x in out.loss), tree


@pytest.fixture(scope="module")
def pipeline():
    stages = separate_stages()
    initial = [jax.device_get(s.params) for s in stages]
    return stages, [StageOptimizer(s, OPT.build()) for s in stages], initial


@pytest.mark.parametrize("order", ["1f1b", "gpipe"])
def test_mllm_pipeline_matches_single_device(order, pipeline, reference):
    stages, opts, initial = pipeline
    for s, o, p in zip(stages, opts, initial):
        s.params = jax.device_put(p, s.param_shardings)
        o.state = o.init_state()
    mbs = separate_batch()
    # No host round trip: encoder features (data-sharded, dp 2) reach the LLM stage (replicated over
    # its 1 x 2 mesh) and their cotangents come back device to device.
    with no_host_round_trip():
        out = run_pipeline(stages, mbs, sum(float(m["loss_mask"].sum()) for m in mbs), order)
    loss = sum(float(x) for x in out.loss)
    apply_updates(opts, out.grads, OPT.clip_norm)
    # Two bucket shapes: each stage program compiled once per shape, whatever the microbatch count.
    assert [s.compiles for s in stages] == [4, 4, 4, 2]
    ref_loss, ref_tree = reference
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    got = model_tree(list(SEPARATE_LAYOUT.stages), [s.params for s in stages], [{} for _ in stages])
    assert_trees_close(got, ref_tree)


@pytest.mark.parametrize(
    "residuals", ["recompute", pytest.param("all", marks=pytest.mark.slow)]
)  # "all": under a minute alone, but the pair is over the fast tier's share
def test_split_features_on_a_dp_tp_llm_stage_match_single_device(residuals, reference_two_rows):
    """Encoder dp 2 -> first LLM stage dp 2 x tp 2: each device receives half of its row's block of
    feature tiles, the stage gathers each block over its row's tp devices and sends dL/dx back the
    same way; the step (loss, updated params) equals the single-device one."""
    loss, got = _pipelined_step(WIDE, 2, residuals)
    ref_loss, ref_tree = reference_two_rows
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(got, ref_tree)


@pytest.mark.seconds(22)
def test_row_local_features_on_three_rows_match_single_device():
    """Encoder dp 1 -> one LLM stage at dp 3 x tp 2 (the encoder's 3 row blocks split over 6
    devices, each row gathering its own): the step equals the single-device one."""
    loss, got = _pipelined_step(THREE_ROWS, 3)
    ref_loss, ref_tree = _reference(3)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(got, ref_tree)


@pytest.mark.parametrize(
    "layout,rows",
    [pytest.param(THREE_ROWS, 3, id="dp1-dp3tp2"),
     pytest.param(WIDE, 2, id="dp2-dp2tp2", marks=pytest.mark.slow)],
)  # fmt: skip
def test_pooled_features_match_single_device(layout, rows):
    """Tiles pooled (`Layout.pooled_tiles`), shuffled over the pool so rows read across blocks:
    the encoder's features arrive split over every device of the first LLM stage (the pool
    end-padded), which gathers the whole pool and places each row's features by their slots;
    dL/dx is each replica's share summed over "data". The step equals the single-device one."""
    rng = np.random.default_rng(1)
    mbs = [as_pool(mb, rng, layout.encoder_dp, SEPARATE_TPT) for mb in separate_batch(rows)]
    loss, got = _pipelined_step(dataclasses.replace(layout, pooled_tiles=True), rows, mbs=mbs)
    ref_loss, ref_tree = _reference(rows)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(got, ref_tree)
