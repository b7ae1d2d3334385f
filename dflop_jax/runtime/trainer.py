"""The training loop: stage meshes -> stage programs -> scheduler + loader -> pipelined steps -> metrics.

    ctx = RunContext.build(cfg)  # dflop_jax.resolve: model config, arch, device, once
    report = train(ctx.cfg, ctx.model_cfg, ctx.arch, ctx.device, resolve_plan(ctx))

(`python -m dflop_jax.train` does exactly this: `dflop_jax.train.run`.) Before step 1 every stage and transfer program of every bucket
pair of the plan is compiled (`runtime/precompile.py`), so no step after the first compiles
(`recompiles` in the metrics counts what did). Per step the trainer takes a scheduled, packed
`GlobalBatch` from the loader (solved and decoded `prefetch` batches ahead, its side inputs put on the
devices in the loader's thread) and issues, without reading anything back: the pipeline (1F1B or GPipe, loss normalized by the batch's loss tokens) and the AdamW update of
every stage after global-norm clipping, with a non-finite step skipped on device
(`train_state.apply_updates`). Step k's numbers (loss, norm, skips) are read after step k + 1 is
dispatched, at log steps only, and each step's `StepMetrics` goes to the console / JSONL /
TensorBoard; checkpoints are saved every `checkpoint.every` steps and the run resumes from the latest
one. The trainer owns the online `Scheduler`, wrapped in a `LaggedSchedule`: the loader calls it with
the batch index, and batch k sees the measured stage times of steps <= k - prefetch (DESIGN 5).
With `eval.every`, the held-out records (`data/split.py`, never in the training loader) are evaluated
after every that many steps (`runtime/evaluate.py`: forward programs only, its own loader and
schedules, so training's batches and corrections are untouched); the loss is read with that step's
numbers and saved in the checkpoint's metadata. Evaluation and the checkpoint (with a re-plan) are
hooks the loop calls on their period; drift measurement is fed each batch (`runtime/run_hooks.py`).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console

from dflop_jax.config import dump_yaml
from dflop_jax.contracts.layout import Layout
from dflop_jax.costs import DeviceSpec, MLLMArch, batch_model_flops, mfu
from dflop_jax.data import HostShardSpec, load_source, make_loader
from dflop_jax.data.loader import TooFewRecords, check_records
from dflop_jax.data.sample_arrays import GlobalBatch
from dflop_jax.data.split import split_records
from dflop_jax.planner.progress import progress_bar
from dflop_jax.planner.resolve import ResolvedPlan
from dflop_jax.programs import watchdog
from dflop_jax.programs.devices import enable_compilation_cache
from dflop_jax.programs.dispatch import ISSUED
from dflop_jax.programs.executable_store import ExecutableStore
from dflop_jax.programs.lowering import KeptProgram
from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.programs.param_paths import tied_groups
from dflop_jax.programs.processes import host_scalars, lower_reads
from dflop_jax.programs.stage_builder import build_stages, has_vision
from dflop_jax.programs.transfer import put_host
from dflop_jax.runtime.checkpoint import Checkpointer
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.runtime.driver import StepOutput, connect, placed_batch, run_pipeline
from dflop_jax.runtime.lagged_schedule import LaggedSchedule, Observation
from dflop_jax.runtime.metrics import (
    MetricsLog,
    StepMetrics,
    dispatch_metrics,
    real_audio_windows,
    real_work,
    stage_modules,
    step_metrics,
)
from dflop_jax.runtime.precompile import (
    CompileCounter,
    PrecompileReport,
    bucket_microbatches,
    precompile,
)
from dflop_jax.runtime.replan import describe, next_plan
from dflop_jax.runtime.resume import carry_corrections, layout_from_dict, same_buckets
from dflop_jax.runtime.run_hooks import DriftWatch, HeldOutEval, Hook
from dflop_jax.runtime.schedule_agreement import check_schedule, shared_stage_times, stage_owners
from dflop_jax.runtime.train_state import STATS, StageOptimizer, apply_updates, lower_update
from dflop_jax.scheduler import Scheduler


@dataclasses.dataclass
class TrainReport:
    """What a run did: per-step losses (this invocation), the summary, where it wrote."""

    losses: list[float]
    summary: dict
    run_dir: Path
    layout: Layout
    first_step: int
    stages: list = dataclasses.field(default_factory=list)  # the StagePrograms (final params)
    optimizers: list = dataclasses.field(default_factory=list)  # their StageOptimizers (state)


def prepare_run_dir(cfg: TrainConfig, model_cfg=None) -> Path:
    """Creates `run_dir` and writes the resolved config (process 0).

    With `model_cfg` (the model the run builds), config.yaml records its kind and sizes in the
    `model` section also where `model.hf_dir` or `model.arch` gives them (`ModelConfig.with_sizes_of`):
    the file says what was trained, and loads back to the same model."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        if model_cfg is not None:
            cfg = dataclasses.replace(cfg, model=cfg.model.with_sizes_of(model_cfg))
        dump_yaml(cfg, run_dir / "config.yaml")
    return run_dir


