"""`plan --check`: every stage of a plan compiled at its real sizes from abstract arrays; the compiled
memory written to plan.yaml equals `memory_analysis()` of the same programs plus the state and inputs
the runtime holds beside them; a gross disagreement with the prediction warns."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx
from plan_fixtures import TINY_PLAN_BUCKETS, TINY_PLAN_LAYOUT, TINY_PLAN_MAX_M, tiny_analytic_plan

from dflop_jax.contracts import BucketSet
from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.costs import AnalyticCostProvider, get_arch, get_device, layout_memory
from dflop_jax.planner import load_plan, save_plan
from dflop_jax.planner.plan_file import StageCheck
from dflop_jax.planner.scoring import in_flight
from dflop_jax.profiling.compile_check import (
    DISAGREE,
    check_layout,
    check_plan,
    warn_disagreements,
)
from dflop_jax.profiling.programs import per_device_bytes, stage_program
from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.programs.model_section import model_config_for_arch
from dflop_jax.programs.stage_builder import abstract_stage, build_stages, stage_module

CFG = model_config_for_arch("tiny", "bfloat16")


def _memory_analysis_bytes(spec, mesh, bucket, features) -> float:
    """arguments + outputs - aliased + temporaries of the stage's training program, compiled here."""
    prog = stage_program(CFG, spec, mesh, bucket, jnp.bfloat16, features)
    with jax.set_mesh(mesh):
        m = (
            prog.bwd.lower(prog.params_abs, prog.x_abs, prog.side_abs, prog.seed_abs, prog.gacc_abs)
            .compile()
            .memory_analysis()
        )
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )


def _param_count(spec) -> int:
    module = nnx.eval_shape(lambda: stage_module(CFG, spec, nnx.Rngs(0)))
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(nnx.state(module, nnx.Param)))


def test_check_writes_compiled_memory_of_every_stage(tmp_path):
    plan = dataclasses.replace(
        tiny_analytic_plan(), checks=tuple(check_plan(tiny_analytic_plan(), CFG))
    )
    path = save_plan(plan, tmp_path / "plan.yaml")
    text = path.read_text()
    assert text.count("compiled_memory_gib:") == TINY_PLAN_LAYOUT.num_stages
    rounded = [dataclasses.replace(c, compile_s=round(c.compile_s, 1)) for c in plan.checks]
    assert list(load_plan(path).checks) == rounded

    meshes = stage_meshes(TINY_PLAN_LAYOUT, jax.devices())
    # tiles packed by row: the one row's 3 tiles pad to a block of 4 (LLM tp 2), which the
    # encoder's 2 shards split, 2 tiles each; the LLM stage takes the row's 4 tiles' features
    features, encoder_tiles = 4, 2
    for check, spec, mesh in zip(plan.checks, TINY_PLAN_LAYOUT.stages, meshes):
        bucket = encoder_tiles if spec.module == "encoder" else TINY_PLAN_BUCKETS.lengths[-1]
        feats = features if spec.module == "llm" and spec.has_embedding else None
        program = _memory_analysis_bytes(spec, mesh, bucket, feats)
        assert check.program_bytes == (program,)
        # fp32 master weights: 4 B per parameter, matrices split over tp (norms replicated), and
        # their bf16 copies (2 B), which the programs take
        n = _param_count(spec)
        masters = check.grads  # each device: its data replica's accumulator, as large
        assert 4 * n / spec.tp <= masters <= 4 * n
        assert check.params == pytest.approx(masters * (4 + 2) / 4)
        # ZeRO-1: the Adam moments sharded over dp, but for leaves no axis of which divides
        assert 2 * masters / spec.dp <= check.optimizer <= 2 * masters
        if spec.dp > 1:
            assert check.optimizer < 0.6 * 2 * masters
        assert check.in_flight == min(TINY_PLAN_LAYOUT.num_stages - check.stage, TINY_PLAN_MAX_M)
        per_microbatch = check.inputs / check.in_flight
        # the runtime holds: the program's peak (the copies among its arguments), the masters, the
        # Adam moments, the other in-flight inputs
        assert check.total == pytest.approx(
            program + masters + check.optimizer + (check.in_flight - 1) * per_microbatch
        )
        assert check.compile_s > 0


