"""bench train: the real runtime trains the same global batches under DFLOP's schedule and under the
data-blind schedule; the data-blind arm pads more, and the losses agree (packing changes speed, not
the math: the loss is normalized over the global batch)."""

import json

import pytest
from models_fixtures import TINY_TRAIN_DECODER

from dflop_jax.bench import train as bench_train


def test_ab_arms_train_the_same_batches_to_the_same_losses(tmp_path, capsys):
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
    rows = {
        arm: [
            json.loads(r)
            for r in (tmp_path / "ab" / arm / "metrics.jsonl").read_text().splitlines()
        ]
        for arm in ("dflop", "data_blind")
    }
    # The same global batches: per step the same samples, real tokens and loss tokens in both arms.
    for a, b in zip(rows["dflop"], rows["data_blind"], strict=True):
        assert a["loss_tokens"] == b["loss_tokens"]
        for rate in ("samples_per_s", "tokens_per_s"):
            assert a[rate] * a["step_time_s"] == pytest.approx(b[rate] * b["step_time_s"], rel=1e-9)
    # Equal tokens, so the all-steps throughput ratio is the inverse ratio of the total step times.
    total = {arm: sum(r["step_time_s"] for r in arm_rows) for arm, arm_rows in rows.items()}
    assert report["speedup_all_steps"] == pytest.approx(total["data_blind"] / total["dflop"])
    bench_train._print(report)
    printed = capsys.readouterr().out
    assert f"{report['speedup_all_steps']:.2f}x over all steps" in printed
    assert f"| {blind['llm_padding_ratio_mean']:.1%} |" in printed
    saved = json.loads((tmp_path / "ab" / "bench_train.json").read_text())
    assert saved["data_blind"]["losses"] == blind["losses"]
    # the second arm trained with the first arm's layout, not a new plan
    blind_cfg = (tmp_path / "ab" / "data_blind" / "config.yaml").read_text()
    assert "solver: data_blind" in blind_cfg and "lengths:\n  - 128" in blind_cfg
