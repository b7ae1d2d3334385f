"""Parquet (HF layout, embedded images) and WebDataset tar shards: the same records, profile, loader
batches and resume as the JSONL they were written from; bad rows counted by reason and named under
strict; cached tar indexes; bounded memory while streaming."""

from __future__ import annotations

import io
import json
import pickle
import sys
import tarfile
import tracemalloc

import grain
import numpy as np
import pytest
from shard_fixtures import (
    parquet_rows,
    synth_records,
    three_formats,
    write_jsonl,
    write_parquet,
    write_tar,
)

from dflop_jax.config import ConfigError
from dflop_jax.data import images, shards
from dflop_jax.data import shape_profile as profile
from dflop_jax.data.bad_sample import BadSample
from dflop_jax.data.config import DataConfig
from dflop_jax.data.dataset import load_source
from dflop_jax.data.loader import make_loader
from dflop_jax.data.metadata import MetadataCache
from dflop_jax.data.process import Processor
from dflop_jax.data.shape_profile import profile_data
from dflop_jax.data.split import split_records
from dflop_jax.scheduler import BucketSet, ScheduleProblem, Scheduler, SchedulerConfig

pytest.importorskip("pyarrow")

TILE_PX = 28


def stage_costs(T, S):
    return np.array([[T * 1e-3, T * 2e-3], [S * 1e-5, S * 2e-5]])


PROBLEM = ScheduleProblem(2, 2, 2, (1, 8), BucketSet((8, 16, 24), (256, 512, 1024)), stage_costs)


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    return three_formats(tmp_path_factory.mktemp("formats"), samples=24, tile=TILE_PX)


def config(source, root, tmp_path, **kw) -> DataConfig:
    kw.setdefault("cache_dir", str(tmp_path / "cache"))
    return DataConfig(source=source, tile_size=TILE_PX, max_frames=4, video_root=str(root), **kw)


def loader_for(cfg, records, **kw):
    sched = Scheduler(PROBLEM, SchedulerConfig(solver="greedy", correction="off"))
    kw.setdefault("global_batch_size", 8)
    kw.setdefault("decode_workers", 0)
    return make_loader(cfg, records, PROBLEM, sched.schedule, seed=0, **kw)


def test_three_formats_give_the_same_samples_and_profile(formats, tmp_path, monkeypatch):
    """Parquet shards are profiled in worker processes (one per shard: two here), tar shards and the
    JSONL in-process (too few records to start workers for)."""
    samples, profiles = {}, {}
    for name, (source, root) in formats.items():
        cfg = config(source, root, tmp_path / name)
        records = load_source(cfg)
        proc = Processor(cfg)
        samples[name] = [proc.process(records[i]) for i in range(len(records))]
        workers = 2 if name == "parquet" else 0  # whatever the CPUs of the machine
        monkeypatch.setattr(profile, "profile_workers", lambda groups, n, w=workers: w)
        path = profile_data(cfg, out_dir=tmp_path / name / "profile")
        profiles[name] = json.loads(path.read_text())
    assert isinstance(load_source(config(*formats["parquet"], tmp_path)), shards.ParquetRecords)
    want = samples["jsonl"]
    assert len(want) == 24 and {s.modality for s in want} == {
        "image", "multi_image", "video", "text"
    }  # fmt: skip
    for name in ("parquet", "tar"):
        assert [s.id for s in samples[name]] == [s.id for s in want]
        for a, b in zip(want, samples[name]):
            np.testing.assert_array_equal(a.tiles, b.tiles)
            np.testing.assert_array_equal(a.token_ids, b.token_ids)
            np.testing.assert_array_equal(a.assistant_mask, b.assistant_mask)
        got = profiles[name]
        assert got["samples"] == profiles["jsonl"]["samples"]
        for key in ("all", "image", "multi_image", "video", "text", "by_source", "bad"):
            assert got["summary"][key] == profiles["jsonl"]["summary"][key], key
    # data_source is the record's group, whatever the format
    assert set(profiles["parquet"]["summary"]["by_source"]) == {
        "single_image", "multi_image", "video", "text"
    }  # fmt: skip


