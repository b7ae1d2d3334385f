"""bench train: the real runtime trains the same global batches as DFLOP (its plan, its schedule) and as
a data-blind trainer (the data-blind planner's own layout: encoder colocated, one tp/pp/dp; in-order
packing at the largest buckets); the data-blind arm pads more, and the losses agree (layout and packing
change speed, not the math: the loss is normalized over the global batch)."""

import json

import pytest
from example_fixtures import example_argv, run_example

from dflop_jax.bench import train as bench_train
from dflop_jax.planner import load_plan


@pytest.mark.slow
@pytest.mark.seconds(60)
def test_ab_arms_train_the_same_batches_to_the_same_losses(tmp_path):
    """The benchmark's `--help` example, as a user runs it: the demo LLaVA-OV, DFLOP planned with
    analytic costs (no profiling), 3 steps of 48 samples in float32 (the arms' losses then agree to
    round-off), into runs/bench_train."""
    printed = run_example(example_argv(bench_train.COMMAND), tmp_path).stdout
    ab = tmp_path / "runs" / "bench_train"  # the example's out=
    report = json.loads((ab / "bench_train.json").read_text())
    dflop, blind = report["dflop"], report["data_blind"]
    assert dflop["steps"] == blind["steps"] == 3
    assert blind["llm_padding_ratio_mean"] > dflop["llm_padding_ratio_mean"]
    assert report["max_loss_diff"] < 1e-4 * max(dflop["losses"])
    rows = {
        arm: [json.loads(r) for r in (ab / arm / "metrics.jsonl").read_text().splitlines()]
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
    # The table printed from the report written.
    assert f"{report['speedup_all_steps']:.2f}x over all steps" in printed
    assert f"| {blind['llm_padding_ratio_mean']:.1%} |" in printed
    assert "CPU cannot show: pipeline bubbles" in printed
    # the second arm trained on the data-blind planner's own layout: the encoder colocated, one tp
    plan = load_plan(ab / "data_blind_plan.yaml")
    assert plan.mode == "uniform" and plan.layout.encoder_stages == ()
    assert len({s.tp for s in plan.layout.llm_stages}) == 1
    # the demo's 2 LLM stages: the colocated stage hands its activations to LLM stage 1 (the 8-device
    # transfer that hung before the CPU client's pool was sized, DESIGN 11)
    assert blind["layout"].startswith("enc@llm0 | llm tp") and " pp2" in blind["layout"]
    assert dflop["layout"].startswith("enc tp")  # the demo's planner keeps separate encoder stages
    blind_cfg = (ab / "data_blind" / "config.yaml").read_text()
    assert "solver: data_blind" in blind_cfg and "data_blind_plan.yaml" in blind_cfg
