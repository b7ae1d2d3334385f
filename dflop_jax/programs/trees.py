"""Parameter-tree helpers of the stage programs: trained / frozen halves, casts, accumulators."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

PyTree = Any


def _is_none(x) -> bool:
    return x is None


def prune(tree: PyTree, keep: PyTree | None) -> PyTree:
    """`tree` with the leaves where `keep` (a bool tree of the same structure) is False replaced by
    None, an empty subtree: what jax sees of it is the kept leaves only. keep None keeps all."""
    if keep is None:
        return tree
    return jax.tree.map(lambda a, k: a if k else None, tree, keep)


def graft(trained: PyTree, frozen: PyTree) -> PyTree:
    """The whole tree from its two `prune`d halves (each leaf from the half that holds it)."""
    return jax.tree.map(lambda t, f: f if t is None else t, trained, frozen, is_leaf=_is_none)


def negate(keep: PyTree) -> PyTree:
    return jax.tree.map(lambda k: not k, keep)


def all_trained(params: PyTree) -> PyTree:
    """The `trained` mask of a stage that trains every leaf."""
    return jax.tree.map(lambda _: True, params)


def cast_floating(tree: PyTree, dtype: jnp.dtype) -> PyTree:
    """Casts the floating leaves of `tree` to `dtype` (integer leaves untouched)."""
    return jax.tree.map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
    )


def accumulator_sharding(param_sharding: NamedSharding) -> NamedSharding:
    """The accumulator of a param: a leading data-replica axis over "data", the param's spec after."""
    spec = tuple(param_sharding.spec)
    if any("data" in ((e,) if isinstance(e, str) else tuple(e or ())) for e in spec):
        raise ValueError(
            f"a parameter sharded over 'data' ({param_sharding.spec}) is not supported"
        )
    return NamedSharding(param_sharding.mesh, P("data", *spec))


def accumulator_structs(params: PyTree, trained: PyTree | None = None) -> PyTree:
    """Abstract per-replica gradient accumulator of `params` (leaves with shardings): fp32 leaves of
    shape (dp, *param.shape), replica r's gradient sum at [r]; only the `trained` leaves (a bool tree
    like `params`, None = all), the frozen ones are None (`prune`)."""

    def leaf(a):
        dp = a.sharding.mesh.shape["data"]
        return jax.ShapeDtypeStruct(
            (dp, *a.shape), jnp.float32, sharding=accumulator_sharding(a.sharding)
        )

    return jax.tree.map(leaf, prune(params, trained))
