"""Multi-head attention core for packed rows (GQA, segment masking, optional causality).

`attention(q, k, v, segment_ids=..., causal=..., implementation=...)`:
  - implementation "xla" or None, short rows (`dense_max`: one tile on CPU, 1024 tokens elsewhere):
    explicit mask over the whole row, float32 logits and softmax (`dense_attention`).
  - implementation "xla" or None, longer rows: `blocked_attention`, flash-style tiles of
    `block_size(S)` queries x keys with an online softmax and a hand-written backward
    (`jax.custom_vjp`). A tile that no (query, key) pair of it may attend to (keys after the tile's
    queries when causal; keys of other packed samples) is skipped by a real `lax.cond`, so a row of
    many short samples costs about the sum of the samples' own attention, not S x S. Rows of one
    call share the loops (rows stay a batched, data-shardable axis): a tile is visited when any row
    needs it.
  - implementation "pallas": `models.pallas_attention.pallas_attention`, our flash kernels (Triton
    on GPU, Pallas interpret mode elsewhere) whose loops visit only the key blocks a query block's
    segments reach, so key blocks of other samples are never loaded; no mask is materialized.
  - implementation "cudnn": `models.cudnn_attention.cudnn_attention`, one cuDNN call per kind of
    row and no dense mask: a row without segment ids (a vision tile) or, when the caller passes
    `single_sample=True`, a row of one sample and its padding, through jax's public API with the
    valid length per row; a packed row through cuDNN's packed layout (`models.cudnn_packed`, jax's
    private module, Hopper and a verified jax), else through the Pallas kernels.
A token attends only to tokens of its own segment (segment id 0 marks padding; padding tokens attend
among themselves, so their output is finite and simply ignored by the loss) and, when causal, only to
earlier-or-equal indices. Packed samples are contiguous in a row, so index order is position order.
The "cudnn" paths differ only at padding positions (0 there, or attention within each run of
padding), equally finite and ignored by the loss.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("xla", "pallas", "cudnn")
MIN_BLOCK, MAX_BLOCK = 128, 512
_NEG = float(jnp.finfo(jnp.float32).min)


def attention_mask(segment_ids: jax.Array | None, length: int, causal: bool) -> jax.Array | None:
    """Boolean mask [B or 1, 1, S, S] (True = may attend), or None when nothing is masked."""
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [B,1,S,S]
    if causal:
        tri = jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]  # [1,1,S,S]
        mask = tri if mask is None else mask & tri
    return mask


# ---- dense path: every (query, key) pair, masked ----


def _dense_block(qc, q_index, seg_q, k, v, seg_k, causal, scale):
    """One query block against every key.

    qc [B,C,K,G,Dh]; q_index [C]; seg_q [B,C] / seg_k [B,S] (or None); k, v [B,S,K,Dh] -> [B,C,K,G,Dh].
    """
    logits = jnp.einsum("bckgd,btkd->bkgct", qc, k, preferred_element_type=jnp.float32) * scale
    mask = None
    if seg_q is not None:
        mask = (seg_q[:, :, None] == seg_k[:, None, :])[:, None, None]  # [B,1,1,C,S]
    if causal:
        tri = (q_index[:, None] >= jnp.arange(k.shape[1])[None, :])[None, None, None]  # [1,1,1,C,S]
        mask = tri if mask is None else mask & tri
    if mask is not None:
        logits = jnp.where(mask, logits, _NEG)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgct,btkd->bckgd", probs, v)


def dense_attention(q, k, v, segment_ids, causal, query_block=None):
    """Explicit-mask attention over all S x S pairs, float32 softmax: q [B,S,H,Dh] -> [B,S,H,Dh].

    `query_block` (dividing S) runs queries in checkpointed blocks to bound the logits' memory to
    [B,H,block,S]; it is the long-row path used before `blocked_attention` skipped masked tiles,
    kept as the baseline of `python -m dflop_jax.bench attention`.
    """
    b, s, h, dh = q.shape
    kv, scale = k.shape[2], dh**-0.5
    qg = q.reshape(b, s, kv, h // kv, dh)  # [B,S,K,G,Dh]
    positions = jnp.arange(s)
    block = query_block or s
    if block >= s:
        out = _dense_block(qg, positions, segment_ids, k, v, segment_ids, causal, scale)
        return out.reshape(b, s, h, dh)
    n = s // block
    seg = jnp.zeros((b, s), jnp.int32) if segment_ids is None else segment_ids

    @jax.checkpoint
    def one(args):
        qc, idx, seg_q = args
        return _dense_block(qc, idx, seg_q, k, v, seg, causal, scale)

    blocks = (
        jnp.moveaxis(qg.reshape(b, n, block, kv, h // kv, dh), 1, 0),  # [n,B,C,K,G,Dh]
        positions.reshape(n, block),
        jnp.moveaxis(seg.reshape(b, n, block), 1, 0),  # [n,B,C]
    )
    out = jax.lax.map(one, blocks)  # [n,B,C,K,G,Dh]
    return jnp.moveaxis(out, 0, 1).reshape(b, s, h, dh)


# ---- blocked path: flash-style tiles, masked tiles skipped ----


def block_size(length: int) -> int:
    """Tile size of the blocked path: about 16 tiles per row, a power of two in [128, 512]
    (small enough to isolate samples of a few hundred tokens, big enough to keep the matmuls
    efficient and the loop short)."""
    c = MAX_BLOCK
    while c > MIN_BLOCK and length // c < 16:
        c //= 2
    return c


def dense_max(platform: str) -> int:
    """Longest row that runs unblocked. On CPU the tiles win from two tiles up (256 tokens: 2x,
    4096: ~10x with nothing to skip; memory traffic of the S x S logits dominates), so only a
    single tile's length stays dense. On accelerators each skipped-or-not tile is a conditional
    (on GPU a predicate read per tile), so rows up to 1024 tokens stay one fused dense pass (not
    measured here: no GPU on the test machines; the GPU's fast path is "cudnn" anyway)."""
    return MIN_BLOCK if platform == "cpu" else 2 * MAX_BLOCK


def block_plan(segment_ids: jax.Array, block: int, causal: bool) -> jax.Array:
    """Which tiles can hold an allowed pair: bool [B, n, n] (query tile, key tile), S = n * block.

    Per tile: the range of its nonzero segment ids and whether it holds padding (id 0). Two tiles
    interact iff their id ranges overlap or both hold padding; never false for a needed tile,
    whatever the ids, and exact for packed rows (ids increasing along the row, padding anywhere).
    The tiled path visits a tile when any row of the program needs it, so rows stay one batched
    (and data-shardable) axis: a program of several rows skips what all its rows skip.
    """
    b, s = segment_ids.shape
    ids = segment_ids.reshape(b, s // block, block)
    real = ids != 0
    lo = jnp.where(real, ids, jnp.iinfo(jnp.int32).max).min(-1)  # [B,n]
    hi = jnp.where(real, ids, jnp.iinfo(jnp.int32).min).max(-1)
    pad = (~real).any(-1)
    plan = (lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None])
    plan = plan | (pad[:, :, None] & pad[:, None, :])
    if causal:
        plan = plan & jnp.tril(jnp.ones(plan.shape[1:], bool))
    return plan


def _tile_mask(seg_q, seg_k, q0, k0, causal):
    """[B,1,1,C,C] allowed pairs of the query tile starting at q0 and the key tile at k0."""
    mask = seg_q[:, :, None] == seg_k[:, None, :]  # [B,C,C]
    if causal:
        c = seg_q.shape[1]
        mask &= (q0 + jnp.arange(c))[:, None] >= (k0 + jnp.arange(c))[None, :]
    return mask[:, None, None]


def _tiles(x, block):
    """[B,S,...] -> [n,B,C,...]: tile-major, so the loops index tiles and rows stay a (shardable)
    batch axis inside each tile."""
    b, s = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, s // block, block, *x.shape[2:]), 1, 0)


def _untile(x):
    """[n,B,C,...] -> [B,n*C,...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _take(x, i):
    return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def _visited(seg, block, causal):
    """[n,n] tiles to visit: those any row of the program needs (one conditional serves all rows)."""
    return block_plan(seg, block, causal).any(0)


def _flash_forward(q, k, v, seg, causal, block):
    """Online softmax over the planned key tiles: (out [B,S,K,G,Dh], lse [n,B,K,G,C] float32)."""
    b, s, kv, g, dh = q.shape
    n, scale = s // block, dh**-0.5
    plan = _visited(seg, block, causal)
    qt, kt, vt, st = (_tiles(x, block) for x in (q, k, v, seg))
    f32 = dict(preferred_element_type=jnp.float32)

    def query_tile(_, i):
        qi, seg_q = _take(qt, i), _take(st, i)

        def visit(j, carry):
            m, denom, acc = carry
            kj, vj = _take(kt, j), _take(vt, j)
            logits = jnp.einsum("bckgd,btkd->bkgct", qi, kj, **f32)
            mask = _tile_mask(seg_q, _take(st, j), i * block, j * block, causal)
            logits = jnp.where(mask, logits * scale, _NEG)
            m_new = jnp.maximum(m, logits.max(-1))  # [B,K,G,C]
            p = jnp.where(mask, jnp.exp(logits - m_new[..., None]), 0.0)
            corr = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgct,btkd->bckgd", p.astype(v.dtype), vj, **f32)
            acc = acc * jnp.moveaxis(corr, -1, 1)[..., None] + pv
            return m_new, denom * corr + p.sum(-1), acc

        def step(j, carry):
            return jax.lax.cond(plan[i, j], visit, lambda _, c: c, j, carry)

        init = (
            jnp.full((b, kv, g, block), _NEG, jnp.float32),
            jnp.zeros((b, kv, g, block), jnp.float32),
            jnp.zeros((b, block, kv, g, dh), jnp.float32),
        )
        m, denom, acc = jax.lax.fori_loop(0, i + 1 if causal else n, step, init)
        out = acc / jnp.moveaxis(denom, -1, 1)[..., None]  # every query sees itself: denom > 0
        return None, (out.astype(q.dtype), m + jnp.log(denom))

    _, (out, lse) = jax.lax.scan(query_tile, None, jnp.arange(n))
    return _untile(out), lse


def _flash_backward(causal, block, res, dout):
    """FlashAttention-2 backward over the same planned tiles; dk/dv accumulate in float32."""
    q, k, v, seg, out, lse = res
    b, s, kv, g, dh = q.shape
    n, scale = s // block, dh**-0.5
    plan = _visited(seg, block, causal)
    qt, kt, vt, st, dot = (_tiles(x, block) for x in (q, k, v, seg, dout))
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)  # [B,S,K,G]
    delta = jnp.moveaxis(_tiles(delta, block), 2, -1)  # [n,B,K,G,C]
    f32 = dict(preferred_element_type=jnp.float32)

    def query_tile(dkv, i):
        qi, doi, seg_q = _take(qt, i), _take(dot, i), _take(st, i)
        lse_i, delta_i = _take(lse, i)[..., None], _take(delta, i)[..., None]

        def visit(j, carry):
            dq, (dk, dv) = carry
            kj, vj = _take(kt, j), _take(vt, j)
            logits = jnp.einsum("bckgd,btkd->bkgct", qi, kj, **f32)
            mask = _tile_mask(seg_q, _take(st, j), i * block, j * block, causal)
            p = jnp.where(mask, jnp.exp(logits * scale - lse_i), 0.0)  # [B,K,G,C,C]
            dv_j = jnp.einsum("bkgct,bckgd->btkd", p.astype(dout.dtype), doi, **f32)
            dp = jnp.einsum("bckgd,btkd->bkgct", doi, vj, **f32)
            ds = p * (dp - delta_i) * scale
            dq = dq + jnp.einsum("bkgct,btkd->bckgd", ds.astype(k.dtype), kj, **f32)
            dk_j = jnp.einsum("bkgct,bckgd->btkd", ds.astype(q.dtype), qi, **f32)
            dk = jax.lax.dynamic_update_index_in_dim(dk, _take(dk, j) + dk_j, j, 0)
            dv = jax.lax.dynamic_update_index_in_dim(dv, _take(dv, j) + dv_j, j, 0)
            return dq, (dk, dv)

        def step(j, carry):
            return jax.lax.cond(plan[i, j], visit, lambda _, c: c, j, carry)

        dq = jnp.zeros(qi.shape, jnp.float32)
        dq, dkv = jax.lax.fori_loop(0, i + 1 if causal else n, step, (dq, dkv))
        return dkv, dq.astype(q.dtype)

    zeros = jnp.zeros(kt.shape, jnp.float32)
    (dk, dv), dq = jax.lax.scan(query_tile, (zeros, zeros), jnp.arange(n))
    return _untile(dq), _untile(dk).astype(k.dtype), _untile(dv).astype(v.dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, k, v, seg, causal, block):
    return _flash_forward(q, k, v, seg, causal, block)[0]


def _flash_fwd(q, k, v, seg, causal, block):
    out, lse = _flash_forward(q, k, v, seg, causal, block)
    return out, (q, k, v, seg, out, lse)


_flash.defvjp(_flash_fwd, _flash_backward)


def blocked_attention(q, k, v, segment_ids, causal, block):
    """Tiled attention that skips masked tiles: q [B,S,H,Dh], k/v [B,S,K,Dh] -> [B,S,H,Dh].

    Rows are padded to a multiple of `block` with a fresh segment id (row max + 1) that no real
    token shares; the padded queries are dropped.
    """
    b, s, h, dh = q.shape
    kv = k.shape[2]
    seg = jnp.ones((b, s), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    extra = -s % block
    if extra:
        widen = ((0, 0), (0, extra), (0, 0), (0, 0))
        q, k, v = (jnp.pad(x, widen) for x in (q, k, v))
        fresh = jnp.max(seg, axis=1, keepdims=True) + 1
        seg = jnp.concatenate([seg, jnp.broadcast_to(fresh, (b, extra))], axis=1)
    qg = q.reshape(b, s + extra, kv, h // kv, dh)  # [B,S',K,G,Dh]
    out = _flash(qg, k, v, seg, causal, block)
    return out[:, :s].reshape(b, s, h, dh)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    segment_ids: jax.Array | None,
    causal: bool,
    implementation: str | None = None,
    single_sample: bool = False,
) -> jax.Array:
    """Scaled dot-product attention with grouped KV heads.

    Args:
      q: [B,S,H,Dh]; k, v: [B,S,K,Dh] with H % K == 0.
      segment_ids: [B,S] int (0 = padding) or None (one segment).
      causal: causal within each segment.
      implementation: "xla" / None (XLA path), "pallas" (our flash kernels) or "cudnn" (fused
        GPU kernels, `models.cudnn_attention`).
      single_sample: every row holds one sample (segment id 1) followed only by padding (id 0), as
        the caller knows (the data is not inspected); "cudnn" then passes cuDNN the valid length
        instead of packed segments. The other implementations ignore it.

    Returns:
      [B,S,H,Dh] in q.dtype.
    """
    if implementation not in (None, *IMPLEMENTATIONS):
        raise ValueError(
            f"attention implementation={implementation!r} is unknown; use one of {IMPLEMENTATIONS}"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} must be a multiple of kv heads {k.shape[2]}")
    if implementation == "cudnn":
        from models.cudnn_attention import cudnn_attention

        return cudnn_attention(q, k, v, segment_ids, causal, single_sample).astype(q.dtype)
    if implementation == "pallas":
        from models.pallas_attention import pallas_attention

        return pallas_attention(q, k, v, segment_ids, causal).astype(q.dtype)
    if q.shape[1] <= dense_max(jax.default_backend()):
        return dense_attention(q, k, v, segment_ids, causal).astype(q.dtype)
    block = block_size(q.shape[1])
    return blocked_attention(q, k, v, segment_ids, causal, block).astype(q.dtype)