def test_shard_shapes_are_cached_per_shard(formats, tmp_path, monkeypatch):
    """One cache file per shard; a second pass answers every record from it (no image header read)."""
    cfg = config(*formats["parquet"], tmp_path)
    records = load_source(cfg)
    first = MetadataCache(cfg.cache_dir, Processor(cfg)).shapes(records)
    assert len(list((tmp_path / "cache").glob("train-*.json"))) == 2

    def no_header(*a, **k):
        raise AssertionError("a cached shape was recomputed")

    monkeypatch.setattr(images, "image_size", no_header)
    again = MetadataCache(cfg.cache_dir, Processor(cfg))
    assert again.shapes(load_source(cfg)) == first and again.hits == len(records) == 24


def test_loader_batches_and_resume_match_jsonl(formats, tmp_path):
    """Shuffled global batches from shards equal the JSONL's (same sample order and tokens), and a
    loader restored from a checkpointed state continues exactly."""
    runs = {}
    for name, (source, root) in formats.items():
        cfg = config(source, root, tmp_path, cache_dir="")
        with loader_for(cfg, load_source(cfg), num_epochs=1) as loader:
            batches = [next(loader) for _ in range(2)]
            state = loader.get_state()
            third = next(loader)
        with loader_for(cfg, load_source(cfg), num_epochs=1) as again:
            again.set_state(state)
            resumed = next(again)
        assert resumed.stats.sample_ids == third.stats.sample_ids
        for a, b in zip(resumed.microbatches, third.microbatches):
            np.testing.assert_array_equal(a.tokens, b.tokens)
        runs[name] = batches + [third]
    for name in ("parquet", "tar"):
        for a, b in zip(runs["jsonl"], runs[name]):
            assert a.stats.sample_ids == b.stats.sample_ids
            for ma, mb in zip(a.microbatches, b.microbatches):
                np.testing.assert_array_equal(ma.tokens, mb.tokens)
                np.testing.assert_array_equal(ma.tiles, mb.tiles)


def test_grain_shards_a_lazy_source_over_readers(formats, tmp_path):
    """grain's index sampler over the lazy source: shuffled and split over two readers like a list."""
    jsonl = load_source(config(*formats["jsonl"], tmp_path))
    lazy = load_source(config(*formats["parquet"], tmp_path))
    for k in range(2):
        want = [r["id"] for r in grain.MapDataset.source(jsonl).shuffle(seed=3)[k::2]]
        got = [r["id"] for r in grain.MapDataset.source(lazy).shuffle(seed=3)[k::2]]
        assert got == want and len(got) == 12
    # grain worker processes receive the source by pickling: the index travels, not files or caches
    lazy[0]
    copy = pickle.loads(pickle.dumps(lazy))
    assert copy.rows_held() == 0 and [copy[i]["id"] for i in (0, 23)] == [
        lazy[0]["id"],
        lazy[23]["id"],
    ]


def test_held_out_split_of_a_lazy_source_is_the_lists(formats, tmp_path):
    jsonl = load_source(config(*formats["jsonl"], tmp_path))
    lazy = load_source(config(*formats["tar"], tmp_path))
    want = [[r["id"] for r in part] for part in split_records(jsonl, 0.3, 1)]
    train, held = split_records(lazy, 0.3, 1)
    assert (
        isinstance(held, shards.Subset)
        and [[r["id"] for r in train], [r["id"] for r in held]] == want
    )
    assert split_records(lazy, 0.0, 1) == (lazy, [])


