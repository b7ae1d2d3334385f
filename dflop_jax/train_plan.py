"""The plan `python -m dflop_jax.train` trains with: `TrainConfig.plan` resolved on this run's devices.

    resolved = resolve_plan(cfg, model_cfg)   # -> planner.resolve.ResolvedPlan

Beside the entry point because it joins the two sides the runtime must not import: the planner
(`planner/resolve.py`, no jax) and, for `plan: auto`, the profiler (`profiling/auto_plan.py`, which runs
the real stage programs). "explicit" is the config's `layout` section; "analytic" plans on the
dataset's shapes with analytic costs; a path loads a plan.yaml; "auto" profiles data and model in
`run_dir/auto_plan` (reusing fresh outputs) and plans on measured costs, which the scheduler then
predicts with too. Each way is one named function in `PLAN_SOURCES`.

The same run config drives the step commands: `auto_plan_config` gives `python -m dflop_jax.profile
data|model|auto` the settings `plan: auto` uses (so each reuses what the other wrote), and
`plan_from_run_dir` is `python -m dflop_jax.plan` (the profiles in `run_dir/auto_plan` ->
`run_dir/plan.yaml`).

Remat: the model config's per-module policy (`ModelConfig.vision_remat` / `llm_remat`) is what the
analytic costs assume; a plan.yaml brings its own (`Plan.remat`), which `with_plan_remat` applies to
the model before it is built.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax

from dflop_jax.costs import AnalyticCostProvider, arch_of_model
from dflop_jax.planner.plan_file import load_plan
from dflop_jax.planner.resolve import (
    ResolvedPlan,
    analytic_plan,
    check_plan_fits_run,
    plan_data_note,
    training_planner,
)
from dflop_jax.planner.space import fit_search_space
from dflop_jax.programs.devices import run_device
from dflop_jax.runtime.config import TrainConfig

log = logging.getLogger(__name__)


def with_plan_remat(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with its plan.yaml's remat policy in the model config (unchanged for other plans): the
    runtime recomputes what the plan's memory model assumed."""
    if not cfg.plan.endswith((".yaml", ".yml")):
        return cfg
    remat = load_plan(cfg.plan).remat
    if remat != cfg.model.remat:
        log.warning(
            "model remat %s replaced by the plan's %s (%s)", cfg.model.remat, remat, cfg.plan
        )
    model = dataclasses.replace(cfg.model, vision_remat=remat["vision"], llm_remat=remat["llm"])
    return dataclasses.replace(cfg, model=model)


def attention_impl(model_cfg) -> str:
    """The attention implementation the model's decoder runs ("xla" when unset): what the memory
    model prices (`costs/memory.py`)."""
    return getattr(model_cfg, "text", model_cfg).attention_impl or "xla"


def resolve_plan(cfg: TrainConfig, model_cfg, progress=None) -> ResolvedPlan:
    """The layout, buckets, microbatch range, cost provider and residual policies of `cfg.plan`
    for `model_cfg`; `progress(phase, done, total)` reports the profiling and planning steps
    (`planner.progress.progress_bar`)."""
    resolved = _resolve_layout(cfg, model_cfg, progress)
    return dataclasses.replace(resolved, residuals=stage_residuals(cfg, model_cfg, resolved))


