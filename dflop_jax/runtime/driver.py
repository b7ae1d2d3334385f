"""The MPMD pipeline driver: one Python loop dispatching stage programs in 1F1B (or GPipe) order.

Every process runs this same loop (same programs, same transfers, same order). JAX dispatch is
asynchronous, so on accelerators the stages overlap; the order below is what a real 1F1B pipeline
would execute, and the dependencies make it valid for any stage count and microbatch count.

Measured steps (`sample=m`): the ops of ONE microbatch m are timed: before each of its ops the
driver waits for that op's inputs, then times the program until its outputs are ready, giving that
microbatch's per-stage seconds for the scheduler's adaptive correction. The other microbatches' ops
are not waited for (those already issued keep running), so the step is not serialized, only the
sampled microbatch's chain. An op whose call compiled a new program is marked invalid (its time is
mostly compilation). Why not every op, from threads watching them finish: on XLA:CPU that measured
nothing (every op of a step was seen "ready" at the end of the dispatch loop: the watching threads
wait for the GIL and CPU devices run programs on the host's cores), DESIGN section 5.

Frozen stages (`StageProgram.has_backward` False: role "forward" by `costs.recipe.stage_role`,
nothing trained and no input gradient; a prefix of the pipeline, e.g. a frozen vision encoder at its
head) run forward only: their ops are forwards, nothing is kept for a backward, and no cotangent is
sent to them. So that such a head does not run the whole
batch ahead (its outputs wait on the next stage's mesh), its forward of microbatch m also waits for
the next stage's forward of m - (P - s), the in-flight bound 1F1B gives stage s.

Transfers: a stage's output goes to the next stage as `next.x_struct(y)` (its `x_sharding`, an axis its
devices do not divide padded) with `transfer` (`programs/transfer.py`: one device-to-device program for
any two shardings, within a process and across processes); cotangents go back the same way, to y's
sharding and shape. `transfer_bytes_per_microbatch(stages, microbatch)` gives,
per stage boundary, the bytes those programs move for one microbatch's shapes, without running them.

Multi-process runs: every process walks the same op order. It dispatches the ops of its LOCAL stages
(`StageProgram.local`) and places side inputs only for them; for other stages it only traces their
output shapes. It calls every transfer in that order; `transfer` runs the ones whose devices this
process holds and skips the rest, so programs sharing devices are issued in one order on every process.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dflop_jax.contracts.pipeline_order import chain_position, depths, parents, stage_order
from dflop_jax.data.sample_arrays import PackedMicrobatch
from dflop_jax.programs.dispatch import ISSUED
from dflop_jax.programs.executable_store import ExecutableStore, hand_over
from dflop_jax.programs.stage_fns import PyTree
from dflop_jax.programs.stage_program import Held, StageProgram
from dflop_jax.programs.transfer import (
    lower_transfer,
    put_host,
    stand_in,
    transfer,
    transfer_bytes,
)

Order = Literal["1f1b", "gpipe"]


@dataclasses.dataclass(frozen=True)
class Op:
    """One dispatch: forward ("F") or backward ("B") of microbatch `mb` on stage `stage`."""

    stage: int
    mb: int
    kind: Literal["F", "B"]


def stage_ops(
    stage: int,
    num_stages: int,
    num_mb: int,
    order: Order,
    backward: bool = True,
    depth: int | None = None,
) -> list[Op]:
    """The op sequence one stage executes (`contracts.pipeline_order.stage_order`, the simulator's too).
    The last stage's forward is fused with its backward; a
    stage without `backward` (frozen, forward only) executes forwards only. `depth`: the stages
    from this one to the last (`contracts.pipeline_order.depths`; None: a chain's)."""
    if stage == num_stages - 1 or not backward:
        return [Op(stage, m, "F") for m in range(num_mb)]
    at = stage if depth is None else chain_position(depth, num_stages)
    return [Op(stage, m, kind) for kind, m in stage_order(order, at, num_stages, num_mb)]


@functools.cache
def _order(num_stages: int, num_mb: int, order: Order, forward_only: int,
           children: tuple[int, ...] | None) -> tuple[Op, ...]:  # fmt: skip
    return tuple(pipeline_order(num_stages, num_mb, order, forward_only, children))


def chain(num_stages: int) -> tuple[int, ...]:
    """The children of a chain of stages (each feeds the next)."""
    return tuple(range(1, num_stages)) + (-1,)


def stage_tree(stages: Sequence[StageProgram]) -> tuple[int, ...]:
    """Per stage, the stage its output feeds: as `build_stages` recorded it from the layout
    (`StageProgram.feeds`), a chain for stages built without one."""
    feeds = [s.feeds for s in stages]
    return chain(len(stages)) if None in feeds else tuple(feeds)


def pipeline_order(
    num_stages: int,
    num_mb: int,
    order: Order,
    forward_only: int = 0,
    children: tuple[int, ...] | None = None,
) -> list[Op]:
    """Merges the per-stage sequences into one dispatch order respecting data dependencies.

    Round by round, each stage issues its next op if its input is ready (a forward needs every
    stage feeding it to have run its forward of that microbatch; a backward needs the stage it feeds
    to have run its backward, or its fused forward+backward when that stage is the last).

    forward_only: how many leading stages run forward only (frozen; module docstring): they are left
    out of the backward wave, and stage s of them issues the forward of microbatch m only after the
    next stage's forward of m - depth(s) (num_stages - s in a chain).
    children: per stage, the stage its output feeds (`contracts.layout.Layout.children`: two
    encoder branches joining at the first LLM stage); None: a chain. A branch stage runs the 1F1B
    order of the chain stage as far from the end (`contracts.pipeline_order.chain_position`).
    """
    if not 0 <= forward_only < num_stages:
        raise ValueError(
            f"forward_only={forward_only}: between 0 and {num_stages - 1} (the last stage trains)"
        )
    children = chain(num_stages) if children is None else tuple(children)
    depth = depths(children)
    queues = [
        stage_ops(s, num_stages, num_mb, order, backward=s >= forward_only, depth=depth[s])
        for s in range(num_stages)
    ]
    done: set[Op] = set()
    out: list[Op] = []
    heads = [0] * num_stages
    last = num_stages - 1
    while len(out) < sum(len(q) for q in queues):
        issued = []
        for s in range(num_stages):
            if heads[s] == len(queues[s]):
                continue
            op = queues[s][heads[s]]
            child = children[s]
            if op.kind == "F":
                ready = all(Op(p, op.mb, "F") in done for p in parents(children, s))
                lead = op.mb - depth[s]
                if s < forward_only and lead >= 0:
                    ready = ready and Op(child, lead, "F") in done
            else:
                ready = Op(child, op.mb, "F" if child == last else "B") in done
            if ready:
                issued.append(op)
                heads[s] += 1
        if not issued:
            raise RuntimeError(f"pipeline order {order} deadlocked at {heads}; this is a bug")
        done.update(issued)
        out.extend(issued)
    return out


@dataclasses.dataclass
class StepOutput:
    """What one pipelined step produced (device values; pull to host only when needed).

    Attributes:
      loss: per-microbatch normalized loss contributions (sum = the step's loss), on the last stage
        (stand-ins without shards on a process that does not hold it; `host_scalars` reads them).
      grads: accumulated fp32 gradients per stage (per data replica, trained leaves only), as the
        accumulator's buffers (`StageProgram.accumulator`, `zero_grads`), on each stage's mesh
        (None for non-local stages).
      transfer_bytes: bytes the step's stage-to-stage transfers moved between devices (all processes).
      stage_times: measured steps only: [M, P, 2] seconds (fwd, bwd) per microbatch and stage, the
        sampled microbatch's row filled; the last stage's fused forward+backward program is reported
        whole in the fwd slot (bwd = 0).
      timing_valid: measured steps only: [M] bool, True only for the sampled microbatch when no op
        of it compiled.
    """

    loss: list[jax.Array]
    grads: list[PyTree | None]
    transfer_bytes: int = 0
    stage_times: np.ndarray | None = None
    timing_valid: np.ndarray | None = None


def run_pipeline(
    stages: Sequence[StageProgram],
    microbatches: Sequence[PackedMicrobatch | Mapping[str, np.ndarray]],
    normalizer: float | None = None,
    order: Order = "1f1b",
    *,
    sample: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
    placed: Sequence[Sequence[dict | None]] | None = None,
    children: Sequence[int] | None = None,
) -> StepOutput:
    """Forward + backward of one global batch through the pipeline, accumulating gradients.

    Args:
      stages: stage programs in pipeline order (encoder stages, audio stages, then LLM stages).
      microbatches: the packed microbatches (`PackedMicrobatch`, or its arrays by field name), global
        shapes; in a multi-process run only this process's shards need to be filled in.
      normalizer: loss tokens of the whole global batch; each microbatch's loss sum is divided by it,
        so the objective does not depend on how samples were packed or split. None: counted on the
        last stage's devices from the microbatches' `loss_mask` (every host's shards).
      order: "1f1b" or "gpipe".
      sample: the microbatch whose ops are timed into `StepOutput.stage_times` (module docstring);
        None = no timing.
      clock: the timer of measured steps (seconds).
      placed: the microbatches' side inputs already on the local stages' devices (`place_sides`,
        run in the loader's prefetch thread); None: placed here, on the dispatching thread.
      children: per stage, the stage its output feeds (`Layout.children`); None: the stages'
        own (`stage_tree`).

    Returns:
      StepOutput with the loss contributions and the accumulated gradients.
    """
    num_stages, num_mb = len(stages), len(microbatches)
    children = stage_tree(stages) if children is None else tuple(children)
    batches = [microbatch_fields(mb) for mb in microbatches]
    if normalizer is None and stages[-1].local:
        normalizer = _loss_tokens(stages[-1], batches, placed)
    step = _InFlight.start(stages, num_mb, children)
    measure = sample is not None
    times = np.zeros((num_mb, num_stages, 2)) if measure else None
    valid = np.arange(num_mb) == sample if measure else None
    forward_only = _forward_only(stages, children)
    for op in _order(num_stages, num_mb, order, forward_only, children):  # the same every step
        s, m = op.stage, op.mb
        stage = stages[s]
        if op.kind == "F":
            step.sides[s, m] = _side(stage, batches[m], None if placed is None else placed[m][s])
        timed = m == sample and stage.local
        if timed:  # inputs ready first, so only the program is timed
            ISSUED.note_wait()
            jax.block_until_ready(step.inputs_of(s, m))
            compiles, t0 = stage.compiles, clock()
        sent, out = step.run(op, stage, normalizer)
        if timed:
            jax.block_until_ready(out)
            times[m, s, 0 if op.kind == "F" else 1] = clock() - t0
            valid[m] &= stage.compiles == compiles
        step.moved += step.pass_on(op, stages, sent, children)
    return StepOutput(step.losses, step.grads, step.moved, times, valid)


def _loss_tokens(last: StageProgram, batches: list[Mapping[str, np.ndarray]], placed) -> jax.Array:
    """The global batch's loss tokens, counted on the last stage's devices (its placed masks when
    the loader placed them)."""
    on_device = placed is not None and "loss_mask" in placed[0][-1]
    masks = [p[-1]["loss_mask"] for p in placed] if on_device else None
    return last.loss_tokens(masks or [b["loss_mask"] for b in batches])


def _side(stage: StageProgram, batch: Mapping[str, np.ndarray], placed: dict | None):
    """A forward's side inputs: placed by the loader, placed here, or (another process's stage)
    their shapes only."""
    if placed is not None and stage.local:
        return placed
    return (stage.put_side if stage.local else stage.side_structs)(batch)


@dataclasses.dataclass
class _InFlight:
    """What one step's ops hand each other, keyed by (stage, microbatch).

    Attributes:
      grads: per stage, its gradient accumulator (None for another process's stage).
      inputs: a stage's x for a microbatch (None: the first stage's).
      sides: a forward's side inputs until it runs.
      held: what a microbatch's backward needs (residuals, or x and side), until it runs.
      cotangents: dL/dy of a stage's output, until its backward runs.
      outputs: the shape dL/dy goes back to (the stage's output), for stages that pass one back.
      losses: per microbatch, the last stage's loss contribution.
      moved: bytes transferred between stages so far.
    """

    grads: list[PyTree | None]
    inputs: dict[tuple[int, int], jax.Array | dict | None]
    losses: list[jax.Array | None]
    sides: dict[tuple[int, int], dict] = dataclasses.field(default_factory=dict)
    held: dict[tuple[int, int], Held] = dataclasses.field(default_factory=dict)
    cotangents: dict[tuple[int, int], jax.Array] = dataclasses.field(default_factory=dict)
    outputs: dict[tuple[int, int], jax.ShapeDtypeStruct] = dataclasses.field(default_factory=dict)
    moved: int = 0

    @classmethod
    def start(cls, stages: Sequence[StageProgram], num_mb: int, children) -> _InFlight:
        """No input yet but for each branch's first stage (none: it takes side inputs only);
        a joining stage's parts arrive one by one (`deliver`)."""
        firsts = [s for s in range(len(stages)) if s not in children]
        inputs = {(s, m): None for s in firsts for m in range(num_mb)}
        return cls(grads=[s.zero_grads() if s.local else None for s in stages], inputs=inputs,
                   losses=[None] * num_mb)  # fmt: skip

    def inputs_of(self, s: int, m: int) -> tuple:
        """Everything op (s, m) reads (what a timed op waits for before its clock starts)."""
        key = (s, m)
        return (self.inputs.get(key), self.sides.get(key), self.held.get(key),
                self.cotangents.get(key), self.grads[s])  # fmt: skip

    def run(self, op: Op, stage: StageProgram, normalizer) -> tuple[jax.Array | None, tuple]:
        """Dispatches one op: (what it sends on, y forward or dL/dx back; everything it output)."""
        key, s = (op.stage, op.mb), op.stage
        if op.kind == "F" and stage.is_last:
            loss, gx, self.grads[s] = _last(stage, self.inputs.pop(key), self.sides.pop(key),
                                            normalizer, self.grads[s])  # fmt: skip
            self.losses[op.mb] = loss
            return gx, (loss, gx, self.grads[s])
        if op.kind == "F" and stage.has_backward:  # what the backward needs stays until it runs
            y, self.held[key] = _forward_train(stage, self.inputs.pop(key), self.sides.pop(key))
            return y, (y, self.held[key])
        if op.kind == "F":  # forward only: nothing kept
            y = _forward(stage, self.inputs.pop(key), self.sides.pop(key))
            return y, y
        # the residuals are dropped here, freed once the backward has run
        gx, self.grads[s] = _backward(stage, self.held.pop(key), self.cotangents.pop(key),
                                      self.grads[s])  # fmt: skip
        return gx, (gx, self.grads[s])

    def pass_on(self, op: Op, stages: Sequence[StageProgram], sent, children) -> int:
        """Moves a forward's y to the stage it feeds (a joining stage's part of x) or a dL/dx back
        to the output of each stage feeding this one; the bytes moved."""
        s, m = op.stage, op.mb
        stage = stages[s]
        if op.kind == "F" and not stage.is_last:
            c = children[s]
            nxt, part = stages[c], part_of(s, c, stages, children)
            x, n = _send(sent, nxt.x_struct(sent, part))
            deliver(self.inputs, (c, m), part, x)
            if nxt.input_grad:
                self.outputs[s, m] = stage.y_struct(sent)
            return n
        if not stage.input_grad:
            return 0
        moved = 0  # dL/dx goes back to the output of each stage feeding this one
        for p in parents(children, s):
            part = part_of(p, s, stages, children)
            g = sent if part is None else sent[part]
            self.cotangents[p, m], n = _send(g, self.outputs.pop((p, m)))
            moved += n
        return moved


def part_of(sender: int, receiver: int, stages: Sequence[StageProgram], children) -> str | None:
    """The part of `receiver`'s x that `sender`'s output is (its parents in order are its parts in
    order: the encoder branch, then the audio branch), None where x is one array."""
    parts = stages[receiver].x_parts
    return parts[parents(children, receiver).index(sender)] if parts else None


def deliver(inputs: dict, key, part: str | None, x) -> None:
    """Sets the stage input `inputs[key]` to `x`, or, where `part` names one, that part of a
    joining stage's input (its dict filled as its parents' outputs arrive)."""
    if part is None:
        inputs[key] = x
    else:
        inputs.setdefault(key, {})[part] = x


@dataclasses.dataclass(frozen=True)
class BoundaryBytes:
    """Bytes one microbatch's transfers move between devices across the boundary after stage `stage`.

    Attributes:
      stage: the sending stage's index (its output goes to the stage it feeds).
      forward: the activations (stage's y -> the next stage's x sharding).
      backward: dL/dx back to the stage's output sharding (0 where the next stage passes none back).
    """

    stage: int
    forward: int
    backward: int


def transfer_bytes_per_microbatch(
    stages: Sequence[StageProgram],
    microbatch: PackedMicrobatch | Mapping[str, np.ndarray],
    children: Sequence[int] | None = None,
) -> list[BoundaryBytes]:
    """Per stage boundary of a built pipeline, the bytes its transfer programs move between devices
    for one microbatch of `microbatch`'s shapes (`Transfer.bytes_moved`: the pieces that cross
    devices, local copies excluded; what `run_pipeline` adds to `StepOutput.transfer_bytes`). Only
    shapes are traced; no stage program runs or compiles, and any process may call it."""
    batch = microbatch_fields(microbatch)
    out = []
    for s, y, x in boundary_structs(stages, batch, children):
        b = stages[_child(s, stages, children)]
        back = transfer_bytes(x, stages[s].y_sharding, y.shape) if b.input_grad else 0
        out.append(BoundaryBytes(s, transfer_bytes(y, x.sharding, x.shape), back))
    return out


def _child(s: int, stages, children) -> int:
    return (stage_tree(stages) if children is None else children)[s]


def boundary_structs(
    stages: Sequence[StageProgram], batch: Mapping[str, np.ndarray], children=None, visit=None
):
    """Per stage boundary, in stage order, (sending stage, its output y, the receiving stage's x
    part made of it) of one microbatch of `batch`'s shapes, traced (`output_struct`), nothing
    compiled. `visit(stage index, x, side)`, when given, is called on every stage's whole input
    (a joining stage's once both parts are in), before its output is traced."""
    children = stage_tree(stages) if children is None else tuple(children)
    inputs: dict[int, object] = {}
    out = []
    for s, stage in enumerate(stages):
        side = stage.side_structs(batch)
        x = inputs.pop(s, None)
        if visit is not None:
            visit(s, x, side)
        if stage.is_last:
            break
        y = stage.output_struct(x, side)
        c = children[s]
        part = part_of(s, c, stages, children)
        xc = stages[c].x_struct(y, part)
        deliver(inputs, c, part, xc)
        out.append((s, y, xc))
    return out


def place_sides(
    stages: Sequence[StageProgram],
    microbatches: Sequence[PackedMicrobatch | Mapping[str, np.ndarray]],
) -> list[list[dict | None]]:
    """Per microbatch, per stage, the stage's side inputs on its devices (`StageProgram.put_side`;
    None for a non-local stage): what `run_pipeline(placed=...)` takes. Thread-safe: the trainer
    runs it in the loader's prefetch thread, so host-to-device copies leave the dispatch thread."""
    fields = [microbatch_fields(mb) for mb in microbatches]
    return [[s.put_side(f) if s.local else None for s in stages] for f in fields]


def placed_batch(stages: Sequence[StageProgram], batch):
    """`batch` (a loader's `GlobalBatch`) with its side inputs on the stages' devices
    (`GlobalBatch.placed`): the loader's `place` hook, run by its prefetch thread."""
    batch.placed = place_sides(stages, batch.microbatches)
    return batch


def _forward_only(stages: Sequence[StageProgram], children) -> int:
    """How many leading stages run forward only (their roles decide, `costs.recipe.stage_role`);
    raises unless they are a prefix (a stage behind a trainable one must pass cotangents back) and
    each stage's input gradient agrees with it: what `build_stages` makes from the roles, checked
    here for stage lists built by hand. A stage fed by a trained one passes dL/dx back."""
    backward = [s.has_backward for s in stages]
    k = backward.index(True) if True in backward else len(stages)
    fed = [any(backward[j] for j in parents(children, i)) for i in range(len(stages))]
    wants = [s.has_x and fed[i] for i, s in enumerate(stages)]
    if not all(backward[k:]) or [s.input_grad for s in stages] != wants:
        raise ValueError(
            f"stages with a backward {backward} and input gradients "
            f"{[s.input_grad for s in stages]}: the forward-only (frozen) stages must be the "
            "pipeline's first ones and every later stage must pass dL/dx back (build_stages does)"
        )
    return k


def connect(
    stages: Sequence[StageProgram],
    children: Sequence[int] | None = None,
    store: ExecutableStore | None = None,
) -> None:
    """Sets up the communicator of every pair of stages that exchange data with one tiny transfer each:
    neighbours (activations, cotangents) and every stage with the last (the step's norms and
    statistics, `train_state.apply_updates`). A pair whose transfers are device-to-device copies
    (`transfer.copies`) needs none; its tiny transfer is one copy.

    Call it where every process arrives at about the same time (after building the stages): the
    first use of a communicator waits only 30 s for late peers (gloo's rendezvous on CPU), and in the
    first step a process whose stages compile longer can be later than that. Transfers in both
    directions between two stages share the communicator (`transfer` orders devices by id).
    `store`: where these transfers' programs come from on a process JAX's cache does not write
    from (`programs/executable_store.py`; they run before `precompile`).
    """
    children = stage_tree(stages) if children is None else children
    pairs = [(a, stages[c]) for a, c in zip(stages, children) if c >= 0]
    pairs += [(a, stages[-1]) for a, c in zip(stages, children) if 0 <= c < len(stages) - 1]
    for a, b in pairs:
        x = put_host(np.zeros(1, np.float32), NamedSharding(a.mesh, P()))
        dst = NamedSharding(b.mesh, P())
        hand_over(lower_transfer(x, dst), store)
        jax.block_until_ready(transfer(x, dst))


def _forward(stage: StageProgram, x, side):
    """y of an inner stage; a non-local stage only gives y's shape (for the transfer out of it)."""
    return stage.forward(x, side) if stage.local else stage.output_struct(x, side)


def _forward_train(stage: StageProgram, x, side) -> tuple[jax.Array, Held]:
    """y of an inner stage with a backward and what it keeps for it; a non-local stage only gives
    y's shape and keeps (x, side) (x's shape is dL/dx's)."""
    if stage.local:
        return stage.forward_train(x, side)
    return stage.output_struct(x, side), Held(None, (x, side))


def _backward(stage: StageProgram, held: Held, gy, gacc):
    """(dL/dx or None, gacc + dL/dparams, as buffers); non-local: (dL/dx's shape or None, None)."""
    if stage.local:
        return stage.backward_from(held, gy, gacc)
    return _like_x(stage, held.values[0]), None


def _last(stage: StageProgram, x, side, normalizer, gacc):
    """The last stage's (loss / normalizer, dL/dx or None, gacc + dL/dparams); non-local: a loss
    stand-in (no shards here) and dL/dx's shape."""
    if stage.local:
        loss, _, gx, gacc = stage.forward_backward_loss(x, side, normalizer, gacc)
        return loss, gx, gacc
    scalar = NamedSharding(stage.mesh, P())
    return stand_in((), np.float32, scalar), _like_x(stage, x), None


def _like_x(stage: StageProgram, x):
    """The shape of dL/dx (None when the stage passes none back; per part for a joining stage)."""
    if x is None or not stage.input_grad:
        return None
    if isinstance(x, dict):
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=stage.x_sharding[k])
                for k, v in x.items()}  # fmt: skip
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=stage.x_sharding)


def _send(value, dst: jax.ShapeDtypeStruct) -> tuple[jax.Array, int]:
    """`value` transferred to `dst`'s sharding and shape, and the bytes that moves between devices
    (the same on every process)."""
    return (transfer(value, dst.sharding, dst.shape),
            transfer_bytes(value, dst.sharding, dst.shape))  # fmt: skip


def microbatch_fields(mb: PackedMicrobatch | Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """The microbatch's arrays by field name, without copying them (`dataclasses.asdict` would)."""
    if isinstance(mb, PackedMicrobatch):
        return {f.name: getattr(mb, f.name) for f in dataclasses.fields(mb)}
    return mb
