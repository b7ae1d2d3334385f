"""Audio records as they ship: files, embedded bytes in parquet and tar shards, `<audio>` markers, the
shape the scheduler sees, counted bad audio, the data profile and the synthetic audio mixes.

Token counts are checked against Qwen2-Audio's processor formula (transformers'
`Qwen2AudioProcessor`: input_lengths = (frames - 1) // 2 + 1, tokens = (input_lengths - 2) // 2 + 1,
frames = ceil(samples / 160)), written out here, not taken from the code under test."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from audio_fixtures import tone, wav_bytes

from dflop_jax.contracts import SampleShape
from dflop_jax.contracts.shape_distribution import (
    load_shape_distribution,
    save_shape_distribution,
)
from dflop_jax.data.bad_sample import BadSample
from dflop_jax.data.config import DataConfig
from dflop_jax.data.dataset import load_source
from dflop_jax.data.metadata import MetadataCache
from dflop_jax.data.process import Processor
from dflop_jax.data.sample_arrays import TEXT
from dflop_jax.data.shape_profile import summarize
from dflop_jax.data.shards import tar_sample_record
from dflop_jax.data.transforms import PackSpec, ShapeStage

pytest.importorskip("av")
RATE = 8000  # written clips are resampled to 16 kHz when read


def _qwen2_audio_tokens(seconds: float) -> int:
    """Qwen2-Audio's token count of one window of `seconds` (at most 30)."""
    frames = math.ceil(round(seconds * 16000) / 160)
    input_lengths = (frames - 1) // 2 + 1
    return (input_lengths - 2) // 2 + 1


def _conv(q: str = "<audio>\nWhat is said?", a: str = "Hello.") -> list[dict]:
    return [{"from": "human", "value": q}, {"from": "gpt", "value": a}]


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("clips")
    for name, seconds in (("short", 3.7), ("long", 65.0), ("tiny", 0.01)):
        (d / f"{name}.wav").write_bytes(wav_bytes(tone(seconds, 440, RATE, 8000), RATE))
    (d / "broken.wav").write_bytes(b"RIFF....WAVEfmt not really")
    return d


@pytest.fixture(scope="module")
def proc():
    return Processor(DataConfig(max_audio_s=120.0))


def _rec(clips, **fields) -> dict:
    return {"_audio_root": str(clips), "_image_root": str(clips), **fields}


def test_a_clip_becomes_bos_one_token_per_output_eos(proc, clips):
    record = _rec(clips, id="a", audio="short.wav", conversations=_conv())
    shape = proc.shape(record)
    sample = proc.process(record)
    n = _qwen2_audio_tokens(3.7)
    assert shape.audio_windows == (math.ceil(3.7 * 16000 / 160),)
    assert shape.modality == "audio" and shape.tiles == 0
    assert shape.tokens == sample.num_tokens  # shapes from metadata = the processed sample
    ids = sample.token_ids
    bos, audio_id, eos = (
        proc.tok.token_id(t) for t in ("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>")
    )
    assert (ids == audio_id).sum() == n
    start = int(np.flatnonzero(ids == bos)[0])
    assert ids[start + n + 1] == eos and (ids[start + 1 : start + n + 1] == audio_id).all()
    # each <|AUDIO|> position takes the next encoder output; everything else is text, unlearned
    assert (sample.audio_source[ids == audio_id] == np.arange(n)).all()
    assert (sample.audio_source[ids != audio_id] == TEXT).all()
    assert not sample.assistant_mask[start : start + n + 2].any()
    assert (sample.feature_source[ids == audio_id] == TEXT).all()  # no image feature taken
    assert len(sample.audio) == 1 and sample.audio[0].valid_frames == shape.audio_windows[0]
    assert sample.audio[0].features.shape[1] == 128


def test_a_long_clip_is_cut_into_30_s_windows(proc, clips):
    record = _rec(clips, id="long", audio="long.wav", conversations=_conv())
    shape = proc.shape(record)
    assert shape.audio_windows == (3000, 3000, 500)
    assert shape.audio_seconds == pytest.approx(65.0)
    sample = proc.process(record)
    expected = 2 * _qwen2_audio_tokens(30.0) + _qwen2_audio_tokens(5.0)
    assert (sample.token_ids == proc.tok.token_id("<|AUDIO|>")).sum() == expected
    assert [w.valid_frames for w in sample.audio] == [3000, 3000, 500]
    assert shape.tokens == sample.num_tokens


