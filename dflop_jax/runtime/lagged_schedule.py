"""The loader's schedule function with corrections one step late: batch b sees the steps <= b - lag.

    lagged = LaggedSchedule(scheduler, lag=prefetch)
    loader = make_loader(..., schedule_fn=lagged, prefetch=prefetch)   # solves ahead in its thread
    lagged.post(step, resolve)        # trainer, after dispatching `step`: how to get its observation
    meta = lagged.state(step)         # checkpoint after `step`; lagged.load(meta) on resume

Why: the loader prefetches (the solver and decoding run in its background thread while the devices
work), so batch b is solved while steps b - 1, b, ... are still running. A rule that depends on when
the thread gets there would make the schedule depend on timing; this one is deterministic: global
batch b (step b + 1) is scheduled after exactly the observations of steps 1..b - lag, applied in step
order. With lag = prefetch the thread only waits when it is `lag` batches ahead and the step it needs
has not finished, so the step itself never waits for the solver (only for a batch that is late).
Every process applies the same observations in the same order (each a bit-exact exchange,
`schedule_agreement.shared_stage_times`), so schedules agree across processes, and a resumed run repeats
them: a checkpoint after step s stores the scheduler's state through step s - 1 - lag (the latest
state the loader is sure to have passed) plus the observations of the steps after it.

`post(step, resolve)`: `resolve()` returns the step's `Observation` or None (a step that measured
nothing). It is called once, from whichever thread needs it first (the loader's, or a checkpoint).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from dflop_jax.contracts import SampleShape, Schedule, ScheduledMicrobatch, ScheduleProblem
from dflop_jax.scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class Observation:
    """Measured stage seconds of one step's valid microbatches (JSON-able for checkpoints).

    Attributes:
      buckets: per microbatch, (tile bucket, length bucket).
      times: per microbatch, [P][2] seconds (fwd, bwd), the last stage's fused program split by the
        raw predicted fwd:bwd ratio.
    """

    buckets: tuple[tuple[int, int], ...]
    times: tuple

    @classmethod
    def of_step(
        cls, problem: ScheduleProblem, schedule: Schedule, times: np.ndarray, valid: np.ndarray
    ) -> Observation | None:
        """The observation of a measured step (None when no microbatch is valid)."""
        times = np.array(times, dtype=np.float64)
        for m, mb in enumerate(schedule.microbatches):
            f, b = problem.microbatch_costs(mb)[-1]
            total = times[m, -1, 0]
            times[m, -1] = (total * f / (f + b), total * b / (f + b)) if f + b > 0 else (total, 0)
        keep = np.flatnonzero(valid)
        if not keep.size:
            return None
        mbs = schedule.microbatches
        return cls(
            tuple((mbs[i].tile_bucket, mbs[i].length_bucket) for i in keep),
            tuple(times[keep].tolist()),
        )

    def feed(self, scheduler: Scheduler) -> None:
        plans = tuple(ScheduledMicrobatch(t, s, ()) for t, s in self.buckets)
        scheduler.observe(Schedule(plans, 0.0, 0.0, "observed", 0.0), np.asarray(self.times))

    def to_json(self) -> dict:
        return {"buckets": [list(b) for b in self.buckets], "times": list(self.times)}

    @classmethod
    def from_json(cls, d: dict) -> Observation:
        return cls(tuple(tuple(b) for b in d["buckets"]), tuple(d["times"]))


class LaggedSchedule:
    """A `ScheduleFn` over a `Scheduler` that feeds it observations `lag` steps late (module docs)."""

    def __init__(self, scheduler: Scheduler, lag: int):
        if lag < 0:
            raise ValueError(f"lag={lag}: must be >= 0")
        self.scheduler, self.lag = scheduler, lag
        self._cond = threading.Condition()
        self._posted: dict[int, Callable[[], Observation | None]] = {}
        self._resolved: dict[int, Observation | None] = {}
        self._resolving: set[int] = set()
        self.applied_through = 0
        self._snapshots: dict[int, dict] = {0: scheduler.state_dict()}
        self._closed = False

    def post(self, step: int, resolve: Callable[[], Observation | None]) -> None:
        """Hands over how to get `step`'s observation (called once per step, in step order)."""
        with self._cond:
            self._posted[step] = resolve
            self._cond.notify_all()

    def __call__(self, shapes: Sequence[SampleShape], index: int) -> Schedule:
        start = time.perf_counter()
        self._apply_through(index - self.lag)
        waited = time.perf_counter() - start
        schedule = self.scheduler.schedule(shapes, index)
        schedule.info["observation_wait_s"] = waited
        schedule.info["correction"] = self.scheduler.prediction_error()
        return schedule

    def _apply_through(self, step: int) -> None:
        while self.applied_through < step:
            k = self.applied_through + 1
            obs = self.observation(k)
            if obs is not None:
                obs.feed(self.scheduler)
            with self._cond:
                self.applied_through = k
                self._snapshots[k] = (
                    self.scheduler.state_dict() if obs is not None else self._snapshots[k - 1]
                )
                horizon = k - 2 * self.lag - 4  # older than any checkpoint can ask for
                for table in (self._snapshots, self._resolved):
                    for old in [t for t in table if t < horizon]:
                        del table[old]
                self._cond.notify_all()

    def observation(self, step: int) -> Observation | None:
        """Step `step`'s observation, waiting for the trainer to post it and for it to resolve."""
        with self._cond:
            while step not in self._resolved:
                if self._closed:
                    raise RuntimeError("the schedule function was closed (the run ended)")
                if step in self._posted and step not in self._resolving:
                    self._resolving.add(step)
                    resolve = self._posted.pop(step)
                    break
                self._cond.wait()
            else:
                return self._resolved[step]
        try:
            obs = resolve()
        finally:
            with self._cond:
                self._resolving.discard(step)
                self._cond.notify_all()
        with self._cond:
            self._resolved[step] = obs
            self._cond.notify_all()
        return obs

    def state(self, step: int) -> dict:
        """Checkpoint after `step`: the scheduler through step - 1 - lag and the observations of the
        later steps through `step` (waits for the ones not yet measured)."""
        base = max(step - 1 - self.lag, 0)
        with self._cond:
            while self.applied_through < base:  # the loader consumed batch step - 1: it gets there
                self._cond.wait()
            snapshot = self._snapshots[base]
        later = {}
        for k in range(base + 1, step + 1):
            obs = self.observation(k)
            if obs is not None:
                later[str(k)] = obs.to_json()
        return {"scheduler": snapshot, "through": base, "step": step, "observations": later}

    def load(self, state: dict) -> None:
        """Restores `state(step)` before the loader schedules anything."""
        self.scheduler.load_state_dict(state["scheduler"])
        base, step = int(state["through"]), int(state["step"])
        with self._cond:
            self.applied_through = base
            self._snapshots = {base: state["scheduler"]}
            self._resolved = dict.fromkeys(range(base + 1, step + 1))
            for k, d in state["observations"].items():
                self._resolved[int(k)] = Observation.from_json(d)

    def close(self) -> None:
        """Wakes a loader thread waiting for a step that will never come (end of run, error)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
