"""LLaVA-OV-style MLLM pipelined over 2 encoder + 2 LLM stages (encoder dp=2, LLM dp=1 x tp=2) ==
single-device jax.grad of the unsplit model + the same optax update, for 1F1B and GPipe orders; and
over 1 encoder + 2 LLM stages with the first at dp=2 x tp=2 (the features arrive split over its 4
devices, padded where the tiles do not divide, and are gathered in its mesh), per residual policy.

The 48-token microbatches carry exact LLaVA-OV feature taps (4 taps with fractional weights, as the
data path packs for interpolated image features); the 32-token one only a plain feature_index, so one
step covers both placements of the first LLM stage."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from pipeline_reference import assert_trees_close, no_host_round_trip, reference_step

from dflop_jax.costs.layout import Layout, StageSpec
from dflop_jax.data.types import plain_taps
from dflop_jax.runtime.checkpoint import model_tree
from dflop_jax.runtime.driver import run_pipeline
from dflop_jax.runtime.mesh import stage_meshes
from dflop_jax.runtime.model_stages import build_stages
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
V_DP, L_DP, TPT = 2, 1, 16


def _taps(rng, fidx, n_rows):
    """[L_DP,S,4] taps / weights: image positions mix 4 random feature rows with random fractional
    weights (summing to 1); TEXT / NEWLINE positions repeat their index with weight 1 on tap 0."""
    taps, weights = plain_taps(fidx.reshape(-1))
    img = fidx.reshape(-1) >= 0
    taps[img] = rng.integers(0, n_rows, (int(img.sum()), 4))
    w = rng.random((int(img.sum()), 4)) + 0.1
    weights[img] = w / w.sum(1, keepdims=True)
    shape = (*fidx.shape, 4)
    return taps.reshape(shape).astype(np.int32), weights.reshape(shape).astype(np.float32)


def _microbatch(rng, tiles_per_shard, length, rows=L_DP):
    """`rows` packed rows, each gathering features of any tile of the microbatch (global slots)."""
    n = V_DP * tiles_per_shard
    fidx = np.full((rows, length), -1, np.int32)
    k = min(n * TPT, length - 4)
    for r in range(rows):
        fidx[r, 1 : 1 + k] = rng.permutation(n * TPT)[:k]
        fidx[r, 1 + k] = -2  # image newline
    seg = np.ones((rows, length), np.int32)
    seg[:, length - 6 :] = 2
    pos = np.tile(np.concatenate([np.arange(length - 6), np.arange(6)]), (rows, 1)).astype(np.int32)
    tokens = rng.integers(1, TEXT.vocab_size, (rows, length)).astype(np.int32)
    taps, weights = _taps(rng, fidx, n * TPT) if length == 48 else (None, None)
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
    rng = np.random.default_rng(0)
    return [_microbatch(rng, t, s, rows) for t, s in ((2, 48), (1, 32), (2, 48))]


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
    """Encoder dp 2 -> first LLM stage dp 2 x tp 2: each device receives a quarter of the feature
    tiles (the 1-tile-per-shard microbatch's 2 tiles padded to 4), the stage gathers them in its
    mesh and reduce-scatters dL/dx back; the step equals the single-device one."""
    cfg = llava_onevision_config(VISION, TEXT)
    stages = build_stages(cfg, WIDE, stage_meshes(WIDE), 0, compute_dtype=jnp.float32,
                          residuals=[residuals] * WIDE.num_stages)  # fmt: skip
    opts = [StageOptimizer(s, OPT.build()) for s in stages]
    mbs = _batch(rows=2)
    with no_host_round_trip():
        out = run_pipeline(stages, mbs, sum(float(m["loss_mask"].sum()) for m in mbs))
    loss = sum(float(x) for x in out.loss)
    apply_updates(opts, out.grads, OPT.clip_norm)
    ref_loss, ref_tree = reference_two_rows
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    got = model_tree(list(WIDE.stages), [s.params for s in stages], [{} for _ in stages])
    assert_trees_close(got, ref_tree)
