"""Sources and mixes: JSON/JSONL reading, locations, invalid lines, sampling strategies, media roots."""

import json

import numpy as np
import pytest

from dflop_jax.config import ConfigError
from dflop_jax.data.config import DataConfig
from dflop_jax.data.dataset import load_source
from dflop_jax.data.mix import load_mix, sample_records
from dflop_jax.data.sources import read_records
from dflop_jax.data.split import split_records
from dflop_jax.data.tokenizer import BUNDLED_SPECIALS, build_byte_tokenizer, load_tokenizer


def _write_jsonl(path, n, prefix):
    path.write_text(
        "".join(json.dumps({"id": f"{prefix}{i}", "text": f"t{i}"}) + "\n" for i in range(n))
    )
    return path


def test_read_jsonl_and_json_list_with_locations(tmp_path):
    (tmp_path / "a.jsonl").write_text(
        '{"id": 1, "text": "x"}\n\n[1, 2]\n{oops\n{"id": 2, "text": "y"}\n'
    )
    recs = list(read_records(tmp_path / "a.jsonl"))
    assert [r["_location"] for r in recs] == [f"{tmp_path / 'a.jsonl'}:{i}" for i in (1, 3, 4, 5)]
    assert [r.get("_error") for r in recs] == [None, "invalid_json", "invalid_json", None]
    (tmp_path / "b.json").write_text(json.dumps([{"id": "p"}, {"id": "q"}]))
    assert [r["_location"] for r in read_records(tmp_path / "b.json")] == [
        f"{tmp_path / 'b.json'}[{i}]" for i in (0, 1)
    ]
    (tmp_path / "c.json").write_text("{not json")
    assert [r["_error"] for r in read_records(tmp_path / "c.json")] == ["invalid_json"]


def test_sampling_strategies():
    recs = list(range(10))
    rng = np.random.default_rng(0)
    assert sample_records(recs, "all", rng) == recs
    assert sample_records(recs, "first:3", rng) == [0, 1, 2]
    assert sample_records(recs, "first:25%", rng) == [0, 1, 2]  # ceil(2.5), as LLaVA does
    assert sample_records(recs, "end:2", rng) == [8, 9]
    assert sample_records(recs, "end:0", rng) == []
    assert sample_records(recs, "first:50", rng) == recs
    picked = sample_records(recs, "random:4", np.random.default_rng(7))
    assert (
        picked == sample_records(recs, "random:4", np.random.default_rng(7))
        and len(set(picked)) == 4
    )
    assert picked != sample_records(recs, "random:4", np.random.default_rng(8))
    for bad in ("first", "last:3", "first:-1", "random:x%", "first:150%"):
        with pytest.raises(ConfigError, match="sampling"):
            sample_records(recs, bad, rng)


