"""Adaptive cost correction and the stateful per-step `Scheduler` the data loader uses.

Correction: one multiplicative factor per (tile bucket, length bucket, stage, fwd/bwd), learned as an
EMA of measured / raw-predicted seconds over observed microbatches (the first observation of an entry
sets it directly). A bucket pair never observed uses, per stage and direction, the count-weighted mean
factor of the observed pairs (a stage that runs 20% slow everywhere is corrected everywhere), else 1.

When it is on ("auto" rule): correction changes decisions only through W = max_s (fwd + bwd), and a
bucket step of the default sets is ~19-41% in cost, so errors of a few percent never flip a choice
while learned factors would chase measurement noise. "auto" therefore switches correction on once at
least `correction_min_observations` microbatches were observed AND the raw predictions' mean absolute
percentage error over the recent window (last 64 microbatches) exceeds `correction_threshold`
(default 10%); it switches off again if that error falls back below half the threshold.
`prediction_error()` reports the raw and the corrected MAPE, both measured out of sample (the corrected
prediction is taken before the observation updates the factors).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

from dflop_jax.contracts import SampleShape, Schedule, ScheduleProblem
from dflop_jax.scheduler.config import SchedulerConfig
from dflop_jax.scheduler.objective import CostTable
from dflop_jax.scheduler.solve import schedule_batch

_WINDOW = 64


class CostCorrection:
    """Per (ti, si, stage, direction) factors over a problem's bucket grid."""

    def __init__(self, problem: ScheduleProblem, rate: float):
        self.tiles = tuple(problem.buckets.tiles)
        self.lengths = tuple(problem.buckets.lengths)
        self.rate = rate
        self.factors = np.ones((len(self.tiles), len(self.lengths), problem.num_stages, 2))
        self.counts = np.zeros((len(self.tiles), len(self.lengths)), dtype=np.int64)

    def factor(self, ti: int, si: int) -> np.ndarray:
        """[P, 2] factors for a bucket pair (fallback: count-weighted mean of observed pairs)."""
        if self.counts[ti, si] > 0:
            return self.factors[ti, si]
        total = self.counts.sum()
        if total == 0:
            return np.ones(self.factors.shape[2:])
        return np.einsum("ts,tspd->pd", self.counts, self.factors) / total

    def update(self, ti: int, si: int, measured: np.ndarray, raw: np.ndarray) -> None:
        ratio = np.where(raw > 0, measured / np.where(raw > 0, raw, 1.0), 1.0)
        if self.counts[ti, si] == 0:
            self.factors[ti, si] = ratio
        else:
            self.factors[ti, si] += self.rate * (ratio - self.factors[ti, si])
        self.counts[ti, si] += 1

    def wrap(self, raw_fn):
        """A StageCostFn applying the factors to `raw_fn`."""
        ti_of = {t: i for i, t in enumerate(self.tiles)}
        si_of = {s: i for i, s in enumerate(self.lengths)}
        return lambda t, s, *audio: (
            np.asarray(raw_fn(t, s, *audio)) * self.factor(ti_of[int(t)], si_of[int(s)])
        )


def _mape(pred: np.ndarray, measured: np.ndarray) -> float:
    ok = measured > 0
    return float(np.mean(np.abs(pred[ok] - measured[ok]) / measured[ok])) if ok.any() else 0.0