def _bad_parquet(tmp_path):
    """Two shards of good synthetic rows with bad rows mixed in; returns (dir, bad locations)."""
    root, (singles, multis) = synth_records(tmp_path / "synth", 24, TILE_PX)
    one = parquet_rows(singles, root, as_list=False)
    many = parquet_rows(multis, root, as_list=True)
    one.insert(
        2, {**one[0], "id": "junk-bytes", "image": {"bytes": b"not an image", "path": "x.jpg"}}
    )
    one.insert(5, {**one[1], "id": "no-conv", "conversations": None})
    many.insert(1, {**many[0], "id": "one-marker", "conversations": [
        {"from": "human", "value": "<image> what?"}, {"from": "gpt", "value": "two images"}]})  # fmt: skip
    many.insert(4, {**many[0], "id": "no-value", "conversations": [
        {"from": "human", "value": None}, {"from": "gpt", "value": "x"}]})  # fmt: skip
    data = tmp_path / "hf" / "data"
    a = write_parquet(one, data / "train-00000-of-00002.parquet")
    b = write_parquet(many, data / "train-00001-of-00002.parquet")
    bad = {f"{a}:2": "corrupt_image", f"{a}:5": "no_conversations"}
    bad |= {f"{b}:1": "bad_markers", f"{b}:4": "no_conversations"}
    return tmp_path / "hf", root, bad


def test_bad_parquet_rows_are_counted_by_reason(tmp_path):
    source, root, bad = _bad_parquet(tmp_path)
    cfg = config(str(source), root, tmp_path, cache_dir="")
    records = load_source(cfg)
    assert len(records) == 28
    with loader_for(cfg, records, num_epochs=1, global_batch_size=7) as loader:
        batches = list(loader)
        stats = loader.stats()
    assert stats["skipped"] == {"corrupt_image": 1, "no_conversations": 2, "bad_markers": 1}
    assert stats["samples"] == 24 and sum(len(b.stats.sample_ids) for b in batches) == 24
    summary = json.loads(profile_data(cfg, out_dir=tmp_path / "p").read_text())["summary"]
    assert summary["bad"] == {"corrupt_image": 1, "no_conversations": 2, "bad_markers": 1}


def test_strict_stops_at_the_first_bad_row_naming_shard_and_row(tmp_path):
    source, root, bad = _bad_parquet(tmp_path)
    cfg = config(str(source), root, tmp_path, cache_dir="", strict=True)
    loader = loader_for(cfg, load_source(cfg), num_epochs=1, global_batch_size=7)
    with loader, pytest.raises(BadSample) as e:
        list(loader)
    assert e.value.location in bad and e.value.reason == bad[e.value.location]
    assert str(e.value).startswith(f"{e.value.location}: {e.value.reason}")


