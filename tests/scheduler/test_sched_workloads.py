"""Shape distributions: the shared file format, the real OmniBal statistics, the LLaVA-OV-like mix,
global-batch sampling and default buckets."""

import gzip
import json
import tomllib
from pathlib import Path

import numpy as np
import pytest

from dflop_jax.scheduler import (
    SampleShape,
    default_buckets,
    llava_ov_mix,
    load_shape_distribution,
    omnibal_shapes,
    sample_global_batch,
    save_shape_distribution,
)
from dflop_jax.scheduler.workloads import OMNIBAL_DIR


def test_file_round_trip(tmp_path):
    shapes = [SampleShape(0, 3, 900, "image"), SampleShape(1, 0, 40, "text")]
    path = tmp_path / "d.json"
    save_shape_distribution(shapes, path, "unit", {"n": 2})
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["source"] == "unit" and data["summary"] == {"n": 2}
    assert load_shape_distribution(path) == shapes


def test_bad_file_errors(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"version": 1, "samples": [{"tiles": 1}]}))
    with pytest.raises(ValueError, match=r"samples\[0\]"):
        load_shape_distribution(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="cannot read"):
        load_shape_distribution(path)


def test_omnibal_matches_the_raw_records():
    shapes = omnibal_shapes(["ai2d"])
    with gzip.open(OMNIBAL_DIR / "ai2d_train_12k_wh_token_lengths.json.gz", "rt") as f:
        raw = json.load(f)
    assert len(shapes) == len(raw) == 12413  # README table
    assert [(s.tiles, s.tokens) for s in shapes[:50]] == [
        (r["vit_num"], r["token_num"]) for r in raw[:50]
    ]
    assert max(s.tiles for s in shapes) == 5
    with pytest.raises(ValueError, match="known"):
        omnibal_shapes(["nope"])


def test_omnibal_ships_inside_the_package():
    """The statistics are package data: inside `dflop_jax`, listed in pyproject's package-data."""
    import dflop_jax

    package = Path(dflop_jax.__file__).resolve().parent
    assert OMNIBAL_DIR.resolve().is_relative_to(package)
    assert (OMNIBAL_DIR / "README.md").read_text().startswith("# Real per-sample shape statistics")
    shapes = omnibal_shapes()
    assert len(shapes) == 12413 + 18317 + 10211 + 29765  # README table: 70,706 samples
    by = {s.id.split(":")[0] for s in shapes}
    assert by == {"ai2d", "chartqa", "docvqa", "synthdog_en"}
    package_data = tomllib.loads((package.parent / "pyproject.toml").read_text())["tool"][
        "setuptools"
    ]["package-data"]["dflop_jax"]
    shipped = {
        f.relative_to(package).as_posix() for pattern in package_data for f in package.glob(pattern)
    }
    assert {f.relative_to(package).as_posix() for f in OMNIBAL_DIR.iterdir()} <= shipped


def test_llava_ov_mix_shapes():
    shapes = llava_ov_mix(4000, seed=1)
    assert shapes == llava_ov_mix(4000, seed=1)
    by = {
        k: [s for s in shapes if s.modality == k] for k in ("image", "multi_image", "video", "text")
    }
    assert abs(len(by["image"]) / 4000 - 0.45) < 0.03 and abs(len(by["video"]) / 4000 - 0.25) < 0.03
    for s in by["image"]:
        assert 2 <= s.tiles <= 37  # base tile + a x b grid, up to 6x6
        kept = min(s.tiles - 1, 9)
        assert s.tokens > 729 * (1 + kept)  # image tokens + newlines + text
    for s in by["multi_image"]:
        assert 2 <= s.tiles <= 16 and s.tokens > 729 * s.tiles
    for s in by["video"]:
        assert 1 <= s.tiles <= 32 and s.tokens > 196 * s.tiles
    assert all(s.tiles == 0 for s in by["text"])


def test_sample_global_batch_and_default_buckets():
    dist = llava_ov_mix(500, seed=2)
    rng = np.random.default_rng(0)
    batch = sample_global_batch(dist, 64, rng)
    assert len(batch) == 64 and len({s.id for s in batch}) == 64  # without replacement
    assert len(sample_global_batch(dist[:10], 20, rng)) == 20  # with replacement when needed
    b = default_buckets(dist, microbatches=4, encoder_dp=2, llm_dp=2, batch_size=64)
    assert b.lengths[-1] >= max(s.tokens for s in dist)
    assert b.tiles[-1] * 2 >= max(s.tiles for s in dist)
    assert all(x % 128 == 0 for x in b.lengths)
    mean_bin = np.mean([s.tokens for s in dist]) * 64 / 8
    assert b.lengths[-1] >= 1.5 * mean_bin
