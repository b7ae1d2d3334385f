"""Per-stage optimizer state and update, with gradient clipping by the GLOBAL norm over all stages.

Each stage keeps fp32 master params and its own optax AdamW state (warmup + cosine schedule;
`OptimizerConfig.build`, `runtime/optimizer_config.py`) on its submesh. Clipping needs the norm of
the whole model's gradient, and none of it touches the host (the trainer dispatches the next step
before this one's numbers are read): each stage computes its squared norm on its mesh, `transfer`
moves the [1] vectors onto the last stage's mesh (across processes too), one program there sums them
with the loss contributions into the step's `STATS` vector, and that vector moves back to every
stage's mesh, whose update scales its gradients by optax.clip_by_global_norm's rule with the global
norm. A step whose loss or gradients are not finite (a non-finite sum of squares or of the loss)
keeps every stage's params and optimizer state (optax.apply_if_finite's zero update, the Adam count
included) and adds one to the skip counter that the vector carries from step to step.

Optimizer state is created by `jax.jit(tx.init)` WITH out_shardings derived from the params' shardings
(a plain `jax.jit(tx.init)` would put it on one device; DESIGN section 11).

ZeRO-1 and one reduction per step: the stage programs leave each data replica's gradient sum in a
per-replica accumulator (`programs/accumulator.py`). Once per step, `StageOptimizer.reduce` sums it over the
replicas straight into the ZeRO-1 layout (`programs/zero1_layout.py`: each leaf's largest divisible axis also
sharded over "data", or its largest axis padded with zeros to a multiple when none divides; XLA
makes that sum a reduce-scatter, or an all-reduce plus a slice on CPU), and the update computes AdamW
on those shards with the moments stored sharded (and padded) the same way, each replica reading its
slice of the replicated fp32 params, and all-gathers the new params (padding cut off) into their
stage sharding for the next step's programs, with their compute-dtype copies, cast once here for the
whole step (`programs/stage_program.py`). `StageOptimizer.shards` is the live state;
`StageOptimizer.state` its unpadded, layout-independent form (what checkpoints save and restore).
The fp32 params are the master copy, so ZeRO-1 here shards m and v: per device 4 (params) + 2 (their
bf16 copies) + 4 (accumulator) + 8 / dp bytes per parameter.

Tied parameters (a tied embedding: the first LLM stage embeds with it, the last one projects with its
own copy, `models.decoder`): one parameter held by several stages. `tied_groups` finds them (the same
model-level path in several stages), `apply_updates` gives every copy the SUM of the copies' gradients
(moved between the stage meshes like activations, `programs/transfer.py`) and counts it once in the global norm, so the copies
start equal (built from one array), get the same update from the same AdamW state, and stay equal:
what the single-device model computes. A checkpoint stores the parameter once and restores it to every
copy.

Frozen parameters (`OptimizerConfig.trainable`; `StageProgram.trained` marks the trained leaves): the
accumulator and the reduced gradient hold the trained leaves only (`programs/trees.py` `prune`), so a frozen leaf
costs no accumulator, no reduction and no share of the norm. The update program takes and donates the
trained params only; the optimizer (`optax.multi_transform`, `set_to_zero` for the frozen parts, which
hold no state) sees the whole tree with zeros in place of the frozen leaves, which it ignores. It runs
on every stage, a stage with nothing trained included, so the step counts in the state advance alike
on every stage (a checkpoint keeps one count per module). The stages and the optimizer must agree
on what is trained (checked when the optimizer is built).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dflop_jax.programs.dispatch import UPDATE, issue
from dflop_jax.programs.executable_store import ExecutableStore, call_once
from dflop_jax.programs.leaf_program import LeafProgram
from dflop_jax.programs.lowering import KeptProgram, Lowering
from dflop_jax.programs.param_paths import TiedGroup, leaf_names
from dflop_jax.programs.stage_fns import PyTree
from dflop_jax.programs.stage_program import StageProgram
from dflop_jax.programs.transfer import lower_transfer, put_host, stand_in, transfer
from dflop_jax.programs.trees import graft, negate, prune
from dflop_jax.programs.zero1_layout import (
    pad,
    replicated_layout,
    unpad,
    zero1_layout,
)

# The update's glue between the stages' own programs, each one jitted program (an eager op would
# compile in step 1, out of `lower_update`'s reach).
_add = jax.jit(operator.add)


class TiedSum:
    """A tied group's programs on its first copy's mesh, each of one signature (a store may give
    them): `add` sums one more copy's gradient into the first's, `correction` is -(copies - 1)
    |summed gradient|^2 as a [1] vector (so the global norm counts the parameter once)."""

    def __init__(self, sharding: NamedSharding, copies: int):
        devices = list(sharding.mesh.devices.flat)
        scalar = NamedSharding(sharding.mesh, P())
        correction = jax.jit(
            lambda total: (-(copies - 1) * jnp.sum(jnp.square(total))).reshape(1),
            out_shardings=scalar,
        )
        self.add, self.correction = KeptProgram(_add, devices), KeptProgram(correction, devices)


@functools.cache
def _zero(sharding: NamedSharding) -> jax.Array:
    """0.0 placed on `sharding` once (never donated: every step starts its loss sum from it)."""
    return put_host(np.float32(0), sharding)


STATS = ("loss", "grad_norm", "applied", "skipped_steps", "clip_norm")
"""Fields of the per-step statistics vector `apply_updates` leaves on the last stage's mesh."""