def stage_residuals(cfg: TrainConfig, model_cfg, resolved: ResolvedPlan) -> tuple[str, ...]:
    """Each stage's residual policy: `cfg.residuals` for every stage; under "auto" the plan's own
    (the planner chose each with the layout: what its memory and times assume), or for a plan
    that records none (an explicit layout) the one with the least backward work that fits the plan
    device's usable memory (analytic memory model at the plan's largest buckets and in-flight
    counts, the planner's rule)."""
    from dflop_jax.costs import residual_policies
    from dflop_jax.planner.scoring import in_flight

    lay = resolved.layout
    if cfg.residuals != "auto":
        if resolved.residuals and set(resolved.residuals) != {cfg.residuals}:
            log.warning("residuals=%s for every stage: the plan was made for %s", cfg.residuals,
                        list(resolved.residuals))  # fmt: skip
        return (cfg.residuals,) * lay.num_stages
    if resolved.residuals:
        return tuple(resolved.residuals)
    device = run_device(cfg.device)
    analytic = AnalyticCostProvider(arch_of_model(model_cfg), device, remat=cfg.model.remat,
                                    trainable=tuple(cfg.optimizer.trainable))  # fmt: skip
    counts = in_flight(lay.num_stages, resolved.microbatches[1], cfg.pipeline)
    budget = device.memory_bytes * (1.0 - cfg.planner.memory_margin)
    return tuple(residual_policies(analytic, lay, resolved.buckets, counts, budget))


def plan_source(plan: str) -> str:
    """The way `TrainConfig.plan` is got: "explicit", "analytic", "auto", or "file" (a plan.yaml
    path); a running job's re-plan is the fifth (`runtime/replan.next_plan`)."""
    return plan if plan in ("explicit", "analytic", "auto") else "file"


def _explicit_plan(cfg: TrainConfig, model_cfg, analytic, progress) -> ResolvedPlan:
    """The config's `layout` section, priced by the analytic provider."""
    lay = cfg.layout
    return ResolvedPlan(lay.layout(), lay.buckets(), tuple(lay.microbatches), analytic)


def _file_plan(cfg: TrainConfig, model_cfg, analytic, progress) -> ResolvedPlan:
    """A plan.yaml, refused when made for another model, recipe, device or global batch; a note when
    the data profile changed since."""
    from dflop_jax.profiling.auto_plan import shape_file

    plan = load_plan(cfg.plan)
    check_plan_fits_run(plan, cfg.plan, arch_of_model(model_cfg), run_device(cfg.device),
                        num_devices(cfg), tuple(cfg.optimizer.trainable), cfg.global_batch)  # fmt: skip
    note = plan_data_note(plan, cfg.plan, shape_file(auto_plan_dir(cfg)))
    if note:
        log.warning(note)
    return ResolvedPlan.of(plan, analytic)


def _auto_plan(cfg: TrainConfig, model_cfg, analytic, progress) -> ResolvedPlan:
    """Profiles data and model in `run_dir/auto_plan` (reusing fresh outputs) and plans on the
    measured costs, which the scheduler then predicts with."""
    from dflop_jax.profiling.auto_plan import profiled_plan

    auto = auto_plan_config(cfg, model_cfg)  # its search space checked before any profiling
    plan, measured = profiled_plan(
        auto, model_cfg, auto_plan_dir(cfg), cfg.data, name=run_name(cfg), progress=progress
    )
    return ResolvedPlan.of(plan, measured.with_trainable(auto.planner.trainable))


def _analytic_plan(cfg: TrainConfig, model_cfg, analytic, progress) -> ResolvedPlan:
    """Plans on the dataset's shapes with analytic costs; saves `run_dir/plan.yaml`."""
    arch, device = arch_of_model(model_cfg), run_device(cfg.device)
    plan = analytic_plan(arch, device, num_devices(cfg), run_planner(cfg, arch, device),
                       lambda: sample_shapes(cfg), cfg.run_dir, analytic, progress)  # fmt: skip
    return ResolvedPlan.of(plan, analytic)


# `plan_source(cfg.plan)` -> (cfg, model_cfg, analytic provider, progress) -> ResolvedPlan
PLAN_SOURCES = {
    "explicit": _explicit_plan,
    "file": _file_plan,
    "auto": _auto_plan,
    "analytic": _analytic_plan,
}


def _resolve_layout(cfg: TrainConfig, model_cfg, progress=None) -> ResolvedPlan:
    get = PLAN_SOURCES[plan_source(cfg.plan)]
    resolved = get(cfg, model_cfg, analytic_provider(cfg, model_cfg), progress)
    return resolved.check_runnable(cfg.plan, cfg.model.kind != "decoder")