def test_bad_tar_members_are_counted_and_named(tmp_path):
    """A truncated last member (a torn download) and a sample whose JSON does not parse."""
    root, (singles, _) = synth_records(tmp_path / "synth", 24, TILE_PX)
    path = write_tar(singles, root, tmp_path / "wds" / "s.tar")
    with tarfile.open(path) as tf:
        last = tf.getmembers()[-1]
    path.write_bytes(path.read_bytes()[: last.offset_data + 10])
    broken = tmp_path / "wds" / "t.tar"
    with tarfile.open(broken, "w") as tf:
        for name, data in (("k1.json", b"{not json"), ("k2.jpg", b"jpeg without json")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    records = load_source(config(str(tmp_path / "wds" / "*.tar"), root, tmp_path))
    proc = Processor(config(str(path), root, tmp_path))
    errors = {}
    for i in range(len(records)):
        try:
            proc.shape(records[i])
        except BadSample as e:
            errors[e.location] = e.reason
    key = last.name.split(".")[0]
    assert errors == {
        f"{path}:{key}": "corrupt_shard",
        f"{broken}:k1": "invalid_json",
        f"{broken}:k2": "invalid_json",
    }


def test_tar_index_is_cached_by_content_hash(tmp_path, monkeypatch):
    root, (singles, _) = synth_records(tmp_path / "synth", 24, TILE_PX)
    path = write_tar(singles[:4], root, tmp_path / "s.tar")
    cache = tmp_path / "cache"
    first = shards.tar_index(path, str(cache))
    assert len(first) == 4 and len(list((cache / "tar_index").iterdir())) == 1

    def no_scan(p):
        raise AssertionError("the cached index should have been used")

    monkeypatch.setattr(shards, "_scan_tar", no_scan)
    assert shards.tar_index(path, str(cache)) == first
    write_tar(singles[:3], root, path)  # new content: a new key, rebuilt
    monkeypatch.undo()
    assert len(shards.tar_index(path, str(cache))) == 3
    assert len(list((cache / "tar_index").iterdir())) == 2


def test_hf_image_struct_with_a_path_only_and_a_mix_of_shards(tmp_path):
    """An Image struct without bytes resolves its path under image_root; a mix entry may name a shard
    directory with a sampling strategy beside a JSONL file."""
    root, (singles, multis) = synth_records(tmp_path / "synth", 24, TILE_PX)
    rows = [{**r, "image": {"bytes": None, "path": r["image"]}} for r in singles if "image" in r]
    write_parquet(rows, tmp_path / "hf" / "train.parquet")
    write_jsonl([multis], tmp_path / "multi.jsonl")
    mix = tmp_path / "mix.yaml"
    mix.write_text(
        f"image_root: {root}\ndatasets:\n  - path: hf\n    sampling: first:3\n"
        "  - path: multi.jsonl\n    sampling: end:2\n"
    )
    cfg = config(str(mix), root, tmp_path)
    records = load_source(cfg)
    assert [records[i]["id"] for i in range(len(records))] == [
        *(r["id"] for r in rows[:3]), *(r["id"] for r in multis[-2:])
    ]  # fmt: skip
    want = Processor(cfg).shape({**singles[0], "_image_root": str(root)})
    assert "image" in singles[0] and want.tiles > 0
    assert Processor(cfg).shape(records[0]) == want


def test_an_empty_image_list_is_a_text_row(tmp_path):
    """HF datasets store a text-only row of an image-list column as `image: []` (or null): a text
    sample in parquet, tar and JSON alike; with an `<image>` marker the row names media it lacks."""
    root, (singles, multis) = synth_records(tmp_path / "synth", 24, TILE_PX)
    texts = [r for r in singles if "image" not in r][:3]
    ask = [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A cat."}]
    rows = parquet_rows([r for r in multis if "image" in r][:2], root, as_list=True)
    rows += [{**texts[0], "image": []}, {**texts[1], "image": None}]
    rows += [{**texts[2], "id": "marked", "conversations": ask, "image": []}]
    path = write_parquet(rows, tmp_path / "hf" / "train.parquet")
    cfg = config(str(path), root, tmp_path, cache_dir="")
    records = load_source(cfg)
    assert records[2]["image"] == [] and "image" not in records[3]  # as HF datasets store them
    proc = Processor(cfg)
    want = [proc.shape(r) for r in texts[:2]]  # the same rows without an `image` key
    assert [proc.shape(records[i]) for i in (2, 3)] == want
    assert {w.modality for w in want} == {"text"} and proc.process(records[2]).modality == "text"
    assert proc.shape(records[0]).modality == "multi_image"
    with pytest.raises(BadSample) as e:
        proc.shape(records[4])
    assert e.value.reason == "bad_markers" and "`image` is [] (no media)" in e.value.detail
    summary = json.loads(profile_data(cfg, out_dir=tmp_path / "p").read_text())["summary"]
    assert summary["bad"] == {"bad_markers": 1}
    # A WebDataset sample whose JSON holds `image: []` and no image member; a JSON record's null.
    tar = shards.tar_sample_record("k", [("json", json.dumps(rows[2]).encode())], "s.tar:k")
    assert tar["image"] == [] and proc.shape(tar) == want[0]
    assert proc.shape({**texts[1], "image": None, "video": None}) == want[1]


def test_a_glob_matching_no_shard_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"^data.source='.*nothing-\*.parquet': no .parquet"):
        load_source(DataConfig(source=str(tmp_path / "nothing-*.parquet")))


def test_a_missing_pyarrow_is_one_sentence_naming_the_extra(tmp_path, monkeypatch):
    (tmp_path / "train-00000-of-00001.parquet").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # `import pyarrow.parquet` fails
    with pytest.raises(ConfigError) as e:
        load_source(DataConfig(source=str(tmp_path)))
    assert str(e.value) == (
        f"data.source='{tmp_path}': parquet shards need pyarrow, which is not installed: "
        "pip install -c constraints.txt -e '.[parquet]' in the repository"
    )


def test_streaming_10x_the_rows_held_does_not_grow_memory(tmp_path):
    """A shuffled pass over 16x the rows the row-group cache holds: rows held stay within the cache's
    bound, and the traced peak of the whole pass stays that of its first tenth."""
    rng = np.random.default_rng(0)
    rows = [
        {"id": f"r{i}", "data_source": "s", "image": {"bytes": rng.bytes(20_000), "path": "x"}}
        for i in range(512)
    ]
    write_parquet(rows, tmp_path / "train.parquet", row_group_size=8)
    records = shards.open_shards(tmp_path / "train.parquet")
    held_bound = shards.ROW_GROUPS_HELD * 8
    assert len(records) >= 10 * held_bound
    order = list(grain.MapDataset.source(range(len(records))).shuffle(seed=0))

    def stream(indices) -> int:
        tracemalloc.reset_peak()
        for i in indices:
            assert records[i]["id"] == f"r{i}"
            assert records.rows_held() <= held_bound
        return tracemalloc.get_traced_memory()[1]

    tracemalloc.start()
    try:
        head = stream(order[:51])
        whole = stream(order)
    finally:
        tracemalloc.stop()
    dataset_bytes = 512 * 20_000
    assert whole < 1.5 * head and whole < dataset_bytes / 4, (head, whole)


# The demo's LLaVA-OV-style model, encoder colocated on the first of 2 LLM stages (8 CPU devices).
TRAIN = ["plan=explicit", "layout.encoder_colocated=true", "layout.encoder_layers=[]",
         "layout.encoder_tp=[]", "layout.llm_layers=[2, 2]", "layout.llm_tp=[2]", "layout.llm_dp=2",
         "layout.tiles=[16]", "layout.lengths=[1024]", "layout.microbatches=[2, 3]",
         "steps=3", "global_batch=8", "checkpoint.every=0", "compute_dtype=float32",
         "measure_stage_times_every=0", "device.peak_flops=1000000000.0", "scheduler.solver=greedy",
         "data.cache_dir=", "seed=0"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.seconds(50)
def test_three_formats_train_to_the_same_losses(tmp_path):
    """3 steps with the same seed on the JSONL, the parquet shards and the tar shards: the same
    per-step losses (float32)."""
    from pathlib import Path

    from dflop_jax.config import load_config
    from dflop_jax.runtime.config import TrainConfig
    from dflop_jax.train import run

    demo = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
    formats = three_formats(tmp_path / "data", samples=32, tile=56)
    losses = {}
    for name, (source, root) in formats.items():
        over = [f"data.source={source}", f"data.video_root={root}", f"run_dir={tmp_path / name}",
                f"compilation_cache={tmp_path / 'jax_cache'}"]  # fmt: skip
        report = run(load_config(TrainConfig, demo, TRAIN + over))
        losses[name] = report.losses
    assert len(losses["jsonl"]) == 3 and all(np.isfinite(losses["jsonl"]))
    for name in ("parquet", "tar"):
        np.testing.assert_allclose(losses[name], losses["jsonl"], rtol=1e-6)