class StageOptimizer:
    """One stage's optimizer state and its per-step programs on the stage's mesh.

    Per step: `reduce` (the data-parallel sum of the per-replica accumulator into the ZeRO-1 layout:
    the step's one gradient reduction), `sq_norm` (of the reduced gradient, for global clipping),
    `apply` (AdamW on the shards, all-gather of the new params).

    Attributes:
      layout: a `Zero1Leaf` per param leaf (shape, padded shape, ZeRO-1 and stage shardings).
      shards: the live optimizer state in the ZeRO-1 layout (padded leaves padded).
      state: (property) the same state in the params' shapes, for checkpoints; settable.
    """

    def __init__(self, stage: StageProgram, tx: optax.GradientTransformation, zero1: bool = True,
                 store: ExecutableStore | None = None):  # fmt: skip
        """The gradients are the stage's trained leaves (`stage.trained`); `tx` must keep no state
        for its frozen ones (`OptimizerConfig.build` of the same trainable parts). `store`: where
        the fresh state's program comes from on a process JAX's cache does not write from
        (`programs/executable_store.py`); the per-step programs go through it in `precompile`."""
        self.stage, self.store = stage, store
        self.tx = tx
        ps = stage.param_shardings
        self.scalar = NamedSharding(stage.mesh, P())
        make = zero1_layout if zero1 else replicated_layout
        self.layout = jax.tree.map(lambda a, s: make(a.shape, s), stage.params, ps)
        zs = jax.tree.map(lambda lay: lay.sharding, self.layout)
        self.grad_shardings = prune(zs, stage.trained)
        padded = jax.tree.map(
            lambda a, lay: jax.ShapeDtypeStruct(lay.padded, a.dtype), stage.params, self.layout
        )
        abstract = jax.eval_shape(tx.init, padded)
        _check_frozen_stateless(tx, abstract, stage.trained)
        self.state_shardings = _abstractly(
            lambda: self._over_state(abstract, lambda x, lay: lay.sharding, self.scalar)
        )
        self._padded = any(lay.is_padded for lay in jax.tree.leaves(self.layout))
        self._view = _abstractly(lambda: self._unpadded_view(abstract))  # what checkpoints see
        self._init, self._unpad, self._pad = self._layout_programs()
        self._state_tree = jax.tree.structure(abstract)
        # A non-local stage (`StageProgram.local` False) keeps its state's shapes only: nothing compiled.
        self.shards = (
            self._fresh()
            if getattr(stage, "local", True)
            else jax.tree.map(
                lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                abstract,
                self.state_shardings,
            )
        )
        self.trains = bool(jax.tree.leaves(self.grad_shardings))
        grad_layout = prune(self.layout, stage.trained)
        self._grad_structs = jax.tree.map(
            lambda lay: jax.ShapeDtypeStruct(lay.padded, jnp.float32, sharding=lay.sharding),
            grad_layout,
        )
        self._reduce, self._sq_norm, self._update = self._step_programs(grad_layout, padded)
        # The step's statistics, which `apply_updates` computes on the last stage's mesh: the loss
        # summed one microbatch at a time (one program for any count) and `_combine`.
        devices = list(stage.mesh.devices.flat)
        self.loss_add, self.combine = KeptProgram(_add, devices), KeptProgram(_combine, devices)
        self._tied: dict[str, TiedSum] = {}  # by the leaf path of a tied group's first copy here

    def _unpadded_view(self, abstract: PyTree) -> PyTree:
        """The state's shapes and shardings in the params' shapes: a padded leaf unpadded in its
        param's stage sharding, the others as they live (`abstract`: the padded state's shapes)."""
        return self._over_state(
            abstract,
            lambda x, lay: jax.ShapeDtypeStruct(
                lay.shape, x.dtype, sharding=lay.param_sharding if lay.is_padded else lay.sharding
            ),
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.scalar),
        )

    def _layout_programs(self) -> tuple[jax.stages.Wrapped, KeptProgram, jax.stages.Wrapped]:
        """The jitted programs between the params' shapes and the ZeRO-1 layout: fresh state from
        the params (padded), the state's padding cut back (`state`: each checkpoint's, compiled
        ahead) and put back (its setter: a restore's, once)."""
        view_shardings = jax.tree.map(lambda v: v.sharding, self._view)
        init = jax.jit(
            lambda p: self.tx.init(jax.tree.map(lambda a, lay: pad(a, lay.padded), p, self.layout)),
            in_shardings=(self.stage.param_shardings,),
            out_shardings=self.state_shardings,
        )
        unpad_state = jax.jit(
            lambda st: self._over_state(st, lambda x, lay: unpad(x, lay.shape)),
            in_shardings=(self.state_shardings,),
            out_shardings=view_shardings,
        )
        unpad_state = KeptProgram(unpad_state, list(self.stage.mesh.devices.flat))
        pad_state = jax.jit(
            lambda st: self._over_state(st, lambda x, lay: pad(x, lay.padded)),
            in_shardings=(view_shardings,),
            out_shardings=self.state_shardings,
        )
        return init, unpad_state, pad_state

    def _step_programs(
        self, grad_layout: PyTree, padded: PyTree
    ) -> tuple[LeafProgram, LeafProgram, LeafProgram]:
        """The per-step programs `reduce`, `sq_norm` and `apply` run (`grad_layout`: the trained
        leaves' `Zero1Leaf`s; `padded`: every param's padded ShapeDtypeStruct)."""
        stage, scalar = self.stage, self.scalar
        trained, frozen = stage.trained, negate(stage.trained)
        ps = stage.param_shardings
        acc = stage.accumulator
        # The per-step programs take and return trees as their leaves (`LeafProgram`), the
        # accumulator as its buffers.
        gt = jax.tree.structure(self.grad_shardings)
        pt, st = jax.tree.structure(prune(ps, trained)), self._state_tree
        reduce = LeafProgram(
            lambda bufs: jax.tree.map(
                lambda a, lay: jnp.sum(pad(a, lay.padded), axis=0), acc.unpack(bufs), grad_layout
            ),
            (None,),
            gt,
            in_shardings=(acc.shardings,),
            out_shardings=self.grad_shardings,
        )

        def sq_norm(g):
            leaves = jax.tree.leaves(g)
            return sum(
                (jnp.sum(jnp.square(x)) for x in leaves), jnp.zeros((), jnp.float32)
            ).reshape(1)

        sq_norm_program = LeafProgram(
            sq_norm,
            (gt,),
            None,
            in_shardings=(self.grad_shardings,),
            out_shardings=scalar,
        )
        # The frozen leaves enter the update as zeros of their padded shape (grads and params alike):
        # `set_to_zero` ignores them, so XLA drops them; the frozen params are never touched.
        update = functools.partial(_guarded_update, self.tx, grad_layout,
                                   prune(padded, frozen), trained)  # fmt: skip
        # the update also makes, from the new masters, the compute-dtype copies of the trained
        # leaves the programs take as copies (`StageProgram.cast_leaves`, `trees.copied_leaves`:
        # weights cast once per step), in leaf order; `update` returns the trained leaves only
        cd = stage.compute_dtype
        casts = [c for c, t in zip(stage.cast_leaves, stage.trained_leaves) if t]
        flags = zip(jax.tree.leaves(ps), stage.cast_leaves, stage.trained_leaves)
        copies = [s for s, c, t in flags if c and t]

        def update_and_cast(params, state, grads, stats):
            new, new_state = update(params, state, grads, stats)
            pairs = zip(jax.tree.leaves(new), casts, strict=True)
            return new, new_state, [p.astype(cd) for p, c in pairs if c]

        update_program = LeafProgram(
            update_and_cast,
            (pt, st, gt, None),
            (pt, st, None),
            in_shardings=(prune(ps, trained), self.state_shardings, self.grad_shardings, scalar),
            out_shardings=(prune(ps, trained), self.state_shardings, copies),
            donate_argnums=(0, 1),
            name="update",
        )
        return reduce, sq_norm_program, update_program

    @property
    def shards(self) -> PyTree:
        """The live optimizer state in the ZeRO-1 layout (padded leaves padded). The update takes
        it as leaves (`shard_leaves`); the tree is rebuilt on reading."""
        if self._shards is None:
            self._shards = self._state_tree.unflatten(self.shard_leaves)
        return self._shards

    @shards.setter
    def shards(self, value: PyTree) -> None:
        self._shards, self.shard_leaves = value, jax.tree.leaves(value)

    def _over_state(self, state: PyTree, params_fn, other=None) -> PyTree:
        """`params_fn(leaf, its param's Zero1Leaf)` over the state's param-shaped leaves (moments),
        `other` (a value, or a function of the leaf; None keeps it) over the rest (step counts)."""
        rest = other if other is None or callable(other) else (lambda _: other)
        return optax.tree_map_params(
            self.tx,
            lambda x, lay: x if _masked(x) else params_fn(x, lay),
            state,
            self.layout,
            transform_non_params=rest,
            is_leaf=_masked,
        )

    @property
    def state(self) -> PyTree:
        """The optimizer state in the unpadded layout-independent shapes (what checkpoints save and
        restore): the live ZeRO-1 shards (`shards`) themselves when no leaf is padded, else a copy
        whose padded leaves are cut back and gathered into their params' stage sharding (a transient
        of their full moments, at checkpoint time only)."""
        if not self._padded:
            return self.shards
        if not getattr(self.stage, "local", True):
            return self._view
        with jax.set_mesh(self.stage.mesh):
            return self._unpad.run(self.shards)

    @state.setter
    def state(self, value: PyTree) -> None:
        """Sets the state from the unpadded shapes (`state`), padding into the ZeRO-1 layout."""
        if not self._padded:
            self.shards = value
        elif getattr(self.stage, "local", True):
            mesh = self.stage.mesh
            with jax.set_mesh(mesh):  # a restore's, before `precompile`: through the store
                self.shards = call_once(self._pad, (value,), list(mesh.devices.flat), self.store)

    @property
    def state_structs(self) -> PyTree:
        """`state`'s shapes and shardings (what a restore reads into), computing nothing."""
        return self._view

    def _fresh(self) -> PyTree:
        """Fresh optimizer state for the stage's current params, in the (padded) ZeRO-1 layout."""
        mesh = self.stage.mesh
        with jax.set_mesh(mesh):
            return call_once(self._init, (self.stage.params,), list(mesh.devices.flat), self.store)

    def init_state(self) -> PyTree:
        """Fresh optimizer state for the stage's current params, shaped like `state` (to set it)."""
        fresh = self._fresh()
        if not self._padded:
            return fresh
        with jax.set_mesh(self.stage.mesh):
            return self._unpad.run(fresh)

    def tied_sum(self, path: str, first: jax.Array | jax.ShapeDtypeStruct, copies: int) -> TiedSum:
        """The programs of the tied group whose first copy is this stage's gradient leaf `path`
        (`first`: that leaf), made once."""
        if path not in self._tied:
            self._tied[path] = TiedSum(first.sharding, copies)
        return self._tied[path]

    def lower(self) -> list[Lowering]:
        """The per-step programs (a fresh accumulator, `reduce`, `sq_norm`, `apply`), lowered from
        abstract inputs for compiling before step 1 (`runtime/precompile.py`), each one signature
        that an executable store may give; none when the stage is not local."""
        stage = self.stage
        if not getattr(stage, "local", True):
            return []
        ids = tuple(d.id for d in stage.mesh.devices.flat)
        stats = jax.ShapeDtypeStruct((len(STATS),), jnp.float32, sharding=self.scalar)
        trained = prune(stage.params, stage.trained)
        out = [stage.jits.zeros.lowering("step", ids, stage.params)] if self.trains else []
        with jax.set_mesh(stage.mesh):  # as `apply`, `reduce`, `sq_norm` call them
            update = (trained, self.shards, self.grad_structs(), stats)
            out.append(self._update.lowering("step", ids, *update))
            if self.trains:
                accs = list(stage.accumulator.structs)
                out += [self._reduce.lowering("step", ids, accs),
                        self._sq_norm.lowering("step", ids, self.grad_structs())]  # fmt: skip
        return out

    def lower_save(self) -> list[Lowering]:
        """The program a checkpoint runs (`state`: the padded leaves cut back), lowered; none when
        nothing is padded or the stage is not local."""
        if not self._padded or not getattr(self.stage, "local", True):
            return []
        shards = jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
            self.shards,
            self.state_shardings,
        )
        with jax.set_mesh(self.stage.mesh):
            return [self._unpad.lowering("step", shards)]

    def reduce(self, acc: list) -> PyTree:
        """The step's data-parallel gradient sum, in the ZeRO-1 layout, of the accumulator's buffers
        (`acc`, not donated: the sum has other shapes; the caller drops it)."""
        return issue(UPDATE, self.stage.mesh, self._reduce, acc)

    def reduce_leaves(self, acc: list) -> list:
        """`reduce` of the accumulator's buffers (`StageProgram.zero_grads`), as the gradient's
        leaves (`grad_tree` makes them a tree)."""
        return issue(UPDATE, self.stage.mesh, self._reduce.run, acc)

    def grad_tree(self, leaves: list) -> PyTree:
        """The reduced gradient's tree (`grad_structs`'s) of its leaves."""
        return self._reduce.outs.unflatten(leaves)

    def grad_structs(self) -> PyTree:
        """Shapes and shardings of `reduce`'s output (a non-local stage's stand-in): the ZeRO-1
        layout's, padded where a leaf has no axis that its tp x dp divides."""
        return self._grad_structs

    @property
    def grad_leaves(self) -> list:
        """`grad_structs`'s leaves."""
        return jax.tree.leaves(self._grad_structs)

    def sq_norm(self, grads: PyTree) -> jax.Array:
        """|grads|^2 (the trained leaves; a tree or its leaves) as a [1] vector, replicated on the
        stage's mesh."""
        return issue(UPDATE, self.stage.mesh, self._sq_norm.run, jax.tree.leaves(grads))

    def apply(self, grads: PyTree, stats: jax.Array) -> None:
        """Updates the stage's params and state in place (old buffers donated) from REDUCED gradients
        (`reduce`) and the step's `STATS` vector on this stage's mesh: clipped by its global norm,
        skipped unless applied. `grads`: a tree or its leaves."""
        stage = self.stage
        leaves, mask = stage.leaves, stage.trained_leaves
        trained = [a for a, k in zip(leaves, mask) if k]
        args = (trained, self.shard_leaves, jax.tree.leaves(grads), stats)
        stage.drop_trained_copies()
        new, state, copies = issue(UPDATE, stage.mesh, self._update.run, *args)
        self._shards, self.shard_leaves = None, state
        it = iter(new)
        stage.set_leaves([next(it) if k else a for a, k in zip(leaves, mask)], copies)


