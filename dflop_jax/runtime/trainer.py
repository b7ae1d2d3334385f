"""The training loop: plan -> stage meshes -> stage programs -> loader -> pipelined steps -> metrics.

    from dflop_jax.runtime.trainer import run
    report = run(TrainConfig(...))

Per step: the loader yields a scheduled, packed `GlobalBatch`; the driver runs its microbatches through
the pipeline (1F1B or GPipe) with the loss normalized by the batch's loss tokens; every stage updates
with AdamW after global-norm clipping; metrics go to the console / JSONL / TensorBoard; checkpoints are
saved every `checkpoint.every` steps and the run resumes from the latest one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console

from dflop_jax.config import dump_yaml
from dflop_jax.contracts import BucketSet, ScheduleProblem
from dflop_jax.costs import (
    AnalyticCostProvider,
    CostProvider,
    MLLMArch,
    arch_from_configs,
    get_device,
    get_vision,
    layout_stage_costs,
    llm_arch_from_config,
    projector_for,
    sample_model_flops,
)
from dflop_jax.costs.layout import Layout
from dflop_jax.runtime.checkpoint import Checkpointer, OwnerCheckpointer
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.runtime.distributed import host_scalars
from dflop_jax.runtime.driver import run_pipeline
from dflop_jax.runtime.mesh import stage_meshes
from dflop_jax.runtime.metrics import MetricsLog, measure_peak_flops
from dflop_jax.runtime.model_stages import build_llm_stages, build_mllm_stages
from dflop_jax.runtime.stages import enable_compilation_cache
from dflop_jax.runtime.train_state import StageOptimizer, apply_updates, tied_groups
from dflop_jax.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainReport:
    """What a run did: per-step losses (this invocation), the summary, where it wrote."""

    losses: list[float]
    summary: dict
    run_dir: Path
    layout: Layout
    first_step: int
    stages: list = dataclasses.field(default_factory=list)  # the StagePrograms (final params)


@dataclasses.dataclass(frozen=True)
class ResolvedPlan:
    """What the trainer runs: layout, buckets, microbatch range, and the costs the scheduler predicts with."""

    layout: Layout
    buckets: BucketSet
    microbatches: tuple[int, int]
    provider: CostProvider


def resolve_plan(cfg: TrainConfig, model_cfg, arch: MLLMArch) -> ResolvedPlan:
    """The plan of `cfg.plan`: explicit, auto (profile -> plan), analytic, or a plan.yaml path.

    `auto` runs DFLOP's steps through `profiling.ensure_plan` in `run_dir/auto_plan` (data profile of
    the training data, model profile of the real stage programs, planner on measured costs), reusing
    each output while it is fresh; the scheduler then predicts with the measured costs too.
    """
    device = get_device(cfg.plan_device)
    provider: CostProvider = AnalyticCostProvider(arch, device)
    if cfg.plan == "explicit":
        lay = cfg.layout
        return ResolvedPlan(lay.layout(), lay.buckets(), tuple(lay.microbatches), provider)
    from dflop_jax.planner import load_plan, make_plan, save_plan

    # The trainer's global batch is the one to plan for; the runtime runs separate encoder stages only.
    planner = dataclasses.replace(
        cfg.planner, global_batch=cfg.global_batch, colocate=cfg.model.kind == "decoder"
    )
    if cfg.plan == "auto":
        plan, provider = _profiled_plan(cfg, model_cfg, arch, planner, provider)
    elif cfg.plan == "analytic":
        plan = make_plan(arch, device, len(jax.devices()), _sample_shapes(cfg), planner)
        save_plan(plan, Path(cfg.run_dir) / "plan.yaml")
    else:
        plan = load_plan(cfg.plan)
    if cfg.model.kind != "decoder" and not plan.layout.encoder_stages:
        raise ValueError(
            f"plan={cfg.plan}: the plan colocates the encoder on LLM stage 0, which the runtime does not "
            "run; plan with planner.colocate=false"
        )
    return ResolvedPlan(plan.layout, plan.buckets, plan.microbatch_range, provider)


def _profiled_plan(cfg: TrainConfig, model_cfg, arch, planner, analytic):
    """(plan, measured cost provider) from data profile -> model profile -> plan (reused when fresh)."""
    from dflop_jax.costs.measured import MeasuredCostProvider
    from dflop_jax.profiling.pipeline import AutoPlanConfig, ensure_plan

    if jax.process_count() > 1:
        # Timings differ between processes, so each would plan differently: profile and plan once.
        raise ValueError(
            "plan=auto is single-process only: run scripts/run_profiling_engine.sh and "
            "scripts/run_data_aware_optimization.sh, then train with plan=<cache_dir>/plan.yaml"
        )
    if model_cfg is None or not hasattr(model_cfg, "vision"):
        raise ValueError("plan=auto profiles multimodal models only; use plan=analytic or explicit")
    cache = Path(cfg.run_dir) / "auto_plan"
    auto = AutoPlanConfig(
        device=cfg.plan_device,
        num_devices=len(jax.devices()),
        data_source="dataset",
        seed=cfg.seed,
        profile=cfg.profile,
        planner=planner,
    )
    plan = ensure_plan(auto, model_cfg, cache, data_cfg=cfg.data, name=f"{cfg.model.kind}-run")
    measured = MeasuredCostProvider(
        cache / "cost_table.json", arch, analytic.device, fallback=analytic
    )
    return plan, measured


def _sample_shapes(cfg: TrainConfig):
    """(tiles, tokens) of the dataset's samples from metadata (bad samples left out)."""
    from dflop_jax.data import BadSample, Processor, load_source

    processor, shapes = Processor(cfg.data), []
    for record in load_source(cfg.data, cfg.seed):
        try:
            shapes.append(processor.shape(record))
        except BadSample:
            continue
    return shapes


