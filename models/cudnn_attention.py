"""The "cudnn" attention implementation: one cuDNN call per kind of row, none with a dense mask.

`cudnn_attention(q, k, v, segment_ids, causal, single_sample)` (`models.attention.attention` calls it
for implementation "cudnn"):
  - no segment ids (a vision tower's tiles: one segment per tile): `jax.nn.dot_product_attention(
    implementation="cudnn")` on the row padded to a multiple of `ALIGN` tokens, with query and key
    lengths = the true length (cuDNN's padding mask, no bias: jax refuses training with a bias at odd
    lengths, which is what SigLIP's 729-token tiles met), the output sliced back.
  - `single_sample=True` (the caller's promise, never read off the data: each row holds one sample,
    segment id 1, and its padding, id 0, only as a suffix): the same call with `is_causal` and the
    valid prefix's length per row. Padding positions come out 0.
  - packed rows (several samples a row): cuDNN's packed layout (`models.cudnn_packed`, jax's private
    module) where it is available (Hopper, a verified jax), for rows of at most `segment_bound(S)`
    runs; a program whose rows hold more runs takes our Pallas kernels instead (a `lax.cond`: both
    are compiled). Where the packed path is unavailable: the Pallas kernels, said in one logged line.
  - float32 operands (cuDNN runs bf16 / fp16 only): the Pallas kernels, said in one logged line.
Grouped-query heads: jax's public cuDNN path takes K kv heads as they are; the packed path repeats them.
The GPU tests compare each path's values and gradients with the XLA path
(tests/models/test_models_llm_attention_cudnn.py, marked `gpu`); no GPU has run them yet.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from models import cudnn_packed

log = logging.getLogger(__name__)
ALIGN = 64  # rows are padded to a multiple of this (729 -> 768): cuDNN's tiles are 64 / 128 long
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


@functools.cache
def _say_once(message: str) -> None:
    log.warning(message)


def _pallas(q, k, v, segment_ids, causal):
    from models.pallas_attention import pallas_attention

    return pallas_attention(q, k, v, segment_ids, causal)


def padded_length(length: int) -> int:
    """The row length the prefix paths hand cuDNN: `length` rounded up to a multiple of `ALIGN`."""
    return -(-length // ALIGN) * ALIGN


def prefix_arguments(q, k, v, lengths):
    """(q, k, v, query lengths, key lengths) of the prefix paths: rows padded to `padded_length`
    with zeros, and the valid lengths (None where nothing is padded and every row is whole)."""
    b, s = q.shape[:2]
    extra = padded_length(s) - s
    if extra:
        widen = ((0, 0), (0, extra), (0, 0), (0, 0))
        q, k, v = (jnp.pad(x, widen) for x in (q, k, v))
        if lengths is None:
            lengths = jnp.full((b,), s, jnp.int32)
    return q, k, v, lengths, lengths


def prefix_attention(q, k, v, lengths, causal, implementation="cudnn"):
    """Attention within each row's valid prefix (`lengths` [B] int32, None = the whole row):
    q [B,S,H,Dh], k / v [B,S,K,Dh] -> [B,S,H,Dh]; positions past the prefix are 0.
    `implementation="xla"` runs the same arguments through jax's XLA path (the CPU tests do)."""
    s = q.shape[1]
    qp, kp, vp, q_len, kv_len = prefix_arguments(q, k, v, lengths)
    out = jax.nn.dot_product_attention(
        qp, kp, vp, is_causal=causal, query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
        implementation=implementation,
    )[:, :s]  # fmt: skip
    if lengths is None:
        return out
    valid = jnp.arange(s)[None, :] < lengths[:, None]  # [B,S]
    return jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))


def _packed(q, k, v, segment_ids, causal):
    """The packed path, or Pallas for a program whose rows hold more runs than the bound."""
    bound = cudnn_packed.segment_bound(q.shape[1])
    _, _, runs = cudnn_packed.segment_runs(segment_ids, bound)

    def packed(q, k, v, seg):
        return cudnn_packed.packed_attention(q, k, v, seg, causal, bound)

    def pallas(q, k, v, seg):
        return _pallas(q, k, v, seg, causal).astype(q.dtype)

    return jax.lax.cond(jnp.max(runs) <= bound, packed, pallas, q, k, v, segment_ids)


def cudnn_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    causal: bool,
    single_sample: bool = False,
) -> jax.Array:
    """q [B,S,H,Dh], k / v [B,S,K,Dh] -> [B,S,H,Dh] (module docstring for the path each row takes).

    Args:
      segment_ids: [B,S] int (0 = padding) or None (each row one segment).
      single_sample: each row holds one sample (id 1) followed only by padding (id 0); the caller
        must know it (nothing checks the data).
    """
    if q.dtype not in CUDNN_DTYPES:
        _say_once(
            f"cuDNN attention runs bf16 / fp16 only: {q.dtype} attention runs the Pallas kernels"
        )
        return _pallas(q, k, v, segment_ids, causal)
    if segment_ids is None:
        return prefix_attention(q, k, v, None, causal)
    if single_sample:
        lengths = jnp.sum(segment_ids != 0, axis=1, dtype=jnp.int32)
        return prefix_attention(q, k, v, lengths, causal)
    reason = cudnn_packed.local_unavailable_reason()
    if reason is not None:
        _say_once(f"{reason}: packed rows run the Pallas kernels")
        return _pallas(q, k, v, segment_ids, causal)
    return _packed(q, k, v, segment_ids, causal)
