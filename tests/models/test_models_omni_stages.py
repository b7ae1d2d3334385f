"""The omni model's pipeline stages (`models.stage_modules.stage_module` of an `OmniConfig`): a vision
encoder stage, the first LLM stage holding the whole audio encoder (`OmniFirstStage`), and the last
LLM stage, fed a microbatch the data layer packed (tiles in each row's block, audio windows in each
row's audio row), give every sample the logits of the whole model run on that sample alone."""

from __future__ import annotations

import io

import jax.numpy as jnp
import numpy as np
import pytest
from audio_fixtures import tone, wav_bytes
from flax import nnx
from models_fixtures import tiny_llava_ov_config
from PIL import Image

from dflop_jax.contracts import ScheduledMicrobatch
from dflop_jax.data.config import DataConfig
from dflop_jax.data.packing import pack_microbatch
from dflop_jax.data.process import Processor
from models.omni import Omni, OmniConfig, OmniFirstStage
from models.qwen2_audio import Qwen2AudioConfig, audio_feature_index
from models.stage_modules import stage_module, with_attention, with_remat
from models.whisper import WhisperEncoderConfig

pytest.importorskip("av")
MELS, TILE = 16, 28
run = nnx.jit(lambda m, *a: m(*a))


def _png(w: int, h: int, colour) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, format="PNG")
    return buf.getvalue()


def _conv(q: str) -> list[dict]:
    return [{"from": "human", "value": q}, {"from": "gpt", "value": "An answer."}]


@pytest.fixture(scope="module")
def packed():
    """Row 0: a sample with an image and a clip, then a text sample; row 1: a sample with two
    clips."""
    data = DataConfig(tile_size=TILE, patch_size=7, audio_mels=MELS, max_grid=2)
    proc = Processor(data)
    records = [
        {"id": "a", "image": {"bytes": _png(50, 40, (200, 30, 90)), "path": "a.png"},
         "audio": {"bytes": wav_bytes(tone(1.3, 300), 16000), "path": "a.wav"}, "conversations": _conv("What?")},
        {"id": "t", "conversations": _conv("Just text.")},
        {"id": "b", "audio": [{"bytes": wav_bytes(tone(1.3, 500), 16000), "path": "b1.wav"},
                              {"bytes": wav_bytes(tone(0.6, 700), 16000), "path": "b2.wav"}],
         "conversations": _conv("<audio> then <audio>?")},
    ]  # fmt: skip
    shapes = [proc.shape(r) for r in records]
    samples = [proc.process(r) for r in records]
    rows = ((0, 1), (2,))
    tiles = max(sum(shapes[i].tiles for i in row) for row in rows)
    frames = max(sum(shapes[i].audio_frames for i in row) for row in rows)
    plan = ScheduledMicrobatch(tiles, 512, rows, tiles_by_row=True, audio_bucket=frames + 4)
    mb, _ = pack_microbatch(plan, samples, shapes, encoder_dp=1, llm_dp=2,
                            tile_shape=(TILE, TILE, 3), tokens_per_tile=16, feature_taps=4,
                            audio_mels=MELS)  # fmt: skip
    return proc, samples, plan, mb


@pytest.fixture(scope="module")
def config(packed):
    proc = packed[0]
    vision = tiny_llava_ov_config()
    text = vision.text.replace(vocab_size=384, max_position_embeddings=512)
    vision = vision.__class__(**{**vision.__dict__, "text": text,
                                 "image_token_id": proc.tok.token_id("<image>"),
                                 "video_token_id": proc.tok.token_id("<video>")})  # fmt: skip
    audio = WhisperEncoderConfig(hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                                 num_mel_bins=MELS, pool=2)  # fmt: skip
    return OmniConfig(vision, Qwen2AudioConfig(audio, text, proc.tok.token_id("<|AUDIO|>")))


def test_stage_modules_hold_the_whole_models_params(config):
    whole = Omni(config, rngs=nnx.Rngs(4))
    first = stage_module(config, "llm", first_layer=0, num_layers=1, has_embedding=True,
                         has_head=False, rngs=nnx.Rngs(4))  # fmt: skip
    assert isinstance(first, OmniFirstStage) and not hasattr(first, "encoder")
    theirs = dict(nnx.to_flat_state(nnx.state(whole.audio)))
    for path, value in nnx.to_flat_state(nnx.state(first.audio)):
        np.testing.assert_array_equal(value[...], theirs[path][...], err_msg=str(path))
    colocated = stage_module(config, "llm", first_layer=0, num_layers=1, has_embedding=True,
                             has_head=False, rngs=nnx.Rngs(4), colocated=True)  # fmt: skip
    assert hasattr(colocated, "encoder")
    with pytest.raises(ValueError, match="only the first LLM stage"):
        stage_module(config, "llm", first_layer=1, num_layers=1, has_embedding=False,
                     has_head=True, rngs=nnx.Rngs(4), colocated=True)  # fmt: skip


