"""The encoder COLOCATED on the first LLM stage (`models.mllm.ColocatedStage`): a pipelined step ==
single-device jax.grad of the unsplit model + the same optax update (loss and every updated parameter,
float32), for LLaVA-OV (exact bilinear taps of an anyres image, several images, video frames pooled)
and InternVL, with 1 and 2 LLM stages and LLM dp 1 and 2.

Row r's tiles sit in tile slots [r*T, (r+1)*T) and its feature indices are GLOBAL slot rows inside
that range (what the packer writes for a colocated plan), so the unsplit reference, which gathers from
the whole microbatch's features, sees the same placement the colocated stage makes row by row.

Also: a layout whose tp splits a head is refused; checkpoints round-trip between the colocated and a
separate-encoder layout; the scheduler keeps each sample's tiles on its row's shard; an explicit
`layout.encoder_colocated` run and a `plan: auto` run whose planner colocates train end to end (slow)."""

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from demo_fixtures import SMALL_DEMO
from pipeline_fixtures import (
    COLOCATED_LLAVA,
    COLOCATED_SIGLIP,
    COLOCATED_TILES,
    MLLM_TEXT,
    colocated_layout,
    colocated_microbatch,
    colocated_model,
    mllm_loss_sum,
)
from pipeline_reference import (
    assert_trees_close,
    no_host_round_trip,
    pipeline_step,
    reference_step,
)

from dflop_jax.config import ConfigError, load_config
from dflop_jax.contracts import BucketSet, SampleShape, ScheduleProblem
from dflop_jax.contracts.cost_table import CostEntry, ProfiledCostTable, load_table
from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.costs import AnalyticCostProvider, arch_of_model, get_device, layout_stage_costs
from dflop_jax.costs.measured import MeasuredCostProvider
from dflop_jax.costs.provider import colocated_encoder_stage
from dflop_jax.planner.resolve import ResolvedPlan
from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.programs.stage_builder import build_stages
from dflop_jax.runtime.checkpoint import Checkpointer, model_tree
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.runtime.driver import run_pipeline
from dflop_jax.runtime.lagged_schedule import Observation
from dflop_jax.runtime.optimizer_config import OptimizerConfig
from dflop_jax.runtime.train_state import StageOptimizer, apply_updates
from dflop_jax.scheduler import Scheduler, SchedulerConfig, schedule_batch
from dflop_jax.train import run
from models.llava_onevision import llava_onevision_config

OPT = OptimizerConfig(lr=1e-2, warmup_steps=1, decay_steps=10, clip_norm=1.0)


def _batch(family: str, rows: int, tpt: int, tiles: int = COLOCATED_TILES) -> list[dict]:
    """LLaVA-OV: an anyres microbatch with exact taps and a video frame pooled per row, then a
    multi-image one (several tiles per row, plain gathers); InternVL: plain gathers (its features are
    never interpolated). Two input signatures: two compiles per program."""
    rng = np.random.default_rng(1)
    llava = family == "llava_ov"
    return [
        colocated_microbatch(rng, rows, 40, tpt, taps=t, video=v, tiles=tiles)
        for t, v in ((llava, llava), (False, False))
    ]


ROWS = 2  # rows per microbatch at LLM dp 1 and 2: one batch, so one reference step, per family


@functools.cache
def _reference(family: str) -> tuple[float, dict]:
    """(loss, updated model tree) of the single-device step on `family`'s batch, shared by its
    layouts (the unsplit model and its batch do not depend on the layout)."""
    model = colocated_model(family)
    mbs = _batch(family, ROWS, model.cfg.tokens_per_tile)
    norm = sum(float(m["loss_mask"].sum()) for m in mbs)
    ref_loss, new, _ = reference_step(model, mbs, norm, OPT, mllm_loss_sum)
    enc_layers = model.cfg.vision.num_layers
    ref_tree = model_tree([StageSpec("encoder", 0, enc_layers), StageSpec("llm", 0, 3)],
                          [new["encoder"], new["llm"]], [{}, {}])  # fmt: skip
    return ref_loss, jax.device_get(ref_tree)