def test_markers_order_audio_and_images(proc, clips, tmp_path):
    from PIL import Image

    Image.new("RGB", (500, 300), (10, 20, 30)).save(clips / "pic.png")
    q = "Listen <audio> then look <image> and listen <audio>"
    record = _rec(clips, id="omni", image="pic.png", audio=["short.wav", "long.wav"],
                  conversations=_conv(q))  # fmt: skip
    shape = proc.shape(record)
    sample = proc.process(record)
    assert shape.modality == "omni" and shape.tiles > 0
    assert shape.audio_windows == (370, 3000, 3000, 500) and shape.tokens == sample.num_tokens
    ids = sample.token_ids
    bos = np.flatnonzero(ids == proc.tok.token_id("<|audio_bos|>"))
    image = np.flatnonzero(ids == proc.tok.token_id("<image>"))
    assert len(bos) == 2 and bos[0] < image[0] < image[-1] < bos[1]  # the text's order
    # outputs are numbered across clips: the second clip's first output follows the first clip's
    first_n = _qwen2_audio_tokens(3.7)
    assert sample.audio_source[bos[1] + 1] == first_n


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"audio": "short.wav", "conversations": _conv("<audio><audio> twice?")}, "bad_markers"),
        ({"audio": "short.wav", "conversations": [
            {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "<audio>"}]}, "bad_markers"),
        ({"audio": [], "conversations": _conv("<audio> where?")}, "bad_markers"),
        ({"audio": "nowhere.wav", "conversations": _conv()}, "missing_file"),
        ({"audio": "broken.wav", "conversations": _conv()}, "unreadable_audio"),
        ({"audio": {"bytes": b"\x00" * 64, "path": "x.wav"}, "conversations": _conv()},
         "unreadable_audio"),
        ({"audio": "tiny.wav", "conversations": _conv()}, "empty_audio"),
        ({"audio": 7, "conversations": _conv()}, "missing_file"),
    ],
)  # fmt: skip
def test_bad_audio_raises_its_reason(proc, clips, fields, reason):
    with pytest.raises(BadSample) as e:
        proc.shape(_rec(clips, id="bad", **fields))
    assert e.value.reason == reason


def test_too_long_for_max_audio_s(clips):
    proc = Processor(DataConfig(max_audio_s=60.0))
    with pytest.raises(BadSample) as e:
        proc.shape(_rec(clips, audio="long.wav", conversations=_conv()))
    assert e.value.reason == "audio_too_long" and "60" in e.value.detail


def test_markers_are_added_and_empty_audio_is_text(proc, clips):
    added = proc.shape(_rec(clips, audio="short.wav", conversations=_conv("What is said?")))
    given = proc.shape(
        _rec(clips, audio="short.wav", conversations=_conv("<audio>\nWhat is said?"))
    )
    assert added == given
    text = proc.shape(_rec(clips, audio=[], conversations=_conv("What is said?")))
    assert text.modality == "text" and text.audio_windows == ()


def test_embedded_bytes_parquet_and_tar_equal_the_file(proc, clips, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    data = (clips / "short.wav").read_bytes()
    from_file = proc.shape(_rec(clips, id="a", audio="short.wav", conversations=_conv()))
    from_bytes = proc.shape({"id": "a", "audio": {"bytes": data, "path": "x.wav"},
                             "conversations": _conv()})  # fmt: skip
    assert from_bytes == from_file
    table = pa.table({"id": ["a"], "audio": [{"bytes": data, "path": "short.wav"}],
                      "conversations": [_conv()]})  # fmt: skip
    pq.write_table(table, tmp_path / "train.parquet")
    (row,) = load_source(DataConfig(source=str(tmp_path / "train.parquet"), cache_dir=""))
    assert proc.shape(row) == from_file
    meta = json.dumps({"id": "a", "conversations": _conv()}).encode()
    tar = tar_sample_record("a", [("json", meta), ("wav", data)], "shard.tar:a")
    assert proc.shape(tar) == from_file


def test_audio_root_and_a_mix_key(clips, tmp_path):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text(json.dumps({"id": "a", "audio": "short.wav", "conversations": _conv()}) + "\n")
    proc = Processor(DataConfig())
    (r,) = load_source(DataConfig(source=str(jsonl), audio_root=str(clips)))
    assert proc.shape(r).audio_windows == (370,)
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"audio_root: {clips}\ndatasets:\n  - path: d.jsonl\n")
    (r,) = load_source(DataConfig(source=str(mix)))
    assert proc.shape(r).audio_windows == (370,)
    (r,) = load_source(DataConfig(source=str(jsonl)))  # no root: the dataset's folder
    with pytest.raises(BadSample, match="missing_file"):
        proc.shape(r)


def test_shapes_survive_the_cache_and_the_distribution_file(proc, clips, tmp_path):
    jsonl = tmp_path / "d.jsonl"
    rows = [{"id": "a", "audio": "long.wav", "conversations": _conv()},
            {"id": "t", "conversations": _conv("Hi", "Yo")}]  # fmt: skip
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = load_source(DataConfig(source=str(jsonl), audio_root=str(clips)))
    first = MetadataCache(tmp_path / "cache", proc)
    computed = first.shapes(records)
    again = MetadataCache(tmp_path / "cache", proc)
    assert again.shapes(records) == computed and again.hits == 2
    assert computed[0].audio_windows == (3000, 3000, 500)
    save_shape_distribution(computed, tmp_path / "dist.json", "d", {})
    loaded = load_shape_distribution(tmp_path / "dist.json")
    assert [s.audio_windows for s in loaded] == [(3000, 3000, 500), ()]


