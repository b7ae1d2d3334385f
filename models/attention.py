"""Multi-head attention core for packed rows (GQA, segment masking, optional causality).

`attention(q, k, v, segment_ids=..., causal=..., implementation=...)`:
  - implementation "xla" or None: explicit mask, float32 logits and softmax; runs anywhere (CPU tests).
    Rows longer than 1024 tokens run in 512-query blocks (`query_block`) to bound memory.
  - implementation "cudnn": `jax.nn.dot_product_attention(..., implementation="cudnn")` given the
    segment mask plus `is_causal` (GPU fused path; cuDNN wants bf16/fp16 inputs). The fused kernel is
    NOT exercised on the CPU-only test machines; the tests check that the same arguments give our
    result through `jax.nn.dot_product_attention(..., implementation="xla")`.
A token attends only to tokens of its own segment (segment id 0 marks padding; padding tokens attend
among themselves, so their output is finite and simply ignored by the loss) and, when causal, only to
earlier-or-equal indices. Packed samples are contiguous in a row, so index order is position order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("xla", "cudnn")
QUERY_BLOCK = 512


def attention_mask(segment_ids: jax.Array | None, length: int, causal: bool) -> jax.Array | None:
    """Boolean mask [B or 1, 1, S, S] (True = may attend), or None when nothing is masked."""
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [B,1,S,S]
    if causal:
        tri = jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]  # [1,1,S,S]
        mask = tri if mask is None else mask & tri
    return mask


def fused_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    segment_ids: jax.Array | None,
    causal: bool,
    implementation: str,
) -> jax.Array:
    """`jax.nn.dot_product_attention` with our masking semantics (segment mask + `is_causal`)."""
    mask = attention_mask(segment_ids, q.shape[1], causal=False)
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=causal, implementation=implementation
    )


def _block_attention(qc, q_index, seg_q, k, v, seg_k, causal, scale):
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
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgct,btkd->bckgd", probs, v)


def _xla_attention(q, k, v, segment_ids, causal, scale, block):
    """Explicit-mask attention, float32 softmax; query blocks of `block` bound the logits' memory
    to [B,H,block,S] (blocks are recomputed in backward, like flash attention's tiles)."""
    b, s, h, dh = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, s, kv, h // kv, dh)  # [B,S,K,G,Dh]
    positions = jnp.arange(s)
    if block >= s:
        out = _block_attention(qg, positions, segment_ids, k, v, segment_ids, causal, scale)
        return out.reshape(b, s, h, dh)
    n = s // block
    seg = jnp.zeros((b, s), jnp.int32) if segment_ids is None else segment_ids

    @jax.checkpoint
    def one(args):
        qc, idx, seg_q = args
        return _block_attention(qc, idx, seg_q, k, v, seg, causal, scale)

    blocks = (
        jnp.moveaxis(qg.reshape(b, n, block, kv, h // kv, dh), 1, 0),  # [n,B,C,K,G,Dh]
        positions.reshape(n, block),
        jnp.moveaxis(seg.reshape(b, n, block), 1, 0),  # [n,B,C]
    )
    out = jax.lax.map(one, blocks)  # [n,B,C,K,G,Dh]
    return jnp.moveaxis(out, 0, 1).reshape(b, s, h, dh)


def query_block(length: int) -> int:
    """Query block size of the XLA path: whole rows up to 1024 tokens, else 512-token blocks when
    the length divides evenly (bucket lengths do)."""
    if length > 2 * QUERY_BLOCK and length % QUERY_BLOCK == 0:
        return QUERY_BLOCK
    return length


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    segment_ids: jax.Array | None,
    causal: bool,
    implementation: str | None = None,
) -> jax.Array:
    """Scaled dot-product attention with grouped KV heads.

    Args:
      q: [B,S,H,Dh]; k, v: [B,S,K,Dh] with H % K == 0.
      segment_ids: [B,S] int (0 = padding) or None (one segment).
      causal: causal within each segment.
      implementation: "xla" / None (explicit-mask XLA path) or "cudnn" (fused GPU kernel).

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
        return fused_attention(
            q, k, v, segment_ids=segment_ids, causal=causal, implementation="cudnn"
        ).astype(q.dtype)
    scale = q.shape[-1] ** -0.5
    block = query_block(q.shape[1])
    return _xla_attention(q, k, v, segment_ids, causal, scale, block).astype(q.dtype)