def test_colocated_stage_is_compiled_as_the_one_program_that_trains():
    """A layout without encoder stages: stage 0 is ONE program, the runtime's colocated stage
    (`init_stage(..., colocated=True)`): its parameters are the trainer's stage-0 params (the whole
    encoder and the LLM layers), and its compiled bytes are those of the colocated program at the largest
    (tile, length) buckets."""
    layout = Layout((), (StageSpec("llm", 0, 4, tp=2, dp=2, has_embedding=True, has_head=True),))
    (check,) = check_plan(tiny_analytic_plan(layout), CFG)
    assert check.parts == ("encoder+llm",)
    mesh = stage_meshes(layout, jax.devices())[0]
    spec = layout.stages[0]
    trained = build_stages(CFG, layout, [mesh], 0)[0]  # what the trainer holds on stage 0
    assert check.params == per_device_bytes(trained.params) + per_device_bytes(
        trained.compute_params
    )  # the fp32 masters and their bf16 copies
    enc = StageSpec("encoder", 0, 2, tp=2, dp=2, has_embedding=True, has_head=True)
    assert check.params > per_device_bytes(abstract_stage(CFG, spec, mesh).state)
    assert check.params > per_device_bytes(abstract_stage(CFG, enc, mesh).state)
    prog = stage_program(CFG, spec, mesh, TINY_PLAN_BUCKETS.lengths[-1], jnp.bfloat16,
                         tile_bucket=TINY_PLAN_BUCKETS.tiles[-1])  # fmt: skip
    assert "tiles" in prog.side_abs and prog.x_abs is None  # it encodes its own tiles
    assert prog.side_abs["tiles"].shape[0] == spec.dp * TINY_PLAN_BUCKETS.tiles[-1]
    with jax.set_mesh(mesh):
        m = prog.bwd.lower(prog.params_abs, prog.x_abs, prog.side_abs, prog.seed_abs,
                           prog.gacc_abs).compile().memory_analysis()  # fmt: skip
    program = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
               + m.temp_size_in_bytes)  # fmt: skip
    assert check.program_bytes == (program,)


def test_colocated_check_refuses_what_the_runtime_refuses():
    """A colocated encoder at its own tp (the runtime runs it at the stage's): the same error."""
    layout = Layout((), (StageSpec("llm", 0, 4, tp=2, dp=2, has_embedding=True, has_head=True),),
                    colocated_encoder_tp=1)  # fmt: skip
    with pytest.raises(ValueError, match="colocated_encoder_tp=1"):
        check_plan(tiny_analytic_plan(layout), CFG)


def test_gross_disagreement_warns(caplog):
    checks = [
        StageCheck(i, ("llm",), (3.0,), 1.0, 1.0, 2.0, 1.0, 1.0, 1, 0.1) for i in range(3)
    ]  # 6 bytes each
    with caplog.at_level(logging.WARNING, logger="dflop_jax.profiling.compile_check"):
        assert warn_disagreements(checks, [6.0, 6.8, 5.3]) == []
        assert warn_disagreements(checks, [6.0, 7.2, 2.0]) == [1, 2]
    assert len(caplog.records) == 2 and "stage 2: compiled" in caplog.records[1].message