def _masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)  # a frozen leaf's (absent) optimizer state


def _abstractly(fn: Callable[[], Any]) -> Any:
    """`fn()` traced: `optax.tree_map_params` runs `tx.init` on placeholders, and run eagerly the
    arrays it makes (AdamW's step count) compile programs of their own, which no executable store
    holds. `fn` maps shapes and shardings, not arrays, so its result is taken as it is."""
    out = []
    jax.eval_shape(lambda: out.append(fn()))
    return out[0]


def _check_frozen_stateless(tx, abstract_state: PyTree, trained: PyTree) -> None:
    """Raises when `tx` keeps optimizer state for a frozen leaf (the stage and the optimizer not
    built from the same `optimizer.trainable`)."""
    leaves, treedef = jax.tree.flatten(trained)
    stateful = [False] * len(leaves)

    def mark(x, i):
        stateful[i] |= not _masked(x)
        return x

    index = jax.tree.unflatten(treedef, list(range(len(leaves))))
    _abstractly(lambda: optax.tree_map_params(tx, mark, abstract_state, index, is_leaf=_masked))
    if any(has and not keep for has, keep in zip(stateful, leaves)):
        raise ValueError(
            "the optimizer keeps state for a parameter the stage does not train: build the stages "
            "(build_stages trainable=) and the optimizer from the same optimizer.trainable"
        )


