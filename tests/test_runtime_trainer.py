"""End-to-end trainer: the loss decreases; N steps straight == N/2, stop, resume to N (losses, params);
the embedded demo (LLaVA-OV-style, 2 encoder + 2 LLM stages) trains and its loss decreases."""

from pathlib import Path

import jax
import numpy as np
import pytest

from dflop_jax.config import load_config
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.runtime.trainer import run

REPO = Path(__file__).resolve().parent.parent


def _cfg(tmp_path, name, **over):
    base = [
        "model.kind=decoder",
        "layout.encoder_layers=[]",
        "model.hidden_size=32",
        "model.intermediate_size=64",
        "model.num_layers=2",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.head_dim=8",
        f"data.synth_dir={tmp_path / 'synth'}",
        "data.synth_mix=text",
        "data.synth_samples=96",
        "data.max_tokens=256",
        "data.cache_dir=",
        "layout.llm_layers=[1, 1]",
        "layout.llm_tp=[1, 2]",
        "layout.llm_dp=2",
        "layout.lengths=[256]",
        "layout.microbatches=[2, 3]",
        "scheduler.solver=greedy",
        "optimizer.lr=0.01",
        "optimizer.warmup_steps=1",
        "optimizer.decay_steps=20",
        "global_batch=8",
        "compute_dtype=float32",
        f"compilation_cache={tmp_path / 'jax_cache'}",
        f"run_dir={tmp_path / name}",
        "peak_flops=1000000000.0",
    ]
    return load_config(TrainConfig, None, base + [f"{k}={v}" for k, v in over.items()])


def test_demo_config_loads():
    cfg = load_config(TrainConfig, REPO / "configs" / "demo.yaml")
    assert cfg.layout.layout().num_stages >= 2 and cfg.layout.layout().num_devices <= 8


def test_train_loss_decreases_and_resume_is_exact(tmp_path):
    straight = run(_cfg(tmp_path, "a", steps=6))
    assert np.mean(straight.losses[-2:]) < straight.losses[0] - 0.3
    assert (tmp_path / "a" / "config.yaml").is_file()
    rows = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 6 and straight.summary["new_compiles_after_first_step"] == 0

    half = run(_cfg(tmp_path, "b", steps=3, **{"checkpoint.every": 3}))
    resumed = run(_cfg(tmp_path, "b", steps=6, **{"checkpoint.every": 3}))
    assert resumed.first_step == 3
    assert half.losses + resumed.losses == straight.losses
    for s_a, s_b in zip(straight.stages, resumed.stages):
        jax.tree.map(
            np.testing.assert_array_equal, jax.device_get(s_a.params), jax.device_get(s_b.params)
        )


@pytest.mark.slow
def test_demo_trains_and_loss_decreases(tmp_path):
    """The demo config itself (fewer steps, a smaller synthetic set, no checkpoints)."""
    cfg = load_config(
        TrainConfig,
        REPO / "configs" / "demo.yaml",
        [
            "steps=6",
            "optimizer.lr=0.01",
            "data.synth_samples=64",
            f"data.synth_dir={tmp_path / 'synth'}",
            "data.cache_dir=",
            "checkpoint.every=0",
            f"run_dir={tmp_path / 'demo'}",
            f"compilation_cache={tmp_path / 'jax_cache'}",
            "peak_flops=1000000000.0",
        ],
    )
    report = run(cfg)
    assert len(report.layout.encoder_stages) >= 2 and len(report.layout.llm_stages) >= 2
    assert np.mean(report.losses[-2:]) < report.losses[0] - 0.2
    assert (tmp_path / "demo" / "config.yaml").is_file()
    assert len((tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()) == 6
