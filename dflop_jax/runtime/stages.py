"""Stage programs: one pipeline stage's jitted forward / backward / fused last step on its submesh.

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
backward casts the params again. "layers" is the same pair of programs over a stage built with layer
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
(`accumulator_structs`: shape (dp, *param.shape), sharded over "data" on that axis and like the
param on the rest), so a microbatch's backward moves no gradient between replicas. The step's one
reduction (a sum over that axis, reduce-scattered into the ZeRO-1 optimizer's shards) is
`runtime/train_state.py`'s. JAX's reduced/unreduced sharding types would say the same without the
extra axis, but need Explicit mesh axes, which the models' Auto-axis meshes are not (DESIGN 11).

Compute dtype: params (and a floating `x`) are cast to `compute_dtype` inside the program, so gradients
w.r.t. the fp32 masters come back in fp32; side arrays enter as the data layer packs them.

Multi-process runs: a stage whose mesh has no device of this process is NON-LOCAL (`local` False):
nothing of it is compiled or dispatched here; the driver only needs the shapes of its outputs
(`output_struct`, a trace without compilation) to take part in transfers from it.

Compiles: every program is compiled once per input-shape signature (bucket); `StageProgram.compiles`
counts the distinct signatures seen, called or lowered ahead (`StageProgram.lower`, which the trainer
runs for every bucket before step 1: `runtime/precompile.py`), which is the number of XLA
compilations JAX performs for these jits (a jit recompiles iff the abstract signature changes;
shardings and dtypes are fixed here).

Dispatch: each program is a `LeafProgram` (`runtime/leaf_program.py`): the parameter and accumulator
trees cross the jit boundary as lists of leaves. `StageProgram` keeps its parameters' leaves
(`leaves`, flattened when the parameters are set) and passes the accumulator as leaves from
`zero_grads` to the last backward of a step, so a call flattens no tree; its programs are issued
through `runtime.dispatch.issue` (counted per step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dflop_jax.contracts.cost_table import RESIDUAL_POLICIES
from dflop_jax.costs.recipe import ALL_TRAIN, StageRole
from dflop_jax.runtime.dispatch import STAGE, issue
from dflop_jax.runtime.leaf_program import LeafProgram
from dflop_jax.runtime.trees import (  # noqa: F401  (re-exported: callers import them from here)
    accumulator_sharding,
    accumulator_structs,
    all_trained,
    cast_floating,
    graft,
    negate,
    prune,
)

PyTree = Any
ForwardFn = Callable[[PyTree, Any, Mapping[str, jax.Array]], jax.Array]
LossFn = Callable[[PyTree, Any, Mapping[str, jax.Array]], tuple[jax.Array, jax.Array]]


def check_residual_policy(policy: str) -> str:
    if policy not in RESIDUAL_POLICIES:
        raise ValueError(f"residual policy {policy!r}: use one of {list(RESIDUAL_POLICIES)}")
    return policy


def signature(x, side: Mapping[str, Any]) -> tuple:
    """The input-shape signature of a stage program call: (x shape and dtype, side shapes and
    dtypes), from arrays, ShapeDtypeStructs or tracers alike (a jit compiles once per signature)."""
    xshape = None if x is None else (tuple(x.shape), str(x.dtype))
    return xshape, tuple((k, tuple(side[k].shape), str(side[k].dtype)) for k in sorted(side))


def put_host(value, sharding: NamedSharding) -> jax.Array:
    """Places a host value (identical on every process) onto `sharding`; each process writes only
    the shards it addresses, so this also works when the mesh spans (or lies on) other processes."""
    arr = np.asarray(value)
    return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx], dtype=arr.dtype)


def enable_compilation_cache(cache_dir: str | Path) -> None:
    """Turns on JAX's persistent compilation cache (every program, however fast it compiles)."""
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@dataclasses.dataclass(frozen=True)
class StageFns:
    """The pure functions of one stage (exactly one of `forward` / `loss` is set).

    Attributes:
      forward: (params, x, side) -> y, for every stage but the last.
      loss: (params, x, side) -> (loss_sum, count) for the last stage; loss_sum is un-normalized.
      side_keys: the microbatch fields this stage reads (keys of `side`).
      optional_keys: fields placed only when the microbatch has them (present and not None), e.g.
        the exact feature taps of LLaVA-OV data; the functions test `key in side` (a separate compile).
      x_spec: PartitionSpec of the stage input x on this stage's mesh, as the transfer delivers it
        (None: the stage has no x). An axis it shards that its devices do not divide arrives
        padded with zeros at the end (`boundary_shape`).
      x_compute_spec: the spec the functions take x in, when it differs from `x_spec` (None: the
        same): the programs reshard x to it on entry, an in-mesh collective (e.g. the all-gather
        of features that arrive split over the stage's devices), and dL/dx back to `x_spec` (the
        matching reduce-scatter), so the bytes that cross the stage boundary are one copy. Such an
        x must arrive unpadded (`StageProgram.x_struct` refuses one that would need padding).
      y_spec: PartitionSpec of the stage output y (unused for the last stage).
    """

    forward: ForwardFn | None = None
    loss: LossFn | None = None
    side_keys: tuple[str, ...] = ()
    optional_keys: tuple[str, ...] = ()
    x_spec: P | None = None
    x_compute_spec: P | None = None
    y_spec: P = P("data")

    def __post_init__(self):
        if (self.forward is None) == (self.loss is None):
            raise ValueError(
                "StageFns: set exactly one of forward (inner stage) or loss (last stage)"
            )

    def fields(self, batch: Mapping[str, Any]) -> tuple[str, ...]:
        """The microbatch fields this stage reads from `batch`: its side keys, plus the optional
        ones the batch has (present and not None)."""
        optional = tuple(k for k in self.optional_keys if batch.get(k) is not None)
        return self.side_keys + optional