def _guarded_update(tx, layout, frozen, trained, params, state, grads, stats):
    """optax.clip_by_global_norm's rule with the GLOBAL norm (stats), then `tx` on the ZeRO-1 shards
    (`layout`: the trained leaves' `Zero1Leaf`s) of the trained `params`, padded like the state and
    cut back after; a step whose loss or gradients are not finite keeps the old params and state
    (optax.apply_if_finite's zero update). `frozen`: the frozen leaves' padded ShapeDtypeStructs,
    given to `tx` as zeros (it ignores them); returns the trained params only."""
    norm, applied, clip = stats[1], stats[2] > 0, stats[4]
    keep = (clip <= 0) | (norm < clip)
    grads = jax.tree.map(lambda g: jnp.where(keep, g, (g / norm.astype(g.dtype)) * clip), grads)
    shards = jax.tree.map(
        lambda p, lay: jax.lax.with_sharding_constraint(pad(p, lay.padded), lay.sharding),
        params,
        layout,
    )
    zeros = jax.tree.map(lambda sd: jnp.zeros(sd.shape, sd.dtype), frozen)
    whole = graft(shards, zeros)
    updates, new_state = tx.update(graft(grads, zeros), state, whole)
    new_params = prune(optax.apply_updates(whole, updates), trained)
    pick = functools.partial(jax.tree.map, lambda new, old: jnp.where(applied, new, old))
    new_params = jax.tree.map(lambda p, lay: unpad(p, lay.shape), pick(new_params, shards), layout)
    return new_params, pick(new_state, state)


