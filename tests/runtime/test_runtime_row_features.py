"""Features once per LLM row, read from the compiled HLO: the first LLM stage of an MLLM at
llm dp 2 x tp 2 takes the encoder features [tiles, tokens_per_tile, D] split over its 4 devices and
gathers each row's block over that row's tp devices only ("model"), never over "data": every
collective on a features-shaped array in its forward and backward programs has replica groups of
size tp within one data row, and each device holds one row's features (1 / dp of the whole)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_fixtures import GROUPS, replica_groups
from models_fixtures import tiny_llava_ov_config

from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.profiling.programs import stage_program
from dflop_jax.programs.meshes import stage_meshes

CFG = tiny_llava_ov_config()
DP, TP, ROW_TILES, S = 2, 2, 4, 32
FIRST = StageSpec("llm", 0, 1, tp=TP, dp=DP, has_embedding=True)
LAYOUT = Layout(
    (StageSpec("encoder", 0, 2, has_embedding=True, has_head=True),),
    (FIRST, StageSpec("llm", 1, 1, dp=DP, has_head=True)),
)
COLLECTIVE = r"= \w+\[([\d,]*)\][^ ]* (all-gather|all-reduce|reduce-scatter|all-to-all)\((.*)"


def _groups(text: str) -> list[tuple[int, ...]]:
    """The replica groups of an HLO op's text, sorted (`hlo_fixtures.replica_groups`)."""
    found = re.search(rf"replica_groups=({GROUPS})", text)
    assert found, f"no replica groups in {text[:200]}"
    return sorted(tuple(g) for g in replica_groups(found[1]))


def _feature_collectives(hlo: str, feature_dims: tuple[int, int]) -> list[tuple[str, tuple, list]]:
    """(op, result shape, replica groups) of every collective whose result ends in `feature_dims`."""
    out = []
    for m in re.finditer(COLLECTIVE, hlo):
        shape = tuple(int(d) for d in m[1].split(",") if d)
        if shape[-2:] == feature_dims:
            out.append((m[2], shape, _groups(m[3])))
    return out


@pytest.fixture(scope="module")
def program():
    mesh = stage_meshes(LAYOUT)[1]
    prog = stage_program(CFG, FIRST, mesh, S, jnp.float32, ROW_TILES)
    with jax.set_mesh(mesh):
        fwd = prog.fwd.lower(prog.params_abs, prog.x_abs, prog.side_abs).compile().as_text()
        bwd = prog.bwd.lower(
            prog.params_abs, prog.x_abs, prog.side_abs, prog.seed_abs, prog.gacc_abs
        ).compile()
    return prog, fwd, bwd.as_text()


def test_features_gather_over_model_only(program):
    prog, fwd, bwd = program
    whole = (DP * ROW_TILES, CFG.tokens_per_tile, CFG.text.hidden_size)
    x = prog.x_abs
    assert x.shape == whole  # one copy of every row's block, no end padding
    assert x.sharding.shard_shape(x.shape) == (ROW_TILES // TP, *whole[1:])  # 1 / (dp x tp)
    model_rows = sorted(tuple(r) for r in np.arange(DP * TP).reshape(DP, TP).tolist())
    for hlo in (fwd, bwd):
        ops = _feature_collectives(hlo, whole[1:])
        gathers = [shape for op, shape, _ in ops if op == "all-gather"]
        # each device gathers its own row's block: 1 / dp of the whole features
        assert gathers == [(ROW_TILES, *whole[1:])]
        for op, shape, groups in ops:
            assert groups == model_rows, f"{op} {shape} over {groups}: not within a data row"


def test_a_global_gather_would_be_caught():
    """The checker itself: the groups of a gather over every device, and over "data", differ from
    the "model" rows the test wants."""
    line = "%ag = f32[8,16,32]{2,1,0} all-gather(%p), replica_groups=[1,4]<=[4], dimensions={0}"
    ops = _feature_collectives(line, (16, 32))
    assert ops == [("all-gather", (8, 16, 32), [(0, 1, 2, 3)])]
    assert _groups("replica_groups=[2,2]<=[2,2]T(1,0)") == [(0, 2), (1, 3)]
    assert _groups("replica_groups={{0,1},{2,3}}") == [(0, 1), (2, 3)]
    assert _groups("replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_0'}") == [(0, 2), (1, 3)]
    assert _groups("replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}") == [(0, 1, 2, 3)]


def test_pooled_features_gather_the_whole_pool_over_every_device():
    """Tiles pooled (`Layout.pooled_tiles`): the same features arrive split over the 4 devices, and
    the forward program gathers the whole pool onto every device, over "data" and "model" both
    (the one features-shaped gather), where the by-row program gathers a row's block over its tp
    devices only."""
    mesh = stage_meshes(LAYOUT)[1]
    prog = stage_program(CFG, FIRST, mesh, S, jnp.float32, ROW_TILES, pooled=True)
    with jax.set_mesh(mesh):
        fwd = prog.fwd.lower(prog.params_abs, prog.x_abs, prog.side_abs).compile().as_text()
    whole = (DP * ROW_TILES, CFG.tokens_per_tile, CFG.text.hidden_size)
    assert prog.x_abs.shape == whole
    assert prog.x_abs.sharding.shard_shape(whole) == (ROW_TILES // TP, *whole[1:])
    ops = _feature_collectives(fwd, whole[1:])
    assert [(op, shape, groups) for op, shape, groups in ops if op == "all-gather"] == [
        ("all-gather", whole, [tuple(range(DP * TP))])
    ]