@dataclasses.dataclass(frozen=True)
class StageJits:
    """The jitted programs of one stage (jit compiles lazily: a program never called is never built),
    each a `LeafProgram`: called (or lowered) with the parameter and accumulator trees as below, or
    through its `jit` with their leaves.

    Attributes:
      forward: (params, x, side) -> y; on the last stage -> (loss_sum, count), the forward half of
        `last` (evaluation and the profiler's forward timing; training uses `last`).
      backward: (params, x, side, gy, gacc) -> (dL/dx or None, gacc + dL/dparams), `gacc` donated
        (per data replica, trained leaves only: `accumulator_structs`); None for a stage that
        runs forward only (nothing trained, no input gradient).
      last: (params, x, side, normalizer, gacc) -> (loss / normalizer, count, dL/dx or None,
        gacc + dL/dparams), `gacc` donated (per data replica); loss and count are over all replicas.
      zeros: params -> a zero accumulator (`accumulator_structs`).
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
    eval_loss: Callable | None = None
    forward_residuals: Callable | None = None
    backward_residuals: Callable | None = None
    residuals: str = "recompute"


def boundary_shape(shape: Sequence[int], sharding: NamedSharding) -> tuple[int, ...]:
    """`shape` with each axis that `sharding` splits padded up to a multiple of its shard count:
    the shape a stage takes its input in (a jit input's sharded axis must divide evenly). Unchanged
    where every axis divides, as between stages of one module."""
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    out = []
    for n, entry in zip(shape, spec):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        k = int(np.prod([sharding.mesh.shape[a] for a in names], dtype=int))
        out.append(-(-n // k) * k)
    return tuple(out)


def _local_spec(spec: P | None) -> P | None:
    """`spec` as a `shard_map` over "data" sees it: only the manual "data" axis named."""
    if spec is None:
        return None
    return P(*(_only_data(e) for e in spec))


def _only_data(entry):
    names = (entry,) if isinstance(entry, str) else tuple(entry or ())
    return "data" if "data" in names else None


def stage_jits(
    mesh: Mesh,
    fns: StageFns,
    param_shardings: PyTree,
    compute_dtype,
    trained: PyTree | None = None,
    role: StageRole = ALL_TRAIN,
    residuals: str = "recompute",
) -> StageJits:
    """Jits the programs of a stage: the one place a stage program is made, for training and profiling.

    Args:
      mesh: the stage's ("data", "model") mesh.
      fns: the stage's pure functions.
      param_shardings: NamedShardings of the fp32 parameters (same tree as the params).
      compute_dtype: dtype the programs compute in (params and a floating `x` are cast inside).
      trained: bool per parameter leaf, whether it gets a gradient (None: all); the others are
        frozen (no accumulator, no weight gradient computed).
      role: the stage's role under the recipe (`costs.recipe.stage_role`): whether the stage input x
        gets a gradient and whether there is a backward program.
      residuals: the residual policy (`RESIDUAL_POLICIES`); "all" and "layers" make the same
        programs (which residuals a stage has is its functions' layer remat, `build_stages`).
    """
    ps = param_shardings
    trained = all_trained(ps) if trained is None else trained
    dx = role.input_grad and fns.x_spec is not None  # the backward returns dL/dx
    xs = None if fns.x_spec is None else NamedSharding(mesh, fns.x_spec)
    gxs = xs if dx else None
    side_s = NamedSharding(mesh, P("data"))
    scalar = NamedSharding(mesh, P())
    ys = (scalar, scalar) if fns.loss is not None else NamedSharding(mesh, fns.y_spec)
    accs = jax.tree.map(accumulator_sharding, prune(ps, trained))
    trains = bool(jax.tree.leaves(accs))
    if trains and not role.has_backward:
        raise ValueError(f"a stage of role {role} runs forward only but holds trained parameters")
    frozen = negate(trained)
    dp = mesh.shape["data"]
    # x as the functions take it: the boundary layout (`xs`), or gathered in-mesh to its own spec
    inner = fns.x_spec if fns.x_compute_spec is None else fns.x_compute_spec
    xl, yl = _local_spec(inner), _local_spec(fns.y_spec)
    # an x the functions take replicated over "data" (every replica's rows may read all of it; the
    # MLLM's image features are taken per row, P("data"), so not they) gets every replica's share of
    # dL/dx summed over "data" (an activation gradient, not the params'). The sum
    # runs outside the manual region, over the per-replica shares stacked on "data": a psum inside it
    # crashes XLA:CPU's compiler when "model" is Auto with tp > 1 ("Invalid binary instruction
    # opcode copy"), and at dp 1 it is rejected ("Cross-partition allreduce must be in (partial)
    # manual partitioning mode").
    x_replicated = dp > 1 and xl is not None and not any(xl)
    gxl = (P("data", *xl) if x_replicated else xl) if dx else None

    def share_gx(gx):
        return gx[None] if x_replicated else gx

    def whole_gx(gx):
        return None if gx is None else (gx.sum(0) if x_replicated else gx)

    def gather(x):
        """x in the functions' layout: an in-mesh all-gather where it arrives split (`x_spec`).
        dL/dx leaves in the boundary layout (`gxs`): its sum over data replicas reduce-scattered."""
        if x is None or fns.x_compute_spec is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, inner))

    def apply(params, x, side):  # x in the functions' layout (inside `per_replica`: its shard)
        p = cast_floating(params, compute_dtype)
        if x is not None and jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(compute_dtype)
        return fns.forward(p, x, side) if fns.loss is None else fns.loss(p, x, side)

    def per_replica(body, in_specs, out_specs):
        """`body` on each data replica's shard. Without replication checks (`check_vma=False`)
        autodiff inside the body keeps each replica's parameter gradient local (with them it would
        psum the gradient of the replicated params over "data", and the models' scans would need
        their carries cast to replica-varying)."""
        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names={"data"},
            check_vma=False,
        )

    def add(gacc, gp):
        return jax.tree.map(lambda a, g: a + g[None].astype(a.dtype), gacc, gp)

    def differentiable(params, x, side):
        """(f, primals): the stage as a function of what gets gradients (trained leaves, and x when
        `dx`); the frozen leaves and an x without gradient are closed over, so autodiff computes no
        cotangent for them (no weight gradient of a frozen layer, no backward of a frozen prefix)."""
        held = prune(params, frozen)

        def f(t, *x_):
            return apply(graft(t, held), x_[0] if dx else x, side)

        return f, (prune(params, trained), *((x,) if dx else ()))

    def bwd_local(params, x, side, gy, gacc):
        f, primals = differentiable(params, x, side)
        _, vjp = jax.vjp(f, *primals)
        gp, *gx = vjp(gy)
        return (share_gx(gx[0]) if dx else None), add(gacc, gp)

    def bwd(params, x, side, gy, gacc):
        specs = (P(), xl, P("data"), yl, P("data"))
        gx, gacc = per_replica(bwd_local, specs, (gxl, P("data")))(
            params, gather(x), side, gy, gacc
        )
        return whole_gx(gx), gacc

    def last_local(params, x, side, normalizer, gacc):
        f, primals = differentiable(params, x, side)

        def objective(*args):
            loss_sum, count = f(*args)
            return loss_sum.astype(jnp.float32) / normalizer, count

        argnums = tuple(range(len(primals)))
        (loss, count), (gp, *gx) = jax.value_and_grad(objective, argnums, has_aux=True)(*primals)
        loss, count = jax.lax.psum((loss, count), "data")  # two scalars, not the gradient
        return loss, count, (share_gx(gx[0]) if dx else None), add(gacc, gp)

    def last(params, x, side, normalizer, gacc):
        specs = (P(), xl, P("data"), P(), P("data"))
        fn = per_replica(last_local, specs, (P(), P(), gxl, P("data")))
        loss, count, gx, gacc = fn(params, gather(x), side, normalizer, gacc)
        return loss, count, whole_gx(gx), gacc

    # Backward from saved residuals. The forward takes the vjp of the stage w.r.t. the compute-dtype
    # copies of its trained params (and x when `dx`) and returns the vjp's pytree leaves; its treedef
    # (the linear program) stays here, per input signature, from the forward's trace. Residual leaves
    # that ARE a weight copy are not returned (1F1B would hold one copy per in-flight microbatch):
    # the backward casts the params again, a cheap elementwise op.
    vjps: dict[tuple, tuple] = {}  # signature -> (vjp treedef, weight-copy slot per leaf, x dtype)
    cd = compute_dtype

    def weight_copies(params):
        return jax.tree.leaves((cast_floating(prune(params, trained), cd),
                                cast_floating(prune(params, frozen), cd)))  # fmt: skip

    def fwd_res(params, x, side):
        sig = signature(x, side)

        def body(params, x, side):
            t = cast_floating(prune(params, trained), cd)
            held = cast_floating(prune(params, frozen), cd)
            xc = x.astype(cd) if x is not None and jnp.issubdtype(x.dtype, jnp.floating) else x

            def f(t, *x_):
                return fns.forward(graft(t, held), x_[0] if dx else xc, side)

            y, vjp = jax.vjp(f, t, *((xc,) if dx else ()))
            leaves, tree = jax.tree_util.tree_flatten(vjp)
            if any(callable(leaf) for leaf in leaves):
                raise RuntimeError(
                    f"this jax ({jax.__version__}) does not return jax.vjp's function as a pytree "
                    "of arrays: train with residuals=recompute"
                )
            slots = {id(c): i for i, c in enumerate(jax.tree.leaves((t, held)))}
            where = tuple(slots.get(id(leaf)) for leaf in leaves)
            vjps[sig] = (tree, where, None if x is None else x.dtype)
            return y, [jnp.asarray(a)[None] for a, w in zip(leaves, where) if w is None]

        y, kept = per_replica(body, (P(), xl, P("data")), (yl, P("data")))(params, gather(x), side)
        return jax.lax.with_sharding_constraint(y, ys), kept

    def bwd_res(params, kept, gy, gacc, sig):
        if sig not in vjps:
            raise RuntimeError(f"no forward with residuals was traced for the signature {sig}")
        tree, where, x_dtype = vjps[sig]

        def body(params, kept, gy, gacc):
            copies, it = weight_copies(params), iter(kept)
            leaves = [next(it)[0] if w is None else copies[w] for w in where]
            gp, *gx = jax.tree_util.tree_unflatten(tree, leaves)(gy)
            return (share_gx(gx[0].astype(x_dtype)) if dx else None), add(gacc, gp)

        specs = (P(), P("data"), yl, P("data"))
        gx, gacc = per_replica(body, specs, (gxl, P("data")))(params, kept, gy, gacc)
        return whole_gx(gx), gacc

    saves = (
        check_residual_policy(residuals) != "recompute" and fns.loss is None and role.has_backward
    )

    def eval_loss(params, x, side, totals):
        loss_sum, count = apply(params, gather(x), side)
        return totals + jnp.stack([loss_sum.astype(jnp.float32), count.astype(jnp.float32)])

    pt, at = jax.tree.structure(ps), jax.tree.structure(accs)  # params, accumulator
    return StageJits(
        forward=LeafProgram(
            lambda params, x, side: apply(params, gather(x), side),
            (pt, None, None),
            None,
            in_shardings=(ps, xs, side_s),
            out_shardings=ys,
        ),
        backward=LeafProgram(
            bwd,
            (pt, None, None, None, at),
            (None, at),
            in_shardings=(ps, xs, side_s, ys, accs),
            out_shardings=(gxs, accs),
            donate_argnums=(4,),
        )
        if role.has_backward
        else None,
        last=LeafProgram(
            last,
            (pt, None, None, None, at),
            (None, None, None, at),
            in_shardings=(ps, xs, side_s, scalar, accs),
            out_shardings=(scalar, scalar, gxs, accs),
            donate_argnums=(4,),
        ),
        zeros=LeafProgram(
            lambda p: jax.tree.map(
                lambda a: jnp.zeros((dp, *a.shape), jnp.float32), prune(p, trained)
            ),
            (pt,),
            at,
            in_shardings=(ps,),
            out_shardings=accs,
        ),
        eval_loss=None
        if fns.loss is None
        else LeafProgram(
            eval_loss,
            (pt, None, None, None),
            None,
            in_shardings=(ps, xs, side_s, scalar),
            out_shardings=scalar,
            donate_argnums=(3,),
        ),
        forward_residuals=LeafProgram(fwd_res, (pt, None, None), (None, None)) if saves else None,
        backward_residuals=LeafProgram(
            bwd_res,
            (pt, None, None, at, None),
            (None, at),
            static_argnums=(4,),
            out_shardings=(gxs, accs),
            donate_argnums=(3,),
        )
        if saves
        else None,
        residuals=residuals,
    )


@dataclasses.dataclass(frozen=True)
class Lowering:
    """A lowered program to compile before the step that runs it (`StageProgram.lower`).

    Attributes:
      kind: which program ("fwd", "fwd_res", "bwd", "bwd_res", "last", "eval", "count", ...).
      lowered: the program, traced and lowered from abstract inputs.
      then: given the compiled program, further lowerings that need its compiled output shardings
        (the backward from residuals of a forward with residuals); None when there are none.
    """

    kind: str
    lowered: jax.stages.Lowered
    then: Callable[[jax.stages.Compiled], list[Lowering]] | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Held:
    """What an in-flight microbatch keeps on a stage until its backward (`StageProgram.forward_train`).

    Attributes:
      sig: the forward call's `signature`, None under "recompute".
      values: the residual arrays (saving policies) or (x, side) (recompute).
    """

    sig: tuple | None = dataclasses.field(metadata=dict(static=True))
    values: Any


class StageProgram:
    """One stage's params and jitted programs (`stage_jits`) on its submesh.

    Args:
      mesh: the stage's ("data", "model") mesh.
      fns: the stage's pure functions.
      params: fp32 parameters, already placed on `mesh` (each leaf a NamedSharding on it).
      compute_dtype: dtype of the stage's matmuls (bf16 by default in training, fp32 in parity tests).
      trained: bool per leaf of `params`, whether it is trained (None: all); see `stage_jits`.
      role: the stage's role (`costs.recipe.stage_role`; default: everything trained); see
        `stage_jits`.
      residuals: what a microbatch keeps for its backward (`RESIDUAL_POLICIES`; "layers" expects
        `fns` built with layer remat, as `build_stages` does).
    """

    def __init__(
        self,
        mesh: Mesh,
        fns: StageFns,
        params: PyTree,
        compute_dtype=jnp.bfloat16,
        *,
        trained: PyTree | None = None,
        role: StageRole = ALL_TRAIN,
        residuals: str = "recompute",
    ):
        self.mesh = mesh
        self.fns = fns
        self.params = params
        self.compute_dtype = compute_dtype
        self.trained = all_trained(params) if trained is None else trained
        # per parameter leaf (`leaves` order): trained or not
        self.trained_leaves = tuple(bool(k) for k in jax.tree.leaves(self.trained))
        self.trains = any(self.trained_leaves)
        me = jax.process_index()
        self.local = any(d.process_index == me for d in mesh.devices.flat)
        self.role = role
        self.input_grad = role.input_grad and fns.x_spec is not None
        self.param_shardings = jax.tree.map(lambda a: a.sharding, params)
        self.x_sharding = None if fns.x_spec is None else NamedSharding(mesh, fns.x_spec)
        self.y_sharding = NamedSharding(mesh, fns.y_spec)
        self.side_sharding = NamedSharding(mesh, P("data"))
        self.jits = stage_jits(
            mesh, fns, self.param_shardings, compute_dtype, trained, role, residuals
        )
        self._signatures: set[tuple] = set()
        self._seen: dict[tuple, tuple] = {}  # (kind, shapes and dtypes) -> its `signature`
        self._outputs: dict[tuple, jax.ShapeDtypeStruct] = {}
        self._x_structs: dict[tuple, jax.ShapeDtypeStruct] = {}
        scalar = NamedSharding(mesh, P())
        self._zero = None  # a 0.0 on `scalar`, placed once (`loss_tokens`)
        self._count = jax.jit(
            lambda total, mask: total + jnp.sum(mask, dtype=jnp.float32),
            in_shardings=(scalar, self.side_sharding),
            out_shardings=scalar,
        )

    @property
    def params(self) -> PyTree:
        """The fp32 parameters (a tree like the one given). The programs take them as `leaves`
        (flattened once, when set: `set_leaves` after an update); the tree is rebuilt on reading."""
        if self._params is None:
            self._params = self._treedef.unflatten(self._leaves)
        return self._params

    @params.setter
    def params(self, value: PyTree) -> None:
        self._params = value
        self._leaves, self._treedef = jax.tree.flatten(value)

    @property
    def leaves(self) -> list:
        """The parameters' leaves (`jax.tree.leaves(params)` order), as the programs take them."""
        return self._leaves

    def set_leaves(self, leaves: Sequence) -> None:
        """Replaces the parameters by `leaves` (same order, shapes and shardings)."""
        self._leaves, self._params = list(leaves), None

    @property
    def is_last(self) -> bool:
        return self.fns.loss is not None

    @property
    def has_x(self) -> bool:
        return self.fns.x_spec is not None

    def x_struct(self, y) -> jax.ShapeDtypeStruct:
        """The stage input made of the previous stage's output `y` (its shape and dtype): on
        `x_sharding`, padded where its devices do not divide an axis (`boundary_shape`). The
        transfer delivers x as this; dL/dx goes back to y's shape. An x the stage regathers
        (`x_compute_spec`: the MLLM's features, in row blocks) must split evenly: end padding
        would shift its blocks, so a microbatch packed for another layout is refused here."""
        key = (y.shape, y.dtype)
        if key in self._x_structs:
            return self._x_structs[key]
        shape = boundary_shape(y.shape, self.x_sharding)
        if shape != tuple(y.shape) and self.fns.x_compute_spec is not None:
            raise ValueError(
                f"stage input {tuple(y.shape)} does not split evenly over {self.x_sharding.spec} "
                f"on a {dict(self.mesh.shape)} mesh: a microbatch packed for another layout? "
                "(tiles packed by row: blocks of `contracts.row_tile_slots` tiles per row)"
            )
        out = self._x_structs[key] = jax.ShapeDtypeStruct(shape, y.dtype, sharding=self.x_sharding)
        return out

    def y_struct(self, y) -> jax.ShapeDtypeStruct:
        """`y`'s shape and dtype on `y_sharding` (where dL/dy goes back to), made once per shape."""
        key = (y.shape, y.dtype, None)
        if key not in self._x_structs:
            self._x_structs[key] = jax.ShapeDtypeStruct(y.shape, y.dtype, sharding=self.y_sharding)
        return self._x_structs[key]

    @property
    def has_backward(self) -> bool:
        """False for a stage that runs forward only (its role's kind "forward"); the last stage's
        backward is fused into its forward (`forward_backward_loss`)."""
        return self.is_last or self.role.has_backward

    @property
    def signatures(self) -> frozenset[tuple]:
        """The (program, x shape, side shapes) signatures run so far ("fwd", "bwd" or "last")."""
        return frozenset(self._signatures)

    @property
    def compiles(self) -> int:
        """Distinct (program, input-shape) signatures seen = XLA compilations of this stage."""
        return len(self._signatures)

    @property
    def residuals(self) -> str:
        """The residual policy: what `forward_train` keeps for the backward (`RESIDUAL_POLICIES`)."""
        return self.jits.residuals

    def _record(self, kind: str, x, side) -> tuple:
        """Records that program `kind` runs on (x, side) (`signatures`); returns their
        `signature`, computed once per shapes and dtypes (a call looks it up by the arrays' own)."""
        xs = None if x is None else (x.shape, x.dtype)
        key = (kind, xs, tuple([(k, a.shape, a.dtype) for k, a in side.items()]))
        sig = self._seen.get(key)
        if sig is None:
            sig = self._seen[key] = signature(x, side)
            if kind != "shape":  # `output_struct`'s trace, not a program
                self._signatures.add((kind, *sig))
        return sig

    def put_side(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """Places this stage's microbatch fields on its mesh, sharded over "data" on the leading axis."""
        return {k: put_host(batch[k], self.side_sharding) for k in self.fns.fields(batch)}

    def side_structs(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes of what `put_side` would place (a non-local stage's inputs, for `output_struct`)."""
        return {
            k: jax.ShapeDtypeStruct(batch[k].shape, batch[k].dtype, sharding=self.side_sharding)
            for k in self.fns.fields(batch)
        }

    def output_struct(self, x, side) -> jax.ShapeDtypeStruct:
        """Shape, dtype and sharding of `forward(x, side)` of an inner stage, traced without compiling
        (once per input signature)."""
        key = self._record("shape", x, side)
        if key not in self._outputs:
            with jax.set_mesh(self.mesh):
                out = jax.eval_shape(self.jits.forward, self._leaves, x, side)
            self._outputs[key] = jax.ShapeDtypeStruct(
                out.shape, out.dtype, sharding=self.y_sharding
            )
        return self._outputs[key]

    def lower(self, x, side, evaluation: bool = False) -> list[Lowering]:
        """The programs a microbatch of this input signature runs on the stage that are not lowered
        yet, traced and lowered from abstract inputs (`x`, `side`: ShapeDtypeStructs with
        shardings) under the stage's mesh, as the step calls them: compiling them fills the jits'
        caches, so the step compiles nothing (`runtime/precompile.py`). Training's programs, plus
        evaluation's with `evaluation`; each (kind, signature) is recorded as seen (`compiles`), so
        a signature two bucket pairs share (an encoder stage's tile bucket, a later LLM stage's
        length bucket) is lowered once."""
        sig, out = signature(x, side), []
        scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(self.mesh, P()))
        accs = accumulator_structs(self.params, self.trained)

        def add(kind, jit, *args, then=None):
            if (kind, *sig) in self._signatures:
                return
            self._record(kind, x, side)
            out.append(Lowering(kind, jit.lower(self._leaves, *args), then))

        with jax.set_mesh(self.mesh):
            if self.is_last:
                add("last", self.jits.last, x, side, scalar, accs)
                mask = side.get("loss_mask")
                count = None if mask is None else ("count", *signature(None, {"loss_mask": mask}))
                if count and count not in self._signatures:  # `loss_tokens`, per length bucket
                    self._signatures.add(count)
                    out.append(Lowering("count", self._count.lower(scalar, mask)))
                if evaluation:
                    totals = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=scalar.sharding)
                    add("eval", self.jits.eval_loss, x, side, totals)
                return out
            y = self.output_struct(x, side)

            def backward_residuals(forward: jax.stages.Compiled) -> list[Lowering]:
                # the residuals' shardings are the compiled forward's (the partitioner picks them)
                _, kept = forward.out_info
                self._signatures.add(("bwd_res", *sig))
                with jax.set_mesh(self.mesh):
                    bwd = self.jits.backward_residuals.lower(self._leaves, kept, y, accs, sig)
                return [Lowering("bwd_res", bwd)]

            if self.jits.forward_residuals is not None:
                add("fwd_res", self.jits.forward_residuals, x, side, then=backward_residuals)
            if self.jits.forward_residuals is None or evaluation:
                add("fwd", self.jits.forward, x, side)
            if self.jits.forward_residuals is None and self.jits.backward is not None:
                add("bwd", self.jits.backward, x, side, y, accs)
        return out

    def loss_tokens(self, masks: list[np.ndarray]) -> jax.Array:
        """Sum of the microbatches' `loss_mask`s (every shard's, not only this host's) as a replicated
        scalar on the stage's mesh: the loss normalizer of a global batch packed per host."""
        if self._zero is None:  # not donated: one placed 0.0 serves every step
            self._zero = put_host(np.float32(0), NamedSharding(self.mesh, P()))
        total = self._zero
        for mask in masks:  # host masks, or masks already placed (`driver.place_sides`)
            placed = mask if isinstance(mask, jax.Array) else put_host(mask, self.side_sharding)
            total = issue(STAGE, self.mesh, self._count, total, placed)
        return total

    def zero_grads(self) -> list:
        """A zero accumulator of the trained leaves (`accumulator_structs`), as its leaves (what
        the backward programs take and return; none when nothing of the stage is trained)."""
        if not self.trains:
            return []  # no leaves: nothing to compile or place
        return issue(STAGE, None, self.jits.zeros.jit, self._leaves)

    def forward(self, x, side) -> jax.Array:
        """y of an inner stage (on the last stage: (loss_sum, count), without gradients)."""
        self._record("fwd", x, side)
        return issue(STAGE, self.mesh, self.jits.forward.jit, self._leaves, x, side)

    def eval_loss(self, x, side, totals: jax.Array) -> jax.Array:
        """Last stage, evaluation: `totals` + (loss sum, loss tokens) of the microbatch, without
        gradients; `totals` (float32[2], replicated on this mesh) is donated."""
        self._record("eval", x, side)
        return issue(STAGE, self.mesh, self.jits.eval_loss.jit, self._leaves, x, side, totals)

    def forward_train(self, x, side) -> tuple[jax.Array, Held]:
        """y of an inner stage with a backward, and what its backward needs (`backward_from`): the
        saved residuals, or under "recompute" the stage input and side arrays."""
        if self.jits.forward_residuals is None:
            return self.forward(x, side), Held(None, (x, side))
        sig = self._record("fwd_res", x, side)
        y, kept = issue(STAGE, self.mesh, self.jits.forward_residuals.jit, self._leaves, x, side)
        return y, Held(sig, kept)

    def backward_from(self, held: Held, gy, gacc: list) -> tuple[jax.Array | None, list]:
        """The backward of the microbatch whose `forward_train` gave `held`: (dL/dx or None, the
        accumulator's leaves + dL/dparams); `gacc` (leaves, `zero_grads`) is donated."""
        if held.sig is None:
            x, side = held.values
            return self._backward(x, side, gy, gacc)
        key = ("bwd_res", held.sig)
        if key not in self._seen:
            self._seen[key] = held.sig
            self._signatures.add(("bwd_res", *held.sig))
        jit = self.jits.backward_residuals.jit
        return issue(STAGE, self.mesh, jit, self._leaves, held.values, gy, gacc, held.sig)

    def backward(self, x, side, gy, gacc: PyTree) -> tuple[jax.Array | None, PyTree]:
        """Returns (dL/dx or None, gacc + dL/dparams) with the accumulator as a tree (`gacc`: its
        tree or its leaves, donated)."""
        gx, acc = self._backward(x, side, gy, jax.tree.leaves(gacc))
        return gx, self.jits.backward.outs[1].unflatten(acc)

    def _backward(self, x, side, gy, gacc: list) -> tuple[jax.Array | None, list]:
        if self.jits.backward is None:
            raise RuntimeError("this stage runs forward only (nothing trained, no input gradient)")
        self._record("bwd", x, side)
        return issue(STAGE, self.mesh, self.jits.backward.jit, self._leaves, x, side, gy, gacc)

    def forward_backward_loss(self, x, side, normalizer, gacc: list):
        """Last stage: returns (loss / normalizer, loss-token count, dL/dx or None, the
        accumulator's leaves + dL/dparams); `gacc` (leaves, `zero_grads`) is donated.

        `normalizer`: a number, or a replicated scalar on this mesh (`loss_tokens`)."""
        self._record("last", x, side)
        norm = normalizer
        if not isinstance(normalizer, jax.Array):
            norm = put_host(np.float32(normalizer), NamedSharding(self.mesh, P()))
        return issue(STAGE, self.mesh, self.jits.last.jit, self._leaves, x, side, norm, gacc)
