"""The "cudnn" attention paths (`models.cudnn_attention`, `models.cudnn_packed`).

On CPU (jax refuses to trace cuDNN without it): the arguments each path hands cuDNN, run through jax's
XLA path, against our XLA attention (values and gradients); the segment-ids -> offsets / lengths
conversion against a numpy reference, and the packed layout's semantics (attention within each run)
against our attention on every real token; the version / device check and the one logged line of
each fallback; the routing of rows with more runs than the bound. Marked `gpu`: each cuDNN path's
values and gradients against the XLA path on the shapes it serves (SigLIP tiles of 729 tokens, head
dim 72; a single-sample row; a packed row with padding; grouped-query heads 28 / 4)."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models_fixtures import packed_segment_ids

from models import cudnn_attention as ca
from models import cudnn_packed as cp
from models.attention import attention

TOL = 1e-5  # float32 round-off


def _qkv(b, s, h, kv, dh, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    shapes = ((b, s, h, dh), (b, s, kv, dh), (b, s, kv, dh), (b, s, h, dh))
    return tuple(jnp.asarray(rng.standard_normal(x), dtype) for x in shapes)


def _out_and_grads(fn, q, k, v, w, real):
    """fn's output and d/d(q, k, v) of sum(out * w) over the real (non-padding) positions."""

    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum((out * w).astype(jnp.float32) * real[:, :, None, None]), out

    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return (out, *grads)


