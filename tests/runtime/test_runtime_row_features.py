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

from dflop_jax.costs.layout import Layout, StageSpec
from dflop_jax.profiling.programs import stage_program
from dflop_jax.runtime.mesh import stage_meshes
from models.decoder_config import DecoderConfig
from models.llava_onevision import llava_onevision_config
from models.siglip import SiglipConfig

TEXT = DecoderConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8,
)  # fmt: skip
VISION = SiglipConfig(
    hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, image_size=28, patch_size=7
)
DP, TP, ROW_TILES, S = 2, 2, 4, 32
FIRST = StageSpec("llm", 0, 1, tp=TP, dp=DP, has_embedding=True)
LAYOUT = Layout(
    (StageSpec("encoder", 0, 2, has_embedding=True, has_head=True),),
    (FIRST, StageSpec("llm", 1, 1, dp=DP, has_head=True)),
)
COLLECTIVE = r"= \w+\[([\d,]*)\][^ ]* (all-gather|all-reduce|reduce-scatter|all-to-all)\((.*)"


def _groups(text: str) -> list[tuple[int, ...]]:
    """An HLO op's replica groups: explicit ({{0,1},{2,3}}), iota ([2,2]<=[4], [2,2]<=[2,2]T(1,0))
    or over named axes of a device mesh (mesh['axis_0'=2,'axis_1'=2] {'axis_1'})."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", text)
    if mesh:
        axes = re.findall(r"'(\w+)'=(\d+)", mesh[1])
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        over = [names.index(a) for a in re.findall(r"'(\w+)'", mesh[2])]
        ids = np.arange(int(np.prod(sizes))).reshape(sizes)
        ids = ids.transpose([i for i in range(len(sizes)) if i not in over] + over)
        return sorted(
            tuple(g) for g in ids.reshape(-1, int(np.prod([sizes[i] for i in over]))).tolist()
        )
    explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)+)\}", text)
    if explicit:
        return sorted(
            tuple(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", explicit[1])
        )
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    assert iota, f"no replica groups in {text[:200]}"
    dims = [int(d) for d in iota[3].split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if iota[4]:
        ids = ids.transpose([int(p) for p in iota[4].split(",")])
    return sorted(tuple(g) for g in ids.reshape(int(iota[1]), int(iota[2])).tolist())


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
    cfg = llava_onevision_config(VISION, TEXT)
    mesh = stage_meshes(LAYOUT)[1]
    prog = stage_program(cfg, FIRST, mesh, S, jnp.float32, ROW_TILES)
    with jax.set_mesh(mesh):
        fwd = prog.fwd.lower(prog.params_abs, prog.x_abs, prog.side_abs).compile().as_text()
        bwd = prog.bwd.lower(
            prog.params_abs, prog.x_abs, prog.side_abs, prog.seed_abs, prog.gacc_abs
        ).compile()
    return cfg, prog, fwd, bwd.as_text()


def test_features_gather_over_model_only(program):
    cfg, prog, fwd, bwd = program
    whole = (DP * ROW_TILES, cfg.tokens_per_tile, TEXT.hidden_size)
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
