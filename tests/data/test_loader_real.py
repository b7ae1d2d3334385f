"""The loader with the real Processor and Scheduler on a synthetic dataset, and on broken inputs."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import shutil

import numpy as np
import pytest
from PIL import Image

from dflop_jax.data.bad_sample import BadSample
from dflop_jax.data.config import DataConfig
from dflop_jax.data.dataset import load_source
from dflop_jax.data.decode_pool import auto_decode_workers
from dflop_jax.data.loader import make_loader, pack_geometry, resolve_decode_workers
from dflop_jax.data.process import Processor
from dflop_jax.data.synth import synth_dataset
from dflop_jax.scheduler import BucketSet, ScheduleProblem, Scheduler, SchedulerConfig

TILE_PX = 28  # 2x2 patches: 4 feature rows per tile keep the test tiny


def stage_costs(T, S):
    return np.array([[T * 1e-3, T * 2e-3], [S * 1e-5, S * 2e-5]])


PROBLEM = ScheduleProblem(2, 2, 2, (1, 8), BucketSet((8, 16, 24), (256, 512, 1024)), stage_costs)


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    mix = synth_dataset(out, 48, "llava-ov", seed=0, tile=TILE_PX)
    cfg = DataConfig(source=str(mix), tile_size=TILE_PX, max_frames=4, cache_dir="")
    return cfg, load_source(cfg)


def loader_for(cfg, records, **kw):
    sched = Scheduler(PROBLEM, SchedulerConfig(solver="greedy", correction="off"))
    kw.setdefault("global_batch_size", 12)
    return make_loader(cfg, records, PROBLEM, sched.schedule, seed=0, **kw)


def check_against_processor(gb, by_id, proc, tpt):
    """Every packed segment equals the sample processed independently; features point at its tiles."""
    ids = gb.stats.sample_ids
    for mb, plan in zip(gb.microbatches, gb.schedule.microbatches):
        for r, members in enumerate(plan.shards):
            offset = 0
            for k, i in enumerate(members, start=1):
                s = proc.process(by_id[ids[i]])
                L = s.num_tokens
                span = slice(offset, offset + L)
                assert (mb.segment_ids[r, span] == k).all()
                np.testing.assert_array_equal(mb.tokens[r, span], s.token_ids)
                np.testing.assert_array_equal(
                    mb.loss_mask[r, offset : offset + L - 1], s.assistant_mask[1:]
                )
                f, src = mb.feature_index[r, span], s.feature_source
                np.testing.assert_array_equal(f[src < 0], src[src < 0])
                img = src >= 0
                np.testing.assert_array_equal(f[img] % tpt, src[img] % tpt)
                np.testing.assert_array_equal(mb.tiles[f[img] // tpt], s.tiles[src[img] // tpt])
                offset += L


def test_real_processor_and_scheduler_on_synth(synth):
    cfg, records = synth
    by_id = {r["id"]: r for r in records}
    proc = Processor(cfg)
    (h, w, _), tpt = pack_geometry(cfg)
    assert (h, w, tpt) == (TILE_PX, TILE_PX, 4)
    with loader_for(cfg, records, num_epochs=1) as loader:
        batches = list(loader)
        stats = loader.stats()
    assert len(batches) == 4 and stats["samples"] == 48 and stats["skipped"] == {}
    assert sorted(i for gb in batches for i in gb.stats.sample_ids) == sorted(by_id)
    for gb in batches:
        assert gb.schedule.solver == "greedy"
        for mb, plan in zip(gb.microbatches, gb.schedule.microbatches):
            assert mb.tiles.shape == (2 * plan.tile_bucket, TILE_PX, TILE_PX, 3)
            assert mb.tiles.dtype == np.uint8  # normalized by the first encoder stage, on device
            assert mb.tokens.shape == (2, plan.length_bucket)
        check_against_processor(gb, by_id, proc, tpt)
        assert gb.num_loss_tokens == sum(
            int(proc.process(by_id[i]).assistant_mask[1:].sum()) for i in gb.stats.sample_ids
        )
    assert 0 < stats["llm_padding_ratio"] < 1


def test_real_resume_is_exact(synth):
    cfg, records = synth
    with loader_for(cfg, records) as loader:
        full = [next(loader) for _ in range(6)]  # 4 batches per epoch: crosses into epoch 2
    with loader_for(cfg, records) as loader:
        [next(loader) for _ in range(3)]
        state = json.loads(json.dumps(loader.get_state()))  # the state survives JSON
    with loader_for(cfg, records) as loader:
        loader.set_state(state)
        rest = [next(loader) for _ in range(3)]
    for a, b in zip(full[3:], rest):
        assert a.stats.schedule_digest == b.stats.schedule_digest
        assert a.stats.sample_ids == b.stats.sample_ids
        for ma, mb in zip(a.microbatches, b.microbatches):
            np.testing.assert_array_equal(ma.tiles, mb.tiles)
            np.testing.assert_array_equal(ma.tokens, mb.tokens)
            np.testing.assert_array_equal(ma.feature_index, mb.feature_index)


def assert_same(a, b):
    assert a.stats.schedule_digest == b.stats.schedule_digest
    assert a.stats.sample_ids == b.stats.sample_ids
    assert a.num_loss_tokens == b.num_loss_tokens
    for ma, mb in zip(a.microbatches, b.microbatches, strict=True):
        for name in ("tiles", "tile_valid", "tokens", "segment_ids", "loss_mask", "feature_index"):
            np.testing.assert_array_equal(getattr(ma, name), getattr(mb, name), err_msg=name)


@pytest.mark.slow
def test_real_worker_processes_match_and_resume(synth):
    """Grain worker processes (the pipeline pickled, the Processor rebuilt there) yield the in-process
    batches, and resume from a JSON state exactly."""
    cfg, records = synth
    with loader_for(cfg, records) as loader:
        full = [next(loader) for _ in range(5)]
    with loader_for(cfg, records, num_workers=2) as loader:
        head = [next(loader) for _ in range(2)]
        state = json.loads(json.dumps(loader.get_state()))
        workers = grain_workers()
    with loader_for(cfg, records, num_workers=2) as loader:
        loader.set_state(state)
        tail = [next(loader) for _ in range(3)]
        workers += grain_workers()
    for a, b in zip(full, head + tail, strict=True):
        assert_same(a, b)
    # Closing stops each worker: it exits by itself (0), not killed when grain's join times out.
    assert [p.exitcode for p in workers] == [0] * 4


def grain_workers() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("grain-")]


@pytest.mark.slow
def test_decode_workers_match_in_process_and_the_schedule_stays_here(synth, tmp_path):
    """Decode worker processes yield the in-process batches; the schedule function keeps running in
    this process (so the trainer's observations reach it, unlike grain workers' copies); a sample
    failing in a worker counts as the same skip."""
    cfg, records = synth
    with loader_for(cfg, records, decode_workers=0) as loader:
        full = [next(loader) for _ in range(3)]
    sched = Scheduler(PROBLEM, SchedulerConfig(solver="greedy", correction="off"))
    calls = []

    def schedule(shapes, index):
        calls.append(index)
        return sched.schedule(shapes, index)

    with make_loader(cfg, records, PROBLEM, schedule, seed=0, global_batch_size=12,
                     decode_workers=2, prefetch=0) as loader:  # fmt: skip
        assert loader._pool is not None and loader._pool.workers == 2
        got = [next(loader) for _ in range(3)]
    assert calls == [0, 1, 2]
    for a, b in zip(full, got, strict=True):
        assert_same(a, b)
    path, want = write_broken_dataset(cfg, records, tmp_path)
    bad_cfg = DataConfig(source=str(path), tile_size=TILE_PX, max_frames=4, cache_dir="")
    broken = load_source(bad_cfg)
    with loader_for(bad_cfg, broken, global_batch_size=17, decode_workers=2) as loader:
        assert next(loader).stats.skipped == want


def test_decode_workers_default_where_they_pay(synth):
    """Automatic (-1): workers for image/video data at real tile sizes, none for text or tiny tiles;
    an explicit count wins; grain workers and decode workers do not mix."""
    cfg, records = synth
    text = [{"id": 0, "text": "hello"}]
    big = dataclasses.replace(cfg, tile_size=384)
    assert resolve_decode_workers(cfg, records, None, 0) == 0  # 28 px tiles: in-process
    assert resolve_decode_workers(big, text, None, 0) == 0  # no media
    assert resolve_decode_workers(big, records, None, 0) == auto_decode_workers(384, True)
    assert [auto_decode_workers(384, True, cpus=c) for c in (1, 2, 4, 8, 64)] == [0, 0, 3, 4, 4]
    assert auto_decode_workers(56, True, cpus=8) == auto_decode_workers(384, False, cpus=8) == 0
    assert resolve_decode_workers(dataclasses.replace(big, decode_workers=0), records, None, 0) == 0
    assert resolve_decode_workers(cfg, records, 3, 0) == 3
    assert resolve_decode_workers(big, records, None, 2) == 0  # grain workers: no pool
    with pytest.raises(ValueError, match="pick one kind of worker"):
        resolve_decode_workers(cfg, records, 2, 2)
    with pytest.raises(ValueError, match="data.decode_workers"):
        DataConfig(decode_workers=-2)


def write_broken_dataset(cfg, records, tmp_path):
    """A JSONL with 10 good records and one of each bad-input kind; returns (path, expected counts)."""
    src_dir = tmp_path / "data"
    src_dir.mkdir()
    good = [r for r in records if r["data_source"] in ("single_image", "text")][:10]
    lines = []
    for r in good:
        rec = {k: v for k, v in r.items() if not k.startswith("_")}
        if "image" in rec:
            shutil.copy(r["_image_root"] + "/" + rec["image"], src_dir / f"{rec['id']}.png")
            rec["image"] = f"{rec['id']}.png"
        lines.append(json.dumps(rec))
    conv = [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "A thing."}]
    a_png = sorted(src_dir.glob("*.png"))[0]
    # Noise compresses badly, so cutting the file keeps the header (metadata passes) and loses pixels:
    # the failure shows only when the scheduled sample is decoded.
    noise = np.random.default_rng(0).integers(0, 255, (96, 96, 3), dtype=np.uint8)
    Image.fromarray(noise).save(src_dir / "noise.png")
    data = (src_dir / "noise.png").read_bytes()
    (src_dir / "truncated.png").write_bytes(data[: len(data) * 2 // 3])
    (src_dir / "garbage.mp4").write_bytes(b"\x00not a video" * 64)
    bad = [
        json.dumps({"id": "missing", "image": "nope.png", "conversations": conv}),
        json.dumps({"id": "corrupt", "image": "truncated.png", "conversations": conv}),
        json.dumps({"id": "video", "video": "garbage.mp4", "conversations": conv}),
        '{"id": "broken json", ',
        json.dumps({"id": "noconv", "image": a_png.name}),
        json.dumps({"id": "unknown", "conversations": [{"from": "robot", "value": "beep"}]}),
        json.dumps({"id": "long", "text": "word " * 3000}),
    ]
    want = {"missing_file": 1, "corrupt_image": 1, "unreadable_video": 1, "invalid_json": 1}
    want |= {"no_conversations": 1, "unknown_fields": 1, "too_long": 1}
    path = src_dir / "broken.jsonl"
    path.write_text("\n".join(lines[:5] + bad + lines[5:]) + "\n")
    return path, want


@pytest.mark.parametrize("strict", [False, True])
def test_every_bad_input_kind_is_counted_or_raised(synth, tmp_path, strict):
    cfg, records = synth
    path, want = write_broken_dataset(cfg, records, tmp_path)
    bad_cfg = DataConfig(
        source=str(path), tile_size=TILE_PX, max_frames=4, cache_dir="", strict=strict
    )
    broken = (
        load_source(bad_cfg)
        if not strict
        else load_source(DataConfig(source=str(path), cache_dir=""))
    )
    assert len(broken) == 17
    with loader_for(bad_cfg, broken, global_batch_size=17, num_epochs=1) as loader:
        if strict:
            with pytest.raises(BadSample):
                next(loader)
            return
        (gb,) = list(loader)
        assert loader.stats()["skipped"] == want
    assert gb.stats.skipped == want
    # The truncated image was scheduled (its header is fine), then failed to decode: its room is padding.
    assert gb.stats.num_samples == 17 - sum(want.values()) + want["corrupt_image"]
    assert "corrupt" in gb.stats.sample_ids
    kept = [i for mb in gb.schedule.microbatches for i in mb.samples()]
    assert len(kept) == gb.stats.num_samples


def test_truncate_policy_cuts_long_text_to_the_largest_bucket(synth):
    cfg, records = synth
    long = {"id": "long", "text": "word " * 3000, "_location": "inline:0"}
    long |= {k: v for k, v in records[0].items() if k in ("_image_root", "_video_root", "_file")}
    data = [long] + [r for r in records if r["data_source"] == "text"][:7]
    cut = DataConfig(source="synthetic", tile_size=TILE_PX, cache_dir="", too_long="truncate")
    with loader_for(cut, data, global_batch_size=8, num_epochs=1) as loader:
        (gb,) = list(loader)
    assert gb.stats.skipped == {} and "long" in gb.stats.sample_ids
    i = gb.stats.sample_ids.index("long")
    plan = next(p for p in gb.schedule.microbatches if i in p.samples())
    assert plan.length_bucket == PROBLEM.buckets.lengths[-1]
    skip = DataConfig(source="synthetic", tile_size=TILE_PX, cache_dir="", too_long="skip")
    with loader_for(skip, data, global_batch_size=8, num_epochs=1) as loader:
        (gb,) = list(loader)
    assert gb.stats.skipped == {"too_long": 1} and "long" not in gb.stats.sample_ids


def test_precomputed_shapes_from_the_metadata_cache(synth, tmp_path):
    cfg, records = synth
    with loader_for(cfg, records) as loader:
        lazy = [next(loader) for _ in range(2)]
    cached = dataclasses.replace(cfg, cache_dir=str(tmp_path / "meta"))
    for _ in range(2):  # the first run writes the cache, the second reads it
        with loader_for(cached, records, precompute_shapes=True) as loader:
            known = [next(loader) for _ in range(2)]
        for a, b in zip(lazy, known, strict=True):
            assert_same(a, b)
    assert list((tmp_path / "meta").glob("*.json"))
