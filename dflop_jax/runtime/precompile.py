"""Every program of the step, for every bucket of the plan, compiled before step 1.

    counter = CompileCounter()               # XLA executables built in this process (all threads)
    batches = bucket_microbatches(problem, data_cfg)    # one per (tile, length) bucket pair
    precompile(stages, batches, console, evaluation=True, optimizers=opts)

A bucket the scheduler first uses at step k would otherwise compile at step k, on the one dispatch
thread, stalling every local stage (minutes at real sizes). So the trainer walks one all-padding
microbatch per (tile bucket, length bucket) pair through the pipeline from abstract inputs, as the
driver walks a real one: each local stage lowers the programs that microbatch runs
(`StageProgram.lower`: forward, backward or backward from residuals, fused last, the loss-token
count, and evaluation's forward and loss when eval is on), and each stage-to-stage transfer
(activations forward, cotangents back) lowers its transport (`transfer.lower_transfer`); the
optimizers' per-step programs join them (`StageOptimizer.lower`: accumulator, reduction, norm,
update; bucket-independent, but at real sizes as slow to compile as the stages'). Lowering runs
on the calling thread (tracing holds the GIL); compiling runs in a thread pool (XLA compiles outside
it) behind a progress bar. A compiled program lands in JAX's in-memory caches, so the step's own call
of the same jit on arrays of the same shapes and shardings finds it, and in the persistent
compilation cache when the run enables one (`compilation_cache`).

Counting: `CompileCounter` listens to JAX's backend-compile event (`jax.monitoring`), which fires once
per executable JAX builds, whether XLA compiles it or loads it from the persistent cache; a jit whose
cache already holds the executable fires nothing. The trainer reports the count per step
(`StepMetrics.recompiles`: 0 after step 1 when everything was compiled ahead).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import jax
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dflop_jax.contracts import MicrobatchPlan, ScheduleProblem
from dflop_jax.data.loader import pack_geometry, pack_taps
from dflop_jax.data.packing import pack_microbatch
from dflop_jax.runtime.stages import Lowering, StageProgram
from dflop_jax.runtime.transfer import lower_transfer

# jax.monitoring's event for building one executable (the backend compile's duration event).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Executables JAX has built in this process since the first counter was made (all threads)."""

    _lock = threading.Lock()
    _count = 0
    _listening = False

    def __init__(self):
        with CompileCounter._lock:
            if not CompileCounter._listening:  # listeners cannot be removed: register one, once
                jax.monitoring.register_event_duration_secs_listener(_on_event)
                CompileCounter._listening = True

    @property
    def count(self) -> int:
        return CompileCounter._count


def _on_event(event: str, duration_s: float, **_) -> None:
    if event == BACKEND_COMPILE_EVENT:
        with CompileCounter._lock:
            CompileCounter._count += 1


def bucket_microbatches(problem: ScheduleProblem, data_cfg) -> list[dict[str, np.ndarray]]:
    """One all-padding microbatch per (tile bucket, length bucket) pair of the plan, packed as the
    run's loader packs (same geometry, feature taps, colocation): the shapes every step may run."""
    tile_shape, tokens_per_tile = pack_geometry(data_cfg)
    out = []
    for t in problem.buckets.tiles:
        for s in problem.buckets.lengths:
            plan = MicrobatchPlan(
                t,
                s,
                ((),) * problem.llm_dp,
                tiles_by_row=problem.tiles_by_row,
                row_align=problem.row_align,
            )
            mb, _ = pack_microbatch(plan, [], [], encoder_dp=problem.encoder_dp,
                                    llm_dp=problem.llm_dp, tile_shape=tile_shape,
                                    tokens_per_tile=tokens_per_tile,
                                    feature_taps=pack_taps(data_cfg))  # fmt: skip
            out.append({f.name: getattr(mb, f.name) for f in dataclasses.fields(mb)})
    return out


def pipeline_lowerings(
    stages: Sequence[StageProgram], batch: dict[str, np.ndarray], evaluation: bool = False
) -> list[Lowering]:
    """The programs one microbatch shaped like `batch` runs on this process's devices, lowered: each
    local stage's (`StageProgram.lower`) and each transfer's, both directions (driver order)."""
    out, x = [], None
    for s, stage in enumerate(stages):
        side = stage.side_structs(batch)
        if stage.local:
            out += stage.lower(x, side, evaluation)
        if stage.is_last:
            break
        y = stage.output_struct(x, side)
        nxt = stages[s + 1]
        x = nxt.x_struct(y)
        out += [Lowering("transfer", lw) for lw in lower_transfer(y, x.sharding, x.shape)]
        if nxt.input_grad:  # dL/dx back to this stage's output
            out += [Lowering("transfer", lw) for lw in lower_transfer(x, stage.y_sharding, y.shape)]
    return out


def precompile(
    stages: Sequence[StageProgram],
    microbatches: Sequence[dict[str, np.ndarray]],
    console: Console | None = None,
    evaluation: bool = False,
    optimizers: Sequence = (),
    workers: int | None = None,
) -> list[jax.stages.Compiled]:
    """Compiles every program the microbatches' shapes run (module docstring) and the per-step
    programs of `optimizers` (`StageOptimizer.lower`), in a thread pool with a progress bar on
    `console`; returns the executables (the jits' caches hold them too)."""
    console = console or Console(quiet=True)
    todo = [lw for batch in microbatches for lw in pipeline_lowerings(stages, batch, evaluation)]
    todo += [Lowering("update", lw) for opt in optimizers for lw in opt.lower()]
    done: list[jax.stages.Compiled] = []
    columns = (TextColumn("compiling"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    workers = workers or max(os.cpu_count() or 1, 1)
    with (
        Progress(*columns, console=console, transient=False) as bar,
        ThreadPoolExecutor(workers, thread_name_prefix="dflop-compile") as pool,
    ):
        task = bar.add_task("compile", total=len(todo))
        running = {pool.submit(lw.lowered.compile): lw for lw in todo}
        while running:
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                lw, compiled = running.pop(future), future.result()
                done.append(compiled)
                more = lw.then(compiled) if lw.then else []  # lowered here, on this thread
                bar.update(task, advance=1, total=bar.tasks[0].total + len(more))
                running.update({pool.submit(m.lowered.compile): m for m in more})
    return done
