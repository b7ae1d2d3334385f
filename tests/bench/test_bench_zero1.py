"""`python -m dflop_jax.bench zero1`: both arms train the same samples to the same losses, and ZeRO-1
shards the AdamW state of each stage over its data axis (the figures the benchmark reports)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from example_fixtures import example_argv, run_example

from dflop_jax.bench import zero1


@pytest.mark.slow
def test_zero1_arms_shard_the_optimizer_state_and_train_alike(tmp_path):
    """The benchmark's `--help` example (the tiny size, into runs/bench_zero1), as a user runs it."""
    out = run_example(example_argv(zero1.COMMAND), tmp_path)
    result = json.loads((tmp_path / "runs" / "bench_zero1" / "bench_zero1.json").read_text())
    off, on = result["off"], result["on"]
    # ZeRO-1 changes where the optimizer state lives, not what the update computes.
    np.testing.assert_allclose(on["losses"], off["losses"], rtol=1e-5)
    dps = [2, 3, 3]  # the benchmark's layout: encoder dp 2, two LLM stages at dp 3
    for s_off, s_on, dp in zip(off["stages"], on["stages"], dps, strict=True):
        assert s_on["params_mib"] == pytest.approx(s_off["params_mib"])
        assert s_on["accumulator_mib"] == pytest.approx(s_off["accumulator_mib"])
        # AdamW m and v: two fp32 copies of the params, replicated over dp without ZeRO-1.
        assert s_off["optimizer_mib"] == pytest.approx(2 * s_off["params_mib"])
        # With it, every leaf is split dp ways (padded to a multiple where no axis divides), so
        # the state is 1/dp plus that padding.
        assert s_on["optimizer_mib"] < s_off["optimizer_mib"] / dp * 1.1
    assert "| on |" in out.stdout and "| off |" in out.stdout


def test_zero1_arms_differ_only_in_the_optimizer_switch(tmp_path):
    off = zero1.arm_overrides("mid", False, 5, tmp_path)
    on = zero1.arm_overrides("mid", True, 5, tmp_path)
    differ = sorted(set(off) ^ set(on))
    assert differ == sorted(
        [
            "optimizer.zero1=false",
            "optimizer.zero1=true",
            f"run_dir={tmp_path / 'off'}",
            f"run_dir={tmp_path / 'on'}",
        ]  # fmt: skip
    )
