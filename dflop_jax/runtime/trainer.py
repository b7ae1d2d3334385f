"""The training loop: stage meshes -> stage programs -> scheduler + loader -> pipelined steps -> metrics.

    model_cfg = cfg.model.model_config(vocab, tile_px=..., patch_size=..., compute_dtype=...)
    report = train(cfg, model_cfg, arch_of_model(model_cfg), resolved_plan)

(`python -m dflop_jax.train` does exactly this: `dflop_jax.train.run`; the plan comes from
`dflop_jax.train_plan.resolve_plan`.) Per step: the loader yields a scheduled, packed `GlobalBatch`; the
driver runs its microbatches through the pipeline (1F1B or GPipe) with the loss normalized by the
batch's loss tokens; every stage updates with AdamW after global-norm clipping; a `StepMetrics` goes to
the console / JSONL / TensorBoard; checkpoints are saved every `checkpoint.every` steps and the run
resumes from the latest one. The trainer owns the online `Scheduler`: the loader calls its `schedule`
with the batch index, the trainer feeds it measured stage times and checkpoints its state.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console

from dflop_jax.config import dump_yaml
from dflop_jax.costs import MLLMArch, batch_model_flops, mfu
from dflop_jax.costs.layout import Layout
from dflop_jax.data import HostShardSpec, make_loader
from dflop_jax.planner.resolve import ResolvedPlan
from dflop_jax.runtime import watchdog
from dflop_jax.runtime.agreement import check_schedule, shared_stage_times, stage_owners
from dflop_jax.runtime.checkpoint import Checkpointer
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.runtime.distributed import host_scalars
from dflop_jax.runtime.driver import StepOutput, connect, run_pipeline
from dflop_jax.runtime.mesh import stage_meshes
from dflop_jax.runtime.metrics import (
    MetricsLog,
    StepMetrics,
    measure_peak_flops,
    real_work,
    step_metrics,
)
from dflop_jax.runtime.model_stages import build_stages, is_multimodal
from dflop_jax.runtime.stages import enable_compilation_cache
from dflop_jax.runtime.train_state import StageOptimizer, apply_updates, tied_groups
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


def prepare_run_dir(cfg: TrainConfig) -> Path:
    """Creates `run_dir`, writes the resolved config (process 0) and turns on the compilation cache."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        dump_yaml(cfg, run_dir / "config.yaml")
    if cfg.compilation_cache:
        enable_compilation_cache(cfg.compilation_cache)
    return run_dir