def test_train_dry_run_compiles_every_stage_of_the_run(tmp_path, capsys):
    from dflop_jax.train import main

    args = ["--dry-run", "plan=explicit", f"run_dir={tmp_path}", "layout.tiles=[2]",
            "layout.lengths=[128]", "model.llm_remat=full"]  # fmt: skip
    assert main(args) == 0
    report = yaml.safe_load((tmp_path / "dry_run.yaml").read_text())
    stages = report["layout"]
    assert len(stages) == 4  # the default explicit layout: 2 encoder + 2 LLM stages
    boundaries = report["transfers"]  # values: tests/runtime/test_runtime_transfer_bytes.py
    assert [t["stage"] for t in boundaries] == [0, 1, 2]
    assert all(t["forward_bytes"] > 0 and t["backward_bytes"] > 0 for t in boundaries)
    # the tiny model fits the default device with every residual kept ("auto" picks "all")
    assert [s["residuals"] for s in stages] == ["all"] * 4
    for s in stages:
        assert 0 < s["flops_forward"] < s["flops_backward"]
        c = s["compiled"]
        # the residual term describes the stage's policy: kept per in-flight microbatch by a
        # saving inner stage, nothing under "recompute" (the last stage's fused program keeps none)
        saves = s["residuals"] != "recompute" and s["stage"] < len(stages) - 1
        assert (c["residuals"] > 0) == saves, s
        terms = (c["params"] + c["grads"] + c["optimizer"] + c["inputs"] + c["residuals"]
                 + c["transient"])  # fmt: skip
        assert s["compiled_memory_gib"] == round(terms / 2**30, 2)
        assert c["program_bytes"][0] > c["params"] + c["grads"]  # + inputs and temporaries
    out = capsys.readouterr()
    assert "compiled" in out.out
    assert out.out.index("plan:\n  stage 0: encoder") < out.out.index("stage 0 (encoder)")
    assert report["flops"].startswith("compiled at the largest buckets, scaled")
    # progress on stderr (not a terminal here: lines, as a batch job's log shows them); the four
    # stages are four kinds (embedding, head, first LLM, last LLM): four compiles
    assert "memory check: compiling stage programs: 4/4 (" in out.err


SAVING_LAYOUT = Layout(
    (StageSpec("encoder", 0, 2, tp=1, dp=2, has_embedding=True, has_head=True),),
    (StageSpec("llm", 0, 2, tp=2, dp=1, has_embedding=True),
     StageSpec("llm", 2, 2, tp=1, dp=1, has_head=True)),
)  # fmt: skip
# 256 tokens: XLA:CPU runs the LLM's attention blocked (flash-like, no saved square), as the model
# assumes; at 128 it takes the dense path and saves the square the model leaves out. 4 tiles per row
# (packed by row): 2 per encoder shard, the LLM stage taking the row's 4 tiles' features.
SAVING_BUCKETS = BucketSet((4,), (256,))


@pytest.fixture(scope="module")
def saving_checks():
    """The check of SAVING_LAYOUT under "recompute" and under "all" everywhere, with the analytic
    memory model's prediction under the same policies."""
    provider = AnalyticCostProvider(get_arch("tiny"), get_device("cpu"))
    counts = in_flight(SAVING_LAYOUT.num_stages, TINY_PLAN_MAX_M, "1f1b")
    out = {}
    for policy in ("recompute", "all"):
        policies = [policy] * SAVING_LAYOUT.num_stages
        mems = layout_memory(provider, SAVING_LAYOUT, SAVING_BUCKETS, counts, residuals=policies)
        predicted = [m.total() for m in mems]
        checks = check_layout(SAVING_LAYOUT, SAVING_BUCKETS, counts, predicted, CFG,
                              residuals=policies)  # fmt: skip
        out[policy] = (checks, predicted)
    return out


