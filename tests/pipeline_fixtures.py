"""What the pipeline parity tests pipeline: tiny models, their layouts, microbatches and summed losses
(`pipeline_reference.reference_step`'s `loss_sum`), shared by the runtime tests.

- The decoder over 3 LLM stages (`DECODER_LAYOUT`): packed text microbatches of two segments per row.
- The tiny LLaVA-OV over 2 encoder + 2 LLM stages (`SEPARATE_LAYOUT`, encoder dp 2, LLM dp 1 x tp 2):
  tiles packed by row, each row's feature indices into its own block of tile slots.
- The encoder COLOCATED on the first LLM stage (`colocated_layout`), for LLaVA-OV and InternVL: row r's
  tiles in slots [r*T, (r+1)*T), its feature indices GLOBAL slot rows inside that range.
- The omni model (`OMNI`: that LLaVA-OV + an audio encoder on the first LLM stage): the colocated
  rows plus each row's audio windows packed in its own audio row; the reference encodes each
  window as a clip of its own (`omni_microbatch`, `omni_loss_sum`).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.contracts.shapes import encoder_outputs, kept_frames
from dflop_jax.data.sample_arrays import plain_taps
from models.decoder_config import DecoderConfig
from models.internvit import InternViTConfig
from models.internvl import InternVL, internvl_config
from models.llava_onevision import LlavaOnevision, llava_onevision_config
from models.loss import cross_entropy_sum
from models.omni import Omni, OmniConfig
from models.qwen2_audio import Qwen2AudioConfig
from models.siglip import SiglipConfig
from models.whisper import WhisperEncoderConfig

# -- The decoder over 3 LLM stages ---------------------------------------------------------------

DECODER_LAYOUT = Layout(
    (),
    (
        StageSpec("llm", 0, 1, tp=1, dp=2, has_embedding=True),
        StageSpec("llm", 1, 1, tp=2, dp=2),
        StageSpec("llm", 2, 1, tp=1, dp=2, has_head=True),
    ),
)


def decoder_microbatch(rng, vocab, rows, length):
    """`rows` packed text rows of two segments (random cut, then padding) over a `vocab` of tokens."""
    seg = np.zeros((rows, length), np.int32)
    pos = np.zeros((rows, length), np.int32)
    for r in range(rows):
        cut = int(rng.integers(3, length - 3))
        used = int(rng.integers(cut + 2, length + 1))
        seg[r, :cut], seg[r, cut:used] = 1, 2
        pos[r, :cut], pos[r, cut:used] = np.arange(cut), np.arange(used - cut)
    return {
        "tokens": rng.integers(0, vocab, (rows, length)).astype(np.int32),
        "feature_index": np.full((rows, length), -1, np.int32),
        "segment_ids": seg,
        "positions": pos,
        "targets": rng.integers(0, vocab, (rows, length)).astype(np.int32),
        "loss_mask": ((rng.random((rows, length)) < 0.7) & (seg > 0)).astype(np.float32),
    }


def decoder_loss_sum(m, mb):
    """The summed loss of an unsplit `models.decoder.Decoder` on a microbatch dict."""
    h = m.embed(mb["tokens"])
    logits = m.forward_embeddings(h, mb["segment_ids"], mb["positions"])
    return cross_entropy_sum(logits, mb["targets"], mb["loss_mask"])[0]


# -- The tiny MLLMs: one LLM for both placements of the encoder ------------------------------------

MLLM_TEXT = DecoderConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
    head_dim=8, qkv_bias=True,
)  # fmt: skip


def mllm_loss_sum(m, mb):
    """The summed loss of an MLLM (LLaVA-OV, InternVL) on a microbatch dict; with `feature_taps` the
    features are placed by the taps (and `feature_weight`) instead of `feature_index`."""
    keys = ("tiles", "tile_pool", "tokens", "segment_ids", "positions", "feature_index", "targets",
            "loss_mask")  # fmt: skip
    args = [mb[k] for k in keys]
    if mb["feature_taps"] is not None:  # MLLM.loss places with the taps instead
        args[keys.index("feature_index")] = mb["feature_taps"]
    return m.loss(*args, feature_weight=mb["feature_weight"])[0]


# -- LLaVA-OV over 2 encoder + 2 LLM stages ------------------------------------------------------

SEPARATE_VISION = SiglipConfig(
    hidden_size=16, intermediate_size=32, num_layers=3, num_heads=2, image_size=28, patch_size=7
)
SEPARATE_LAYOUT = Layout(
    (
        StageSpec("encoder", 0, 1, tp=1, dp=2, has_embedding=True),
        StageSpec("encoder", 1, 2, tp=1, dp=2, has_head=True),
    ),
    (
        StageSpec("llm", 0, 2, tp=2, dp=1, has_embedding=True),
        StageSpec("llm", 2, 1, tp=2, dp=1, has_head=True),
    ),
)
SEPARATE_ROWS, SEPARATE_TPT = 1, 16  # LLM rows per microbatch (the LLM's dp); feature rows per tile


def _separate_taps(rng, fidx, block):
    """[rows,S,4] taps / weights: image positions mix 4 random feature rows of their row's own block
    (`block` feature rows per row) with random fractional weights (summing to 1); TEXT / NEWLINE
    positions repeat their index with weight 1 on tap 0."""
    taps, weights = plain_taps(fidx.reshape(-1))
    img = fidx.reshape(-1) >= 0
    row = np.repeat(np.arange(fidx.shape[0]), fidx.shape[1])[img]
    taps[img] = row[:, None] * block + rng.integers(0, block, (int(img.sum()), 4))
    w = rng.random((int(img.sum()), 4)) + 0.1
    weights[img] = w / w.sum(1, keepdims=True)
    shape = (*fidx.shape, 4)
    return taps.reshape(shape).astype(np.int32), weights.reshape(shape).astype(np.float32)


def separate_microbatch(rng, row_tiles, length, rows=SEPARATE_ROWS):
    """`rows` packed rows, each gathering features of its own block of `row_tiles` tiles (global
    slot indices, row r's in [r * row_tiles * SEPARATE_TPT, (r + 1) * row_tiles * SEPARATE_TPT)). The 48-token ones
    carry exact LLaVA-OV feature taps (4 taps with fractional weights), others a plain feature_index."""
    n, block = rows * row_tiles, row_tiles * SEPARATE_TPT
    fidx = np.full((rows, length), -1, np.int32)
    k = min(block, length - 4)
    for r in range(rows):
        fidx[r, 1 : 1 + k] = r * block + rng.permutation(block)[:k]
        fidx[r, 1 + k] = -2  # image newline
    seg = np.ones((rows, length), np.int32)
    seg[:, length - 6 :] = 2
    pos = np.tile(np.concatenate([np.arange(length - 6), np.arange(6)]), (rows, 1)).astype(np.int32)
    tokens = rng.integers(1, MLLM_TEXT.vocab_size, (rows, length)).astype(np.int32)
    taps, weights = _separate_taps(rng, fidx, block) if length == 48 else (None, None)
    return {
        "feature_taps": taps,
        "feature_weight": weights,
        "tiles": rng.standard_normal((n, 28, 28, 3)).astype(np.float32),
        "tile_valid": np.ones(n, bool),
        "tile_pool": np.arange(n) == 1,  # one video frame (pooled features)
        "tokens": tokens,
        "segment_ids": seg,
        "positions": pos,
        "targets": np.roll(tokens, -1, axis=1),
        "loss_mask": (rng.random((rows, length)) < 0.6).astype(np.float32),
        "feature_index": fidx,
    }


def separate_batch(rows=SEPARATE_ROWS):
    """Three microbatches at two bucket shapes; a row's tiles a multiple of the LLM's tp (2), as
    the data layer pads each row's block."""
    rng = np.random.default_rng(0)
    shapes = ((4, 48), (2, 32), (4, 48)) if rows == 1 else ((2, 48), (4, 32), (2, 48))
    return [separate_microbatch(rng, t, s, rows) for t, s in shapes]


def separate_model():
    """The unsplit LLaVA-OV of the separate layout (a new one each call)."""
    with jax.default_device(jax.devices()[0]):
        return LlavaOnevision(llava_onevision_config(SEPARATE_VISION, MLLM_TEXT), rngs=nnx.Rngs(0))


def separate_stages(residuals: str = "recompute"):
    """The separate layout's stages (seed 0, float32), every stage under the residual policy
    `residuals` (a new set each call)."""
    from dflop_jax.programs.meshes import stage_meshes
    from dflop_jax.programs.stage_builder import build_stages

    cfg, layout = llava_onevision_config(SEPARATE_VISION, MLLM_TEXT), SEPARATE_LAYOUT
    return build_stages(cfg, layout, stage_meshes(layout), 0, compute_dtype=jax.numpy.float32,
                        residuals=[residuals] * layout.num_stages)  # fmt: skip


# -- The encoder colocated on the first LLM stage --------------------------------------------------

COLOCATED_SIGLIP = SiglipConfig(
    hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, image_size=28, patch_size=7
)
COLOCATED_INTERNVIT = InternViTConfig(hidden_size=16, intermediate_size=32, num_layers=2,
                                      num_heads=2, image_size=28, patch_size=7, dtype="float32")  # fmt: skip
COLOCATED_LLAVA = llava_onevision_config(COLOCATED_SIGLIP, MLLM_TEXT)
COLOCATED_TILES = 3  # tile slots per row (T)


def colocated_layout(dp: int, llm_stages: int) -> Layout:
    """The encoder on LLM stage 0 (tp 2); with 2 LLM stages the second holds the last layer."""
    if llm_stages == 1:
        return Layout((), (StageSpec("llm", 0, 3, tp=2, dp=dp, has_embedding=True, has_head=True),))
    return Layout(
        (),
        (
            StageSpec("llm", 0, 2, tp=2, dp=dp, has_embedding=True),
            StageSpec("llm", 2, 1, tp=1, dp=dp, has_head=True),
        ),
    )


def _row_taps(rng, fidx, lo, hi):
    """[S,4] taps / weights of one row: image positions mix 4 random rows of [lo, hi) (the row's own
    features) with fractional weights, as LLaVA-OV's bilinear downscale of an anyres grid does."""
    taps, weights = plain_taps(fidx)
    img = fidx >= 0
    taps[img] = rng.integers(lo, hi, (int(img.sum()), 4))
    w = rng.random((int(img.sum()), 4)) + 0.1
    weights[img] = w / w.sum(1, keepdims=True)
    return taps.astype(np.int32), weights.astype(np.float32)


def colocated_microbatch(
    rng, rows: int, length: int, tpt: int, *, taps: bool, video: bool, tiles: int = COLOCATED_TILES
) -> dict:
    """`rows` packed rows of two segments, each placing features of its own `tiles` tiles only."""
    per_row = tiles * tpt
    fidx = np.full((rows, length), -1, np.int32)
    k = min(per_row - 2, length - 8)
    for r in range(rows):  # row r's features: global rows [r*per_row, (r+1)*per_row)
        fidx[r, 1 : 1 + k] = r * per_row + rng.permutation(per_row)[:k]
        fidx[r, 1 + k] = -2  # an image newline (LLaVA-OV)
    seg = np.ones((rows, length), np.int32)
    seg[:, length - 6 :] = 2
    pos = np.tile(np.concatenate([np.arange(length - 6), np.arange(6)]), (rows, 1)).astype(np.int32)
    tokens = rng.integers(1, MLLM_TEXT.vocab_size, (rows, length)).astype(np.int32)
    mb = {
        "tiles": rng.integers(0, 256, (rows * tiles, 28, 28, 3)).astype(np.uint8),
        "tile_valid": np.ones(rows * tiles, bool),
        # video: the last slot of every row is a frame pooled 2x2 after the projector
        "tile_pool": (np.arange(rows * tiles) % tiles == tiles - 1) & video,
        "tokens": tokens,
        "segment_ids": seg,
        "positions": pos,
        "targets": np.roll(tokens, -1, axis=1),
        "loss_mask": (rng.random((rows, length)) < 0.6).astype(np.float32),
        "feature_index": fidx,
        "feature_taps": None,
        "feature_weight": None,
    }
    if taps:
        pairs = [_row_taps(rng, fidx[r], r * per_row, (r + 1) * per_row) for r in range(rows)]
        mb["feature_taps"] = np.stack([t for t, _ in pairs])
        mb["feature_weight"] = np.stack([w for _, w in pairs])
    return mb


@functools.cache  # not changed by a test (the reference step splits off its state)
def colocated_model(family: str):
    """The unsplit model of the colocated tests: "internvl" or LLaVA-OV (any other family)."""
    with jax.default_device(jax.devices()[0]):
        if family == "internvl":
            return InternVL(internvl_config(COLOCATED_INTERNVIT, MLLM_TEXT), rngs=nnx.Rngs(0))
        return LlavaOnevision(llava_onevision_config(COLOCATED_SIGLIP, MLLM_TEXT), rngs=nnx.Rngs(0))


# -- The omni model: the tiny LLaVA-OV + a Whisper-style audio encoder on the first LLM stage ------

OMNI_WHISPER = WhisperEncoderConfig(hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                                    num_mel_bins=8, max_source_positions=32, pool=2)  # fmt: skip
OMNI = OmniConfig.compose(COLOCATED_LLAVA, Qwen2AudioConfig(OMNI_WHISPER, MLLM_TEXT))
OMNI_LENGTH = 64  # tokens per row: image features at 1..46, audio tokens at 48..57 (segment 1)
OMNI_VALID = (13, 30)  # valid frames of each row's two windows: 3 + 7 = 10 audio tokens
OMNI_AUDIO_BUCKET = 64  # frames per audio row: kept 16 + 32, then padding
OMNI_CLIP_FRAMES = 32  # the reference's frames per clip (each clip alone, zero-padded)


def omni_model() -> Omni:
    """The unsplit omni model of `OMNI` (seed 0)."""
    with jax.default_device(jax.devices()[0]):
        return Omni(OMNI, rngs=nnx.Rngs(0))


def omni_microbatch(rng, rows: int, tpt: int, *, audio: bool, taps: bool, video: bool) -> tuple:
    """(packed microbatch, the reference's inputs): `colocated_microbatch`'s rows (4 tiles each),
    with `audio` two windows per row packed in the row's audio row (`data.packing`'s layout: kept
    frames back to back, window numbers, valid frames, GLOBAL output rows r*A/4 + frame/4 + j) and,
    for the reference, the same windows as separate clips (`Omni.embed`: clip c's outputs at rows
    c*F/4 + j of the flattened clips). Without `audio` the audio fields are None."""
    mb = colocated_microbatch(rng, rows, OMNI_LENGTH, tpt, taps=taps, video=video, tiles=4)
    ref = dict(mb, audio=None, audio_lengths=None, audio_index=None)
    mb.update(audio=None, audio_windows=None, audio_valid=None, audio_index=None)
    if not audio:
        return mb, ref
    A, F, mels = OMNI_AUDIO_BUCKET, OMNI_CLIP_FRAMES, OMNI.audio.audio.num_mel_bins
    mb["audio"] = np.zeros((rows, A, mels), np.float32)
    mb["audio_windows"] = np.zeros((rows, A), np.int32)
    mb["audio_valid"] = np.zeros((rows, A), bool)
    mb["audio_index"] = np.full((rows, OMNI_LENGTH), -1, np.int32)
    clips = np.zeros((rows * len(OMNI_VALID), F, mels), np.float32)
    ref_index = np.full((rows, OMNI_LENGTH), -1, np.int32)
    for r in range(rows):
        frame, token = 0, 48
        for w, valid in enumerate(OMNI_VALID):
            kept, n = kept_frames(valid), encoder_outputs(valid)
            feats = rng.normal(size=(kept, mels)).astype(np.float32)
            mb["audio"][r, frame : frame + kept] = feats
            mb["audio_windows"][r, frame : frame + kept] = w + 1
            mb["audio_valid"][r, frame : frame + valid] = True
            mb["audio_index"][r, token : token + n] = r * A // 4 + frame // 4 + np.arange(n)
            c = r * len(OMNI_VALID) + w
            clips[c, :kept] = feats
            ref_index[r, token : token + n] = c * F // 4 + np.arange(n)
            frame, token = frame + kept, token + n
    lengths = np.tile(np.asarray(OMNI_VALID, np.int32), rows)
    ref.update(audio=clips, audio_lengths=lengths, audio_index=ref_index)
    return mb, ref


def omni_loss_sum(m, ref):
    """The summed loss of the unsplit `Omni` on `omni_microbatch`'s reference inputs: each clip
    encoded alone, every feature placed by its GLOBAL index into the whole microbatch's outputs."""
    index = ref["feature_taps"] if ref["feature_taps"] is not None else ref["feature_index"]
    h = m.embed(ref["tiles"], ref["tile_pool"], ref["audio"], ref["audio_lengths"], ref["tokens"],
                index, ref["audio_index"], ref["feature_weight"])  # fmt: skip
    h = m.llm(h, ref["segment_ids"], ref["positions"])
    return m.llm.loss(h, ref["targets"], ref["loss_mask"])[0]


# -- A Qwen2-Audio model: that audio encoder + the MLLM decoder, no vision -------------------------

QWEN2_AUDIO = Qwen2AudioConfig(OMNI_WHISPER, MLLM_TEXT)


def qwen2_audio_model():
    """The unsplit Qwen2-Audio model of `QWEN2_AUDIO` (seed 0)."""
    from models.qwen2_audio import Qwen2Audio

    with jax.default_device(jax.devices()[0]):
        return Qwen2Audio(QWEN2_AUDIO, rngs=nnx.Rngs(0))


def audio_microbatch(rng, rows: int, *, audio: bool) -> tuple:
    """(packed microbatch, the reference's inputs): `omni_microbatch`'s rows without images (every
    feature index TEXT, no tile), with `audio` two windows per row as there."""
    mb, ref = omni_microbatch(rng, rows, OMNI.tokens_per_tile, audio=audio, taps=False, video=False)
    for d in (mb, ref):
        d.update(feature_index=np.full_like(d["feature_index"], -1),
                 tiles=d["tiles"][:0], tile_valid=d["tile_valid"][:0], tile_pool=d["tile_pool"][:0])  # fmt: skip
    return mb, ref


def qwen2_audio_loss_sum(m, ref):
    """The summed loss of the unsplit `Qwen2Audio` on `audio_microbatch`'s reference inputs: each
    clip encoded alone, every feature placed by its GLOBAL index into the microbatch's outputs."""
    return m.loss(ref["audio"], ref["audio_lengths"], ref["tokens"], ref["segment_ids"],
                  ref["positions"], ref["audio_index"], ref["targets"], ref["loss_mask"])[0]  # fmt: skip


def as_pool(mb: dict, rng: np.random.Generator, spare: int, tpt: int) -> dict:
    """`mb` packed as one pool: its tiles shuffled over the slots plus `spare` unused ones (so the
    pool no longer splits evenly over the LLM stage's devices), every feature index moved with its
    tile (`tpt` feature rows a tile). Rows now read features outside their block, which only a
    pooled stage (`Layout.pooled_tiles`) places right."""
    n = mb["tiles"].shape[0]
    to = rng.permutation(n + spare)[:n]  # tile slot i -> slot to[i] of n + spare

    def moved(idx):
        slot, k = np.divmod(np.maximum(idx, 0), tpt)
        return np.where(idx >= 0, to[slot] * tpt + k, idx).astype(idx.dtype)

    out = dict(mb, feature_index=moved(mb["feature_index"]))
    if mb.get("feature_taps") is not None:
        out["feature_taps"] = moved(mb["feature_taps"])
    for key in ("tiles", "tile_valid", "tile_pool"):
        pool = np.zeros((n + spare,) + mb[key].shape[1:], mb[key].dtype)
        pool[to] = mb[key]
        out[key] = pool
    return out
