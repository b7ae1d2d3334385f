"""Qwen2-Audio: Whisper encoder (pooled by 2, then its final LayerNorm) + linear projector + Qwen2 decoder.

HF order (`Qwen2AudioForConditionalGeneration`): conv embedding, encoder layers, AvgPool1d(2, 2) over
time, LayerNorm (the tower's `layer_norm`), then `multi_modal_projector.linear` (with bias) into the
LLM width: the pool and the norm belong to the audio tower (`models.whisper.AudioStage` with
`pool=2`), the projector is the linear alone. Features replace the embeddings of the `<|AUDIO|>`
tokens (`audio_token_id`): HF scatters each clip's valid outputs, clip after clip, into the audio
token positions in row-major order; `audio_feature_index` builds the same gather for
`models.placement.place_features`.

Build: `Qwen2Audio(cfg, rngs=...)`. Call: `model(features, lengths, tokens, segment_ids, positions,
feature_index) -> logits`, with features [C, F, M] (C clips, F frames, a multiple of 4, at most
3000) and lengths [C] valid frames. Stages: `AudioEncoderStage` (audio layers, + conv embedding if
first, + pool, norm and projector if last) and `models.mllm.LLMStage` (decoder layers, + token
embedding and feature placement if first), built alone through `models.stage_modules.stage_module`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.decoder_config import DecoderConfig
from models.layers import constrain, keyed_rngs, make_param
from models.mllm import LLMStage
from models.placement import TEXT
from models.whisper import AudioStage, WhisperEncoderConfig

__all__ = [
    "AudioEncoderStage",
    "AudioProjector",
    "LLMStage",
    "Qwen2Audio",
    "Qwen2AudioConfig",
    "audio_feature_index",
]


@dataclasses.dataclass(frozen=True)
class Qwen2AudioConfig:
    """Qwen2-Audio shapes: `audio` (a Whisper encoder with pool=2) and `text` (the decoder)."""

    audio: WhisperEncoderConfig
    text: DecoderConfig
    audio_token_id: int = 151646

    def __post_init__(self):
        if self.audio.pool != 2:
            raise ValueError(
                f"Qwen2AudioConfig.audio.pool={self.audio.pool}; Qwen2-Audio pools its encoder "
                "output by 2: build the audio config with pool=2"
            )

    has_newline = False  # what models.mllm.LLMStage reads: no image newline

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


class AudioProjector(nnx.Module):
    """[C, N, Da] -> [C, N, D]: one linear with bias (HF `Qwen2AudioMultiModalProjector`)."""

    def __init__(self, d_in: int, d_out: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        init, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros
        # Replicated (a small matrix; its input axis is the tower's width, its output the LLM's).
        self.kernel = make_param(rngs, init, (d_in, d_out), (None, "embed"), param_dtype)
        self.bias = make_param(rngs, zeros, (d_out,), ("embed",), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(self.dtype)
        out = jnp.einsum("cnd,de->cne", x, self.kernel[...].astype(x.dtype))
        return constrain(out + self.bias[...].astype(x.dtype), ("batch", "length", "act_embed"))


class AudioEncoderStage(nnx.Module):
    """Audio layers [first_layer, first_layer + num_layers) with optional embedding / projector head."""

    def __init__(
        self,
        cfg: Qwen2AudioConfig,
        *,
        first_layer: int,
        num_layers: int,
        has_embedding: bool,
        has_head: bool,
        rngs: nnx.Rngs,
    ):
        self.cfg, self.has_head = cfg, has_head
        self.audio = AudioStage(
            cfg.audio, first_layer=first_layer, num_layers=num_layers,
            has_embedding=has_embedding, has_head=has_head, rngs=keyed_rngs(rngs, "audio"),
        )  # fmt: skip
        if has_head:
            self.projector = AudioProjector(
                cfg.audio.hidden_size, cfg.text.hidden_size, dtype=jnp.dtype(cfg.audio.dtype),
                param_dtype=jnp.dtype(cfg.audio.param_dtype), rngs=keyed_rngs(rngs, "projector"),
            )  # fmt: skip

    def __call__(
        self,
        x: jax.Array,
        lengths: jax.Array | None = None,
        windows: jax.Array | None = None,
        valid: jax.Array | None = None,
    ) -> jax.Array:
        """x: features [C,F,M] (first stage) or hidden [C,F/2,Da]; lengths [C] valid mel frames,
        or packed rows of windows (`windows`, `valid` [C,F]: `models.whisper`'s module docstring).

        Returns hidden [C,F/2,Da], or on the head stage projected features [C,F/4,D] (row j of clip
        c is valid for j < `cfg.audio.output_lengths(lengths[c])`; packed, a window's outputs start
        at its first frame / 4).
        """
        h = self.audio(x, lengths, windows, valid)
        return self.projector(h) if self.has_head else h


class Qwen2Audio(nnx.Module):
    """The unsplit model: `encoder` (every audio layer + projector) and `llm` (every decoder layer)."""

    def __init__(self, cfg: Qwen2AudioConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        whole = dict(first_layer=0, has_embedding=True, has_head=True, rngs=rngs)
        self.encoder = AudioEncoderStage(cfg, num_layers=cfg.audio.num_layers, **whole)
        self.llm = LLMStage(cfg, num_layers=cfg.text.num_layers, **whole)

    def hidden(self, features, lengths, tokens, segment_ids, positions, feature_index):
        """Final hidden states [B,S,D] (before the final norm); features None: text only."""
        clips = None
        if features is not None and features.shape[0]:
            clips = self.encoder(features, lengths)  # [C, F/4, D]
        h = self.llm.embed(tokens, clips, feature_index)
        return self.llm(h, segment_ids, positions)

    def __call__(self, features, lengths, tokens, segment_ids, positions, feature_index):
        """features [C,F,M], lengths [C], tokens/segment_ids/positions/feature_index [B,S] -> [B,S,V]."""
        h = self.hidden(features, lengths, tokens, segment_ids, positions, feature_index)
        return self.llm.logits(h)

    def loss(self, features, lengths, tokens, segment_ids, positions, feature_index, targets,
             loss_mask):  # fmt: skip
        """(summed cross-entropy, loss-token count); targets [B,S] int, loss_mask [B,S]."""
        h = self.hidden(features, lengths, tokens, segment_ids, positions, feature_index)
        return self.llm.loss(h, targets, loss_mask)


def audio_feature_index(
    tokens: np.ndarray, audio_token_id: int, out_lengths, slots: int
) -> np.ndarray:
    """[B,S] int32 rows of the flattened clip features [C * slots, D] per token (TEXT elsewhere).

    The k-th audio token in row-major order takes the k-th valid output, clips in order (clip c's
    valid rows c * slots + j, j < out_lengths[c]), as HF's `masked_scatter` places them.

    Args:
      tokens: [B,S] token ids.
      out_lengths: [C] valid encoder outputs per clip (`WhisperEncoderConfig.output_lengths`).
      slots: encoder output rows per clip (F / 4 of the features given to the encoder).
    """
    tokens = np.asarray(tokens)
    rows = [c * slots + np.arange(int(n)) for c, n in enumerate(out_lengths)]
    rows = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    is_audio = tokens == audio_token_id
    if int(is_audio.sum()) != len(rows):
        raise ValueError(
            f"{int(is_audio.sum())} audio tokens but {len(rows)} audio features "
            f"(valid outputs {list(map(int, out_lengths))}): give one token per valid output"
        )
    index = np.full(tokens.shape, TEXT, np.int32)
    index[is_audio] = rows
    return index
