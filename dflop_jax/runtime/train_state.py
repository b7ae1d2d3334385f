"""Per-stage optimizer state and update, with gradient clipping by the GLOBAL norm over all stages.

Each stage keeps fp32 master params and its own optax AdamW state (warmup + cosine schedule) on its
submesh. Clipping needs the norm of the whole model's gradient, and none of it touches the host (the
trainer dispatches the next step before this one's numbers are read): each stage computes its squared
norm on its mesh, `transfer` moves the [1] vectors onto the last stage's mesh (across processes too),
one program there sums them with the loss contributions into the step's `STATS` vector, and that vector
moves back to every stage's mesh, whose update scales its gradients by optax.clip_by_global_norm's rule
with the global norm. A step whose loss or gradients are not finite (a non-finite sum of squares or of
the loss) keeps every stage's params and optimizer state (optax.apply_if_finite's zero update, the
Adam count included) and adds one to the skip counter that the vector carries from step to step.

Optimizer state is created by `jax.jit(tx.init)` WITH out_shardings derived from the params' shardings
(a plain `jax.jit(tx.init)` would put it on one device; DESIGN section 11).

Tied parameters (a tied embedding: the first LLM stage embeds with it, the last one projects with its
own copy, `models.decoder`): one parameter held by several stages. `tied_groups` finds them (the same
model-level path in several stages), `apply_updates` gives every copy the SUM of the copies' gradients
(moved between the stage meshes like activations, `runtime/transfer.py`) and counts it once in the global norm, so the copies
start equal (built from one array), get the same update from the same AdamW state, and stay equal:
what the single-device model computes. A checkpoint stores the parameter once and restores it to every
copy.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dflop_jax.config import require
from dflop_jax.costs.layout import StageSpec
from dflop_jax.runtime.checkpoint import global_path, key_name
from dflop_jax.runtime.stages import PyTree, StageProgram, put_host
from dflop_jax.runtime.transfer import stand_in, transfer


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup and cosine decay; clipping by the global gradient norm.

    Attributes:
      lr: peak learning rate.
      warmup_steps: linear warmup from 0 to `lr`.
      decay_steps: total schedule length (cosine decays to `end_lr_ratio * lr` by then).
      end_lr_ratio: final learning rate as a fraction of `lr`.
      b1, b2, eps: Adam moments.
      weight_decay: decoupled decay, applied to matrices only (ndim >= 2).
      clip_norm: max global gradient norm (0 disables clipping).
    """

    lr: float = 3e-3
    warmup_steps: int = 5
    decay_steps: int = 100
    end_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_norm: float = 1.0

    def __post_init__(self):
        require(self.lr > 0, "optimizer.lr", self.lr, "must be > 0")
        require(self.warmup_steps >= 0, "optimizer.warmup_steps", self.warmup_steps, "must be >= 0")
        require(
            self.decay_steps > self.warmup_steps,
            "optimizer.decay_steps",
            self.decay_steps,
            "must exceed optimizer.warmup_steps",
        )
        require(
            0 <= self.end_lr_ratio <= 1, "optimizer.end_lr_ratio", self.end_lr_ratio, "in [0, 1]"
        )
        require(
            self.clip_norm >= 0, "optimizer.clip_norm", self.clip_norm, "must be >= 0 (0 = off)"
        )
        for name in ("b1", "b2"):
            value = getattr(self, name)
            require(0 <= value < 1, f"optimizer.{name}", value, "must be in [0, 1)")
        require(self.eps > 0, "optimizer.eps", self.eps, "must be > 0")
        require(self.weight_decay >= 0, "optimizer.weight_decay", self.weight_decay, "must be >= 0")

    def schedule(self) -> optax.Schedule:
        return optax.warmup_cosine_decay_schedule(
            0.0, self.lr, self.warmup_steps, self.decay_steps, self.lr * self.end_lr_ratio
        )

    def build(self) -> optax.GradientTransformation:
        """The per-stage transformation (clipping is applied before it, across stages)."""
        return optax.adamw(
            self.schedule(),
            b1=self.b1,
            b2=self.b2,
            eps=self.eps,
            weight_decay=self.weight_decay,
            mask=lambda params: jax.tree.map(lambda a: a.ndim >= 2, params),
        )


