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

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from pipeline_reference import assert_trees_close, no_host_round_trip, reference_step

from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.data.sample_arrays import plain_taps
from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.programs.stage_builder import build_stages
from dflop_jax.runtime.checkpoint import model_tree
from dflop_jax.runtime.driver import run_pipeline
from dflop_jax.runtime.train_state import OptimizerConfig, StageOptimizer, apply_updates
from models.decoder_config import DecoderConfig
from models.llava_onevision import LlavaOnevision, llava_onevision_config
from models.siglip import SiglipConfig

TEXT = DecoderConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
    head_dim=8, qkv_bias=True,
)  # fmt: skip
VISION = SiglipConfig(
    hidden_size=16, intermediate_size=32, num_layers=3, num_heads=2, image_size=28, patch_size=7
)
LAYOUT = Layout(
    (
        StageSpec("encoder", 0, 1, tp=1, dp=2, has_embedding=True),
        StageSpec("encoder", 1, 2, tp=1, dp=2, has_head=True),
    ),
    (
        StageSpec("llm", 0, 2, tp=2, dp=1, has_embedding=True),
        StageSpec("llm", 2, 1, tp=2, dp=1, has_head=True),
    ),
)
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
L_DP, TPT = 1, 16


def _taps(rng, fidx, block):
    """[rows,S,4] taps / weights: image positions mix 4 random feature rows of their row's own block
    (`block` feature rows per row) with random fractional weights (summing to 1); TEXT / NEWLINE
    positions repeat their index with weight 1 on tap 0."""
    taps, weights = plain_taps(fidx.reshape(-1))
    img = fidx.reshape(-1) >= 0
    row = np.repeat(np.arange(fidx.shape[0]), fidx.shape[1])[img]
    taps[img] = row[:, None] * block + rng.integers(0, block, (int(img.sum()), 4))
    w = rng.random((int(img.sum()), 4)) + 0.1
    weights[img] = w / w.sum(1, keepdims=True)
    shape = (*fidx.shape, 4)
    return taps.reshape(shape).astype(np.int32), weights.reshape(shape).astype(np.float32)


def _microbatch(rng, row_tiles, length, rows=L_DP):
    """`rows` packed rows, each gathering features of its own block of `row_tiles` tiles (global
    slot indices, row r's in [r * row_tiles * TPT, (r + 1) * row_tiles * TPT))."""
    n, block = rows * row_tiles, row_tiles * TPT
    fidx = np.full((rows, length), -1, np.int32)
    k = min(block, length - 4)
    for r in range(rows):
        fidx[r, 1 : 1 + k] = r * block + rng.permutation(block)[:k]
        fidx[r, 1 + k] = -2  # image newline
    seg = np.ones((rows, length), np.int32)
    seg[:, length - 6 :] = 2
    pos = np.tile(np.concatenate([np.arange(length - 6), np.arange(6)]), (rows, 1)).astype(np.int32)
    tokens = rng.integers(1, TEXT.vocab_size, (rows, length)).astype(np.int32)
    taps, weights = _taps(rng, fidx, block) if length == 48 else (None, None)
    return {
        "feature_taps": taps,
        "feature_weight": weights,
        "tiles": rng.standard_normal((n, 28, 28, 3)).astype(np.float32),
        "tile_valid": np.ones(n, bool),
        "tile_pool": np.arange(n) == 1,  # one video frame (pooled features)
        "tokens": tokens,
        "segment_ids": seg,
        "positions": pos,
        "targets": np.roll(tokens, -1, axis=1),
        "loss_mask": (rng.random((rows, length)) < 0.6).astype(np.float32),
        "feature_index": fidx,
    }


def _batch(rows=L_DP):
    """Three microbatches at two bucket shapes; a row's tiles a multiple of the LLM's tp (2), as
    the data layer pads each row's block."""
    rng = np.random.default_rng(0)
    shapes = ((4, 48), (2, 32), (4, 48)) if rows == 1 else ((2, 48), (4, 32), (2, 48))
    return [_microbatch(rng, t, s, rows) for t, s in shapes]


def _model():
    with jax.default_device(jax.devices()[0]):
        return LlavaOnevision(llava_onevision_config(VISION, TEXT), rngs=nnx.Rngs(0))


def _llava_loss(m, mb):
    keys = ("tiles", "tile_pool", "tokens", "segment_ids", "positions", "feature_index", "targets",
            "loss_mask")  # fmt: skip
    args = [mb[k] for k in keys]
    if mb["feature_taps"] is not None:  # MLLM.loss places with the taps instead
        args[keys.index("feature_index")] = mb["feature_taps"]
    return m.loss(*args, feature_weight=mb["feature_weight"])[0]


def _reference(rows):
    mbs = _batch(rows)
    norm = sum(float(m["loss_mask"].sum()) for m in mbs)
    loss, new, _ = reference_step(_model(), mbs, norm, OPT, _llava_loss)
    tree = model_tree(
        [StageSpec("encoder", 0, 3), StageSpec("llm", 0, 3)], [new["encoder"], new["llm"]], [{}, {}]
    )
    return loss, tree


@pytest.fixture(scope="module")
def reference():
    return _reference(L_DP)


@pytest.fixture(scope="module")
def reference_two_rows():
    return _reference(2)


def _pipelined_step(layout, rows, residuals="recompute"):
    """(loss, updated model tree) of one step of `layout` on `_batch(rows)`."""
    cfg = llava_onevision_config(VISION, TEXT)
    stages = build_stages(cfg, layout, stage_meshes(layout), 0, compute_dtype=jnp.float32,
                          residuals=[residuals] * layout.num_stages)  # fmt: skip
    opts = [StageOptimizer(s, OPT.build()) for s in stages]
    mbs = _batch(rows)
    with no_host_round_trip():
        out = run_pipeline(stages, mbs, sum(float(m["loss_mask"].sum()) for m in mbs))
    apply_updates(opts, out.grads, OPT.clip_norm)
    tree = model_tree(list(layout.stages), [s.params for s in stages], [{} for _ in stages])
    return sum(float(x) for x in out.loss), tree


@pytest.fixture(scope="module")
def pipeline():
    cfg = llava_onevision_config(VISION, TEXT)
    stages = build_stages(cfg, LAYOUT, stage_meshes(LAYOUT), 0, compute_dtype=jnp.float32)
    initial = [jax.device_get(s.params) for s in stages]
    return stages, [StageOptimizer(s, OPT.build()) for s in stages], initial


@pytest.mark.parametrize("order", ["1f1b", "gpipe"])
def test_mllm_pipeline_matches_single_device(order, pipeline, reference):
    stages, opts, initial = pipeline
    for s, o, p in zip(stages, opts, initial):
        s.params = jax.device_put(p, s.param_shardings)
        o.state = o.init_state()
    mbs = _batch()
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
    got = model_tree(list(LAYOUT.stages), [s.params for s in stages], [{} for _ in stages])
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


def test_row_local_features_on_three_rows_match_single_device():
    """Encoder dp 1 -> one LLM stage at dp 3 x tp 2 (the encoder's 3 row blocks split over 6
    devices, each row gathering its own): the step equals the single-device one."""
    loss, got = _pipelined_step(THREE_ROWS, 3)
    ref_loss, ref_tree = _reference(3)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(got, ref_tree)
