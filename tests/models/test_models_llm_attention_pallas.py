"""Pallas flash attention for packed rows (`implementation="pallas"`): values and gradients equal the
XLA path's in float32 (interpret mode on CPU; packed rows of 1..16 samples, a padding gap, GQA, head
dims 64 and 128, causal or not), its block ranges against brute force (a key block that no query
of a block may attend to is outside the block's range, so it is never loaded) and, on a GPU, the
compiled Triton kernels against the XLA path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models_fixtures import packed_segment_ids

from models.attention import attention, attention_mask
from models.pallas_attention import (
    NUM_STAGES,
    SMEM_BUDGET,
    block_ranges,
    gpu_block,
    head_width,
    pallas_attention,
    visited_blocks,
)

TOL = 2e-5  # float32 round-off of values and gradients of O(1) (both sides tile differently)


def _rows(s):
    """One sample, three samples and a padding tail, 16 short samples, a padding gap."""
    return np.stack(
        [
            packed_segment_ids(s, [s]),
            packed_segment_ids(s, [30, 21, 17]),
            packed_segment_ids(s, [5] * 16),
            packed_segment_ids(s, [13, -7, 20, 9]),
        ]
    )


def _qkv(b, s, h, kv, dh, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((b, s, h, dh), (b, s, kv, dh), (b, s, kv, dh), (b, s, h, dh))
    return tuple(jnp.asarray(rng.standard_normal(x), jnp.float32) for x in shapes)


def _value_and_grads(fn, q, k, v, w):
    """(out, dq, dk, dv) of sum(fn(q, k, v) * w)."""
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(w))


def _check(seg, causal, h, kv, dh, block):
    q, k, v, w = _qkv(seg.shape[0], seg.shape[1], h, kv, dh)

    def ours(q, k, v):
        return pallas_attention(q, k, v, seg, causal, block=block, interpret=True)

    def xla(q, k, v):
        return attention(q, k, v, segment_ids=seg, causal=causal, implementation="xla")

    got = jax.jit(_value_and_grads, static_argnums=0)(ours, q, k, v, w)
    want = jax.jit(_value_and_grads, static_argnums=0)(xla, q, k, v, w)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOL, rtol=TOL, err_msg=name)


@pytest.mark.parametrize("causal", [True, False])
def test_values_and_grads_equal_xla_head_dim_64(causal):
    # 80 tokens in blocks of 32: the row is padded to 96 (a fresh segment the kernel drops).
    _check(jnp.asarray(_rows(80)), causal, h=4, kv=2, dh=64, block=32)


def test_values_and_grads_equal_xla_head_dim_128_gqa_4_to_1():
    _check(jnp.asarray(_rows(64)[1:3]), True, h=4, kv=1, dh=128, block=16)


def test_no_segment_ids_is_one_segment():
    q, k, v, _ = _qkv(1, 48, 2, 2, 64)
    ours = pallas_attention(q, k, v, None, True, block=16, interpret=True)
    want = attention(q, k, v, segment_ids=None, causal=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(ours), np.asarray(want), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("causal", [True, False])
def test_block_ranges_hold_every_needed_block_and_only_those(causal):
    """Query block i's key range holds every key block with an allowed pair; with contiguous
    samples nothing else (a gap's id-0 runs are one id: what lies between them is visited)."""
    s, block = 128, 16
    rows = _rows(s)
    keys, queries = (np.asarray(x) for x in block_ranges(jnp.asarray(rows), block, causal))
    n = s // block
    for r, ids in enumerate(rows):
        mask = np.asarray(attention_mask(jnp.asarray(ids[None]), s, causal))[0, 0]
        need = mask.reshape(n, block, n, block).any((1, 3))  # [query block, key block]
        for i in range(n):
            lo, hi = keys[r, i]
            assert need[i, :lo].sum() == 0 and need[i, hi:].sum() == 0, (r, i)
            lo, hi = queries[r, i]
            assert need[:lo, i].sum() == 0 and need[hi:, i].sum() == 0, (r, i)
        if r < 3:  # contiguous samples: the ranges are exactly the needed blocks
            visited = np.zeros((n, n), bool)
            for i, (lo, hi) in enumerate(keys[r]):
                visited[i, lo:hi] = True
            np.testing.assert_array_equal(visited, need)
    # 16 samples of 5 tokens from the row's start: causal query block 2 (tokens 32..47) needs key
    # blocks 1 (token 30's sample) and 2 only, not block 0.
    if causal:
        assert tuple(keys[2, 2]) == (1, 3)


def test_gpu_block_by_head_dim_length_and_dtype():
    """The compiled kernels' tile: the largest whose q tile and double-buffered k / v tiles fit the
    shared-memory budget at the padded head dim (bf16: 128 up to Dh 64, 64 at Dh 72..128 (SigLIP's
    72 runs at width 128), 32 at 256; float32 half), never longer than the row."""
    assert [gpu_block(dh, 8192) for dh in (32, 64, 72, 128, 256)] == [128, 128, 64, 64, 32]
    assert [gpu_block(dh, 8192, itemsize=4) for dh in (64, 72, 128, 256)] == [64, 32, 32, 16]
    for dh in (32, 64, 72, 128, 256):
        for itemsize in (2, 4):
            block, width = gpu_block(dh, 8192, itemsize), head_width(dh)
            tiles = (1 + 2 * NUM_STAGES) * width * itemsize  # bytes per tile row
            assert block * tiles <= SMEM_BUDGET and (
                block == 128 or 2 * block * tiles > SMEM_BUDGET
            )
    assert (gpu_block(64, 40), gpu_block(64, 10), gpu_block(128, 100)) == (64, 16, 64)


def test_bad_block_is_refused():
    q, k, v, _ = _qkv(1, 32, 2, 2, 64)
    with pytest.raises(ValueError, match="block=24 must be a power of two >= 16"):
        pallas_attention(q, k, v, None, True, block=24, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dh", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_triton_kernels_equal_xla_on_gpu(dh, causal):
    """The compiled kernels (not interpreted), default block, float32 at highest matmul precision."""
    seg = jnp.asarray(_rows(640))
    q, k, v, w = _qkv(seg.shape[0], seg.shape[1], 8, 2, dh)

    def ours(q, k, v):
        return attention(q, k, v, segment_ids=seg, causal=causal, implementation="pallas")

    def xla(q, k, v):
        return attention(q, k, v, segment_ids=seg, causal=causal, implementation="xla")

    with jax.default_matmul_precision("highest"):
        got = jax.jit(_value_and_grads, static_argnums=0)(ours, q, k, v, w)
        want = jax.jit(_value_and_grads, static_argnums=0)(xla, q, k, v, w)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lengths", [[300], [30, 21, 17], [5] * 16, [64, 64, 100], [1] * 40])
def test_cost_model_counts_the_tiles_the_kernel_visits(lengths, causal):
    """`costs.flops.visited_pairs` (pure Python, what the cost model counts) equals the kernel's own
    block ranges x block^2, and a row of many samples visits far fewer tiles than the causal square."""
    from dflop_jax.costs.flops import visited_pairs

    s, block = 320, 32
    seg = jnp.asarray(packed_segment_ids(s, lengths)[None])
    kernel = float(visited_blocks(seg, block, causal)[0]) * block * block
    assert visited_pairs(lengths, s, block, causal) == kernel
    # 16 samples of 20 filling the row: 1 or 2 tiles per query block (18), vs 55 causal tiles
    assert visited_pairs([20] * 16, s, block) == 18 * block * block


def _sharded_run(impl, rules):
    """loss and grads of attention on a (data 2, model 4) mesh, heads and rows sharded, and the
    all-gathers of the compiled program."""
    from flax import nnx
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"),
                axis_types=(AxisType.Auto, AxisType.Auto))  # fmt: skip
    seg = jnp.asarray(_rows(96)[1:3])
    q, k, v, _ = _qkv(2, 96, 8, 4, 64)

    def loss(q, k, v, seg):
        out = attention(q, k, v, segment_ids=seg, causal=True, implementation=impl)
        return (out**2).sum()

    heads = NamedSharding(mesh, P("data", None, "model", None))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        args = (*(jax.device_put(x, heads) for x in (q, k, v)),
                jax.device_put(seg, NamedSharding(mesh, P("data", None))))  # fmt: skip
        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        gathers = fn.lower(*args).compile().as_text().count("all-gather")
        return fn(*args), gathers


def test_tensor_parallel_heads_run_on_their_own_devices():
    """GSPMD cannot split a Pallas call: under the runtime's rules (heads on "model", rows on
    "data") each device runs its own heads' kernels (no all-gather), with the XLA path's values;
    without the rules the heads are gathered onto every device."""
    from dflop_jax.programs.sharding import rules_for

    rules = rules_for("decoder")
    (value, grads), gathers = _sharded_run("pallas", rules)
    (want, want_grads), _ = _sharded_run("xla", rules)
    assert gathers == 0
    np.testing.assert_allclose(float(value), float(want), rtol=1e-5)
    for a, b in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)
    assert _sharded_run("pallas", ())[1] > 0
