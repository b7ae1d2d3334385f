"""Metadata cache, synthetic datasets, the data profiler and its CLI."""

import json
import multiprocessing

import numpy as np
import pytest
from PIL import Image

from dflop_jax import profile as profile_cli
from dflop_jax.data.bad_sample import BadSample
from dflop_jax.data.config import DataConfig
from dflop_jax.data.dataset import load_source
from dflop_jax.data.metadata import MetadataCache
from dflop_jax.data.process import Processor
from dflop_jax.data.shape_profile import profile_data
from dflop_jax.data.synth import main as synth_main
from dflop_jax.data.synth import synth_dataset
from dflop_jax.scheduler.workloads import load_shape_distribution, omnibal_shapes


@pytest.fixture(scope="module")
def llava_data(tmp_path_factory):
    return synth_dataset(tmp_path_factory.mktemp("synth") / "ov", 60, "llava-ov", seed=1)


def _count_opens(monkeypatch):
    calls = []
    real = Image.open

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(Image, "open", counting)
    return calls


def test_cache_second_run_opens_no_image(llava_data, tmp_path, monkeypatch):
    cfg = DataConfig(source=str(llava_data), cache_dir=str(tmp_path / "cache"))
    records = load_source(cfg)
    calls = _count_opens(monkeypatch)
    first = MetadataCache(cfg.cache_dir, Processor(cfg)).shapes(records)
    assert len(calls) > 50
    calls.clear()
    again = MetadataCache(cfg.cache_dir, Processor(cfg))
    second = again.shapes(load_source(cfg))
    assert calls == [] and again.hits == len(records) and again.misses == 0
    assert second == first
    other = MetadataCache(
        cfg.cache_dir, Processor(DataConfig(source=str(llava_data), anyres_max=4))
    )
    other.shapes(records[:5])  # another processing setting is another key
    assert other.misses == 5


def test_cache_keeps_bad_samples(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"id": 1, "image": "gone.png", "conversations": []}\n{bad\n')
    cfg = DataConfig(source=str(tmp_path / "d.jsonl"), cache_dir=str(tmp_path / "c"))
    MetadataCache(cfg.cache_dir, Processor(cfg)).shapes(load_source(cfg))
    cache = MetadataCache(cfg.cache_dir, Processor(cfg))
    out = cache.shapes(load_source(cfg))
    assert [type(o) for o in out] == [BadSample, BadSample] and cache.hits == 2
    assert [o.reason for o in out] == ["no_conversations", "invalid_json"]


def test_llava_ov_synth_covers_design_workloads(llava_data, tmp_path):
    cfg = DataConfig(source=str(llava_data), cache_dir="")
    records = load_source(cfg)
    proc = Processor(cfg)
    shapes = [proc.shape(r) for r in records]
    by_mod = {}
    for s in shapes:
        by_mod.setdefault(s.modality, []).append(s)
    assert set(by_mod) == {"image", "multi_image", "video", "text"}
    assert all(1 < s.tiles <= 37 for s in by_mod["image"])
    assert all(2 <= s.tiles <= 16 for s in by_mod["multi_image"])
    assert all(1 <= s.tiles <= 32 for s in by_mod["video"])
    assert all(s.tiles == 0 for s in by_mod["text"])
    first_of_each = {s.modality: r for r, s in reversed(list(zip(records, shapes)))}
    for record in first_of_each.values():  # the demo trains on these: processing must work
        sample = proc.process(record)
        assert (sample.num_tiles, sample.num_tokens) == (
            proc.shape(record).tiles,
            proc.shape(record).tokens,
        )


def test_synth_is_deterministic_and_reused(tmp_path):
    a = synth_dataset(tmp_path / "a", 20, "multi-image", seed=5)
    b = synth_dataset(tmp_path / "b", 20, "multi-image", seed=5)
    assert (a.parent / "multi_image.jsonl").read_text() == (
        b.parent / "multi_image.jsonl"
    ).read_text()
    mtime = a.stat().st_mtime_ns
    assert (
        synth_dataset(tmp_path / "a", 20, "multi-image", seed=5) == a
        and a.stat().st_mtime_ns == mtime
    )
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "precious.txt").write_text("keep")
    assert synth_main([f"out={tmp_path / 'user'}", "samples=3", "mix=text"]) == 2
    assert (tmp_path / "user" / "precious.txt").read_text() == "keep"


def _synth_in_child(out, barrier):
    barrier.wait()  # start together, to race for the same folder
    synth_dataset(out, 40, "llava-ov", seed=2)