def train(
    cfg: TrainConfig,
    model_cfg,
    arch: MLLMArch,
    plan: ResolvedPlan,
    console: Console | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> TrainReport:
    """Trains the model of `model_cfg` on `plan`, each stage's params made on its own mesh from
    `cfg.model.source` (init seed or HF directory).

    Args:
      arch: the model's cost-model architecture (MFU).
      clock: times the stage programs of measured steps (tests pass a deterministic one).
    """
    console = console or Console(quiet=jax.process_index() != 0)
    trainer = _Trainer(cfg, model_cfg, arch, plan, console, clock)
    metrics = MetricsLog(
        cfg.run_dir,
        cfg.log_every,
        cfg.tensorboard and jax.process_index() == 0,
        console,
        jax.process_index(),
        total_steps=cfg.steps,
    )
    start, losses = trainer.restore(), []
    try:
        for step in range(start + 1, cfg.steps + 1):
            watchdog.progress(step)
            row = trainer.step(step)
            losses.append(row.loss)
            metrics.log(row)
            if cfg.checkpoint.every and (step % cfg.checkpoint.every == 0 or step == cfg.steps):
                watchdog.progress(step, "checkpoint")
                trainer.save(step)
    finally:
        trainer.close()
        metrics.close()
    watchdog.finish()
    summary = metrics.summary()
    if summary:
        console.print(
            "[bold]summary[/bold] " + ", ".join(f"{k}={_fmt(v)}" for k, v in summary.items()),
            highlight=False,
            soft_wrap=True,
        )
    return TrainReport(losses, summary, Path(cfg.run_dir), plan.layout, start, trainer.stages)


class _Trainer:
    """The parts of a run that live across steps (stages, optimizers, scheduler, loader, checkpoints)
    and the step itself."""

    def __init__(self, cfg: TrainConfig, model_cfg, arch, plan: ResolvedPlan, console, clock):
        self.cfg, self.layout, self.arch, self.console, self.clock = (
            cfg,
            plan.layout,
            arch,
            console,
            clock,
        )
        meshes = stage_meshes(plan.layout)
        self.has_encoder = is_multimodal(model_cfg)  # on its own stages or colocated on stage 0
        _print_plan(console, plan, meshes)
        self.stages = build_stages(
            model_cfg, plan.layout, meshes, cfg.model.source,
            compute_dtype=jnp.dtype(cfg.compute_dtype),
        )  # fmt: skip
        opt = cfg.optimizer
        self.opts = [
            StageOptimizer(s, opt.build(), opt.zero1, counted=opt.counted) for s in self.stages
        ]
        if jax.process_count() > 1:
            connect(self.stages)  # while the processes are together (see `connect`)
        # A tied embedding split over the first and last LLM stage: one parameter, two copies.
        self.tied = tied_groups(list(plan.layout.stages), [s.params for s in self.stages])
        problem = plan.problem()
        # Processes must solve alike whatever their load: no wall-clock cut-off (`agreement.py`).
        self.scheduler = Scheduler(problem, cfg.scheduler, backstop=jax.process_count() == 1)
        self.owners = stage_owners(meshes)
        self.measure_every = cfg.measure_stage_times_every
        # Observations steer later schedules: no prefetch, so batch k sees exactly steps < k (exact resume).
        prefetch = 0 if self.measure_every and cfg.scheduler.correction != "off" else 2
        self.loader = make_loader(
            cfg.data, None, problem, self.scheduler.schedule,
            seed=cfg.seed, global_batch_size=cfg.global_batch, prefetch=prefetch,
            host=_host_shards(plan.layout, meshes, self.has_encoder),
        )  # fmt: skip
        self.ckpt = _checkpointer(cfg)
        self.peak_flops = cfg.peak_flops or measure_peak_flops()
        self.lr = cfg.optimizer.schedule()

    def restore(self) -> int:
        """Resumes from the latest checkpoint when there is one; returns the last completed step."""
        if not self.cfg.checkpoint.resume:
            return 0
        latest = self.ckpt.latest_step()
        self.ckpt.discard_after(latest or 0)  # what a run killed mid-save left behind
        if latest is None:
            return 0
        params, states, meta = self.ckpt.restore(
            list(self.layout.stages),
            [s.params for s in self.stages],
            [o.state for o in self.opts],
            latest,
        )
        for s, o, p, st in zip(self.stages, self.opts, params, states):
            s.params, o.state = p, st
        self.loader.set_state(meta["loader"])
        if meta["layout"] == json.loads(json.dumps(dataclasses.asdict(self.layout))):
            self.scheduler.load_state_dict(meta["scheduler"])
        else:  # correction factors are per stage of the layout that measured them
            self.console.print(
                "note: the checkpoint comes from another layout; scheduler corrections start fresh",
                highlight=False,
            )
        self.console.print(f"resumed from step {meta['step']}", highlight=False)
        return meta["step"]

    def save(self, step: int) -> None:
        meta = {
            "loader": self.loader.get_state(),
            "scheduler": self.scheduler.state_dict(),
            "layout": dataclasses.asdict(self.layout),
            "seed": self.cfg.seed,
        }
        params, states = [s.params for s in self.stages], [o.state for o in self.opts]
        self.ckpt.save(step, list(self.layout.stages), params, states, meta)

    def close(self) -> None:
        self.ckpt.close()
        self.loader.close()

    def step(self, step: int) -> StepMetrics:
        """One optimizer step on the next global batch; raises on an empty batch or a non-finite loss."""
        measure = bool(self.measure_every) and step % self.measure_every == 0
        compiles_before = sum(s.compiles for s in self.stages)
        batch = next(self.loader)
        if not batch.microbatches:
            raise RuntimeError(
                f"step {step}: the loader produced an empty global batch (all skipped)"
            )
        check_schedule(step, batch.stats.schedule_digest)  # before anything is dispatched
        t0 = time.perf_counter()
        # The normalizer (every host's loss tokens) is counted on the last stage's devices.
        out = run_pipeline(
            self.stages, batch.microbatches, None, self.cfg.pipeline,
            measure=measure, clock=self.clock,
        )  # fmt: skip
        loss = float(host_scalars(out.loss, f"step{step}/loss").sum())
        if not np.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss} at step {step}")
        clip = self.cfg.optimizer.clip_norm
        grad_norm = apply_updates(self.opts, out.grads, clip, f"step{step}/norm", tied=self.tied)
        jax.block_until_ready([s.params for s in self.stages])
        step_time = time.perf_counter() - t0
        observed_before = self.scheduler.prediction_error()["observations"]
        if measure:
            out.stage_times, out.timing_valid = shared_stage_times(
                out.stage_times, out.timing_valid, self.owners, step
            )
            _observe(self.scheduler, batch.schedule, out)
        compiles = sum(s.compiles for s in self.stages)
        flops = batch_model_flops(self.arch, real_work(batch, self.has_encoder))
        return step_metrics(
            step, batch, [s.module for s in self.layout.stages], self.scheduler.prediction_error(),
            observed_before=observed_before, loss=loss, grad_norm=grad_norm,
            lr=float(self.lr(step - 1)), step_time_s=step_time,
            mfu=mfu(flops, step_time, self.layout.num_devices, self.peak_flops),
            compiles=compiles, recompiles=compiles - compiles_before, stage_times_measured=measure,
        )  # fmt: skip


