"""Next-token cross-entropy as a (sum, count) pair, so the runtime normalizes by the loss tokens of
the whole global batch (packing and microbatching then never change the objective).

Two entry points over one core (`_token_nll`):
  cross_entropy_sum(logits, ...)                   for callers that already hold [B,S,V] logits;
  chunked_cross_entropy_sum(hidden, head, ...)     the training loss: never holds [B,S,V] logits.

The chunked form scans over chunks of `chunk` sequence positions; each chunk projects its hidden
states to vocabulary logits, takes the float32 log-sum-exp and target logit and keeps only the
[B, chunk] losses. The chunk body is under `jax.checkpoint`, so the backward recomputes a chunk's
logits instead of saving them: peak memory holds one chunk's [B, chunk, V] logits, not the whole
sequence's. When tensor parallelism shards the vocabulary (the head's "vocab" axis on "model"), the
log-sum-exp and the target pick are reductions over the sharded axis, which GSPMD splits into local
reductions plus an all-reduce; the target is picked with an iota comparison (not a gather) so no
shard ever needs another shard's logits.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

# h [B,c,D] -> logits [B,c,V] (the model's vocabulary projection; any float dtype).
Head = Callable[[jax.Array], jax.Array]


def _token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """[B,S,V] logits, [B,S] targets -> [B,S] float32 -log p(target)."""
    logits = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    hit = vocab == targets[..., None].astype(jnp.int32)
    return logz - jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)


def _masked_sum(nll: jax.Array, loss_mask: jax.Array) -> jax.Array:
    return jnp.sum(nll * loss_mask.astype(jnp.float32))


def cross_entropy_sum(
    logits: jax.Array, targets: jax.Array, loss_mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Summed token cross-entropy in float32.

    Args:
      logits: [B,S,V] (any float dtype; upcast to float32 before the log-softmax).
      targets: [B,S] int, the next token (already shifted by the data layer).
      loss_mask: [B,S] 0/1 (float or bool), 1 where the token counts.

    Returns:
      (sum_loss, num_tokens): float32 scalars; sum over masked tokens of -log p(target).
    """
    return _masked_sum(_token_nll(logits, targets), loss_mask), jnp.sum(
        loss_mask.astype(jnp.float32)
    )


def _chunk_loss(head: Head) -> Callable:
    """Loss of one chunk, rematerialized in the backward (its logits are never saved)."""

    @jax.checkpoint
    def loss(h, targets, mask):
        return _masked_sum(_token_nll(head(h), targets), mask)

    return loss


def _split(x: jax.Array, n: int, chunk: int) -> jax.Array:
    """[B, >= n*chunk, ...] -> [n, B, chunk, ...] (the first n*chunk positions, chunk-major)."""
    x = x[:, : n * chunk]
    return jnp.moveaxis(x.reshape(x.shape[0], n, chunk, *x.shape[2:]), 1, 0)


def chunked_cross_entropy_sum(
    hidden: jax.Array,
    head: Head,
    targets: jax.Array,
    loss_mask: jax.Array,
    *,
    chunk: int,
) -> tuple[jax.Array, jax.Array]:
    """`cross_entropy_sum(head(hidden), targets, loss_mask)` without the [B,S,V] logits.

    Args:
      hidden: [B,S,D] final hidden states (after the final norm: `head` is only the projection).
      head: h [B,c,D] -> logits [B,c,V]; a closure over the head weight (an untied [D,V] matrix or a
        tied [V,D] embedding). It should read the weight in its stored dtype and cast inside, so the
        weight's gradient accumulates over chunks in that dtype.
      targets, loss_mask: [B,S], as for `cross_entropy_sum`.
      chunk: sequence positions per chunk (> 0); the whole sequence when S <= chunk. When chunk does
        not divide S, the remainder is one shorter chunk (no padded positions are computed).

    Returns:
      (sum_loss, num_tokens), equal to `cross_entropy_sum` on the full logits.
    """
    if chunk <= 0:
        raise ValueError(f"chunk={chunk} must be > 0 (sequence positions per loss chunk)")
    seq = hidden.shape[1]
    chunk = max(1, min(chunk, seq))
    n, tail = divmod(seq, chunk)
    loss = _chunk_loss(head)

    def body(total, xs):
        return total + loss(*xs), None

    xs = tuple(_split(x, n, chunk) for x in (hidden, targets, loss_mask))
    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)
    if tail:
        end = n * chunk
        total = total + loss(hidden[:, end:], targets[:, end:], loss_mask[:, end:])
    return total, jnp.sum(loss_mask.astype(jnp.float32))
