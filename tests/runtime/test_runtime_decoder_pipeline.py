"""Real decoder (models.decoder) pipelined over 3 LLM stages == single-device jax.grad reference, in 1F1B and
GPipe order (the order changes when each microbatch runs, never the summed gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from models_fixtures import tiny_decoder_config
from pipeline_fixtures import DECODER_LAYOUT, decoder_loss_sum, decoder_microbatch
from pipeline_reference import assert_trees_close, reference_step

from dflop_jax.contracts.layout import StageSpec
from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.programs.param_paths import key_name, tied_groups
from dflop_jax.programs.stage_builder import build_stages
from dflop_jax.runtime.checkpoint import model_tree
from dflop_jax.runtime.driver import run_pipeline
from dflop_jax.runtime.optimizer_config import OptimizerConfig
from dflop_jax.runtime.train_state import StageOptimizer, apply_updates
from models.decoder import Decoder

OPT = OptimizerConfig(lr=1e-2, warmup_steps=1, decay_steps=10, clip_norm=1.0)


def _leaf(tree, names):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if tuple(key_name(k) for k in path) == names:
            return leaf
    raise KeyError(names)


@pytest.mark.parametrize(
    "order, tie, residuals",
    [("1f1b", False, "all"), ("1f1b", True, "recompute"), ("gpipe", True, "layers"),
     ("1f1b", True, "all")],
)  # fmt: skip
def test_decoder_pipeline_matches_reference(order, tie, residuals):
    """tie=True: the embedding is also the head (Qwen2.5-0.5B style), held by stages 0 and 2.
    Every residual policy gives the reference's step; a saving one never runs the recompute
    backward (its inner stages ran the residual programs only)."""
    cfg = tiny_decoder_config(num_layers=3, dtype="float32", tie_embeddings=tie)
    with jax.default_device(jax.devices()[0]):
        decoder = Decoder(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    mbs = [
        decoder_microbatch(rng, cfg.vocab_size, 2, 16) for _ in range(3)
    ]  # one bucket: one compile each
    norm = sum(float(m["loss_mask"].sum()) for m in mbs)
    stages = build_stages(cfg, DECODER_LAYOUT, stage_meshes(DECODER_LAYOUT), 0,
                          compute_dtype=jnp.float32, residuals=[residuals] * 3)  # fmt: skip
    opts = [StageOptimizer(s, OPT.build()) for s in stages]
    tied = tied_groups(list(DECODER_LAYOUT.stages), [s.params for s in stages])
    assert [[i for i, _ in group] for group in tied] == ([[0, 2]] if tie else [])
    out = run_pipeline(stages, mbs, norm, order)
    saving = residuals != "recompute"
    for stage in stages[:-1]:
        kinds = {sig[0] for sig in stage.signatures}
        assert kinds == ({"fwd_res", "bwd_res"} if saving else {"fwd", "bwd"})
    loss = sum(float(x) for x in out.loss)
    norm_got = np.asarray(apply_updates(opts, out.grads, OPT.clip_norm, tied=tied)[-1])[1]

    ref_loss, ref_params, ref_norm = reference_step(decoder, mbs, norm, OPT, decoder_loss_sum)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(norm_got, ref_norm, rtol=1e-5)  # the tied matrix counted once
    for group in tied:  # both copies took the same update
        copies = [_leaf(stages[i].params, path) for i, path in group]
        np.testing.assert_array_equal(*map(np.asarray, copies))
    specs = list(DECODER_LAYOUT.stages)
    got = model_tree(specs, [s.params for s in stages], [{} for _ in stages])["llm"]
    want = model_tree([StageSpec("llm", 0, 3)], [ref_params["stage"]], [{}])["llm"]
    assert_trees_close(got, want)
