"""Tiled attention that skips masked tiles: values and gradients against an independent dense
reference (`jax.nn.dot_product_attention`, XLA, explicit mask), the tile plan against brute force,
and proof that skipped tiles are not computed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models_fixtures import packed_segment_ids

from models.attention import (
    MIN_BLOCK,
    attention,
    attention_mask,
    block_plan,
    block_size,
    blocked_attention,
    dense_attention,
    dense_max,
)

TOL = 1e-5  # float32 round-off (values are O(1))


def _rows(s):
    """Row layouts: many short samples, one long sample, a padding tail, a padding gap, all padding."""
    rng = np.random.default_rng(1)
    short = rng.integers(1, 9, size=s)
    many = packed_segment_ids(s, list(short[np.cumsum(short) <= s - 3]))
    return np.stack(
        [
            many,
            packed_segment_ids(s, [s]),
            packed_segment_ids(s, [s - 11]),
            packed_segment_ids(s, [13, -7, 20, 9]),
            np.zeros(s, np.int32),
        ]
    )


def _qkv(b, s, h=4, kv=2, dh=8, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    shapes = ((b, s, h, dh), (b, s, kv, dh), (b, s, kv, dh), (b, s, h, dh))
    return tuple(jnp.asarray(rng.standard_normal(x), dtype) for x in shapes)


def _reference(q, k, v, seg, causal):
    mask = attention_mask(seg, q.shape[1], causal)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


def _value_and_grads(fn, q, k, v, w, seg):
    """Output and d/d(q, k, v) of sum(out * w * real), i.e. a loss that ignores padding rows."""
    real = (seg != 0)[:, :, None, None]

    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out * w * real), out

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("s", [64, 60])  # 60: padded to a multiple of the tile
def test_blocked_equals_dense_reference_values_and_grads(causal, s):
    seg = jnp.asarray(_rows(s))
    q, k, v, w = _qkv(seg.shape[0], s)
    ours = _value_and_grads(lambda *a: blocked_attention(*a, seg, causal, 8), q, k, v, w, seg)
    ref = _value_and_grads(lambda *a: _reference(*a, seg, causal), q, k, v, w, seg)
    (g_ours, out_ours), (g_ref, out_ref) = ours, ref
    assert np.abs(np.asarray(out_ours) - np.asarray(out_ref)).max() <= TOL
    for a, b in zip(g_ours, g_ref):
        assert np.isfinite(np.asarray(a)).all()
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= TOL


@pytest.mark.parametrize("causal", [True, False])
def test_public_attention_takes_blocked_path_on_long_cpu_rows(causal):
    s = 2 * MIN_BLOCK + 64  # 320: blocked on CPU, padded to a multiple of the tile
    assert s > dense_max("cpu") and s % block_size(s)
    seg = jnp.asarray(_rows(s)[:2])
    q, k, v, w = _qkv(2, s, h=2, kv=1)
    fn = jax.jit(lambda q, k, v: attention(q, k, v, segment_ids=seg, causal=causal))
    out = fn(q, k, v)
    assert np.abs(np.asarray(out) - np.asarray(_reference(q, k, v, seg, causal))).max() <= TOL
    assert "cond" in str(jax.make_jaxpr(fn)(q, k, v))  # the tiled path, with its conditionals


def test_no_segments_is_full_or_causal_attention():
    q, k, v, _ = _qkv(1, 48)
    for causal in (True, False):
        out = blocked_attention(q, k, v, None, causal, 16)
        ref = _reference(q, k, v, None, causal)
        assert np.abs(np.asarray(out) - np.asarray(ref)).max() <= TOL


def _brute_plan(seg, block, causal):
    b, s = seg.shape
    n = s // block
    plan = np.zeros((b, n, n), bool)
    for r in range(b):
        for i in range(n):
            for j in range(n):
                qi, kj = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
                allowed = seg[r, qi][:, None] == seg[r, kj][None, :]
                if causal:
                    allowed &= np.arange(s)[qi][:, None] >= np.arange(s)[kj][None, :]
                plan[r, i, j] = allowed.any()
    return plan


@pytest.mark.parametrize("causal", [True, False])
def test_plan_is_exact_for_packed_rows(causal):
    seg = _rows(64)
    plan = np.asarray(block_plan(jnp.asarray(seg), 8, causal))
    np.testing.assert_array_equal(plan, _brute_plan(seg, 8, causal))
    # many short samples causal: a band near the diagonal, far fewer tiles than the triangle
    assert not causal or plan[0].sum() < np.tril(np.ones((8, 8))).sum()


def test_plan_is_conservative_for_unordered_ids():
    seg = np.array([[3] * 8 + [1] * 8 + [2] * 8 + [1] * 8 + [0] * 8 + [3] * 8], np.int32)
    for causal in (True, False):
        plan = np.asarray(block_plan(jnp.asarray(seg), 8, causal))
        assert (plan >= _brute_plan(seg, 8, causal)).all()


@pytest.mark.parametrize("causal", [True, False])
def test_skipped_tiles_are_not_computed(causal):
    """NaN values in sample 1's keys/values reach sample 2 only through a computed tile (0 * NaN):
    the dense path is poisoned, the tiled path is not."""
    s, block = 64, 16
    seg = jnp.asarray([[1] * 32 + [2] * 32], jnp.int32)
    q, k, v, _ = _qkv(1, s)
    v = v.at[:, :32].set(jnp.nan)
    tiled = np.asarray(blocked_attention(q, k, v, seg, causal, block))
    dense = np.asarray(dense_attention(q, k, v, seg, causal))
    assert np.isfinite(tiled[:, 32:]).all()
    assert np.isnan(dense[:, 32:]).any()
    ref = _reference(q[:, 32:], k[:, 32:], v[:, 32:], None, causal)
    assert np.abs(tiled[:, 32:] - np.asarray(ref)).max() <= TOL


def test_bfloat16_inputs_track_float32():
    s = 64
    seg = jnp.asarray(_rows(s)[:2])
    q, k, v, _ = _qkv(2, s, dtype=jnp.bfloat16)
    out = blocked_attention(q, k, v, seg, True, 16)
    assert out.dtype == jnp.bfloat16
    ref = _reference(*(x.astype(jnp.float32) for x in (q, k, v)), seg, True)
    assert np.abs(np.asarray(out, np.float32) - np.asarray(ref)).max() <= 3e-2


def test_rows_and_heads_stay_sharded():
    """Rows are a batched axis of every tile (not a loop index), so data and head shardings
    survive the loops: gradients come back sharded like their inputs."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    s = 64
    seg = jnp.asarray(_rows(s)[:2])
    q, k, v, w = _qkv(2, s)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", None, "model", None)))
    (gq, gk, gv), out = _value_and_grads(
        lambda *a: blocked_attention(*a, seg, True, 16), put(q), put(k), put(v), w, seg
    )
    (rq, rk, rv), ref = _value_and_grads(lambda *a: _reference(*a, seg, True), q, k, v, w, seg)
    for g, r in ((gq, rq), (gk, rk), (gv, rv)):
        assert g.sharding.spec[0] == "data" and g.sharding.spec[2] == "model"
        assert np.abs(np.asarray(g) - np.asarray(r)).max() <= TOL


def test_block_size_policy():
    assert block_size(4096) == 256 and block_size(8192) == 512 and block_size(2048) == 128
    assert block_size(300) == MIN_BLOCK
    assert dense_max("cpu") == MIN_BLOCK and dense_max("gpu") == 1024


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_path_matches_reference(causal):
    s = 256
    seg = jnp.asarray(_rows(s)[:2])
    q, k, v, _ = _qkv(2, s, h=4, kv=2, dh=64, dtype=jnp.bfloat16)
    out = attention(q, k, v, segment_ids=seg, causal=causal, implementation="cudnn")
    ref = _reference(*(x.astype(jnp.float32) for x in (q, k, v)), seg, causal)
    real = np.asarray(seg != 0)
    err = np.abs(np.asarray(out, np.float32) - np.asarray(ref))[real]
    assert err.max() <= 3e-2
