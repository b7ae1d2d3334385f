"""An omni model across real processes: 2 jax processes x 4 CPU devices train `configs/omni_demo.yaml`,
the vision encoder's 2 stages on process 0 and the LLM's 2 stages on process 1 (the first of them
running the audio encoder); every step's loss equals a single-process run of the same layout (8
devices, same data and schedule) to 1e-5 (float32).

What crosses processes here and nowhere else: the vision features go to the process that runs the
audio encoder, and process 1's loader packs every LLM row's audio windows (process 0 packs only
tiles), each process deciding the same audio buckets from the same schedule."""

import numpy as np
import pytest
from multiprocess_launch import REPO, finish, launch, rows

from dflop_jax.config import load_config
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.train import run


def _args(tmp_path, run_dir) -> list[str]:
    return ["steps=3", "global_batch=8", f"data.synth_dir={tmp_path / 'synth'}",
            "data.synth_samples=48", "data.cache_dir=", "checkpoint.every=0",
            "compute_dtype=float32", "compilation_cache=", "device.peak_flops=1000000000.0",
            "scheduler.solver=greedy", "distributed.timeout_s=60", f"run_dir={run_dir}"]  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_train_the_omni_model_like_one(tmp_path):
    config = REPO / "configs" / "omni_demo.yaml"
    run_dir = tmp_path / "mp"
    logs = tmp_path / "logs"
    logs.mkdir()
    args = ["--config", str(config), *_args(tmp_path, run_dir), "num_cpu_devices=4"]
    finish(launch(logs, 2, args, limit_s=300), 320)
    multi = rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in multi] == [1, 2, 3]
    assert any(r["audio_padding_ratio"] is not None for r in multi)  # the audio encoder ran

    cfg = load_config(TrainConfig, config, _args(tmp_path, tmp_path / "sp") + ["num_cpu_devices=8"])
    single = run(cfg)
    np.testing.assert_allclose([r["loss"] for r in multi], single.losses, rtol=1e-5, atol=0)
