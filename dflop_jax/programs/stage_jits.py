"""The jitted programs of one pipeline stage: forward, backward, the fused last step, on its submesh.

A stage is given as pure functions over (params, x, side):
  forward(params, x, side) -> y                      every stage but the last
  loss(params, x, side) -> (loss_sum, count)         the last stage (forward + loss)
where `x` is the activation from the previous stage (None for the pipeline's first stage), `side` a dict
of this stage's microbatch arrays (tiles, segment ids, targets, ...), and `params` fp32 master weights.
`stage_jits` turns them into the jitted programs; it is the only place they are made: the trainer runs
them through `StageProgram`, and the model profiler (`profiling/programs.py`) compiles and times the
same jits from abstract inputs, so the profiled cost is the cost of what trains.

Backward designs, per stage (`RESIDUAL_POLICIES`, picked by `costs.residual_policies` from the memory
budget). "recompute": the forward program returns only its output; the backward program re-runs the
forward under `jax.vjp` from the saved stage input and pulls the cotangent through (memory per
in-flight microbatch: one stage input; work: one extra stage forward). "all" / "layers": the forward
program (`forward_residuals`) takes the stage's `jax.vjp` and returns its residuals, the pytree leaves
of the vjp function, each with a leading data-replica axis (the body runs per replica); the vjp's
treedef (its linear program) stays in a table of the jit, keyed by the input signature that traced it,
and the backward program (`backward_residuals`, that signature a static argument) rebuilds the
function from it and the residuals and applies it: no forward runs again. Residual leaves that are the
compute-dtype weight copies are not returned (1F1B would hold a copy per in-flight microbatch); the
backward takes the params again (the copies themselves, as the trainer calls it). "layers" is the same pair of programs over a stage built with layer
remat, whose residuals are the layer inputs (each layer's forward rebuilt inside the backward). The
driver holds each microbatch's residuals (`Held`) from its forward to its backward. The last stage
fuses forward, loss and backward in one program under every policy.

Frozen parameters (a training recipe's `optimizer.trainable`, e.g. LLaVA-OV stage 1 trains the
projector only): `trained` marks the leaves that get gradients, and the stage's `role`
(`costs.recipe.stage_role`, the one place it is decided) says whether the stage input needs one (some
earlier stage trains) and whether the stage has a backward at all. The backward differentiates w.r.t.
the trained leaves (and x only when the role's `input_grad`), so a frozen leaf has no accumulator and
no weight-gradient computation, and a stage with nothing trained behind a trainable one ("dx")
computes dL/dx only. A "forward" stage (nothing trained, no input gradient) has NO backward program
(`StageJits.backward` None, `has_backward` False): it runs forward only, keeps no input for a
backward, and the driver leaves it out of the backward wave. Such stages form a prefix of the
pipeline (a stage after a trainable one needs dL/dx).

One data-parallel reduction per step: the backward programs run their body per data replica (a
`shard_map` manual over "data" only; "model" stays Auto for the models' tp sharding) and add each
replica's gradient, UNREDUCED, into a donated fp32 accumulator with a leading data-replica axis
(`programs/accumulator.py`: per leaf (dp, *param.shape), sharded over "data" on that axis and like
the param on the rest, the leaves packed into at most two buffers), so a microbatch's backward
moves no gradient between replicas. The step's one
reduction (a sum over that axis, reduce-scattered into the ZeRO-1 optimizer's shards) is
`runtime/train_state.py`'s. JAX's reduced/unreduced sharding types would say the same without the
extra axis, but need Explicit mesh axes, which the models' Auto-axis meshes are not (DESIGN 11).

Compute dtype: the trainer's programs take the params as their compute-dtype copies, cast once per
step (`programs/stage_program.py`); a floating `x`, and params given in another floating dtype (the
fp32 masters, as tests and tools may call a program), are cast to `compute_dtype` inside. Either way
the gradient is the compute-dtype one, added into the fp32 accumulator (`Accumulator.add` upcasts
it, which is the cast's transpose); side arrays enter as the data layer packs them.

Multi-process runs: a stage whose mesh has no device of this process is NON-LOCAL (`local` False):
nothing of it is compiled or dispatched here; the driver only needs the shapes of its outputs
(`output_struct`, a trace without compilation) to take part in transfers from it.

Compiles: every program is compiled once per input-shape signature (bucket); `StageProgram.compiles`
counts the distinct signatures seen, called or lowered ahead (`StageProgram.lower`, which the trainer
runs for every bucket before step 1: `runtime/precompile.py`), which is the number of XLA
compilations JAX performs for these jits (a jit recompiles iff the abstract signature changes;
shardings and dtypes are fixed here).

Dispatch: each program is a `LeafProgram` (`programs/leaf_program.py`): the parameter tree crosses
the jit boundary as a list of leaves, the accumulator as its few buffers (`Accumulator`: a
program's call costs per output array). `StageProgram` keeps its parameters' leaves (`leaves`,
flattened when the parameters are set) and passes the accumulator's buffers from `zero_grads` to
the last backward of a step, so a call flattens no tree; its programs are issued through
`programs.dispatch.issue` (counted per step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dflop_jax.costs.recipe import ALL_TRAIN, StageRole
from dflop_jax.programs.accumulator import Accumulator
from dflop_jax.programs.leaf_program import LeafProgram
from dflop_jax.programs.sharding import mesh_axes
from dflop_jax.programs.stage_fns import (
    PyTree,
    StageFns,
    check_residual_policy,
    per_part,
    signature,
)
from dflop_jax.programs.trees import (
    all_trained,
    cast_floating,
    graft,
    negate,
    prune,
)


@dataclasses.dataclass(frozen=True)
class StageJits:
    """The jitted programs of one stage (jit compiles lazily: a program never called is never built),
    each a `LeafProgram`: called (or lowered) with the parameter tree as below, or through its `jit`
    with its leaves; `gacc` is the accumulator's buffers (`Accumulator`) either way.

    Attributes:
      forward: (params, x, side) -> y; on the last stage -> (loss_sum, count), the forward half of
        `last` (evaluation and the profiler's forward timing; training uses `last`).
      backward: (params, x, side, gy, gacc) -> (dL/dx or None, gacc + dL/dparams), `gacc` donated
        (per data replica, trained leaves only: `Accumulator`); None for a stage that
        runs forward only (nothing trained, no input gradient).
      last: (params, x, side, normalizer, gacc) -> (loss / normalizer, count, dL/dx or None,
        gacc + dL/dparams), `gacc` donated (per data replica); loss and count are over all replicas.
      zeros: params -> a zero accumulator's buffers (`Accumulator`).
      accumulator: the packing of the buffers `gacc` is (`Accumulator`).
      eval_loss: last stage only (None elsewhere): (params, x, side, totals) -> totals + (loss_sum,
        count), float32[2] replicated, `totals` donated: the forward and loss without gradients or
        accumulator, summed over an evaluation's microbatches on device (`runtime/evaluate.py`).
      forward_residuals: inner stages with a backward under a saving policy ("all", "layers"),
        else None: (params, x, side) -> (y, residuals), the residuals a list of arrays, each with
        a leading data-replica axis (dp, ...) sharded over "data" (replica r's at [r]).
      backward_residuals: with `forward_residuals`: (params, residuals, gy, gacc, sig) ->
        (dL/dx or None, gacc + dL/dparams), `gacc` donated, `sig` (static) the forward call's
        `signature(x, side)`; it runs no forward (module docstring: backward designs).
      residuals: the stage's residual policy (`RESIDUAL_POLICIES`).
    """

    forward: Callable
    backward: Callable | None
    last: Callable
    zeros: Callable
    accumulator: Accumulator
    eval_loss: Callable | None = None
    forward_residuals: Callable | None = None
    backward_residuals: Callable | None = None
    residuals: str = "recompute"


def _local_spec(spec: P | None) -> P | None:
    """`spec` as a `shard_map` over "data" sees it: only the manual "data" axis named."""
    if spec is None:
        return None
    return P(*(_only_data(e) for e in spec))


def _only_data(entry):
    return "data" if "data" in mesh_axes(entry) else None


def stage_jits(
    mesh: Mesh,
    fns: StageFns,
    params: PyTree,
    compute_dtype,
    trained: PyTree | None = None,
    role: StageRole = ALL_TRAIN,
    residuals: str = "recompute",
) -> StageJits:
    """Jits the programs of a stage: the one place a stage program is made, for training and profiling.

    Args:
      mesh: the stage's ("data", "model") mesh.
      fns: the stage's pure functions.
      params: the parameters, arrays or ShapeDtypeStructs, each with a NamedSharding (their
        shapes and shardings; the programs take them in any floating dtype, module docstring).
      compute_dtype: dtype the programs compute in (params and a floating `x` are cast inside).
      trained: bool per parameter leaf, whether it gets a gradient (None: all); the others are
        frozen (no accumulator, no weight gradient computed).
      role: the stage's role under the recipe (`costs.recipe.stage_role`): whether the stage input x
        gets a gradient and whether there is a backward program.
      residuals: the residual policy (`RESIDUAL_POLICIES`); "all" and "layers" make the same
        programs (which residuals a stage has is its functions' layer remat, `build_stages`).
    """
    trained = all_trained(params) if trained is None else trained
    stage = _Stage.of(mesh, fns, params, compute_dtype, trained, role)
    if stage.acc.structs and not role.has_backward:
        raise ValueError(f"a stage of role {role} runs forward only but holds trained parameters")
    saves = (
        check_residual_policy(residuals) != "recompute" and fns.loss is None and role.has_backward
    )
    vjps: dict[tuple, tuple] = {}  # the residual programs' table (`_forward_saving_residuals`)
    return StageJits(
        forward=_forward(stage),
        backward=_backward_recomputing(stage) if role.has_backward else None,
        last=_last_step(stage),
        zeros=_zero_accumulator(stage),
        eval_loss=None if fns.loss is None else _eval_loss(stage),
        forward_residuals=_forward_saving_residuals(stage, vjps) if saves else None,
        backward_residuals=_backward_from_residuals(stage, vjps) if saves else None,
        residuals=residuals,
        accumulator=stage.acc,
    )


@dataclasses.dataclass(frozen=True)
class _Stage:
    """What the programs of one stage share: its mesh and pure functions, the shardings the programs
    take and return, which parameters get gradients, and the stage's pieces of program (`apply`,
    `per_replica`, ...) built on them.

    Attributes:
      mesh, fns, compute_dtype: as `stage_jits`'s.
      trained: bool per parameter leaf, whether it gets a gradient; `frozen`: its negation.
      dx: whether the backward returns dL/dx (the role's `input_grad`, on a stage with an x).
      param_shardings: the fp32 parameters' NamedShardings.
      x_sharding: the stage input's, as the transfer delivers it (None: the stage has no x).
      gx_sharding: dL/dx's (`x_sharding`; None when not `dx`).
      side_sharding: the microbatch arrays' (split over "data" on the leading axis).
      scalar: a replicated value's.
      y_sharding: the forward's output's; on the last stage (scalar, scalar): loss sum and count.
      acc: the accumulator's packing (`programs/accumulator.py`: trained leaves, per data replica);
        the programs take and return its buffers.
      x_inner: the spec the functions take x in (`x_compute_spec`, else `x_spec`).
      x_local, y_local, gx_local: the specs x, y and dL/dx have inside `per_replica`.
      x_replicated: x is taken replicated over "data" with dp > 1: each replica's share of dL/dx
        is stacked on "data" (`share_gx`) and summed outside the manual region (`whole_gx`).
    """

    mesh: Mesh
    fns: StageFns
    compute_dtype: Any
    trained: PyTree
    frozen: PyTree
    dx: bool
    param_shardings: PyTree
    x_sharding: NamedSharding | dict[str, NamedSharding] | None
    gx_sharding: NamedSharding | dict[str, NamedSharding] | None
    side_sharding: NamedSharding
    scalar: NamedSharding
    y_sharding: NamedSharding | tuple[NamedSharding, NamedSharding]
    acc: Accumulator
    x_inner: P | dict[str, P] | None
    x_local: P | dict[str, P] | None
    y_local: P | None
    gx_local: P | dict[str, P] | None
    x_replicated: bool

    @classmethod
    def of(cls, mesh: Mesh, fns: StageFns, params: PyTree, compute_dtype,
           trained: PyTree, role: StageRole) -> _Stage:  # fmt: skip
        """The context of `stage_jits`'s arguments (`trained` given, not None)."""
        param_shardings = jax.tree.map(lambda a: a.sharding, params)
        dx = role.input_grad and fns.x_spec is not None
        xs = None if fns.x_spec is None else per_part(lambda p: NamedSharding(mesh, p), fns.x_spec)
        scalar = NamedSharding(mesh, P())
        # x as the functions take it: the boundary layout (`xs`), or gathered in-mesh to its own spec
        inner = fns.x_spec if fns.x_compute_spec is None else fns.x_compute_spec
        xl = None if inner is None else per_part(_local_spec, inner)
        # an x the functions take replicated over "data" (every replica's rows may read all of it;
        # the MLLM's image features are taken per row, P("data"), so not they) gets every replica's
        # share of dL/dx summed over "data" (an activation gradient, not the params'). The sum runs
        # outside the manual region, over the per-replica shares stacked on "data": a psum inside it
        # crashes XLA:CPU's compiler when "model" is Auto with tp > 1 ("Invalid binary instruction
        # opcode copy"), and at dp 1 it is rejected ("Cross-partition allreduce must be in
        # (partial) manual partitioning mode").
        x_replicated = mesh.shape["data"] > 1 and isinstance(xl, P) and not any(xl)
        if isinstance(xl, dict) and mesh.shape["data"] > 1 and not all(map(any, xl.values())):
            raise ValueError(f"x parts {xl}: a joining stage takes every part split over 'data'")
        return cls(
            mesh=mesh,
            fns=fns,
            compute_dtype=compute_dtype,
            trained=trained,
            frozen=negate(trained),
            dx=dx,
            param_shardings=param_shardings,
            x_sharding=xs,
            gx_sharding=xs if dx else None,
            side_sharding=NamedSharding(mesh, P("data")),
            scalar=scalar,
            y_sharding=(scalar, scalar)
            if fns.loss is not None
            else NamedSharding(mesh, fns.y_spec),
            acc=Accumulator.of(params, trained),
            x_inner=inner,
            x_local=xl,
            y_local=_local_spec(fns.y_spec),
            gx_local=(P("data", *xl) if x_replicated else xl) if dx else None,
            x_replicated=x_replicated,
        )

    @property
    def param_tree(self) -> jax.tree_util.PyTreeDef:
        return jax.tree.structure(self.param_shardings)

    def share_gx(self, gx):
        """One replica's dL/dx as `per_replica` returns it (stacked on "data" when `x_replicated`)."""
        return gx[None] if self.x_replicated else gx

    def whole_gx(self, gx):
        """dL/dx of `per_replica`'s output (the replicas' shares summed when `x_replicated`)."""
        return None if gx is None else (gx.sum(0) if self.x_replicated else gx)

    def gather(self, x):
        """x in the functions' layout: an in-mesh all-gather where it arrives split (`x_spec`).
        dL/dx leaves in the boundary layout (`gx_sharding`): its sum over data replicas
        reduce-scattered."""
        if x is None or self.fns.x_compute_spec is None:
            return x
        inner = per_part(lambda p: NamedSharding(self.mesh, p), self.x_inner)
        return jax.lax.with_sharding_constraint(x, inner)

    def cast_x(self, x):
        """x in the compute dtype where it is floating (token ids stay as they are)."""
        if x is None:
            return x
        return per_part(
            lambda a: a.astype(self.compute_dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a,
            x,
        )

    def apply(self, params, x, side):
        """The stage's function (forward, or the last stage's loss) in the compute dtype; x in the
        functions' layout (inside `per_replica`: its shard)."""
        p = cast_floating(params, self.compute_dtype)
        x = self.cast_x(x)
        return self.fns.forward(p, x, side) if self.fns.loss is None else self.fns.loss(p, x, side)

    def per_replica(self, body, in_specs, out_specs):
        """`body` on each data replica's shard. Without replication checks (`check_vma=False`)
        autodiff inside the body keeps each replica's parameter gradient local (with them it would
        psum the gradient of the replicated params over "data", and the models' scans would need
        their carries cast to replica-varying)."""
        return jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names={"data"},
            check_vma=False,
        )

    def differentiable(self, params, x, side):
        """(f, primals): the stage as a function of what gets gradients (trained leaves, and x when
        `dx`); the frozen leaves and an x without gradient are closed over, so autodiff computes no
        cotangent for them (no weight gradient of a frozen layer, no backward of a frozen prefix)."""
        held = prune(params, self.frozen)

        def f(t, *x_):
            return self.apply(graft(t, held), x_[0] if self.dx else x, side)

        return f, (prune(params, self.trained), *((x,) if self.dx else ()))

    def weight_copies(self, params) -> list:
        """The compute-dtype copies of the params, trained leaves first (a residual's slot)."""
        cd = self.compute_dtype
        return jax.tree.leaves((cast_floating(prune(params, self.trained), cd),
                                cast_floating(prune(params, self.frozen), cd)))  # fmt: skip


def _forward(stage: _Stage) -> LeafProgram:
    """`StageJits.forward`: the stage's function without gradients."""
    c = stage
    return LeafProgram(
        # a lambda: the XLA program is named after it (`jit__lambda`) in compile logs and profiles
        lambda params, x, side: c.apply(params, c.gather(x), side),
        (c.param_tree, None, None),
        None,
        in_shardings=(c.param_shardings, c.x_sharding, c.side_sharding),
        out_shardings=c.y_sharding,
    )


def _backward_recomputing(stage: _Stage) -> LeafProgram:
    """`StageJits.backward`: the forward re-run under `jax.vjp` from the stage input, the cotangent
    pulled through it, the gradient added to the donated accumulator."""
    c = stage

    def recompute_and_pull_back(params, x, side, gy, gacc):  # one replica's shard
        f, primals = c.differentiable(params, x, side)
        _, vjp = jax.vjp(f, *primals)
        gp, *gx = vjp(gy)
        return (c.share_gx(gx[0]) if c.dx else None), c.acc.add(gacc, gp)

    def backward_recomputing(params, x, side, gy, gacc):
        specs = (P(), c.x_local, P("data"), c.y_local, P("data"))
        body = c.per_replica(recompute_and_pull_back, specs, (c.gx_local, P("data")))
        gx, gacc = body(params, c.gather(x), side, gy, gacc)
        return c.whole_gx(gx), gacc

    return LeafProgram(
        backward_recomputing,
        (c.param_tree, None, None, None, None),
        None,
        in_shardings=(
            c.param_shardings,
            c.x_sharding,
            c.side_sharding,
            c.y_sharding,
            c.acc.shardings,
        ),  # fmt: skip
        out_shardings=(c.gx_sharding, c.acc.shardings),
        donate_argnums=(4,),
        name="bwd",
    )


def _last_step(stage: _Stage) -> LeafProgram:
    """`StageJits.last`: the last stage's forward, loss and backward in one program."""
    c = stage

    def loss_and_gradients(params, x, side, normalizer, gacc):  # one replica's shard
        f, primals = c.differentiable(params, x, side)

        def objective(*args):
            loss_sum, count = f(*args)
            return loss_sum.astype(jnp.float32) / normalizer, count

        argnums = tuple(range(len(primals)))
        (loss, count), (gp, *gx) = jax.value_and_grad(objective, argnums, has_aux=True)(*primals)
        loss, count = jax.lax.psum((loss, count), "data")  # two scalars, not the gradient
        return loss, count, (c.share_gx(gx[0]) if c.dx else None), c.acc.add(gacc, gp)

    def forward_loss_backward(params, x, side, normalizer, gacc):
        specs = (P(), c.x_local, P("data"), P(), P("data"))
        body = c.per_replica(loss_and_gradients, specs, (P(), P(), c.gx_local, P("data")))
        loss, count, gx, gacc = body(params, c.gather(x), side, normalizer, gacc)
        return loss, count, c.whole_gx(gx), gacc

    return LeafProgram(
        forward_loss_backward,
        (c.param_tree, None, None, None, None),
        None,
        in_shardings=(c.param_shardings, c.x_sharding, c.side_sharding, c.scalar, c.acc.shardings),
        out_shardings=(c.scalar, c.scalar, c.gx_sharding, c.acc.shardings),
        donate_argnums=(4,),
        name="last",
    )


def _zero_accumulator(stage: _Stage) -> LeafProgram:
    """`StageJits.zeros`: a zero accumulator of the trained leaves, one per data replica."""
    c = stage
    return LeafProgram(
        # a lambda: the XLA program is named after it (`jit__lambda`) in compile logs and profiles
        lambda p: c.acc.zeros(),
        (c.param_tree,),
        None,
        in_shardings=(c.param_shardings,),
        out_shardings=c.acc.shardings,
    )


def _eval_loss(stage: _Stage) -> LeafProgram:
    """`StageJits.eval_loss`: the last stage's loss sum and count added to the running totals."""
    c = stage

    def add_loss_and_count(params, x, side, totals):
        loss_sum, count = c.apply(params, c.gather(x), side)
        return totals + jnp.stack([loss_sum.astype(jnp.float32), count.astype(jnp.float32)])

    return LeafProgram(
        add_loss_and_count,
        (c.param_tree, None, None, None),
        None,
        in_shardings=(c.param_shardings, c.x_sharding, c.side_sharding, c.scalar),
        out_shardings=c.scalar,
        donate_argnums=(3,),
        name="eval_loss",
    )


# Backward from saved residuals. The forward takes the vjp of the stage w.r.t. the compute-dtype
# copies of its trained params (and x when `dx`) and returns the vjp's pytree leaves; its treedef
# (the linear program) stays in the table both programs share (`vjps`: signature -> (vjp treedef,
# weight-copy slot per leaf, x dtype)), per input signature, from the forward's trace. Residual
# leaves that ARE a weight copy are not returned (1F1B would hold one copy per in-flight
# microbatch): the backward takes the params again (the trainer's copies: no cast; fp32 masters
# given: a cheap elementwise cast).


def _forward_saving_residuals(stage: _Stage, vjps: dict[tuple, tuple]) -> LeafProgram:
    """`StageJits.forward_residuals`: the forward under `jax.vjp`, returning y and the vjp's leaves
    (weight copies left out), its treedef recorded in `vjps` under the call's signature."""
    c, cd = stage, stage.compute_dtype

    def forward_saving_residuals(params, x, side):
        sig = signature(x, side)

        def vjp_residuals(params, x, side):  # one replica's shard
            t = cast_floating(prune(params, c.trained), cd)
            held = cast_floating(prune(params, c.frozen), cd)
            xc = c.cast_x(x)

            def f(t, *x_):
                return c.fns.forward(graft(t, held), x_[0] if c.dx else xc, side)

            y, vjp = jax.vjp(f, t, *((xc,) if c.dx else ()))
            leaves, tree = jax.tree_util.tree_flatten(vjp)
            if any(callable(leaf) for leaf in leaves):
                raise RuntimeError(
                    f"this jax ({jax.__version__}) does not return jax.vjp's function as a pytree "
                    "of arrays: train with residuals=recompute"
                )
            slots = {id(w): i for i, w in enumerate(jax.tree.leaves((t, held)))}
            where = tuple(slots.get(id(leaf)) for leaf in leaves)
            vjps[sig] = (tree, where, None if x is None else per_part(lambda a: a.dtype, x))
            return y, [jnp.asarray(a)[None] for a, w in zip(leaves, where) if w is None]

        body = c.per_replica(vjp_residuals, (P(), c.x_local, P("data")), (c.y_local, P("data")))
        y, kept = body(params, c.gather(x), side)
        return jax.lax.with_sharding_constraint(y, c.y_sharding), kept

    return LeafProgram(
        forward_saving_residuals, (c.param_tree, None, None), (None, None), name="fwd_res"
    )


def _backward_from_residuals(stage: _Stage, vjps: dict[tuple, tuple]) -> LeafProgram:
    """`StageJits.backward_residuals`: the vjp rebuilt from `vjps`' treedef of the forward's
    signature and the saved residuals (the weight copies taken again) and applied; no forward."""
    c = stage

    def backward_from_residuals(params, kept, gy, gacc, sig):
        if sig not in vjps:
            raise RuntimeError(f"no forward with residuals was traced for the signature {sig}")
        tree, where, x_dtype = vjps[sig]

        def pull_back(params, kept, gy, gacc):  # one replica's shard
            copies, it = c.weight_copies(params), iter(kept)
            leaves = [next(it)[0] if w is None else copies[w] for w in where]
            gp, *gx = jax.tree_util.tree_unflatten(tree, leaves)(gy)
            gx = jax.tree.map(lambda g, d: g.astype(d), gx[0], x_dtype) if c.dx else None
            return (c.share_gx(gx) if c.dx else None), c.acc.add(gacc, gp)

        specs = (P(), P("data"), c.y_local, P("data"))
        body = c.per_replica(pull_back, specs, (c.gx_local, P("data")))
        gx, gacc = body(params, kept, gy, gacc)
        return c.whole_gx(gx), gacc

    return LeafProgram(
        backward_from_residuals,
        (c.param_tree, None, None, None, None),
        None,
        static_argnums=(4,),
        out_shardings=(c.gx_sharding, c.acc.shardings),
        donate_argnums=(3,),
        name="bwd_res",
    )