def analytic_provider(cfg: TrainConfig, model_cfg) -> AnalyticCostProvider:
    """The analytic costs of the run: its model's remat, its recipe, its attention kernel."""
    return AnalyticCostProvider(arch_of_model(model_cfg), run_device(cfg.device),
                                remat=cfg.model.remat, trainable=tuple(cfg.optimizer.trainable),
                                attention_impl=attention_impl(model_cfg))  # fmt: skip


def run_planner(cfg: TrainConfig, arch, device):
    """The run's planner settings (`training_planner`: its batch, recipe, what the runtime trains),
    its search space fitted to the run's devices (a space nothing satisfies is one config error,
    raised before any profiling). The uniform baseline keeps its own space."""
    planner = training_planner(cfg.planner, cfg.global_batch, cfg.model.kind != "decoder",
                               tuple(cfg.optimizer.trainable), cfg.steps)  # fmt: skip
    if planner.mode == "uniform":
        return planner
    return fit_search_space(arch, num_devices(cfg), device, planner)


def run_name(cfg: TrainConfig) -> str:
    """The model's name in the cost table and the plan of `plan: auto` and the CLI steps: its named
    architecture where it has one (then `python -m dflop_jax.simulate` replays the plan), that name
    with "-llm<N>" for the architecture cut to its first N decoder layers (`model.llm_layers_kept`;
    not a named one), else "<kind>-run"."""
    if cfg.model.arch and cfg.model.llm_layers_kept:
        return f"{cfg.model.arch}-llm{cfg.model.llm_layers_kept}"
    return cfg.model.arch or f"{cfg.model.kind}-run"


def auto_plan_dir(cfg: TrainConfig) -> Path:
    """Where the profiling steps and `plan: auto` write and reuse their outputs."""
    return Path(cfg.run_dir) / "auto_plan"


def auto_plan_config(cfg: TrainConfig, model_cfg):
    """The auto-plan workflow's settings for this run (`profiling.auto_plan.AutoPlanConfig`): the same
    for `plan: auto` and `python -m dflop_jax.profile data|model|auto`, so each reuses what the
    other wrote while it is fresh."""
    from dflop_jax.profiling.auto_plan import AutoPlanConfig

    planner = run_planner(cfg, arch_of_model(model_cfg), run_device(cfg.device))
    return AutoPlanConfig(cfg.device, num_devices(cfg), cfg.profile.data_source,
                          cfg.profile.data_samples, seed=cfg.seed, profile=cfg.profile,
                          planner=planner)  # fmt: skip


def plan_from_run_dir(cfg: TrainConfig, model_cfg, progress=None):
    """`python -m dflop_jax.plan`: a plan on the shapes `profile data` wrote and the cost table
    `profile model` wrote in `auto_plan_dir(cfg)`; where one is absent, one line says so and the
    data's shapes (from metadata) or the analytic cost model stand in. `Plan.inputs` records what
    was read (paths and sha256)."""
    from dflop_jax.costs.measured import MeasuredCostProvider
    from dflop_jax.planner import make_plan
    from dflop_jax.profiling.auto_plan import cost_table_file

    arch, device = arch_of_model(model_cfg, run_name(cfg)), run_device(cfg.device)
    planner = run_planner(cfg, arch, device)
    provider, table = analytic_provider(cfg, model_cfg), cost_table_file(auto_plan_dir(cfg))
    if table.is_file():
        provider = MeasuredCostProvider(table, arch, device, fallback=provider)
    else:
        log.warning("no cost table at %s (python -m dflop_jax.profile model writes it): "
                    "the analytic cost model prices the stages", table)  # fmt: skip
    shapes, shapes_input = plan_shapes(cfg)
    plan = make_plan(arch, device, num_devices(cfg), shapes, planner, provider, progress)
    inputs = {"shapes": shapes_input,
              "cost_table": _file_input(table) if table.is_file() else "analytic"}  # fmt: skip
    return dataclasses.replace(plan, inputs=inputs)