# Two 3-stage checks in the fixture (about a minute of compiles): the second tier. The fast tier's dry
# run test checks the residual term of a saving stage too.
@pytest.mark.slow
def test_saved_residuals_are_held_by_every_in_flight_microbatch(saving_checks):
    """Under "all" the inner LLM stage compiles the forward that returns its residuals and the
    backward from them: each of its in-flight microbatches holds the forward's outputs but y (not
    its input), and the stage's peak is the larger of the two programs' with the other microbatches'
    residuals beside it (both read from the compiled programs here)."""
    from dflop_jax.programs.stage_fns import signature

    (rec, _), (saving, _) = saving_checks["recompute"], saving_checks["all"]
    spec, c = SAVING_LAYOUT.stages[1], saving[1]
    assert c.in_flight == 2 and rec[1].residuals == 0
    mesh = stage_meshes(SAVING_LAYOUT, jax.devices())[1]
    features = SAVING_BUCKETS.tiles[-1]  # the one row's block (a multiple of tp 2)
    prog = stage_program(CFG, spec, mesh, SAVING_BUCKETS.lengths[-1], jnp.bfloat16, features,
                         residuals="all")  # fmt: skip
    args = (prog.params_abs, prog.x_abs, prog.side_abs)
    with jax.set_mesh(mesh):
        fwd = prog.jits.forward_residuals.lower(*args).compile().memory_analysis()
        _, kept = jax.eval_shape(prog.jits.forward_residuals, *args)
        bwd = prog.jits.backward_residuals.lower(prog.params_abs, kept, prog.seed_abs,
                                                 prog.gacc_abs, signature(prog.x_abs, prog.side_abs)
                                                 ).compile().memory_analysis()  # fmt: skip
    y, gacc = per_device_bytes(prog.seed_abs), per_device_bytes(prog.gacc_abs)
    per_microbatch = fwd.output_size_in_bytes - y
    assert c.residuals == 2 * per_microbatch > 0
    # the backward reads them (jit drops the few it does not: at most 10% here)
    read = bwd.argument_size_in_bytes - per_device_bytes(prog.params_abs) - y - gacc
    assert 0.9 * per_microbatch <= read <= per_microbatch

    def peak(m) -> float:
        held = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
        return held + m.temp_size_in_bytes

    # beside the programs: the fp32 masters (the programs take their bf16 copies), the moments and
    # the other microbatches' residuals
    others = c.params - per_device_bytes(prog.params_abs) + c.optimizer
    others += (c.in_flight - 1) * per_microbatch
    forward = peak(fwd) + c.grads + others
    backward = peak(bwd) + others + c.inputs  # (the input the next forward reads)
    assert c.total == pytest.approx(max(forward, backward))
    assert c.inputs == rec[1].inputs / rec[1].in_flight  # one microbatch's, not in_flight's
    # the other microbatches' residuals come on top; the recompute backward already held one
    # microbatch's (rebuilt), so at most in_flight x residuals
    assert (c.in_flight - 1) * per_microbatch < c.total - rec[1].total < c.residuals


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_all_residuals_check_agrees_with_the_memory_model(saving_checks, stage):
    """Under "all" the compiled check and the memory model's prediction under the same policy are
    within `DISAGREE` (the band `plan --check` and the dry run warn outside of). The inner LLM stage
    (tp 2, no remat) was +18.5% while the model charged its backward from residuals no temporaries
    of its own: it holds one layer's cotangents beside the residuals it cannot free."""
    checks, predicted = saving_checks["all"]
    assert abs(checks[stage].total / predicted[stage] - 1) <= DISAGREE


def test_dry_run_predicts_saving_stages_with_the_analytic_model():
    """A cost table prices recomputing stages only: under a saving policy the dry run's prediction
    comes from the analytic memory model (the one that picked the policies); otherwise the plan's."""
    from dflop_jax.planner.resolve import ResolvedPlan
    from dflop_jax.resolve import RunContext
    from dflop_jax.resolve.dry_run import memory_provider
    from dflop_jax.runtime.config import TrainConfig

    ctx, table = RunContext.of(TrainConfig(), CFG), object()  # a measured provider: not analytic
    resolved = ResolvedPlan(SAVING_LAYOUT, SAVING_BUCKETS, (1, TINY_PLAN_MAX_M), table)
    assert memory_provider(ctx, resolved) is table  # no policy: "recompute"
    recompute = dataclasses.replace(resolved, residuals=("recompute",) * 3)
    assert memory_provider(ctx, recompute) is table
    saving = dataclasses.replace(resolved, residuals=("all", "layers", "recompute"))
    assert isinstance(memory_provider(ctx, saving), AnalyticCostProvider)


