"""An omni model: LLaVA-OneVision's vision tower and projector, Qwen2-Audio's audio tower and projector,
and one decoder that takes both kinds of features.

Image and video tokens take the vision features as LLaVA-OneVision places them (`feature_index`, or
exact bilinear taps with `feature_weight`); `<|AUDIO|>` tokens take the audio features as Qwen2-Audio
places them (`audio_index`, `models.qwen2_audio.audio_feature_index`). Both placements run on the
same token embeddings, so a row may hold images, video, audio and text together.

Build: `Omni(cfg, rngs=...)` (random), or from two HF checkpoints (`models.hf.omni.load_omni`: a
LLaVA-OneVision one gives the vision tower, its projector and the decoder; a Qwen2-Audio one the audio
tower and its projector). Params: `encoder` (the vision `EncoderStage`), `audio` (the
`AudioEncoderStage`) and `llm` (the `LLMStage`), the names and random init of `MLLM` and `Qwen2Audio`,
so either family's name map reads the part it knows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.llava_onevision import LlavaOnevisionConfig
from models.mllm import EncoderStage, LLMStage
from models.placement import TEXT, flatten_tiles, place_features
from models.qwen2_audio import AudioEncoderStage, Qwen2AudioConfig

__all__ = ["Omni", "OmniConfig", "OmniFirstStage"]


@dataclasses.dataclass(frozen=True)
class OmniConfig:
    """`llava`: the LLaVA-OneVision config (vision tower, projector and the decoder `text`);
    `audio`: the Qwen2-Audio config whose `text` is that same decoder (its projector's output width
    is the decoder's). `vision` and `text` are the vision tower's and the decoder's configs, as an
    MLLM config names them."""

    llava: LlavaOnevisionConfig
    audio: Qwen2AudioConfig

    def __post_init__(self):
        if self.audio.text != self.llava.text:
            raise ValueError(
                "OmniConfig: the audio config's decoder must be the vision config's (one LLM); "
                "build it with OmniConfig.compose"
            )

    @classmethod
    def compose(cls, llava: LlavaOnevisionConfig, audio: Qwen2AudioConfig) -> OmniConfig:
        """The omni config of a LLaVA-OneVision model and a Qwen2-Audio model's audio part: the
        decoder is the vision model's; the audio projector must already project into its width."""
        if audio.text.hidden_size != llava.text.hidden_size:
            raise ValueError(
                f"the audio projector writes {audio.text.hidden_size}-wide features but the "
                f"decoder is {llava.text.hidden_size} wide: pick a Qwen2-Audio checkpoint whose "
                "LLM has the vision model's width"
            )
        return cls(llava, audio.replace(text=llava.text))

    @property
    def vision(self):
        """The vision tower's config."""
        return self.llava.vision

    @property
    def text(self):
        """The decoder's config."""
        return self.llava.text

    @property
    def tokens_per_tile(self) -> int:
        """LLM tokens per vision tile (the vision model's)."""
        return self.llava.tokens_per_tile

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


class Omni(nnx.Module):
    """The unsplit omni model: `encoder` (vision), `audio` and `llm`, each whole."""

    def __init__(self, cfg: OmniConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        whole = dict(first_layer=0, has_embedding=True, has_head=True, rngs=rngs)
        self.encoder = EncoderStage(cfg.llava, num_layers=cfg.vision.num_layers, **whole)
        self.audio = AudioEncoderStage(cfg.audio, num_layers=cfg.audio.audio.num_layers, **whole)
        self.llm = LLMStage(cfg.llava, num_layers=cfg.text.num_layers, **whole)

    def embed(self, tiles, tile_pool, audio, audio_lengths, tokens, feature_index, audio_index,
              feature_weight=None) -> jax.Array:  # fmt: skip
        """Token embeddings [B,S,D] with the vision and audio features placed.

        tiles [T,H,W,3] and tile_pool [T] (T may be 0 or tiles None: no image); audio [C,F,M] log-mel
        windows and audio_lengths [C] valid frames (C may be 0 or audio None: no audio);
        feature_index [B,S](,K) and feature_weight: the vision placement; audio_index [B,S]: rows of
        the flattened audio features [C * F/4, D] per `<|AUDIO|>` token, TEXT elsewhere.
        """
        visual = None
        if tiles is not None and tiles.shape[0]:
            visual = self.encoder(tiles, tile_pool)
        h = self.llm.embed(tokens, visual, feature_index, feature_weight)
        if audio is None or audio.shape[0] == 0:
            return h
        clips = self.audio(audio, audio_lengths)  # [C, F/4, D]
        return place_features(h, flatten_tiles(clips.astype(h.dtype)), audio_index)

    def __call__(self, tiles, tile_pool, audio, audio_lengths, tokens, segment_ids, positions,
                 feature_index, audio_index, feature_weight=None) -> jax.Array:  # fmt: skip
        """Logits [B,S,V]; arguments as `embed`'s, with segment_ids and positions [B,S]."""
        h = self.embed(tiles, tile_pool, audio, audio_lengths, tokens, feature_index, audio_index,
                       feature_weight)  # fmt: skip
        return self.llm.logits(self.llm(h, segment_ids, positions))


class OmniFirstStage(nnx.Module):
    """The first LLM stage of the omni model with the whole audio encoder on its devices (and, with
    `encoder`, the whole vision encoder too): each LLM row's audio windows arrive packed in that
    row's own audio row (`dflop_jax.data.packing`), the encoder runs them as packed windows on the
    row's shard, and each row places only its own outputs, so no feature crosses shards. Without
    `audio` (the audio encoder on stages of its own) the rows' audio features arrive encoded.
    Params: `encoder` (optional), `audio` (optional) and `llm`, the names and init of `Omni`'s."""

    def __init__(
        self,
        audio: AudioEncoderStage | None,
        llm: LLMStage,
        encoder: EncoderStage | None = None,
    ):
        self.llm = llm
        if audio is not None:
            self.audio = audio
        if encoder is not None:
            self.encoder = encoder

    def embed(self, features, tokens, feature_index, feature_weight, audio, windows, valid,
              audio_index, *, per_row: bool = True) -> jax.Array:  # fmt: skip
        """The rows' embeddings [B,S,D] with every feature placed.

        features: the vision features [B*T, tokens_per_tile, D] from the encoder stages, or, with
        a colocated `encoder`, its inputs (tiles [B*T,H,W,3], tile_pool [B*T]); None: no image.
        audio, windows, valid: [B, A, M] / [B, A] packed audio rows (None: no audio); without
        an `audio` encoder, audio is the rows' encoded features [B, A/4, D] (windows, valid unused);
        audio_index [B,S]: global output rows (row b's in [b*A/4, (b+1)*A/4)) or TEXT.
        per_row: the vision features are packed by row (`LLMStage.embed`); False: one pool, placed
        by pool slot (`Layout.pooled_tiles`).
        """
        if hasattr(self, "encoder") and features is not None:
            tiles, tile_pool = features
            features = self.encoder(tiles, tile_pool) if tiles.shape[0] else None
        h = self.llm.embed(tokens, features, feature_index, feature_weight, per_row=per_row)
        if audio is None or audio.shape[1] == 0:
            return h
        if hasattr(self, "audio"):
            audio = self.audio(audio, None, windows, valid)
        clips = audio.astype(h.dtype)  # [B, A/4, D]
        local = jnp.where(audio_index >= 0, audio_index % clips.shape[1], TEXT)
        return place_features(h, clips, local)

    def __call__(self, h, segment_ids, positions) -> jax.Array:
        return self.llm(h, segment_ids, positions)

    def loss(self, h, targets, loss_mask) -> tuple[jax.Array, jax.Array]:
        return self.llm.loss(h, targets, loss_mask)
