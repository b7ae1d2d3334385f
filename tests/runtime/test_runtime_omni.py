"""An omni model (`models.omni`: vision encoder + audio encoder + one decoder) trained by the pipeline:
a step == single-device jax.grad of the unsplit `Omni` + the same optax update (loss and every
updated parameter, float32), with the audio encoder on the first LLM stage (`OmniFirstStage`) and the
vision encoder on its own stage or colocated there too.

The pipeline runs each LLM row's audio windows packed in that row's own audio row (windows convolved
and attended apart, outputs placed by row-local index); the reference encodes every window as a clip
of its own and places by GLOBAL index into the whole microbatch's outputs (`omni_loss_sum`), so the
packing, the per-row placement and the stage split are all checked against the plain model. One of
the two microbatches has no audio: the first LLM stage's second signature.

Also: the run config's checks for an omni run, and the demo config training end to end (slow).
"""

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pipeline_fixtures import (
    OMNI,
    as_pool,
    colocated_layout,
    omni_loss_sum,
    omni_microbatch,
    omni_model,
)
from pipeline_reference import (
    assert_trees_close,
    guarded_step,
    pipeline_step,
    reference_step,
)

from dflop_jax.config import ConfigError, load_config
from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.planner.plan_file import load_plan
from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.programs.stage_builder import build_stages
from dflop_jax.resolve import RunContext
from dflop_jax.runtime.checkpoint import model_tree
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.runtime.hf_export import export_run, run_config
from dflop_jax.runtime.optimizer_config import OptimizerConfig
from dflop_jax.runtime.train_state import StageOptimizer
from dflop_jax.train import run

OPT = OptimizerConfig(lr=1e-2, warmup_steps=1, decay_steps=10, clip_norm=1.0)
ROWS = 2

# The vision encoder on a stage of its own (dp 2), the audio encoder in LLM stage 0 (tp 2, dp 2).
SEPARATE = Layout(
    (StageSpec("encoder", 0, 2, tp=1, dp=2, has_embedding=True, has_head=True),),
    (
        StageSpec("llm", 0, 2, tp=2, dp=2, has_embedding=True),
        StageSpec("llm", 2, 1, tp=1, dp=2, has_head=True),
    ),
)


# The audio encoder on a stage of its own (dp 1: both rows' audio on one replica), beside the
# vision encoder's stage: two branches joining at LLM stage 0 (tp 2).
AUDIO_APART = Layout(
    (StageSpec("encoder", 0, 2, tp=1, dp=2, has_embedding=True, has_head=True),),
    (
        StageSpec("llm", 0, 2, tp=2, dp=1, has_embedding=True),
        StageSpec("llm", 2, 1, tp=1, dp=1, has_head=True),
    ),
    audio_stages=(
        StageSpec("audio", 0, 1, tp=1, dp=1, has_embedding=True),
        StageSpec("audio", 1, 1, tp=1, dp=1, has_head=True),
    ),
)
# Both encoders on stages of their own at dp 2, as the LLM: each audio replica one row's audio.
AUDIO_APART_DP2 = Layout(
    (StageSpec("encoder", 0, 2, tp=1, dp=2, has_embedding=True, has_head=True),),
    (StageSpec("llm", 0, 2, tp=1, dp=2, has_embedding=True),
     StageSpec("llm", 2, 1, tp=1, dp=2, has_head=True)),
    audio_stages=(StageSpec("audio", 0, 2, tp=1, dp=2, has_embedding=True, has_head=True),),
)  # fmt: skip
# The vision encoder colocated on LLM stage 0, the audio encoder on a stage of its own: LLM
# stage 0 takes the audio features as its one input.
COLOCATED_AUDIO_APART = dataclasses.replace(
    colocated_layout(2, 2),
    audio_stages=(StageSpec("audio", 0, 2, tp=1, dp=2, has_embedding=True, has_head=True),),
)
LAYOUTS = {"separate": SEPARATE, "colocated": colocated_layout(2, 2), "audio_apart": AUDIO_APART,
           "audio_apart_dp2": AUDIO_APART_DP2, "colocated_audio_apart": COLOCATED_AUDIO_APART,
           "separate_pooled": dataclasses.replace(SEPARATE, pooled_tiles=True)}  # fmt: skip