@pytest.mark.slow  # over a minute in the fast tier (CI's second tier runs it)
@pytest.mark.parametrize(
    "family,dp,llm_stages",
    [("llava_ov", 1, 1), ("llava_ov", 2, 2), ("internvl", 2, 1), ("internvl", 1, 2)],
)  # fmt: skip
def test_colocated_step_matches_single_device(family, dp, llm_stages):
    """At dp 1 the colocated stage's one shard holds both rows (and their 2T tile slots); at dp 2
    each shard one."""
    cfg = colocated_model(family).cfg
    layout = colocated_layout(dp, llm_stages)
    mbs = _batch(family, ROWS, cfg.tokens_per_tile)
    norm = sum(float(m["loss_mask"].sum()) for m in mbs)
    stages = build_stages(cfg, layout, stage_meshes(layout), 0, compute_dtype=jnp.float32)
    assert not stages[0].has_x  # the colocated stage takes tiles, not an activation
    opts = [StageOptimizer(s, OPT.build()) for s in stages]
    with no_host_round_trip():
        out = run_pipeline(stages, mbs, norm, "1f1b")
    loss = sum(float(x) for x in out.loss)
    apply_updates(opts, out.grads, OPT.clip_norm)

    ref_loss, ref_tree = _reference(family)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    got = model_tree(list(layout.stages), [s.params for s in stages], [{} for _ in stages])
    assert_trees_close(got, ref_tree)


def test_colocated_layout_refused_when_tp_splits_a_head():
    """tp 4 divides the decoder's 4 heads but not the ViT's 2: refused, saying why."""
    cfg = llava_onevision_config(COLOCATED_SIGLIP, MLLM_TEXT)
    layout = Layout((), (StageSpec("llm", 0, 3, tp=4, has_embedding=True, has_head=True),))
    with pytest.raises(ValueError, match=r"tp must divide every model's attention heads"):
        build_stages(cfg, layout, stage_meshes(layout), 0)


SEPARATE = Layout(
    (StageSpec("encoder", 0, 2, tp=1, dp=2, has_embedding=True, has_head=True),),
    (
        StageSpec("llm", 0, 2, tp=2, dp=2, has_embedding=True),
        StageSpec("llm", 2, 1, tp=1, dp=2, has_head=True),
    ),
)


def _run(layout, seed):
    """Stages of `layout` (params from `seed`) and their optimizers."""
    cfg = llava_onevision_config(COLOCATED_SIGLIP, MLLM_TEXT)
    stages = build_stages(cfg, layout, stage_meshes(layout), seed, compute_dtype=jnp.float32)
    return stages, [StageOptimizer(s, OPT.build()) for s in stages]


def _step(stages, opts, mbs) -> float:
    return pipeline_step(stages, opts, mbs, OPT.clip_norm)


def _tree(layout, stages, opts) -> dict:
    return model_tree(list(layout.stages), [s.params for s in stages], [o.state for o in opts])


def _restore(ckpt, layout, stages, opts, step):
    params, states, _ = ckpt.restore(list(layout.stages), [s.params for s in stages],
                                     [o.state for o in opts], step)  # fmt: skip
    for s, o, p, st in zip(stages, opts, params, states):
        s.params, o.state = p, st


