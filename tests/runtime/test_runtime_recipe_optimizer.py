"""Training recipes in the optimizer: `optimizer.trainable` freezes parts (no state, no gradient, no
update, no share of the gradient norm) and `optimizer.lr_scale` / `weight_decay_scale` slow parts down,
checked against plain optax AdamW applied to each part on its own; the state of a recipe checkpoints
and restores; stages and an optimizer built from different trainable parts are refused."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from dflop_jax.config import ConfigError, load_config
from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.programs.model_section import ModelConfig
from dflop_jax.programs.param_paths import key_name
from dflop_jax.programs.stage_builder import build_stages
from dflop_jax.programs.transfer import put_host
from dflop_jax.programs.trees import prune
from dflop_jax.runtime.checkpoint import Checkpointer
from dflop_jax.runtime.config import LayoutConfig, TrainConfig
from dflop_jax.runtime.optimizer_config import OptimizerConfig
from dflop_jax.runtime.train_state import STATS, StageOptimizer

BASE = dict(lr=1e-2, warmup_steps=0, decay_steps=10, weight_decay=0.1)


@pytest.fixture(scope="module")
def built():
    """A tiny LLaVA-OV: one encoder stage (vision + projector, tp 2, dp 2: ZeRO-1 shards), two LLM
    stages; `build(trainable)` makes its stages for a recipe."""
    cfg = TrainConfig(
        model=ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, vision_hidden_size=16,
                          vision_intermediate_size=32, vision_num_heads=2),
        layout=LayoutConfig(encoder_layers=(2,), encoder_tp=(2,), encoder_dp=2, llm_layers=(1, 1)),
    )  # fmt: skip
    model_cfg = cfg.model.model_config(300, tile_px=28, patch_size=7, compute_dtype="float32")
    layout = cfg.layout.layout()
    cache = {}

    def build(trainable=("vision", "projector", "llm")):
        if trainable not in cache:
            cache[trainable] = build_stages(
                model_cfg, layout, stage_meshes(layout), 0, trainable=trainable
            )
        return layout, cache[trainable]

    return build


def _part(tree, part):
    return {k: v for k, v in tree.items() if k == part}


def _grads(params, seed):
    leaves, treedef = jax.tree.flatten(jax.device_get(params))
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(
        treedef, [rng.standard_normal(x.shape).astype(np.float32) for x in leaves]
    )


def _adamw_step(params, grads, lr_scale=1.0, wd_scale=1.0):
    """One plain optax AdamW step (the reference), on host arrays."""
    cfg = OptimizerConfig(**BASE)
    tx = optax.adamw(
        lambda s: lr_scale * cfg.schedule()(s),
        b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay * wd_scale,
        mask=lambda p: jax.tree.map(lambda a: a.ndim >= 2, p),
    )  # fmt: skip
    updates, _ = tx.update(grads, tx.init(params), params)
    return optax.apply_updates(params, updates)


def _array_state_paths(state):
    return [
        "/".join(key_name(k) for k in path)
        for path, x in jax.tree_util.tree_flatten_with_path(state)[0]
        if np.ndim(x) > 0
    ]


def _applied(opt):
    """A `STATS` vector that applies the update unclipped (clip_norm 0) on the stage's mesh."""
    stats = dict.fromkeys(STATS, 0.0) | {"applied": 1.0}
    return put_host(np.array([stats[k] for k in STATS], np.float32), opt.scalar)


def _step(stage, cfg, grads):
    """One update from `grads` of every leaf, of which the stage's trained ones are given to the
    optimizer (as `StageOptimizer.reduce` leaves them: in the ZeRO-1 layout)."""
    opt = StageOptimizer(stage, cfg.build())
    before = jax.device_get(stage.params)
    grads = jax.device_put(prune(grads, stage.trained), opt.grad_shardings)
    sq = float(opt.sq_norm(grads)[0]) if opt.trains else 0.0
    opt.apply(grads, _applied(opt))
    after = jax.device_get(stage.params)
    stage.params = jax.device_put(before, stage.param_shardings)  # leave the fixture as it was
    return opt, before, after, sq


def _sq(tree):
    return sum(float(np.sum(np.square(x, dtype=np.float64))) for x in jax.tree.leaves(tree))


