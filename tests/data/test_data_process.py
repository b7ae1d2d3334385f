"""Processor: shapes from metadata equal what processing real pixels yields; bad inputs raise BadSample."""

import json
import math

import numpy as np
import pytest
from PIL import Image

from dflop_jax.data.bad_sample import BadSample
from dflop_jax.data.config import DataConfig
from dflop_jax.data.dataset import load_source
from dflop_jax.data.process import Processor
from dflop_jax.data.sample_arrays import NEWLINE, TEXT


def _image(path, w, h):
    Image.new("RGB", (w, h), (40, 90, 200)).save(path)
    return path.name


def _frames(folder, n):
    folder.mkdir()
    for i in range(n):
        Image.new("RGB", (40, 30), (i, 0, 0)).save(folder / f"{i:04d}.jpg")
    return folder.name


def _mp4(path, seconds, fps):
    av = pytest.importorskip("av")
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        for i in range(seconds * fps):
            c.mux(
                s.encode(
                    av.VideoFrame.from_ndarray(np.full((48, 64, 3), i, np.uint8), format="rgb24")
                )
            )
        c.mux(s.encode())
    return path.name


def _conv(q="<image>\nWhat is shown?", a="A blue box."):
    return [{"from": "human", "value": q}, {"from": "gpt", "value": a}]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    d = tmp_path_factory.mktemp("ds")
    records = [
        {"id": "wide", "image": _image(d / "wide.png", 1000, 600), "conversations": _conv()},
        {"id": "tall", "image": _image(d / "tall.jpg", 300, 1700), "conversations": _conv()},
        {"id": "huge", "image": _image(d / "huge.png", 2300, 2000), "conversations": _conv()},
        {"id": "multi", "image": ["wide.png", "tall.jpg", "huge.png"], "conversations": _conv("Compare <image> <image> <image>")},
        {"id": "frames", "video": _frames(d / "clip", 40), "conversations": _conv("<video>\nWhat happens?")},
        {"id": "mp4", "video": _mp4(d / "clip.mp4", 6, 4), "conversations": _conv("<video>\nWhat happens?")},
        {"id": "text", "conversations": _conv("Hi there", "Hello!") + _conv("And?", "More.")},
        {"id": "plain", "text": "Plain text pretraining."},
    ]  # fmt: skip
    (d / "data.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return d / "data.jsonl"


def _records(path, **kw):
    cfg = DataConfig(source=str(path), **kw)
    return cfg, {r["id"]: r for r in load_source(cfg)}


def _hf_llava_tokens(h, w, tile=384, patches=27, max_patches=9, max_grid=6):
    """LLaVA-OV image tokens, written from HF's `_get_number_of_features` formula (independent of models/)."""
    pinpoints = [
        (tile * r, tile * c) for r in range(1, max_grid + 1) for c in range(1, max_grid + 1)
    ]
    best, best_eff, best_waste = None, 0, math.inf
    for ph, pw in pinpoints:
        s = min(pw / w, ph / h)
        eff = min(int(w * s) * int(h * s), w * h)
        waste = ph * pw - eff
        if eff > best_eff or (eff == best_eff and waste < best_waste):
            best, best_eff, best_waste = (ph, pw), eff, waste
    rows, cols = best[0] // tile, best[1] // tile
    ch, cw = patches * rows, patches * cols
    if w / h > cw / ch:
        ch -= ((ch - int(round(h * (cw / w), 7))) // 2) * 2
    else:
        cw -= ((cw - int(round(w * (ch / h), 7))) // 2) * 2
    unpadded, newline = ch * cw, ch
    ratio = math.sqrt(ch * cw / (max_patches * patches**2))
    if ratio > 1.1:
        unpadded, newline = int(ch // ratio) * int(cw // ratio), int(ch // ratio)
    return patches * patches + unpadded + newline, 1 + rows * cols


def _text_tokens(proc, sample, ids_to_drop):
    return int(np.isin(sample.token_ids, ids_to_drop, invert=True).sum())


@pytest.mark.parametrize("family", ["llava_ov", "internvl"])
@pytest.mark.parametrize("rid", ["wide", "tall", "huge", "multi", "frames", "mp4", "text", "plain"])
def test_shape_from_metadata_matches_processed(dataset, family, rid):
    cfg, recs = _records(dataset, model_family=family)
    proc = Processor(cfg)
    shape = proc.shape(recs[rid])
    sample = proc.process(recs[rid])
    assert (shape.tiles, shape.tokens) == (sample.num_tiles, sample.num_tokens)
    assert (
        sample.tiles.shape[1:] == (cfg.tile_px, cfg.tile_px, 3) and sample.tiles.dtype == np.uint8
    )
    n = sample.num_tokens
    assert (
        sample.token_ids.shape == sample.assistant_mask.shape == sample.feature_source.shape == (n,)
    )
    feats = sample.feature_source[sample.feature_source >= 0]
    tpt = 729 if family == "llava_ov" else 256
    assert feats.max(initial=-1) < sample.num_tiles * tpt
    assert (
        sample.assistant_mask.any()
        and not sample.assistant_mask[sample.feature_source != TEXT].any()
    )
    assert shape.modality == sample.modality


def test_llava_ov_counts_against_reference_formula(dataset):
    cfg, recs = _records(dataset)
    proc = Processor(cfg)
    image_id, video_id = proc.tok.token_id("<image>"), proc.tok.token_id("<video>")
    sizes = {"wide": (600, 1000), "tall": (1700, 300), "huge": (2000, 2300)}
    for rid, (h, w) in sizes.items():
        s = proc.process(recs[rid])
        tokens, tiles = _hf_llava_tokens(h, w)
        assert (int((s.token_ids == image_id).sum()), s.num_tiles) == (tokens, tiles), rid
        assert int((s.feature_source == NEWLINE).sum()) > 0
    multi = proc.process(recs["multi"])
    assert (int((multi.token_ids == image_id).sum()), multi.num_tiles) == (3 * 730, 3)
    frames = proc.process(
        recs["frames"]
    )  # 40 frames at 1 fps, capped at 32; 14x14 pooled + 1 newline
    assert (int((frames.token_ids == video_id).sum()), frames.num_tiles) == (32 * 196 + 1, 32)
    assert frames.tile_pool.all() and not multi.tile_pool.any()
    mp4 = proc.process(recs["mp4"])  # 6 s at 4 fps sampled at 1 fps
    assert mp4.num_tiles == 6


def test_internvl_counts_against_reference(dataset):
    cfg, recs = _records(dataset, model_family="internvl")
    proc = Processor(cfg)
    ctx = proc.tok.token_id("<IMG_CONTEXT>")
    # 1000x600 -> aspect 1.67 -> 3x2 grid + thumbnail; 300x1700 -> 1x6 grid (aspect 0.176 ~ 1/6) + thumbnail
    for rid, tiles in {"wide": 7, "tall": 7}.items():
        s = proc.process(recs[rid])
        assert s.num_tiles == tiles and int((s.token_ids == ctx).sum()) == 256 * tiles
        assert int((s.token_ids == proc.tok.token_id("<img>")).sum()) == 1
    frames = proc.process(recs["frames"])
    assert (
        frames.num_tiles == 32 and int((frames.token_ids == proc.tok.token_id("<img>")).sum()) == 32
    )


def test_text_tokens_are_the_rendered_conversation(dataset):
    cfg, recs = _records(dataset)
    proc = Processor(cfg)
    s = proc.process(recs["wide"])
    text = proc.template.render(
        [
            {"role": "user", "content": "\nWhat is shown?"},
            {"role": "assistant", "content": "A blue box."},
        ]
    )
    one_token_each = text.replace("<|im_start|>", "S").replace(
        "<|im_end|>", "E"
    )  # byte tokenizer: 1 per byte
    assert _text_tokens(proc, s, [proc.tok.token_id("<image>")]) == len(one_token_each.encode())
    assert proc.tok.decode(s.token_ids[s.assistant_mask]) == "A blue box.<|im_end|>\n"
    multi_turn = proc.process(recs["text"])
    assert (
        proc.tok.decode(multi_turn.token_ids[multi_turn.assistant_mask])
        == "Hello!<|im_end|>\nMore.<|im_end|>\n"
    )
    plain = proc.process(recs["plain"])
    assert (
        plain.assistant_mask.all()
        and proc.tok.decode(plain.token_ids) == "Plain text pretraining.<|endoftext|>"
    )


def test_pixels_stay_uint8_and_tiles_in_layout_order(tmp_path):
    # left half red, right half blue: the first grid tile of a 1x2 grid is red, the second blue
    img = np.zeros((384, 768, 3), np.uint8)
    img[:, :384, 0] = 255
    img[:, 384:, 2] = 255
    Image.fromarray(img).save(tmp_path / "rb.png")
    cfg = DataConfig(source="x")
    rec = {
        "id": 0,
        "image": "rb.png",
        "conversations": _conv(),
        "_location": "t",
        "_image_root": str(tmp_path),
    }
    s = Processor(cfg).process(rec)
    assert s.num_tiles == 3 and s.tiles.dtype == np.uint8  # the encoder normalizes on device
    np.testing.assert_allclose(s.tiles[1, 100:300, 100:300].mean((0, 1)), [255, 0, 0], atol=1e-6)
    np.testing.assert_allclose(s.tiles[2, 100:300, 100:300].mean((0, 1)), [0, 0, 255], atol=1e-6)


# ---- bad input --------------------------------------------------------------------------------------
def _bad_cases(d):
    (d / "trunc.png").write_bytes((d / "ok.png").read_bytes()[:200])
    (d / "notimg.jpg").write_text("hello")
    (d / "bad.mp4").write_bytes(b"\x00" * 100)
    (d / "empty_clip").mkdir()
    return {
        "missing_file": {"image": "nope.png", "conversations": _conv()},
        "corrupt_image": {"image": "notimg.jpg", "conversations": _conv()},
        "unreadable_video": {"video": "bad.mp4", "conversations": _conv("<video>")},
        "no_conversations": {"image": "ok.png", "conversations": []},
        "unknown_fields": {"image": "ok.png", "conversations": [{"from": "robot", "value": "hi"}]},
        "bad_markers": {"image": "ok.png", "conversations": _conv("<image> <image>")},
    }


def test_each_bad_input_raises_its_reason(tmp_path):
    _image(tmp_path / "ok.png", 500, 400)
    cases = _bad_cases(tmp_path)
    lines = [json.dumps({"id": k, **v}) for k, v in cases.items()]
    lines += [
        '{"id": "broken", ',
        json.dumps({"id": "noassist", "conversations": [{"from": "human", "value": "hi"}]}),
    ]
    lines += [
        json.dumps({"id": "emptyclip", "video": "empty_clip", "conversations": _conv("<video>")})
    ]
    lines += [json.dumps({"id": "trunc", "image": "trunc.png", "conversations": _conv()})]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    cfg = DataConfig(source=str(tmp_path / "d.jsonl"))
    proc = Processor(cfg)
    got = {}
    for r in load_source(cfg):
        with pytest.raises(BadSample) as e:
            proc.process(r) if r.get("id") == "trunc" else proc.shape(r)
        got[r.get("id", "broken")] = (e.value.reason, e.value.location)
    expected = {k: k for k in cases} | {"broken": "invalid_json", "noassist": "no_conversations"}
    expected |= {"emptyclip": "unreadable_video", "trunc": "corrupt_image"}
    assert {k: v[0] for k, v in got.items()} == expected
    assert got["broken"][1] == f"{tmp_path / 'd.jsonl'}:7"


def test_too_long_skip_or_truncate(dataset):
    cfg, recs = _records(dataset, max_tokens=40)
    with pytest.raises(BadSample, match="too_long"):
        Processor(cfg).shape(recs["text"])
    cfg, recs = _records(dataset, max_tokens=60, too_long="truncate", system_prompt="")
    proc = Processor(cfg)
    assert proc.shape(recs["text"]).tokens == 60 == proc.process(recs["text"]).num_tokens
    with pytest.raises(BadSample, match="too_long"):  # truncation would cut the image: refused
        proc.shape(recs["wide"])


def test_strict_invalid_json_raises_while_reading(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"id": 1, "text": "a"}\nnot json\n')
    with pytest.raises(BadSample, match="invalid_json"):
        load_source(DataConfig(source=str(tmp_path / "d.jsonl"), strict=True))


@pytest.mark.parametrize(
    "family, tile, patch, tpt", [("llava_ov", 32, 16, 4), ("internvl", 56, 14, 4)]
)
def test_tiny_tiles_for_demo_models(dataset, family, tile, patch, tpt):
    cfg, recs = _records(dataset, model_family=family, tile_size=tile, patch_size=patch)
    proc = Processor(cfg)
    for rid in ("wide", "multi", "frames"):
        shape, sample = proc.shape(recs[rid]), proc.process(recs[rid])
        assert (shape.tiles, shape.tokens) == (sample.num_tiles, sample.num_tokens)
        assert sample.tiles.shape[1:] == (tile, tile, 3)
        assert sample.feature_source.max() < sample.num_tiles * tpt
    frames = proc.process(recs["frames"])
    per_frame = 1 if family == "llava_ov" else tpt  # llava: 2x2 patches pooled to 1x1
    assert int((frames.feature_source >= 0).sum()) == 32 * per_frame


def test_patch_size_validation():
    from dflop_jax.config import ConfigError

    with pytest.raises(ConfigError, match="data.tile_size"):
        DataConfig(tile_size=12, patch_size=14)
    with pytest.raises(ConfigError, match="even number"):
        DataConfig(model_family="internvl", tile_size=42, patch_size=14)


def test_processor_pickles_for_grain_workers(dataset):
    import pickle

    cfg, recs = _records(dataset, model_family="internvl")
    proc = Processor(cfg)
    clone = pickle.loads(pickle.dumps(proc))
    a, b = proc.process(recs["wide"]), clone.process(recs["wide"])
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    np.testing.assert_array_equal(a.assistant_mask, b.assistant_mask)


def test_internvl_tiles_row_major_then_thumbnail(tmp_path):
    img = np.zeros((448, 896, 3), np.uint8)
    img[:, :448, 0] = 255
    img[:, 448:, 2] = 255
    Image.fromarray(img).save(tmp_path / "rb.png")
    cfg = DataConfig(source="x", model_family="internvl")
    rec = {
        "id": 0,
        "image": "rb.png",
        "conversations": _conv(),
        "_location": "t",
        "_image_root": str(tmp_path),
    }
    s = Processor(cfg).process(rec)
    assert s.num_tiles == 3  # 1x2 grid + thumbnail
    np.testing.assert_allclose(s.tiles[0].mean((0, 1)), [255, 0, 0], atol=1e-6)
    np.testing.assert_allclose(s.tiles[1].mean((0, 1)), [0, 0, 255], atol=1e-6)
    np.testing.assert_allclose(
        s.tiles[2].mean((0, 1)), [127.5, 0, 127.5], atol=2.55
    )  # the whole image, squashed


def _with_extra_keys(record):
    """A record as real LLaVA-OneVision JSON has it: source tags, metadata, per-turn extras."""
    turns = [{**turn, "weight": 1.0} for turn in record["conversations"]]
    return {
        **record,
        "source": "ai2d",
        "metadata": {"k": 1},
        "sample_id": 7,
        "conversations": turns,
    }


def test_extra_keys_are_ignored_by_default(dataset):
    cfg, recs = _records(dataset)
    proc = Processor(cfg)
    rec = _with_extra_keys(recs["wide"])
    assert proc.extra_keys(rec) == ("conversations[].weight", "metadata", "sample_id")
    assert proc.extra_keys(recs["wide"]) == ()  # `_location`, `_image_root`, ... are internal
    assert proc.shape(rec) == proc.shape(recs["wide"])
    got, want = proc.process(rec), proc.process(recs["wide"])
    np.testing.assert_array_equal(got.token_ids, want.token_ids)
    np.testing.assert_array_equal(got.assistant_mask, want.assistant_mask)
    np.testing.assert_array_equal(got.tiles, want.tiles)


def test_strict_rejects_extra_keys_unless_listed(dataset):
    cfg, recs = _records(dataset, strict=True)
    rec = _with_extra_keys(recs["text"])
    with pytest.raises(BadSample, match=r"unknown_fields.*'metadata'.*data\.extra_fields") as e:
        Processor(cfg).shape(rec)
    assert e.value.location == rec["_location"]
    listed, _ = _records(dataset, strict=True, extra_fields=("metadata", "sample_id", "weight"))
    assert Processor(listed).extra_keys(rec) == ()
    assert Processor(listed).shape(rec) == Processor(cfg).shape(recs["text"])


def test_decompression_bomb_is_a_corrupt_image(tmp_path, monkeypatch):
    Image.new("RGB", (300, 300)).save(tmp_path / "big.png")
    monkeypatch.setattr(
        Image, "MAX_IMAGE_PIXELS", 1000
    )  # 300x300 > 2x the limit: Pillow refuses it
    rec = {
        "id": 0,
        "image": "big.png",
        "conversations": _conv(),
        "_location": "t",
        "_image_root": str(tmp_path),
    }
    with pytest.raises(BadSample, match="corrupt_image"):
        Processor(DataConfig(source="x")).shape(rec)


def test_template_refusal_is_a_bad_sample(dataset, tmp_path):
    from dflop_jax.data.chat import ChatTemplate

    cfg, recs = _records(dataset)
    proc = Processor(cfg)
    strict = "{% if messages|length > 2 %}{{ raise_exception('roles must alternate') }}{% endif %}x"
    proc.template = ChatTemplate(strict)
    with pytest.raises(
        BadSample, match="no_conversations: chat template refused it: roles must alternate"
    ):
        proc.shape({**recs["text"], "_location": "here"})
