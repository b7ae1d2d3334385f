"""The single-device reference the pipeline parity tests compare against, and the tree comparison.

A pipelined step must equal one step of the unsplit model on one device: per-microbatch
`jax.value_and_grad` of the loss normalized by the whole batch's loss tokens, gradients summed, then
global-norm clipping and the optimizer's update (optax, independent of the runtime's `apply_updates`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
import numpy as np
import optax
from flax import nnx


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
    guard) and explicit `jax.device_put`, whose reshard between non-aligned shardings falls back to a
    copy through host memory that the guard does not see (DESIGN section 11)."""

    def forbidden(*args, **kwargs):
        raise AssertionError(
            "jax.device_put in the pipelined step (stage data must move by transfer)"
        )

    original = jax.device_put
    jax.device_put = forbidden
    try:
        with jax.transfer_guard_device_to_host("disallow"):
            yield
    finally:
        jax.device_put = original