def tie_gradients(
    grads: list[PyTree], groups: list[TiedGroup], optimizers: list[StageOptimizer]
) -> tuple[list[PyTree], list[jax.Array]]:
    """Every copy of a tied parameter gets the sum of the copies' gradients (the programs of
    `StageOptimizer.tied_sum`, the first copy's stage's).

    Copies move between stage meshes with `transfer` (device to device, across processes too). A
    non-local stage's tree holds `jax.ShapeDtypeStruct`s (with shardings): this process only takes
    part in the transfers that touch its devices.

    Returns the new gradient trees and, per group, a scalar to ADD to the sum of the stages' squared
    norms so the parameter counts once: -(copies - 1) * |summed gradient|^2 (a stand-in on processes
    that do not hold the first copy's stage).
    """
    flat = [jax.tree_util.tree_flatten_with_path(g) for g in grads]
    leaves = [[leaf for _, leaf in f] for f, _ in flat]
    index = [{leaf_names(path): j for j, (path, _) in enumerate(f)} for f, _ in flat]
    corrections = []
    for group in groups:
        if any(p not in index[s] for s, p in group):
            continue  # frozen: no gradient (all copies are one parameter, so all frozen)
        (s0, p0), *rest = group
        total = leaves[s0][index[s0][p0]]
        sums = optimizers[s0].tied_sum(p0, total, len(group))
        for s, p in rest:
            moved = transfer(leaves[s][index[s][p]], total.sharding)
            total = issue(UPDATE, None, sums.add.run, total, moved) if _holds(total) else total
        for s, p in group:
            j = index[s][p]
            leaves[s][j] = transfer(total, leaves[s][j].sharding)
        scalar = NamedSharding(total.sharding.mesh, P())
        corrections.append(
            issue(UPDATE, None, sums.correction.run, total)
            if _holds(total)
            else stand_in((1,), jnp.float32, scalar)
        )
    trees = [jax.tree_util.tree_unflatten(treedef, ls) for (_, treedef), ls in zip(flat, leaves)]
    return trees, corrections


