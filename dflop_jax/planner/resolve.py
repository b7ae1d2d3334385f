"""The plan a training run trains with (`TrainConfig.plan`), as far as it needs no devices. No jax.

    resolved = ResolvedPlan(layout, buckets, (2, 6), provider)                     # plan: explicit
    resolved = ResolvedPlan.of(analytic_plan(arch, device, ...), provider)        # plan: analytic
    resolved = ResolvedPlan.of(load_plan("runs/x/plan.yaml"), provider)          # plan: <path>

`plan: auto` (profile the model on the devices, then plan) needs jax: the entry point runs it through
`dflop_jax.profiling.auto_plan.profiled_plan`, which returns a `Plan` and its measured cost provider;
the planner never calls the profiler.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from dflop_jax.contracts import BucketSet, SampleShape, ScheduleProblem
from dflop_jax.contracts.layout import Layout
from dflop_jax.costs import CostProvider, DeviceSpec, MLLMArch, layout_stage_costs
from dflop_jax.costs.compile import compile_cost
from dflop_jax.costs.recipe import TRAINABLE_PARTS
from dflop_jax.planner.config import PlannerConfig
from dflop_jax.planner.plan_file import Plan, save_plan
from dflop_jax.planner.search import make_plan

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ResolvedPlan:
    """What the trainer runs: layout, buckets, microbatch range, the costs the scheduler predicts
    with, and each stage's residual policy (`contracts.cost_table.RESIDUAL_POLICIES`; None: "recompute")."""

    layout: Layout
    buckets: BucketSet
    microbatches: tuple[int, int]
    provider: CostProvider
    residuals: tuple[str, ...] | None = None

    @classmethod
    def of(cls, plan: Plan, provider: CostProvider) -> ResolvedPlan:
        """The plan's layout, buckets, microbatch range and residual policies, priced by
        `provider`."""
        residuals = plan.residuals or None
        return cls(plan.layout, plan.buckets, plan.microbatch_range, provider, residuals)

    def problem(self) -> ScheduleProblem:
        """The scheduling problem of every global batch: dp degrees, buckets, predicted stage costs
        (each stage's under its residual policy)."""
        lay = self.layout
        costs = layout_stage_costs(self.provider, lay, self.residuals)
        return ScheduleProblem(
            lay.encoder_dp, lay.llm_dp, lay.num_stages, self.microbatches, self.buckets, costs,
            tiles_by_row=lay.tiles_by_row, row_align=lay.row_align,
            audio_always=bool(lay.audio_stages),
        )  # fmt: skip

    def describe(self, multimodal: bool, devices: list[list[int]] | None = None) -> list[str]:
        """The plan for people, a line per stage (with its device ids when given, and the
        encoders the first LLM stage runs itself), its buckets (the sparse pairs' count where
        narrowed), microbatches and residual policies, and what compiling it costs
        (`costs.compile.compile_cost` with the plan's provider)."""
        lay, lines = self.layout, []
        colocated = [name for name, here in (
            ("vision encoder", multimodal and not lay.encoder_stages),
            ("audio encoder", bool(self.buckets.audio) and not lay.audio_stages)) if here]  # fmt: skip
        for i, s in enumerate(lay.stages):
            where = f" devices={devices[i]}" if devices else ""
            runs = f" + {' + '.join(colocated)}" if colocated and i == lay.first_llm else ""
            lines.append(f"stage {i}: {s.module}{runs} layers {s.first_layer}.."
                         f"{s.first_layer + s.num_layers - 1} dp={s.dp} tp={s.tp} "
                         f"emb={s.has_embedding} head={s.has_head}{where}")  # fmt: skip
        b = self.buckets
        pairs = "" if b.grid else f" pairs={len(b.pairs)} of {len(b.tiles) * len(b.lengths)}"
        audio = f" audio={b.audio}" if b.audio else ""
        per = "encoder shard, pooled" if lay.pooled_tiles else "row"
        per = f" (per {per})" if multimodal and lay.encoder_stages else ""
        lines.append(f"buckets tiles={b.tiles}{per} lengths={b.lengths}{pairs}{audio} microbatches="
                     f"{self.microbatches} residuals={list(self.residuals or ['recompute'])}")  # fmt: skip
        trainable = getattr(self.provider, "trainable", TRAINABLE_PARTS)
        cost = compile_cost(self.provider, self.layout, b, multimodal, trainable)
        lines.append(f"compile: {cost.programs} stage, transfer and per-step programs, estimated "
                     f"{cost.seconds:.0f}s ({self.provider.name})")  # fmt: skip
        return lines

    def check_runnable(self, mode: str, multimodal: bool) -> ResolvedPlan:
        """Raises ValueError if the runtime cannot run this plan; returns it otherwise."""
        check_runnable(self.layout, mode, multimodal)
        return self