@pytest.mark.slow  # over a minute in the fast tier (CI's second tier runs it)
def test_colocated_checkpoint_resumes_on_separate_encoder_and_back(tmp_path):
    """The colocated stage's encoder params AND optimizer moments / step counts map to the model-level
    tree: a separate-encoder run restored from it holds exactly the colocated run's state and computes
    the same next loss, and a colocated run restored from that run's save holds its state exactly.
    4 tiles per row: packed by row for both layouts (SEPARATE's first LLM stage, at tp 2, takes row
    blocks of a multiple of 2 tiles). One microbatch (the anyres one) per step: one input signature,
    so one compile per program; what is checked is the state the layouts map between."""
    tpt = llava_onevision_config(COLOCATED_SIGLIP, MLLM_TEXT).tokens_per_tile
    batches = [_batch("llava_ov", 2, tpt, tiles=4)[:1]] * 2
    coloc, coloc_opts = _run(colocated_layout(2, 2), 0)
    _step(coloc, coloc_opts, batches[0])
    ckpt = Checkpointer(tmp_path / "ckpt", keep=3, async_save=False)
    ckpt.save(1, list(colocated_layout(2, 2).stages), [s.params for s in coloc],
              [o.state for o in coloc_opts], meta={})  # fmt: skip

    split, split_opts = _run(SEPARATE, 1)  # other init: the restore must overwrite all of it
    _restore(ckpt, SEPARATE, split, split_opts, 1)
    assert_trees_close(_tree(SEPARATE, split, split_opts),
                       _tree(colocated_layout(2, 2), coloc, coloc_opts), rtol=0, atol=0)  # fmt: skip
    loss_coloc = _step(coloc, coloc_opts, batches[1])
    loss_split = _step(split, split_opts, batches[1])
    # The restored state computes what the colocated run computes. (Not compared after the update:
    # the ViT's key bias has an exactly-zero gradient, so AdamW turns each layout's float round-off
    # in it into different lr-sized steps.)
    np.testing.assert_allclose(loss_split, loss_coloc, rtol=1e-5)

    ckpt.save(2, list(SEPARATE.stages), [s.params for s in split], [o.state for o in split_opts],
              meta={})  # fmt: skip
    back, back_opts = _run(colocated_layout(2, 2), 1)
    _restore(ckpt, colocated_layout(2, 2), back, back_opts, 2)
    assert_trees_close(_tree(colocated_layout(2, 2), back, back_opts),
                       _tree(SEPARATE, split, split_opts), rtol=0, atol=0)  # fmt: skip
    ckpt.close()


# The demo at its least (`SMALL_DEMO`), its planner free to colocate: the encoder pipeline is deeper than
# the 2-layer ViT, so no separate-encoder candidate exists and the planner colocates.
# A global batch of 8: on the 8 devices at tp 1 the LLM runs at dp 4 (pp 2), and a candidate needs
# microbatches x LLM dp <= global batch.
AUTO = [*SMALL_DEMO, "steps=2", "global_batch=8", "compute_dtype=float32",
        "measure_stage_times_every=1", "device.peak_flops=1000000000.0", "planner.llm_pp=[1, 2]",
        "planner.colocate=true", "planner.encoder_pp=[4]"]  # fmt: skip


@pytest.mark.slow
def test_auto_plan_colocated_trains_end_to_end(tmp_path):
    """`plan: auto` on the demo model: the planner's layout has the encoder colocated, and the trainer
    trains it as planned (the loader packs each sample's tiles on its row's shard)."""
    demo = Path(__file__).parents[2] / "configs" / "demo.yaml"
    over = [f"data.synth_dir={tmp_path / 'synth'}", f"run_dir={tmp_path / 'run'}"]
    report = run(load_config(TrainConfig, demo, AUTO + over))
    assert report.layout.encoder_stages == () and report.layout.colocated_encoder_tp is None
    plan = (tmp_path / "run" / "auto_plan" / "plan.yaml").read_text()
    assert "encoder_colocated: true" in plan
    assert len(report.losses) == 2 and np.all(np.isfinite(report.losses))
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert min(r["encoder_padding_ratio"] for r in rows) < 1.0  # the colocated stage encoded tiles
    # the planner scored the colocated layout with the profiled colocated stage program
    table = load_table(tmp_path / "run" / "auto_plan" / "cost_table.json")
    assert table.buckets("colocated_embedding", 1, 0) == [4]  # SMALL_DEMO's one encoder bucket
    sources = json.loads((tmp_path / "run" / "auto_plan" / "cost_sources.json").read_text())
    assert sum(sources["colocated_embedding"].values()) > 0
    assert "fallback" not in sources["colocated_embedding"]