def _holds(leaf) -> bool:
    """True when this process holds shards of `leaf` (not a shape or a stand-in)."""
    return isinstance(leaf, jax.Array) and bool(leaf.addressable_shards)


def apply_updates(
    optimizers: list[StageOptimizer],
    grads: list[PyTree],
    clip_norm: float,
    loss: list[jax.Array] = (),
    previous: jax.Array | None = None,
    tied: list[TiedGroup] = (),
) -> list[jax.Array]:
    """Reduces each stage's per-replica accumulator (`grads`) once, clips by the global norm over all
    stages and updates every stage, all on device.

    Each stage's squared norm (and each tied group's correction) moves with `transfer` onto the last
    stage's mesh, where one program sums them with the loss contributions into the step's `STATS`
    vector; that vector moves back to every stage's mesh and drives its update. Nothing is read on
    the host, so the caller can dispatch the next step at once; a process whose devices hold none of
    a stage only takes part in the transfers that touch its devices.

    Args:
      loss: the step's per-microbatch loss contributions (on the last stage's mesh); a non-finite
        loss skips the update like a non-finite gradient. Empty: gradients only.
      previous: the previous step's `STATS` vector (its skip counter carries on); None = zeros.
      tied: `tied_groups(...)` of the stages (their copies get summed gradients, counted once).

    Returns:
      The step's `STATS` vector [5] (loss, global norm, applied 1/0, skipped steps so far,
      clip_norm), replicated on each stage's mesh, in stage order (the last one is where it was
      computed; stand-ins where this process holds none of a mesh).
    """
    local = [getattr(opt.stage, "local", True) for opt in optimizers]
    # A non-local stage (no gradients here, None) takes part by its shapes and a stand-in norm.
    # A stage with nothing trained has no gradient: no reduction, no norm (its update still runs).
    grads = [
        opt.reduce_leaves(list(g)) if here and opt.trains else opt.grad_leaves
        for opt, g, here in zip(optimizers, grads, local)
    ]
    corrections = []
    if tied:  # by the gradients' trees (their leaf paths name the tied copies)
        trees = [opt.grad_tree(g) for opt, g in zip(optimizers, grads)]
        trees, corrections = tie_gradients(trees, list(tied), optimizers)
        grads = [jax.tree.leaves(t) for t in trees]
    sq = [
        opt.sq_norm(g) if here else stand_in((1,), jnp.float32, opt.scalar)
        for opt, g, here in zip(optimizers, grads, local)
        if opt.trains
    ]
    last = optimizers[-1]
    home = last.scalar
    parts = [transfer(x, home) for x in sq + corrections]
    if local[-1]:
        prev = (
            previous if previous is not None else put_host(np.zeros(len(STATS), np.float32), home)
        )
        # the loss summed pairwise from 0 first: one add program for any microbatch count (a list
        # argument would compile `_combine` once per count)
        total = _zero(home)
        for x in loss:
            total = issue(UPDATE, home.mesh, last.loss_add.run, total, x)
        stats = issue(
            UPDATE, home.mesh, last.combine.run, parts, total, prev, np.float32(clip_norm)
        )
    else:
        stats = stand_in((len(STATS),), jnp.float32, home)
    copies = [transfer(stats, opt.scalar) for opt in optimizers]
    for opt, g, here, mine in zip(optimizers, grads, local, copies):
        if here:
            opt.apply(g, mine)
    return copies