def train(
    cfg: TrainConfig,
    model_cfg,
    arch: MLLMArch,
    device: DeviceSpec,
    plan: ResolvedPlan,
    console: Console | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> TrainReport:
    """Trains the model of `model_cfg` on `plan`, each stage's params made on its own mesh from
    `cfg.model.source` (init seed or HF directory).

    The run's persistent compilation cache (`compilation_cache`) turns on here, after the plan: a
    model profile (`plan: auto`) times its compiles cold, whatever the cache already holds, since
    the planner prices the run's compilation by them (`costs/compile.py`).

    Args:
      arch: the model's cost-model architecture (MFU).
      device: the run's accelerator spec (peak FLOP/s for MFU; the drift measurements' planner).
      clock: times the sampled stage programs of measured steps (tests pass a deterministic one).
    """
    if cfg.compilation_cache:
        enable_compilation_cache(cfg.compilation_cache)
    console = console or Console(quiet=jax.process_index() != 0)
    trainer = _Trainer(cfg, model_cfg, arch, device, plan, console, clock)
    metrics = MetricsLog(
        cfg.run_dir,
        cfg.log_every,
        cfg.tensorboard and jax.process_index() == 0,
        console,
        jax.process_index(),
        total_steps=cfg.steps,
    )
    start, losses = trainer.restore(), []
    watchdog.resume_from(str(Path(cfg.run_dir).absolute() / "config.yaml"))
    watchdog.progress(start + 1, "compile")
    trainer.precompile()
    ahead, replanned = trainer.programs, 0  # built before step 1; by re-plans' precompiles

    def log(rows: list[StepMetrics]) -> None:
        for row in rows:
            losses.append(row.loss)
            metrics.log(row)

    def checkpoint(trainer: _Trainer, step: int) -> _Trainer:
        """Reads and saves after `step`; a due re-plan goes on from there on its new plan."""
        watchdog.progress(step, "checkpoint")
        if trainer.drift is not None:
            trainer.drift.settle()
        log(trainer.read(through=step))
        trainer.save(step)
        if step == cfg.steps or trainer.drift is None or not trainer.drift.replan_due(step):
            return trainer
        return _replanned(trainer, step, model_cfg)

    # Side jobs on their period: evaluation right after its step is dispatched (read with that
    # step's numbers), the checkpoint (and a re-plan) once the step is read.
    after_dispatch = [Hook(cfg.eval.every, _evaluate)]
    after_read = [Hook(cfg.checkpoint.every, checkpoint)]
    try:
        for step in range(start + 1, cfg.steps + 1):
            watchdog.progress(step)
            trainer.dispatch(step)
            for hook in (h for h in after_dispatch if h.due(step, cfg.steps)):
                trainer = hook.fn(trainer, step)
            # Step k's numbers are read after step k + 1 is dispatched, and only at log steps.
            if step - 1 > start and trainer.read_due(step - 1, first=start + 1):
                log(trainer.read(through=step - 1))
            for hook in (h for h in after_read if h.due(step, cfg.steps)):
                before, programs = trainer, trainer.programs
                trainer = hook.fn(trainer, step)
                replanned += trainer.programs - programs if trainer is not before else 0
        log(trainer.read(through=cfg.steps))
    finally:
        trainer.close()
        metrics.close()
    watchdog.finish()
    summary = _summary(metrics, console, trainer.programs, ahead, replanned)
    return TrainReport(
        losses, summary, Path(cfg.run_dir), trainer.layout, start, trainer.stages, trainer.opts
    )


def _summary(metrics: MetricsLog, console, programs: int, ahead: int, replanned: int) -> dict:
    """The run's summary, printed, with its one count of programs (`runtime/precompile.py`): all,
    those after the precompile (none, unless a shape escaped it) and a re-plan's."""
    summary = metrics.summary()
    if summary:
        summary.update(programs=programs, programs_after_precompile=programs - ahead - replanned,
                       **({"programs_replanned": replanned} if replanned else {}))  # fmt: skip
        console.print(
            "[bold]summary[/bold] " + ", ".join(f"{k}={_fmt(v)}" for k, v in summary.items()),
            highlight=False,
            soft_wrap=True,
        )
    return summary


@dataclasses.dataclass
class _InFlight:
    """A dispatched step whose numbers are not read yet.

    Attributes:
      stats: the `STATS` vector on the last stage's mesh (`apply_updates`).
      start_s, dispatched_s: the clock when its dispatch began (its batch in hand) and ended.
      dispatch: its `dispatch_metrics` (programs issued, the dispatching thread's CPU seconds).
      done: set by a waiting thread to the clock when the step's statistics are ready.
    """

    step: int
    batch: GlobalBatch
    stats: jax.Array
    start_s: float
    dispatched_s: float
    compiles: int
    recompiles: int
    measured: bool
    done: threading.Event
    done_s: list[float]
    dispatch: dict


class _Trainer:
    """The parts of a run that live across steps (stages, optimizers, scheduler, loader, checkpoints)
    and the step itself."""

    def __init__(self, cfg: TrainConfig, model_cfg, arch, device: DeviceSpec, plan: ResolvedPlan,
                 console, clock, counter_start: int | None = None,
                 store: ExecutableStore | None = None):  # fmt: skip
        """`counter_start`: the compile count where the run began (a re-planned trainer continues
        its predecessor's count); None: now. `store`: a re-planned trainer's predecessor's (the
        programs it holds); None: this process's own (`ExecutableStore.for_this_process`)."""
        self.cfg, self.layout, self.arch, self.console = cfg, plan.layout, arch, console
        self.plan, self.device = plan, device
        self.clock = clock
        self.counter = CompileCounter()
        # where JAX's persistent cache does not write (processes other than 0), the programs'
        self.store = store or ExecutableStore.for_this_process(cfg.compilation_cache)
        # the stages' initialization counts as the run's
        self.counter_start = self.counter.count if counter_start is None else counter_start
        self.replanned = counter_start is not None  # built by a re-plan, during the run
        meshes = stage_meshes(plan.layout)
        self.has_encoder = has_vision(model_cfg)  # a vision encoder, on its own stages or colocated
        _print_plan(console, plan, meshes, model_cfg)
        self.problem = plan.problem()
        # Enough data for a global batch, checked before any parameter is made (loading weights).
        records, held_out = _training_records(cfg, self.problem)
        opt = cfg.optimizer
        self.stages = build_stages(
            model_cfg, plan.layout, meshes, cfg.model.source,
            compute_dtype=jnp.dtype(cfg.compute_dtype), trainable=opt.trainable,
            residuals=plan.residuals, store=self.store,
        )  # fmt: skip
        self.opts = [StageOptimizer(s, opt.build(), opt.zero1, self.store) for s in self.stages]
        if jax.process_count() > 1:
            # while the processes are together (see `connect`)
            connect(self.stages, store=self.store)
        # A tied embedding split over the first and last LLM stage: one parameter, two copies.
        self.tied = tied_groups(list(plan.layout.stages), [s.params for s in self.stages])
        # Processes must solve alike whatever their load: no wall-clock cut-off (`schedule_agreement.py`).
        self.scheduler = Scheduler(self.problem, cfg.scheduler, backstop=jax.process_count() == 1)
        self.owners = stage_owners(meshes)
        self.measure_every = cfg.measure_stage_times_every
        # The loader solves and decodes `prefetch` batches ahead; batch b sees the observations of
        # steps <= b - prefetch (deterministic: exact resume, every process alike).
        self.schedule_fn = LaggedSchedule(self.scheduler, cfg.prefetch)
        host = _host_shards(plan.layout, meshes, self.has_encoder)
        self.loader = make_loader(
            cfg.data, records, self.problem, self.schedule_fn,
            seed=cfg.seed, global_batch_size=cfg.global_batch, prefetch=cfg.prefetch,
            host=host, num_batches=cfg.steps, place=self._place, vision=self.has_encoder,
        )  # fmt: skip
        self.eval = HeldOutEval.build(cfg, self.problem, host, held_out) if cfg.eval.every else None
        self.restored_eval: dict | None = None
        self.ckpt = _checkpointer(cfg)
        self.peak_flops = device.peak_flops  # the preset's: nothing is timed
        # jitted (and compiled ahead, or given by the store) so reading a step's rate compiles nothing
        self.lr = KeptProgram(jax.jit(cfg.optimizer.schedule()), jax.local_devices()[:1])
        self.stats: jax.Array | None = None  # the last dispatched step's STATS (its skip counter)
        self.in_flight: list[_InFlight] = []
        self.observed = 0  # observations the last read batch was scheduled with
        self.skipped_steps = 0  # updates skipped on device (non-finite), as of the last read
        self.last_done_s: float | None = None
        self.drift = DriftWatch(cfg, plan, arch, device) if cfg.planner.replan_every else None

    def precompile(self) -> None:
        """Compiles every program the run dispatches before step 1, each once per shape it
        receives (`runtime/precompile.py`): the stages' and transfers' of every allowed bucket
        pair of the plan (evaluation's when it is on) and the per-step ones (optimizers, the
        update's glue, the host reads, the checkpoint's); one line says how many programs the run
        has built so far (`programs`), the count every later figure continues."""
        hits, t0 = self.counter.cache_hits, time.perf_counter()
        before = self.programs  # initializations, a restore's; a re-planned run's earlier ones
        batches = bucket_microbatches(self.problem, self.cfg.data)
        extra = [lw for opt in self.opts for lw in opt.lower()]
        extra += lower_update(self.opts, self.cfg.optimizer.clip_norm, self.tied)
        stats = jax.ShapeDtypeStruct((len(STATS),), jnp.float32, sharding=self.opts[-1].scalar)
        totals = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=self.opts[-1].scalar)
        extra += lower_reads([stats] + ([totals] if self.eval is not None else []))
        saves = (
            [lw for opt in self.opts for lw in opt.lower_save()]
            if self.cfg.checkpoint.every
            else []
        )
        extra += saves
        extra.append(self.lr.lowering("step", jax.ShapeDtypeStruct((), jnp.int32)))
        with progress_bar(jax.process_index() == 0) as progress:
            done = precompile(self.stages, batches, progress,
                              evaluation=self.eval is not None, extra=extra,
                              store=self.store)  # fmt: skip
        self.precompiled = done
        loaded = self.counter.cache_hits - hits
        self.console.print(
            f"compiled {self.programs} programs "
            f"({_program_kinds(done, before, len(saves), self.replanned)}"
            f"{f'; {loaded} from the persistent cache' if loaded else ''}) in "
            f"{time.perf_counter() - t0:.1f}s",
            highlight=False,
            soft_wrap=True,
        )

    @property
    def programs(self) -> int:
        """Executables this run (this trainer) has built so far, in this process."""
        return self.counter.count - self.counter_start

    def _place(self, batch: GlobalBatch) -> GlobalBatch:
        """The loader's hook (its prefetch thread): the batch's side inputs onto the devices of the
        stages the run trains now (a re-plan replaces them)."""
        return placed_batch(self.stages, batch)

    def restore(self) -> int:
        """Resumes from the latest checkpoint when there is one; returns the last completed step."""
        if not self.cfg.checkpoint.resume:
            return 0
        latest = self.ckpt.latest_step()
        self.ckpt.discard_after(latest or 0)  # what a run killed mid-save left behind
        if latest is None:
            return 0
        with progress_bar(jax.process_index() == 0) as progress:
            params, states, meta = self.ckpt.restore(
                list(self.layout.stages),
                [s.params for s in self.stages],
                [o.state_structs for o in self.opts],
                latest,
                progress,
            )
        for s, o, p, st in zip(self.stages, self.opts, params, states):
            s.params, o.state = p, st
        # The schedule function first: the loader's thread schedules the next batch as soon as its
        # state is set, and must find the lag counted from the resumed step.
        saved = _lagged_state(meta["scheduler"], meta["step"], self.cfg.prefetch)
        fresh = self.scheduler.state_dict()
        moved = meta["layout"] != json.loads(json.dumps(dataclasses.asdict(self.layout)))
        if moved or not same_buckets(saved["scheduler"], fresh):
            # Correction factors are per stage and bucket pair of the plan that measured them.
            carried = carry_corrections(saved, layout_from_dict(meta["layout"]), self.layout, fresh)
            saved = carried.state
            self.console.print(f"note: {carried.message()}", highlight=False, soft_wrap=True)
        self.schedule_fn.load(saved)
        self.loader.set_state(meta["loader"])
        if self.eval is not None:
            self.eval.last = meta.get("eval")
        else:
            self.restored_eval = meta.get("eval")  # carried on by a run that does not evaluate
        self.skipped_steps = skipped = meta.get("skipped_steps", 0)
        self.stats = put_host(np.array([0, 0, 1, skipped, 0], np.float32), self.opts[-1].scalar)
        self.console.print(f"resumed from step {meta['step']}", highlight=False)
        return meta["step"]

    def save(self, step: int) -> None:
        """Checkpoint after `step` (read first: its skip counter goes into the metadata)."""
        meta = {
            "loader": self.loader.get_state(),
            "scheduler": self.schedule_fn.state(step),
            "layout": dataclasses.asdict(self.layout),
            "seed": self.cfg.seed,
            "skipped_steps": self.skipped_steps,
            "eval": self.eval.last if self.eval is not None else self.restored_eval,
        }
        params, states = [s.params for s in self.stages], [o.state for o in self.opts]
        self.ckpt.save(step, list(self.layout.stages), params, states, meta)

    def close(self) -> None:
        self.schedule_fn.close()  # first: wakes a loader thread waiting for a step that never comes
        self.ckpt.close()
        self.loader.close()

    def dispatch(self, step: int) -> None:
        """Issues one optimizer step on the next global batch without reading anything back: the
        pipeline, the clipped update (skipped on device when not finite); a measured step times the
        ops of one microbatch (step % M). Raises on an empty batch."""
        measure = bool(self.measure_every) and step % self.measure_every == 0
        compiles_before = self.programs
        batch = next(self.loader)
        if not batch.microbatches:
            raise RuntimeError(
                f"step {step}: the loader produced an empty global batch (all skipped)"
            )
        check_schedule(step, batch.stats.schedule_digest)  # before anything is dispatched
        if self.drift is not None:  # measured on the monitor's thread, read with a later step
            self.drift.add(step, batch.shapes)
        t0, cpu0, issued = time.perf_counter(), time.thread_time(), ISSUED.snapshot()
        ISSUED.reset_wait()
        # The normalizer (every host's loss tokens) is counted on the last stage's devices.
        out = run_pipeline(
            self.stages, batch.microbatches, None, self.cfg.pipeline,
            sample=step % len(batch.microbatches) if measure else None, clock=self.clock,
            placed=batch.placed,
        )  # fmt: skip
        batch.placed = None  # the step's programs hold them; the metrics keep the host batch only
        copies = apply_updates(self.opts, out.grads, self.cfg.optimizer.clip_norm, out.loss,
                               self.stats, tied=self.tied)  # fmt: skip
        self.stats = copies[-1]
        dispatched, cpu = time.perf_counter(), time.thread_time() - cpu0
        counts = [b - a for a, b in zip(issued, ISSUED.snapshot())]
        waited = None if ISSUED.first_wait is None else ISSUED.first_wait - t0
        compiles = self.programs
        self.schedule_fn.post(step, self._observation(step, batch, out) if measure else _none)
        del out  # its accumulators are the update's (donated); nothing else of it outlives dispatch
        flight = _InFlight(step, batch, copies[-1], t0, dispatched, compiles,
                           compiles - compiles_before, measure, threading.Event(), [0.0],
                           dispatch_metrics(dispatched - t0, cpu, counts, waited))  # fmt: skip
        _when_ready([c for c in copies if _holds(c)][:1], flight)
        self.in_flight.append(flight)

    def _observation(self, step: int, batch: GlobalBatch, out: StepOutput):
        """How to get a measured step's observation: share its sampled stage times across processes
        (bit-exact), keep the valid microbatch. The closure holds the stage times (host arrays) and
        the schedule only, not the step's device values (gradient accumulators, losses), which the
        loader thread may resolve steps later."""
        stage_times, timing_valid, schedule = out.stage_times, out.timing_valid, batch.schedule

        def resolve() -> Observation | None:
            times, valid = shared_stage_times(stage_times, timing_valid, self.owners, step)
            return Observation.of_step(self.problem, schedule, times, valid)

        return resolve

    def read_due(self, step: int, first: int) -> bool:
        """Whether `step`'s numbers are read (and its metrics written) now: log steps, the first, and
        steps that evaluated."""
        every = self.cfg.eval.every
        evaluated = bool(every) and (step % every == 0 or step == self.cfg.steps)
        return step % self.cfg.log_every == 0 or step == first or evaluated

    def read(self, through: int) -> list[StepMetrics]:
        """Reads the dispatched steps and evaluations up to `through` (one exchange, `host_scalars`)
        into metrics."""
        due = [f for f in self.in_flight if f.step <= through]
        if not due:
            return []
        self.in_flight = [f for f in self.in_flight if f.step > through]
        evals = self.eval.take(through) if self.eval is not None else []
        values = host_scalars(
            [f.stats for f in due] + [e.totals for e in evals], f"step{through}/stats"
        )
        n = values.size - 2 * len(evals)  # the STATS vectors, then the evaluations' (sum, tokens)
        losses = {e.step: (e, v) for e, v in zip(evals, values[n:].reshape(len(evals), 2))}
        rows = []
        for f, v in zip(due, values[:n].reshape(len(due), -1)):
            f.done.wait()
            stats = dict(zip(STATS, v.tolist()))
            self.skipped_steps = int(stats["skipped_steps"])
            row = self._metrics(f, stats)
            if f.step in losses:
                row = self.eval.with_eval(row, *losses[f.step])
            rows.append(row)
        if self.drift is not None:
            rows[-1] = self.drift.with_drift(rows[-1], self.console)
        return rows

    def _metrics(self, f: _InFlight, stats: dict) -> StepMetrics:
        """The step's record. Its time is from its dispatch (or the previous step's end, if later)
        to its statistics being ready: the steps overlap, so this is the time it added."""
        begin = f.start_s if self.last_done_s is None else max(f.start_s, self.last_done_s)
        step_time = max(f.done_s[0] - begin, 1e-9)
        wall = f.done_s[0] - (f.start_s if self.last_done_s is None else self.last_done_s)
        self.last_done_s = f.done_s[0]
        correction = f.batch.schedule.info.get("correction") or self.scheduler.prediction_error()
        observed_before, self.observed = self.observed, correction["observations"]
        flops = batch_model_flops(self.arch, real_work(f.batch, self.has_encoder),
                                  real_audio_windows(f.batch))  # fmt: skip
        return step_metrics(
            f.step, f.batch, stage_modules(self.layout, self.has_encoder), correction,
            observed_before=observed_before, loss=stats["loss"], grad_norm=stats["grad_norm"],
            lr=float(self.lr.run(np.int32(f.step - 1))), step_time_s=step_time,
            mfu=mfu(flops, step_time, self.layout.num_devices, self.peak_flops),
            compiles=f.compiles, recompiles=f.recompiles, stage_times_measured=f.measured,
            wall_s=wall, update_skipped=stats["applied"] == 0,
            skipped_steps=int(stats["skipped_steps"]), **f.dispatch,
        )  # fmt: skip


