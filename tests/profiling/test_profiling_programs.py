"""The profiled program is the trained program: for an encoder stage, the first, a middle and the last
LLM stage, the model profiler's programs (`profiling/programs.py`) lower to the same StableHLO as the
programs the runtime trains (`programs/stage_builder.py`), fed as the pipeline feeds them: the data
layer's packed microbatch and the previous stage's actual output. Built on the tiny arch in bf16 (as
training computes) with an odd vocabulary, so tp=2 must replicate the vocab axis on both sides."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dflop_jax.contracts import ScheduledMicrobatch
from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.data.packing import pack_microbatch
from dflop_jax.data.sample_arrays import FEATURE_TAPS
from dflop_jax.profiling.programs import StageShape, build_program, profile_mesh, stage_program
from dflop_jax.programs.accumulator import accumulator_structs
from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.programs.model_section import model_config_for_arch
from dflop_jax.programs.stage_builder import build_stages

TINY = model_config_for_arch("tiny", "bfloat16")
CFG = dataclasses.replace(TINY, text=TINY.text.replace(vocab_size=511))
DTYPE = jnp.bfloat16
S = 64  # LLM length bucket
T = S // (2 * CFG.tokens_per_tile)  # encoder tile bucket = the profiler's feature tiles at S
LAYOUT = Layout(
    (
        StageSpec("encoder", 0, 1, tp=1, has_embedding=True),
        StageSpec("encoder", 1, 1, tp=1, has_head=True),
    ),
    (
        StageSpec("llm", 0, 1, tp=2, has_embedding=True),
        StageSpec("llm", 1, 2, tp=2),
        StageSpec("llm", 3, 1, tp=2, has_head=True),
    ),
)


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def _normalized(lowered) -> str:
    """StableHLO text without names: module name, source locations, result and argument labels."""
    text = lowered.as_text()
    text = re.sub(r"module @\S+", "module", text)
    text = re.sub(r"\s*loc\([^)]*\)", "", text)
    return re.sub(r'jax\.(result|arg)_info = "[^"]*",?\s*', "", text)


@pytest.fixture(scope="module")
def trained():
    """Per stage: (spec, abstract runtime args of its forward and of its backward / fused last step)."""
    stages = build_stages(CFG, LAYOUT, stage_meshes(LAYOUT), 0, compute_dtype=DTYPE)
    v = CFG.vision
    mb, _ = pack_microbatch(ScheduledMicrobatch(T, S, ((),)), [], [], encoder_dp=1, llm_dp=1,
                            tile_shape=(v.image_size, v.image_size, v.num_channels),
                            tokens_per_tile=CFG.tokens_per_tile, feature_taps=FEATURE_TAPS)  # fmt: skip
    batch = dataclasses.asdict(mb)
    out, y = [], None
    for spec, stage in zip(LAYOUT.stages, stages):
        params, side = _abstract(stage.compute_params), _abstract(stage.put_side(batch))
        x = None if y is None else jax.ShapeDtypeStruct(y.shape, y.dtype, sharding=stage.x_sharding)
        with jax.set_mesh(stage.mesh):
            if stage.is_last:
                seed = jax.ShapeDtypeStruct(
                    (), jnp.float32, sharding=NamedSharding(stage.mesh, P())
                )
            else:
                y = jax.eval_shape(stage.jits.forward, params, x, side)
                seed = jax.ShapeDtypeStruct(y.shape, y.dtype, sharding=stage.y_sharding)
        gacc = accumulator_structs(params)
        out.append((spec, stage, (params, x, side), (params, x, side, seed, gacc)))
    return out


def _profiled(spec: StageSpec):
    shape = StageShape(spec.module, spec.num_layers, spec.has_embedding, spec.has_head)
    bucket = T if spec.module == "encoder" else S
    prog = build_program(CFG, shape, spec.tp, bucket, jax.devices(), DTYPE)
    fwd_args = (prog.params_abs, prog.x_abs, prog.side_abs)
    return prog, fwd_args, (*fwd_args, prog.seed_abs, prog.gacc_abs)


def _lower(mesh, program, args):
    with jax.set_mesh(mesh):
        return program.lower(*args)


@pytest.mark.parametrize(
    "index", range(5), ids=["encoder_first", "encoder_last", "llm_first", "llm_middle", "llm_last"]
)
def test_profiled_programs_lower_to_the_trained_ones(trained, index):
    spec, stage, fwd_args, bwd_args = trained[index]
    prog, prof_fwd, prof_bwd = _profiled(spec)
    train_bwd = stage.jits.last if stage.is_last else stage.jits.backward
    assert _normalized(_lower(prog.mesh, prog.bwd, prof_bwd)) == _normalized(
        _lower(stage.mesh, train_bwd, bwd_args)
    )
    assert _normalized(_lower(prog.mesh, prog.fwd, prof_fwd)) == _normalized(
        _lower(stage.mesh, stage.jits.forward, fwd_args)
    )


def test_last_stage_costs_equal_and_a_changed_input_dtype_is_caught(trained):
    spec, stage, _, bwd_args = trained[-1]
    prog, _, prof_bwd = _profiled(spec)
    profiled = _lower(prog.mesh, prog.bwd, prof_bwd)
    trained_last = _lower(stage.mesh, stage.jits.last, bwd_args)

    def cost(lowered):
        c = lowered.compile().cost_analysis()
        return c["flops"], c["bytes accessed"]

    assert cost(profiled) == cost(trained_last)
    # the comparison sees input dtypes: an int32 loss mask (the old profiler's) lowers differently
    params, x, side, seed, gacc = bwd_args
    mask = side["loss_mask"]
    assert mask.dtype == jnp.float32  # what the data layer packs
    side = dict(side, loss_mask=jax.ShapeDtypeStruct(mask.shape, jnp.int32, sharding=mask.sharding))
    int_mask = _lower(stage.mesh, stage.jits.last, (params, x, side, seed, gacc))
    assert _normalized(int_mask) != _normalized(profiled)


def test_profiled_colocated_stage_lowers_to_the_trained_one():
    """The colocated stage (`ColocatedStage`: ViT + projector + the first LLM layer in
    one program, tiles packed by row): the profiler's program (`stage_program(..., tile_bucket=T)`,
    what the colocated_embedding entries and the compile check build) is the trainer's LLM stage 0
    of a layout without encoder stages, forward and backward, fed the packer's colocated microbatch."""
    coloc = Layout((), (StageSpec("llm", 0, 1, tp=2, has_embedding=True),
                        StageSpec("llm", 1, 3, tp=2, has_head=True)))  # fmt: skip
    stage = build_stages(CFG, coloc, stage_meshes(coloc), 0, compute_dtype=DTYPE)[0]
    v = CFG.vision
    mb, _ = pack_microbatch(ScheduledMicrobatch(T, S, ((),), tiles_by_row=True), [], [], encoder_dp=1,
                            llm_dp=1, tile_shape=(v.image_size, v.image_size, v.num_channels),
                            tokens_per_tile=CFG.tokens_per_tile, feature_taps=FEATURE_TAPS)  # fmt: skip
    params, side = (
        _abstract(stage.compute_params),
        _abstract(stage.put_side(dataclasses.asdict(mb))),
    )
    with jax.set_mesh(stage.mesh):
        y = jax.eval_shape(stage.jits.forward, params, None, side)
    seed = jax.ShapeDtypeStruct(y.shape, y.dtype, sharding=stage.y_sharding)
    prog = stage_program(CFG, coloc.stages[0], profile_mesh(jax.devices(), 2), S, DTYPE,
                         tile_bucket=T)  # fmt: skip
    assert prog.x_abs is None and "tiles" in prog.side_abs
    trained_bwd = (params, None, side, seed, accumulator_structs(params))
    profiled_bwd = (prog.params_abs, None, prog.side_abs, prog.seed_abs, prog.gacc_abs)
    assert _normalized(_lower(prog.mesh, prog.bwd, profiled_bwd)) == _normalized(
        _lower(stage.mesh, stage.jits.backward, trained_bwd)
    )
    assert _normalized(_lower(prog.mesh, prog.fwd, profiled_bwd[:3])) == _normalized(
        _lower(stage.mesh, stage.jits.forward, trained_bwd[:3])
    )


def test_measure_program_times_what_a_saving_stage_trains():
    """Under a saving policy the profiler compiles, costs and times the forward that keeps its
    residuals and the backward from them: that backward runs within 2.2 forwards of FLOPs, where the
    backward that recomputes the forward runs about 3."""
    from dflop_jax.contracts.profile_settings import ProfileSettings
    from dflop_jax.profiling.model_profiler import measure_program

    settings = ProfileSettings(tps=(1,), warmup=0, runs=1, memory_limit_bytes=2.0**60)
    measured = {}
    for policy in ("all", "recompute"):
        prog = build_program(CFG, StageShape("llm", 2), 1, S, jax.devices(), DTYPE,
                             residuals=policy)  # fmt: skip
        measured[policy] = measure_program(prog, settings)
    saving, recompute = measured["all"], measured["recompute"]
    assert saving["flops_bwd"] <= 2.2 * saving["flops_fwd"]
    assert recompute["flops_bwd"] >= 2.6 * recompute["flops_fwd"]
    assert saving["fwd_s"] > 0 and saving["bwd_s"] > 0
    # the residuals are the forward's outputs: its program writes them, the recompute one does not
    assert saving["memory_fwd"]["output"] > recompute["memory_fwd"]["output"]