@functools.cache
def _batch(all_audio: bool = False) -> tuple[list[dict], list[dict]]:
    """(packed microbatches, their reference inputs): an anyres microbatch with audio and a video
    one, without audio unless `all_audio` (a layout with audio stages runs audio in every
    microbatch: the scheduler gives each one an audio bucket)."""
    rng = np.random.default_rng(3)
    tpt = OMNI.tokens_per_tile
    pairs = [omni_microbatch(rng, ROWS, tpt, audio=True, taps=True, video=False),
             omni_microbatch(rng, ROWS, tpt, audio=all_audio, taps=False, video=True)]  # fmt: skip
    return [p for p, _ in pairs], [r for _, r in pairs]


@functools.cache
def _reference(all_audio: bool = False) -> tuple[float, dict]:
    model = omni_model()
    mbs, refs = _batch(all_audio)
    norm = sum(float(m["loss_mask"].sum()) for m in mbs)
    loss, new, _ = reference_step(model, refs, norm, OPT, omni_loss_sum)
    whole = StageSpec("llm", 0, OMNI.text.num_layers, has_embedding=True, has_head=True)
    parts = {k: new[k] for k in ("encoder", "audio", "llm")}
    return loss, jax.device_get(model_tree([whole], [parts], [{}]))


@pytest.mark.parametrize(
    "layout",
    [*LAYOUTS][:3] + [pytest.param(k, marks=pytest.mark.slow) for k in [*LAYOUTS][3:]],
)
@pytest.mark.seconds(30)
def test_omni_step_matches_single_device(layout):
    """Each layout's step equals the single-device one; with pooled tiles (the audio encoder on
    LLM stage 0) the tiles are shuffled over an end-padded pool (`as_pool`)."""
    lay = LAYOUTS[layout]
    apart = bool(lay.audio_stages)
    mbs = _batch(apart)[0]
    if lay.pooled_tiles:
        rng = np.random.default_rng(4)
        mbs = [as_pool(mb, rng, lay.encoder_dp, OMNI.tokens_per_tile) for mb in mbs]
    loss, got = guarded_step(OMNI, lay, mbs, OPT)
    ref_loss, ref_tree = _reference(apart)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert set(got) == {"encoder", "audio", "llm"}
    assert_trees_close(got, ref_tree)


@pytest.mark.parametrize(
    "layout",
    [*LAYOUTS][:3] + [pytest.param(k, marks=pytest.mark.slow) for k in [*LAYOUTS][3:]],
)
def test_the_memory_check_compiles_the_omni_stages_as_built(layout):
    """`train --dry-run`'s abstract stage programs of an omni layout are the built pipeline's: the
    transfers along each branch (vision and audio into LLM stage 0) move the bytes the built
    stages' transfers move for a microbatch at the same buckets, and each compiled stage holds
    the built stage's parameters (the audio encoder's on LLM stage 0 without audio stages) and
    takes its inputs (the audio rows there)."""
    from pipeline_fixtures import OMNI_AUDIO_BUCKET, OMNI_LENGTH

    from dflop_jax.contracts import BucketSet
    from dflop_jax.profiling.compile_check import check_layout
    from dflop_jax.profiling.programs import per_device_bytes
    from dflop_jax.profiling.stage_report import transfer_bytes_per_microbatch as dry_run_bytes
    from dflop_jax.runtime.driver import transfer_bytes_per_microbatch

    lay = LAYOUTS[layout]
    mb = _first_rows(_batch(True)[0][0], lay.llm_dp)  # one row per LLM shard, as packed
    buckets = BucketSet((4,), (OMNI_LENGTH,), audio=(OMNI_AUDIO_BUCKET,))
    stages = build_stages(OMNI, lay, stage_meshes(lay), 0, compute_dtype=jnp.float32)
    built = transfer_bytes_per_microbatch(stages, mb, lay.children)
    dry = dry_run_bytes(lay, buckets, OMNI, jnp.float32)
    assert dry == [{"stage": b.stage, "forward_bytes": b.forward, "backward_bytes": b.backward}
                   for b in built]  # fmt: skip
    assert len(dry) == lay.num_stages - 1 and all(d["forward_bytes"] > 0 for d in dry)
    n = lay.num_stages
    checks = check_layout(lay, buckets, [1] * n, [1.0] * n, OMNI, compute_dtype=jnp.float32)
    for check, stage in zip(checks, stages):
        assert check.params == per_device_bytes(stage.params)
    first = checks[lay.first_llm]
    if not lay.audio_stages:  # the audio rows of each of its shard's rows are its inputs
        rows = (
            mb["audio"][:1].nbytes + mb["audio_windows"][:1].nbytes + mb["audio_valid"][:1].nbytes
        )
        assert first.inputs > rows


