"""Every program a run dispatches, compiled before step 1, once per shape it receives.

    counter = CompileCounter()               # XLA executables built in this process (all threads)
    batches = bucket_microbatches(problem, data_cfg)    # one per allowed (tile, length) pair
    report = precompile(stages, batches, progress, evaluation=True, optimizers=opts, tied=tied)

A shape first met at step k would otherwise compile at step k, on the one dispatch thread, stalling
every local stage (minutes at real sizes). So the trainer walks one all-padding microbatch per
allowed (tile bucket, length bucket) pair of the plan (`BucketSet.allowed`: the whole grid, or the
sparse set the planner chose) through the pipeline from abstract inputs, as the driver walks a real
one. Each local stage lowers the programs that microbatch runs and it has not lowered yet
(`StageProgram.lower` skips a signature it has seen): so an encoder stage compiles once per tile
bucket, an LLM stage past the first once per length bucket, and only a stage that sees both (the
colocated stage, the first LLM stage taking the encoder's features) once per pair. Each
stage-to-stage transfer (activations forward, cotangents back) is lowered once per shape. The
per-step programs join them: each optimizer's (`StageOptimizer.lower`: accumulator, reduction,
norm, update), the update's glue (`train_state.lower_update`: norm and statistics transfers, the
tied-gradient sums, the loss sum, the statistics vector), the host reads' (`distributed.lower_reads`,
multi-process runs) and the checkpoint's (`StageOptimizer.lower_save`). Lowering runs on the
calling thread (tracing holds the GIL); compiling runs in a thread pool (XLA compiles outside it).
A compiled program lands in JAX's in-memory caches, so the step's own call of the same jit on
arrays of the same shapes and shardings finds it, and in the persistent compilation cache when the
run enables one (`compilation_cache`), where a second run of the same plan finds it. JAX writes that
cache from process 0 only; on the other processes of a multi-process run the programs whose owners
take a compiled program (`Lowering.keep`: the stages', the transfers', the optimizers', each
stage's parameter initialization) go through an `ExecutableStore` in the same folder instead
(`programs/executable_store.py`), and their owners call the compiled programs it gives them.

Counting: `CompileCounter` listens to JAX's backend-compile event (`jax.monitoring`), which fires once
per executable JAX builds, whether XLA compiles it or loads it from the persistent cache (those
loads are counted apart, `cache_hits`, with the programs an `ExecutableStore` loads: its own
event, `STORE_LOAD_EVENT`); a jit whose
cache already holds the executable fires nothing. The run's one count of programs is the executables it built: the precompile line, each
step's `recompiles` (0 when everything was compiled ahead) and the summary's `programs` all read it.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import jax
import numpy as np

from dflop_jax.contracts import ScheduledMicrobatch, ScheduleProblem
from dflop_jax.data.loader import pack_geometry, pack_taps
from dflop_jax.data.packing import pack_microbatch
from dflop_jax.programs.executable_store import (
    JAX_CACHE_HIT_EVENT,
    STORE_LOAD_EVENT,
    ExecutableStore,
)
from dflop_jax.programs.lowering import Lowering
from dflop_jax.programs.stage_program import StageProgram
from dflop_jax.programs.transfer import lower_transfer
from dflop_jax.runtime.driver import boundary_structs, stage_tree

# jax.monitoring's event for building one executable (the backend compile's duration event); the
# one for finding it in the persistent compilation cache instead is the store's JAX_CACHE_HIT_EVENT.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
ProgressFn = Callable[[str, int, int], None]


class CompileCounter:
    """Executables JAX has built in this process since the first counter was made (all threads),
    and how many of them came from the persistent compilation cache."""

    _lock = threading.Lock()
    _count = 0
    _hits = 0
    _listening = False

    def __init__(self):
        with CompileCounter._lock:
            if not CompileCounter._listening:  # listeners cannot be removed: register one, once
                jax.monitoring.register_event_duration_secs_listener(_on_duration)
                jax.monitoring.register_event_listener(_on_event)
                CompileCounter._listening = True

    @property
    def count(self) -> int:
        return CompileCounter._count

    @property
    def cache_hits(self) -> int:
        return CompileCounter._hits


def _on_duration(event: str, duration_s: float, **_) -> None:
    if event == BACKEND_COMPILE_EVENT:
        with CompileCounter._lock:
            CompileCounter._count += 1


def _on_event(event: str, **_) -> None:
    if event == JAX_CACHE_HIT_EVENT:
        with CompileCounter._lock:
            CompileCounter._hits += 1
    elif event == STORE_LOAD_EVENT:  # no jax event fires for it: built here, found in a cache
        with CompileCounter._lock:
            CompileCounter._count += 1
            CompileCounter._hits += 1


@dataclasses.dataclass(frozen=True)
class PrecompileReport:
    """What `precompile` did.

    Attributes:
      stage_programs: the stage and transfer programs of the bucket pairs (distinct signatures:
        what `costs.compile.program_counts` predicts as `bucket_programs`).
      step_programs: the per-step programs (`extra`).
      pairs: the bucket pairs walked.
      lower_s: seconds lowering the stage and transfer programs (this thread).
      wall_s: seconds until the last compile ended.
      compile_s: per program kind ("fwd", "bwd_res", "last", "transfer", "step", ...), the seconds
        its compiles took, summed over the pool's threads.
    """

    stage_programs: int
    step_programs: int
    pairs: int
    lower_s: float
    wall_s: float
    compile_s: dict[str, float]

    @property
    def programs(self) -> int:
        return self.stage_programs + self.step_programs


def bucket_microbatches(problem: ScheduleProblem, data_cfg) -> list[dict[str, np.ndarray]]:
    """One all-padding microbatch per allowed (tile bucket, length bucket) pair of the plan
    (`BucketSet.allowed`), packed as the run's loader packs (same geometry, feature taps,
    colocation): the shapes every step may run. With audio buckets, one per pair and audio
    bucket, none included (a microbatch without audio) unless every microbatch has audio
    (`ScheduleProblem.audio_always`): only the stages running or taking the audio encoder see the
    audio bucket, so the others compile nothing more for them."""
    tile_shape, tokens_per_tile = pack_geometry(data_cfg)
    out = []
    audio = problem.buckets.audio if problem.audio_always else (0, *problem.buckets.audio)
    for (t, s), a in itertools.product(problem.buckets.allowed(), audio or (0,)):
        plan = ScheduledMicrobatch(
            t,
            s,
            ((),) * problem.llm_dp,
            tiles_by_row=problem.tiles_by_row,
            row_align=problem.row_align,
            audio_bucket=a,
        )
        mb, _ = pack_microbatch(plan, [], [], encoder_dp=problem.encoder_dp,
                                llm_dp=problem.llm_dp, tile_shape=tile_shape,
                                tokens_per_tile=tokens_per_tile,
                                feature_taps=pack_taps(data_cfg),
                                audio_mels=data_cfg.audio_mels)  # fmt: skip
        out.append({f.name: getattr(mb, f.name) for f in dataclasses.fields(mb)})
    return out


def pipeline_lowerings(
    stages: Sequence[StageProgram],
    batch: dict[str, np.ndarray],
    evaluation: bool = False,
    seen: set | None = None,
    children: Sequence[int] | None = None,
) -> list[Lowering]:
    """The programs one microbatch shaped like `batch` runs on this process's devices that are not
    lowered yet, lowered: each local stage's (`StageProgram.lower`) and each transfer's, both
    directions (driver order); `seen` collects the transfers lowered so far (one per shape).
    `children`: the stages' tree (`Layout.children`; None: the stages' own, `stage_tree`)."""
    seen = set() if seen is None else seen
    out: list[Lowering] = []

    def lower(s, x, side):
        if stages[s].local:
            out.extend(stages[s].lower(x, side, evaluation))

    for s, y, x in boundary_structs(stages, batch, children, visit=lower):
        out += _transfer(y, x.sharding, x.shape, seen)
        child = stages[(stage_tree(stages) if children is None else children)[s]]
        if child.input_grad:  # dL/dx back to this stage's output
            out += _transfer(x, stages[s].y_sharding, y.shape, seen)
    return out


def _transfer(x, dst, shape, seen: set) -> list[Lowering]:
    key = (x.sharding, tuple(x.shape), str(x.dtype), dst, tuple(shape))
    if key in seen:
        return []
    seen.add(key)
    return lower_transfer(x, dst, shape)


def precompile(
    stages: Sequence[StageProgram],
    microbatches: Sequence[dict[str, np.ndarray]],
    progress: ProgressFn | None = None,
    *,
    evaluation: bool = False,
    extra: Sequence[Lowering | jax.stages.Lowered] = (),
    workers: int | None = None,
    store: ExecutableStore | None = None,
) -> PrecompileReport:
    """Lowers and compiles every program the microbatches' shapes run (module docstring) and the
    `extra` lowered programs (the per-step ones), in a thread pool, reporting
    `progress("compile", done, total)` as programs finish. With `store` (a process JAX's
    persistent cache does not write from: `ExecutableStore.for_this_process`), each program whose
    `Lowering` names its devices (the stages', the transfers', the optimizers'; not a bare
    `Lowered`) is loaded from it or compiled and written to it, and its owner calls it itself
    (`Lowering.keep`)."""
    report = progress or (lambda *_: None)
    t0, seen = time.perf_counter(), set()
    todo: list[Lowering] = []
    for i, batch in enumerate(microbatches):
        todo += pipeline_lowerings(stages, batch, evaluation, seen)
        report("lower", i + 1, len(microbatches))
    lower_s = time.perf_counter() - t0
    todo += [lw if isinstance(lw, Lowering) else Lowering("step", lw) for lw in extra]
    total, done, seconds = len(todo), 0, {}
    workers = workers or max(os.cpu_count() or 1, 1)
    with ThreadPoolExecutor(workers, thread_name_prefix="dflop-compile") as pool:
        running = {pool.submit(_timed, lw, store): lw for lw in todo}
        report("compile", 0, total)
        while running:
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                lw, (compiled, s) = running.pop(future), future.result()
                if store is not None and lw.keep is not None:
                    lw.keep(compiled)
                done += 1
                seconds[lw.kind] = seconds.get(lw.kind, 0.0) + s
                more = lw.then(compiled) if lw.then else []  # lowered here, on this thread
                total += len(more)
                running.update({pool.submit(_timed, m, store): m for m in more})
            report("compile", done, total)
    wall = time.perf_counter() - t0
    return PrecompileReport(
        done - len(extra), len(extra), len(microbatches), lower_s, wall, seconds
    )


def _timed(lw: Lowering, store: ExecutableStore | None) -> tuple[jax.stages.Compiled, float]:
    t0 = time.perf_counter()
    if store is None or lw.devices is None:
        return lw.lowered.compile(), time.perf_counter() - t0
    return store.compile(lw.lowered, lw.devices)[0], time.perf_counter() - t0
