"""A stage's gradient accumulator: per data replica, the trained leaves' fp32 gradient sums, packed.

    acc = Accumulator.of(params, trained)        # params: arrays or ShapeDtypeStructs with shardings
    bufs = acc.zeros()                           # in a program: the buffers the backward programs
    bufs = acc.add(bufs, grads)                  #   take (donated) and return
    tree = acc.unpack(bufs)                      # the leaves, each (dp, *param.shape)

Every leaf has a leading data-replica axis (shape (dp, *param.shape), sharded over "data" on it and
like its param on the rest): replica r's gradient sum is at [r], so a microbatch's backward moves
no gradient between replicas and the step reduces once (`runtime/train_state.py`).

Why packed: a program's call costs the dispatching thread about 1-1.6 us per output array on
XLA:CPU (jax's own call, `bench dispatch`'s "jax" part), and a backward program returns the whole
accumulator. So the leaves live in at most two buffers, in leaf order:
  - "whole": the leaves no mesh axis larger than 1 splits past the replica axis (norms, biases,
    every leaf of a tp-1 stage), raveled into one (dp, n) buffer;
  - "split": the leaves one mesh axis (tp's "model") splits on one dimension, as a (dp, tp, n)
    buffer split over that axis, each device's block its shards raveled. A leaf's piece in it is
    the leaf with its split dimension cut into (tp, rest) and the tp factor moved to the front: on
    each device that is its own shard, so packing and unpacking move nothing between devices.

A backward adds each gradient into its slice with `dynamic_update_slice`, which XLA runs in place
on the donated buffer (a `concatenate` of the sums would not be: XLA builds it in a temporary as
large as the buffer; `tests/runtime/test_runtime_accumulator.py` checks the compiled program's
temporaries and collectives).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dflop_jax.programs.sharding import mesh_axes
from dflop_jax.programs.trees import PyTree, prune

WHOLE, SPLIT = "whole", "split"


def _split(sharding: NamedSharding) -> tuple[str, int, str | None]:
    """(kind, the param dimension split, the mesh axis splitting it) of a param's sharding: WHOLE when
    no mesh axis larger than 1 splits it, SPLIT when one axis ("model": "data" is refused) splits
    one dimension."""
    if any("data" in mesh_axes(e) for e in sharding.spec):
        raise ValueError(f"a parameter sharded over 'data' ({sharding.spec}) is not supported")
    size = sharding.mesh.shape
    cuts = [(d, n) for d, e in enumerate(sharding.spec) for n in mesh_axes(e) if size[n] > 1]
    if len(cuts) > 1:
        raise ValueError(
            f"a parameter split on several dimensions ({sharding.spec}) is not supported"
        )
    return (SPLIT, *cuts[0]) if cuts else (WHOLE, 0, None)


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where one trained leaf lives: in buffer `buffer`, at [offset, offset + size) of its last axis
    (WHOLE: the raveled leaf; SPLIT: one device's shard raveled, `dim` the param dimension split in
    `parts`)."""

    shape: tuple[int, ...]
    kind: str
    buffer: int
    offset: int = 0
    dim: int = 0
    parts: int = 1

    @property
    def size(self) -> int:
        return math.prod(self.shape) // self.parts

    def to_block(self, a, xp=jnp):
        """A (dp, *shape) leaf as this slot's piece of its buffer."""
        if self.kind == WHOLE:
            return a.reshape(a.shape[0], self.size)
        d = self.dim + 1
        cut = a.reshape(*a.shape[:d], self.parts, a.shape[d] // self.parts, *a.shape[d + 1 :])
        return xp.moveaxis(cut, d, 1).reshape(a.shape[0], self.parts, self.size)

    def from_block(self, b):
        """This slot's piece of its buffer as the (dp, *shape) leaf."""
        if self.kind == WHOLE:
            return b.reshape(-1, *self.shape)
        d, s = self.dim + 1, self.shape
        cut = b.reshape(-1, self.parts, *s[: d - 1], s[d - 1] // self.parts, *s[d:])
        return jnp.moveaxis(cut, 1, d).reshape(-1, *s)


@dataclasses.dataclass(frozen=True)
class Accumulator:
    """The packing of one stage's accumulator (module docstring).

    Attributes:
      tree: the treedef of the trained leaves (`prune`d params: frozen leaves are empty subtrees).
      slots: per trained leaf (tree order), where it lives.
      structs: the buffers' shapes, dtype (fp32) and shardings: WHOLE's, then SPLIT's.
    """

    tree: jax.tree_util.PyTreeDef
    slots: tuple[_Slot, ...]
    structs: tuple[jax.ShapeDtypeStruct, ...]

    @classmethod
    def of(cls, params: PyTree, trained: PyTree | None = None) -> Accumulator:
        """The accumulator of `params`' `trained` leaves (None: all), each leaf an array or a
        ShapeDtypeStruct with a NamedSharding."""
        leaves, tree = jax.tree.flatten(prune(params, trained))
        cuts = [_split(a.sharding) for a in leaves]
        structs, slots = [], [None] * len(leaves)
        for kind in (WHOLE, SPLIT):
            mine = [i for i, c in enumerate(cuts) if c[0] == kind]
            if not mine:
                continue
            offset, mesh = 0, leaves[mine[0]].sharding.mesh
            for i in mine:
                _, dim, axis = cuts[i]
                parts = 1 if axis is None else mesh.shape[axis]
                slots[i] = _Slot(tuple(leaves[i].shape), kind, len(structs), offset, dim, parts)
                offset += slots[i].size
            dp = mesh.shape["data"]
            if kind == WHOLE:
                shape, spec = (dp, offset), P("data", None)
            else:
                shape, spec = (dp, slots[mine[0]].parts, offset), P("data", cuts[mine[0]][2], None)
            sharding = NamedSharding(mesh, spec)
            structs.append(jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding))
        return cls(tree, tuple(slots), tuple(structs))

    @property
    def shardings(self) -> list[NamedSharding]:
        return [s.sharding for s in self.structs]

    def zeros(self) -> list[jax.Array]:
        """Zero buffers (inside a program: their shardings are the program's out_shardings)."""
        return [jnp.zeros(s.shape, s.dtype) for s in self.structs]

    def add(self, bufs: list, grads: PyTree) -> list:
        """`bufs` plus one replica's gradient `grads` (a tree like the trained params), inside that
        replica's body (`bufs` of leading size 1); each slice updated in place."""
        bufs = list(bufs)
        for slot, g in zip(self.slots, jax.tree.leaves(grads)):
            b, g = bufs[slot.buffer], g[None].astype(jnp.float32)
            end, axis = slot.offset + slot.size, b.ndim - 1
            new = jax.lax.slice_in_dim(b, slot.offset, end, axis=axis) + slot.to_block(g)
            bufs[slot.buffer] = jax.lax.dynamic_update_slice_in_dim(b, new, slot.offset, axis)
        return bufs

    def unpack(self, bufs: list) -> PyTree:
        """The accumulator as a tree like the trained params, each leaf (dp, *param.shape)."""
        leaves = []
        for slot in self.slots:
            b = bufs[slot.buffer]
            end = slot.offset + slot.size
            leaves.append(
                slot.from_block(jax.lax.slice_in_dim(b, slot.offset, end, axis=b.ndim - 1))
            )
        return self.tree.unflatten(leaves)

    def pack(self, tree: PyTree) -> list:
        """`unpack`'s inverse: buffers holding the leaves of `tree` (each (dp, *param.shape)); host
        arrays give host buffers."""
        leaves = jax.tree.leaves(tree)
        xp = np if all(isinstance(a, np.ndarray) for a in leaves) else jnp
        out = []
        for kind in (WHOLE, SPLIT):
            blocks = [s.to_block(a, xp) for a, s in zip(leaves, self.slots) if s.kind == kind]
            if blocks:
                out.append(xp.concatenate(blocks, axis=-1))
        return out


def accumulator_structs(
    params: PyTree, trained: PyTree | None = None
) -> list[jax.ShapeDtypeStruct]:
    """The buffers of `params`' accumulator (`Accumulator.of`), abstract: what the backward programs
    take and return for it."""
    return list(Accumulator.of(params, trained).structs)
