"""Placing projected image features into packed token rows: a gather with indices the loader precomputes.

`feature_index` follows `dflop_jax/data/sample_arrays.py` (restated here because models/ does not import
dflop_jax): TEXT (-1) keeps the token embedding, NEWLINE (-2) takes the learned image-newline vector,
i >= 0 takes row i of the microbatch's flattened features [num_tile_slots * tokens_per_tile, D], or,
with per-row features [B, F, D] (an encoder colocated on the LLM's mesh: each packed row reads only the
tiles of its own data shard, so no feature crosses shards), row i of that row's own features.
The exact form for interpolated LLaVA-OV features (`models/layouts.py` `taps`) passes a trailing axis
of K taps with weights; a plain gather is K = 1 (or no trailing axis).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TEXT = -1
NEWLINE = -2


def place_features(
    embeds: jax.Array,
    features: jax.Array,
    feature_index: jax.Array,
    newline: jax.Array | None = None,
    feature_weight: jax.Array | None = None,
) -> jax.Array:
    """Token embeddings with image positions replaced by their features.

    Args:
      embeds: [B,S,D] token embeddings.
      features: [F,D] flattened projected features of the microbatch, or [B,F,D]: row b's own
        features (indices then count within the row).
      feature_index: [B,S] int32, or [B,S,K] with `feature_weight` (weighted sum of K rows).
      newline: [D] image-newline embedding, or None when the model has none (NEWLINE is then an error
        in the data, and such positions get zeros).
      feature_weight: [B,S,K] weights of the K taps (None: a plain gather).

    Returns:
      [B,S,D] in embeds.dtype. Gradients flow to `embeds` (TEXT positions), `features`, `newline`.
    """
    d = embeds.shape[-1]
    extra = (
        newline[None].astype(features.dtype)
        if newline is not None
        else jnp.zeros((1, d), features.dtype)
    )
    per_row = features.ndim == 3
    if per_row:
        extra = jnp.broadcast_to(extra, (features.shape[0], 1, d))
    table = jnp.concatenate([features, extra], axis=-2)  # [(B,) F+1, D]; row F is the newline
    if feature_index.ndim == embeds.ndim - 1:  # [B,S]: a plain gather, one tap
        if feature_weight is not None:
            raise ValueError(
                "place_features: feature_weight needs feature_index [B,S,K], got [B,S]"
            )
        feature_index = feature_index[..., None]
    idx = jnp.where(feature_index == NEWLINE, features.shape[-2], jnp.maximum(feature_index, 0))
    if per_row:  # a batched gather: each row from its own table, partitioned along B
        gathered = jax.vmap(lambda t, i: jnp.take(t, i, axis=0))(table, idx)  # [B,S,K,D]
    else:
        gathered = jnp.take(table, idx, axis=0)  # [B,S,K,D]
    if feature_weight is None:
        gathered = gathered[..., 0, :]
    else:
        gathered = jnp.einsum("bskd,bsk->bsd", gathered, feature_weight.astype(gathered.dtype))
    is_text = feature_index[..., 0] == TEXT
    return jnp.where(is_text[..., None], embeds, gathered.astype(embeds.dtype))


def flatten_tiles(features: jax.Array) -> jax.Array:
    """[T, tokens_per_tile, D] -> [T * tokens_per_tile, D] (tile slot s covers rows s*tpt ...)."""
    return features.reshape(-1, features.shape[-1])


__all__ = ["NEWLINE", "TEXT", "flatten_tiles", "place_features"]