def lower_update(
    optimizers: list[StageOptimizer], clip_norm: float, tied: list[TiedGroup] = ()
) -> list[Lowering]:
    """The programs `apply_updates` runs on this process beyond each optimizer's own
    (`StageOptimizer.lower`), lowered from shapes: the tied groups' transfers, sums and norm
    corrections, the norm and statistics transfers, the loss sum and `_combine`. What
    `apply_updates` dispatches, step for step (a run compiling nothing in step 1 tests the two
    agree)."""
    local = [getattr(opt.stage, "local", True) for opt in optimizers]
    grads = [opt.grad_structs() for opt in optimizers]
    out, corrections = [], []
    flat = [jax.tree_util.tree_flatten_with_path(g)[0] for g in grads]
    index = [{leaf_names(path): leaf for path, leaf in f} for f in flat]
    for group in tied:
        if any(p not in index[s] for s, p in group):
            continue
        (s0, p0), *rest = group
        total = index[s0][p0]
        sums = optimizers[s0].tied_sum(p0, total, len(group))
        for s, p in rest:
            out += lower_transfer(index[s][p], total.sharding)
        out += [lw for s, p in group for lw in lower_transfer(total, index[s][p].sharding)]
        scalar = NamedSharding(total.sharding.mesh, P())
        if local[s0]:
            out += [sums.add.lowering("step", total, total)] if rest else []
            out.append(sums.correction.lowering("step", total))
        corrections.append(jax.ShapeDtypeStruct((1,), jnp.float32, sharding=scalar))
    last = optimizers[-1]
    home = last.scalar
    sq = [
        jax.ShapeDtypeStruct((1,), jnp.float32, sharding=o.scalar) for o in optimizers if o.trains
    ]
    for x in sq + corrections:
        out += lower_transfer(x, home)
    stats = jax.ShapeDtypeStruct((len(STATS),), jnp.float32, sharding=home)
    if local[-1]:
        scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=home)
        parts = [jax.ShapeDtypeStruct((1,), jnp.float32, sharding=home)] * len(sq + corrections)
        with jax.set_mesh(home.mesh):  # as `apply_updates` calls them (the mesh keys the cache)
            out.append(last.loss_add.lowering("step", scalar, scalar))
            out.append(last.combine.lowering("step", parts, scalar, stats, np.float32(clip_norm)))
    for opt in optimizers:
        out += lower_transfer(stats, opt.scalar)
    return out


@jax.jit
def _combine(parts, loss, previous, clip):
    """The step's STATS from the stages' squared norms, the step's loss and the last STATS."""
    sq = sum(p[0] for p in parts)
    applied = jnp.isfinite(sq) & jnp.isfinite(loss)
    skipped = previous[3] + jnp.where(applied, 0.0, 1.0)
    norm = jnp.sqrt(jnp.maximum(sq, 0.0))
    fields = (loss, norm, applied.astype(jnp.float32), skipped, clip)
    return jnp.stack([jnp.asarray(f, jnp.float32) for f in fields])