def _lagged_state(saved: dict, step: int, lag: int) -> dict:
    """A checkpoint's `LaggedSchedule.state`; one written before corrections were lagged holds the
    plain scheduler state after step `step`, taken as the state through step - 1 - lag."""
    if "through" in saved:
        return saved
    return {"scheduler": saved, "through": max(step - 1 - lag, 0), "step": step, "observations": {}}


def _none() -> None:
    """The observation of a step that measured nothing."""
    return None


def _holds(x: jax.Array) -> bool:
    return isinstance(x, jax.Array) and bool(x.addressable_shards)


def _when_ready(values: list[jax.Array], flight: _InFlight) -> None:
    """Notes in `flight` the clock when `values` are ready, from a daemon thread (no host sync)."""

    def wait():
        try:
            jax.block_until_ready(values)
        except Exception:  # noqa: BLE001
            # A failed step (a lost peer's collective, say) raises where its values are read, on
            # the dispatch thread, and the watchdog names a lost peer: a traceback from this timing
            # thread would only bury that message.
            pass
        finally:
            flight.done_s[0] = time.perf_counter()
            flight.done.set()

    threading.Thread(target=wait, name=f"dflop-step{flight.step}", daemon=True).start()


def _evaluate(trainer: _Trainer, step: int) -> _Trainer:
    """Issues the evaluation of the params after `step` (read later, with `step`'s numbers)."""
    watchdog.progress(step, "evaluation")
    trainer.eval.dispatch(step, trainer.stages, trainer.counter)
    return trainer