def test_settings_reach_every_tower(config):
    fast = with_attention(config, "pallas", vision="xla")
    assert fast.vision.attention_impl == fast.audio.audio.attention_impl == "xla"
    assert fast.text.attention_impl == fast.audio.text.attention_impl == "pallas"
    saved = with_remat(config, {"vision": "full", "llm": "dots"})
    assert saved.vision.remat == saved.audio.audio.remat == "full"
    assert saved.text.remat == "dots"
    assert (
        with_remat(config, {"vision": "full", "audio": "none", "llm": "dots"}).audio.audio.remat
        == "none"
    )


@pytest.mark.parametrize("colocated", [False, True])
def test_packed_stages_give_each_samples_logits_alone(packed, config, colocated):
    _, samples, plan, mb = packed
    whole = Omni(config, rngs=nnx.Rngs(4))
    n = config.text.num_layers
    flags = dict(rngs=nnx.Rngs(4), first_layer=0, has_embedding=True)
    first = stage_module(config, "llm", num_layers=1, has_head=False, colocated=colocated, **flags)
    last = stage_module(config, "llm", first_layer=1, num_layers=n - 1, has_embedding=False,
                        has_head=True, rngs=nnx.Rngs(4))  # fmt: skip
    tiles, pool = jnp.asarray(mb.tiles), jnp.asarray(mb.tile_pool)
    if colocated:
        features = (tiles, pool)
    else:
        encoder = stage_module(config, "encoder", num_layers=config.vision.num_layers,
                               has_head=True, **flags)  # fmt: skip
        features = run(encoder, tiles, pool)
    args = (jnp.asarray(mb.tokens), jnp.asarray(mb.feature_taps), jnp.asarray(mb.feature_weight),
            jnp.asarray(mb.audio), jnp.asarray(mb.audio_windows), jnp.asarray(mb.audio_valid),
            jnp.asarray(mb.audio_index))  # fmt: skip
    h = nnx.jit(lambda m, f, *a: m.embed(f, *a))(first, features, *args)
    seg, pos = jnp.asarray(mb.segment_ids), jnp.asarray(mb.positions)
    h = run(first, h, seg, pos)
    logits = np.asarray(nnx.jit(lambda m, h, s, p: m.logits(m(h, s, p)))(last, h, seg, pos))
    for r, row in enumerate(plan.shards):
        for segment, i in enumerate(row, start=1):
            span = mb.segment_ids[r] == segment
            np.testing.assert_allclose(logits[r][span], _alone(whole, config, samples[i]),
                                       atol=3e-5, err_msg=f"sample {i}")  # fmt: skip


def _alone(model, cfg, sample):
    tokens = sample.token_ids[None]
    s = tokens.shape[1]
    ones, pos = jnp.ones((1, s), jnp.int32), jnp.arange(s, dtype=jnp.int32)[None]
    tiles = jnp.asarray(sample.tiles)
    audio, lengths, index = None, None, np.full(tokens.shape, -1, np.int32)
    if sample.audio:
        frames = max(w.features.shape[0] for w in sample.audio)
        audio = jnp.asarray(np.stack([np.pad(w.features, [(0, frames - len(w.features)), (0, 0)])
                                      for w in sample.audio]))  # fmt: skip
        valid = np.array([w.valid_frames for w in sample.audio])
        lengths = jnp.asarray(valid)
        index = audio_feature_index(tokens, cfg.audio.audio_token_id,
                                    cfg.audio.audio.output_lengths(valid), frames // 4)  # fmt: skip
    out = run(model, tiles, jnp.asarray(sample.tile_pool), audio, lengths, jnp.asarray(tokens),
              ones, pos, jnp.asarray(sample.feature_taps[None]), jnp.asarray(index),
              jnp.asarray(sample.feature_weight[None]))  # fmt: skip
    return np.asarray(out)[0]
