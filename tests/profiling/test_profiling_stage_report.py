"""The dry run's per-stage FLOPs (`profiling/stage_report.py`): XLA's cost analysis of the compiled
training programs at the largest buckets, scaled to the others by the cost model. Keeping every
residual, each stage's backward costs about twice its forward (the backward never runs the forward
again); recomputing the stage, or each layer, about three times. The scaled sum over two length
buckets stays near the per-bucket compiled counts it replaces."""

import jax.numpy as jnp
import pytest

from dflop_jax.contracts import BucketSet
from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.costs import arch_of_model
from dflop_jax.profiling.compile_check import check_layout
from dflop_jax.profiling.stage_report import stage_flops
from dflop_jax.programs.model_section import model_config_for_arch

CFG = model_config_for_arch("tiny", "float32")  # the demo model's architecture
ARCH = arch_of_model(CFG)
LAYOUT = Layout(
    (StageSpec("encoder", 0, 2, tp=1, dp=2, has_embedding=True, has_head=True),),
    (
        StageSpec("llm", 0, 2, tp=2, dp=1, has_embedding=True),
        StageSpec("llm", 2, 2, tp=1, dp=1, has_head=True),
    ),
)


def _flops(buckets: BucketSet, policy: str) -> list[dict]:
    checks = check_layout(LAYOUT, buckets, [1, 1, 1], [1.0] * 3, CFG, compute_dtype=jnp.float32,
                          residuals=[policy] * 3)  # fmt: skip
    return stage_flops(LAYOUT, buckets, ARCH, checks)


def test_backward_from_all_residuals_costs_at_most_2_2_forwards():
    got = _flops(BucketSet((2,), (64,)), "all")
    assert [s["residuals"] for s in got] == ["all"] * 3
    for s in got:
        assert s["flops_forward"] > 0
        assert s["flops_backward"] <= 2.2 * s["flops_forward"], s


@pytest.mark.parametrize("policy", ["recompute", "layers"])
def test_a_backward_that_runs_the_forward_again_costs_more(policy):
    llm0 = _flops(BucketSet((2,), (64,)), policy)[1]  # an inner LLM stage: layers rebuilt
    assert 2.6 * llm0["flops_forward"] <= llm0["flops_backward"] <= 4.0 * llm0["flops_forward"]


def test_scaled_flops_match_compiling_every_bucket():
    """Two length buckets: the count compiled at 128 tokens and scaled to 64 by the cost model
    against compiling both (the LLM stages run both; the encoder stage its one tile bucket)."""
    both = _flops(BucketSet((2,), (64, 128)), "all")
    each = [_flops(BucketSet((2,), (n,)), "all") for n in (64, 128)]
    for i in (1, 2):
        for key in ("flops_forward", "flops_backward"):
            compiled = sum(e[i][key] for e in each)
            assert both[i][key] == pytest.approx(compiled, rel=0.1), (i, key)
    assert both[0]["flops_forward"] == each[0][0]["flops_forward"]  # one tile bucket, run once
