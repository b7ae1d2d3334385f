"""Exact feature taps on the data path: processed LLaVA-OV samples -> packed taps -> place_features.

A big image whose grid exceeds anyres_max_N has its grid features bilinearly downscaled (not a gather).
The packed `feature_taps` / `feature_weight`, fed to `models.placement.place_features` with features
whose rows encode their own index, must give exactly the combination `models/layouts.py` describes
(shifted to the sample's tile slots), and HF's `pack_image_features` on the same features.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from packing_fixtures import TILE, TPT, make_sample, packing_cases
from PIL import Image

from dflop_jax.contracts import SampleShape, Schedule, ScheduledMicrobatch
from dflop_jax.data.config import DataConfig
from dflop_jax.data.dataset import load_source
from dflop_jax.data.loader import PackSpec, pack_geometry, pack_taps
from dflop_jax.data.packing import HostShardSpec, all_shards, pack_global_batch, pack_microbatch
from dflop_jax.data.process import Processor
from dflop_jax.data.sample_arrays import FEATURE_TAPS, NEWLINE, TEXT
from dflop_jax.data.transforms import PackStage, Scheduled
from models import layouts
from models.placement import place_features

# Tiny LLaVA-OV geometry: 32 px tiles, 8 px patches -> 4x4 = 16 features per tile, grids up to 3x3.
TILE_PX, PATCH, P, ANYRES_MAX, MAX_GRID = 32, 8, 4, 2, 3
BIG_HW, SMALL_HW = (80, 96), (32, 32)  # (h, w); BIG: 3x3 grid, 10x12 unpadded -> 5x6 (downscaled)
NEWLINE_VEC = np.array([-5.0, 3.0], np.float32)
EMBED_FILL = -100.0


def _image(path, hw):
    Image.new("RGB", (hw[1], hw[0]), (40, 90, 200)).save(path)
    return path.name


def _conv(q):
    return [{"from": "human", "value": q}, {"from": "gpt", "value": "A blue box."}]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    d = tmp_path_factory.mktemp("taps")
    big, small = _image(d / "big.png", BIG_HW), _image(d / "small.png", SMALL_HW)
    recs = [
        {"id": "text", "conversations": _conv("Hi there")},
        {"id": "small", "image": small, "conversations": _conv("<image>\nWhat?")},
        {"id": "big", "image": big, "conversations": _conv("<image>\nWhat is shown?")},
        {"id": "multi", "image": [small, big], "conversations": _conv("<image> and <image>")},
    ]
    (d / "data.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return d / "data.jsonl"


def _processor(path, family="llava_ov"):
    kw = dict(tile_size=TILE_PX, patch_size=PATCH) if family == "llava_ov" else dict(tile_size=56)
    cfg = DataConfig(
        source=str(path), model_family=family, anyres_max=ANYRES_MAX, max_grid=MAX_GRID, **kw
    )
    return cfg, Processor(cfg), load_source(cfg)


def _big_layout():
    pinpoints = [(TILE_PX * r, TILE_PX * c) for r in range(1, 4) for c in range(1, 4)]
    return layouts.llava_ov_image_layout(
        BIG_HW, pinpoints=pinpoints, tile_size=TILE_PX, patches_per_side=P,
        max_num_patches=ANYRES_MAX,
    )  # fmt: skip


@pytest.fixture(scope="module")
def packed(records):
    """The four samples packed into one microbatch (encoder_dp=2, llm_dp=2), the big image second in
    its row and its tiles at a non-zero slot offset."""
    cfg, proc, recs = _processor(records)
    samples = [proc.process(r) for r in recs]
    shapes = [SampleShape(s.id, s.num_tiles, s.num_tokens, s.modality) for s in samples]
    S = max(samples[0].num_tokens + samples[1].num_tokens, shapes[3].tokens + shapes[2].tokens) + 5
    T = -(-sum(s.tiles for s in shapes) // 2) + 1
    plan = ScheduledMicrobatch(T, S, ((0, 1), (3, 2)))
    mb, _ = pack_microbatch(
        plan, samples, shapes, encoder_dp=2, llm_dp=2, tile_shape=(TILE_PX, TILE_PX, 3),
        tokens_per_tile=P * P, feature_taps=pack_taps(cfg),
    )  # fmt: skip
    return samples, shapes, plan, mb


def _slots(plan, shapes, encoder_dp, i):
    """[n_tiles] tile slot of each of sample i's tiles, from the scheduler's own placement order."""
    placement = plan.encoder_tiles(shapes, encoder_dp)
    where = {
        it: e * plan.tile_bucket + k for e, ts in enumerate(placement) for k, it in enumerate(ts)
    }
    return np.array([where[(i, t)] for t in range(shapes[i].tiles)], np.int64)


def _to_global(local, slots, tpt):
    """Tile-local feature ids t*tpt+j -> slots[t]*tpt+j; TEXT / NEWLINE unchanged."""
    if not len(slots):
        return local
    safe = np.maximum(local, 0)
    return np.where(local >= 0, slots[safe // tpt] * tpt + safe % tpt, local)


def _placed(mb, n_rows):
    """place_features on features[r] = (r, 1): [l_dp, S, 2]."""
    features = np.stack([np.arange(n_rows), np.ones(n_rows)], 1).astype(np.float32)
    embeds = np.full((*mb.feature_index.shape, 2), EMBED_FILL, np.float32)
    out = place_features(
        jnp.asarray(embeds), jnp.asarray(features), jnp.asarray(mb.feature_taps),
        jnp.asarray(NEWLINE_VEC), jnp.asarray(mb.feature_weight),
    )  # fmt: skip
    return np.asarray(out), features


def test_big_image_is_downscaled_and_processed_with_its_layout_taps(packed):
    samples, _, _, _ = packed
    big, layout = samples[2], _big_layout()
    assert layout.taps is not None  # the grid exceeds anyres_max_2: interpolated, not a gather
    assert (layout.tap_weights.max(1) < 1).any()  # and some weights are genuinely fractional
    image = np.flatnonzero(big.feature_source != TEXT)
    np.testing.assert_array_equal(big.feature_taps[image], layout.offset_taps(0)[0])
    np.testing.assert_array_equal(big.feature_weight[image], layout.tap_weights)
    assert big.feature_taps.shape == big.feature_weight.shape == (big.num_tokens, FEATURE_TAPS)


def test_packed_taps_reproduce_the_layout_combination(packed):
    samples, shapes, plan, mb = packed
    assert mb.feature_taps.shape == mb.feature_weight.shape == (2, plan.length_bucket, 4)
    out, features = _placed(mb, 2 * plan.tile_bucket * P * P)
    layout, slots = _big_layout(), _slots(plan, shapes, 2, 2)
    # Independent expectation: each layout tap t*16+j lands at row slots[t]*16+j of the features.
    table = np.concatenate([features, NEWLINE_VEC[None]])
    rows = np.where(layout.taps >= 0, _to_global(layout.taps, slots, P * P), len(features))
    expected = np.einsum("nk,nkd->nd", layout.tap_weights.astype(np.float64), table[rows])
    start = shapes[3].tokens  # the big image follows the multi-image sample in row 1
    image = start + np.flatnonzero(samples[2].feature_source != TEXT)
    np.testing.assert_allclose(out[1, image], expected, rtol=1e-6)
    assert not np.allclose(expected[:, 0], np.round(expected[:, 0]))  # really interpolated
    # feature_index stays the nearest (heaviest) tap.
    nearest = np.take_along_axis(mb.feature_taps, mb.feature_weight.argmax(-1)[..., None], -1)
    np.testing.assert_array_equal(mb.feature_index, nearest[..., 0])
    # Text and padding keep their embeddings.
    text = mb.feature_index == TEXT
    assert (out[text] == EMBED_FILL).all()


@pytest.mark.hf
def test_packed_taps_match_hf_pack_image_features(packed):
    torch = pytest.importorskip("torch")
    from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

    samples, shapes, plan, mb = packed
    out, features = _placed(mb, 2 * plan.tile_bucket * P * P)
    slots = _slots(plan, shapes, 2, 2)
    tile_features = torch.from_numpy(features.reshape(-1, P * P, 2)[slots])  # [10, 16, 2] HF order
    fake = SimpleNamespace(config=SimpleNamespace(
        vision_config=SimpleNamespace(image_size=TILE_PX, patch_size=PATCH),
        image_grid_pinpoints=[[TILE_PX * r, TILE_PX * c] for r in range(1, 4) for c in range(1, 4)],
    ))  # fmt: skip
    hf, _ = LlavaOnevisionModel.pack_image_features(
        fake, [tile_features], torch.tensor([BIG_HW]), torch.from_numpy(NEWLINE_VEC),
        vision_aspect_ratio=f"anyres_max_{ANYRES_MAX}",
    )  # fmt: skip
    image = shapes[3].tokens + np.flatnonzero(samples[2].feature_source != TEXT)
    (hf,) = hf  # one image
    np.testing.assert_allclose(out[1, image], hf.numpy(), rtol=1e-6)


def test_normal_images_pack_one_tap_of_weight_one(packed):
    samples, shapes, plan, mb = packed
    one_hot = np.array([1, 0, 0, 0], np.float32)
    for r, idx in enumerate(plan.shards):
        start = 0
        for i in idx:
            span = slice(start, start + shapes[i].tokens)
            start += shapes[i].tokens
            if samples[i].id == "big":
                continue
            np.testing.assert_array_equal(mb.feature_taps[r, span, 0], mb.feature_index[r, span])
            assert (mb.feature_weight[r, span] == one_hot).all()
        assert (mb.feature_taps[r, start:] == TEXT).all()  # padding
        assert (mb.feature_weight[r, start:] == one_hot).all()
    assert (mb.feature_index == NEWLINE).any()
    assert ((mb.feature_index == NEWLINE) == (mb.feature_taps == NEWLINE).all(-1)).all()


def test_internvl_leaves_taps_none(records):
    cfg, proc, recs = _processor(records, "internvl")
    samples = [proc.process(r) for r in recs]
    assert all(s.feature_taps is None and s.feature_weight is None for s in samples)
    assert pack_taps(cfg) == 0
    tile_shape, tpt = pack_geometry(cfg)
    shapes = [SampleShape(s.id, s.num_tiles, s.num_tokens, s.modality) for s in samples]
    plan = ScheduledMicrobatch(
        sum(s.tiles for s in shapes), sum(s.tokens for s in shapes), ((0, 1, 2, 3),)
    )
    mb, _ = pack_microbatch(
        plan, samples, shapes, encoder_dp=1, llm_dp=1, tile_shape=tile_shape, tokens_per_tile=tpt
    )
    assert mb.feature_taps is None and mb.feature_weight is None


def test_pack_stage_carries_taps_and_refuses_to_drop_them(records):
    cfg, proc, recs = _processor(records)
    shapes = [proc.shape(r) for r in recs]
    plan = ScheduledMicrobatch(
        sum(s.tiles for s in shapes), sum(s.tokens for s in shapes), ((0, 1, 2, 3),)
    )
    schedule = Schedule((plan,), 1.0, 1.0, "test", 0.0)
    spec = PackSpec(1, 1, (TILE_PX, TILE_PX, 3), P * P, plan.tile_bucket, plan.length_bucket, 4)
    batch = PackStage(proc, spec, all_shards(1, 1), strict=True)(
        Scheduled(list(recs), shapes, schedule, {}, 0.0)
    )
    (mb,) = batch.microbatches
    assert mb.feature_taps.shape == (1, plan.length_bucket, 4)
    assert (mb.feature_weight.max(-1) < 1).any()  # the big image's interpolated rows got through
    with pytest.raises(
        ValueError, match="feature_taps=4"
    ):  # packing only the nearest tap is refused
        pack_microbatch(
            plan, [proc.process(r) for r in recs], shapes, encoder_dp=1, llm_dp=1,
            tile_shape=(TILE_PX, TILE_PX, 3), tokens_per_tile=P * P,
        )  # fmt: skip


def _with_random_taps(sample, rng, k):
    """The sample with k random tile-local taps per image position (tap 0 = its feature_source)."""
    src = sample.feature_source
    taps = np.repeat(src[:, None], k, 1)
    weights = np.zeros((len(src), k), np.float32)
    weights[:, 0] = 1.0
    image = np.flatnonzero(src >= 0)
    if len(image) and k > 1:
        taps[image, 1:] = rng.integers(0, sample.num_tiles * TPT, (len(image), k - 1))
        w = rng.random((len(image), k)).astype(np.float32)
        w[:, 0] += k  # keep tap 0 the heaviest: feature_index is the nearest tap
        weights[image] = w / w.sum(1, keepdims=True)
    return dataclasses.replace(sample, feature_taps=taps, feature_weight=weights)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packing_cases(), st.integers(1, 4), st.integers(1, 3))
def test_random_schedules_map_every_tap_like_feature_index(case, k, procs):
    encoder_dp, llm_dp, sizes, n_mb, bins, extra_s, extra_t, seed = case
    rng = np.random.default_rng(seed)
    plain = [make_sample(i, t, x, rng, newline=bool(i % 2)) for i, (t, x) in enumerate(sizes)]
    samples = [_with_random_taps(s, rng, k) if i % 3 else s for i, s in enumerate(plain)]
    shapes = [SampleShape(s.id, s.num_tiles, s.num_tokens, s.modality) for s in samples]
    plans = []
    for m in range(n_mb):
        shards = tuple(
            tuple(i for i, b in enumerate(bins) if b == m * llm_dp + r) for r in range(llm_dp)
        )
        tokens = max(sum(shapes[i].tokens for i in sh) for sh in shards)
        T = -(-sum(shapes[i].tiles for sh in shards for i in sh) // encoder_dp) + extra_t or 1
        plans.append(ScheduledMicrobatch(T, max(tokens, 1) + extra_s, shards))
    schedule = Schedule(tuple(plans), 1.0, 1.0, "test", 0.0)
    kw = dict(encoder_dp=encoder_dp, llm_dp=llm_dp, tile_shape=TILE, tokens_per_tile=TPT)
    full = pack_global_batch(schedule, samples, shapes, feature_taps=4, **kw)
    gather = pack_global_batch(schedule, plain, shapes, **kw)
    for mb, ref, plan in zip(full.microbatches, gather.microbatches, plans):
        np.testing.assert_array_equal(mb.feature_index, ref.feature_index)  # unchanged by taps
        for r, idx in enumerate(plan.shards):
            start = 0
            for i in idx:
                L, slots = shapes[i].tokens, _slots(plan, shapes, encoder_dp, i)
                taps, w = (
                    mb.feature_taps[r, start : start + L],
                    mb.feature_weight[r, start : start + L],
                )
                local = samples[i].feature_taps
                if local is None:
                    np.testing.assert_array_equal(
                        taps[:, 0], ref.feature_index[r, start : start + L]
                    )
                    assert (w[:, 1:] == 0).all() and (w[:, 0] == 1).all()
                else:
                    np.testing.assert_array_equal(taps[:, :k], _to_global(local, slots, TPT))
                    np.testing.assert_array_equal(w[:, :k], samples[i].feature_weight)
                    assert (w[:, k:] == 0).all()
                start += L
            assert (mb.feature_taps[r, start:] == TEXT).all()
        # Host-local packing materialises exactly this host's rows of the same arrays.
        host = HostShardSpec.contiguous(procs - 1, procs, encoder_dp, llm_dp)
        local_mb, _ = pack_microbatch(plan, samples, shapes, host=host, feature_taps=4, **kw)
        rows = list(host.llm_shards)
        assert local_mb.feature_taps.shape == mb.feature_taps.shape  # global shape, local rows
        np.testing.assert_array_equal(local_mb.feature_taps[rows], mb.feature_taps[rows])
        np.testing.assert_array_equal(local_mb.feature_weight[rows], mb.feature_weight[rows])


def test_truncated_and_text_samples_keep_taps_aligned(records):
    cfg, proc, recs = _processor(records)
    text = proc.process(recs[0])
    assert text.feature_taps.shape == (
        text.num_tokens,
        FEATURE_TAPS,
    )  # static: present without images
    assert (text.feature_taps == TEXT).all() and (text.feature_weight[:, 0] == 1).all()
    full = proc.process(recs[2])
    limit = full.num_tokens - 2  # cuts the answer's tail, keeps the image
    short = Processor(dataclasses.replace(cfg, max_tokens=limit, too_long="truncate")).process(
        recs[2]
    )
    assert short.feature_taps.shape == short.feature_weight.shape == (limit, FEATURE_TAPS)
    np.testing.assert_array_equal(short.feature_taps, full.feature_taps[:limit])
    np.testing.assert_array_equal(short.feature_weight, full.feature_weight[:limit])
