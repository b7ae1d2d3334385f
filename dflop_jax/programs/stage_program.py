"""`StageProgram`: one stage's params and jitted programs (`programs/stage_jits.py`) on its submesh.

The trainer runs a stage through it (`runtime/driver.py`), calling its programs with the parameter
and accumulator trees as leaves (`programs/leaf_program.py`: flattened when they change, not per
call) through `programs.dispatch.issue` (counted per step). It records the input signature of each
call and each program lowered ahead (`lower`, `runtime/precompile.py`), so `compiles` is the XLA
compilations its jits perform (a jit recompiles iff the abstract signature changes). On a process
whose stage programs come from an executable store (`programs/executable_store.py`), each call
runs the compiled program the precompile kept for its (program, signature) instead of the jit
(`_program`). A stage whose mesh has no device of this process is NON-LOCAL (`local` False):
nothing of it is compiled or dispatched here; the driver only needs the shapes of its outputs
(`output_struct`, a trace without compilation) to take part in transfers from it. Between a
forward and its backward an in-flight microbatch keeps `Held`: its residuals (saving policies) or
its input (recompute).

Weights cast once per step: beside the fp32 master parameters (`params`, `leaves`: what the
optimizer updates and checkpoints save) a stage keeps their compute-dtype copies (`compute_leaves`:
each floating leaf in `compute_dtype`, `programs.trees.copied_leaves`), and every stage program
takes those. The optimizer's update makes the trained leaves' copies from the new masters in the
same program (`runtime/train_state.py`); a frozen leaf's copy is made once, when the params are set
(`cast`, one program per stage). So a step casts each weight once, not once per microbatch program,
and a program computes exactly what it computed casting inside: the gradient w.r.t. a copy is the
one w.r.t. its master before the cast's transpose (an upcast), which the accumulator applies
(`Accumulator.add`). The copies cost `compute_dtype` bytes per parameter, held for the run; a
frozen leaf read only by a gather (`gathered`: a token embedding that is not also the tied head)
has none: its programs take the master, and XLA fuses the convert into the gather, so only the
gathered rows are converted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dflop_jax.costs.recipe import ALL_TRAIN, StageRole
from dflop_jax.programs.dispatch import STAGE, issue
from dflop_jax.programs.executable_store import ExecutableStore, call_once
from dflop_jax.programs.lowering import Lowering
from dflop_jax.programs.stage_fns import (
    PyTree,
    StageFns,
    boundary_shape,
    per_part,
    signature,
    x_signature,
)
from dflop_jax.programs.stage_jits import stage_jits
from dflop_jax.programs.transfer import put_host
from dflop_jax.programs.trees import all_trained, compute_structs, copied_leaves


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
      store: this process's executable store, if any: the cast program that makes the weights'
        compute-dtype copies when the params are set comes from it (`call_once`).
      gathered: bool per leaf of `params`, whether the stage reads it only by a gather
        (`StageBlueprint.gathered`; None: none is): frozen, it gets no copy (module docstring).
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
        store: ExecutableStore | None = None,
        gathered: PyTree | None = None,
    ):
        self.mesh = mesh
        self.fns = fns
        self.compute_dtype = compute_dtype
        self.trained = all_trained(params) if trained is None else trained
        # per parameter leaf (`leaves` order): trained or not; taken as a compute-dtype copy or not
        self.trained_leaves = tuple(bool(k) for k in jax.tree.leaves(self.trained))
        leaves = jax.tree.leaves(params)
        self.cast_leaves = copied_leaves(params, compute_dtype, self.trained, gathered)
        self.trains = any(self.trained_leaves)
        me = jax.process_index()
        self.local = any(d.process_index == me for d in mesh.devices.flat)
        self._store = store
        casts = [a.sharding for a, c in zip(leaves, self.cast_leaves) if c]
        # the copies of the cast leaves from their masters: when the params are set (`params`)
        self._cast = jax.jit(
            lambda masters: [a.astype(compute_dtype) for a in masters], out_shardings=casts
        )
        self.params = params
        self.role = role
        self.input_grad = role.input_grad and fns.x_spec is not None
        self.param_shardings = jax.tree.map(lambda a: a.sharding, params)
        self.x_sharding = (
            None if fns.x_spec is None else per_part(lambda p: NamedSharding(mesh, p), fns.x_spec)
        )
        self.y_sharding = NamedSharding(mesh, fns.y_spec)
        self.side_sharding = NamedSharding(mesh, P("data"))
        self.jits = stage_jits(mesh, fns, params, compute_dtype, trained, role, residuals)
        # the packing of its gradient accumulator (what the backward programs take and return)
        self.accumulator = self.jits.accumulator
        # the stage this one's output feeds (`Layout.children`), set by `build_stages`; None: the
        # next stage (a chain of stages built by hand)
        self.feeds: int | None = None
        self._signatures: set[tuple] = set()
        self._seen: dict[tuple, tuple] = {}  # (kind, shapes and dtypes) -> its `signature`
        # (kind, signature) -> the compiled stage program called in place of its jit: filled by a
        # precompile with an executable store (`Lowering.keep`), else empty
        self._compiled: dict[tuple, jax.stages.Compiled] = {}
        self._device_ids = tuple(d.id for d in mesh.devices.flat)
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
        """The fp32 master parameters (a tree like the one given), kept as `leaves` (flattened
        once, when set: `set_leaves` after an update); the tree is rebuilt on reading. Setting
        them makes their compute-dtype copies (`compute_leaves`)."""
        if self._params is None:
            self._params = self._treedef.unflatten(self._leaves)
        return self._params

    @params.setter
    def params(self, value: PyTree) -> None:
        leaves, self._treedef = jax.tree.flatten(value)
        self.set_leaves(leaves)
        self._params = value

    @property
    def leaves(self) -> list:
        """The master parameters' leaves (`jax.tree.leaves(params)` order)."""
        return self._leaves

    @property
    def compute_leaves(self) -> list:
        """What the programs take for the parameters, per leaf of `leaves`: its compute-dtype copy
        where it is cast (`cast_leaves`), else the master itself (module docstring)."""
        return self._compute

    @property
    def compute_params(self) -> PyTree:
        """`compute_leaves` as a tree like `params`."""
        return self._treedef.unflatten(self._compute)

    def set_leaves(self, leaves: Sequence, copies: Sequence | None = None) -> None:
        """Replaces the master parameters by `leaves` (same order, shapes and shardings) and their
        compute-dtype copies by `copies`: one per trained cast leaf, in leaf order, as the
        optimizer's update makes them (the frozen leaves' copies stay); None: every copy cast
        from `leaves` here (`cast`, one program)."""
        self._leaves, self._params = list(leaves), None
        if copies is None:
            self._compute = self._copies(self._leaves)
            return
        it, old = iter(copies), self._compute
        self._compute = [
            (next(it) if t else c) if k else a
            for a, c, k, t in zip(self._leaves, old, self.cast_leaves, self.trained_leaves)
        ]

    def drop_trained_copies(self) -> None:
        """Lets go of the trained leaves' copies before the update makes new ones, so the device
        never holds two (the programs still reading them keep them alive until they have run)."""
        self._compute = [
            None if k and t else c
            for c, k, t in zip(self._compute, self.cast_leaves, self.trained_leaves)
        ]

    def _copies(self, leaves: list) -> list:
        """Per leaf: the compute-dtype copy of a cast leaf, else the leaf itself; abstract
        (ShapeDtypeStructs) on a non-local stage, whose params are."""
        if not any(self.cast_leaves):
            return list(leaves)
        if not self.local or not isinstance(leaves[0], jax.Array):
            return compute_structs(leaves, self.compute_dtype, self.cast_leaves)
        masters = [a for a, k in zip(leaves, self.cast_leaves) if k]
        devices = list(self.mesh.devices.flat)
        it = iter(call_once(self._cast, (masters,), devices, self._store))
        return [next(it) if k else a for a, k in zip(leaves, self.cast_leaves)]

    @property
    def is_last(self) -> bool:
        return self.fns.loss is not None

    @property
    def has_x(self) -> bool:
        return self.fns.x_spec is not None

    def x_struct(self, y, part: str | None = None) -> jax.ShapeDtypeStruct:
        """The stage input made of the previous stage's output `y` (its shape and dtype): on
        `x_sharding`, padded where its devices do not divide an axis (`boundary_shape`). The
        transfer delivers x as this; dL/dx goes back to y's shape. An x the stage regathers
        in row blocks (`x_compute_spec` P("data"): the MLLM's features packed by row) must split
        evenly: end padding would shift its blocks, so a microbatch packed for another layout is
        refused here. A pool gathered whole (P()) keeps its slots under end padding. A stage
        joining two branches takes y as its x's `part` (the sending stage's module)."""
        key = (y.shape, y.dtype, part)
        if key in self._x_structs:
            return self._x_structs[key]
        sharding = self.x_sharding if part is None else self.x_sharding[part]
        shape = boundary_shape(y.shape, sharding)
        blocks = self.fns.x_compute_spec
        if (
            shape != tuple(y.shape)
            and blocks is not None
            and (isinstance(blocks, dict) or any(blocks))
        ):
            raise ValueError(
                f"stage input {tuple(y.shape)} does not split evenly over {sharding.spec} "
                f"on a {dict(self.mesh.shape)} mesh: a microbatch packed for another layout? "
                "(tiles packed by row: blocks of `contracts.row_tile_slots` tiles per row)"
            )
        out = self._x_structs[key] = jax.ShapeDtypeStruct(shape, y.dtype, sharding=sharding)
        return out

    @property
    def x_parts(self) -> tuple[str, ...]:
        """The parts of a joining stage's x (the modules of its parent stages); () otherwise."""
        return tuple(self.x_sharding) if isinstance(self.x_sharding, dict) else ()

    def y_struct(self, y) -> jax.ShapeDtypeStruct:
        """`y`'s shape and dtype on `y_sharding` (where dL/dy goes back to), made once per shape."""
        key = (y.shape, y.dtype, None, "y")
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
        xs = None if x is None else x_signature(x) if isinstance(x, dict) else (x.shape, x.dtype)
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
        (once per input signature). A local stage that saves residuals traces the forward that
        saves them, the program `lower` lowers next for this signature: jax keeps the trace, so
        the forward is traced once, not twice (tracing is most of a stage program's lowering)."""
        key = self._record("shape", x, side)
        if key not in self._outputs:
            saving = self.local and self.jits.forward_residuals is not None
            program = self.jits.forward_residuals if saving else self.jits.forward
            with jax.set_mesh(self.mesh):
                out = program.trace(self._compute, x, side).out_info
            out = out[0] if saving else out  # (y, residuals)
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
        accs = list(self.accumulator.structs)

        def add(kind, jit, *args, then=None):
            if (kind, *sig) in self._signatures:
                return
            self._record(kind, x, side)
            out.append(self._lowering(kind, sig, jit.lower(self._compute, *args), then))

        with jax.set_mesh(self.mesh):
            if self.is_last:
                add("last", self.jits.last, x, side, scalar, accs)
                mask = side.get("loss_mask")
                count = None if mask is None else _mask_signature(mask)
                if count and ("count", *count) not in self._signatures:  # `loss_tokens`, per length
                    self._signatures.add(("count", *count))
                    out.append(self._lowering("count", count, self._count.lower(scalar, mask)))
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
                    bwd = self.jits.backward_residuals.lower(self._compute, kept, y, accs, sig)
                return [self._lowering("bwd_res", sig, bwd)]

            if self.jits.forward_residuals is not None:
                add("fwd_res", self.jits.forward_residuals, x, side, then=backward_residuals)
            if self.jits.forward_residuals is None or evaluation:
                add("fwd", self.jits.forward, x, side)
            if self.jits.forward_residuals is None and self.jits.backward is not None:
                add("bwd", self.jits.backward, x, side, y, accs)
        return out

    def _lowering(self, kind: str, sig: tuple, lowered, then=None) -> Lowering:
        def keep(compiled: jax.stages.Compiled) -> None:
            self._compiled[(kind, sig)] = compiled

        return Lowering(kind, lowered, then, self._device_ids, keep)

    def _program(self, kind: str, sig: tuple, jit: Callable) -> Callable:
        """What a call of program `kind` on inputs of signature `sig` calls: the compiled program
        the executable store gave (`_compiled`), else the jit."""
        return self._compiled.get((kind, sig), jit) if self._compiled else jit

    def loss_tokens(self, masks: list[np.ndarray]) -> jax.Array:
        """Sum of the microbatches' `loss_mask`s (every shard's, not only this host's) as a replicated
        scalar on the stage's mesh: the loss normalizer of a global batch packed per host."""
        if self._zero is None:  # not donated: one placed 0.0 serves every step
            self._zero = put_host(np.float32(0), NamedSharding(self.mesh, P()))
        total = self._zero
        for mask in masks:  # host masks, or masks already placed (`driver.place_sides`)
            placed = mask if isinstance(mask, jax.Array) else put_host(mask, self.side_sharding)
            count = self._program("count", _mask_signature(placed), self._count)
            total = issue(STAGE, self.mesh, count, total, placed)
        return total

    def zero_grads(self) -> list:
        """A zero accumulator of the trained leaves, as its buffers (`accumulator`: what
        the backward programs take and return; none when nothing of the stage is trained)."""
        if not self.trains:
            return []  # no leaves: nothing to compile or place
        return issue(STAGE, None, self.jits.zeros.run, self._leaves)

    def forward(self, x, side) -> jax.Array:
        """y of an inner stage (on the last stage: (loss_sum, count), without gradients)."""
        fwd = self._program("fwd", self._record("fwd", x, side), self.jits.forward.jit)
        return issue(STAGE, self.mesh, fwd, self._compute, x, side)

    def eval_loss(self, x, side, totals: jax.Array) -> jax.Array:
        """Last stage, evaluation: `totals` + (loss sum, loss tokens) of the microbatch, without
        gradients; `totals` (float32[2], replicated on this mesh) is donated."""
        fn = self._program("eval", self._record("eval", x, side), self.jits.eval_loss.jit)
        return issue(STAGE, self.mesh, fn, self._compute, x, side, totals)

    def forward_train(self, x, side) -> tuple[jax.Array, Held]:
        """y of an inner stage with a backward, and what its backward needs (`backward_from`): the
        saved residuals, or under "recompute" the stage input and side arrays."""
        if self.jits.forward_residuals is None:
            return self.forward(x, side), Held(None, (x, side))
        sig = self._record("fwd_res", x, side)
        fwd = self._program("fwd_res", sig, self.jits.forward_residuals.jit)
        y, kept = issue(STAGE, self.mesh, fwd, self._compute, x, side)
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
        compiled = self._compiled.get(key) if self._compiled else None
        if compiled is not None:  # compiled with the signature static: not an argument of its own
            return issue(STAGE, self.mesh, compiled, self._compute, held.values, gy, gacc)
        jit = self.jits.backward_residuals.jit
        return issue(STAGE, self.mesh, jit, self._compute, held.values, gy, gacc, held.sig)

    def backward(self, x, side, gy, gacc: PyTree) -> tuple[jax.Array | None, PyTree]:
        """Returns (dL/dx or None, gacc + dL/dparams) with the accumulator as a tree like the
        trained params (`accumulator.unpack`); `gacc`: its buffers (`zero_grads`), donated."""
        gx, acc = self._backward(x, side, gy, list(gacc))
        return gx, self.accumulator.unpack(acc)

    def _backward(self, x, side, gy, gacc: list) -> tuple[jax.Array | None, list]:
        if self.jits.backward is None:
            raise RuntimeError("this stage runs forward only (nothing trained, no input gradient)")
        bwd = self._program("bwd", self._record("bwd", x, side), self.jits.backward.jit)
        return issue(STAGE, self.mesh, bwd, self._compute, x, side, gy, gacc)

    def forward_backward_loss(self, x, side, normalizer, gacc: list):
        """Last stage: returns (loss / normalizer, loss-token count, dL/dx or None, the
        accumulator's leaves + dL/dparams); `gacc` (leaves, `zero_grads`) is donated.

        `normalizer`: a number, or a replicated scalar on this mesh (`loss_tokens`)."""
        last = self._program("last", self._record("last", x, side), self.jits.last.jit)
        norm = normalizer
        if not isinstance(normalizer, jax.Array):
            norm = put_host(np.float32(normalizer), NamedSharding(self.mesh, P()))
        return issue(STAGE, self.mesh, last, self._compute, x, side, norm, gacc)


def _mask_signature(mask) -> tuple:
    """The signature of `loss_tokens`' count program: one per loss mask shape (length bucket)."""
    return tuple(mask.shape), str(mask.dtype)