EXPLICIT = ["plan=explicit", "layout.encoder_colocated=true", "layout.encoder_layers=[]",
            "layout.encoder_tp=[]", "layout.llm_layers=[2, 2]", "layout.llm_tp=[2]",
            "layout.llm_dp=2", "layout.tiles=[16]", "layout.lengths=[1024]",
            "layout.microbatches=[2, 3]", "steps=2", "global_batch=8", "data.synth_samples=32",
            "checkpoint.every=0", "compute_dtype=float32", "measure_stage_times_every=1",
            "device.peak_flops=1000000000.0", "scheduler.solver=greedy"]  # fmt: skip


def _demo_cfg(tmp_path, *extra):
    demo = Path(__file__).parents[2] / "configs" / "demo.yaml"
    over = [f"data.synth_dir={tmp_path / 'synth'}", f"run_dir={tmp_path / 'run'}",
            "compilation_cache="]  # fmt: skip
    return load_config(TrainConfig, demo, [*EXPLICIT, *over, *extra])


def test_explicit_colocated_layout_config():
    """`layout.encoder_colocated` gives a layout without encoder stages; bad combinations are refused
    at config load with the key and the fix."""
    tmp = Path("/nonexistent")  # nothing is written at config load
    lay = _demo_cfg(tmp).layout
    assert lay.layout().encoder_stages == () and lay.layout().llm_dp == 2
    with pytest.raises(ConfigError, match="layout.encoder_layers"):
        _demo_cfg(tmp, "layout.encoder_layers=[1, 1]")
    with pytest.raises(ConfigError, match="layout.llm_tp.*vision_num_heads"):
        _demo_cfg(tmp, "layout.llm_tp=[4]")  # divides the decoder's 4 heads, not the ViT's 2


@pytest.mark.slow
def test_explicit_colocated_layout_trains(tmp_path):
    """The trainer path on an explicit colocated layout (2 LLM stages, dp 2, tp 2): schedule with tiles
    on their row's shard, packing, the colocated stage, metrics."""
    report = run(_demo_cfg(tmp_path))
    assert report.layout.encoder_stages == () and len(report.layout.llm_stages) == 2
    assert len(report.losses) == 2 and np.all(np.isfinite(report.losses))
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert min(r["encoder_padding_ratio"] for r in rows) < 1.0
    for r in rows:  # the colocated stage pads tiles and tokens, each reported on its own
        tiles, tokens = r["encoder_padding_ratio"], r["llm_padding_ratio"]
        assert r["stage_padding"] == [{"tiles": tiles, "tokens": tokens}, {"tokens": tokens}]
        assert r["tile_padding_ratio"] == tiles and tiles != tokens


def test_colocated_schedule_keeps_tiles_on_their_row():
    """A colocated problem: each microbatch's tile bucket covers its fullest shard (not the shards'
    mean), its plans carry `tiles_by_row`, and encoder shard r holds exactly LLM shard r's tiles."""
    rng = np.random.default_rng(3)
    shapes = [
        SampleShape(i, int(rng.integers(0, 7)), int(rng.integers(20, 200))) for i in range(24)
    ]
    costs = lambda t, s: np.array([[1e-3 * t + 1e-5 * s, 2e-3 * t + 2e-5 * s]])  # noqa: E731
    problem = ScheduleProblem(2, 2, 1, (2, 4), BucketSet((4, 8, 12), (256, 512)), costs,
                              tiles_by_row=True)  # fmt: skip
    schedule = schedule_batch(shapes, problem, SchedulerConfig(solver="greedy"))
    for mb in schedule.microbatches:
        assert mb.tiles_by_row
        per_shard = [sum(shapes[i].tiles for i in shard) for shard in mb.shards]
        smaller = [t for t in problem.buckets.tiles if t < mb.tile_bucket]
        assert max(per_shard) <= mb.tile_bucket and all(t < max(per_shard) for t in smaller)
        placed = mb.encoder_tiles(shapes, 2)
        for shard, tiles in zip(mb.shards, placed):
            assert tiles == [(i, t) for i in shard for t in range(shapes[i].tiles)]
    with pytest.raises(ValueError, match="largest tile bucket 12"):
        schedule_batch([SampleShape("big", 13, 50)], problem, SchedulerConfig(solver="greedy"))