def _host_shards(layout: Layout, meshes, has_encoder: bool) -> HostShardSpec | None:
    """The data shards this process's stages hold (None: one process holds them all); a colocated
    encoder's shards are LLM stage 0's."""
    if jax.process_count() == 1:
        return None
    grids = [m.devices for m in meshes]
    n = len(layout.encoder_stages)
    encoder = grids[:n] if n or not has_encoder else grids[:1]
    return HostShardSpec.from_meshes(encoder, grids[n:], jax.process_index())


def _checkpointer(cfg: TrainConfig) -> Checkpointer:
    """orbax checkpoints for any layout and process count (one manager per group of owning processes)."""
    directory = Path(cfg.run_dir) / "checkpoints"
    return Checkpointer(directory, cfg.checkpoint.keep, cfg.checkpoint.async_save)


def _observe(scheduler: Scheduler, schedule, out: StepOutput) -> None:
    """Feeds a measured step's stage times to the scheduler (microbatches that compiled left out).

    The last stage runs forward+backward fused: its time is split by the raw predicted fwd:bwd ratio.
    """
    costs = scheduler.problem.stage_costs
    times = out.stage_times.copy()
    for m, mb in enumerate(schedule.microbatches):
        f, b = np.asarray(costs(mb.tile_bucket, mb.length_bucket))[-1]
        total = times[m, -1, 0]
        times[m, -1] = (total * f / (f + b), total * b / (f + b)) if f + b > 0 else (total, 0.0)
    keep = np.flatnonzero(out.timing_valid)
    if keep.size:
        kept = tuple(schedule.microbatches[i] for i in keep)
        scheduler.observe(dataclasses.replace(schedule, microbatches=kept), times[keep])


def _print_plan(console: Console, plan: ResolvedPlan, meshes) -> None:
    console.print("[bold]plan[/bold]")
    for i, (s, m) in enumerate(zip(plan.layout.stages, meshes)):
        ids = [d.id for d in m.devices.flat]
        console.print(
            f"  stage {i}: {s.module} layers {s.first_layer}..{s.first_layer + s.num_layers - 1}"
            f" dp={s.dp} tp={s.tp} emb={s.has_embedding} head={s.has_head} devices={ids}",
            highlight=False,
        )
    console.print(
        f"  buckets tiles={plan.buckets.tiles} lengths={plan.buckets.lengths} "
        f"microbatches={plan.microbatches}",
        highlight=False,
    )


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
