"""SchedulerConfig: how the online scheduler solves and whether it corrects its cost predictions."""

from __future__ import annotations

import dataclasses
from typing import Literal

from dflop_jax.config import require, require_seed


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler settings (DESIGN section 4).

    Attributes:
      solver: "greedy" (milliseconds), "cpsat" / "auto" (greedy, then CP-SAT refinement seeded with the
        greedy answer as hint and cap, within `time_limit_s`; any solver problem falls back to greedy),
        or "data_blind": the data-blind baseline (`baselines.data_blind_schedule`: loader-order
        microbatches at the largest buckets, the smallest allowed count), to measure what DFLOP's
        schedule buys on the same layout (`python -m dflop_jax.bench train`).
      time_limit_s: wall-clock budget of one `schedule_batch` call: the greedy always runs (milliseconds
        to ~1 s at N=1024), CP-SAT (model building included) gets what is left of it.
      num_workers: CP-SAT worker threads.
      deterministic: CP-SAT runs interleaved (deterministic) search stopped by a deterministic-time
        limit (half of `time_limit_s`). What is deterministic for a seed: the greedy and the lower bound
        always; "cpsat"/"auto" answers as long as no wall-clock guard fires — the guards are the time
        left after the greedy, the model-building deadline and CP-SAT's wall limit, and
        `info["fallback"]` / `info["cpsat_wall_limited"]` say when one did (on a heavily loaded machine
        the same batch can then come back with the greedy answer instead of a refined one).
      max_cpsat_vars: above this many assignment variables (samples x bins) CP-SAT is skipped (the model
        would not even be built within a step); the report says so.
      correction: "off", "on", or "auto" (on once the raw prediction MAPE exceeds `correction_threshold`
        after `correction_min_observations` observed microbatches).
      correction_rate: EMA rate of the per (stage, bucket pair) correction factors.
      correction_threshold: MAPE above which "auto" switches correction on.
      correction_min_observations: microbatch observations before "auto" decides.
      seed: default seed (CP-SAT random seed, greedy tie-breaks).
    """

    solver: Literal["greedy", "cpsat", "auto", "data_blind"] = "auto"
    time_limit_s: float = 1.0
    num_workers: int = 2
    deterministic: bool = True
    max_cpsat_vars: int = 40000
    correction: Literal["off", "on", "auto"] = "auto"
    correction_rate: float = 0.2
    correction_threshold: float = 0.1
    correction_min_observations: int = 8
    seed: int = 0

    def __post_init__(self):
        require(
            self.solver in ("greedy", "cpsat", "auto", "data_blind"),
            "scheduler.solver",
            self.solver,
            "use greedy, cpsat, auto or data_blind",
        )
        require(
            self.time_limit_s > 0,
            "scheduler.time_limit_s",
            self.time_limit_s,
            "must be > 0 seconds",
        )
        require(self.num_workers >= 1, "scheduler.num_workers", self.num_workers, "must be >= 1")
        require(
            self.max_cpsat_vars >= 1,
            "scheduler.max_cpsat_vars",
            self.max_cpsat_vars,
            "must be >= 1",
        )
        require_seed(self.seed, "scheduler.seed")
        require(
            self.correction in ("off", "on", "auto"),
            "scheduler.correction",
            self.correction,
            "use off, on or auto",
        )
        require(
            0 < self.correction_rate <= 1,
            "scheduler.correction_rate",
            self.correction_rate,
            "must be in (0, 1]",
        )
        require(
            self.correction_threshold >= 0,
            "scheduler.correction_threshold",
            self.correction_threshold,
            "must be >= 0 (a relative error, e.g. 0.1)",
        )
        require(
            self.correction_min_observations >= 1,
            "scheduler.correction_min_observations",
            self.correction_min_observations,
            "must be >= 1",
        )