def _replanned(old: _Trainer, step: int, model_cfg) -> _Trainer:
    """The run after `step`'s checkpoint on the plan the drift measurement found, on the same
    devices, restored from that checkpoint (`runtime/replan.py`)."""
    plan = next_plan(old.drift.latest, old.plan)
    plan = plan.check_runnable("replan", has_vision(model_cfg))
    old.console.print(
        describe(old.drift.latest, old.plan, plan, step), highlight=False, soft_wrap=True
    )
    old.close()  # waits for the checkpoint
    new = _Trainer(old.cfg, model_cfg, old.arch, old.device, plan, old.console, old.clock,
                   old.counter_start, old.store)  # fmt: skip
    new.restore()
    new.precompile()  # the new plan's programs, before it runs a step
    return new


def _host_shards(layout: Layout, meshes, has_encoder: bool) -> HostShardSpec | None:
    """The data shards this process's stages hold (None: one process holds them all); a colocated
    encoder's shards are LLM stage 0's; an audio stage's replica j holds LLM rows j*k .. j*k+k-1
    (k = `Layout.audio_rows`), whose audio rows this process packs."""
    if jax.process_count() == 1:
        return None
    grids = [m.devices for m in meshes]
    n, first = len(layout.encoder_stages), layout.first_llm
    encoder = grids[:n] if n or not has_encoder else grids[first : first + 1]
    k = layout.audio_rows
    audio = [np.repeat(g, k, axis=0) for g in grids[n:first]]  # one grid row per LLM row
    return HostShardSpec.from_meshes(encoder, grids[first:] + audio, jax.process_index())


