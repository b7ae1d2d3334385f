"""Frozen-aware costs: stage roles, memory terms against hand-computed values, the
recipe's times, the simulator's forward-only prefix, and the planner's prediction under a recipe."""

import dataclasses

import numpy as np
import pytest

from dflop_jax.config import ConfigError, load_config
from dflop_jax.costs import (
    AnalyticCostProvider,
    StageSpec,
    get_arch,
    get_device,
    llm_layer_params,
    projector_params,
    vision_activation_bytes_per_token,
    vision_layer_params,
)
from dflop_jax.costs.flops import vision_embedding_params
from dflop_jax.costs.recipe import DX_FRACTION, stage_role
from dflop_jax.planner import PlannerConfig, make_plan
from dflop_jax.scheduler import llava_ov_mix
from dflop_jax.sim.pipeline import simulate

ARCH = get_arch("siglip-so400m+qwen2.5-7b")
H100 = get_device("h100")
ALL = ("vision", "projector", "llm")
ENC_BODY = StageSpec("encoder", 0, 13, tp=1, dp=4, has_embedding=True)  # frozen encoder stage
ENC_FULL = StageSpec("encoder", 0, 26, tp=1, dp=4, has_embedding=True, has_head=True)
LLM_MID = StageSpec("llm", 7, 7, tp=1, dp=2)


def test_roles_follow_the_pipeline_order():
    assert stage_role(ENC_BODY, ("projector", "llm")).kind == "forward"
    assert stage_role(ENC_BODY, ALL).kind == "train"
    tail = StageSpec("encoder", 13, 13, has_head=True)
    assert stage_role(tail, ("vision",)).kind == "train"  # holds vision layers
    assert stage_role(tail, ("llm",)).kind == "forward"
    assert stage_role(tail, ("projector",)).head_only
    assert not stage_role(tail, ("vision", "projector")).head_only
    assert stage_role(LLM_MID, ("projector",)).kind == "dx"  # a trained part lies before it
    assert stage_role(LLM_MID, ("vision",)).kind == "dx"
    # decoder-only: nothing before the first LLM stage
    first = StageSpec("llm", 0, 7, has_embedding=True)
    assert stage_role(first, ("llm",), multimodal=False).input_grad is False


def test_audio_roles_follow_the_branches():
    """An audio stage is an encoder branch (tower "vision", head "projector"); an omni model's
    first LLM stage holding the audio encoder holds every part, and one taking the audio stages'
    features passes dL/dx back to them when they train, also when the vision encoder is
    colocated there (its one input is then the audio branch's)."""
    audio = StageSpec("audio", 0, 32, has_embedding=True, has_head=True)
    assert stage_role(audio, ("projector",)).head_only
    assert stage_role(audio, ("llm",)).kind == "forward"
    first = StageSpec("llm", 0, 7, has_embedding=True)
    holding = stage_role(first, ("projector",), audio=True)
    assert holding.trains == ("projector",) and holding.input_grad  # the vision projector trains
    assert stage_role(first, ("projector",), colocated=True).input_grad is False
    taking = stage_role(first, ("projector",), colocated=True, audio_x=True)
    assert taking.kind == "train" and taking.input_grad  # its vision projector; dx to the audio
    assert stage_role(first, ("projector",), audio_x=True).kind == "dx"
    assert stage_role(first, ("llm",), colocated=True, audio_x=True).input_grad is False


def test_frozen_encoder_stage_memory_by_hand():
    """A forward-only encoder stage: fp32 params and their bf16 copies only, no accumulator, no
    optimizer state, no stage input kept; its transient is one layer's activations (its tiles'
    attention squares included: 729-token tiles run dense), the tiles and the patch pixels (the
    program reads the resident weight copies)."""
    tiles, v = 16, ARCH.vision
    n = 13 * vision_layer_params(v) + vision_embedding_params(v)
    frozen = AnalyticCostProvider(ARCH, H100, trainable=("projector", "llm"))
    m = frozen.stage_memory(ENC_BODY, tiles)
    assert (m.params, m.grads, m.optimizer, m.activations_per_microbatch) == (
        pytest.approx((4 + 2) * n),
        0.0,
        0.0,
        0.0,
    )
    one_layer = vision_activation_bytes_per_token(v, 1, False, 2) * tiles * v.seq_len
    one_layer += tiles * v.num_heads * v.seq_len**2 * (4 + 2)  # a 729-token tile's dense square
    pixels = tiles * v.patches_per_tile * 3 * v.patch_size**2 * 2
    packed = tiles * v.image_size**2 * 3
    assert m.temp == pytest.approx(one_layer + pixels + packed)
    trained = AnalyticCostProvider(ARCH, H100).stage_memory(ENC_BODY, tiles)
    assert trained.grads == pytest.approx(4 * n)
    assert trained.optimizer == pytest.approx(8 * n / 4)  # ZeRO-1 over dp = 4
    assert trained.activations_per_microbatch == packed