def test_load_mix_roots_and_seeded_random(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", 10, "a")
    (tmp_path / "sub").mkdir()
    _write_jsonl(tmp_path / "sub" / "b.jsonl", 20, "b")
    mix = tmp_path / "mix.yaml"
    mix.write_text(
        "image_root: imgs\ndatasets:\n  - path: a.jsonl\n    sampling: first:30%\n"
        "  - json_path: sub/b.jsonl\n    sampling_strategy: random:5\n    image_root: /abs/other\n"
    )
    recs = load_mix(mix, seed=3)
    assert [r["id"] for r in recs[:3]] == ["a0", "a1", "a2"] and len(recs) == 8
    assert (
        recs[0]["_image_root"] == str(tmp_path / "imgs") and recs[3]["_image_root"] == "/abs/other"
    )
    assert recs[3]["_video_root"] == str(tmp_path / "sub")
    assert [r["id"] for r in load_mix(mix, seed=3)] == [r["id"] for r in recs]
    assert [r["id"] for r in load_mix(mix, seed=4)] != [r["id"] for r in recs]
    via_cfg = load_source(DataConfig(source=str(mix)), seed=3)
    assert [r["id"] for r in via_cfg] == [r["id"] for r in recs]


def test_mix_phases_order_a_curriculum(tmp_path):
    """`phases:` reads the datasets as a curriculum: phase k holds `allot(samples, weights)` records
    of each dataset, drawn without replacement, shuffled together; the same seed gives the same
    order (a resumed run reads what the first read)."""
    _write_jsonl(tmp_path / "img.jsonl", 12, "i")
    _write_jsonl(tmp_path / "vid.jsonl", 12, "v")
    mix = tmp_path / "mix.yaml"
    mix.write_text(
        "datasets:\n  - path: img.jsonl\n  - path: vid.jsonl\n"
        "phases:\n  - {samples: 8, weights: [1, 0]}\n  - {samples: 8, weights: [1, 3]}\n"
    )
    recs = load_mix(mix, seed=1)
    ids = [r["id"] for r in recs]
    assert recs.phase_ends == (8, 16) and len(ids) == 16 == len(set(ids))
    assert all(i.startswith("i") for i in ids[:8])
    assert sum(i.startswith("v") for i in ids[8:]) == 6  # 8 * 3/4
    assert ids == [r["id"] for r in load_mix(mix, seed=1)]
    assert ids != [r["id"] for r in load_mix(mix, seed=2)]
    with pytest.raises(ConfigError, match="held-out fraction 0.1: a data mix with `phases`"):
        split_records(recs, 0.1, 0)


@pytest.mark.parametrize(
    "phases, match",
    [
        ("phases: []\n", "non-empty list"),
        ("phases:\n  - {samples: 4, weights: [1]}\n", r"phases\[0\]: weights=\[1\]: give 2"),
        ("phases:\n  - {samples: 4, weights: [0, 0]}\n", "not all 0"),
        ("phases:\n  - {samples: 0, weights: [1, 1]}\n", "samples=0: must be a count"),
        ("phases:\n  - {samples: 4, weight: [1, 1]}\n", "expected {samples: N, weights"),
        ("phases:\n  - {samples: 4, weights: [1, 0]}\n  - {samples: 4, weights: [1, 0]}\n",
         r"phases\[1\] needs 4 records of datasets\[0\], which has 2 left of 6"),
    ],
)  # fmt: skip
def test_mix_phase_errors_are_one_line(tmp_path, phases, match):
    _write_jsonl(tmp_path / "a.jsonl", 6, "a")
    (tmp_path / "m.yaml").write_text("datasets:\n  - path: a.jsonl\n  - path: a.jsonl\n" + phases)
    with pytest.raises(ConfigError, match=match) as e:
        load_mix(tmp_path / "m.yaml")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "text, match",
    [
        ("datasets: []\n", "non-empty"),
        ("datasets:\n  - path: nope.jsonl\n", "not found"),
        ("datasets:\n  - path: a.jsonl\n    weight: 2\n", "unknown key 'weight'"),
        ("datazets: []\n", "unknown key 'datazets'"),
    ],
)
def test_mix_errors_are_one_line(tmp_path, text, match):
    _write_jsonl(tmp_path / "a.jsonl", 2, "a")
    (tmp_path / "m.yaml").write_text(text)
    with pytest.raises(ConfigError, match=match) as e:
        load_mix(tmp_path / "m.yaml")
    assert "\n" not in str(e.value)


def test_bundled_tokenizer_is_byte_level_and_asset_is_current():
    tok = load_tokenizer("bundled")
    assert tok.vocab_size == 256 + len(BUNDLED_SPECIALS) <= 512
    text = "héllo <image> wörld<|im_end|>"
    ids, offsets = tok.encode(text)
    specials = {tok.token_id(s) for s in BUNDLED_SPECIALS}
    assert len(ids) == len(text.replace("<image>", "I").replace("<|im_end|>", "E").encode())
    assert sum(int(i) in specials for i in ids) == 2 and tok.decode(ids) == text
    assert offsets.shape == (len(ids), 2)
    assert (
        build_byte_tokenizer().to_str() == tok.hf.to_str()
    )  # assets/byte_tokenizer.json is up to date


def test_data_config_validation():
    with pytest.raises(ConfigError, match="data.max_frames"):
        DataConfig(max_frames=0)
    with pytest.raises(ConfigError, match="data.synth_mix"):
        DataConfig(synth_mix="nope")
    assert DataConfig(model_family="internvl").tile_px == 448 and DataConfig().tile_px == 384
    assert DataConfig(model_family="internvl").mean == (0.485, 0.456, 0.406)


def test_missing_source_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="data.source"):
        load_source(DataConfig(source=str(tmp_path / "nope.jsonl")))