STATS = ("loss", "grad_norm", "applied", "skipped_steps", "clip_norm")
"""Fields of the per-step statistics vector `apply_updates` leaves on the last stage's mesh."""


class StageOptimizer:
    """One stage's optimizer state and jitted update on the stage's mesh."""

    def __init__(self, stage: StageProgram, tx: optax.GradientTransformation):
        self.stage = stage
        self.tx = tx
        ps = stage.param_shardings
        scalar = NamedSharding(stage.mesh, P())
        abstract = jax.eval_shape(tx.init, stage.params)
        self.state_shardings = optax.tree_map_params(
            tx, lambda _, s: s, abstract, ps, transform_non_params=lambda _: scalar
        )
        self._init = jax.jit(tx.init, in_shardings=(ps,), out_shardings=self.state_shardings)
        self.state = self.init_state()
        self._sq_norm = jax.jit(
            lambda g: sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(g)).reshape(1),
            in_shardings=(ps,),
            out_shardings=scalar,
        )
        self._update = jax.jit(
            functools.partial(_guarded_update, tx),
            in_shardings=(ps, self.state_shardings, ps, scalar),
            out_shardings=(ps, self.state_shardings),
            donate_argnums=(0, 1),
        )
        self.scalar = scalar

    def init_state(self) -> PyTree:
        """Fresh optimizer state for the stage's current params, sharded like them."""
        with jax.set_mesh(self.stage.mesh):
            return self._init(self.stage.params)

    def sq_norm(self, grads: PyTree) -> jax.Array:
        """|grads|^2 as a [1] vector, replicated on the stage's mesh."""
        with jax.set_mesh(self.stage.mesh):
            return self._sq_norm(grads)

    def apply(self, grads: PyTree, stats: jax.Array) -> None:
        """Updates the stage's params and state in place (old buffers donated) from the step's
        `STATS` vector on this stage's mesh: clipped by its global norm, skipped unless applied."""
        with jax.set_mesh(self.stage.mesh):
            self.stage.params, self.state = self._update(
                self.stage.params, self.state, grads, stats
            )


def _guarded_update(tx, params, state, grads, stats):
    """optax.clip_by_global_norm's rule with the GLOBAL norm (stats), then `tx`; a step whose loss or
    gradients are not finite keeps the old params and state (optax.apply_if_finite's zero update)."""
    norm, applied, clip = stats[1], stats[2] > 0, stats[4]
    keep = (clip <= 0) | (norm < clip)
    grads = jax.tree.map(lambda g: jnp.where(keep, g, (g / norm.astype(g.dtype)) * clip), grads)
    updates, new_state = tx.update(grads, state, params)
    new_params = optax.apply_updates(params, updates)
    pick = functools.partial(jax.tree.map, lambda new, old: jnp.where(applied, new, old))
    return pick(new_params, params), pick(new_state, state)


TiedGroup = tuple[tuple[int, tuple[str, ...]], ...]  # ((stage index, leaf path in its params), ...)


def _leaf_names(path) -> tuple[str, ...]:
    return tuple(key_name(k) for k in path)


def tied_groups(specs: list[StageSpec], params: list[PyTree]) -> list[TiedGroup]:
    """Leaves that several stages hold (same model-level path): one group per tied parameter."""
    where: dict[tuple, list] = {}
    for i, (spec, tree) in enumerate(zip(specs, params)):
        for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
            where.setdefault((spec.module, *global_path(path, spec)), []).append(
                (i, _leaf_names(path))
            )
    return [tuple(group) for group in where.values() if len(group) > 1]


