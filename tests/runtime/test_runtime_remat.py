"""Remat is a choice: a stage trained with remat on or off gives the same loss and gradients (float32),
its compiled temporaries shrink with remat (read from `memory_analysis()`), and the policy reaches the
model from the training config and from a plan.yaml."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflop_jax.config import ConfigError, load_config
from dflop_jax.contracts.layout import StageSpec
from dflop_jax.profiling.programs import profile_mesh, stage_program
from dflop_jax.programs.model_section import model_config_for_arch
from dflop_jax.runtime.config import TrainConfig
from models.stage_modules import with_remat

TINY = model_config_for_arch("tiny", "float32")
CFG = dataclasses.replace(
    TINY, vision=TINY.vision.replace(num_layers=6), text=TINY.text.replace(num_layers=6)
)
# the last LLM stage (forward + loss + backward fused, as it trains) and a middle encoder stage
STAGES = {
    "llm": (StageSpec("llm", 0, 6, tp=1, has_embedding=True, has_head=True), 256),
    "encoder": (StageSpec("encoder", 0, 6, tp=1), 32),
}


def _train_step(policy: str, module: str):
    """(loss or output-gradient pull, accumulated gradients, temp bytes) of one training program."""
    spec, bucket = STAGES[module]
    cfg = with_remat(CFG, {"vision": policy, "llm": policy})
    prog = stage_program(cfg, spec, profile_mesh(jax.devices(), 1), bucket, jnp.float32)
    with jax.set_mesh(prog.mesh):
        compiled = prog.bwd.lower(
            prog.params_abs, prog.x_abs, prog.side_abs, prog.seed_abs, prog.gacc_abs
        ).compile()
        rng = np.random.default_rng(0)
        params = prog.make_params(rng)
        x, side, seed = prog.make_inputs(rng)
        gacc = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding), prog.gacc_abs)
        out = compiled(params, x, side, seed, gacc)
    return out[0], out[-1], compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("module", ["llm", "encoder"])
def test_remat_keeps_loss_and_grads_and_shrinks_temporaries(module):
    first, grads, temp = _train_step("none", module)
    for policy in ("full", "dots"):
        first_r, grads_r, temp_r = _train_step(policy, module)
        np.testing.assert_allclose(np.asarray(first_r), np.asarray(first), rtol=1e-6, atol=1e-7)
        # float32 rounding grows through the layers' backward (recomputed forwards reassociate
        # sums): each leaf is compared to 1e-6 of its own magnitude besides 1e-5 of each element
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                                    atol=1e-6 * float(np.abs(b).max())),
            grads_r, grads,
        )  # fmt: skip
        assert temp_r < temp, f"{module} remat={policy}: temp {temp_r} >= {temp} without remat"
    _, _, temp_full = _train_step("full", module)
    assert temp_full < 0.6 * temp  # six layers' residuals -> one layer's plus the inputs


def test_model_config_remat_is_validated_and_applied(tmp_path):
    cfg = load_config(TrainConfig, None, ["model.vision_remat=full", "model.llm_remat=dots"])
    assert cfg.model.remat == {"vision": "full", "llm": "dots"}
    model_cfg = cfg.model.model_config(512, tile_px=56, patch_size=14, compute_dtype="float32")
    assert (model_cfg.vision.remat, model_cfg.text.remat) == ("full", "dots")
    with pytest.raises(ConfigError, match="model.llm_remat"):
        load_config(TrainConfig, None, ["model.llm_remat=some"])


def test_training_from_a_plan_applies_its_remat(tmp_path):
    from plan_fixtures import tiny_analytic_plan

    from dflop_jax.planner import load_plan, save_plan
    from dflop_jax.resolve.run_context import with_plan_remat

    plan = tiny_analytic_plan()
    path = save_plan(dataclasses.replace(plan, cost_provider=plan.cost_provider + "+remat"),
                     tmp_path / "plan.yaml")  # fmt: skip
    assert load_plan(path).remat == {"vision": "full", "llm": "full"}
    cfg = dataclasses.replace(TrainConfig(), plan=str(path))
    assert with_plan_remat(cfg, load_plan(path)).model.remat == {"vision": "full", "llm": "full"}
    assert with_plan_remat(TrainConfig(), None).model.remat == {"vision": "none", "llm": "none"}
