"""bench train: the real runtime trains the same global batches under DFLOP's schedule and under the
data-blind schedule; the data-blind arm pads more, and the losses agree (packing changes speed, not
the math: the loss is normalized over the global batch)."""

import json

from models_fixtures import TINY_TRAIN_DECODER

from dflop_jax.bench import train as bench_train


def test_ab_arms_train_the_same_batches_to_the_same_losses(tmp_path):
    overrides = [
        "model.kind=decoder",
        "layout.encoder_layers=[]",
        *TINY_TRAIN_DECODER,
        f"data.synth_dir={tmp_path / 'synth'}",
        "data.synth_mix=text",
        "data.synth_samples=64",
        "data.max_tokens=512",
        "data.cache_dir=",
        "plan=explicit",
        "layout.llm_layers=[1, 1]",
        "layout.llm_tp=[1, 2]",
        "layout.llm_dp=2",
        "layout.lengths=[128, 256, 512]",
        "layout.microbatches=[2, 4]",
        "scheduler.solver=greedy",
        "global_batch=16",
        "steps=3",
        "compute_dtype=float32",
        f"compilation_cache={tmp_path / 'jax_cache'}",
    ]
    report = bench_train.run_ab(None, tmp_path / "ab", overrides)
    dflop, blind = report["dflop"], report["data_blind"]
    assert dflop["steps"] == blind["steps"] == 3
    assert blind["llm_padding_ratio_mean"] > dflop["llm_padding_ratio_mean"]
    assert report["max_loss_diff"] < 1e-4 * max(dflop["losses"])
    assert report["speedup_all_steps"] > 0
    saved = json.loads((tmp_path / "ab" / "bench_train.json").read_text())
    assert saved["data_blind"]["losses"] == blind["losses"]
    # the second arm trained with the first arm's layout, not a new plan
    blind_cfg = (tmp_path / "ab" / "data_blind" / "config.yaml").read_text()
    assert "solver: data_blind" in blind_cfg and "lengths:\n  - 128" in blind_cfg
