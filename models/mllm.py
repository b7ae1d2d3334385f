"""A ViT + projector + decoder multimodal LLM expressed as pipeline STAGES (used by LLaVA-OneVision in
`models/llava_onevision.py` and InternVL in `models/internvl.py`).

Stages (each a module holding only its own parameters, so it can live on its own submesh):
  EncoderStage  vision layers [a, b) (+ patch embedding if first) (+ feature head and projector if
                last): tiles [T,H,W,3] or hidden [T,N,Dv] -> hidden [T,N,Dv], or on the last encoder
                stage projected per-tile features [T, tokens_per_tile, D].
  LLMStage      decoder layers [a, b) (+ token embedding, image-newline and feature placement if first)
                (+ final norm, head and loss if last).
`MLLM` is the unsplit model (one EncoderStage + one LLMStage holding everything) and
`extract_stages` cuts it into stages that share its arrays, so split == unsplit by construction and
gradients flow through every cut (each cut is an ordinary array boundary). Random init is keyed by part
("vision", "projector", "text", "image_newline") and, inside, by global layer index, so a stage built
on its own from the same rngs holds exactly the params the whole model holds for it.

The config object (`LlavaOnevisionConfig` / `InternVLConfig`) provides: vision (ViTConfig, trimmed to
the layers the feature layer needs), text (DecoderConfig), tokens_per_tile, drop_cls, shuffle_ratio,
projector_in, projector_bias, projector_act, projector_norm_eps, has_newline, pool_video.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from models.decoder import DecoderStage
from models.layers import extract_layer_range, keyed_rngs, make_param
from models.placement import flatten_tiles, place_features
from models.projector import MlpProjector, pixel_shuffle, pool_tiles
from models.vit import VisionStage


class EncoderStage(nnx.Module):
    """Vision layers [first_layer, first_layer + num_layers) with optional embedding / projector head."""

    def __init__(
        self,
        cfg,
        *,
        first_layer: int,
        num_layers: int,
        has_embedding: bool,
        has_head: bool,
        rngs: nnx.Rngs,
    ):
        self.cfg = cfg
        self.has_head = has_head
        self.vision = VisionStage(
            cfg.vision,
            first_layer=first_layer,
            num_layers=num_layers,
            has_embedding=has_embedding,
            has_head=has_head,
            rngs=keyed_rngs(rngs, "vision"),
        )
        if has_head:
            self.projector = MlpProjector(
                cfg.projector_in,
                cfg.text.hidden_size,
                bias=cfg.projector_bias,
                act=cfg.projector_act,
                pre_norm_eps=cfg.projector_norm_eps,
                dtype=jnp.dtype(cfg.vision.dtype),
                param_dtype=jnp.dtype(cfg.vision.param_dtype),
                rngs=keyed_rngs(rngs, "projector"),
            )

    def __call__(self, x: jax.Array, tile_pool: jax.Array | None = None) -> jax.Array:
        """x: tiles [T,H,W,3] (first stage) or hidden [T,N,Dv]; tile_pool [T] bool (video frames).

        Returns hidden [T,N,Dv], or on the head stage features [T, tokens_per_tile, D].
        """
        h = self.vision(x)
        if not self.has_head:
            return h
        cfg = self.cfg
        if cfg.drop_cls:
            h = h[:, 1:]
        if cfg.shuffle_ratio is not None:
            h = pixel_shuffle(h, cfg.shuffle_ratio)
        features = self.projector(h)
        if cfg.pool_video and tile_pool is not None:
            features = pool_tiles(features, tile_pool, cfg.vision.patches_per_side)
        return features


class LLMStage(nnx.Module):
    """Decoder layers [first_layer, first_layer + num_layers) with optional placement / head + loss."""

    def __init__(
        self,
        cfg,
        *,
        first_layer: int,
        num_layers: int,
        has_embedding: bool,
        has_head: bool,
        rngs: nnx.Rngs,
    ):
        self.cfg = cfg
        self.has_embedding, self.has_head = has_embedding, has_head
        self.decoder = DecoderStage(
            cfg.text,
            first_layer=first_layer,
            num_layers=num_layers,
            has_embedding=has_embedding,
            has_head=has_head,
            rngs=keyed_rngs(rngs, "text"),
        )
        if has_embedding and cfg.has_newline:
            init = nnx.initializers.normal(cfg.text.hidden_size**-0.5)
            self.image_newline = make_param(
                keyed_rngs(rngs, "image_newline"),
                init,
                (cfg.text.hidden_size,),
                ("embed",),
                cfg.text.param_jnp_dtype,
            )

    def embed(
        self,
        tokens: jax.Array,
        features: jax.Array | None,
        feature_index: jax.Array | None,
        feature_weight: jax.Array | None = None,
        *,
        per_row: bool = False,
    ) -> jax.Array:
        """tokens [B,S]; features [T, tokens_per_tile, D] or None (text only); feature_index [B,S](,K).

        per_row: the tiles are packed by row, row b's in [b*T/B, (b+1)*T/B), and row b gathers only
        its own block's features. Indices may stay the data layer's global tile-slot rows: row b's
        lie in [b*L, (b+1)*L) (L = T/B * tokens_per_tile), so modulo L is the row's own, also where
        this code sees only some rows (the runtime's per-replica backward runs on each data shard,
        with that shard's block of tiles). Each row then needs only its own features on its devices.
        """
        h = self.decoder.embed(tokens)
        if features is None or features.shape[0] == 0:
            return h
        newline = self.image_newline[...] if self.cfg.has_newline else None
        features = features.astype(h.dtype)
        if not per_row:
            return place_features(
                h, flatten_tiles(features), feature_index, newline, feature_weight
            )
        table = features.reshape(tokens.shape[0], -1, features.shape[-1])  # [B, L, D]
        local = jnp.where(feature_index >= 0, feature_index % table.shape[1], feature_index)
        return place_features(h, table, local, newline, feature_weight)

    def __call__(
        self, h: jax.Array, segment_ids: jax.Array | None, positions: jax.Array
    ) -> jax.Array:
        """h [B,S,D] -> [B,S,D] through this stage's layers."""
        return self.decoder(h, segment_ids, positions)

    def logits(self, h: jax.Array) -> jax.Array:
        """h [B,S,D] -> [B,S,V]."""
        return self.decoder.logits(h)

    def loss(
        self, h: jax.Array, targets: jax.Array, loss_mask: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """(summed cross-entropy, loss-token count) of the head stage's output, chunked: no full logits."""
        return self.decoder.loss(h, targets, loss_mask)


class ColocatedStage(nnx.Module):
    """The whole encoder and the first LLM stage's layers in one stage: the encoder COLOCATED on LLM
    stage 0's devices (the layout the planner picks when a separate encoder would idle).

    The tiles of packed row b sit in tile slots [b*T, (b+1)*T) (T = tiles // rows): the encoder runs
    data-parallel over the rows' shard axis and each row gathers only its own tiles' features
    (`LLMStage.embed(per_row=True)`), so with tiles and rows sharded alike no feature crosses
    shards.
    Params are `encoder` (an `EncoderStage` holding every vision layer and the projector) and `llm`
    (an `LLMStage` with the embedding), the same names and init as `MLLM`'s.
    """

    def __init__(self, encoder: EncoderStage, llm: LLMStage):
        self.encoder, self.llm = encoder, llm

    def embed(self, tiles, tile_pool, tokens, feature_index, feature_weight=None) -> jax.Array:
        """tiles [B*T,H,W,3] (T may be 0), tile_pool [B*T], tokens [B,S], feature_index [B,S](,K)
        -> the rows' embeddings with their features placed [B,S,D]."""
        if tiles.shape[0] == 0:
            return self.llm.embed(tokens, None, None)
        features = self.encoder(tiles, tile_pool)  # [B*T, tokens_per_tile, D]
        return self.llm.embed(tokens, features, feature_index, feature_weight, per_row=True)

    def __call__(self, h, segment_ids, positions) -> jax.Array:
        return self.llm(h, segment_ids, positions)

    def loss(self, h, targets, loss_mask) -> tuple[jax.Array, jax.Array]:
        return self.llm.loss(h, targets, loss_mask)


class MLLM(nnx.Module):
    """The unsplit model: `encoder` (every vision layer + projector) and `llm` (every decoder layer)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.encoder = EncoderStage(
            cfg,
            first_layer=0,
            num_layers=cfg.vision.num_layers,
            has_embedding=True,
            has_head=True,
            rngs=rngs,
        )
        self.llm = LLMStage(
            cfg,
            first_layer=0,
            num_layers=cfg.text.num_layers,
            has_embedding=True,
            has_head=True,
            rngs=rngs,
        )

    def hidden(
        self, tiles, tile_pool, tokens, segment_ids, positions, feature_index, feature_weight=None
    ):
        """Final hidden states [B,S,D] (before the final norm)."""
        features = self.encoder(tiles, tile_pool) if tiles is not None and tiles.shape[0] else None
        h = self.llm.embed(tokens, features, feature_index, feature_weight)
        return self.llm(h, segment_ids, positions)

    def __call__(
        self, tiles, tile_pool, tokens, segment_ids, positions, feature_index, feature_weight=None
    ):
        """tiles [T,H,W,3], tile_pool [T] bool, tokens/segment_ids/positions/feature_index [B,S] -> logits [B,S,V]."""
        return self.llm.logits(
            self.hidden(
                tiles, tile_pool, tokens, segment_ids, positions, feature_index, feature_weight
            )
        )

    def loss(
        self,
        tiles,
        tile_pool,
        tokens,
        segment_ids,
        positions,
        feature_index,
        targets,
        loss_mask,
        feature_weight=None,
    ):
        """(summed cross-entropy, loss-token count); targets [B,S] int, loss_mask [B,S]."""
        h = self.hidden(
            tiles, tile_pool, tokens, segment_ids, positions, feature_index, feature_weight
        )
        return self.llm.loss(h, targets, loss_mask)


def extract_stages(
    model: MLLM, encoder_layers: Sequence[int], llm_layers: Sequence[int]
) -> tuple[list[EncoderStage], list[LLMStage]]:
    """Cuts `model` into stages sharing its arrays.

    Args:
      encoder_layers: vision layers per encoder stage (sum = cfg.vision.num_layers, each >= 0).
      llm_layers: decoder layers per LLM stage (sum = cfg.text.num_layers).
    """
    cfg = model.cfg
    for name, split, total in (
        ("encoder", encoder_layers, cfg.vision.num_layers),
        ("llm", llm_layers, cfg.text.num_layers),
    ):
        if sum(split) != total or min(split) < 0 or not split:
            raise ValueError(f"{name} stage layers {list(split)} must be >= 0 and sum to {total}")
    full = dict(nnx.to_flat_state(nnx.state(model)))

    def cut(stage_cls, split, prefix, layer_key):
        stages, first = [], 0
        for i, n in enumerate(split):
            last = i == len(split) - 1
            factory = lambda f=first, n=n, i=i, last=last: stage_cls(
                cfg, first_layer=f, num_layers=n, has_embedding=i == 0, has_head=last,
                rngs=nnx.Rngs(0),
            )  # fmt: skip
            stages.append(extract_layer_range(factory, full, prefix, layer_key, first))
            first += n
        return stages

    return (
        cut(EncoderStage, encoder_layers, ("encoder",), ("vision", "layers")),
        cut(LLMStage, llm_layers, ("llm",), ("decoder", "layers")),
    )