class Scheduler:
    """Schedules every global batch of a run; learns cost corrections from measured stage times.

    `backstop=False` turns the solver's wall-clock cut-off off (`schedule_batch`): every schedule is
    then a function of (shapes, index, observations) alone, as processes of one run need.
    """

    def __init__(self, problem: ScheduleProblem, config: SchedulerConfig, backstop: bool = True):
        self.problem, self.config, self.backstop = problem, config, backstop
        self.correction = CostCorrection(problem, config.correction_rate)
        self.active = config.correction == "on"
        self.steps = 0
        self.observations = 0
        self.raw_err: collections.deque = collections.deque(maxlen=_WINDOW)
        self.corr_err: collections.deque = collections.deque(maxlen=_WINDOW)
        self._raw_table = CostTable.build(problem)
        self._table: CostTable | None = None  # corrected table, rebuilt after observations

    def current_problem(self) -> ScheduleProblem:
        """The problem with corrected stage costs when correction is active."""
        if not self.active:
            return self.problem
        fn = self.correction.wrap(self.problem.stage_costs)
        return dataclasses.replace(self.problem, stage_costs=fn)

    def schedule(self, shapes: Sequence[SampleShape], index: int | None = None) -> Schedule:
        """Schedules global batch `index` (a `ScheduleFn`) with seed `config.seed + index`, so a batch's
        schedule depends neither on prefetching nor on a resume. None = the next batch (`steps`)."""
        if index is not None:
            self.steps = index
        problem = self.current_problem()
        if not self.active:
            table = self._raw_table
        else:
            if self._table is None:
                self._table = CostTable.build(problem)
            table = self._table
        config = dataclasses.replace(self.config, seed=self.config.seed + self.steps)
        out = schedule_batch(shapes, problem, config, table=table, backstop=self.backstop)
        self.steps += 1
        out.info["correction_active"] = self.active
        return out

    def observe(self, schedule: Schedule, measured: np.ndarray) -> None:
        """Feeds measured per-microbatch stage times `measured` [M, P, 2] (fwd, bwd seconds)."""
        measured = np.asarray(measured, dtype=np.float64)
        m, p = len(schedule.microbatches), self.problem.num_stages
        if measured.shape != (m, p, 2):
            raise ValueError(
                f"measured shape {measured.shape}: expected ({m}, {p}, 2) for this schedule"
            )
        tix = {t: i for i, t in enumerate(self.correction.tiles)}
        six = {s: i for i, s in enumerate(self.correction.lengths)}
        for mb, meas in zip(schedule.microbatches, measured):
            ti, si = tix[mb.tile_bucket], six[mb.length_bucket]
            raw = self._raw_table.stage[ti, si]
            self.raw_err.append(_mape(raw, meas))
            self.corr_err.append(_mape(raw * self.correction.factor(ti, si), meas))
            if self.config.correction != "off":  # "off" still reports the raw error
                self.correction.update(ti, si, meas, raw)
            self.observations += 1
        self._table = None
        self._update_active()

    def _update_active(self) -> None:
        if self.config.correction != "auto":
            return
        if self.observations < self.config.correction_min_observations:
            return
        err = float(np.mean(self.raw_err))
        if err > self.config.correction_threshold:
            self.active = True
        elif err < 0.5 * self.config.correction_threshold:
            self.active = False

    def prediction_error(self) -> dict:
        """Recent-window MAPE of raw and corrected predictions, observation count, whether active."""
        return {
            "raw_mape": float(np.mean(self.raw_err)) if self.raw_err else None,
            "corrected_mape": float(np.mean(self.corr_err)) if self.corr_err else None,
            "observations": self.observations,
            "active": self.active,
        }

    def state_dict(self) -> dict:
        """JSON-able state for checkpoints."""
        return {
            "version": 1,
            "tiles": list(self.correction.tiles),
            "lengths": list(self.correction.lengths),
            "factors": self.correction.factors.tolist(),
            "counts": self.correction.counts.tolist(),
            "active": self.active,
            "steps": self.steps,
            "observations": self.observations,
            "raw_err": list(self.raw_err),
            "corr_err": list(self.corr_err),
        }

    def load_state_dict(self, d: dict) -> None:
        """Restores `state_dict()` output; the bucket sets must match."""
        if (tuple(d["tiles"]), tuple(d["lengths"])) != (
            self.correction.tiles,
            self.correction.lengths,
        ):
            raise ValueError(
                f"scheduler state buckets {d['tiles']}/{d['lengths']} differ from the problem's "
                f"{list(self.correction.tiles)}/{list(self.correction.lengths)}"
            )
        factors = np.asarray(d["factors"], dtype=np.float64)
        if factors.shape != self.correction.factors.shape:
            raise ValueError(
                f"scheduler state factors shape {factors.shape} != {self.correction.factors.shape}"
            )
        self.correction.factors = factors
        self.correction.counts = np.asarray(d["counts"], dtype=np.int64)
        self.active = bool(d["active"])
        self.steps = int(d["steps"])
        self.observations = int(d["observations"])
        self.raw_err = collections.deque(d["raw_err"], maxlen=_WINDOW)
        self.corr_err = collections.deque(d["corr_err"], maxlen=_WINDOW)
        self._table = None