def plan_shapes(cfg: TrainConfig):
    """(the shapes the run plans for, how `Plan.inputs` records them), per `profile.data_source`."""
    from dflop_jax.contracts.profile_settings import SYNTHETIC_SHAPES
    from dflop_jax.planner.resolve import load_shapes
    from dflop_jax.profiling.auto_plan import shape_file

    source = cfg.profile.data_source
    if source in SYNTHETIC_SHAPES:
        return load_shapes(source, cfg.profile.data_samples, cfg.seed), source
    path = shape_file(auto_plan_dir(cfg)) if source == "dataset" else Path(source)
    if path.is_file():
        return load_shapes(str(path)), _file_input(path)
    log.warning("no shape distribution at %s (python -m dflop_jax.profile data writes it): "
                "planning on the data's shapes from metadata", path)  # fmt: skip
    return sample_shapes(cfg), "dataset"


def _file_input(path) -> dict:
    from dflop_jax.contracts.files import file_hash

    return {"path": str(Path(path).resolve()), "sha256": file_hash(path)}


def num_devices(cfg: TrainConfig) -> int:
    """The devices the run plans for: `num_devices`, else those JAX sees."""
    return cfg.num_devices or len(jax.devices())


def sample_shapes(cfg: TrainConfig):
    """(tiles, tokens) of the dataset's samples from metadata (bad samples left out)."""
    from dflop_jax.data import BadSample, Processor, load_source

    processor, shapes = Processor(cfg.data), []
    for record in load_source(cfg.data, cfg.seed):
        try:
            shapes.append(processor.shape(record))
        except BadSample:
            continue
    return shapes


# What a dry run of `plan: auto` says where no GPU is present.
DRY_RUN_ANALYTIC_NOTE = (
    "plan: auto profiles the model on the devices present, and these are {platform} devices, not "
    "GPUs: this dry run plans with the analytic costs (plan=analytic); on the GPU the run profiles first"
)


def dry_run(cfg: TrainConfig, show=print) -> list[dict]:
    """`python -m dflop_jax.train --dry-run`: resolve the run's plan, `show` it (a line at a time,
    before anything compiles), then compile each kind of stage program once at its largest buckets
    from abstract arrays (`profiling/compile_check.py`); nothing is materialized. Writes
    `run_dir/dry_run.yaml` (per stage: predicted and compiled GiB, compile seconds, the residual
    policy and the training programs' FLOPs summed over its buckets, compiled at the largest and
    scaled to the others by the cost model, `profiling/stage_report.py`; per transfer its bytes per
    microbatch) and returns its stages.

    `plan: auto` profiles the model on the devices present: without a GPU (a CPU checking a GPU
    config) the dry run plans with the analytic costs instead (`plan: analytic`), says so, and
    records it in dry_run.yaml (`plan_note`); profiling a real-size model on CPU would take hours and
    price a CPU."""
    import jax.numpy as jnp
    import yaml

    from dflop_jax.planner.plan_file import check_to_dict
    from dflop_jax.planner.progress import progress_bar
    from dflop_jax.profiling.stage_report import SCALED, stage_flops, transfer_bytes_per_microbatch

    note = ""
    if cfg.plan == "auto" and jax.devices()[0].platform != "gpu":
        note = DRY_RUN_ANALYTIC_NOTE.format(platform=jax.devices()[0].platform)
        show(note)
        cfg = dataclasses.replace(cfg, plan="analytic")
    cfg = with_plan_remat(cfg)
    model_cfg = abstract_model_config(cfg)
    multimodal = hasattr(model_cfg, "vision")
    with progress_bar() as progress:
        resolved = resolve_plan(cfg, model_cfg, progress)
    show("plan:")
    for line in resolved.describe(multimodal):
        show(f"  {line}")
    dtype, trainable = jnp.dtype(cfg.compute_dtype), tuple(cfg.optimizer.trainable)
    with progress_bar() as progress:  # each compile takes minutes at real sizes
        checks = compile_stages(cfg, model_cfg, resolved, progress)
    flops = stage_flops(resolved.layout, resolved.buckets, arch_of_model(model_cfg), checks,
                        multimodal)  # fmt: skip
    stages = [
        {"stage": c.stage, "memory_gib": round(c.predicted / 2**30, 2),
         **check_to_dict(c, c.predicted), **f}
        for c, f in zip(checks, flops)
    ]  # fmt: skip
    transfers = transfer_bytes_per_microbatch(resolved.layout, resolved.buckets, model_cfg, dtype,
                                              trainable)  # fmt: skip
    out = Path(cfg.run_dir) / "dry_run.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"flops": SCALED, **({"plan_note": note} if note else {}), "layout": stages,
              "transfers": transfers}  # fmt: skip
    out.write_text(yaml.safe_dump(report, sort_keys=False))
    return stages


