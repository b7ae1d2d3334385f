"""The side jobs of a training run, each an object the loop calls at fixed points: held-out
evaluation (`HeldOutEval`: dispatched after a step, read with that step's numbers) and drift
measurement and re-planning (`DriftWatch`: fed each batch's shapes, its measurement put on a read
row, its decision taken at a checkpoint). `Hook` is when the loop calls one: every N steps and the
last."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from dflop_jax.config import ConfigError
from dflop_jax.costs import DeviceSpec, MLLMArch
from dflop_jax.data import load_source
from dflop_jax.planner.drift import Drift, DriftMonitor, measure_drift
from dflop_jax.planner.resolve import ResolvedPlan, training_planner
from dflop_jax.programs.processes import exchange_host
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.runtime.evaluate import Evaluator, eval_loss
from dflop_jax.runtime.metrics import StepMetrics
from dflop_jax.runtime.replan import pick_digest, wants_replan


@dataclasses.dataclass(frozen=True)
class Hook:
    """`fn(trainer, step) -> trainer` called after every `every` steps and the last (0: never)."""

    every: int
    fn: Callable[[Any, int], Any]

    def due(self, step: int, last: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == last)


@dataclasses.dataclass
class _Evaluation:
    """A dispatched evaluation after `step` (its totals: `Evaluator.dispatch`), not read yet."""

    step: int
    totals: jax.Array
    recompiles: int


class HeldOutEval:
    """The run's held-out evaluations: dispatched after a step, read with that step's numbers;
    the last one read goes into the checkpoint's metadata (`last`)."""

    def __init__(self, evaluator: Evaluator):
        self.evaluator = evaluator
        self.pending: list[_Evaluation] = []  # dispatched, not read yet
        self.last: dict | None = None  # {"step", "loss", "tokens"} of the last evaluation read

    @classmethod
    def build(cls, cfg: TrainConfig, problem, host, held_out: list) -> HeldOutEval:
        """The held-out share of data.source and/or eval.source's records, a global batch at least."""
        records = list(held_out)
        if cfg.eval.source:
            records += load_source(dataclasses.replace(cfg.data, source=cfg.eval.source), cfg.seed)
        if len(records) < cfg.global_batch:
            raise ConfigError(
                f"eval.fraction={cfg.eval.fraction}: {len(records)} held-out records (eval.source "
                f"{cfg.eval.source!r} included) < global_batch={cfg.global_batch}; hold out more "
                "(eval.fraction) or give a larger eval.source"
            )
        return cls(Evaluator(
            records, cfg.data, problem, cfg.scheduler, global_batch=cfg.global_batch,
            batches=cfg.eval.batches, seed=cfg.eval.seed, host=host, vision=cfg.model.has_vision,
        ))  # fmt: skip

    def dispatch(self, step: int, stages, counter) -> None:
        """Issues the evaluation of the params after `step` (read later, with `step`'s numbers);
        `counter` counts what it compiled."""
        before = counter.count
        totals = self.evaluator.dispatch(stages)
        self.pending.append(_Evaluation(step, totals, counter.count - before))

    def take(self, through: int) -> list[_Evaluation]:
        """The dispatched evaluations up to step `through`, to read now."""
        due = [e for e in self.pending if e.step <= through]
        self.pending = [e for e in self.pending if e.step > through]
        return due

    def with_eval(self, row: StepMetrics, evaluation: _Evaluation | None, totals) -> StepMetrics:
        """`row` with the evaluation after its step, if there was one (then the latest, saved)."""
        if evaluation is None:
            return row
        loss, tokens = eval_loss(totals), int(totals[1])
        self.last = {"step": row.step, "loss": loss, "tokens": tokens}
        return dataclasses.replace(
            row, eval_loss=loss, eval_tokens=tokens, eval_recompiles=evaluation.recompiles
        )


class DriftWatch:
    """Drift measurements of the running plan (`planner/drift.py`) on the batches the run trains,
    off the dispatch thread, and the re-plan decision they lead to (`runtime/replan.py`)."""

    def __init__(self, cfg: TrainConfig, plan: ResolvedPlan, arch: MLLMArch, device: DeviceSpec):
        self.cfg = cfg
        config = training_planner(cfg.planner, cfg.global_batch, cfg.model.has_vision,
                                  cfg.optimizer.trainable, cfg.steps)  # fmt: skip
        measure = functools.partial(measure_drift, running=plan, arch=arch, device=device,
                                    config=config, kind=cfg.pipeline)  # fmt: skip
        wait = cfg.planner.replan == "on_drift"
        self.monitor = DriftMonitor(measure, cfg.planner.replan_batches, wait=wait)
        self.finished: list[Drift] = []  # measurements finished, not yet in a row
        self.latest: Drift | None = None  # the last one put in a row

    def add(self, step: int, shapes) -> None:
        """Notes the batch of `step`; measures every `planner.replan_every` steps (on the monitor's
        thread, read with a later step); the last step's row waits for its measurement."""
        self.monitor.add(shapes)
        if step % self.cfg.planner.replan_every == 0:
            self.monitor.measure(step)
        if step == self.cfg.steps:
            self.monitor.join()

    def settle(self) -> None:
        """Re-planning runs: waits for the running measurement (every process then holds the same
        ones at a checkpoint)."""
        if self.monitor.wait:
            self.monitor.join()

    def with_drift(self, row: StepMetrics, console) -> StepMetrics:
        """`row` with the latest measurement finished since the last read, if any, of the batches
        through this step or before (a later one waits for its own step's row)."""
        self.finished += self.monitor.poll()
        ready = [d for d in self.finished if d.step <= row.step]
        self.finished = [d for d in self.finished if d.step > row.step]
        for d in ready:
            console.print(d.describe(), highlight=False, soft_wrap=True)
        if not ready:
            return row
        self.latest = ready[-1]
        return dataclasses.replace(
            row, plan_regret=ready[-1].regret, plan_regret_step=ready[-1].step
        )

    def replan_due(self, step: int) -> bool:
        """Whether this run re-plans after `step` (`planner.replan: on_drift`).

        Decided once for the job: process 0's decision, shared with every process through the
        coordinator (`exchange_host`), with the digest of its pick; a process whose own measurement
        picked another plan stops the job in one line rather than train on another layout."""
        planner = self.cfg.planner
        if planner.replan != "on_drift":
            return False
        mine = wants_replan(self.latest, planner.replan_threshold)
        if jax.process_count() == 1:
            return mine
        local = np.array([int(mine), pick_digest(self.latest) if mine else 0], np.int64)
        votes = exchange_host(local, f"step{step}/replan")
        if not votes[0, 0]:
            return False
        if any(tuple(v) != tuple(votes[0]) for v in votes):
            raise RuntimeError(
                f"re-plan after step {step}: process 0 re-plans to pick {votes[0, 1]:#x} but the "
                f"processes decided {votes.tolist()} ([re-plan, pick] per process): their drift "
                "measurements differ (planner.replan=log keeps the plan)"
            )
        return True