# ------------------------------------------------ cost and correction accounting of the colocated stage

COLOCATED_LAYOUT = Layout((), (StageSpec("llm", 0, 2, tp=2, dp=2, has_embedding=True),
                           StageSpec("llm", 2, 1, tp=2, dp=2, has_head=True)))  # fmt: skip


def _table(colocated: bool) -> ProfiledCostTable:
    """A cost table of simple per-part times at tp 2 (LLM rows 256, 512; tiles 4, 8), with the
    colocated stage's program (colocated_embedding, its row 256 tokens) when `colocated`."""
    table = ProfiledCostTable("cpu", "cpu", 8, "h", "v")
    per = {"llm_embedding": 1e-6, "llm_layers": 3e-6, "llm_head": 2e-6}
    for kind, rate in per.items():
        for b in (256, 512):
            for n in (1, 2) if kind == "llm_layers" else (0,):
                table.add(CostEntry(kind, 2, b, n, fwd_s=rate * b * max(n, 1),
                                    bwd_s=2 * rate * b * max(n, 1)))  # fmt: skip
    for kind, rate in {
        "encoder_embedding": 1e-4,
        "encoder_layers": 5e-4,
        "encoder_head": 2e-4,
    }.items():
        for t in (4, 8):
            for n in (1, 2) if kind == "encoder_layers" else (0,):
                table.add(CostEntry(kind, 2, t, n, fwd_s=rate * t * max(n, 1),
                                    bwd_s=2 * rate * t * max(n, 1)))  # fmt: skip
    if (
        colocated
    ):  # the colocated program: 256e-6 s of embedding at its row + 3e-3 s per tile of encoder
        for t in (4, 8):
            table.add(CostEntry("colocated_embedding", 2, t, 0, fwd_s=256e-6 + 3e-3 * t,
                                bwd_s=2 * (256e-6 + 3e-3 * t), length=256))  # fmt: skip
    return table


def test_colocated_stage_cost_comes_from_the_profiled_colocated_program():
    """LLM stage 0 of a colocated layout costs its LLM parts plus the colocated program's encoder share
    (colocated_embedding minus the embedding at its row), interpolated in tiles; without that entry,
    the encoder's parts as a separate stage. The scheduler problem has ONE stage for it."""
    arch, cpu = arch_of_model(COLOCATED_LLAVA), get_device("cpu")
    coloc = MeasuredCostProvider(_table(True), arch, cpu, fit="interpolate")
    apart = MeasuredCostProvider(_table(False), arch, cpu, fit="interpolate")
    problem = ResolvedPlan(COLOCATED_LAYOUT, BucketSet((4, 8), (256, 512)), (2, 3), coloc).problem()
    assert problem.num_stages == 2 and problem.tiles_by_row
    llm0 = np.array(coloc.stage_time(COLOCATED_LAYOUT.stages[0], 512))
    got = problem.stage_costs(6, 512)
    np.testing.assert_allclose(got[0], llm0 + [3e-3 * 6, 2 * 3e-3 * 6], rtol=1e-9)
    np.testing.assert_allclose(got[1], coloc.stage_time(COLOCATED_LAYOUT.stages[1], 512), rtol=1e-9)
    assert coloc.sources()["colocated_embedding"] == {"interpolated": 1}
    enc = apart.stage_time(colocated_encoder_stage(arch, COLOCATED_LAYOUT), 6)
    np.testing.assert_allclose(layout_stage_costs(apart, COLOCATED_LAYOUT)(6, 512)[0],
                               llm0 + np.array(enc), rtol=1e-9)  # fmt: skip
    assert "colocated_embedding" not in apart.sources()


