"""The update runs on device: over several steps the pipelined run (global-norm clipping combined from
per-stage squared norms on the last stage's mesh, a tied embedding counted once) equals a single-device
optax.chain(clip_by_global_norm, adamw) run, with no device-to-host transfer while a step is issued;
a step whose gradients or loss are not finite leaves params and optimizer state untouched and is
counted."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from models_fixtures import tiny_decoder_config
from pipeline_fixtures import DECODER_LAYOUT, decoder_loss_sum, decoder_microbatch
from pipeline_reference import assert_trees_close

from dflop_jax.contracts.layout import StageSpec
from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.programs.param_paths import tied_groups
from dflop_jax.programs.stage_builder import build_stages
from dflop_jax.runtime.checkpoint import model_tree
from dflop_jax.runtime.driver import run_pipeline
from dflop_jax.runtime.optimizer_config import OptimizerConfig
from dflop_jax.runtime.train_state import STATS, StageOptimizer, apply_updates, lower_update
from models.decoder import Decoder

# A small clip_norm so that clipping is active on every step (the gradient norm is ~1 here).
OPT = OptimizerConfig(lr=1e-2, warmup_steps=1, decay_steps=10, clip_norm=0.25)


def _setup():
    cfg = tiny_decoder_config(num_layers=3, dtype="float32", tie_embeddings=True)
    with jax.default_device(jax.devices()[0]):
        decoder = Decoder(cfg, rngs=nnx.Rngs(0))
    stages = build_stages(
        cfg, DECODER_LAYOUT, stage_meshes(DECODER_LAYOUT), 0, compute_dtype=jnp.float32
    )
    opts = [StageOptimizer(s, OPT.build()) for s in stages]
    tied = tied_groups(list(DECODER_LAYOUT.stages), [s.params for s in stages])
    rng = np.random.default_rng(0)
    batches = [[decoder_microbatch(rng, cfg.vocab_size, 2, 16) for _ in range(3)] for _ in range(3)]
    return decoder, stages, opts, tied, batches


def _reference_run(decoder, batches):
    """Losses, gradient norms and final params of single-device steps with persistent optax state."""
    graphdef, params = nnx.split(decoder)
    tx = optax.chain(optax.clip_by_global_norm(OPT.clip_norm), OPT.build())
    state = tx.init(params)

    @jax.jit
    def step(params, state, mbs, norm):
        def loss(p):
            model = nnx.merge(graphdef, p)
            return sum(decoder_loss_sum(model, mb) for mb in mbs) / norm

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        return value, optax.tree.norm(grads), optax.apply_updates(params, updates), state

    losses, norms = [], []
    for mbs in batches:
        norm = sum(float(m["loss_mask"].sum()) for m in mbs)
        value, gnorm, params, state = step(params, state, mbs, norm)
        losses.append(float(value))
        norms.append(float(gnorm))
    return losses, norms, params


def _stats(copies) -> dict:
    return dict(zip(STATS, np.asarray(copies[-1]).tolist()))


@pytest.mark.parametrize("kept", [False, True])
def test_device_update_matches_optax_over_steps_without_host_transfers(kept):
    """`kept`: every program of the update (the optimizers', a tied group's sum and correction,
    the step's statistics, the transfers) named with its devices and run as the compiled program
    handed to its owner, as a process's executable store gives them (`programs/executable_store.py`)."""
    decoder, stages, opts, tied, batches = _setup()
    if kept:
        lowerings = lower_update(opts, OPT.clip_norm, tied) + [lw for o in opts for lw in o.lower()]
        assert tied and all(lw.devices and lw.keep for lw in lowerings)
        for lw in lowerings:
            lw.keep(lw.lowered.compile())
    want_losses, want_norms, want_params = _reference_run(decoder, batches)
    stats, got = None, []
    for mbs in batches:
        # Issuing a step reads nothing back (the loss normalizer is counted on device).
        with jax.transfer_guard_device_to_host("disallow_explicit"):
            out = run_pipeline(stages, mbs, None, "1f1b")
            copies = apply_updates(opts, out.grads, OPT.clip_norm, out.loss, stats, tied=tied)
        stats = copies[-1]
        got.append(_stats(copies))
    assert min(want_norms) > OPT.clip_norm  # clipping was active on every step
    np.testing.assert_allclose([g["loss"] for g in got], want_losses, rtol=1e-5)
    np.testing.assert_allclose([g["grad_norm"] for g in got], want_norms, rtol=1e-5)
    assert [(g["applied"], g["skipped_steps"]) for g in got] == [(1.0, 0.0)] * 3
    # Every stage's mesh got the same statistics.
    for c in copies:
        np.testing.assert_array_equal(np.asarray(c), np.asarray(copies[-1]))
    tree = model_tree(list(DECODER_LAYOUT.stages), [s.params for s in stages], [{} for _ in stages])
    want = model_tree([StageSpec("llm", 0, 3)], [want_params["stage"]], [{}])["llm"]
    # Adam divides each element's moment by its root mean square, so after a few steps an element whose
    # gradient is near float32 round-off of the summation order moves by a differently-rounded share
    # of lr: the bound is set against the per-step update size (1e-3 of lr), not the param size.
    assert_trees_close(tree["llm"], want, rtol=1e-5, atol=1e-3 * OPT.lr)


def _poison_grads(grads):
    """Stage gradients with one NaN in the first leaf."""
    leaves, treedef = jax.tree.flatten(grads)
    leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].set(jnp.nan)
    return jax.tree.unflatten(treedef, leaves)


def _nan_loss(loss):
    return [loss[0] * jnp.nan, *loss[1:]]


@pytest.mark.parametrize("poison", ["grads", "loss"])
def test_non_finite_step_is_skipped_on_device_and_counted(poison):
    _, stages, opts, tied, batches = _setup()
    out = run_pipeline(stages, batches[0], None, "1f1b")
    first = apply_updates(opts, out.grads, OPT.clip_norm, out.loss, None, tied=tied)
    params = jax.device_get([s.params for s in stages])
    states = jax.device_get([o.state for o in opts])

    out = run_pipeline(stages, batches[1], None, "1f1b")
    grads, loss = out.grads, out.loss
    if poison == "grads":
        grads = [_poison_grads(grads[1]) if i == 1 else g for i, g in enumerate(grads)]
    else:
        loss = _nan_loss(loss)
    with jax.transfer_guard_device_to_host("disallow_explicit"):
        bad = apply_updates(opts, grads, OPT.clip_norm, loss, first[-1], tied=tied)
    stats = _stats(bad)
    assert stats["applied"] == 0.0 and stats["skipped_steps"] == 1.0
    # A zero update: params and the whole AdamW state (moments, count) exactly as before.
    jax.tree.map(np.testing.assert_array_equal, jax.device_get([s.params for s in stages]), params)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get([o.state for o in opts]), states)

    out = run_pipeline(stages, batches[2], None, "1f1b")
    good = apply_updates(opts, out.grads, OPT.clip_norm, out.loss, bad[-1], tied=tied)
    assert (_stats(good)["applied"], _stats(good)["skipped_steps"]) == (1.0, 1.0)
    moved = jax.device_get([s.params for s in stages])
    assert any(
        not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(params))
    )
