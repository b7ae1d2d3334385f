"""Parameter-tree helpers of the stage programs: trained / frozen halves, casts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

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


def is_cast(leaf, dtype) -> bool:
    """Whether a leaf (array or ShapeDtypeStruct) in the compute dtype `dtype` is a cast copy: a
    floating leaf of another dtype (integer leaves and leaves already in `dtype` stay as they are)."""
    return jnp.issubdtype(leaf.dtype, jnp.floating) and jnp.dtype(leaf.dtype) != jnp.dtype(dtype)


def copied_leaves(
    params: PyTree, dtype, trained: PyTree, gathered: PyTree | None = None
) -> tuple[bool, ...]:
    """Per leaf of `params`: whether the stage programs take it as a compute-dtype copy
    (`StageProgram`): a cast leaf (`is_cast`), unless it is frozen and read only by a gather
    (`gathered`, bool per leaf; None: none is). The programs take such a leaf's fp32 master and XLA
    fuses the convert into the gather (only the gathered rows are converted), so a resident copy
    would only cost memory; a trained one keeps its copy, which the update writes and whose
    gradient comes out in the compute dtype."""
    leaves = jax.tree.leaves(params)
    only_gathered = [False] * len(leaves) if gathered is None else jax.tree.leaves(gathered)
    return tuple(
        is_cast(a, dtype) and (bool(t) or not g)
        for a, t, g in zip(leaves, jax.tree.leaves(trained), only_gathered, strict=True)
    )


def cast_floating(tree: PyTree, dtype: jnp.dtype) -> PyTree:
    """Casts the floating leaves of `tree` to `dtype`; a leaf already in it is returned itself (no
    op in a trace: a program given the compute-dtype copies casts nothing)."""
    return jax.tree.map(lambda a: a.astype(dtype) if is_cast(a, dtype) else a, tree)


def compute_structs(tree: PyTree, dtype: jnp.dtype, copied: Sequence[bool]) -> PyTree:
    """`tree`'s leaves (arrays or ShapeDtypeStructs with shardings) as ShapeDtypeStructs of what
    the stage programs take: the copied leaves (`copied_leaves`) in `dtype`, the others as they
    are; same shapes and shardings."""
    leaves, treedef = jax.tree.flatten(tree)
    structs = [
        jax.ShapeDtypeStruct(a.shape, dtype if c else a.dtype, sharding=a.sharding)
        for a, c in zip(leaves, copied, strict=True)
    ]
    return treedef.unflatten(structs)
