"""Stage times of a measured step without stopping the pipeline: background threads watch each op finish.

    watch = watch_ops(out.timeline, num_stages, num_mb)   # returns at once; threads start
    times, valid = watch.result()                          # [M, P, 2] seconds, [M] bool (waits)

Why threads: the adaptive correction needs per-stage, per-microbatch seconds, but blocking the
dispatching thread on every op (what measured steps used to do) serializes the step. Here one thread
per stage waits, in that stage's order, for each op's `done` value and notes the clock when it is
ready. After the step an op's time is its ready time minus its start, where the start is the latest
of: its dispatch, the previous op of its stage being done, and the op producing its input (the
neighbour stage's forward or backward of that microbatch) being done. So an op's time includes the
transfer of its input when that transfer runs late, and a thread that wakes late shifts one op's end
and the next op's start alike.

What the backends allow: neither XLA:CPU nor the GPU backends expose per-program device timestamps
through a public JAX API (the profiler's traces are the only source, far too heavy for every few
steps), so readiness seen from host threads is the measure. On CPU the simulated devices share the
host's cores: ops of different stages that overlap slow each other, so these times are the stage
costs of the run as it actually overlaps (the serialized measurement timed each op alone). A thread's
wake-up adds ~0.1 ms of noise per op on an idle host, more on a loaded one.

A microbatch whose op compiled a new program is invalid (its time is mostly compilation), as before.
The last stage's fused forward+backward is reported whole in the fwd slot (bwd = 0).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from dflop_jax.runtime.driver import Op, OpEvent


class OpWatch:
    """The threads watching one step's ops; `result()` waits for them and returns the times."""

    def __init__(
        self,
        timeline: Sequence[OpEvent],
        num_stages: int,
        num_mb: int,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.events = list(timeline)
        self.num_stages, self.num_mb, self.clock = num_stages, num_mb, clock
        self.ready: dict[Op, float] = {}
        self._errors: list[BaseException] = []
        by_stage: dict[int, list[OpEvent]] = {}
        for e in self.events:
            by_stage.setdefault(e.op.stage, []).append(e)
        self._threads = [
            threading.Thread(target=self._watch, args=(evs,), name=f"dflop-optime-{s}", daemon=True)
            for s, evs in by_stage.items()
        ]
        for t in self._threads:
            t.start()

    def _watch(self, events: list[OpEvent]) -> None:
        try:
            for e in events:
                jax.block_until_ready(e.done)
                self.ready[e.op] = self.clock()
        except BaseException as err:  # handed to result()
            self._errors.append(err)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """([M, P, 2] seconds, [M] validity); stages this process does not run stay 0 (valid)."""
        for t in self._threads:
            t.join()
        if self._errors:
            raise self._errors[0]
        return op_seconds(self.events, self.ready, self.num_stages, self.num_mb)


def op_seconds(
    events: Sequence[OpEvent], ready: dict[Op, float], num_stages: int, num_mb: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per-op seconds from dispatch and ready times (module docstring's start rule)."""
    times = np.zeros((num_mb, num_stages, 2))
    valid = np.ones(num_mb, bool)
    last_done: dict[int, float] = {}
    for e in events:
        op = e.op
        start = max(e.dispatched_s, last_done.get(op.stage, -np.inf))
        producer = _producer(op, num_stages)
        if producer is not None and producer in ready:
            start = max(start, ready[producer])
        times[op.mb, op.stage, 0 if op.kind == "F" else 1] = max(ready[op] - start, 0.0)
        last_done[op.stage] = ready[op]
        valid[op.mb] &= not e.compiled
    return times, valid


def _producer(op: Op, num_stages: int) -> Op | None:
    """The op whose output this op consumes from a neighbour stage (None: host inputs only)."""
    if op.kind == "F":
        return Op(op.stage - 1, op.mb, "F") if op.stage > 0 else None
    nxt = op.stage + 1
    return Op(nxt, op.mb, "F" if nxt == num_stages - 1 else "B")


def watch_ops(
    timeline: Sequence[OpEvent],
    num_stages: int,
    num_mb: int,
    clock: Callable[[], float] = time.perf_counter,
) -> OpWatch:
    """Starts watching a measured step's ops (see `OpWatch`)."""
    return OpWatch(timeline, num_stages, num_mb, clock)


OpWatcher = Callable[[Sequence[OpEvent], int, int, Callable[[], float]], OpWatch]
"""What starts timing a measured step (`watch_ops`; tests give a deterministic stand-in)."""