def build_model(cfg: TrainConfig, vocab_size: int):
    """The full model with fp32 master params (random, or loaded from `model.hf_dir`).

    Returns:
      (model, model_cfg, arch): a `models` nnx module (`Decoder`, `LlavaOnevision` or `InternVL`), its
      config and its cost-model arch.
    """
    from flax import nnx

    from models.decoder import Decoder
    from models.decoder_config import DecoderConfig

    m = cfg.model
    if m.hf_dir:
        from models.hf import load_pretrained

        model, mcfg = load_pretrained(m.hf_dir, dtype=cfg.compute_dtype, param_dtype="float32")
        return model, mcfg, _arch(mcfg)
    # Tokenizer vocabularies are padded to a multiple of 128 (rows never targeted) so tp divides them.
    dcfg = DecoderConfig(
        vocab_size=m.vocab_size or -(-vocab_size // 128) * 128,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        dtype=cfg.compute_dtype,
        param_dtype="float32",
    )
    with jax.default_device(jax.local_devices()[0]):
        if m.kind == "decoder":
            return Decoder(dcfg, rngs=nnx.Rngs(m.init_seed)), dcfg, _arch(dcfg)
        vision_shape = {
            "hidden_size": m.vision_hidden_size,
            "intermediate_size": m.vision_intermediate_size,
            "num_layers": m.vision_num_layers,
            "num_heads": m.vision_num_heads,
            "image_size": cfg.data.tile_px,
            "patch_size": cfg.data.patch_size,
            "dtype": cfg.compute_dtype,
        }
        if m.kind == "internvl":
            from models.internvit import InternViTConfig
            from models.internvl import InternVL, internvl_config

            mcfg = internvl_config(InternViTConfig(**vision_shape), dcfg)
            return InternVL(mcfg, rngs=nnx.Rngs(m.init_seed)), mcfg, _arch(mcfg)
        from models.llava_onevision import LlavaOnevision, llava_onevision_config
        from models.siglip import SiglipConfig

        mcfg = llava_onevision_config(SiglipConfig(**vision_shape), dcfg)
        return LlavaOnevision(mcfg, rngs=nnx.Rngs(m.init_seed)), mcfg, _arch(mcfg)


def _arch(mcfg) -> MLLMArch:
    """The cost-model architecture of a model config (MFU and the scheduler's cost predictions)."""
    if hasattr(mcfg, "vision"):
        return arch_from_configs(mcfg.vision, mcfg.text, mcfg.tokens_per_tile, "run")
    llm = llm_arch_from_config(mcfg, "run-llm")
    vision = get_vision("tiny")  # decoder-only: tiles are never encoded, the vision arch is unused
    return MLLMArch("run", vision, projector_for(vision, llm), llm)


def _model_flops(arch: MLLMArch, microbatches, has_encoder: bool) -> float:
    """Model FLOPs of the real work of a batch: valid tiles and the segments of the packed rows."""
    total = 0.0
    for mb in microbatches:
        if has_encoder:
            total += sample_model_flops(arch, int(mb.tile_valid.sum()), 0)
        for row in mb.segment_ids:
            _, counts = np.unique(row[row > 0], return_counts=True)
            total += sum(sample_model_flops(arch, 0, int(c)) for c in counts)
    return total


def _print_plan(console: Console, layout: Layout, buckets: BucketSet, mbs, meshes) -> None:
    console.print("[bold]plan[/bold]")
    for i, (s, m) in enumerate(zip(layout.stages, meshes)):
        ids = [d.id for d in m.devices.flat]
        console.print(
            f"  stage {i}: {s.module} layers {s.first_layer}..{s.first_layer + s.num_layers - 1}"
            f" dp={s.dp} tp={s.tp} emb={s.has_embedding} head={s.has_head} devices={ids}",
            highlight=False,
        )
    console.print(
        f"  buckets tiles={buckets.tiles} lengths={buckets.lengths} microbatches={mbs}",
        highlight=False,
    )


def run(cfg: TrainConfig, console: Console | None = None, clock=time.perf_counter) -> TrainReport:
    """Trains per `cfg` (resuming from `run_dir/checkpoints` when present); returns the report.

    `clock` times the stage programs of measured steps (tests pass a deterministic one).
    """
    from dflop_jax.data import load_tokenizer, make_loader

    lead = jax.process_index() == 0
    console = console or Console(quiet=not lead)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if lead:
        dump_yaml(cfg, run_dir / "config.yaml")
    if cfg.compilation_cache:
        enable_compilation_cache(cfg.compilation_cache)

    model, model_cfg, arch = build_model(cfg, load_tokenizer(cfg.data.tokenizer).vocab_size)
    resolved = resolve_plan(cfg, model_cfg, arch)
    layout, buckets, mb_range = resolved.layout, resolved.buckets, resolved.microbatches
    meshes = stage_meshes(layout)
    _print_plan(console, layout, buckets, mb_range, meshes)
    dtype = jnp.dtype(cfg.compute_dtype)
    if cfg.model.kind == "decoder":
        if layout.encoder_stages:
            raise ValueError("model.kind=decoder has no encoder: give layout.encoder_layers=[]")
        stages = build_llm_stages(model, layout, meshes, compute_dtype=dtype)
    else:
        stages = build_mllm_stages(model, layout, meshes, compute_dtype=dtype)
    del model
    opts = [StageOptimizer(s, cfg.optimizer.build()) for s in stages]
    # A tied embedding split over the first and last LLM stage: one parameter, two copies.
    tied = tied_groups(list(layout.stages), [s.params for s in stages])
    costs = layout_stage_costs(resolved.provider, layout)
    problem = ScheduleProblem(
        layout.encoder_dp, layout.llm_dp, layout.num_stages, mb_range, buckets, costs
    )
    measure_every = cfg.measure_stage_times_every
    if measure_every and jax.process_count() > 1:
        console.print(
            "note: stage-time measurement and adaptive correction are off in multi-process runs "
            "(every process must schedule from the same observations)",
            highlight=False,
        )
        measure_every = 0
    # Observations steer later schedules: no prefetch, so batch k sees exactly steps < k (exact resume).
    prefetch = 0 if measure_every and cfg.scheduler.correction != "off" else 2
    scheduler = Scheduler(problem, cfg.scheduler, seed=cfg.seed)
    loader = make_loader(
        cfg.data,
        None,
        problem,
        scheduler.schedule,
        global_batch_size=cfg.global_batch,
        seed=cfg.seed,
        prefetch=prefetch,
    )
    if jax.process_count() == 1:
        ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint.keep, cfg.checkpoint.async_save)
    else:  # orbax refuses arrays living on one process of many: every owner writes its own
        ckpt = OwnerCheckpointer(run_dir / "checkpoints", cfg.checkpoint.keep)
    specs = list(layout.stages)
    start = 0
    if cfg.checkpoint.resume and ckpt.latest_step() is not None:
        params, states, meta = ckpt.restore(
            specs, [s.params for s in stages], [o.state for o in opts]
        )
        for s, o, p, st in zip(stages, opts, params, states):
            s.params, o.state = p, st
        loader.set_state(meta["loader"])
        scheduler.load_state_dict(meta["scheduler"])
        start = meta["step"]
        console.print(f"resumed from step {start}", highlight=False)

    peak = cfg.peak_flops or measure_peak_flops()
    metrics = MetricsLog(
        run_dir, cfg.log_every, cfg.tensorboard and lead, console, jax.process_index()
    )
    schedule_fn = cfg.optimizer.schedule()
    losses: list[float] = []
    try:
        for step in range(start + 1, cfg.steps + 1):
            measure = bool(measure_every) and step % measure_every == 0
            row = _train_step(
                cfg,
                step,
                loader,
                scheduler,
                stages,
                opts,
                arch,
                peak,
                layout,
                schedule_fn,
                measure,
                clock,
                tied,
            )
            losses.append(row["loss"])
            metrics.log(row)
            if cfg.checkpoint.every and (step % cfg.checkpoint.every == 0 or step == cfg.steps):
                meta = {
                    "loader": loader.get_state(),
                    "scheduler": scheduler.state_dict(),
                    "layout": dataclasses.asdict(layout),
                    "seed": cfg.seed,
                }
                ckpt.save(step, specs, [s.params for s in stages], [o.state for o in opts], meta)
    finally:
        ckpt.close()
        loader.close()
        metrics.close()
    summary = metrics.summary()
    if summary:
        console.print(
            "[bold]summary[/bold] " + ", ".join(f"{k}={_fmt(v)}" for k, v in summary.items()),
            highlight=False,
            soft_wrap=True,
        )
    return TrainReport(losses, summary, run_dir, layout, start, stages)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _observe(scheduler, schedule, out, costs) -> None:
    """Feeds a measured step's stage times to the scheduler (microbatches that compiled left out).

    The last stage runs forward+backward fused: its time is split by the raw predicted fwd:bwd ratio.
    """
    times = out.stage_times.copy()
    for m, mb in enumerate(schedule.microbatches):
        f, b = np.asarray(costs(mb.tile_bucket, mb.length_bucket))[-1]
        total = times[m, -1, 0]
        times[m, -1] = (total * f / (f + b), total * b / (f + b)) if f + b > 0 else (total, 0.0)
    keep = np.flatnonzero(out.timing_valid)
    if keep.size:
        kept = tuple(schedule.microbatches[i] for i in keep)
        scheduler.observe(dataclasses.replace(schedule, microbatches=kept), times[keep])


