"""Tensor parallelism of the vision side: a LLaVA-OV-style MLLM (SigLIP layers, projector, placement,
decoder) on a ("data", "model") mesh with tp=2 / tp=4 gives the tp=1 loss and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from dflop_jax.programs.sharding import rules_for, state_shardings
from models.decoder_config import DecoderConfig
from models.llava_onevision import LlavaOnevision, llava_onevision_config
from models.placement import NEWLINE, TEXT
from models.siglip import SiglipConfig

TOL = 1e-4
TEXT_CFG = DecoderConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
    qkv_bias=True,
)  # fmt: skip
VISION = SiglipConfig(
    hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, image_size=28, patch_size=7
)


def _loss(model, tiles, pool, tokens, seg, pos, fidx, targets, mask):
    total, count = model.loss(tiles, pool, tokens, seg, pos, fidx, targets, mask)
    return total / count


def _batch():
    rng = np.random.default_rng(0)
    tiles = jnp.asarray(rng.standard_normal((4, 28, 28, 3)), jnp.float32)
    pool = jnp.asarray([False, False, True, False])
    tokens = jnp.asarray(rng.integers(1, 64, (2, 24)), jnp.int32)
    fidx = np.full((2, 24), TEXT, np.int32)
    fidx[0, 2:18] = np.arange(16)
    fidx[0, 18] = NEWLINE
    fidx[1, 1:17] = np.arange(16) + 48
    fidx[1, 17:21] = np.arange(4) + 32  # pooled frame: first 4 rows of its slot
    seg = jnp.ones((2, 24), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(24, dtype=jnp.int32), (2, 24))
    mask = jnp.asarray(rng.random((2, 24)) < 0.6, jnp.float32)
    return tiles, pool, tokens, seg, pos, jnp.asarray(fidx), jnp.roll(tokens, -1, 1), mask


@pytest.fixture(scope="module")
def reference():
    model = LlavaOnevision(llava_onevision_config(VISION, TEXT_CFG), rngs=nnx.Rngs(0))
    loss, grads = nnx.jit(nnx.value_and_grad(_loss))(model, *_batch())
    return model, float(loss), grads


@pytest.mark.parametrize(
    "tp, overrides",
    [(2, {}), pytest.param(4, {"kv_heads": None, "act_kv_heads": None}, marks=pytest.mark.slow)],
)
def test_mllm_tensor_parallel_matches_single_device(reference, tp, overrides):
    model, ref_loss, ref_grads = reference
    mesh = Mesh(np.array(jax.devices()[: 2 * tp]).reshape(2, tp), ("data", "model"))
    rules = rules_for("vision", overrides)
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, state_shardings(state, mesh, rules))
    sharded = nnx.merge(graphdef, state)
    fc1 = sharded.encoder.vision.layers[0].mlp.fc1[...]
    assert {s.data.shape[1] for s in fc1.addressable_shards} == {VISION.intermediate_size // tp}
    # the fused q / k / v kernel [D, 3, H, Dh] splits its heads, each device all three of its heads'
    qkv = sharded.encoder.vision.layers[0].attn.qkv_kernel[...]
    d, h = VISION.hidden_size, VISION.num_heads
    assert {s.data.shape for s in qkv.addressable_shards} == {(d, 3, h // tp, d // h)}
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        loss, grads = nnx.jit(nnx.value_and_grad(_loss))(sharded, *_batch())
    assert abs(float(loss) - ref_loss) <= TOL
    flat_ref = dict(nnx.to_flat_state(ref_grads))
    for path, g in nnx.to_flat_state(grads):
        assert np.abs(np.asarray(g[...]) - np.asarray(flat_ref[path][...])).max() <= TOL, path
