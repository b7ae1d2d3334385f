"""The dry run's per-stage FLOPs (`profiling/stage_report.py`): XLA's cost analysis of the compiled
training programs. Keeping every residual, each stage's backward costs about twice its forward (the
backward never runs the forward again; measured 1.55, 1.95 and 2.02 for the three stages below);
recomputing the stage, or each layer, about three times (2.93 and 2.81 on the first LLM stage)."""

import jax.numpy as jnp
import pytest

from dflop_jax.contracts import BucketSet
from dflop_jax.costs.layout import Layout, StageSpec
from dflop_jax.profiling.model_config import model_config_for_arch
from dflop_jax.profiling.stage_report import stage_flops

CFG = model_config_for_arch("tiny", "float32")  # the demo model's architecture
LAYOUT = Layout(
    (StageSpec("encoder", 0, 2, tp=1, dp=2, has_embedding=True, has_head=True),),
    (
        StageSpec("llm", 0, 2, tp=2, dp=1, has_embedding=True),
        StageSpec("llm", 2, 2, tp=1, dp=1, has_head=True),
    ),
)
BUCKETS = BucketSet((2,), (64, 128))  # summed over both length buckets


def test_backward_from_all_residuals_costs_at_most_2_2_forwards():
    got = stage_flops(LAYOUT, BUCKETS, CFG, ["all"] * 3, compute_dtype=jnp.float32)
    assert [s["residuals"] for s in got] == ["all"] * 3
    for s in got:
        assert s["flops_forward"] > 0
        assert s["flops_backward"] <= 2.2 * s["flops_forward"], s


@pytest.mark.parametrize("policy", ["recompute", "layers"])
def test_a_backward_that_runs_the_forward_again_costs_more(policy):
    got = stage_flops(LAYOUT, BucketSet((2,), (64,)), CFG, [policy] * 3, compute_dtype=jnp.float32)
    llm0 = got[1]  # an inner LLM stage: the layers rebuilt in the backward
    assert 2.6 * llm0["flops_forward"] <= llm0["flops_backward"] <= 4.0 * llm0["flops_forward"]