def test_dx_only_and_projector_only_memory_by_hand():
    tokens = 8192
    n = 7 * llm_layer_params(ARCH.llm)
    full = AnalyticCostProvider(ARCH, H100).stage_memory(LLM_MID, tokens)
    dx = AnalyticCostProvider(ARCH, H100, trainable=("projector",)).stage_memory(LLM_MID, tokens)
    assert (dx.grads, dx.optimizer) == (0.0, 0.0) and dx.params == pytest.approx((4 + 2) * n)
    # same residuals, input and gradients of x; the weights' bf16 gradient and its fp32 form go
    assert dx.activations_per_microbatch == full.activations_per_microbatch
    assert full.temp - dx.temp == pytest.approx(n * (2 + 4))
    head = AnalyticCostProvider(ARCH, H100, trainable=("projector",)).stage_memory(ENC_FULL, 4)
    proj = projector_params(ARCH.projector)
    assert head.grads == pytest.approx(4 * proj)
    assert head.optimizer == pytest.approx(8 * proj / 4)


def test_a_frozen_token_embedding_holds_no_copy_by_hand():
    """The first LLM stage under projector-only: every frozen parameter keeps its fp32 master and
    bf16 copy but the token embedding, which only its gather reads (its programs take the master).
    Trained, the embedding keeps its copy; the untied LM head, which a dot reads, keeps it frozen
    too."""
    first = StageSpec("llm", 0, 7, tp=2, dp=2, has_embedding=True)
    last = StageSpec("llm", 21, 7, tp=2, dp=2, has_head=True)
    embed = ARCH.llm.vocab_size * ARCH.llm.hidden_size / 2  # vocab-parallel over tp 2
    frozen = AnalyticCostProvider(ARCH, H100, trainable=("projector",))
    trained = AnalyticCostProvider(ARCH, H100)
    n = trained.stage_memory(first, 4096).params / (4 + 2)  # every parameter: master and copy
    assert n > embed + 7 * llm_layer_params(ARCH.llm) / 2
    assert frozen.stage_memory(first, 4096).params == pytest.approx((4 + 2) * n - 2 * embed)
    assert frozen.stage_memory(last, 4096).params == pytest.approx(
        trained.stage_memory(last, 4096).params
    )


def test_recipe_times():
    all_ = AnalyticCostProvider(ARCH, H100)
    proj = AnalyticCostProvider(ARCH, H100, trainable=("projector",))
    vfrozen = AnalyticCostProvider(ARCH, H100, trainable=("projector", "llm"))
    f, b = all_.stage_time(LLM_MID, 8192)
    assert proj.stage_time(LLM_MID, 8192) == pytest.approx((f, DX_FRACTION * b))
    assert vfrozen.stage_time(LLM_MID, 8192) == pytest.approx((f, b))
    fe, _ = all_.stage_time(ENC_BODY, 16)
    assert vfrozen.stage_time(ENC_BODY, 16) == (fe, 0.0)
    # projector-only encoder stage: recompute the frozen layers, back-propagate the projector only
    head_spec = StageSpec("encoder", 0, 0, tp=1, has_head=True)
    hf, hb = all_.stage_time(head_spec, 16)
    ff, fb = all_.stage_time(ENC_FULL, 16)
    assert proj.stage_time(ENC_FULL, 16) == pytest.approx((ff, ff - hf + hb))
    assert proj.stage_time(ENC_FULL, 16)[1] < fb


