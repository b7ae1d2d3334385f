"""InternVL selectable in the trainer: a tiny InternViT + pixel-shuffle projector + decoder on 2 encoder
and 2 LLM stages trains 2 steps on synthetic internvl-family data with a finite, changing loss."""

import json

import numpy as np
import pytest
from models_fixtures import TINY_TRAIN_DECODER

from dflop_jax.config import ConfigError, load_config
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.train import run


def _cfg(tmp_path, *extra):
    over = [
        "model.kind=internvl",
        "data.model_family=internvl",
        *TINY_TRAIN_DECODER,
        "model.vision_hidden_size=16",
        "model.vision_intermediate_size=32",
        "model.vision_num_layers=2",
        "model.vision_num_heads=2",
        f"data.synth_dir={tmp_path / 'synth'}",
        "data.synth_samples=32",
        "data.tile_size=56",  # 4x4 patches of 14 px -> pixel shuffle -> 4 tokens per tile
        "data.patch_size=14",
        "data.max_grid=2",
        "data.max_tiles=4",
        "data.max_frames=4",
        "data.max_tokens=512",
        "data.cache_dir=",
        "layout.encoder_layers=[1, 1]",
        "layout.encoder_dp=2",
        "layout.llm_layers=[1, 1]",
        "layout.llm_tp=[2]",
        "layout.tiles=[8, 16]",
        "layout.lengths=[512]",
        "layout.microbatches=[1, 4]",
        "scheduler.solver=greedy",
        "global_batch=4",
        "steps=2",
        "optimizer.lr=0.01",
        "optimizer.warmup_steps=1",
        "compute_dtype=float32",
        "measure_stage_times_every=0",
        f"compilation_cache={tmp_path / 'jax_cache'}",
        f"run_dir={tmp_path / 'run'}",
        "peak_flops=1000000000.0",
    ]
    return load_config(TrainConfig, None, over + list(extra))


def test_internvl_kind_must_match_data_family(tmp_path):
    with pytest.raises(ConfigError, match="model.kind"):
        _cfg(tmp_path, "data.model_family=llava_ov")


@pytest.mark.slow
def test_internvl_trains_two_steps(tmp_path):
    report = run(_cfg(tmp_path))
    assert len(report.layout.encoder_stages) == 2 and len(report.layout.llm_stages) == 2
    assert len(report.losses) == 2 and np.all(np.isfinite(report.losses))
    assert report.losses[1] != report.losses[0]
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # The encoder really ran on image tiles (a batch may happen to hold text samples only).
    assert min(r["encoder_padding_ratio"] for r in rows) < 1.0
    for r in rows:
        enc, llm = r["encoder_padding_ratio"], r["llm_padding_ratio"]
        assert r["stage_padding_ratio"] == [enc, enc, llm, llm]