def compile_stages(cfg: TrainConfig, model_cfg, resolved: ResolvedPlan, progress=None) -> list:
    """Every stage program of `resolved` compiled at its largest buckets under the residual policies
    the run trains (`resolved.residuals`), each `StageCheck` beside the memory model's prediction
    for the same policy: what `train --dry-run` and `plan --check` report."""
    import jax.numpy as jnp

    from dflop_jax.planner.scoring import in_flight
    from dflop_jax.profiling.compile_check import check_layout

    lay = resolved.layout
    counts = in_flight(lay.num_stages, resolved.microbatches[1], cfg.pipeline)
    predicted = [m.total() for m in predicted_stage_memory(cfg, model_cfg, resolved)]
    return check_layout(lay, resolved.buckets, counts, predicted, model_cfg,
                        compute_dtype=jnp.dtype(cfg.compute_dtype),
                        trainable=tuple(cfg.optimizer.trainable),
                        progress=progress or (lambda *_: None),
                        residuals=resolved.residuals)  # fmt: skip


def predicted_stage_memory(cfg: TrainConfig, model_cfg, resolved: ResolvedPlan) -> list:
    """The memory model's `StageMemory` per stage of `resolved` at its largest buckets and in-flight
    counts, under the residual policies the run trains (`resolved.residuals`): what the dry run and
    `plan --check` set beside the compiled programs."""
    from dflop_jax.costs import layout_memory
    from dflop_jax.planner.scoring import in_flight

    lay = resolved.layout
    counts = in_flight(lay.num_stages, resolved.microbatches[1], cfg.pipeline)
    provider = _memory_provider(cfg, model_cfg, resolved)
    return layout_memory(provider, lay, resolved.buckets, counts, residuals=resolved.residuals)


def _memory_provider(cfg: TrainConfig, model_cfg, resolved: ResolvedPlan):
    """The provider that predicts the dry run's stage memory: the plan's, unless a stage saves its
    residuals and the plan's provider (a measured cost table) prices "recompute" only; then the
    analytic memory model, as `stage_residuals` picks the policies with."""
    saving = any(r != "recompute" for r in resolved.residuals or ())
    if not saving or isinstance(resolved.provider, AnalyticCostProvider):
        return resolved.provider
    log.warning("the cost table prices recomputing stages only: the analytic memory model "
                "predicts the stages under residual policies %s", list(resolved.residuals))  # fmt: skip
    return analytic_provider(cfg, model_cfg)


def abstract_model_config(cfg: TrainConfig):
    """The run's `models` config (`ModelConfig.model_config`: no parameter is made; an HF directory
    gives it from its config.json alone, without reading the tokenizer)."""
    from dflop_jax.data import load_tokenizer

    vocab = 0 if cfg.model.hf_dir else load_tokenizer(cfg.data.tokenizer).vocab_size
    return cfg.model.model_config(vocab, tile_px=cfg.data.tile_px, patch_size=cfg.data.patch_size,
                                  compute_dtype=cfg.compute_dtype,
                                  pixel_norm=(cfg.data.mean, cfg.data.std))  # fmt: skip