def _siglip_encoder_stage():
    """(arch, model config, stage, one-device mesh) of a SigLIP-400M-width encoder stage as the 7B
    plan's: patch embedding, 2 layers under remat, the projector."""
    from jax.sharding import Mesh

    from models.stage_modules import with_remat

    base = get_arch("siglip-so400m+qwen2.5-7b")
    arch = dataclasses.replace(base, vision=dataclasses.replace(base.vision, num_layers=2))
    cfg = with_remat(model_config_for_arch(arch), {"vision": "full", "llm": "full"})
    spec = StageSpec("encoder", 0, 2, has_embedding=True, has_head=True)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    return arch, cfg, spec, mesh


@pytest.mark.slow
def test_encoder_transient_per_tile_matches_the_memory_model():
    """SigLIP-400M widths (729-token tiles, 16 heads), 2 layers under remat, one device: the compiled
    encoder program's transient grows per tile as the memory model's (within 10%). Without a tile's
    attention square the model's growth was a third low (docs/benchmarks.md, "plan --check")."""
    from dflop_jax.costs.memory import encoder_stage_memory
    from dflop_jax.profiling.compile_check import compile_part

    arch, cfg, spec, mesh = _siglip_encoder_stage()
    few, many = 2, 6
    compiled = [
        compile_part("encoder", stage_program(cfg, spec, mesh, t, jnp.bfloat16)).transient
        for t in (few, many)
    ]
    model = [encoder_stage_memory(arch, spec, t, remat=True).temp for t in (few, many)]
    per_tile = (compiled[1] - compiled[0]) / (many - few)
    assert (model[1] - model[0]) / (many - few) == pytest.approx(per_tile, rel=0.10)


@pytest.mark.slow
def test_saving_siglip_encoder_stage_agrees_with_the_memory_model():
    """SigLIP-400M widths as the 7B plan's encoder stage trains (patch embedding, 2 layers under
    remat, the projector; one device) under "all", 4 tiles: the residuals its forward returns per
    microbatch are the model's held bytes (the projector's and the patch pixels with the layers':
    the model once counted the layers' alone, 71 of 170 MiB), and with the 7B stage's 2 microbatches
    in flight the compiled peak is within `DISAGREE` of the model's."""
    from dflop_jax.costs.memory import encoder_stage_memory
    from dflop_jax.profiling.compile_check import compile_part

    arch, cfg, spec, mesh = _siglip_encoder_stage()
    tiles, in_flight = 4, 2
    c = compile_part("encoder", stage_program(cfg, spec, mesh, tiles, jnp.bfloat16,
                                              residuals="all"))  # fmt: skip
    model = encoder_stage_memory(arch, spec, tiles, remat=True, residuals="all")
    assert model.activations_per_microbatch == pytest.approx(c.residuals, rel=0.02)
    compiled = StageCheck(stage=0, parts=("encoder",), program_bytes=(c.program_bytes,),
                          params=c.params, grads=c.grads, optimizer=c.optimizer, inputs=c.inputs,
                          transient=c.transient, in_flight=in_flight, compile_s=c.compile_s,
                          residuals=in_flight * c.residuals)  # fmt: skip
    assert abs(compiled.total / model.total(in_flight) - 1) <= DISAGREE


