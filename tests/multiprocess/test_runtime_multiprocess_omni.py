"""An omni model across real processes: 2 jax processes x 4 CPU devices train `configs/omni_demo.yaml`,
every step's loss equal to a single-process run of the same layout (8 devices, same data and
schedule) to 1e-5 (float32), on two layouts:

- "separate": the vision encoder's 2 stages on process 0, the LLM's 2 stages on process 1 (the first
  running the audio encoder): the vision features go to the process that runs the audio encoder,
  whose loader packs every LLM row's audio windows (process 0 packs only tiles);
- "audio_stage": the vision and the audio encoder each on a stage of its own, both on process 0,
  feeding LLM stage 0 on process 1: two branches join across processes (both processes walk the
  same branched op order), and process 0 packs the audio rows its audio stage holds.

Each process decides the same audio buckets from the same schedule. A Qwen2-Audio model
(`configs/qwen2_audio_demo.yaml`, no vision) crosses processes the same way: its audio stages on
process 0 feed LLM stage 0 on process 1."""

import numpy as np
import pytest
from multiprocess_launch import REPO, finish_beside, launch, rows

from dflop_jax.config import load_config
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.train import run


def _args(tmp_path, run_dir) -> list[str]:
    return ["steps=3", "global_batch=8", f"data.synth_dir={tmp_path / 'synth'}",
            "data.synth_samples=48", "data.cache_dir=", "checkpoint.every=0",
            "compute_dtype=float32", "compilation_cache=", "device.peak_flops=1000000000.0",
            "scheduler.solver=greedy", "distributed.timeout_s=60", f"run_dir={run_dir}"]  # fmt: skip


# The omni layouts keep one tile bucket of the demo's two: half the programs to compile, while the
# processes still agree on a bucket of two ladders for every microbatch (lengths and audio).
LAYOUTS = {
    "separate": ["layout.tiles=[8]"],
    "audio_stage": [
        "layout.tiles=[8]",
        "layout.encoder_layers=[2]",
        "layout.audio_layers=[2]",
        "layout.audio_dp=2",
    ],
    # Qwen2-Audio (no vision): its audio encoder's 2 stages on process 0, the LLM's on process 1
    "qwen2_audio": ["layout.audio_layers=[1,1]", "layout.audio_dp=2", "layout.llm_dp=2"],
}
CONFIGS = {"qwen2_audio": "qwen2_audio_demo.yaml"}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_processes_train_the_omni_model_like_one(tmp_path, layout):
    config = REPO / "configs" / CONFIGS.get(layout, "omni_demo.yaml")
    run_dir = tmp_path / "mp"
    logs = tmp_path / "logs"
    logs.mkdir()
    args = ["--config", str(config), *_args(tmp_path, run_dir), *LAYOUTS[layout],
            "num_cpu_devices=4"]  # fmt: skip
    cfg = load_config(TrainConfig, config,
                      [*_args(tmp_path, tmp_path / "sp"), *LAYOUTS[layout], "num_cpu_devices=8"])  # fmt: skip
    _, single = finish_beside(launch(logs, 2, args, limit_s=300), lambda: run(cfg), 320)
    multi = rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in multi] == [1, 2, 3]
    assert all(r["recompiles"] == 0 for r in multi)  # process 0's rows: nothing after precompile
    heard = [r["audio_padding_ratio"] for r in multi if r["audio_padding_ratio"] is not None]
    assert heard and min(heard) < 1.0  # the audio encoder ran real frames
    assert single.summary["programs_after_precompile"] == 0
    np.testing.assert_allclose([r["loss"] for r in multi], single.losses, rtol=1e-5, atol=0)
