"""The ZeRO-1 layout of one parameter: which axis its optimizer state is sharded on over "data", and
how far that axis is padded so that every leaf is 1/dp per device (what the planner's memory model,
`costs/memory.py`, assumes).

A leaf with an axis whose size divides by its tp ways x dp gets "data" on the largest such axis, no
padding. A leaf with none (dp 3 with power-of-two widths; dp 14 against most of Qwen2.5-7B's
widths) gets "data" on its largest axis padded with zeros up to the next multiple: its reduced
gradient, AdamW moments and (inside the update) its fp32 params live in the padded shape. The
padding stays zero: a zero gradient leaves zero moments, AdamW's update of a zero param with zero
moments is zero (weight decay included), and zeros add nothing to the gradient norm. Nothing padded
leaves the optimizer: the update slices the new params back before they are gathered into the
stage sharding, and checkpoints see the unpadded state (`StageOptimizer.state`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dflop_jax.programs.sharding import mesh_axes


@dataclasses.dataclass(frozen=True)
class Zero1Leaf:
    """One parameter's ZeRO-1 layout (a pytree leaf: the layout tree mirrors the params tree).

    Attributes:
      shape: the parameter's shape.
      padded: its shape in the ZeRO-1 layout (`shape` when an axis divides, or without ZeRO-1).
      sharding: the layout's sharding (of `padded`).
      param_sharding: the parameter's own (stage) sharding.
    """

    shape: tuple[int, ...]
    padded: tuple[int, ...]
    sharding: NamedSharding
    param_sharding: NamedSharding

    @property
    def is_padded(self) -> bool:
        return self.padded != self.shape


def zero1_layout(shape: tuple[int, ...], sharding: NamedSharding) -> Zero1Leaf:
    """The layout of a leaf of `shape` in the stage sharding `sharding` (see the module docstring).
    A scalar, or a stage with dp 1, keeps the stage sharding."""
    shape = tuple(shape)
    mesh = sharding.mesh
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    dp = mesh.shape["data"]
    if dp == 1 or not shape:
        return Zero1Leaf(shape, shape, sharding, sharding)
    ways = [int(np.prod([mesh.shape[n] for n in mesh_axes(e)], dtype=int)) * dp for e in spec]
    fits = [i for i, n in enumerate(shape) if n % ways[i] == 0]
    axis = max(fits or range(len(shape)), key=lambda i: (shape[i], -i))
    padded = list(shape)
    padded[axis] = -(-shape[axis] // ways[axis]) * ways[axis]
    spec[axis] = (*mesh_axes(spec[axis]), "data") if spec[axis] is not None else "data"
    return Zero1Leaf(shape, tuple(padded), NamedSharding(mesh, P(*spec)), sharding)


def replicated_layout(shape: tuple[int, ...], sharding: NamedSharding) -> Zero1Leaf:
    """The pre-ZeRO layout (`optimizer.zero1: false`): the stage sharding, no padding."""
    return Zero1Leaf(tuple(shape), tuple(shape), sharding, sharding)


def zero1_sharding(shape: tuple[int, ...], sharding: NamedSharding) -> NamedSharding:
    """The ZeRO-1 sharding of a leaf (of its `zero1_layout(...).padded` shape)."""
    return zero1_layout(shape, sharding).sharding


def pad(x: jax.Array, padded: tuple[int, ...]) -> jax.Array:
    """`x` with zeros appended up to `padded` on its trailing axes (the leading ones are kept, e.g.
    an accumulator's replica axis)."""
    lead = x.ndim - len(padded)
    widths = [(0, 0)] * lead + [(0, p - n) for n, p in zip(x.shape[lead:], padded)]
    return jnp.pad(x, widths) if any(w for _, w in widths) else x


def unpad(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """`x` cut back to `shape` (the inverse of `pad`)."""
    return x[tuple(slice(0, n) for n in shape)] if tuple(x.shape) != tuple(shape) else x