def _first_rows(mb: dict, n: int) -> dict:
    """The microbatch's first `n` rows with their tiles (4 a row) and audio rows: each row's
    features and audio are its own, so the slice is a microbatch of `n` rows."""

    def cut(a):
        if a is None or a.shape[0] not in (ROWS, 4 * ROWS):
            return a
        return a[: n if a.shape[0] == ROWS else 4 * n]

    return {k: cut(v) for k, v in mb.items()}


OMNI_DEMO = Path(__file__).parents[2] / "configs" / "omni_demo.yaml"


def _omni_cfg(tmp_path, *extra) -> TrainConfig:
    over = [f"data.synth_dir={tmp_path / 'synth'}", f"run_dir={tmp_path / 'run'}",
            "compilation_cache=", "data.cache_dir="]  # fmt: skip
    return load_config(TrainConfig, OMNI_DEMO, [*over, *extra])


def test_omni_run_config_checks():
    """An omni run: its model, an explicit layout with audio buckets, LLM stage 0's tp dividing
    the audio heads; refused in one line naming the key otherwise."""
    tmp = Path("/nonexistent")  # nothing is written at config load
    cfg = _omni_cfg(tmp)
    model = cfg.model_config()
    assert model.audio.audio.num_mel_bins == cfg.data.audio_mels == 80
    assert cfg.layout.buckets().audio == (1024, 4096)
    bad = {
        "layout.audio=[]": "layout.audio.*needs audio buckets",
        "layout.audio=[1000,998]": "layout.audio.*multiples of 4",
        "layout.llm_tp=[4]": "layout.llm_tp",  # divides the decoder's 4 heads, not the tower's 2
        "model.arch=siglip-so400m+qwen2.5-0.5b": "model.kind.*built from the fields",
        "layout.audio_layers=[1]": "layout.audio_layers.*audio_num_layers=2",
        "layout.audio_layers=[2] layout.audio_dp=3": "layout.audio_dp.*divide layout.llm_dp",
        "layout.audio_layers=[2] layout.pooled_tiles=true": "layout.pooled_tiles.*no audio stages",
        "layout.encoder_colocated=true layout.encoder_layers=[] layout.encoder_tp=[] "
        "layout.pooled_tiles=true": "layout.pooled_tiles.*encoder stages of their own",
    }
    for override, match in bad.items():
        with pytest.raises(ConfigError, match=match):
            _omni_cfg(tmp, *override.split())
    apart = _omni_cfg(tmp, *VARIANTS["audio_stage"]).layout.layout()
    assert [s.module for s in apart.stages] == ["encoder", "audio", "llm", "llm"]
    assert apart.children == (2, 2, 3, -1)
    with pytest.raises(ConfigError, match="layout.audio.*no audio encoder"):
        _omni_cfg(tmp, "model.kind=llava_ov")