def _training_records(cfg: TrainConfig, problem) -> tuple:
    """(training records, held-out records) of `data.source` (`eval.fraction`); raises a one-line
    ConfigError on `global_batch` when the training records hold fewer usable ones than a global
    batch (the loader would train on short or empty batches)."""
    records, held_out = split_records(
        load_source(cfg.data, cfg.seed), cfg.eval.fraction, cfg.eval.seed
    )
    try:
        check_records(cfg.data, records, problem, cfg.global_batch, cfg.model.has_vision)
    except TooFewRecords as e:
        raise (e.with_held_out(len(held_out), cfg.eval.fraction) if held_out else e) from None
    return records, held_out


def _checkpointer(cfg: TrainConfig) -> Checkpointer:
    """orbax checkpoints for any layout and process count (one manager per group of owning processes)."""
    directory = Path(cfg.run_dir) / "checkpoints"
    return Checkpointer(directory, cfg.checkpoint.keep, cfg.checkpoint.async_save)


def _program_kinds(done: PrecompileReport, before: int, saves: int, replanned: bool) -> str:
    """The run's programs by kind, for the precompile line: the stage and transfer programs and the
    per-step ones (what the plan's `compile:` estimate counts), a checkpoint's, and those built
    before `precompile`: at start-up the stages' and optimizers' initializations and a restore's
    padding of the optimizer state; in a re-plan (`replanned`) everything the run built before it.
    The kinds count the programs lowered and compiled, the line's total the executables XLA built:
    in a fresh process they agree; one whose jits already hold some of them (a re-plan's
    transfers) builds fewer."""
    pairs = done.pairs
    kinds = [
        f"{done.stage_programs} stage and transfer programs for {pairs} bucket pair{'s' * (pairs != 1)}",
        f"{done.step_programs - saves} per-step",
    ]
    if saves:
        kinds.append(f"{saves} for checkpoints")
    if before:
        kinds.append(f"{before} before this plan" if replanned else f"{before} at start-up")
    return ", ".join(kinds)


def _print_plan(console: Console, plan: ResolvedPlan, meshes, model_cfg) -> None:
    console.print("[bold]plan[/bold]")
    devices = [[d.id for d in m.devices.flat] for m in meshes]
    for line in plan.describe(has_vision(model_cfg), devices):
        console.print(f"  {line}", highlight=False)
    vision = getattr(model_cfg, "vision", None)  # the kernels the model runs ("auto" resolved)
    kernels = f"vision={vision.attention_impl or 'xla'} " if vision is not None else ""
    llm = getattr(model_cfg, "text", model_cfg).attention_impl or "xla"
    console.print(f"  attention: {kernels}llm={llm}", highlight=False)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
