"""InternVL in the runtime: the tiny InternViT + pixel-shuffle projector + decoder pipelined over 2 encoder
(dp=2) and 2 LLM (tp=2) stages == single-device jax.grad of the unsplit model + the same optax update
(loss and every updated parameter); and the trainer runs it end to end on synthetic internvl-family data."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from models_fixtures import TINY_TRAIN_DECODER, tiny_decoder_config
from pipeline_reference import assert_trees_close, no_host_round_trip, reference_step

from dflop_jax.config import ConfigError, load_config
from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.programs.stage_builder import build_stages
from dflop_jax.runtime.checkpoint import model_tree
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.runtime.driver import run_pipeline
from dflop_jax.runtime.optimizer_config import OptimizerConfig
from dflop_jax.runtime.train_state import StageOptimizer, apply_updates
from dflop_jax.train import run
from models.internvit import InternViTConfig
from models.internvl import InternVL, internvl_config

LAYOUT = Layout(
    (
        StageSpec("encoder", 0, 1, tp=1, dp=2, has_embedding=True),
        StageSpec("encoder", 1, 1, tp=1, dp=2, has_head=True),
    ),
    (
        StageSpec("llm", 0, 1, tp=2, dp=1, has_embedding=True),
        StageSpec("llm", 1, 1, tp=2, dp=1, has_head=True),
    ),
)
OPT = OptimizerConfig(lr=1e-2, warmup_steps=1, decay_steps=10, clip_norm=1.0)
TILE, V_DP, TILES_PER_SHARD, LENGTH = 28, 2, 2, 40


def _model() -> InternVL:
    """28 px tiles of 7 px patches: 4x4 patches + CLS -> CLS dropped, pixel shuffle 0.5 -> 4 tokens."""
    vision = InternViTConfig(hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                             image_size=TILE, patch_size=7, dtype="float32")  # fmt: skip
    text = tiny_decoder_config(vocab_size=64, num_layers=2, dtype="float32")
    with jax.default_device(jax.devices()[0]):
        return InternVL(internvl_config(vision, text), rngs=nnx.Rngs(0))


def _microbatch(rng, tokens_per_tile: int) -> dict:
    """One packed row of two segments; a random subset of the tiles' features placed in segment 1."""
    n = V_DP * TILES_PER_SHARD
    fidx = np.full((1, LENGTH), -1, np.int32)
    k = n * tokens_per_tile - 3  # leave some features unplaced
    fidx[0, 2 : 2 + k] = rng.permutation(n * tokens_per_tile)[:k]
    seg = np.ones((1, LENGTH), np.int32)
    seg[0, 30:] = 2
    pos = np.concatenate([np.arange(30), np.arange(LENGTH - 30)])[None].astype(np.int32)
    tokens = rng.integers(1, 64, (1, LENGTH)).astype(np.int32)
    return {
        "tiles": rng.standard_normal((n, TILE, TILE, 3)).astype(np.float32),
        "tile_valid": np.ones(n, bool),
        "tile_pool": np.zeros(n, bool),
        "tokens": tokens,
        "segment_ids": seg,
        "positions": pos,
        "feature_index": fidx,
        "targets": np.roll(tokens, -1, axis=1),
        "loss_mask": (rng.random((1, LENGTH)) < 0.6).astype(np.float32),
    }


def _internvl_loss(m, mb):
    keys = ("tiles", "tile_pool", "tokens", "segment_ids", "positions", "feature_index", "targets",
            "loss_mask")  # fmt: skip
    return m.loss(*(mb[k] for k in keys))[0]


@pytest.mark.slow  # over a minute in the fast tier (CI's second tier runs it)
def test_internvl_pipeline_matches_single_device():
    model = _model()
    rng = np.random.default_rng(0)
    mbs = [_microbatch(rng, model.cfg.tokens_per_tile) for _ in range(3)]  # one shape: one compile
    norm = sum(float(m["loss_mask"].sum()) for m in mbs)
    stages = build_stages(model.cfg, LAYOUT, stage_meshes(LAYOUT), 0, compute_dtype=jnp.float32)
    opts = [StageOptimizer(s, OPT.build()) for s in stages]
    # No host round trip: encoder features (data-sharded, dp 2) reach the LLM stage (replicated over
    # its 1 x 2 mesh) and their cotangents come back device to device.
    with no_host_round_trip():
        out = run_pipeline(stages, mbs, norm, "1f1b")
    loss = sum(float(x) for x in out.loss)
    apply_updates(opts, out.grads, OPT.clip_norm)

    ref_loss, new, _ = reference_step(model, mbs, norm, OPT, _internvl_loss)
    specs = [StageSpec("encoder", 0, 2), StageSpec("llm", 0, 2)]
    ref_tree = model_tree(specs, [new["encoder"], new["llm"]], [{}, {}])
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)  # float32 round-off of a ~4.2 loss
    got = model_tree(list(LAYOUT.stages), [s.params for s in stages], [{} for _ in stages])
    assert_trees_close(got, ref_tree)


def _cfg(tmp_path, *extra):
    over = [
        "model.kind=internvl",
        "data.model_family=internvl",
        *TINY_TRAIN_DECODER,
        "model.vision_hidden_size=16",
        "model.vision_intermediate_size=32",
        "model.vision_num_layers=2",
        "model.vision_num_heads=2",
        f"data.synth_dir={tmp_path / 'synth'}",
        "data.synth_samples=32",
        "data.tile_size=56",  # 4x4 patches of 14 px -> pixel shuffle -> 4 tokens per tile
        "data.patch_size=14",
        "data.max_grid=2",
        "data.max_tiles=4",
        "data.max_frames=4",
        "data.max_tokens=512",
        "data.cache_dir=",
        "layout.encoder_layers=[1, 1]",
        "layout.encoder_dp=2",
        "layout.llm_layers=[1, 1]",
        "layout.llm_tp=[2]",
        "layout.tiles=[16]",
        "layout.lengths=[512]",
        "layout.microbatches=[1, 4]",
        "scheduler.solver=greedy",
        "global_batch=4",
        "steps=2",
        "optimizer.lr=0.01",
        "optimizer.warmup_steps=1",
        "compute_dtype=float32",
        "measure_stage_times_every=0",
        "compilation_cache=",
        f"run_dir={tmp_path / 'run'}",
        "device.peak_flops=1000000000.0",
    ]
    return load_config(TrainConfig, None, over + list(extra))


def test_internvl_kind_must_match_data_family(tmp_path):
    with pytest.raises(ConfigError, match="model.kind"):
        _cfg(tmp_path, "data.model_family=llava_ov")


@pytest.mark.slow
def test_internvl_trains_two_steps(tmp_path):
    """The trainer path (config -> model -> loader -> stages); the math is the test above's."""
    report = run(_cfg(tmp_path))
    assert len(report.layout.encoder_stages) == 2 and len(report.layout.llm_stages) == 2
    assert len(report.losses) == 2 and np.all(np.isfinite(report.losses))
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # The encoder really ran on image tiles (a batch may happen to hold text samples only).
    assert min(r["encoder_padding_ratio"] for r in rows) < 1.0
    for r in rows:
        enc, llm = r["encoder_padding_ratio"], r["llm_padding_ratio"]
        assert r["stage_padding_ratio"] == [enc, enc, llm, llm]