@pytest.mark.seconds(28)
def test_the_dry_run_checks_an_omni_run_with_its_audio_stage(tmp_path):
    """`train --dry-run` of the omni demo with the audio encoder on a stage of its own: every stage
    compiled beside its prediction, the audio stage's FLOPs counted, and the two branches'
    transfers into LLM stage 0 reported; `plan --check` of the same config compiles every stage
    of the plan it makes."""
    import yaml

    from dflop_jax import plan, train

    args = ["--config", str(OMNI_DEMO), f"run_dir={tmp_path}", f"data.synth_dir={tmp_path / 's'}",
            "compilation_cache=", *VARIANTS["audio_stage"]]  # fmt: skip
    assert train.main([*args, "--dry-run"]) == 0
    report = yaml.safe_load((tmp_path / "dry_run.yaml").read_text())
    stages = report["layout"]
    assert len(stages) == 4 and all(s["compiled"]["params"] > 0 for s in stages)
    assert stages[1]["compiled"]["parts"] == ["audio"] and stages[1]["flops_forward"] > 0
    # the vision stage and the audio stage both feed LLM stage 0 (stage 2)
    assert [t["stage"] for t in report["transfers"]] == [0, 1, 2]
    assert plan.main([*args, "--check", "--no-progress"]) == 0
    checked = load_plan(tmp_path / "plan.yaml")
    assert len(checked.checks) == checked.layout.num_stages >= 2


# Variants of the demo's layout (its own: the vision encoder's 2 stages, the audio encoder on LLM
# stage 0): the vision encoder colocated on LLM stage 0 (the audio encoder there too), or both
# encoders on a stage of their own, side by side (2 + 2 + 4 devices).
VARIANTS = {
    "colocated": ["layout.encoder_colocated=true", "layout.encoder_layers=[]",
                  "layout.encoder_tp=[]", "layout.llm_tp=[2]"],
    "audio_stage": ["layout.encoder_layers=[2]", "layout.audio_layers=[2]", "layout.audio_dp=2"],
}  # fmt: skip