def test_projector_only_freezes_vision_and_llm(built):
    layout, progs = built(("projector",))
    cfg = OptimizerConfig(**BASE, trainable=("projector",))
    enc = progs[0]
    assert [s.trains for s in progs] == [True, False, False]
    grads = _grads(enc.params, 1)
    opt, before, after, sq = _step(enc, cfg, grads)
    paths = _array_state_paths(opt.state)
    assert paths and all("/projector/" in p for p in paths), paths  # no state for the vision tower
    np.testing.assert_allclose(sq, _sq(_part(grads, "projector")), rtol=1e-5)
    jax.tree.map(np.testing.assert_array_equal, after["vision"], before["vision"])
    want = _adamw_step(_part(before, "projector"), _part(grads, "projector"))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        _part(after, "projector"),
        want,
    )
    for llm in progs[1:]:  # a stage with nothing trained: no state, no gradient, no change
        opt, before, after, _ = _step(llm, cfg, _grads(llm.params, 2))
        assert _array_state_paths(opt.state) == [] and jax.tree.leaves(opt.grad_shardings) == []
        assert jax.tree.leaves(llm.zero_grads()) == []  # no accumulator either
        jax.tree.map(np.testing.assert_array_equal, after, before)


def test_vision_at_a_fifth_of_the_rate(built):
    layout, progs = built()
    cfg = OptimizerConfig(**BASE, lr_scale={"vision": 0.2}, weight_decay_scale={"vision": 0.5})
    enc = progs[0]
    grads = _grads(enc.params, 3)
    _, before, after, sq = _step(enc, cfg, grads)
    np.testing.assert_allclose(sq, _sq(grads), rtol=1e-5)
    for part, lr, wd in (("vision", 0.2, 0.5), ("projector", 1.0, 1.0)):
        want = _adamw_step(_part(before, part), _part(grads, part), lr, wd)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
            _part(after, part),
            want,
        )


def test_a_recipe_state_checkpoints_and_restores(built, tmp_path):
    layout, progs = built(("projector", "llm"))
    cfg = OptimizerConfig(**BASE, trainable=("projector", "llm"), lr_scale={"llm": 0.5})
    opts = [StageOptimizer(s, cfg.build()) for s in progs]
    for i, (s, o) in enumerate(zip(progs, opts)):
        grads = prune(_grads(s.params, 10 + i), s.trained)
        o.apply(jax.device_put(grads, o.grad_shardings), _applied(o))
    ckpt = Checkpointer(tmp_path / "ckpt", async_save=False)
    specs, params, states = list(layout.stages), [s.params for s in progs], [o.state for o in opts]
    ckpt.save(1, specs, params, states, meta={})
    fresh = [StageOptimizer(s, cfg.build()) for s in progs]
    got_params, got, _ = ckpt.restore(specs, params, [o.state for o in fresh])
    ckpt.close()
    for a, b in zip(got + got_params, states + params):  # frozen params included
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))


def test_stages_and_optimizer_must_agree_on_what_is_trained(built):
    _, progs = built(("projector",))
    plain = OptimizerConfig(**BASE)  # every part trained: state for the frozen vision tower
    with pytest.raises(ValueError, match="same optimizer.trainable"):
        StageOptimizer(progs[0], plain.build())


@pytest.mark.parametrize(
    "override, key",
    [
        ("optimizer.trainable=[vision,vision]", "optimizer.trainable"),
        ("optimizer.trainable=[]", "optimizer.trainable"),
        ("optimizer.trainable=[text]", "optimizer.trainable"),
        ("optimizer.lr_scale={text: 0.2}", "optimizer.lr_scale"),
        ("optimizer.lr_scale={vision: 0}", "optimizer.lr_scale"),
        ("optimizer.weight_decay_scale={vision: -1}", "optimizer.weight_decay_scale"),
    ],
)
def test_bad_recipes_are_config_errors(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(TrainConfig, None, ["plan=explicit", override])


def test_recipe_overrides_parse():
    cfg = load_config(
        TrainConfig, None, ["optimizer.trainable=[projector]", "optimizer.lr_scale={vision: 0.2}"]
    )
    assert cfg.optimizer.trainable == ("projector",) and cfg.optimizer.lr_scale == {"vision": 0.2}
