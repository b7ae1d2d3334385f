"""MLLM stage splits equal the unsplit model (loss and gradients); placement and pooling semantics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.decoder_config import DecoderConfig
from models.internvit import InternViTConfig
from models.internvl import InternVL, internvl_config
from models.llava_onevision import LlavaOnevision, llava_onevision_config
from models.mllm import extract_stages
from models.placement import NEWLINE, TEXT, place_features
from models.projector import pool_2x2, pool_tiles
from models.siglip import SiglipConfig

TEXT_CFG = DecoderConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    qkv_bias=True,
)  # fmt: skip


def _llava():
    vision = SiglipConfig(
        hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, image_size=28, patch_size=7
    )
    return LlavaOnevision(llava_onevision_config(vision, TEXT_CFG), rngs=nnx.Rngs(0))


def _internvl():
    vision = InternViTConfig(
        hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, image_size=28, patch_size=7
    )
    return InternVL(
        internvl_config(vision, TEXT_CFG.replace(tie_embeddings=True)), rngs=nnx.Rngs(0)
    )


def _batch(model, tiles_n=3, s=40, seed=0):
    rng = np.random.default_rng(seed)
    cfg = model.cfg
    tpt = cfg.tokens_per_tile
    tiles = rng.standard_normal((tiles_n, 28, 28, 3)).astype(np.float32)
    pool = np.array([False, True, False][:tiles_n])
    fidx = np.full((2, s), TEXT, np.int32)
    fidx[0, 3 : 3 + tpt] = np.arange(tpt)  # tile 0 in row 0
    fidx[1, 5 : 5 + tpt] = np.arange(tpt) + 2 * tpt  # tile 2 in row 1
    fidx[1, 2] = 1 * tpt + 1  # a pooled feature of tile 1
    if cfg.has_newline:
        fidx[0, 3 + tpt] = NEWLINE
    seg = np.ones((2, s), np.int32)
    seg[1, s // 2 :] = 2
    pos = np.concatenate(
        [np.arange(s)[None], np.concatenate([np.arange(s // 2), np.arange(s - s // 2)])[None]]
    )
    tokens = rng.integers(1, 60, (2, s)).astype(np.int32)
    targets = np.roll(tokens, -1, axis=1)
    mask = (rng.random((2, s)) < 0.5).astype(np.float32)
    return tuple(
        jnp.asarray(x)
        for x in (tiles, pool, tokens, seg, pos.astype(np.int32), fidx, targets, mask)
    )


def _flat(tree):
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(tree)}


@pytest.mark.parametrize(
    "build, enc_split, llm_split", [(_llava, (1, 1), (1, 0, 1)), (_internvl, (1, 1), (1, 1))]
)
def test_stage_split_equals_unsplit(build, enc_split, llm_split):
    model = build()
    tiles, pool, tokens, seg, pos, fidx, targets, mask = _batch(model)

    def whole_loss(m):
        total, count = m.loss(tiles, pool, tokens, seg, pos, fidx, targets, mask)
        return total / count

    lw, gw = nnx.jit(nnx.value_and_grad(whole_loss))(model)
    encs, llms = extract_stages(model, enc_split, llm_split)

    def split_loss(encs, llms):
        x = tiles
        for e in encs:
            x = e(x, pool)
        h = llms[0].embed(tokens, x, fidx)
        for stage in llms:
            h = stage(h, seg, pos)
        total, count = llms[-1].loss(h, targets, mask)
        return total / count

    ls, (ge, gl) = nnx.jit(nnx.value_and_grad(split_loss, argnums=(0, 1)))(encs, llms)
    np.testing.assert_allclose(ls, lw, rtol=1e-6)
    want = _flat(gw)
    firsts = (
        [sum(enc_split[:i]) for i in range(len(enc_split))],
        [sum(llm_split[:i]) for i in range(len(llm_split))],
    )
    summed: dict = {}
    for prefix, layer_key, grads, starts in (
        ("encoder", ("vision", "layers"), ge, firsts[0]),
        ("llm", ("decoder", "layers"), gl, firsts[1]),
    ):
        for g, first in zip(grads, starts, strict=True):
            for path, value in _flat(g).items():
                if path[:2] == layer_key:
                    path = (*layer_key, first + path[2], *path[3:])
                key = (prefix, *path)
                summed[key] = summed.get(key, 0) + value  # tied embedding: copies' gradients add up
    assert set(summed) == set(want)
    for key, value in summed.items():
        np.testing.assert_allclose(value, want[key], atol=2e-6, err_msg=str(key))
    # gradients reach the first encoder stage through every cut
    assert np.abs(_flat(ge[0])[("vision", "patch_kernel")]).max() > 0


def test_place_features_gather_and_gradients():
    embeds = jnp.arange(2 * 5 * 3, dtype=jnp.float32).reshape(2, 5, 3)
    feats = 100 + jnp.arange(4 * 3, dtype=jnp.float32).reshape(4, 3)
    newline = jnp.array([-1.0, -2.0, -3.0])
    fidx = jnp.array([[TEXT, 0, 3, NEWLINE, TEXT], [2, 2, TEXT, TEXT, 1]], jnp.int32)
    out = place_features(embeds, feats, fidx, newline)
    np.testing.assert_array_equal(out[0, 0], embeds[0, 0])
    np.testing.assert_array_equal(out[0, 2], feats[3])
    np.testing.assert_array_equal(out[0, 3], newline)
    np.testing.assert_array_equal(out[1, 0], feats[2])
    g_feats, g_nl = jax.grad(lambda f, n: place_features(embeds, f, fidx, n).sum(), argnums=(0, 1))(
        feats, newline
    )
    np.testing.assert_array_equal(g_feats[:, 0], [1, 1, 2, 1])  # feature 2 used twice
    np.testing.assert_array_equal(g_nl, [1, 1, 1])
    taps = jnp.stack([fidx, jnp.where(fidx >= 0, 0, fidx)], -1)
    w = jnp.stack([jnp.full(fidx.shape, 0.25), jnp.full(fidx.shape, 0.75)], -1)
    mixed = place_features(embeds, feats, taps, newline, w)
    np.testing.assert_allclose(mixed[1, 0], 0.25 * feats[2] + 0.75 * feats[0])
    np.testing.assert_array_equal(mixed[0, 4], embeds[0, 4])


def test_video_pooling_shape_and_slot_convention():
    p, d = 27, 4
    feats = jnp.asarray(np.random.default_rng(0).standard_normal((3, p * p, d)), jnp.float32)
    assert pool_2x2(feats, p).shape == (3, 196, d)
    out = pool_tiles(feats, jnp.array([False, True, False]), p)
    assert out.shape == feats.shape
    np.testing.assert_array_equal(out[0], feats[0])
    np.testing.assert_allclose(out[1, :196], pool_2x2(feats, p)[1], atol=1e-6)
    assert not np.any(np.asarray(out[1, 196:]))
    const = pool_2x2(jnp.ones((1, p * p, 1)), p)  # bilinear weights sum to 1
    np.testing.assert_allclose(const, 1.0, atol=1e-6)
