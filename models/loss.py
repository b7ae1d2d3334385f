"""Next-token cross-entropy as a (sum, count) pair, so the runtime normalizes by the loss tokens of
the whole global batch (packing and microbatching then never change the objective)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
    logits = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)  # [B,S]
    target_logit = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[
        ..., 0
    ]
    mask = loss_mask.astype(jnp.float32)
    return jnp.sum((logz - target_logit) * mask), jnp.sum(mask)