def test_a_model_without_an_audio_encoder_skips_audio_samples_counted(proc, clips, caplog):
    spec = PackSpec(1, 1, (384, 384, 3), 729, 64, 100_000, 4)
    stage = ShapeStage(proc, spec, strict=False)
    with caplog.at_level("WARNING"):
        heard = stage(_rec(clips, _location="d.jsonl:7", audio="short.wav", conversations=_conv()))
    assert heard.shape is None and heard.reason == "no_audio_encoder"
    assert "d.jsonl:7" in caplog.text and "no audio encoder" in caplog.text  # where, and why
    text = stage(_rec(clips, conversations=_conv("Hi", "Yo")))
    assert text.shape is not None
    hears = PackSpec(1, 1, (384, 384, 3), 729, 64, 100_000, 4, audio_mels=128,
                     max_audio_frames=3000)  # fmt: skip
    hearing = ShapeStage(proc, hears, strict=False, quiet=True)
    assert hearing(_rec(clips, audio="short.wav", conversations=_conv())).shape is not None
    # more audio than the largest audio bucket holds: a counted too_long skip, like too many tokens
    small = ShapeStage(proc, dataclasses.replace(hears, max_audio_frames=100), strict=False,
                       quiet=True)  # fmt: skip
    assert small(_rec(clips, audio="short.wav", conversations=_conv())).reason == "too_long"


def test_a_model_without_a_vision_encoder_skips_image_samples_counted(proc, clips, caplog):
    """A Qwen2-Audio (or decoder-only) model's loader: a sample with image tiles is a counted
    "no_vision_encoder" skip (never placeholder tokens trained as text); audio and text pass."""
    from dflop_jax.contracts import SampleShape
    from dflop_jax.data.transforms import Known

    hears = PackSpec(1, 1, (384, 384, 3), 729, 64, 100_000, 4, audio_mels=128,
                     max_audio_frames=3000, vision=False)  # fmt: skip
    stage = ShapeStage(proc, hears, strict=False)
    record = {"id": "img", "_location": "d.jsonl:3", "conversations": _conv()}
    with caplog.at_level("WARNING"):
        seen = stage(Known(record, SampleShape("img", 4, 3000, "image")))
    assert seen.shape is None and seen.reason == "no_vision_encoder"
    assert "d.jsonl:3" in caplog.text and "no vision encoder" in caplog.text
    assert stage(_rec(clips, audio="short.wav", conversations=_conv())).shape is not None
    assert stage(_rec(clips, conversations=_conv("Hi", "Yo"))).shape is not None
    seeing = ShapeStage(proc, dataclasses.replace(hears, vision=True), strict=False)
    assert seeing(Known(record, SampleShape("img", 4, 3000, "image"))).shape is not None


def test_synthetic_omni_mix_and_its_profile(tmp_path):
    cfg = DataConfig(synth_dir=str(tmp_path / "omni"), synth_samples=80, synth_mix="omni",
                     cache_dir="", max_tokens=32768)  # fmt: skip
    records = load_source(cfg)
    proc = Processor(cfg)
    shapes = [proc.shape(r) for r in records]
    by_kind: dict[str, list[SampleShape]] = {}
    for r, s in zip(records, shapes):
        by_kind.setdefault(r["data_source"], []).append(s)
    speech = [s.audio_seconds for s in by_kind["speech"]]
    assert min(speech) >= 1.0 and max(speech) <= 35.0
    assert all(len(s.audio_windows) >= 1 for s in by_kind["speech"])
    assert all(len(s.audio_windows) >= 1 for s in by_kind["sound"])
    assert any(len(s.audio_windows) > 1 for s in by_kind["sound"])  # 20-65 s: several windows
    assert all(s.modality == "omni" and s.tiles > 0 for s in by_kind["audio_image"])
    assert not any(s.audio_windows for s in by_kind["single_image"] + by_kind["text"])
    summary = summarize(shapes, [r["data_source"] for r in records])
    heard = [s for s in shapes if s.audio_windows]
    assert summary["all"]["audio_seconds"]["mean"] == pytest.approx(
        np.mean([s.audio_seconds for s in heard])
    )
    assert "audio_seconds" not in summary["image"]
    sample = proc.process(next(r for r in records if r["data_source"] == "sound"))
    assert len(sample.audio) >= 2 and sample.audio[0].features.shape == (3000, 128)