def check_runnable(layout: Layout, mode: str, multimodal: bool) -> None:
    """Raises ValueError if the runtime cannot run `layout` (also used at config load, on plan files);
    `multimodal`: the model has a vision encoder.

    An encoder colocated on LLM stage 0 runs at that stage's tp (`programs/stage_builder.py`); the
    heads check needs the model and is made when the stages are built."""
    own = layout.colocated_encoder_tp
    if multimodal and own is not None and own != layout.llm_stages[0].tp:
        raise ValueError(
            f"plan={mode}: the encoder is colocated at its own tp={own} < LLM stage 0's "
            f"tp={layout.llm_stages[0].tp}, which the runtime does not run (it runs a colocated "
            "encoder at the stage's tp); plan for training (plan=auto/analytic restrict it)"
        )
    if not multimodal and layout.encoder_stages:
        raise ValueError(
            "the model has no vision encoder (model.kind decoder or qwen2_audio): the plan's "
            "vision encoder stages cannot run; give layout.encoder_layers=[]"
        )


def training_planner(
    planner: PlannerConfig,
    global_batch: int,
    multimodal: bool,
    trainable: tuple[str, ...] | None = None,
    steps: int | None = None,
) -> PlannerConfig:
    """The planner settings of a training run: its global batch and steps (over which compiling
    is amortized; None: the planner's own); its recipe (`optimizer.trainable`, None: the planner's
    own); a colocated encoder only at LLM stage 0's own tp (the runtime runs no colocated encoder
    at a smaller tp); no encoder stages for a decoder-only model. The planner's choice between
    separate and colocated encoders is otherwise its own; the drift keys (`replan_*`) are the
    trainer's."""
    trainable = planner.trainable if trainable is None else tuple(trainable)
    steps = planner.steps if steps is None else steps
    steps = steps if planner.price_compile else 0
    # The run's drift schedule is no search setting: plans (and plan: auto's cache) ignore it.
    base = PlannerConfig()
    return dataclasses.replace(
        planner, global_batch=global_batch, steps=steps, colocate_own_tp=False, trainable=trainable,
        encoder_stages=planner.encoder_stages and multimodal,
        replan_every=base.replan_every, replan_batches=base.replan_batches, replan=base.replan,
        replan_threshold=base.replan_threshold,
    )  # fmt: skip


def analytic_plan(
    arch: MLLMArch,
    device: DeviceSpec,
    num_devices: int,
    planner: PlannerConfig,
    shapes: Callable[[], Sequence[SampleShape]],
    out_dir: str | Path,
    provider: CostProvider | None = None,
    progress=None,
) -> Plan:
    """Plans on the dataset's `shapes()` with analytic costs (`provider`, default the plain analytic
    one) and saves `out_dir/plan.yaml`."""
    plan = make_plan(arch, device, num_devices, shapes(), planner, provider, progress)
    save_plan(plan, Path(out_dir) / "plan.yaml")
    return plan


