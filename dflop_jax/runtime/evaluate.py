"""Evaluation: the held-out loss of the current parameters, forward waves through the pipeline.

    evaluator = Evaluator(records, data_cfg, problem, scheduler_cfg, global_batch=16, batches=4)
    totals = evaluator.dispatch(stages)           # float32[2] on the last stage: (loss sum, tokens)
    loss_sum, tokens = host_scalars([totals], "eval")   # read once, with the step's numbers

Per evaluation a fresh loader (`make_loader`, one pass) packs the held-out records in a fixed order
into scheduled global batches with the run's buckets, and every microbatch runs the forward programs
of the inner stages and the last stage's `eval_loss` (forward + loss, no gradient; `programs/stage_jits.py`),
which adds its loss sum and loss tokens into one device vector: no host read per microbatch, and the
eval loss is (sum of losses) / (sum of loss tokens) over the whole held-out set.

Same batches at every evaluation: the eval loader's schedule function solves each eval batch once,
with a scheduler of its own (same problem and solver settings as training, no corrections, no
wall-clock cut-off) and keeps the schedule. So evaluations compile nothing after the first, their
numbers compare across steps, and they depend only on the config: they neither feed the training
scheduler's corrections nor draw from the training loader (exact resume holds), and every process
schedules them alike.

Multi-process runs: like the training driver, every process walks the same microbatches and stages,
dispatches only its local stages (`StageProgram.local`), traces the shapes of the others, and calls
every transfer in the same order; the totals are read on every process with `host_scalars`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dflop_jax.contracts import SampleShape, Schedule, ScheduleProblem
from dflop_jax.data import HostShardSpec, make_loader
from dflop_jax.data.sample_arrays import PackedMicrobatch
from dflop_jax.programs.stage_program import StageProgram
from dflop_jax.programs.transfer import put_host, transfer
from dflop_jax.runtime.driver import (
    deliver,
    microbatch_fields,
    part_of,
    placed_batch,
    stage_tree,
)
from dflop_jax.scheduler import Scheduler
from dflop_jax.scheduler.config import SchedulerConfig


def forward_losses(
    stages: Sequence[StageProgram],
    microbatches: Iterable[PackedMicrobatch | dict[str, np.ndarray]],
    totals: jax.Array,
    placed: Sequence[Sequence[dict | None]] | None = None,
) -> jax.Array:
    """`totals` + (loss sum, loss tokens) of `microbatches` through the pipeline, forward only.

    Args:
      stages: the stage programs in pipeline order (the last one computes the loss).
      microbatches: packed microbatches (or their arrays by field name), global shapes; in a
        multi-process run only this process's shards need to be filled in.
      totals: float32[2] replicated on the last stage's mesh (`zero_totals`); donated.
      placed: per microbatch, the local stages' side inputs already on their devices
        (`driver.place_sides`, run by the eval loader's prefetch thread); None: placed here.
    """
    last, children = stages[-1], stage_tree(stages)
    for i, mb in enumerate(microbatches):
        fields = microbatch_fields(mb)
        inputs: dict[int, object] = {}  # a stage's x (a joining stage's by part)
        for s, stage in enumerate(stages):
            if not stage.local:
                side = stage.side_structs(fields)
            else:
                side = placed[i][s] if placed is not None else stage.put_side(fields)
            x = inputs.pop(s, None)
            if stage is last:
                totals = stage.eval_loss(x, side, totals) if stage.local else totals
                continue
            y = stage.forward(x, side) if stage.local else stage.output_struct(x, side)
            c = children[s]
            part = part_of(s, c, stages, children)
            to = stages[c].x_struct(y, part)
            deliver(inputs, c, part, transfer(y, to.sharding, to.shape))
    return totals


def zero_totals(last: StageProgram) -> jax.Array:
    """(0, 0) replicated on the last stage's mesh (no shards where this process holds none)."""
    return put_host(np.zeros(2, np.float32), NamedSharding(last.mesh, P()))


class FixedSchedules:
    """The eval loader's schedule function: eval batch k is solved once and kept (module docstring).

    Its scheduler is private to evaluation (the loader's thread is the only caller) and runs without
    corrections and without the solver's wall-clock cut-off, so the schedules are a function of the
    held-out records and the config alone.
    """

    def __init__(self, problem: ScheduleProblem, config: SchedulerConfig):
        config = dataclasses.replace(config, correction="off")
        self.scheduler = Scheduler(problem, config, backstop=False)
        self.solved: dict[int, Schedule] = {}

    def __call__(self, shapes: Sequence[SampleShape], index: int) -> Schedule:
        if index not in self.solved:
            self.solved[index] = self.scheduler.schedule(shapes, index)
        return self.solved[index]


class Evaluator:
    """Evaluates a held-out record set with the run's stages (module docstring).

    Args:
      records: the held-out records (never part of the training loader's).
      data_cfg: the run's `DataConfig` (processing; the records are given).
      problem: the run's scheduling problem (its buckets and dp degrees).
      scheduler_cfg: the run's scheduler settings (solver, seed).
      global_batch: records per eval global batch (the training run's).
      batches: eval global batches per evaluation; 0 = every full batch of `records`.
      seed: the order the records are batched in (the same at every evaluation).
      host: this process's shards (`HostShardSpec`; None = all).
      prefetch: eval batches the loader prepares ahead.
      vision: the model has a vision encoder (else records with images are counted skips).
    """

    def __init__(
        self,
        records: Sequence[Any],
        data_cfg: Any,
        problem: ScheduleProblem,
        scheduler_cfg: SchedulerConfig,
        *,
        global_batch: int,
        batches: int = 0,
        seed: int = 0,
        host: HostShardSpec | None = None,
        prefetch: int = 1,
        vision: bool = True,
    ):
        self.records, self.data_cfg, self.problem = list(records), data_cfg, problem
        self.vision = vision
        self.schedule_fn = FixedSchedules(problem, scheduler_cfg)
        self.global_batch, self.seed, self.host, self.prefetch = global_batch, seed, host, prefetch
        self.num_batches = batches or None

    def batches(self, stages: Sequence[StageProgram] | None = None):
        """The eval global batches, packed afresh (one pass of the held-out records; the same
        batches, in the same order, every time); with `stages`, each batch's side inputs are placed
        on their devices by the loader's prefetch thread (`GlobalBatch.placed`)."""
        loader = make_loader(
            self.data_cfg, self.records, self.problem, self.schedule_fn,
            global_batch_size=self.global_batch, seed=self.seed, host=self.host,
            prefetch=self.prefetch, num_epochs=1, num_batches=self.num_batches,
            place=None if stages is None else functools.partial(placed_batch, stages),
            vision=self.vision,
        )  # fmt: skip
        with loader:
            yield from loader

    def dispatch(self, stages: Sequence[StageProgram]) -> jax.Array:
        """Issues one evaluation of the stages' current params (nothing is read back): the
        float32[2] (loss sum, loss tokens) on the last stage's mesh."""
        totals = zero_totals(stages[-1])
        for batch in self.batches(stages):
            totals = forward_losses(stages, batch.microbatches, totals, batch.placed)
        return totals


def eval_loss(totals: np.ndarray) -> float:
    """The eval loss of read totals: loss sum / loss tokens (NaN when no token was evaluated)."""
    loss_sum, tokens = (float(v) for v in totals)
    return loss_sum / tokens if tokens else float("nan")
