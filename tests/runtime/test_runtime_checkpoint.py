"""Checkpoint resume: N steps straight == N/2 steps, save, restore, N/2 more (same and other layout)."""

import jax
import numpy as np
import runtime_toy as toy

from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.runtime.checkpoint import Checkpointer
from dflop_jax.runtime.driver import run_pipeline
from dflop_jax.runtime.optimizer_config import OptimizerConfig
from dflop_jax.runtime.train_state import StageOptimizer, apply_updates

LAYOUT_A = Layout(
    (
        StageSpec("encoder", 0, 1, tp=1, dp=2, has_embedding=True),
        StageSpec("encoder", 1, 2, tp=1, dp=2, has_head=True),
    ),
    (
        StageSpec("llm", 0, 1, tp=2, dp=1, has_embedding=True),
        StageSpec("llm", 1, 2, tp=2, dp=1, has_head=True),
    ),
)
LAYOUT_B = Layout(
    (StageSpec("encoder", 0, 3, tp=1, dp=4, has_embedding=True, has_head=True),),
    (
        StageSpec("llm", 0, 2, tp=2, dp=1, has_embedding=True),
        StageSpec("llm", 2, 1, tp=1, dp=1, has_head=True),
    ),
)
OPT = OptimizerConfig(lr=1e-2, warmup_steps=1, decay_steps=10, clip_norm=0.5)


def _batch(step):
    rng = np.random.default_rng(100 + step)
    return [toy.make_microbatch(rng, 2, 2, 1, 16) for _ in range(2)]


def _train(stages, opts, steps):
    losses = []
    for step in steps:
        mbs = _batch(step)
        out = run_pipeline(stages, mbs, sum(float(m["loss_mask"].sum()) for m in mbs))
        losses.append(sum(float(x) for x in out.loss))
        apply_updates(opts, out.grads, OPT.clip_norm)
    return losses


def _state(layout, stages, opts):
    return list(layout.stages), [s.params for s in stages], [o.state for o in opts]


def _restore_into(ckpt, layout, stages, opts):
    params, states, meta = ckpt.restore(*_state(layout, stages, opts))
    for s, o, p, st in zip(stages, opts, params, states):
        s.params, o.state = p, st
    return meta


def test_resume_same_and_other_layout(tmp_path):
    stages = toy.build_stages(LAYOUT_A, stage_meshes(LAYOUT_A))
    initial = [jax.device_get(s.params) for s in stages]
    opts = [StageOptimizer(s, OPT.build()) for s in stages]
    straight = _train(stages, opts, range(4))
    final = [jax.device_get(s.params) for s in stages]

    for s, p, o in zip(stages, initial, opts):
        s.params = jax.device_put(p, s.param_shardings)
        o.state = o.init_state()
    first = _train(stages, opts, range(2))
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2)
    ckpt.save(2, *_state(LAYOUT_A, stages, opts), meta={"note": "half"})
    ckpt.wait()
    _train(stages, opts, range(7, 9))  # diverge, then restore the saved state
    meta = _restore_into(ckpt, LAYOUT_A, stages, opts)
    assert meta["step"] == 2 and meta["note"] == "half"
    resumed = first + _train(stages, opts, range(2, 4))
    assert resumed == straight  # bit-identical on the same layout
    for s, ref in zip(stages, final):
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(s.params), ref)

    # Another layout (different stage split, tp and dp) restores the same model state.
    stages_b = toy.build_stages(LAYOUT_B, stage_meshes(LAYOUT_B), seed=5)
    opts_b = [StageOptimizer(s, OPT.build()) for s in stages_b]
    _restore_into(ckpt, LAYOUT_B, stages_b, opts_b)
    resumed_b = first + _train(stages_b, opts_b, range(2, 4))
    np.testing.assert_allclose(resumed_b, straight, rtol=1e-5)
    merged = {"encoder": {}, "llm": {}}
    for spec, s in zip(LAYOUT_B.stages, stages_b):
        merged[spec.module].update(jax.device_get(s.params))
    for spec, ref in zip(LAYOUT_A.stages, final):
        for k, v in ref.items():
            jax.tree.map(
                lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                merged[spec.module][k],
                v,
            )
    ckpt.close()


def test_a_save_missing_from_one_group_is_not_a_checkpoint(tmp_path):
    """Multi-process saves span several orbax managers (one per group of processes): a step counts only
    when every group listed in process 0's meta committed it; a resumed run discards such leftovers
    (committed or temporary) and can save those steps again."""
    stages = toy.build_stages(LAYOUT_A, stage_meshes(LAYOUT_A))
    opts = [StageOptimizer(s, OPT.build()) for s in stages]
    ckpt = Checkpointer(tmp_path / "ckpt", keep=3)
    for step in (2, 4):
        ckpt.save(step, *_state(LAYOUT_A, stages, opts), meta={})
    ckpt.wait()
    assert ckpt.latest_step() == 4
    meta = tmp_path / "ckpt" / "procs_0" / "4" / "meta" / "meta.json"
    # As if a second group (processes 0 and 1) was killed before committing step 4.
    meta.write_text(meta.read_text().replace('"procs_0"', '"procs_0", "procs_0-1"'))
    (tmp_path / "ckpt" / "procs_0" / "6.orbax-checkpoint-tmp").mkdir()
    assert ckpt.latest_step() == 2
    ckpt.discard_after(2)
    assert sorted(p.name for p in (tmp_path / "ckpt" / "procs_0").iterdir()) == ["2"]
    fresh = Checkpointer(tmp_path / "ckpt", keep=3)  # the resumed run's
    fresh.save(4, *_state(LAYOUT_A, stages, opts), meta={"again": True})
    fresh.close()
    assert fresh.latest_step() == 4
    assert _restore_into(fresh, LAYOUT_A, stages, opts)["again"] is True
