"""Multi-head attention core for packed rows (GQA, segment masking, optional causality).

`attention(q, k, v, segment_ids=..., causal=..., implementation=...)`:
  - implementation "xla" or None: explicit mask, float32 logits and softmax; runs anywhere (CPU tests).
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


def _xla_attention(q, k, v, mask, scale):
    b, s, h, dh = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, s, kv, h // kv, dh)  # [B,S,K,G,Dh]
    logits = jnp.einsum("bskgd,btkd->bkgst", qg, k, preferred_element_type=jnp.float32) * scale
    if mask is not None:
        logits = jnp.where(mask[:, :, None], logits, jnp.finfo(jnp.float32).min)  # mask [B,1,1,S,T]
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v)
    return out.reshape(b, s, h, dh)


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
    mask = attention_mask(segment_ids, q.shape[1], causal)
    return _xla_attention(q, k, v, mask, q.shape[-1] ** -0.5).astype(q.dtype)