def test_correction_observes_the_colocated_stage_as_one_stage():
    """The runtime builds one program per stage of the colocated layout (the encoder inside stage 0),
    so a step's measured times are [M, 2, 2]; the correction learns stage 0's factor against the
    colocated stage's prediction (LLM parts + encoder), not against an encoder stage of its own."""
    meshes = stage_meshes(COLOCATED_LAYOUT, jax.devices())
    stages = build_stages(COLOCATED_LLAVA, COLOCATED_LAYOUT, meshes, 0, compute_dtype=jnp.float32)
    assert len(stages) == 2 and "tiles" in stages[0].fns.side_keys
    arch, cpu = arch_of_model(COLOCATED_LLAVA), get_device("cpu")
    provider = AnalyticCostProvider(arch, cpu)
    problem = ResolvedPlan(
        COLOCATED_LAYOUT, BucketSet((4, 8), (256, 512)), (2, 3), provider
    ).problem()
    shapes = [SampleShape(i, 1 + i % 3, 60 + 37 * i) for i in range(8)]
    scheduler = Scheduler(problem, SchedulerConfig(solver="greedy", correction="on"))
    schedule = scheduler.schedule(shapes, 1)
    raw = np.array([problem.stage_costs(mb.tile_bucket, mb.length_bucket)
                    for mb in schedule.microbatches])  # fmt: skip
    measured = raw * [[1.0], [3.0]]  # stage 1 (the colocated stage is 0) runs 3x its prediction
    measured[:, -1, 0], measured[:, -1, 1] = measured[:, -1].sum(1), 0.0  # the fused last step
    obs = Observation.of_step(problem, schedule, measured, np.ones(len(raw), bool))
    assert np.asarray(obs.times).shape == (len(raw), 2, 2)
    obs.feed(scheduler)
    assert scheduler.observations == len(raw)
    for mb in schedule.microbatches:
        ti = problem.buckets.tiles.index(mb.tile_bucket)
        si = problem.buckets.lengths.index(mb.length_bucket)
        np.testing.assert_allclose(scheduler.correction.factor(ti, si), [[1, 1], [3, 3]])


def test_stage_modules_name_the_colocated_stage():
    from dflop_jax.runtime.metrics import COLOCATED, stage_modules

    assert stage_modules(COLOCATED_LAYOUT, True) == [COLOCATED, "llm"]
    assert stage_modules(COLOCATED_LAYOUT, False) == ["llm", "llm"]  # a decoder: no encoder
    separate = Layout((StageSpec("encoder", 0, 2, tp=1, dp=2, has_embedding=True, has_head=True),),
                      COLOCATED_LAYOUT.llm_stages)  # fmt: skip
    assert stage_modules(separate, True) == ["encoder", "llm", "llm"]


def test_data_blind_schedule_keeps_each_shard_within_the_largest_tile_bucket():
    """The data-blind baseline on a colocated layout (its own planner's choice): in-order first-fit,
    every microbatch at the largest buckets, and no shard holding more of its rows' tiles than the
    largest tile bucket (the runtime's colocated stage encodes exactly them). The loader order puts two
    5-tile samples first: a separate encoder would pool them over both shards; here they split."""
    shapes = [SampleShape(0, 5, 40), SampleShape(1, 5, 40)] + [
        SampleShape(i, 1, 40) for i in range(2, 8)
    ]
    costs = lambda t, s: np.array([[1e-3 * t + 1e-5 * s, 2e-3 * t + 2e-5 * s]])  # noqa: E731
    problem = ScheduleProblem(
        2, 2, 1, (2, 2), BucketSet((4, 8), (256, 512)), costs, tiles_by_row=True
    )
    schedule = schedule_batch(shapes, problem, SchedulerConfig(solver="data_blind"))
    assert sorted(i for mb in schedule.microbatches for i in mb.samples()) == list(range(8))
    for mb in schedule.microbatches:
        assert mb.tiles_by_row and (mb.tile_bucket, mb.length_bucket) == (8, 512)
        assert max(sum(shapes[i].tiles for i in shard) for shard in mb.shards) <= 8
    assert schedule.microbatches[0].shards == ((0, 2, 3), (1,))
    separate = dataclasses.replace(problem, tiles_by_row=False)
    pooled = schedule_batch(shapes, separate, SchedulerConfig(solver="data_blind"))
    assert pooled.microbatches[0].shards == ((0, 1, 2, 3), ())  # 10 tiles pooled over 2 x 8
