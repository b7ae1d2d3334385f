"""Audio samples packed into microbatch rows (`pack_microbatch` with an audio bucket), run through a
Qwen2-Audio model as packed windows: every sample's logits equal those of the sample run alone through
the model's per-clip path (`lengths` and `audio_feature_index`, the HF-parity path)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from audio_fixtures import tone, wav_bytes
from flax import nnx
from models_fixtures import tiny_decoder_config

from dflop_jax.contracts import ScheduledMicrobatch
from dflop_jax.data.config import DataConfig
from dflop_jax.data.packing import pack_microbatch
from dflop_jax.data.process import Processor
from dflop_jax.data.sample_arrays import TEXT
from models.qwen2_audio import Qwen2Audio, Qwen2AudioConfig, audio_feature_index
from models.whisper import WhisperEncoderConfig

pytest.importorskip("av")
MELS = 16
run = nnx.jit(lambda m, *a: m(*a))


def _record(i: int, clips: list[float]) -> dict:
    audio = [{"bytes": wav_bytes(tone(s, 200 + 150 * i + 40 * j), 16000), "path": f"{i}-{j}.wav"}
             for j, s in enumerate(clips)]  # fmt: skip
    question = "".join("<audio>" for _ in clips) + f"Question {i}?"
    conv = [{"from": "human", "value": question}, {"from": "gpt", "value": f"Answer {i}."}]
    return {"id": f"s{i}", "conversations": conv, **({"audio": audio} if clips else {})}


@pytest.fixture(scope="module")
def batch():
    """Four samples in two rows: row 0 two clips then one, row 1 a text sample then a clip."""
    proc = Processor(DataConfig(audio_mels=MELS))
    records = [_record(0, [0.9, 1.7]), _record(1, [0.45]), _record(2, []), _record(3, [2.3])]
    shapes = [proc.shape(r) for r in records]
    samples = [proc.process(r) for r in records]
    rows = ((0, 1), (2, 3))
    frames = max(sum(shapes[i].audio_frames for i in row) for row in rows)
    plan = ScheduledMicrobatch(1, 512, rows, tiles_by_row=True, audio_bucket=frames + 8)
    mb, counts = pack_microbatch(plan, samples, shapes, encoder_dp=1, llm_dp=2,
                                 tile_shape=(28, 28, 3), tokens_per_tile=16,
                                 audio_mels=MELS)  # fmt: skip
    return proc, shapes, samples, plan, mb, counts


@pytest.fixture(scope="module")
def model(batch):
    proc = batch[0]
    audio = WhisperEncoderConfig(hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                                 num_mel_bins=MELS, pool=2)  # fmt: skip
    text = tiny_decoder_config(vocab_size=proc.tok.vocab_size, max_position_embeddings=512)
    cfg = Qwen2AudioConfig(audio, text, audio_token_id=proc.tok.token_id("<|AUDIO|>"))
    return Qwen2Audio(cfg, rngs=nnx.Rngs(3)), cfg


def test_rows_hold_each_rows_windows_and_count_the_padding(batch):
    _, shapes, samples, plan, mb, counts = batch
    A = plan.audio_bucket
    assert mb.audio.shape == (2, A, MELS) and mb.audio_index.shape == mb.tokens.shape
    row0 = [w.valid_frames for i in (0, 1) for w in samples[i].audio]
    windows = mb.audio_windows[0]
    assert windows.max() == len(row0) == 3  # numbered within the row
    assert [int(mb.audio_valid[0][windows == k].sum()) for k in (1, 2, 3)] == row0
    real = sum(s.audio_frames for s in shapes)
    assert (counts.audio_frames_real, counts.audio_frames_computed) == (real, 2 * A)
    assert (mb.audio_windows > 0).sum() == real
    # audio_index: every <|AUDIO|> position takes a distinct output of its own row
    heard = mb.audio_index != TEXT
    assert heard.sum() == sum(int((s.audio_source >= 0).sum()) for s in samples if s.audio)
    for r in range(2):
        rows = mb.audio_index[r][heard[r]]
        assert len(set(rows.tolist())) == len(rows)
        assert ((rows >= r * A // 4) & (rows < (r + 1) * A // 4)).all()


def test_packed_rows_give_each_samples_logits_alone(batch, model):
    _, shapes, samples, plan, mb, _ = batch
    qa, cfg = model
    packed = nnx.jit(lambda m, *a: _packed_logits(m, *a))(
        qa, *(jnp.asarray(x) for x in (mb.audio, mb.audio_windows, mb.audio_valid, mb.tokens,
                                       mb.segment_ids, mb.positions, mb.audio_index))
    )  # fmt: skip
    packed = np.asarray(packed)
    for r, row in enumerate(plan.shards):
        for segment, i in enumerate(row, start=1):
            span = mb.segment_ids[r] == segment
            alone = _alone_logits(qa, cfg, samples[i])
            np.testing.assert_allclose(packed[r][span], alone, atol=2e-5, err_msg=f"sample {i}")


def _packed_logits(model, audio, windows, valid, tokens, segment_ids, positions, audio_index):
    features = model.encoder(audio, None, windows, valid)  # [rows, A/4, D]
    h = model.llm.embed(tokens, features, audio_index, per_row=True)
    return model.llm.logits(model.llm(h, segment_ids, positions))


def _alone_logits(model, cfg, sample):
    """The sample alone: its windows padded to the longest as clips [C, F, M] with `lengths`."""
    tokens = sample.token_ids[None]
    s = tokens.shape[1]
    ones, pos = jnp.ones((1, s), jnp.int32), jnp.arange(s, dtype=jnp.int32)[None]
    if not sample.audio:
        return np.asarray(run(model, None, None, jnp.asarray(tokens), ones, pos, None))[0]
    frames = max(w.features.shape[0] for w in sample.audio)
    feats = np.stack([np.pad(w.features, [(0, frames - len(w.features)), (0, 0)])
                      for w in sample.audio])  # fmt: skip
    valid = np.array([w.valid_frames for w in sample.audio])
    index = audio_feature_index(tokens, cfg.audio_token_id, cfg.audio.output_lengths(valid),
                                frames // 4)  # fmt: skip
    out = run(model, jnp.asarray(feats), jnp.asarray(valid), jnp.asarray(tokens), ones, pos,
              jnp.asarray(index))  # fmt: skip
    return np.asarray(out)[0]