def _train_step(
    cfg,
    step,
    loader,
    scheduler,
    stages,
    opts,
    arch,
    peak,
    layout,
    schedule_fn,
    measure,
    clock,
    tied,
) -> dict:
    compiles_before = sum(s.compiles for s in stages)
    batch = next(loader)
    if not batch.microbatches:
        raise RuntimeError(
            f"step {step}: the loader produced an empty global batch (all samples skipped)"
        )
    t0 = time.perf_counter()
    out = run_pipeline(
        stages,
        batch.microbatches,
        float(batch.num_loss_tokens),
        cfg.pipeline,
        measure=measure,
        clock=clock,
    )
    loss = float(host_scalars(out.loss, f"step{step}/loss").sum())
    if not np.isfinite(loss):
        raise FloatingPointError(f"non-finite loss {loss} at step {step}")
    grad_norm = apply_updates(
        opts, out.grads, cfg.optimizer.clip_norm, f"step{step}/norm", tied=tied
    )
    jax.block_until_ready([s.params for s in stages])
    step_time = time.perf_counter() - t0
    st = batch.stats
    tokens_real = float(st.packed.tokens_real)
    flops = _model_flops(arch, batch.microbatches, bool(layout.encoder_stages))
    compiles = sum(s.compiles for s in stages)
    before = scheduler.prediction_error()
    if measure:
        _observe(scheduler, batch.schedule, out, scheduler.problem.stage_costs)
    after = scheduler.prediction_error()
    return {
        "step": step,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": float(schedule_fn(step - 1)),
        "step_time_s": step_time,
        "tokens_per_s": tokens_real / step_time,
        "samples_per_s": st.num_samples / step_time,
        "mfu": flops / (step_time * layout.num_devices * peak),
        "llm_padding_ratio": st.llm_padding_ratio,
        "encoder_padding_ratio": st.encoder_padding_ratio,
        # Every stage of a module computes the same bucket shapes: its module's padding ratio.
        "stage_padding_ratio": [
            st.encoder_padding_ratio if s.module == "encoder" else st.llm_padding_ratio
            for s in layout.stages
        ],
        "microbatches": len(batch.microbatches),
        "loss_tokens": batch.num_loss_tokens,
        "scheduler_latency_s": st.scheduler_latency_s,
        "scheduler_gap": batch.schedule.gap,
        "scheduler_solver": batch.schedule.solver,
        "data_wait_s": st.data_wait_s,
        "predicted_step_time_s": batch.schedule.objective,
        "compiles": compiles,
        "recompiles": compiles - compiles_before,
        "skipped": st.num_skipped,
        # Adaptive correction (recent-window MAPE of predicted vs measured stage times, out of sample):
        # raw = the cost model, corrected = with the learned factors.
        "stage_times_measured": measure,
        "pred_raw_mape": after.get("raw_mape"),  # noqa: SIM910 - absent without a scheduler
        "pred_corrected_mape": after.get("corrected_mape"),  # noqa: SIM910
        "correction_observations": after.get("observations", 0),  # noqa: SIM910
        "correction_active": after.get("active", False),  # noqa: SIM910
        "new_observations": after.get("observations", 0) - before.get("observations", 0),  # noqa: SIM910
    }
