"""The encoder COLOCATED on LLM stage 0 across real processes: 2 jax processes x 4 CPU devices train the
demo LLaVA-OV with `layout.encoder_colocated: true`, the colocated stage (ViT + projector + the
first 2 LLM layers, tp 2 dp 2) on process 0 and the second LLM stage (tp 2 dp 2) on process 1; every
step's loss equals a single-process run of the same layout (8 devices, same data and schedule) to 1e-5 (float32).

What crosses processes here and nowhere else: the colocated stage's inputs are tiles (not features), its
output goes to the other process's stage, and the loader packs each sample's tiles on its row's shard
(`ScheduledMicrobatch.tiles_by_row`) identically on both processes."""

import numpy as np
import pytest
from multiprocess_launch import REPO, finish_beside, launch, rows

from dflop_jax.config import load_config
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.train import run

LAYOUT = ["plan=explicit", "layout.encoder_colocated=true", "layout.encoder_layers=[]",
          "layout.encoder_tp=[]", "layout.llm_layers=[2, 2]", "layout.llm_tp=[2]",
          "layout.llm_dp=2", "layout.tiles=[16]", "layout.lengths=[1024]",
          "layout.microbatches=[2, 3]"]  # fmt: skip


def _args(tmp_path, run_dir) -> list[str]:
    return [*LAYOUT, "steps=3", "global_batch=8", f"data.synth_dir={tmp_path / 'synth'}",
            "data.synth_samples=32", "data.cache_dir=", "checkpoint.every=0",
            "compute_dtype=float32", "compilation_cache=", "device.peak_flops=1000000000.0",
            "scheduler.solver=greedy", "distributed.timeout_s=60", f"run_dir={run_dir}"]  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_colocated_encoder_train_like_one(tmp_path):
    run_dir = tmp_path / "mp"
    logs = tmp_path / "logs"
    logs.mkdir()
    cfg = load_config(TrainConfig, REPO / "configs" / "demo.yaml",
                      _args(tmp_path, tmp_path / "sp") + ["num_cpu_devices=8"])  # fmt: skip
    procs = launch(logs, 2, _args(tmp_path, run_dir) + ["num_cpu_devices=4"], limit_s=240)
    _, single = finish_beside(procs, lambda: run(cfg), 260)
    multi = rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in multi] == [1, 2, 3]
    assert min(r["encoder_padding_ratio"] for r in multi) < 1.0  # the colocated stage encoded tiles
    assert cfg.layout.layout().encoder_stages == ()
    np.testing.assert_allclose([r["loss"] for r in multi], single.losses, rtol=1e-5, atol=0)