def _assert_close(got, want, tol, names=("out", "dq", "dk", "dv"), where=None):
    for name, a, b in zip(names, got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if where is not None and name == "out":
            a, b = a[where], b[where]
        scale = max(1.0, float(np.abs(b).max()))
        assert np.abs(a - b).max() <= tol * scale, name


# ---- prefix paths (vision tiles, single-sample rows): jax's public cuDNN arguments ----


def test_padded_length_rounds_up_to_the_alignment():
    assert ca.padded_length(729) == 768 and ca.padded_length(768) == 768
    assert ca.padded_length(1) == ca.ALIGN and ca.padded_length(1025) == 1088


def test_vision_tiles_go_to_cudnn_padded_with_lengths_and_no_mask():
    """A 27-token tile (SigLIP's 729 at small scale) is padded to 64 tokens, the true length passed
    as query and key lengths; run through XLA, the padded call equals unpadded attention."""
    q, k, v, w = _qkv(3, 27, 2, 2, 72)
    qp, kp, vp, q_len, kv_len = ca.prefix_arguments(q, k, v, None)
    assert qp.shape == kp.shape == vp.shape == (3, 64, 2, 72)
    assert np.asarray(q_len).tolist() == np.asarray(kv_len).tolist() == [27] * 3
    assert float(jnp.abs(qp[:, 27:]).max()) == 0.0
    real = jnp.ones((3, 27))

    def padded(q, k, v):
        return ca.prefix_attention(q, k, v, None, False, implementation="xla")

    def ours(q, k, v):
        return attention(q, k, v, segment_ids=None, causal=False, implementation="xla")

    _assert_close(
        _out_and_grads(padded, q, k, v, w, real), _out_and_grads(ours, q, k, v, w, real), TOL
    )


def test_an_aligned_tile_is_handed_over_unpadded_without_lengths():
    q, k, v, _ = _qkv(2, 64, 2, 2, 16)
    qp, _, _, q_len, kv_len = ca.prefix_arguments(q, k, v, None)
    assert qp.shape == q.shape and q_len is None and kv_len is None


@pytest.mark.parametrize("causal", [True, False])
def test_single_sample_rows_take_the_valid_length(causal):
    """Rows of one sample then padding: cuDNN's arguments (the valid length per row, is_causal) run
    through XLA equal our attention on the real tokens (values and gradients); padding comes out 0."""
    s, lengths = 40, [25, 40, 7]
    seg = jnp.asarray(np.stack([packed_segment_ids(s, [n]) for n in lengths]))
    q, k, v, w = _qkv(3, s, 4, 2, 16)
    real = (seg != 0).astype(jnp.float32)
    valid = jnp.sum(seg != 0, axis=1, dtype=jnp.int32)

    def prefix(q, k, v):
        return ca.prefix_attention(q, k, v, valid, causal, implementation="xla")

    def ours(q, k, v):
        return attention(q, k, v, segment_ids=seg, causal=causal, implementation="xla")

    got = _out_and_grads(prefix, q, k, v, w, real)
    _assert_close(got, _out_and_grads(ours, q, k, v, w, real), TOL, where=np.asarray(seg != 0))
    assert float(jnp.abs(got[0][0, 25:]).max()) == 0.0 and np.isfinite(np.asarray(got[0])).all()


# ---- packed path: offsets / lengths ----


def _numpy_runs(seg, max_runs):
    """Per row: runs of equal ids as (start, length) lists, in cuDNN's [B, M+1] / [B, M] form."""
    b, s = seg.shape
    offsets = np.full((b, max_runs + 1), -1, np.int32)
    lengths = np.full((b, max_runs), -1, np.int32)
    counts = np.zeros(b, np.int32)
    for r in range(b):
        runs, start = [], 0
        for i in range(1, s + 1):
            if i == s or seg[r, i] != seg[r, i - 1]:
                runs.append((start, i - start))
                start = i
        counts[r] = len(runs)
        for j, (o, n) in enumerate(runs[:max_runs]):
            offsets[r, j], lengths[r, j] = o, n
    return offsets, lengths, counts


def _rows(s):
    rng = np.random.default_rng(3)
    short = rng.integers(1, 6, size=s)
    return np.stack(
        [
            packed_segment_ids(s, [s]),
            packed_segment_ids(s, [30, 21, 17]),
            packed_segment_ids(s, [13, -7, 20, 9]),  # a padding gap, then a padding tail
            packed_segment_ids(s, list(short[np.cumsum(short) <= s])),  # many short samples
            np.zeros(s, np.int32),
        ]
    )


@pytest.mark.parametrize("max_runs", [2, 5, 64])
def test_segment_runs_match_numpy(max_runs):
    seg = _rows(80)
    got = jax.jit(cp.segment_runs, static_argnums=1)(jnp.asarray(seg), max_runs)
    for a, b in zip(got, _numpy_runs(seg, max_runs)):
        np.testing.assert_array_equal(np.asarray(a), b)


def _runs_reference(q, k, v, offsets, lengths, causal):
    """numpy: each query attends to the keys of its own [offset, offset + length) (causally from
    the run's start), the packed layout's semantics as jax documents q_offsets / q_seqlen."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, s, h, dh = q.shape
    group = h // k.shape[2]
    out = np.full_like(q, np.nan)
    for r in range(b):
        for o, n in zip(offsets[r], lengths[r]):
            if n <= 0:
                continue
            for i in range(o, o + n):
                keys = np.arange(o, i + 1 if causal else o + n)
                for hi in range(h):
                    logits = k[r, keys, hi // group] @ q[r, i, hi] / np.sqrt(dh)
                    p = np.exp(logits - logits.max())
                    out[r, i, hi] = (p / p.sum()) @ v[r, keys, hi // group]
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_packed_layout_semantics_equal_our_attention_on_real_tokens(causal):
    """What the offsets / lengths tell cuDNN (attention within each run) is our attention on every
    real token, and covers every position (padding runs too: finite outputs)."""
    seg = _rows(48)[:4]
    q, k, v, _ = _qkv(4, 48, 4, 2, 8)
    offsets, lengths, runs = (np.asarray(x) for x in cp.segment_runs(jnp.asarray(seg), 32))
    assert runs.max() <= 32
    ref = _runs_reference(q, k, v, offsets, lengths, causal)
    assert np.isfinite(ref).all()
    ours = np.asarray(attention(q, k, v, segment_ids=jnp.asarray(seg), causal=causal))
    real = seg != 0
    assert np.abs(ours[real] - ref[real]).max() <= TOL


def test_segment_bound():
    assert [cp.segment_bound(n) for n in (32, 511, 512, 2048, 8192, 32768, 1 << 20)] == [
        2, 2, 2, 8, 32, 64, 64,
    ]  # fmt: skip


# ---- availability: versions, devices, fallbacks ----


def test_version_check():
    assert cp.version_tuple("0.11.1.dev20260808+cec06d1") == (0, 11, 1)
    for ok in ("0.10.2", "0.11.0", "0.11.1", "0.11.1.dev20260808"):
        assert cp.version_verified(ok), ok
    for out in ("0.10.1", "0.9.2", "0.11.2", "0.12.0", "1.0.0"):
        assert not cp.version_verified(out), out
    with pytest.raises(ValueError, match="MAJOR.MINOR.PATCH"):
        cp.version_tuple("main")


def test_unavailable_reasons():
    assert cp.unavailable_reason("gpu", "9.0", "0.10.2") is None  # H100 / H200
    assert cp.unavailable_reason("gpu", "10.0", "0.11.1") is None  # Blackwell
    assert "backend: cpu" in cp.unavailable_reason("cpu", None, "0.10.2")
    assert "Hopper" in cp.unavailable_reason("gpu", "8.0", "0.10.2")  # A100
    assert "none reported" in cp.unavailable_reason("gpu", None, "0.10.2")  # ROCm
    reason = cp.unavailable_reason("gpu", "9.0", "0.12.0")
    assert "0.12.0" in reason and "0.10.2 to 0.11.1" in reason
    assert "backend: cpu" in cp.local_unavailable_reason()  # this host


def _cudnn(q, k, v, seg, causal=True):
    """A fresh trace each call (jax caches traces per function: a test that fakes the packed path's
    availability must not reuse another test's)."""
    return jax.jit(lambda q, k, v, seg: ca.cudnn_attention(q, k, v, seg, causal))(q, k, v, seg)


def test_packed_rows_fall_back_to_pallas_with_one_logged_line(caplog):
    """Here (CPU) the packed path is unavailable: packed rows run the Pallas kernels (interpreted),
    equal to the XLA path, and the reason is logged once however often the path is traced."""
    ca._say_once.cache_clear()
    seg = jnp.asarray(_rows(32)[1:3])
    q, k, v, _ = _qkv(2, 32, 4, 2, 16, dtype=jnp.bfloat16)
    with caplog.at_level(logging.WARNING, logger="models.cudnn_attention"):
        out = _cudnn(q, k, v, seg)
        _cudnn(q[:1], k[:1], v[:1], seg[:1])
    lines = [r.getMessage() for r in caplog.records if r.name == "models.cudnn_attention"]
    assert len(lines) == 1 and "backend: cpu" in lines[0] and "Pallas" in lines[0]
    want = attention(q, k, v, segment_ids=seg, causal=True, implementation="xla")
    real = np.asarray(seg != 0)
    diff = np.abs(np.asarray(out, np.float32) - np.asarray(want, np.float32))[real]
    assert diff.max() <= 2e-2  # bf16 outputs of O(1)


def test_float32_runs_pallas_with_one_logged_line(caplog):
    ca._say_once.cache_clear()
    q, k, v, _ = _qkv(1, 16, 2, 2, 16)
    with caplog.at_level(logging.WARNING, logger="models.cudnn_attention"):
        out = _cudnn(q, k, v, None, False)
        _cudnn(q, k, v, None, False)
    lines = [r.getMessage() for r in caplog.records if r.name == "models.cudnn_attention"]
    assert len(lines) == 1 and "float32" in lines[0]
    want = attention(q, k, v, segment_ids=None, causal=False, implementation="xla")
    assert np.abs(np.asarray(out) - np.asarray(want)).max() <= TOL


def test_rows_with_more_runs_than_the_bound_take_pallas(monkeypatch):
    """Where the packed path is available (faked here), a program whose rows all fit the bound
    (2 runs at 32 tokens) takes it; one row over the bound sends the program to Pallas."""
    marker = 7.0

    def fake_packed(q, k, v, seg, causal, max_runs):
        assert max_runs == cp.segment_bound(q.shape[1]) == 2
        return jnp.full(q.shape, marker, q.dtype)

    monkeypatch.setattr(cp, "local_unavailable_reason", lambda: None)
    monkeypatch.setattr(cp, "packed_attention", fake_packed)
    fits = np.stack([packed_segment_ids(32, [20]), packed_segment_ids(32, [32])])
    over = np.stack([packed_segment_ids(32, [20]), packed_segment_ids(32, [10, 10])])
    q, k, v, _ = _qkv(2, 32, 4, 2, 16, dtype=jnp.bfloat16)
    assert (np.asarray(_cudnn(q, k, v, jnp.asarray(fits)), np.float32) == marker).all()
    out = np.asarray(_cudnn(q, k, v, jnp.asarray(over)), np.float32)
    want = attention(q, k, v, segment_ids=jnp.asarray(over), causal=True, implementation="xla")
    real = over != 0
    assert np.abs(out - np.asarray(want, np.float32))[real].max() <= 2e-2


# ---- on a GPU: each cuDNN path against the XLA path ----

GPU_TOL = 3e-2  # bf16 inputs and outputs against the XLA path on the same values in float32


def _gpu_check(seg, h, kv, dh, causal, single_sample=False, s=None):
    b, s = seg.shape if seg is not None else (4, s)
    q, k, v, w = _qkv(b, s, h, kv, dh, dtype=jnp.bfloat16)
    real = jnp.ones((b, s)) if seg is None else (seg != 0).astype(jnp.float32)

    def cudnn(q, k, v):
        return attention(q, k, v, segment_ids=seg, causal=causal, implementation="cudnn",
                         single_sample=single_sample)  # fmt: skip

    def xla(q, k, v):
        return attention(q, k, v, segment_ids=seg, causal=causal, implementation="xla")

    text = jax.jit(cudnn).lower(q, k, v).as_text()
    assert "cudnn" in text  # a cuDNN custom call, not a fallback alone
    got = _out_and_grads(cudnn, q, k, v, w, real)
    f32 = (x.astype(jnp.float32) for x in (q, k, v, w))
    want = _out_and_grads(xla, *f32, real)
    where = None if seg is None else np.asarray(seg != 0)
    _assert_close(got, want, GPU_TOL, where=where)
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in got)


def _hopper_with_packed_path():
    if cp.local_unavailable_reason() is not None:
        pytest.skip(cp.local_unavailable_reason())


@pytest.mark.gpu
def test_cudnn_siglip_tiles_equal_xla_on_gpu():
    """SigLIP-SO400M's tiles: 729 tokens, 16 heads of 72, no mask."""
    _gpu_check(None, 16, 16, 72, causal=False, s=729)


@pytest.mark.gpu
def test_cudnn_single_sample_rows_equal_xla_on_gpu():
    """Qwen2.5-7B's heads (28 query, 4 kv, 128): one sample per row, a padding suffix."""
    seg = jnp.asarray(np.stack([packed_segment_ids(2048, [n]) for n in (2048, 1500)]))
    _gpu_check(seg, 28, 4, 128, causal=True, single_sample=True)


@pytest.mark.gpu
def test_cudnn_packed_rows_equal_xla_on_gpu():
    """Packed rows of several samples, a padding gap and tail, GQA 28 / 4: cuDNN's packed layout."""
    _hopper_with_packed_path()
    seg = np.stack([packed_segment_ids(2048, [700, 300, 500, 9]),
                    packed_segment_ids(2048, [1024, -24, 1000])])  # fmt: skip
    assert cp.segment_runs(jnp.asarray(seg), 8)[2].max() <= cp.segment_bound(2048)
    _gpu_check(jnp.asarray(seg), 28, 4, 128, causal=True)


@pytest.mark.gpu
def test_auto_never_picks_xla_on_a_gpu():
    from dflop_jax.programs.devices import local_attention_kernels

    kernels = local_attention_kernels()
    assert "xla" not in (kernels.vision, kernels.llm)
