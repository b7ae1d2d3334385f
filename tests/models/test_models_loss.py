"""Chunked cross-entropy (`models.loss.chunked_cross_entropy_sum`): the same value and gradients as the
full-logits loss (untied [D,V] and tied [V,D] heads, chunk dividing S or not, masked tokens, tp=2 with
the vocabulary sharded), and compiled temporaries that no longer hold the [B,S,V] float32 logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from models_fixtures import tiny_decoder_config

from dflop_jax.programs.sharding import rules_for, state_shardings
from models.decoder import Decoder
from models.loss import chunked_cross_entropy_sum, cross_entropy_sum

TOL = 1e-5
B, S, D, V = 2, 12, 16, 40


def _reference(h, w, tied, targets, mask):
    """The pre-chunking loss, written independently: log_softmax + take_along_axis on full logits."""
    logits = h @ (w.T if tied else w)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mask)


def _chunked(h, w, tied, targets, mask, chunk):
    head = (lambda x: x @ w.T) if tied else (lambda x: x @ w)
    return chunked_cross_entropy_sum(h, head, targets, mask, chunk=chunk)[0]


def _inputs(tied, seed=0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(V, D) if tied else (D, V)) * 0.5, jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, (B, S)), jnp.int32)
    mask = jnp.asarray(rng.random((B, S)) < 0.7, jnp.float32).at[:, -1].set(0.0)
    return h, w, targets, mask


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [4, 5, 12, 100])  # divides S, leaves a tail of 2, == S, > S
def test_chunked_matches_full_logits_value_and_grads(tied, chunk):
    h, w, targets, mask = _inputs(tied)
    ref, (ref_dh, ref_dw) = jax.value_and_grad(_reference, argnums=(0, 1))(
        h, w, tied, targets, mask
    )
    got, (dh, dw) = jax.jit(jax.value_and_grad(_chunked, argnums=(0, 1)), static_argnums=(2, 5))(
        h, w, tied, targets, mask, chunk
    )
    assert abs(float(got) - float(ref)) <= TOL * abs(float(ref))
    np.testing.assert_allclose(dh, ref_dh, atol=TOL)
    np.testing.assert_allclose(dw, ref_dw, atol=TOL)
    assert np.abs(np.asarray(dh)[np.asarray(mask) == 0]).max() == 0.0  # masked tokens: no gradient


def test_count_and_logits_form_agree():
    h, w, targets, mask = _inputs(False)
    total, count = chunked_cross_entropy_sum(h, lambda x: x @ w, targets, mask, chunk=5)
    full, full_count = cross_entropy_sum(h @ w, targets, mask)
    assert float(count) == float(full_count) == float(np.asarray(mask).sum())
    assert abs(float(total) - float(full)) <= TOL * abs(float(full))


def test_chunk_must_be_positive():
    h, w, targets, mask = _inputs(False)
    with pytest.raises(ValueError, match="chunk=0"):
        chunked_cross_entropy_sum(h, lambda x: x @ w, targets, mask, chunk=0)
    with pytest.raises(ValueError, match="loss_chunk"):
        tiny_decoder_config(loss_chunk=0)


def _batch(cfg, b=2, s=12):
    rng = np.random.default_rng(3)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, s)), jnp.int32)
    seg = jnp.asarray(np.repeat([[1] * 5 + [2] * 5 + [0] * 2], b, 0), jnp.int32)
    pos = jnp.asarray(np.repeat([list(range(5)) * 2 + [0, 0]], b, 0), jnp.int32)
    targets = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, s)), jnp.int32)
    return ids, seg, pos, targets, (seg > 0).astype(jnp.float32)


def _logits_loss(model, ids, seg, pos, targets, mask):
    return cross_entropy_sum(model(ids, seg, pos), targets, mask)[0]


def _model_loss(model, ids, seg, pos, targets, mask):
    return model.loss(ids, targets, mask, seg, pos)[0]


def _assert_same_grads(got, ref):
    flat_ref = dict(nnx.to_flat_state(ref))
    paths = []
    for path, g in nnx.to_flat_state(got):
        np.testing.assert_allclose(g[...], flat_ref[path][...], atol=1e-4, err_msg=str(path))
        paths.append(path)
    assert set(paths) == set(flat_ref)


@pytest.mark.parametrize("tied", [False, True])
def test_decoder_loss_equals_logits_path(tied):
    """`Decoder.loss` (chunk 5 of S=12: two chunks and a tail) == cross-entropy of the full logits."""
    cfg = tiny_decoder_config(tie_embeddings=tied, loss_chunk=5)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    batch = _batch(cfg)
    ref, ref_grads = nnx.jit(nnx.value_and_grad(_logits_loss))(model, *batch)
    got, grads = nnx.jit(nnx.value_and_grad(_model_loss))(model, *batch)
    assert abs(float(got) - float(ref)) <= 1e-4
    _assert_same_grads(grads, ref_grads)


@pytest.mark.parametrize("tied", [False, True])
def test_decoder_loss_tp2_vocab_sharded_equals_unsharded(tied):
    """tp=2 shards the head's vocabulary over "model": the chunked log-sum-exp still normalizes over
    the whole vocabulary (loss and gradients equal the unsharded full-logits loss)."""
    cfg = tiny_decoder_config(vocab_size=64, num_layers=2, tie_embeddings=tied, loss_chunk=5)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    batch = _batch(cfg)
    ref, ref_grads = nnx.jit(nnx.value_and_grad(_logits_loss))(model, *batch)
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    rules = rules_for("decoder")
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, state_shardings(state, mesh, rules))
    sharded = nnx.merge(graphdef, state)
    head = sharded.stage.embed_tokens.weight if tied else sharded.stage.lm_head
    assert {s.data.shape[0 if tied else 1] for s in head[...].addressable_shards} == {32}
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        got, grads = nnx.jit(nnx.value_and_grad(_model_loss))(sharded, *batch)
    assert abs(float(got) - float(ref)) <= 1e-4
    _assert_same_grads(grads, ref_grads)


def _temp_bytes(loss_fn, s, d=64, v=8192) -> int:
    """Compiled temporaries of value_and_grad w.r.t. (h, w) at B=1, from abstract shapes."""
    args = (
        jax.ShapeDtypeStruct((1, s, d), jnp.float32),
        jax.ShapeDtypeStruct((d, v), jnp.float32),
        jax.ShapeDtypeStruct((1, s), jnp.int32),
        jax.ShapeDtypeStruct((1, s), jnp.float32),
    )
    step = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))
    return step.lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_chunked_loss_memory_does_not_grow_with_the_sequence():
    """From S=1024 to S=4096 the full-logits program's temporaries grow by at least the extra
    [dS, V] float32 logits; the chunked one's grow only by hidden-sized [dS, D] buffers, and stay
    within a few chunks' logits."""
    d, v, chunk = 64, 8192, 256

    def full(h, w, t, m):
        return cross_entropy_sum(h @ w, t, m)[0]

    def chunked(h, w, t, m):
        return chunked_cross_entropy_sum(h, lambda x: x @ w, t, m, chunk=chunk)[0]

    (f1, f4), (c1, c4) = (
        [_temp_bytes(fn, s, d, v) for s in (1024, 4096)] for fn in (full, chunked)
    )
    extra = 4096 - 1024
    assert f4 - f1 >= extra * v * 4
    assert c4 - c1 <= 2 * extra * d * 4, (c1, c4)
    assert c4 <= 5 * chunk * v * 4 < f1, (c4, f1)


def test_sharded_loss_keeps_vocab_split():
    """On a tp=2 mesh each device's chunk logits are its half of the vocabulary: the compiled
    chunked loss holds no all-gather (the logits are never gathered to one device)."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    b, s, d, v = 2, 64, 32, 256
    w = jax.ShapeDtypeStruct((d, v), jnp.float32, sharding=NamedSharding(mesh, P(None, "model")))
    h = jax.ShapeDtypeStruct((b, s, d), jnp.float32, sharding=NamedSharding(mesh, P()))
    ids = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=NamedSharding(mesh, P()))
    mask = jax.ShapeDtypeStruct((b, s), jnp.float32, sharding=NamedSharding(mesh, P()))

    def loss(h, w, t, m):
        head = lambda x: jax.lax.with_sharding_constraint(x @ w, P(None, None, "model"))
        return chunked_cross_entropy_sum(h, head, t, m, chunk=16)[0]

    with jax.set_mesh(mesh):
        hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(h, w, ids, mask)
        text = hlo.compile().as_text()
    assert "all-reduce" in text and "all-gather" not in text
