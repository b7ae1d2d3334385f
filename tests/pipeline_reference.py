"""The single-device reference the pipeline parity tests compare against, and the tree comparison.

A pipelined step must equal one step of the unsplit model on one device: per-microbatch
`jax.value_and_grad` of the loss normalized by the whole batch's loss tokens, gradients summed, then
global-norm clipping and the optimizer's update (optax, independent of the runtime's `apply_updates`).
Under a training recipe (`optimizer.trainable`) the reference puts the frozen parts behind
`stop_gradient` and updates only the trained ones (`stop_gradient_reference`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dflop_jax.contracts.layout import StageSpec
from dflop_jax.programs.param_paths import key_name
from dflop_jax.runtime.checkpoint import model_tree
from dflop_jax.runtime.driver import run_pipeline
from dflop_jax.runtime.optimizer_config import OptimizerConfig
from dflop_jax.runtime.train_state import apply_updates


def pipeline_step(stages, opts, mbs: list[dict], clip_norm: float) -> float:
    """One pipelined 1F1B step of `mbs` (loss normalized by their loss tokens) and the runtime's
    update after it (`apply_updates`); the step's loss."""
    out = run_pipeline(stages, mbs, sum(float(m["loss_mask"].sum()) for m in mbs), "1f1b")
    apply_updates(opts, out.grads, clip_norm)
    return sum(float(x) for x in out.loss)


def guarded_step(model_cfg, layout, mbs: list[dict], opt) -> tuple[float, dict]:
    """(loss, updated params by module) of one 1F1B step of `model_cfg`'s stages on `layout`
    (seed 0, float32), the pipeline under `no_host_round_trip`, then the runtime's update: what a
    parity test compares with `reference_step`'s (its tree through `model_tree` too)."""
    from dflop_jax.programs.meshes import stage_meshes
    from dflop_jax.programs.stage_builder import build_stages
    from dflop_jax.runtime.train_state import StageOptimizer

    norm = sum(float(m["loss_mask"].sum()) for m in mbs)
    stages = build_stages(model_cfg, layout, stage_meshes(layout), 0, compute_dtype=jnp.float32)
    opts = [StageOptimizer(s, opt.build()) for s in stages]
    with no_host_round_trip():
        out = run_pipeline(stages, mbs, norm, "1f1b")
    loss = sum(float(x) for x in out.loss)
    apply_updates(opts, out.grads, opt.clip_norm)
    tree = model_tree(list(layout.stages), [s.params for s in stages], [{} for _ in stages])
    return loss, tree


def reference_step(model, mbs: list[dict], norm: float, opt, loss_sum: Callable):
    """(summed normalized loss, updated params, gradient global norm) of one single-device step.

    Args:
      model: the unsplit nnx model (its state is not changed).
      mbs: the microbatches (dicts of numpy arrays).
      norm: the batch's loss-token count.
      opt: an `OptimizerConfig` (its `clip_norm` and `build()`).
      loss_sum: (merged model, microbatch) -> summed loss of that microbatch.
    """
    graphdef, params = nnx.split(model)

    @jax.jit
    def grad_mb(params, mb):
        return jax.value_and_grad(lambda p: loss_sum(nnx.merge(graphdef, p), mb) / norm)(params)

    outs = [grad_mb(params, mb) for mb in mbs]
    grads = jax.tree.map(lambda *g: sum(g), *[g for _, g in outs])
    tx = optax.chain(optax.clip_by_global_norm(opt.clip_norm), opt.build())
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    loss = sum(float(v) for v, _ in outs)
    return loss, optax.apply_updates(params, updates), float(optax.tree.norm(grads))


# The recipe tests' optimizer: lr > 0 at step 0 (no warmup), so the step changes the trained parts.
# Adam's first step is about lr * sign(g); eps 1e-3 keeps it smooth in g where g is near 0 (float32
# round-off of a tiny gradient would otherwise flip a whole lr-sized step).
RECIPE_HYPERPARAMS = dict(lr=1e-2, warmup_steps=0, decay_steps=10, clip_norm=1.0, eps=1e-3)
# The training recipes the tests step, by name: the parts each trains (`optimizer.trainable`).
TRAINABLE_BY_RECIPE = {"projector_only": ("projector",), "vision_frozen": ("projector", "llm")}