@pytest.mark.slow
def test_dx_only_transient_per_layer_matches_the_memory_model():
    """Qwen2.5-7B widths, a middle LLM stage frozen behind the trained projector (dx-only backward),
    remat, one CPU device: the compiled program's transient grows per layer as the memory model's at
    XLA:CPU's dot dtype (within 10%). XLA:CPU keeps the frozen weights as an f32 stack (it upcasts bf16
    dots), 4 B per parameter, twice the bf16 copy a GPU holds and the model charged on every backend
    (docs/benchmarks.md, "Under a frozen recipe")."""
    from jax.sharding import Mesh

    from dflop_jax.costs.memory import CPU_DOT_BYTES, llm_stage_memory
    from dflop_jax.profiling.compile_check import compile_part
    from models.stage_modules import with_remat

    base = get_arch("siglip-so400m+qwen2.5-7b")
    arch = dataclasses.replace(base, llm=dataclasses.replace(base.llm, num_layers=6))
    cfg = with_remat(model_config_for_arch(arch), {"vision": "full", "llm": "full"})
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    few, many, tokens, recipe = 2, 4, 256, ("projector",)
    specs = [StageSpec("llm", 1, n) for n in (few, many)]
    compiled = [
        compile_part("llm", stage_program(cfg, s, mesh, tokens, jnp.bfloat16, trainable=recipe))
        for s in specs
    ]
    assert all(c.grads == 0 for c in compiled)  # frozen: no accumulator
    per_layer = (compiled[1].transient - compiled[0].transient) / (many - few)
    # held params: the fp32 masters and their bf16 copies, 6 B per parameter
    layer_params = (compiled[1].params - compiled[0].params) / (many - few) / (4 + 2)
    assert per_layer == pytest.approx(4 * layer_params, rel=0.05)  # an f32 weight copy per layer

    def model(spec, dot_bytes=None):
        return llm_stage_memory(arch, spec, tokens, True, trainable=recipe, dot_bytes=dot_bytes)

    cpu = [model(s, CPU_DOT_BYTES).temp for s in specs]
    assert (cpu[1] - cpu[0]) / (many - few) == pytest.approx(per_layer, rel=0.10)
    gpu = [model(s).temp for s in specs]  # bf16 dots read the resident copies: no weight bytes
    assert (gpu[1] - gpu[0]) / (many - few) < 0.01 * per_layer


@pytest.mark.slow
def test_dx_only_whole_llm_stage_transient_matches_the_memory_model():
    """The same frozen LLM as one stage with its token embedding and LM head (2 layers, 1024-token
    row): the compiled transient is the model's at XLA:CPU's dot dtype within 10% (the embedding
    table, read by a gather only, holds no copy; the head's bf16 copy does). Before, the model charged
    the embedding a bf16 copy and the layers half their CPU bytes: 4.73 vs 5.28 GiB compiled."""
    from jax.sharding import Mesh

    from dflop_jax.costs.memory import CPU_DOT_BYTES, llm_stage_memory
    from dflop_jax.profiling.compile_check import compile_part
    from models.stage_modules import with_remat

    base = get_arch("siglip-so400m+qwen2.5-7b")
    arch = dataclasses.replace(base, llm=dataclasses.replace(base.llm, num_layers=2))
    cfg = with_remat(model_config_for_arch(arch), {"vision": "full", "llm": "full"})
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    spec, tokens, recipe = (
        StageSpec("llm", 0, 2, has_embedding=True, has_head=True),
        1024,
        ("projector",),
    )
    prog = stage_program(cfg, spec, mesh, tokens, jnp.bfloat16, feature_tiles=1, trainable=recipe)
    compiled = compile_part("llm", prog).transient
    model = llm_stage_memory(arch, spec, tokens, True, trainable=recipe, dot_bytes=CPU_DOT_BYTES)
    assert model.temp == pytest.approx(compiled, rel=0.10)


def test_a_pooled_first_llm_stage_holds_no_more_than_the_model_adds():
    """The first LLM stage at llm dp 4 compiled for the same 32 tiles packed by row (8 a row) and
    pooled: the pooled program's transient grows (the pool gathered whole, each replica's share
    of its gradient), by no more than `pooled_features_bytes`, what the memory model adds for it."""
    from dflop_jax.costs.provider import pooled_features_bytes

    row = Layout((StageSpec("encoder", 0, 2, tp=1, dp=1, has_embedding=True, has_head=True),),
                 (StageSpec("llm", 0, 4, tp=1, dp=4, has_embedding=True, has_head=True),))  # fmt: skip
    pool = dataclasses.replace(row, pooled_tiles=True)
    grown = [
        check_layout(lay, BucketSet((tiles,), (256,)), [1, 1], [1.0, 1.0], CFG)[1].transient
        for lay, tiles in ((row, 8), (pool, 32))
    ]
    provider = AnalyticCostProvider(get_arch("tiny"), get_device("cpu"))
    assert 0 < grown[1] - grown[0] <= pooled_features_bytes(provider, pool, 32)
