"""Tensor parallelism on simulated CPU devices: mesh ("data", "model") with tp=2 and tp=4 gives the
same loss, logits and gradients as the unsharded model (tp=1)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from models_fixtures import tiny_decoder_config

from dflop_jax.programs.sharding import create_sharded, rules_for, state_shardings
from models.decoder import Decoder
from models.loss import cross_entropy_sum

TOL = 1e-4
# vocab and mlp divisible by 4; kv_heads=2 so tp=4 needs the kv_heads override (replicated K/V).
CFG = tiny_decoder_config(vocab_size=64, num_layers=2)


def _loss(model, ids, seg, pos, targets, mask):
    logits = model(ids, seg, pos)
    return cross_entropy_sum(logits, targets, mask)[0], logits


def _batch():
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 10)), jnp.int32)
    seg = jnp.asarray([[1] * 6 + [2] * 4, [1] * 8 + [0] * 2], jnp.int32)
    pos = jnp.asarray([list(range(6)) + list(range(4)), list(range(8)) + [0, 0]], jnp.int32)
    targets = jnp.roll(ids, -1, axis=1)
    return ids, seg, pos, targets, (seg > 0).astype(jnp.float32)


@pytest.fixture(scope="module")
def reference():
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    step = nnx.jit(nnx.value_and_grad(_loss, has_aux=True))
    (loss, logits), grads = step(model, *_batch())
    return model, float(loss), np.asarray(logits), grads


@pytest.mark.parametrize("tp, overrides", [(2, {}), (4, {"kv_heads": None, "act_kv_heads": None})])
def test_tensor_parallel_matches_single_device(reference, tp, overrides):
    model, ref_loss, ref_logits, ref_grads = reference
    mesh = Mesh(np.array(jax.devices()[: 2 * tp]).reshape(2, tp), ("data", "model"))
    rules = rules_for("decoder", overrides)
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, state_shardings(state, mesh, rules))
    sharded = nnx.merge(graphdef, state)
    q = sharded.stage.layers[0].attn.q_kernel[...]
    assert {s.data.shape[1] for s in q.addressable_shards} == {CFG.num_heads // tp}
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        step = nnx.jit(nnx.value_and_grad(_loss, has_aux=True))
        (loss, logits), grads = step(sharded, *_batch())
    assert abs(float(loss) - ref_loss) <= TOL
    assert np.abs(np.asarray(logits) - ref_logits).max() <= TOL
    flat_ref = dict(nnx.to_flat_state(ref_grads))
    for path, g in nnx.to_flat_state(grads):
        assert np.abs(np.asarray(g[...]) - np.asarray(flat_ref[path][...])).max() <= TOL, path


def test_create_sharded_equals_unsharded_init(reference):
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    sharded = create_sharded(lambda rngs: Decoder(CFG, rngs=rngs), 0, mesh, rules_for("decoder"))
    up = sharded.stage.layers[1].mlp.up[...]
    assert up.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    ref = dict(nnx.to_flat_state(nnx.state(reference[0], nnx.Param)))
    for path, v in nnx.to_flat_state(nnx.state(sharded, nnx.Param)):
        # same RNG stream; jit may fuse the init's scaling differently from eager (last-bit rounding)
        assert np.abs(np.asarray(v[...]) - np.asarray(ref[path][...])).max() <= 1e-6, path


def test_rules_for_rejects_unknown_names():
    with pytest.raises(ValueError, match="not a logical axis"):
        rules_for("decoder", {"hedas": None})
    with pytest.raises(ValueError, match="mesh axis"):
        rules_for("decoder", {"heads": "tensor"})
    with pytest.raises(ValueError, match="stage_kind"):
        rules_for("llm")


def test_real_shape_stage_lowers_sharded_from_abstract_values():
    """A Qwen2.5-7B layer at tp=4 compiles from shapes only (nothing materialized) and each device's
    arguments are exactly its parameter shards plus its slice of the activations."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from models.decoder import DecoderStage
    from models.decoder_config import DECODER_PRESETS

    cfg = DECODER_PRESETS["qwen2.5-7b"]
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    rules = rules_for("decoder")
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        graphdef, abs_state = nnx.get_abstract_model(
            lambda: DecoderStage(
                cfg,
                first_layer=0,
                num_layers=1,
                has_embedding=False,
                has_head=False,
                rngs=nnx.Rngs(0),
            ),
            mesh,
        )
        rows = NamedSharding(mesh, P("data"))
        h = jax.ShapeDtypeStruct((2, 256, cfg.hidden_size), jnp.bfloat16, sharding=rows)
        ids = jax.ShapeDtypeStruct((2, 256), jnp.int32, sharding=rows)
        forward = jax.jit(lambda state, h, seg, pos: nnx.merge(graphdef, state)(h, seg, pos))
        compiled = forward.lower(abs_state, h, ids, ids).compile()
    param_bytes = sum(
        int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
        for x in jax.tree.leaves(abs_state)
    )
    full_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(abs_state))
    assert param_bytes < full_bytes / 3.9  # everything but the two norms is split 4 ways
    input_bytes = 256 * cfg.hidden_size * 2 + 2 * 256 * 4  # one row per data shard
    assert compiled.memory_analysis().argument_size_in_bytes == param_bytes + input_bytes