def _part(path) -> str:
    """The recipe part of a leaf of the UNSPLIT model (encoder/vision, encoder/projector, llm/...)."""
    names = [key_name(k) for k in path]
    return names[1] if names[0] == "encoder" else "llm"


class _RecipeOptimizer:
    """The single-device optimizer of a recipe, independent of the runtime's labels: AdamW on the
    trained parts of the unsplit model, `set_to_zero` on the frozen ones."""

    def __init__(self, trainable):
        self.clip_norm, self.trainable = RECIPE_HYPERPARAMS["clip_norm"], trainable

    def build(self):
        labels = lambda params: jax.tree_util.tree_map_with_path(
            lambda path, _: "train" if _part(path) in self.trainable else "frozen", params
        )
        adamw = OptimizerConfig(**RECIPE_HYPERPARAMS).build()  # plain AdamW (every part trained)
        return optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, labels)


def _stop_frozen(loss, trainable):
    """`loss` of the model with its frozen parts behind `stop_gradient`."""

    def frozen_loss(model, mb):
        graphdef, state = nnx.split(model)
        state = jax.tree_util.tree_map_with_path(
            lambda path, a: a if _part(path) in trainable else jax.lax.stop_gradient(a), state
        )
        return loss(nnx.merge(graphdef, state), mb)

    return frozen_loss


def stop_gradient_reference(model, mbs, loss, trainable) -> tuple[float, float, dict]:
    """(loss, global gradient norm, updated model tree) of one single-device step of the unsplit MLLM
    `model` with its frozen parts behind `stop_gradient`, under `RECIPE_HYPERPARAMS`."""
    norm = sum(float(m["loss_mask"].sum()) for m in mbs)
    ref_loss, new, ref_norm = reference_step(
        model, mbs, norm, _RecipeOptimizer(trainable), _stop_frozen(loss, trainable)
    )
    return ref_loss, ref_norm, unsplit_tree(model.cfg, new)


def unsplit_tree(cfg, state) -> dict:
    """The model tree (`model_tree`'s paths) of the unsplit LLaVA-OV's state (3 LLM layers)."""
    specs = [StageSpec("encoder", 0, cfg.vision.num_layers), StageSpec("llm", 0, 3)]
    return model_tree(specs, [state["encoder"], state["llm"]], [{}, {}])


def assert_trees_close(got, want, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Same leaves (by path) and values within float32 round-off of a few operations."""
    flat_got = jax.tree_util.tree_flatten_with_path(jax.device_get(got))[0]
    flat_want = dict(jax.tree_util.tree_flatten_with_path(jax.device_get(want))[0])
    assert len(flat_got) == len(flat_want)
    for path, value in flat_got:
        np.testing.assert_allclose(value, flat_want[path], rtol=rtol, atol=atol, err_msg=str(path))


@contextlib.contextmanager
def no_host_round_trip():
    """Fails the test on any host round trip of device data: implicit device->host copies (transfer
    guard) and an explicit `jax.device_put` between non-aligned shardings, whose reshard falls back
    to a copy through host memory that the guard does not see (DESIGN section 11). A device_put
    whose source shards, in their order, hold the blocks the destination's devices take in theirs
    (on other devices) is a device-to-device copy of each block and passes (`programs/transfer.py`
    routes aligned stage transfers so)."""
    original = jax.device_put

    def aligned_only(x, device=None, *args, **kwargs):
        if not (isinstance(x, jax.Array) and isinstance(device, jax.sharding.NamedSharding)
                and _blocks_line_up(x, device)):  # fmt: skip
            raise AssertionError(
                "jax.device_put between non-aligned shardings in the pipelined step (stage data "
                "must move by transfer)"
            )
        return original(x, device, *args, **kwargs)

    jax.device_put = aligned_only
    try:
        with jax.transfer_guard_device_to_host("disallow"):
            yield
    finally:
        jax.device_put = original


def _blocks_line_up(x: jax.Array, dst: jax.sharding.NamedSharding) -> bool:
    """x's shards, in order, hold the boxes dst's devices (in mesh order, all other devices) take."""
    held = [tuple(i.indices(n)[:2] for i, n in zip(s.index, x.shape)) for s in x.addressable_shards]
    boxes = dst.devices_indices_map(x.shape)
    want = [
        tuple(i.indices(n)[:2] for i, n in zip(boxes[d], x.shape)) for d in dst.mesh.devices.flat
    ]
    others = x.sharding.device_set.isdisjoint(dst.device_set)
    return others and held == want
