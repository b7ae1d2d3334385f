"""Discrete-event pipeline simulator: 1F1B and GPipe over heterogeneous stages (DESIGN sections 4 and 9).

Each stage runs its operations (forward F or backward B of one microbatch) in a fixed per-stage order;
an operation starts when its stage is free and its inputs have arrived:

- F(k, s) needs F(k, s-1) finished plus the transfer time between stages s-1 and s;
- B(k, s) needs F(k, s) finished and, except on the last stage, B(k, s+1) finished plus the transfer.

Per-stage orders (non-interleaved, as in Megatron-LM's `forward_backward_pipelining_without_interleaving`):

- 1F1B: stage s (0-based, P stages, M microbatches) runs `w = min(P - s - 1, M)` warm-up forwards, then
  alternates one forward and one backward (F(w), B(0), F(w+1), B(1), ...) until all forwards are issued,
  then the remaining backwards (cool-down). At most `w + 1` microbatches are in flight on stage s.
- GPipe: all forwards, then all backwards, both in microbatch order. All M microbatches are in flight.
- Interleaved 1F1B (Megatron-LM's `forward_backward_pipelining_with_interleaving`, "virtual pipeline
  stages"): the model is cut into V = P x v virtual stages, device d holding model chunks c = 0..v-1,
  i.e. virtual stages c x P + d. Device d walks M x v virtual microbatches: virtual microbatch i is
  microbatch (i // (P v)) x P + i % P of chunk (i // P) % v going forward (chunk v - 1 - that going
  backward); it runs `min((P - d - 1) x 2 + (v - 1) x P, M v)` warm-up forwards (all of them when
  M = P), then one forward / one backward, then the cool-down backwards. M must be a multiple of P
  (Megatron's own requirement for this schedule; with a shorter last group of microbatches taken
  through the chunks the same way, this order deadlocks, e.g. P = 4, v = 3, M = 5). With v = 1 it is
  plain 1F1B.

Forward-only stages (a frozen prefix of the pipeline, costs/recipe.py: nothing trained and nothing
before them trains): the leading stages whose backward times are all zero run their forwards only, in
microbatch order, and no backward ops: the runtime's driver leaves them out of the backward wave, so
their forwards are never held back behind a backward (1F1B and GPipe; interleaved runs all stages
as given). A microbatch's backward then ends at the first stage that has one.

The step's update (`StepUpdate`, priced by `costs/update.py`) follows the pipeline: each device group
reduces its gradients from the end of its own last operation, the global-norm barrier waits for every
group's reduce, then each applies its optimizer step; the step ends with the slowest apply. Without
an update the step is the pipeline's makespan.

Encoder branches (`children`: two encoders, each on its own stages, feeding the first LLM stage): the
stages form an in-tree. F(k, s) needs F(k, p) of every parent p (the stages feeding s; at most two)
plus each one's transfer, B(k, s) needs B(k, child) plus the transfer back, and a stage runs the 1F1B
or GPipe order of the chain stage as many stages from the end as it is (`contracts.pipeline_order.
depths`), so a branch keeps as many microbatches in flight as its depth. `transfer[k, s]` is the hop
from stage s to its child. Branched pipelines run every stage forward and backward (no forward-only
prefix) and are not interleaved.

For uniform stages (forward f, backward b, zero transfer) 1F1B and GPipe give a step time of
(M + P - 1) * (f + b); interleaving with v chunks of f / v, b / v cuts the bubble to (P - 1)(f + b) / v.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Literal, NamedTuple

import numpy as np

from dflop_jax.contracts.pipeline_order import chain_position, depths, stage_order

ScheduleKind = Literal["1f1b", "gpipe", "interleaved"]
SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe", "interleaved")


class Event(NamedTuple):
    """One operation on one stage: `kind` is "F" or "B" of `microbatch`, over [start, end) seconds
    (`stage` is the virtual stage under the interleaved schedule)."""

    stage: int
    microbatch: int
    kind: str
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class StepUpdate:
    """The per-step update after the pipeline, per device group (module docstring).

    Attributes:
      reduce: [P] seconds from a group's last operation until its gradients are reduced.
      apply: [P] seconds from the norm barrier until a group's params are updated and gathered.
      barrier: seconds of the global-norm exchange between the last reduce and any apply.
    """

    reduce: tuple[float, ...]
    apply: tuple[float, ...]
    barrier: float = 0.0

    def __post_init__(self):
        if len(self.reduce) != len(self.apply):
            raise ValueError(f"update: {len(self.reduce)} reduce times, {len(self.apply)} apply")
        if min((*self.reduce, *self.apply, self.barrier), default=0.0) < 0:
            raise ValueError("update times must be non-negative")

    @property
    def tail(self) -> float:
        """The update's seconds when every group's pipeline ends at once."""
        return max(self.reduce) + self.barrier + max(self.apply)

    def end(self, group_ends) -> float:
        """When the step ends, given each group's last operation's end."""
        ready = max(e + r for e, r in zip(group_ends, self.reduce, strict=True))
        return ready + self.barrier + max(self.apply)


@dataclasses.dataclass(frozen=True)
class SimResult:
    """What one simulated training step did.

    Attributes:
      step_time: seconds from the step's start to its end (the update's, when one was given).
      pipeline_time: the pipeline's makespan (its last forward or backward's end).
      busy: [P] seconds each stage (device group) spent computing.
      idle_fraction: sum_s (pipeline - busy_s) / (P * pipeline) (DESIGN section 9: the bubbles; the
        update after the pipeline is not counted).
      schedule: "1f1b", "gpipe" or "interleaved".
      chunks: model chunks per stage (virtual stages per device group; 1 unless interleaved).
      events: (a property) per stage (device group), its operations in execution order; built on
        first use, since most callers (the planner, the scheduler's order search) read only the step.
    """

    step_time: float
    pipeline_time: float
    busy: np.ndarray
    idle_fraction: float
    schedule: str
    chunks: int
    timeline: _Timeline = dataclasses.field(repr=False, compare=False)

    @functools.cached_property
    def events(self) -> tuple[tuple[Event, ...], ...]:
        return self.timeline.events(len(self.busy))

    @property
    def num_stages(self) -> int:
        return len(self.events)

    @property
    def num_microbatches(self) -> int:
        return sum(1 for e in self.events[0] if e.kind == "F") // self.chunks

    def peak_in_flight(self) -> list[int]:
        """Per stage, the most (chunk-)microbatches forwarded but not yet backwarded at any time (0 for
        a forward-only stage, which keeps none)."""
        out = []
        for stage_events in self.events:
            live = peak = 0
            if all(e.kind == "F" for e in stage_events):
                out.append(0)
                continue
            for e in stage_events:
                live += 1 if e.kind == "F" else -1
                peak = max(peak, live)
            out.append(peak)
        return out


def device_order(
    schedule: str, device: int, num_devices: int, num_microbatches: int, chunks: int = 1
) -> list[tuple[str, int, int]]:
    """The (kind, microbatch, virtual stage) sequence device group `device` executes; with chunks = 1
    (or any schedule but "interleaved") virtual stage = `device` and the order is `stage_order`'s."""
    if schedule != "interleaved" or chunks == 1:
        kind = "1f1b" if schedule == "interleaved" else schedule
        return [(f, k, device) for f, k in stage_order(kind, device, num_devices, num_microbatches)]
    p, v, m = num_devices, chunks, num_microbatches
    if m % p:
        raise ValueError(
            f"interleaved schedule: {m} microbatches is not a multiple of the {p} pipeline stages"
        )
    total = m * v

    def op(kind: str, i: int) -> tuple[str, int, int]:
        chunk = (i // p) % v
        chunk = chunk if kind == "F" else v - 1 - chunk
        return kind, (i // (p * v)) * p + i % p, chunk * p + device

    warmup = total if m == p else min((p - device - 1) * 2 + (v - 1) * p, total)
    order = [op("F", i) for i in range(warmup)]
    for i in range(total - warmup):
        order += [op("F", warmup + i), op("B", i)]
    return order + [op("B", i) for i in range(total - warmup, total)]


def _check_inputs(times: np.ndarray, transfer) -> tuple[np.ndarray, np.ndarray]:
    times = np.asarray(times, dtype=np.float64)
    if times.ndim != 3 or times.shape[2] != 2 or times.shape[0] < 1 or times.shape[1] < 1:
        raise ValueError(
            f"times has shape {times.shape}: expected [microbatches, stages, 2] (fwd, bwd)"
        )
    if not np.all(np.isfinite(times)) or np.any(times < 0):
        raise ValueError("times must be finite and non-negative")
    m, p, _ = times.shape
    if transfer is None:
        transfer = 0.0
    try:
        xfer = np.broadcast_to(np.asarray(transfer, dtype=np.float64), (m, max(p - 1, 0)))
    except ValueError:
        raise ValueError(
            f"transfer has shape {np.shape(transfer)}: expected [microbatches, stages-1] = {(m, p - 1)} "
            "or broadcastable to it"
        ) from None
    if not np.all(np.isfinite(xfer)) or np.any(xfer < 0):
        raise ValueError("transfer times must be finite and non-negative")
    return times, xfer


def _check_schedule(schedule: str, num_virtual: int, chunks: int) -> int:
    """The number of device groups P; raises ValueError for an unknown schedule or bad chunking."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks={chunks!r}: must be an integer >= 1")
    if chunks > 1 and schedule != "interleaved":
        raise ValueError(f"chunks={chunks} needs schedule='interleaved', not {schedule!r}")
    if num_virtual % chunks:
        raise ValueError(
            f"{num_virtual} virtual stages do not split into {chunks} chunks per stage"
        )
    return num_virtual // chunks


def simulate(
    times,
    transfer=None,
    schedule: ScheduleKind = "1f1b",
    chunks: int = 1,
    update: StepUpdate | None = None,
    children: tuple[int, ...] | None = None,
) -> SimResult:
    """Simulates one training step of a pipeline.

    Args:
      times: [M, V, 2] forward and backward seconds of microbatch k on (virtual) stage j; V = P x chunks.
      transfer: seconds to move microbatch k's activations (and, backwards, their gradients) between
        (virtual) stages j and j+1: [M, V-1] or anything broadcastable to it (a scalar); None = free.
      schedule: "1f1b", "gpipe" or "interleaved".
      chunks: model chunks per device group (interleaved only): virtual stage j runs on group j % P.
      update: the update after the pipeline, per device group (None: the step ends with it).
      children: per stage, the stage its output feeds (-1 for the last): encoder branches (module
        docstring); None: a chain.

    Returns:
      The SimResult (step time, busy time per device group, idle fraction, events).
    """
    times, xfer = _check_inputs(times, transfer)
    m, nv, _ = times.shape
    p = _check_schedule(schedule, nv, chunks)
    if children is not None:
        children = _check_children(children, nv, schedule)
    prefix = 0 if chunks > 1 or children is not None else forward_only_prefix(times)
    plan = _op_plan(schedule, p, m, chunks, prefix, children)
    # plain Python lists: this loop is the planner's inner loop (the scheduler's order search runs it
    # tens of thousands of times per plan), and list indexing is ~10x numpy's
    dur = times.ravel().tolist()
    hop = xfer.ravel().tolist() + [0.0]  # the last entry: "no transfer"
    start = [0.0] * (len(plan.deps) + 1)
    end = [0.0] * (len(plan.deps) + 1)  # end[0] = 0.0: "no dependency"
    joins = plan.joins  # op -> (second parent's op, its transfer); empty for a chain
    for i, (q, a, b, h, t) in enumerate(plan.deps, 1):
        s, x, y = end[q], end[a], end[b] + hop[h]
        if x > s:
            s = x
        if y > s:
            s = y
        if joins and i in joins:
            c, g = joins[i]
            s = max(s, end[c] + hop[g])
        start[i] = s
        end[i] = s + dur[t]
    pipeline = max(end[i] for i in plan.last)
    if update is not None and len(update.reduce) != p:
        raise ValueError(f"update has {len(update.reduce)} device groups, the pipeline {p}")
    step = pipeline if update is None else update.end([end[i] for i in plan.last])
    busy = times.sum(axis=0).sum(axis=1).reshape(chunks, p).sum(axis=0)  # [P]
    idle = (
        max(0.0, float(np.sum(pipeline - busy) / (p * pipeline))) if pipeline > 0 else 0.0
    )  # clamp fp round-off
    return SimResult(step, pipeline, busy, idle, schedule, chunks, _Timeline(plan, start, end))


def forward_only_prefix(times: np.ndarray) -> int:
    """How many leading stages have no backward (all their backward times zero)."""
    if times[0, 0, 1] > 0:  # the usual case, in the planner's inner loop: one scalar read
        return 0
    bwd, n = times[:, :, 1], 0
    while n < bwd.shape[1] and not bwd[:, n].any():
        n += 1
    return n


class _OpPlan(NamedTuple):
    """A schedule's operations in one dependency-respecting order, as indices (`_op_plan`)."""

    deps: tuple[tuple[int, int, int, int, int], ...]  # per op (q, a, b, h, t), see `_op_plan`
    ops: tuple[tuple[int, str, int, int], ...]  # per op (device group, kind, microbatch, stage)
    last: tuple[int, ...]  # per device group, its last op's position (1-based)
    # op -> (its second parent's op, that transfer); built once with the cached plan, never changed
    joins: dict[int, tuple[int, int]]


def _check_children(children, nv: int, schedule: str) -> tuple[int, ...]:
    children = tuple(int(c) for c in children)
    if len(children) != nv:
        raise ValueError(f"children has {len(children)} stages, times {nv}")
    depths(children)  # validates the in-tree
    if schedule == "interleaved":
        raise ValueError("encoder branches (children) run 1f1b or gpipe, not interleaved")
    if any(children.count(j) > 2 for j in range(nv)):
        raise ValueError(f"children={list(children)}: a stage takes at most two parents")
    return children


@functools.lru_cache(maxsize=1024)
def _op_plan(
    schedule: str, p: int, m: int, chunks: int, forward_only: int = 0, children=None
) -> _OpPlan:
    """Every operation of the schedule in an order where all its inputs come earlier, with what it
    waits for as positions: op i (1-based) starts at max(end[q], end[a], end[b] + hop[h]) and lasts
    dur[t], q = the previous op of its device group, a = F(k, j) for B(k, j), b = F(k, j-1) for a
    forward or B(k, j+1) for a backward, h = the transfer between them; 0 (and h = M x (V-1)) where
    there is none, end[0] = hop[M (V-1)] = 0. dur and hop are `times` and `transfer` flattened.

    The order is the one the event loop of a discrete-event simulation would take (a group runs its
    next op as soon as its inputs exist); it depends only on (schedule, P, M, chunks), never on the
    times, so it is built once and every simulation is one pass over it. The first `forward_only`
    stages (chunks = 1) run their forwards only; the backward of the next stage then waits for nothing
    upstream. With `children` (encoder branches), a forward's parents are the stages feeding it, a
    backward's child the one it feeds; a second parent goes to `joins`.
    """
    nv = p * chunks
    if children is None:
        orders = [device_order(schedule, d, p, m, chunks) for d in range(p)]
        for d in range(min(forward_only, p)):
            orders[d] = [("F", k, d) for k in range(m)]
        parents = [[j - 1] if j else [] for j in range(nv)]
        child = [j + 1 if j < nv - 1 else -1 for j in range(nv)]
        near = [[t % p for t in (d - 1, d + 1) if chunks > 1 or 0 <= t < p] for d in range(p)]
    else:
        depth = depths(children)
        orders = [[(f, k, d) for f, k in stage_order(schedule, chain_position(depth[d], p), p, m)]
                  for d in range(p)]  # fmt: skip
        parents = [[i for i in range(p) if children[i] == j] for j in range(p)]
        child = list(children)
        near = [parents[d] + ([child[d]] if child[d] >= 0 else []) for d in range(p)]
    return _plan_ops(schedule, orders, parents, child, near, m, nv)


def _plan_ops(schedule, orders, parents, child, near, m: int, nv: int) -> _OpPlan:
    """`_op_plan`'s worklist over device groups' `orders` of (kind, microbatch, virtual stage): a
    forward waits for its `parents`' forwards (a second one goes to `joins`), a backward for its
    forward and its `child`'s backward; `near[d]`: the groups that may wait for group d."""
    p = len(orders)
    pos: dict[tuple[str, int, int], int] = {}
    deps, ops, joins = [], [], {}
    next_op, last = [0] * p, [0] * p
    none = m * (nv - 1)
    # Worklist: a group is re-examined only when a neighbour finished something it may wait for.
    todo, queued = collections.deque(range(p)), [True] * p
    while todo:
        d = todo.popleft()
        queued[d] = False
        order, i = orders[d], next_op[d]
        while i < len(order):
            kind, k, j = order[i]
            if kind == "F":
                a = 0
                ups = [(pos.get(("F", k, u)), k * (nv - 1) + u) for u in parents[j]]
            else:
                a, c = pos.get(("F", k, j)), child[j]
                ups = [] if c < 0 else [(pos.get(("B", k, c)), k * (nv - 1) + j)]
            if a is None or any(b is None for b, _ in ups):
                break
            (b, h), extra = (ups[0], ups[1:]) if ups else ((0, none), [])
            deps.append((last[d], a, b, h, (k * nv + j) * 2 + (kind == "B")))
            ops.append((d, kind, k, j))
            pos[kind, k, j] = last[d] = len(deps)
            joins.update((len(deps), e) for e in extra)
            i += 1
        if i > next_op[d]:
            for t in near[d]:
                if not queued[t]:
                    todo.append(t)
                    queued[t] = True
        next_op[d] = i
    if any(next_op[d] < len(orders[d]) for d in range(p)):  # impossible for the orders above
        raise RuntimeError(f"pipeline schedule {schedule!r} deadlocked")
    return _OpPlan(tuple(deps), tuple(ops), tuple(last), joins)


class _Timeline(NamedTuple):
    """A simulation's start and end times, by position in its `_OpPlan` (events built on demand)."""

    plan: _OpPlan
    start: list[float]
    end: list[float]

    def events(self, p: int) -> tuple[tuple[Event, ...], ...]:
        out: list[list[Event]] = [[] for _ in range(p)]
        for i, (d, kind, k, j) in enumerate(self.plan.ops, 1):
            out[d].append(Event(j, k, kind, self.start[i], self.end[i]))
        return tuple(tuple(e) for e in out)


def uniform_step_time(
    num_microbatches: int, num_stages: int, fwd: float, bwd: float, chunks: int = 1
) -> float:
    """Closed-form step time for identical stages (f, b each) and free transfers: 1F1B / GPipe
    (M + P - 1)(f + b); interleaved with `chunks` v (each chunk f / v, b / v) M (f + b) + (P - 1)(f + b) / v."""
    return (num_microbatches + (num_stages - 1) / chunks) * (fwd + bwd)