def _metrics(tmp_path) -> list[dict]:
    return [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.seconds(110)
def test_omni_demo_trains_and_resumes_on_the_other_variant(tmp_path):
    """configs/omni_demo.yaml on 8 devices with the vision encoder colocated on LLM stage 0 (the
    audio encoder there too), then resumed from its checkpoint with both encoders on a stage of their
    own: in both, audio windows reach the audio encoder (audio padding reported) and nothing
    compiles after the precompile; the resumed run takes the audio encoder's state from LLM stage 0
    into a stage of its own and exports as two HF directories (`vision/`, `audio/`). One tile bucket
    of the demo's two halves the programs to compile; the length and audio ladders keep two each.
    (The demo's own layout, both encoders apart and the audio encoder on LLM stage 0, trains in
    tests/multiprocess/test_runtime_multiprocess_omni.py, across processes and in one.)"""
    common = ["checkpoint.every=2", "data.synth_samples=48", "compute_dtype=float32",
              "scheduler.solver=greedy", "layout.tiles=[8]"]  # fmt: skip
    report = run(_omni_cfg(tmp_path, "steps=2", *common, *VARIANTS["colocated"]))
    assert len(report.losses) == 2 and np.all(np.isfinite(report.losses))
    assert report.summary["programs_after_precompile"] == 0
    assert report.layout.encoder_stages == () and report.layout.audio_stages == ()
    rows = _metrics(tmp_path)
    heard = [r["audio_padding_ratio"] for r in rows if r["audio_padding_ratio"] is not None]
    assert heard and min(heard) < 1.0  # the audio encoder ran real frames

    again = run(_omni_cfg(tmp_path, "steps=3", *common, *VARIANTS["audio_stage"]))
    assert again.first_step == 2 and len(again.losses) == 1 and np.isfinite(again.losses[0])
    assert again.summary["programs_after_precompile"] == 0
    assert len(again.layout.encoder_stages) == len(again.layout.audio_stages) == 1
    resumed = [r for r in _metrics(tmp_path) if r["step"] == 3]
    # every microbatch runs the audio stage: an audio bucket each
    assert resumed and all(r["audio_padding_ratio"] is not None for r in resumed)
    run_dir = tmp_path / "run"
    cfg = run_config(run_dir)
    model_cfg = RunContext.build(cfg, read_plan=False).model_cfg
    exported = export_run(cfg, model_cfg, run_dir, tmp_path / "hf")
    assert exported.step == 3  # the resumed run's last step
    assert {p.parent.name for p in exported.files} == {"vision", "audio"}


@pytest.mark.slow
@pytest.mark.seconds(45)
def test_checkpoint_moves_the_audio_encoder_between_llm_stage_0_and_its_own_stage(tmp_path):
    """The audio encoder's params and optimizer state saved from LLM stage 0 (`OmniFirstStage`)
    restore exactly into a layout giving it a stage of its own and back: the model-level tree
    (`runtime/checkpoint.py`) stores it as module "audio" whichever stage held it, and the restored
    run computes the same next loss."""
    from dflop_jax.runtime.checkpoint import Checkpointer

    mbs, _ = _batch(True)  # every microbatch has audio: both layouts run both

    def built(lay, seed):
        stages = build_stages(OMNI, lay, stage_meshes(lay), seed, compute_dtype=jnp.float32)
        return stages, [StageOptimizer(s, OPT.build()) for s in stages]

    def step(stages, opts):
        return pipeline_step(stages, opts, mbs, OPT.clip_norm)

    def tree(lay, stages, opts):
        return model_tree(list(lay.stages), [s.params for s in stages], [o.state for o in opts])

    ckpt = Checkpointer(tmp_path / "ckpt", keep=3, async_save=False)
    layouts = [SEPARATE, AUDIO_APART, SEPARATE]
    stages, opts = built(layouts[0], 0)
    step(stages, opts)
    for n, (old, new) in enumerate(zip(layouts, layouts[1:]), start=1):
        ckpt.save(n, list(old.stages), [s.params for s in stages], [o.state for o in opts], meta={})
        moved, moved_opts = built(new, n)  # another init: the restore must overwrite all of it
        params, states, _ = ckpt.restore(list(new.stages), [s.params for s in moved],
                                         [o.state for o in moved_opts], n)  # fmt: skip
        for s, o, p, st in zip(moved, moved_opts, params, states):
            s.params, o.state = p, st
        assert_trees_close(tree(new, moved, moved_opts), tree(old, stages, opts), rtol=0, atol=0)
        np.testing.assert_allclose(step(moved, moved_opts), step(stages, opts), rtol=1e-5)
        stages, opts = moved, moved_opts
    ckpt.close()


@pytest.mark.slow
@pytest.mark.seconds(75)
def test_omni_demo_trains_the_planners_layout(tmp_path):
    """plan=auto on the omni demo: the model profiler times both encoders (the audio kinds too),
    the planner places them from those measured costs and picks the audio ladder on the data's
    shapes (audio included), the run trains that plan with nothing compiled after the precompile,
    and its plan.yaml trains again as a plan file."""
    profile = ["profile.tps=[1]", "profile.encoder_buckets=[8]", "profile.llm_buckets=[1024]",
               "profile.audio_buckets=[1024,4096]", "profile.warmup=0", "profile.runs=1",
               "profile.data_samples=48", "profile.compute_dtype=float32", "planner.tp=[1]"]  # fmt: skip
    extra = ["steps=2", "data.synth_samples=48", "compute_dtype=float32", "plan=auto", *profile,
             "checkpoint.every=0"]  # fmt: skip
    report = run(_omni_cfg(tmp_path, *extra))
    assert len(report.losses) == 2 and np.all(np.isfinite(report.losses))
    assert report.summary["programs_after_precompile"] == 0
    plan_file = tmp_path / "run" / "auto_plan" / "plan.yaml"
    plan = load_plan(plan_file)
    assert plan.layout == report.layout and plan.buckets.audio
    sources = json.loads((tmp_path / "run" / "auto_plan" / "cost_sources.json").read_text())
    assert {"audio_embedding", "audio_layers", "audio_head"} <= set(sources)
    assert "audio_encoder" not in sources  # priced from its entries, not the fallback
    rows = _metrics(tmp_path)
    assert any(r["audio_padding_ratio"] is not None for r in rows)
    again = run(_omni_cfg(tmp_path, *extra[:3], f"plan={plan_file}",
                          f"run_dir={tmp_path / 'again'}", "steps=1"))  # fmt: skip
    assert again.layout == plan.layout and np.isfinite(again.losses[0])