def test_concurrent_synth_writes_once_and_every_caller_reuses_it(tmp_path):
    """Two processes of a multi-process run ask for the same dataset at the same moment."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(3)
    out = tmp_path / "shared"
    children = [ctx.Process(target=_synth_in_child, args=(out, barrier)) for _ in range(2)]
    for c in children:
        c.start()
    barrier.wait()
    mix = synth_dataset(out, 40, "llava-ov", seed=2)
    for c in children:
        c.join(timeout=120)
        assert c.exitcode == 0
    reference = synth_dataset(tmp_path / "alone", 40, "llava-ov", seed=2)
    for name in ("mix.yaml", "single_image.jsonl", "video.jsonl"):
        assert (mix.parent / name).read_text() == (reference.parent / name).read_text()
    # No staging folders left beside the dataset, only the lock file.
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [
        ".alone.lock",
        ".shared.lock",
    ]


def test_stale_synth_is_replaced_whole(tmp_path):
    synth_dataset(tmp_path / "d", 10, "text", seed=1)
    (tmp_path / "d" / "text.jsonl").write_text("")  # the new dataset must not keep old files
    mix = synth_dataset(tmp_path / "d", 12, "text", seed=1)
    assert len((mix.parent / "text.jsonl").read_text().splitlines()) == 12


def test_internvl_synth_profile_reproduces_the_omnibal_stats(tmp_path):
    reference = omnibal_shapes()  # the in-package statistics: never skipped
    cfg = DataConfig(
        source="synthetic", synth_dir=str(tmp_path / "syn"), synth_samples=300, synth_mix="internvl",
        model_family="internvl", max_tiles=4, system_prompt="", cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    path = profile_data(cfg, num_samples=300, seed=0, out_dir=tmp_path / "prof")
    summary = json.loads(path.read_text())["summary"]
    assert (
        len(load_shape_distribution(path)) == 300
        and (tmp_path / "prof" / "shape_histogram.png").is_file()
    )
    for subset, got in summary["by_source"].items():
        ref = [s for s in reference if s.id.startswith(subset + ":")]
        for field in ("tiles", "tokens"):
            want = np.mean([getattr(s, field) for s in ref])
            assert abs(got[f"{field}_mean"] / want - 1) < 0.10, (subset, field, got, want)
    for field in ("tiles", "tokens"):
        want = np.mean([getattr(s, field) for s in reference])
        assert abs(summary["all"][field]["mean"] / want - 1) < 0.10


def test_profile_cli(tmp_path, capsys):
    cfg_file = tmp_path / "p.yaml"
    cfg_file.write_text(
        f"data:\n  source: synthetic\n  synth_dir: {tmp_path / 's'}\n  synth_mix: text\n"
    )
    rc = profile_cli.main(
        ["data", "--config", str(cfg_file), "data.synth_samples=40", f"run_dir={tmp_path / 'o'}",
         f"data.cache_dir={tmp_path / 'c'}", "profile.data_samples=25"]
    )  # fmt: skip
    assert rc == 0
    # where `plan` (and `train plan=auto`) read it
    shapes = load_shape_distribution(
        tmp_path / "o" / "auto_plan" / "data" / "shape_distribution.json"
    )
    assert len(shapes) == 25 and {s.modality for s in shapes} == {"text"}
    assert "text" in capsys.readouterr().out
    assert profile_cli.main(["data", "--config", str(cfg_file), "data.max_frames=0"]) == 2
    assert "data.max_frames" in capsys.readouterr().err


@pytest.mark.parametrize("strict", [False, True])
def test_profile_counts_extra_keys_once(tmp_path, capsys, strict):
    """Real LLaVA records carry metadata: kept and reported once by default, skipped under strict."""
    turns = [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]
    records = [
        {"id": "a", "conversations": turns, "metadata": {"src": "x"}, "sample_id": 1},
        {"id": "b", "conversations": turns, "metadata": {"src": "y"}},
        {"id": "c", "conversations": turns},
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig(source=str(tmp_path / "d.jsonl"), cache_dir="", strict=strict)
    path = profile_data(cfg, out_dir=tmp_path / "prof")
    summary = json.loads(path.read_text())["summary"]
    assert summary["extra_keys"] == {
        "records": 2,
        "keys": {"metadata": 2, "sample_id": 1},
        "ignored": not strict,
    }
    assert summary["bad"] == ({"unknown_fields": 2} if strict else {})
    assert len(load_shape_distribution(path)) == (1 if strict else 3)
    verdict = "rejected: data.strict" if strict else "ignored"
    out = capsys.readouterr().out
    assert out.count("records carried extra keys") == 1
    assert f"2 records carried extra keys: metadata, sample_id ({verdict})" in out
