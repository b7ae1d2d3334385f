"""Per-stage optimizer state and update, with gradient clipping by the GLOBAL norm over all stages.

Each stage keeps fp32 master params and its own optax AdamW state (warmup + cosine schedule) on its
submesh. Clipping needs the norm of the whole model's gradient: each stage computes its squared norm
on its mesh, the host sums the scalars (one tiny pull per stage, which the step's loss pull needs
anyway; in multi-process runs the scalars travel between processes with `host_scalars`), and each
stage's update scales its gradients by min(1, max_norm / global_norm) -- the
`optax.clip_by_global_norm` rule applied across stages.

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

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dflop_jax.config import require
from dflop_jax.costs.layout import StageSpec
from dflop_jax.runtime.checkpoint import holds_encoder, key_name, model_paths
from dflop_jax.runtime.distributed import host_scalars
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
            lambda g: sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(g)),
            in_shardings=(ps,),
            out_shardings=scalar,
        )

        def update(params, state, grads, scale):
            grads = jax.tree.map(lambda g: g * scale, grads)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        self._update = jax.jit(
            update,
            in_shardings=(ps, self.state_shardings, ps, scalar),
            out_shardings=(ps, self.state_shardings),
            donate_argnums=(0, 1),
        )
        self._scalar = scalar

    def init_state(self) -> PyTree:
        """Fresh optimizer state for the stage's current params, sharded like them."""
        with jax.set_mesh(self.stage.mesh):
            return self._init(self.stage.params)

    def sq_norm(self, grads: PyTree) -> jax.Array:
        with jax.set_mesh(self.stage.mesh):
            return self._sq_norm(grads)

    def apply(self, grads: PyTree, scale: float) -> None:
        """Updates the stage's params and state in place (old buffers donated)."""
        s = put_host(np.float32(scale), self._scalar)
        with jax.set_mesh(self.stage.mesh):
            self.stage.params, self.state = self._update(self.stage.params, self.state, grads, s)


def clip_scale(global_norm: float, clip_norm: float) -> float:
    """optax.clip_by_global_norm's factor: 1 below the threshold, clip_norm / norm above."""
    if clip_norm <= 0 or global_norm < clip_norm:
        return 1.0
    return clip_norm / global_norm


TiedGroup = tuple[tuple[int, tuple[str, ...]], ...]  # ((stage index, leaf path in its params), ...)


def _leaf_names(path) -> tuple[str, ...]:
    return tuple(key_name(k) for k in path)


def tied_groups(specs: list[StageSpec], params: list[PyTree]) -> list[TiedGroup]:
    """Leaves that several stages hold (same model-level path): one group per tied parameter."""
    where: dict[tuple, list] = {}
    for i, (spec, tree) in enumerate(zip(specs, params)):
        fused = holds_encoder(tree)
        for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
            where.setdefault(model_paths(path, spec, fused)[0], []).append((i, _leaf_names(path)))
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
            -(len(group) - 1) * jnp.sum(jnp.square(total))
            if _holds(total)
            else stand_in((), jnp.float32, scalar)
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
    tag: str = "norm",
    tied: list[TiedGroup] = (),
) -> float:
    """Clips by the global norm over all stages and updates every stage; returns the global norm.

    `tag` names this call's scalars in multi-process runs (unique per step, see `host_scalars`);
    `tied` = `tied_groups(...)` of the stages (their copies get summed gradients, counted once).
    """
    local = [getattr(opt.stage, "local", True) for opt in optimizers]
    # A non-local stage (no gradients here, None) takes part by its shapes and a stand-in norm.
    grads = [g if g is not None else _structs(o.stage.params) for o, g in zip(optimizers, grads)]
    corrections = []
    if tied:
        grads, corrections = tie_gradients(list(grads), list(tied))
    sq = [
        opt.sq_norm(g) if here else stand_in((), jnp.float32, NamedSharding(opt.stage.mesh, P()))
        for opt, g, here in zip(optimizers, grads, local)
    ]
    global_norm = max(float(host_scalars(sq + corrections, tag).sum()), 0.0) ** 0.5
    scale = clip_scale(global_norm, clip_norm)
    for opt, g, here in zip(optimizers, grads, local):
        if here:
            opt.apply(g, scale)
    return global_norm
