"""A stage's role under a training recipe is decided in one place, `costs.recipe.stage_role`: the
runtime's stage builder gives each stage program its role and takes from it whether the stage has a
backward program and whether its input gets a gradient; the parts a role names are the parts whose
parameters the built stage holds (`models.stage_modules.param_part`, which the trained-leaf masks follow)."""

import itertools

import jax
import jax.numpy as jnp
import pytest
import runtime_toy as toy
from pipeline_fixtures import (
    COLOCATED_LLAVA,
    MLLM_TEXT,
    SEPARATE_LAYOUT,
    SEPARATE_VISION,
    colocated_layout,
)

from dflop_jax.contracts.cost_table import TRAINABLE_PARTS
from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.costs.recipe import StageRole, stage_parts, stage_role
from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.programs.param_paths import param_labels
from dflop_jax.programs.stage_builder import abstract_stage, build_stages, colocated
from dflop_jax.programs.stage_program import StageProgram
from models.llava_onevision import llava_onevision_config

RECIPES = [c for n in (1, 2, 3) for c in itertools.combinations(TRAINABLE_PARTS, n)]
SEPARATE_CFG = llava_onevision_config(SEPARATE_VISION, MLLM_TEXT)
MODELS = {  # (model config, layout): encoder stages, the colocated encoder, a decoder-only model
    "separate": (SEPARATE_CFG, SEPARATE_LAYOUT),
    "colocated": (COLOCATED_LLAVA, colocated_layout(2, 2)),
    "decoder": (MLLM_TEXT, colocated_layout(2, 2)),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_role_parts_are_the_parts_the_stage_holds(name):
    model_cfg, layout = MODELS[name]
    coloc = colocated(model_cfg, layout)
    for i, (spec, mesh) in enumerate(zip(layout.stages, stage_meshes(layout))):
        bp = abstract_stage(model_cfg, spec, mesh, colocated=coloc and i == 0)
        held = set(jax.tree.leaves(param_labels(bp.state)))
        assert held == set(stage_parts(spec, coloc and i == 0)), (name, i, held)


def test_the_colocated_stage_role_is_its_one_program():
    """LLM stage 0 holding the encoder: all three parts, no stage input (its tiles need no
    gradient), so it trains under every recipe; as plain LLM stage 0 it would be dx-only under a
    projector-only recipe."""
    spec = colocated_layout(2, 2).stages[0]
    for trainable in RECIPES:
        role = stage_role(spec, trainable, True, colocated=True)
        assert role.kind == "train" and not role.input_grad
        assert set(role.trains) == set(trainable)
    assert stage_role(spec, ("projector",), True).kind == "dx"


def _build(model_cfg, layout, trainable):
    return build_stages(model_cfg, layout, stage_meshes(layout), 0, compute_dtype=jnp.float32,
                        trainable=trainable)  # fmt: skip


def test_build_stages_runs_each_stage_by_its_role():
    """The projector-only recipe on 2 encoder + 2 LLM stages has all three kinds; on the colocated
    layout the first stage trains the projector inside its one program."""
    trainable = ("projector",)
    stages = _build(SEPARATE_CFG, SEPARATE_LAYOUT, trainable)
    assert [s.role for s in stages] == [stage_role(s, trainable) for s in SEPARATE_LAYOUT.stages]
    assert [s.role.kind for s in stages] == ["forward", "train", "dx", "dx"]
    assert [s.has_backward for s in stages] == [False, True, True, True]
    assert stages[0].jits.backward is None and stages[1].jits.backward is not None
    assert [s.input_grad for s in stages] == [False, False, True, True]

    layout = colocated_layout(2, 2)
    stages = _build(COLOCATED_LLAVA, layout, trainable)
    assert stages[0].role == StageRole(("projector",), ("vision", "llm"), False)
    assert stages[1].role == stage_role(layout.stages[1], trainable)
    assert [s.role.kind for s in stages] == ["train", "dx"]
    assert [s.input_grad for s in stages] == [False, True]
    assert [s.trains for s in stages] == [True, False]


def test_a_role_without_backward_refuses_trained_parameters():
    layout = Layout((), (StageSpec("llm", 0, 1, has_embedding=True, has_head=True),))
    stage = toy.build_stages(layout, stage_meshes(layout))[0]
    frozen = StageRole((), ("llm",), False)
    with pytest.raises(ValueError, match="runs forward only but holds trained parameters"):
        StageProgram(stage.mesh, stage.fns, stage.params, role=frozen)