def tie_gradients(
    grads: list[PyTree], groups: list[TiedGroup]
) -> tuple[list[PyTree], list[jax.Array]]:
    """Every copy of a tied parameter gets the sum of the copies' gradients.

    Copies move between stage meshes with `transfer` (device to device, across processes too). A
    non-local stage's tree holds `jax.ShapeDtypeStruct`s (with shardings): this process only takes
    part in the transfers that touch its devices.

    Returns the new gradient trees and, per group, a scalar to ADD to the sum of the stages' squared
    norms so the parameter counts once: -(copies - 1) * |summed gradient|^2 (a stand-in on processes
    that do not hold the first copy's stage).
    """
    flat = [jax.tree_util.tree_flatten_with_path(g) for g in grads]
    leaves = [[leaf for _, leaf in f] for f, _ in flat]
    index = [{_leaf_names(path): j for j, (path, _) in enumerate(f)} for f, _ in flat]
    corrections = []
    for group in groups:
        (s0, p0), *rest = group
        total = leaves[s0][index[s0][p0]]
        for s, p in rest:
            moved = transfer(leaves[s][index[s][p]], total.sharding)
            total = total + moved if _holds(total) else total
        for s, p in group:
            j = index[s][p]
            leaves[s][j] = transfer(total, leaves[s][j].sharding)
        scalar = NamedSharding(total.sharding.mesh, P())
        corrections.append(
            (-(len(group) - 1) * jnp.sum(jnp.square(total))).reshape(1)
            if _holds(total)
            else stand_in((1,), jnp.float32, scalar)
        )
    trees = [jax.tree_util.tree_unflatten(treedef, ls) for (_, treedef), ls in zip(flat, leaves)]
    return trees, corrections


def _holds(leaf) -> bool:
    """True when this process holds shards of `leaf` (not a shape or a stand-in)."""
    return isinstance(leaf, jax.Array) and bool(leaf.addressable_shards)


def _structs(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def apply_updates(
    optimizers: list[StageOptimizer],
    grads: list[PyTree],
    clip_norm: float,
    loss: list[jax.Array] = (),
    previous: jax.Array | None = None,
    tied: list[TiedGroup] = (),
) -> list[jax.Array]:
    """Clips by the global norm over all stages and updates every stage, all on device.

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
    grads = [g if g is not None else _structs(o.stage.params) for o, g in zip(optimizers, grads)]
    corrections = []
    if tied:
        grads, corrections = tie_gradients(list(grads), list(tied))
    sq = [
        opt.sq_norm(g) if here else stand_in((1,), jnp.float32, opt.scalar)
        for opt, g, here in zip(optimizers, grads, local)
    ]
    home = optimizers[-1].scalar
    parts = [transfer(x, home) for x in sq + corrections]
    if local[-1]:
        prev = (
            previous if previous is not None else put_host(np.zeros(len(STATS), np.float32), home)
        )
        with jax.set_mesh(home.mesh):
            stats = _combine(parts, list(loss), prev, np.float32(clip_norm))
    else:
        stats = stand_in((len(STATS),), jnp.float32, home)
    copies = [transfer(stats, opt.scalar) for opt in optimizers]
    for opt, g, here, mine in zip(optimizers, grads, local, copies):
        if here:
            opt.apply(g, mine)
    return copies


@jax.jit
def _combine(parts, loss, previous, clip):
    """The step's STATS from the stages' squared norms, the loss contributions and the last STATS."""
    sq = sum(p[0] for p in parts)
    total = sum(loss) if loss else jnp.zeros((), jnp.float32)
    applied = jnp.isfinite(sq) & jnp.isfinite(total)
    skipped = previous[3] + jnp.where(applied, 0.0, 1.0)
    norm = jnp.sqrt(jnp.maximum(sq, 0.0))
    fields = (total, norm, applied.astype(jnp.float32), skipped, clip)
    return jnp.stack([jnp.asarray(f, jnp.float32) for f in fields])
