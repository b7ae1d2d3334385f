"""SchedulerConfig: how the online scheduler solves and whether it corrects its cost predictions."""

from __future__ import annotations

import dataclasses
from typing import Literal

from dflop_jax.config import require, require_seed


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler settings (DESIGN section 4).

    Attributes:
      solver: "greedy" (milliseconds), "cpsat" / "auto" (greedy, then a large-neighbourhood search that
        re-packs a few microbatches at a time exactly with CP-SAT, `lns.py`; any solver problem falls
        back to greedy), or "data_blind": the data-blind baseline (`baselines.data_blind_schedule`:
        loader-order microbatches at the largest buckets, the smallest allowed count), to measure what
        DFLOP's schedule buys on the same layout (`python -m dflop_jax.bench train`).
      time_limit_s: wall-clock backstop of one `schedule_batch` call. It never changes a refined answer:
        when it fires during the refinement, the deterministic greedy answer is returned and the report
        says so (`info["wall_clock_cutoff"]`). Not used in multi-process runs (every process must
        reach the same answer whatever its load: `Scheduler(backstop=False)`).
      refine_rounds: most neighbourhoods re-packed per batch (deterministic budget).
      refine_deterministic_time: most CP-SAT deterministic seconds per batch, all rounds together.
      round_deterministic_time: CP-SAT deterministic seconds per round.
      neighbourhood: microbatches re-packed together per round (fewer when the model would pass
        `max_cpsat_vars`).
      max_cpsat_vars: most assignment variables (samples x bins) of one round's CP-SAT model.
      order_evaluations: most 1F1B simulations spent choosing the microbatch order (`order.py`).
      select: how candidates (microbatch counts, packings, the refinement's answer) are chosen when
        the pipeline has more than one stage: "makespan" (the simulated 1F1B makespan of a good
        order, `select.py`) or "surrogate" (the static-bucket surrogate alone, the rule before).
      select_evaluations: 1F1B simulations per candidate in the first round of the makespan rule
        (`select.py`; the best few then get `order_evaluations`).
      correction: "off", "on", or "auto" (on once the raw prediction MAPE exceeds `correction_threshold`
        after `correction_min_observations` observed microbatches).
      correction_rate: EMA rate of the per (stage, bucket pair) correction factors.
      correction_threshold: MAPE above which "auto" switches correction on.
      correction_min_observations: microbatch observations before "auto" decides.
      seed: the seed of the refinement (neighbourhood draws, CP-SAT's random seed). The stateful
        `Scheduler` solves batch k with `seed + k`; the greedy has no randomness.
    """

    solver: Literal["greedy", "cpsat", "auto", "data_blind"] = "auto"
    time_limit_s: float = 1.0
    refine_rounds: int = 6
    refine_deterministic_time: float = 0.12
    round_deterministic_time: float = 0.02
    neighbourhood: int = 2
    max_cpsat_vars: int = 4000
    order_evaluations: int = 200
    select: Literal["makespan", "surrogate"] = "makespan"
    select_evaluations: int = 12
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
        require(
            self.refine_rounds >= 0, "scheduler.refine_rounds", self.refine_rounds, "must be >= 0"
        )
        require(
            self.neighbourhood >= 2, "scheduler.neighbourhood", self.neighbourhood, "must be >= 2"
        )
        require(
            self.order_evaluations >= 1,
            "scheduler.order_evaluations",
            self.order_evaluations,
            "must be >= 1",
        )
        require(
            self.select in ("makespan", "surrogate"),
            "scheduler.select",
            self.select,
            "use makespan or surrogate",
        )
        require(
            self.select_evaluations >= 1,
            "scheduler.select_evaluations",
            self.select_evaluations,
            "must be >= 1",
        )
        for key, value in (
            ("refine_deterministic_time", self.refine_deterministic_time),
            ("round_deterministic_time", self.round_deterministic_time),
        ):
            require(
                value > 0, f"scheduler.{key}", value, "must be > 0 (CP-SAT deterministic seconds)"
            )
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
