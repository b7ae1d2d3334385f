"""Packed-row attention: independent numpy reference, jax.nn.dot_product_attention, per-sample runs.
The "cudnn" paths' arguments are checked in test_models_llm_attention_cudnn.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import attention as _attention
from models.attention import attention_mask

TOL = 1e-4
# jitted: one compile instead of many eager dispatches (keeps the test fast on a loaded machine)
attention = jax.jit(_attention, static_argnames=("causal", "implementation"))


def _qkv(b=2, s=10, h=4, k=2, dh=8, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in ((b, s, h, dh), (b, s, k, dh), (b, s, k, dh))
    )


def _numpy_reference(q, k, v, seg, causal):
    """Per (row, head, query) loop: softmax over the allowed keys only."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, s, h, dh = q.shape
    group = h // k.shape[2]
    out = np.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            for i in range(s):
                allowed = [
                    j
                    for j in range(s)
                    if (seg is None or seg[bi, i] == seg[bi, j]) and (not causal or j <= i)
                ]
                logits = np.array(
                    [q[bi, i, hi] @ k[bi, j, hi // group] for j in allowed]
                ) / np.sqrt(dh)
                p = np.exp(logits - logits.max())
                p /= p.sum()
                out[bi, i, hi] = sum(pj * v[bi, j, hi // group] for pj, j in zip(p, allowed))
    return out


SEGMENTS = np.array([[1, 1, 1, 2, 2, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 2, 2, 2, 2]], np.int32)


@pytest.mark.parametrize("causal", [True, False])
def test_matches_numpy_reference_with_segments_and_gqa(causal):
    q, k, v = _qkv()
    out = attention(q, k, v, segment_ids=jnp.asarray(SEGMENTS), causal=causal)
    ref = _numpy_reference(q, k, v, SEGMENTS, causal)
    assert np.abs(np.asarray(out) - ref).max() <= TOL


def test_no_segments_non_causal_is_full_attention():
    q, k, v = _qkv(h=2, k=2)
    out = attention(q, k, v, segment_ids=None, causal=False)
    assert np.abs(np.asarray(out) - _numpy_reference(q, k, v, None, False)).max() <= TOL


@pytest.mark.parametrize("causal", [True, False])
def test_equals_jax_dot_product_attention_xla(causal):
    q, k, v = _qkv()
    seg = jnp.asarray(SEGMENTS)
    ours = attention(q, k, v, segment_ids=seg, causal=causal, implementation="xla")
    mask = attention_mask(seg, q.shape[1], causal)
    theirs = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    assert np.abs(np.asarray(ours) - np.asarray(theirs)).max() <= TOL


def test_packed_row_equals_each_sample_alone():
    q, k, v = _qkv(b=1, s=9)
    seg = jnp.asarray([[1, 1, 1, 1, 2, 2, 2, 0, 0]], jnp.int32)
    packed = np.asarray(attention(q, k, v, segment_ids=seg, causal=True))
    for lo, hi in ((0, 4), (4, 7)):
        alone = attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], segment_ids=None, causal=True)
        assert np.abs(packed[:, lo:hi] - np.asarray(alone)).max() <= TOL


def test_padding_rows_are_finite_and_gradients_too():
    q, k, v = _qkv(b=1, s=6)
    seg = jnp.asarray([[1, 1, 0, 0, 0, 0]], jnp.int32)

    def f(q, k, v):
        return jnp.sum(attention(q, k, v, segment_ids=seg, causal=True))

    assert np.isfinite(np.asarray(attention(q, k, v, segment_ids=seg, causal=True))).all()
    for g in jax.grad(f, argnums=(0, 1, 2))(q, k, v):
        assert np.isfinite(np.asarray(g)).all()


def test_bad_arguments_raise_clear_errors():
    q, k, v = _qkv(h=3, k=2)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attention(q, k, v, segment_ids=None, causal=True)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="implementation"):
        attention(q, k, v, segment_ids=None, causal=True, implementation="flash")


@pytest.mark.parametrize("causal", [True, False])
def test_dense_query_blocks_equal_whole_rows_forward_and_grads(causal):
    from models.attention import dense_attention

    q, k, v = _qkv(s=12)
    seg = jnp.asarray(np.repeat([[1] * 5 + [2] * 4 + [0] * 3], 2, 0), jnp.int32)

    def loss(block, q, k, v):
        out = dense_attention(q, k, v, seg, causal, block)
        return jnp.sum(out * jnp.cos(out)), out

    grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3), has_aux=True), static_argnums=0)
    (g_whole, out_whole), (g_blocks, out_blocks) = grad(None, q, k, v), grad(4, q, k, v)
    assert (
        np.abs(np.asarray(out_blocks) - _numpy_reference(q, k, v, np.asarray(seg), causal)).max()
        <= TOL
    )
    assert np.abs(np.asarray(out_blocks) - np.asarray(out_whole)).max() <= TOL
    for a, b in zip(g_whole, g_blocks):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= TOL


@pytest.mark.parametrize("causal", [True, False])
def test_tiled_path_matches_numpy_reference_forward_and_grads(causal):
    """The tiled path (tiles of 4, a padded last tile) against the numpy reference and the dense
    path's gradients."""
    from models.attention import blocked_attention, dense_attention

    q, k, v = _qkv(s=10)
    seg = jnp.asarray(SEGMENTS)

    def loss(fn, q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out * jnp.cos(out) * (seg != 0)[:, :, None, None]), out

    grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3), has_aux=True), static_argnums=0)
    g_tiles, out_tiles = grad(lambda *a: blocked_attention(*a, seg, causal, 4), q, k, v)
    g_dense, _ = grad(lambda *a: dense_attention(*a, seg, causal), q, k, v)
    assert np.abs(np.asarray(out_tiles) - _numpy_reference(q, k, v, SEGMENTS, causal)).max() <= TOL
    for a, b in zip(g_dense, g_tiles):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= TOL
