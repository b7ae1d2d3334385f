"""The data-blind baseline searches what a Megatron user would: padded encoder heads, remat on/off."""

import dataclasses

import pytest

from dflop_jax.costs import AnalyticCostProvider, get_arch, get_device, param_count
from dflop_jax.costs.architectures import pad_vision_heads
from dflop_jax.planner import PlannerConfig, PlanningError, make_plan
from dflop_jax.planner.variants import encoder_tp, plan_provider
from dflop_jax.scheduler import llava_ov_mix

H100 = get_device("h100")


def test_padded_heads_cost_exactly_the_dummy_heads_weights():
    arch = get_arch("internvit-6b+qwen2.5-7b")
    v, padded = arch.vision, pad_vision_heads(arch, 8).vision
    assert (padded.num_heads, padded.dh) == (32, v.dh) and pad_vision_heads(arch, 5) is arch
    # 7 dummy heads per layer: q, k, v columns and out-projection rows (no qkv bias), qk-norm weights
    extra = 7 * v.dh * (4 * v.hidden_size + 2)
    assert param_count(padded) - param_count(v) == v.num_layers * extra


@pytest.fixture(scope="module")
def intern6b_blind():
    """The issue's case: InternViT-6B + Qwen2.5-7B on 32 H100s, where the baseline found no layout
    ("needs 181.4 GiB per device on stage 0") while tp had to divide both 25 and 28 heads."""
    arch = get_arch("internvit-6b+qwen2.5-7b")
    provider = AnalyticCostProvider(arch, H100, remat=True)
    cfg = PlannerConfig(global_batch=128, samples=1, remat=(False, True))
    shapes = llava_ov_mix(500, 0)
    return (
        arch,
        provider,
        cfg,
        shapes,
        make_plan(arch, H100, 32, shapes, cfg, provider, mode="uniform"),
    )


def test_baseline_finds_a_layout_for_a_25_head_encoder_by_padding_heads(intern6b_blind):
    arch, provider, _, _, plan = intern6b_blind
    tp = encoder_tp(plan.layout)
    assert tp > 1 and not plan.layout.encoder_stages  # colocated, tensor-parallel
    heads = plan.search["encoder_heads"]
    assert heads % tp == 0 and 25 < heads < 25 + tp
    assert max(plan.stage_memory_bytes) <= plan.memory_capacity_bytes
    rebuilt = plan_provider(plan, provider)
    assert rebuilt.arch.vision.num_heads == heads and rebuilt.remat == plan.search["remat"]


def test_baseline_without_padding_or_remat_search_has_nothing_that_fits(intern6b_blind):
    """Without padding tp must divide 25 and 28 heads: tp 1 puts the whole 5.5B encoder's state on
    stage 0's devices, which no pipeline depth fits -- the issue's failure, reproduced on purpose."""
    arch, provider, cfg, shapes, _ = intern6b_blind

    class Measured:  # not analytic: no variants can be built, so no padding
        name, arch, device = "fixed", provider.arch, provider.device
        stage_time, stage_memory = provider.stage_time, provider.stage_memory
        transfer_time = provider.transfer_time

    plain = dataclasses.replace(cfg, remat=())
    with pytest.raises(PlanningError, match="no layout fits in memory"):
        make_plan(arch, H100, 32, shapes, plain, Measured(), mode="uniform")
    with pytest.raises(PlanningError, match="planner.remat.*analytic"):
        make_plan(arch, H100, 32, shapes, cfg, Measured(), mode="uniform")


def test_remat_is_chosen_per_layout_and_off_wins_where_it_fits():
    """A small model fits without remat, and remat only adds recompute: the search must pick it off
    and be faster than the remat-only search."""
    arch = get_arch("siglip-so400m+qwen2.5-0.5b")
    shapes = llava_ov_mix(300, 0)
    base = PlannerConfig(global_batch=32, samples=1, microbatches=(8,), llm_pp=(1, 2))
    remat_only = AnalyticCostProvider(arch, H100, remat=True)
    both = make_plan(arch, H100, 8, shapes, dataclasses.replace(base, remat=(False, True)), remat_only,
                     mode="uniform")  # fmt: skip
    forced = make_plan(arch, H100, 8, shapes, base, remat_only, mode="uniform")
    assert both.search["remat"] is False and forced.search["remat"] is None
    assert both.step_time_mean_s < forced.step_time_mean_s
    assert "+remat" not in both.cost_provider and "+remat" in forced.cost_provider