def test_forward_only_prefix_leaves_the_backward_wave():
    """Uniform f = b = 1, P = 4, M = 8, stage 0 forward only: stage 0 streams its forwards (F(k) ends
    at k + 1) and stages 1..3 are a plain 3-stage 1F1B pipeline fed from t = 1:
    1 + (M + 3 - 1) (f + b)."""
    times = np.ones((8, 4, 2))
    times[:, 0, 1] = 0.0
    res = simulate(times)
    assert res.step_time == pytest.approx(1 + (8 + 3 - 1) * 2)
    assert res.peak_in_flight() == [0, 3, 2, 1]
    assert [e.kind for e in res.events[0]] == ["F"] * 8


SMALL = PlannerConfig(
    tp=(1,),
    encoder_pp=(1,),
    llm_pp=(1,),
    microbatches=(8,),
    colocate=False,
    num_buckets=(2,),
    samples=1,
    global_batch=32,
)


def test_projector_only_plan_is_faster_on_the_same_layout():
    shapes = llava_ov_mix(400, 0)
    arch = get_arch("siglip-so400m+qwen2.5-0.5b")  # fits one H100 per module at tp 1
    remat = AnalyticCostProvider(arch, H100, remat=True)
    full = make_plan(arch, H100, 2, shapes, SMALL, remat)
    projector_only = dataclasses.replace(SMALL, trainable=("projector",))
    proj = make_plan(arch, H100, 2, shapes, projector_only, remat)
    assert proj.layout == full.layout and proj.microbatches == full.microbatches
    assert proj.step_time_mean_s < full.step_time_mean_s
    assert proj.cost_provider.endswith("+train:projector")
    llm_stage = full.layout.num_stages - 1  # no optimizer state, no accumulator for the frozen LLM
    assert proj.stage_memory_bytes[llm_stage] < full.stage_memory_bytes[llm_stage]


@pytest.mark.parametrize("value", ["[vision,bogus]", "[]", "[llm,llm]"])
def test_bad_trainable_is_a_one_line_config_error(value):
    from dflop_jax.runtime.config import TrainConfig

    with pytest.raises(ConfigError, match="planner.trainable") as err:
        load_config(TrainConfig, None, [f"planner.trainable={value}"])
    assert "\n" not in str(err.value)


def test_training_planner_takes_the_optimizer_recipe_and_replay_keeps_it():
    from dflop_jax.planner.replay import provider_for
    from dflop_jax.planner.resolve import training_planner

    planner = training_planner(PlannerConfig(), 64, True, ("projector",))
    assert planner.trainable == ("projector",) and planner.global_batch == 64
    assert training_planner(PlannerConfig(), 64, True).trainable == ALL
    shapes = llava_ov_mix(200, 0)
    arch = get_arch("siglip-so400m+qwen2.5-0.5b")
    remat = AnalyticCostProvider(arch, H100, remat=True)
    plan = make_plan(
        arch, H100, 2, shapes, dataclasses.replace(SMALL, trainable=("projector",)), remat
    )
    replayed = provider_for(plan)
    assert replayed.trainable == ("projector",) and replayed.policy["llm"] == "full"
    assert replayed.name == plan.cost_provider


def test_schedule_costs_of_a_frozen_encoder_layout():
    """The scheduler's stage costs (layout_stage_costs) under vision frozen: the separate encoder
    stages cost their forward only, the LLM stages their full training step."""
    from dflop_jax.costs import Layout, layout_stage_costs

    enc = (
        StageSpec("encoder", 0, 13, tp=1, dp=2, has_embedding=True),
        StageSpec("encoder", 13, 13, tp=1, dp=2, has_head=True),
    )
    lay = Layout(enc, (StageSpec("llm", 0, 28, tp=4, dp=2, has_embedding=True, has_head=True),))
    full = layout_stage_costs(AnalyticCostProvider(ARCH, H100), lay)(8, 8192)
    frozen = layout_stage_costs(
        AnalyticCostProvider(ARCH, H100, trainable=("projector", "llm")), lay
    )(8, 8192)
    assert frozen[0, 1] == 0.0 and frozen[0, 0] == full[0, 0]  # forward only
    assert 0.0 < frozen[1, 1] < full[1, 1]  # projector-only head stage
    np.testing.assert_array_equal(frozen[2], full[2])