def check_plan_fits_run(plan: Plan, path: str, arch: MLLMArch, device: DeviceSpec,
                        num_devices: int, trainable: tuple[str, ...], global_batch: int) -> None:  # fmt: skip
    """Raises a one-line ConfigError when a plan.yaml was made for another model (its layers, or the
    named architecture's widths), recipe (trained parts), device kind, device count or global batch
    than the run's (its buckets and microbatch counts are sized for its global batch)."""
    from dflop_jax.config import ConfigError
    from dflop_jax.costs import get_arch, list_archs

    lay, problems = plan.layout, []
    layers = (
        sum(s.num_layers for s in lay.encoder_stages),
        sum(s.num_layers for s in lay.llm_stages),
    )
    want = (arch.vision.num_layers if lay.encoder_stages else 0, arch.llm.num_layers)
    named = get_arch(plan.model) if plan.model in list_archs() else None
    widths = (named.vision.hidden_size, named.llm.hidden_size) if named else None
    if layers != want or widths not in (None, (arch.vision.hidden_size, arch.llm.hidden_size)):
        problems.append(f"model {plan.model!r} (this run's has {want[0]} + {want[1]} layers)")
    planned = tuple(plan.planner_config.get("trainable", trainable))
    if set(planned) != set(trainable):
        problems.append(f"recipe trainable={list(planned)} (this run trains {list(trainable)})")
    if plan.device != device.name:
        problems.append(f"device {plan.device!r} (this run's is {device.name!r})")
    if plan.num_devices != num_devices:
        problems.append(f"{plan.num_devices} devices (this run has {num_devices})")
    fix = "re-plan for this run (python -m dflop_jax.plan) or use plan=auto"
    if plan.global_batch != global_batch:
        problems.append(f"global_batch={plan.global_batch} (this run's is {global_batch})")
        fix += f", or set global_batch={plan.global_batch}"
    if problems:
        raise ConfigError(f"plan={path} was made for " + "; ".join(problems) + f": {fix}")


def plan_data_note(plan: Plan, path: str, shapes: str | Path) -> str:
    """One line when the plan records the shape distribution it was made from (`Plan.inputs`: a path
    and its sha256) and the run's own shape file `shapes` exists with other contents: the data
    profile changed since the plan was made. "" otherwise."""
    from dflop_jax.contracts.files import file_hash

    made = plan.inputs.get("shapes")
    if not isinstance(made, dict) or "sha256" not in made or not Path(shapes).is_file():
        return ""
    now = file_hash(shapes)
    if now == made["sha256"]:
        return ""
    return (
        f"plan={path} was made from the shape distribution {made.get('path')} (sha256 "
        f"{made['sha256'][:12]}), but this run's {shapes} differs (sha256 {now[:12]}): the data "
        "changed since the plan was made; re-plan (python -m dflop_jax.plan) to plan for it"
    )


def load_shapes(
    source, samples: int = 4000, seed: int = 0, audio: bool = False, vision: bool = True
):
    """The shape distribution (list of SampleShape) of a synthetic mix's name (`samples` of it,
    seeded) or of a shape-distribution JSON path. For a model without an audio encoder (`audio`
    False) less the samples with audio, and without a vision encoder (`vision` False) less those
    with images: the loader skips them (`no_audio_encoder`, `no_vision_encoder`) and a plan
    counting them would plan for work the run never does."""
    from dflop_jax.scheduler import llava_ov_mix, load_shape_distribution, omnibal_shapes

    if source == "llava-ov":
        return llava_ov_mix(samples, seed)
    if source == "omnibal":
        return omnibal_shapes()
    shapes = load_shape_distribution(source)
    heard = sum(1 for s in shapes if s.audio_windows)
    if heard and not audio:
        log.warning("planning without the %d of %d profiled samples that hold audio: the model has "
                    "no audio encoder, so the run skips them", heard, len(shapes))  # fmt: skip
        shapes = [s for s in shapes if not s.audio_windows]
    seen = sum(1 for s in shapes if s.tiles)
    if seen and not vision:
        log.warning("planning without the %d of %d profiled samples that hold images: the model "
                    "has no vision encoder, so the run skips them", seen, len(shapes))  # fmt: skip
        shapes = [s for s in shapes if not s.tiles]
    if not shapes:
        raise ValueError(f"{source}: every profiled sample holds media the model has no encoder "
                         "for")  # fmt: skip
    return shapes
