"""`RunContext`: everything a command derives from a run config, derived once.

The model config, its cost-model architecture, the resolved device (a preset, or the accelerator JAX
reports), the device count, the analytic cost provider, the planner settings and, for `plan=FILE`, the
plan file are each built here and nowhere else; commands build one context and pass it down.

Remat: the model config's per-module policy (`ModelConfig.vision_remat` / `llm_remat`) is what the
analytic costs assume; a plan.yaml brings its own (`Plan.remat`), which `RunContext.build` applies to
the model before its config is built, so the runtime recomputes what the plan's memory model assumed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any

import jax

from dflop_jax.costs import AnalyticCostProvider, DeviceSpec, MLLMArch, arch_of_model
from dflop_jax.planner.config import PlannerConfig
from dflop_jax.planner.plan_file import Plan, load_plan
from dflop_jax.planner.resolve import training_planner
from dflop_jax.planner.space import fit_search_space
from dflop_jax.programs.devices import run_device
from dflop_jax.runtime.config import TrainConfig

log = logging.getLogger(__name__)

PLAN_MODES = ("explicit", "analytic", "auto")  # any other `plan:` is a plan.yaml path


@dataclasses.dataclass(frozen=True)
class RunContext:
    """A run config resolved: what every command needs of it, computed once.

    Attributes:
      cfg: the run config, with a plan file's remat policy applied (`with_plan_remat`).
      model_cfg: the `models` config of the run's model (`ModelConfig.model_config`; no parameter
        is made).
      arch: its cost-model architecture, under the run's name (`run_name`: what the cost table and
        a plan record as the model).
      device: the accelerator's spec: the preset named, or the one JAX reports ("auto").
      num_devices: the devices the run plans for (`num_devices`, else those JAX sees).
      plan_file: the plan.yaml of `plan=FILE`, read once (None for the other plan modes).
    """

    cfg: TrainConfig
    model_cfg: Any
    arch: MLLMArch
    device: DeviceSpec
    num_devices: int
    plan_file: Plan | None = None

    @classmethod
    def build(cls, cfg: TrainConfig, *, read_plan: bool = True) -> RunContext:
        """The context of a run config: its plan file read, its remat applied, its model config
        built from the config (an HF directory's config.json, or the fields and the tokenizer's
        vocabulary). `read_plan=False`: a command that needs no plan (the HF export of a run whose
        plan file may be gone) reads none and applies none."""
        plan_file = None if not read_plan or cfg.plan in PLAN_MODES else load_plan(cfg.plan)
        cfg = with_plan_remat(cfg, plan_file)
        return cls._derive(cfg, cfg.model_config(), plan_file)

    @classmethod
    def of(cls, cfg: TrainConfig, model_cfg, plan_file: Plan | None = None) -> RunContext:
        """The context of `cfg` for a model config built elsewhere (a test's own); a plan file not
        given is read here."""
        if plan_file is None and cfg.plan not in PLAN_MODES:
            plan_file = load_plan(cfg.plan)
        return cls._derive(cfg, model_cfg, plan_file)

    @classmethod
    def _derive(cls, cfg: TrainConfig, model_cfg, plan_file: Plan | None) -> RunContext:
        devices = cfg.num_devices or len(jax.devices())
        return cls(cfg, model_cfg, arch_of_model(model_cfg, run_name(cfg)), run_device(cfg.device),
                   devices, plan_file)  # fmt: skip

    @property
    def multimodal(self) -> bool:
        """Whether the model has a vision encoder (the planner places its stages)."""
        return self.cfg.model.has_vision

    @property
    def trainable(self) -> tuple[str, ...]:
        return tuple(self.cfg.optimizer.trainable)

    @property
    def name(self) -> str:
        return run_name(self.cfg)

    @property
    def attention_impl(self) -> str:
        """The attention implementation the model's decoder runs ("xla" when unset): what the
        memory model prices (`costs/memory.py`)."""
        return getattr(self.model_cfg, "text", self.model_cfg).attention_impl or "xla"

    @functools.cached_property
    def analytic(self) -> AnalyticCostProvider:
        """The analytic costs of the run: its model's remat, its recipe, its attention kernel."""
        return AnalyticCostProvider(self.arch, self.device, remat=self.cfg.model.remat,
                                    trainable=self.trainable,
                                    attention_impl=self.attention_impl)  # fmt: skip

    @functools.cached_property
    def planner(self) -> PlannerConfig:
        """The run's planner settings (`training_planner`: its batch, recipe, what the runtime
        trains), its search space fitted to the run's devices (a space nothing satisfies is one
        config error, raised before any profiling). The uniform baseline keeps its own space."""
        cfg = self.cfg
        planner = training_planner(cfg.planner, cfg.global_batch, self.multimodal, self.trainable,
                                   cfg.steps)  # fmt: skip
        if planner.mode == "uniform":
            return planner
        return fit_search_space(self.arch, self.num_devices, self.device, planner)

    @property
    def auto_plan_dir(self) -> Path:
        return auto_plan_dir(self.cfg)


def auto_plan_dir(cfg: TrainConfig) -> Path:
    """Where the profiling steps and `plan: auto` write and reuse their outputs (the data step
    needs no more of the run than this)."""
    return Path(cfg.run_dir) / "auto_plan"


def run_name(cfg: TrainConfig) -> str:
    """The model's name in the cost table and the plan of `plan: auto` and the CLI steps: its named
    architecture where it has one (then `python -m dflop_jax.simulate` replays the plan), that name
    with "-llm<N>" for the architecture cut to its first N decoder layers (`model.llm_layers_kept`;
    not a named one), else "<kind>-run"."""
    model = cfg.model
    if model.arch and model.llm_layers_kept:
        return f"{model.arch}-llm{model.llm_layers_kept}"
    return model.arch or f"{model.kind}-run"


def with_plan_remat(cfg: TrainConfig, plan_file: Plan | None) -> TrainConfig:
    """`cfg` with its plan file's remat policy in the model config (unchanged for other plans)."""
    if plan_file is None:
        return cfg
    remat = plan_file.remat
    if remat != cfg.model.remat:
        log.warning(
            "model remat %s replaced by the plan's %s (%s)", cfg.model.remat, remat, cfg.plan
        )
    model = dataclasses.replace(cfg.model, vision_remat=remat["vision"], llm_remat=remat["llm"])
    return dataclasses.replace(cfg, model=model)
