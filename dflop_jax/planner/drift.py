"""Data drift, measured: how much faster the best plan for the recent data would run than the running
plan (`plan_regret`). No jax.

A plan is chosen for one shape distribution; a curriculum that changes the data (images first, then
video) can leave it far from the best. Every `planner.replan_every` steps the run hands the shapes of
its last `planner.replan_batches` global batches to a `DriftMonitor`, which on its own thread:

1. scores the running plan on exactly those batches: the planner's expected step time
   (`scoring.expected_step_time`: the online scheduler's output, simulated) with the run's cost
   provider, buckets and microbatch range;
2. plans for them (`search.make_plan` on the pooled shapes, the same devices, the same cost provider
   and planner settings) and scores the planner's pick on the same batches the same way;
3. reports `plan_regret = running / best - 1`, where best is the faster of the two (0: the running plan
   is as good as anything the planner finds; 0.25: the best plan would take 20% less time per step).

Scoring both plans on the same recent batches (common random numbers) keeps sampling noise out of the
difference. The results are read back on the dispatch thread without waiting (`DriftMonitor.poll`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections import deque
from collections.abc import Sequence

from dflop_jax.contracts import SampleShape
from dflop_jax.contracts.layout import Layout
from dflop_jax.planner.config import PlannerConfig
from dflop_jax.planner.explain import PlanningError
from dflop_jax.planner.plan_file import Plan
from dflop_jax.planner.resolve import ResolvedPlan
from dflop_jax.planner.scoring import (
    LayoutCosts,
    expected_step_time,
    online_scheduler,
    problem_for,
)
from dflop_jax.planner.search import make_plan

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Drift:
    """One drift measurement after `step` over `batches` recent global batches.

    Attributes:
      running_s: the running plan's expected step time on them (inf: they do not fit its buckets).
      planned_s: the planner's pick's (inf: no plan found).
      best: the planner's pick (None: no plan found, `error` says why).
    """

    step: int
    batches: int
    running_s: float
    planned_s: float
    best: Plan | None
    error: str = ""

    @property
    def regret(self) -> float:
        """running / min(running, planned) - 1: >= 0, 0 when nothing the planner finds is faster."""
        best = min(self.running_s, self.planned_s)
        if math.isinf(self.running_s):
            return math.inf if not math.isinf(best) else 0.0
        return self.running_s / best - 1.0

    def describe(self) -> str:
        if self.best is None:
            return (
                f"plan_regret after step {self.step}: no plan for the last {self.batches} batches "
                f"({self.error})"
            )
        return (
            f"plan_regret after step {self.step}: {self.regret:.1%} over the last {self.batches} "
            f"batches (running plan {self.running_s * 1e3:.3g} ms/step, planner's pick "
            f"{self.planned_s * 1e3:.3g} ms/step: {_describe(self.best.layout)})"
        )


def _describe(layout: Layout) -> str:
    return " + ".join(f"{s.module}[{s.num_layers}L dp{s.dp} tp{s.tp}]" for s in layout.stages) + (
        " (encoder colocated)" if not layout.encoder_stages else ""
    )


def score_on(
    batches: Sequence[Sequence[SampleShape]], plan: ResolvedPlan, config: PlannerConfig, kind: str
) -> float:
    """A plan's expected step time on exactly `batches` (the planner's scoring: its stage costs under
    each stage's residual policy, the online scheduler with its solver and seed, then the
    simulator)."""
    costs = LayoutCosts.build(plan.provider, plan.layout, residuals=plan.residuals)
    problem = problem_for(costs, tuple(plan.microbatches), plan.buckets)
    scheduler = online_scheduler(config.solver, config.seed)
    return expected_step_time(batches, costs, problem, scheduler, kind).mean


def measure_drift(
    step: int,
    batches: Sequence[Sequence[SampleShape]],
    running: ResolvedPlan,
    arch,
    device,
    config: PlannerConfig,
    kind: str = "1f1b",
) -> Drift:
    """The running plan against the planner's best for `batches` (see the module docstring).

    config: the run's planner settings (`planner.resolve.training_planner`); its global batch is
    the run's.
    """
    batches = [list(b) for b in batches]
    running_s = score_on(batches, running, config, kind)
    shapes = [s for b in batches for s in b]
    try:
        plan = make_plan(arch, device, running.layout.num_devices, shapes, config,
                         running.provider)  # fmt: skip
    except PlanningError as e:
        return Drift(step, len(batches), running_s, math.inf, None, str(e).splitlines()[0])
    planned_s = score_on(batches, ResolvedPlan.of(plan, running.provider), config, kind)
    return Drift(step, len(batches), running_s, planned_s, plan)


class DriftMonitor:
    """Keeps the shapes of the last `window` global batches; `measure(step)` starts a measurement on
    a daemon thread (one at a time: a request while one runs is skipped and logged, or waits), `poll()` returns
    the finished ones without waiting; `join()` waits.

    Args:
      measure: (step, batches) -> Drift, e.g. `measure_drift` with the run's plan bound.
      wait: a due measurement waits for the running one instead of being skipped (every process
        of a run that acts on the measurements must hold the same ones).
    """

    def __init__(self, measure, window: int, wait: bool = False):
        self._measure, self.window, self.wait = measure, window, wait
        self._recent: deque[list[SampleShape]] = deque(maxlen=window)
        self._done: list[Drift] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, shapes: Sequence[SampleShape]) -> None:
        """Notes one global batch's sample shapes (in step order)."""
        self._recent.append(list(shapes))

    def measure(self, step: int) -> bool:
        """Starts measuring the recent batches after `step`; False when one is still running."""
        if self.wait:
            self.join()
        if self._thread is not None and self._thread.is_alive():
            log.warning("drift: the measurement before step %d still runs; step %d skipped",
                        step, step)  # fmt: skip
            return False
        batches = list(self._recent)

        def run():
            try:
                drift = self._measure(step, batches)
            except Exception as e:  # noqa: BLE001 -- a measurement never stops the run
                log.warning("drift: measurement after step %d failed: %s", step, e)
                return
            with self._lock:
                self._done.append(drift)

        self._thread = threading.Thread(target=run, name=f"dflop-drift{step}", daemon=True)
        self._thread.start()
        return True

    def poll(self) -> list[Drift]:
        """The measurements finished since the last poll, oldest first."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def join(self) -> None:
        """Waits for a running measurement (its result stays for `poll`): the run's last step."""
        if self._thread is not None:
            self._thread.join()
