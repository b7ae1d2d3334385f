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

For uniform stages (forward f, backward b, zero transfer) both give a step time of (M + P - 1) * (f + b).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Literal, NamedTuple

import numpy as np

ScheduleKind = Literal["1f1b", "gpipe"]
SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe")


class Event(NamedTuple):
    """One operation on one stage: `kind` is "F" or "B" of `microbatch`, over [start, end) seconds."""

    stage: int
    microbatch: int
    kind: str
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class SimResult:
    """What one simulated training step did.

    Attributes:
      step_time: makespan in seconds (last operation's end; the step starts at 0).
      busy: [P] seconds each stage spent computing.
      idle_fraction: sum_s (step - busy_s) / (P * step) (DESIGN section 9).
      events: per stage, its operations in execution order.
      schedule: "1f1b" or "gpipe".
    """

    step_time: float
    busy: np.ndarray
    idle_fraction: float
    events: tuple[tuple[Event, ...], ...]
    schedule: str

    @property
    def num_stages(self) -> int:
        return len(self.events)

    @property
    def num_microbatches(self) -> int:
        return sum(1 for e in self.events[0] if e.kind == "F")

    def peak_in_flight(self) -> list[int]:
        """Per stage, the most microbatches forwarded but not yet backwarded at any time."""
        out = []
        for stage_events in self.events:
            live = peak = 0
            for e in stage_events:
                live += 1 if e.kind == "F" else -1
                peak = max(peak, live)
            out.append(peak)
        return out


def stage_order(
    schedule: str, stage: int, num_stages: int, num_microbatches: int
) -> list[tuple[str, int]]:
    """The (kind, microbatch) sequence one stage executes; see the module docstring."""
    m = num_microbatches
    if schedule == "gpipe":
        return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}")
    warmup = min(num_stages - stage - 1, m)
    order = [("F", k) for k in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", k) for k in range(m - warmup, m)]
    return order


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


def simulate(times, transfer=None, schedule: ScheduleKind = "1f1b") -> SimResult:
    """Simulates one training step of a pipeline.

    Args:
      times: [M, P, 2] forward and backward seconds of microbatch k on stage s.
      transfer: seconds to move microbatch k's activations (and, backwards, their gradients) between
        stages s and s+1: [M, P-1] or anything broadcastable to it (a scalar); None = free.
      schedule: "1f1b" or "gpipe".

    Returns:
      The SimResult (step time, busy time per stage, idle fraction, events).
    """
    times, xfer = _check_inputs(times, transfer)
    m, p, _ = times.shape
    orders = [stage_order(schedule, s, p, m) for s in range(p)]
    # plain Python lists: this loop is the planner's inner loop, and list indexing is ~10x numpy's
    dur = times.tolist()  # [M][P][2]
    hop = xfer.tolist()  # [M][P-1]
    f_end: list[list[float | None]] = [[None] * p for _ in range(m)]
    b_end: list[list[float | None]] = [[None] * p for _ in range(m)]
    next_op = [0] * p
    free_at = [0.0] * p
    events: list[list[Event]] = [[] for _ in range(p)]
    # Worklist: a stage is re-examined only when a neighbour finished something it may wait for.
    todo, queued = collections.deque(range(p)), [True] * p
    while todo:
        s = todo.popleft()
        queued[s] = False
        order, i = orders[s], next_op[s]
        while i < len(order):
            kind, k = order[i]
            ready = _ready_time(kind, k, s, p, f_end, b_end, hop)
            if ready is None:
                break
            start = ready if ready > free_at[s] else free_at[s]
            end = start + dur[k][s][0 if kind == "F" else 1]
            (f_end if kind == "F" else b_end)[k][s] = end
            free_at[s] = end
            events[s].append(Event(s, k, kind, start, end))
            i += 1
        if i > next_op[s]:
            for t in (s - 1, s + 1):
                if 0 <= t < p and not queued[t]:
                    todo.append(t)
                    queued[t] = True
        next_op[s] = i
    if any(next_op[s] < len(orders[s]) for s in range(p)):  # impossible for the two orders above
        raise RuntimeError(f"pipeline schedule {schedule!r} deadlocked")
    step = float(max(free_at))
    busy = times.sum(axis=0).sum(axis=1)  # [P]
    idle = (
        max(0.0, float(np.sum(step - busy) / (p * step))) if step > 0 else 0.0
    )  # clamp fp round-off
    return SimResult(step, busy, idle, tuple(tuple(e) for e in events), schedule)


def _ready_time(kind, k, s, p, f_end, b_end, hop) -> float | None:
    """When the inputs of (kind, k) on stage s are available, or None if they are not produced yet."""
    if kind == "F":
        if s == 0:
            return 0.0
        prev = f_end[k][s - 1]
        return None if prev is None else prev + hop[k][s - 1]
    own = f_end[k][s]
    if own is None:
        return None
    if s == p - 1:
        return own
    nxt = b_end[k][s + 1]
    if nxt is None:
        return None
    nxt += hop[k][s]
    return own if own > nxt else nxt


def uniform_step_time(num_microbatches: int, num_stages: int, fwd: float, bwd: float) -> float:
    """Closed-form 1F1B / GPipe step time for identical stages and free transfers: (M + P - 1)(f + b)."""
    return (num_microbatches + num_stages - 1) * (fwd + bwd)
