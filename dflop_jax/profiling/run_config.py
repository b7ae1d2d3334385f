"""Root configs of `python -m dflop_jax.profile model` and `... profile auto` (pure Python, so the CLI
parses and validates them before any JAX work)."""

from __future__ import annotations

import dataclasses

from dflop_jax.config import require
from dflop_jax.contracts.profile_settings import ProfileSettings
from dflop_jax.costs.recipe import TRAINABLE_PARTS
from dflop_jax.profiling.pipeline import AutoPlanConfig


@dataclasses.dataclass(frozen=True)
class ModelProfileConfig:
    """Root config of `profile model`.

    Attributes:
      arch: architecture name (`dflop_jax.costs.list_archs()`, LLaVA-style) whose real `models/`
        stages are profiled with random weights.
      num_cpu_devices: simulated devices when running on CPU.
      profile: grid and timing settings.
      out: cost-table path (the PNG goes beside it).
      trainable: the training recipe profiled (each part's programs as the recipe runs them, e.g.
        `trainable=[projector]` for LLaVA-OV stage 1; costs/recipe.py). Default: all trained.
    """

    arch: str = "tiny"
    num_cpu_devices: int = 8
    profile: ProfileSettings = ProfileSettings()
    out: str = "runs/profile/cost_table.json"
    trainable: tuple[str, ...] = TRAINABLE_PARTS

    def __post_init__(self):
        require(self.num_cpu_devices >= 1, "num_cpu_devices", self.num_cpu_devices, "must be >= 1")
        chosen = self.trainable
        ok = (
            bool(chosen) and len(set(chosen)) == len(chosen) and set(chosen) <= set(TRAINABLE_PARTS)
        )
        require(
            ok,
            "trainable",
            list(chosen),
            f"give a non-empty subset of {list(TRAINABLE_PARTS)}, no repeats",
        )


@dataclasses.dataclass(frozen=True)
class AutoPlanRunConfig:
    """Root config of `profile auto` (data profile -> model profile -> plan, `profiling.pipeline`).

    Attributes:
      arch: architecture name (LLaVA-style, `dflop_jax.costs.list_archs()`).
      cache_dir: where the data profile, cost table and plan are written and reused while fresh.
      data_config: a YAML file with a `data:` section, read when auto.data_source is "dataset".
      num_cpu_devices: simulated devices when running on CPU.
      auto: the pipeline's settings.
    """

    arch: str = "tiny"
    cache_dir: str = "runs/auto_plan"
    data_config: str = ""
    num_cpu_devices: int = 8
    auto: AutoPlanConfig = AutoPlanConfig()

    def __post_init__(self):
        require(self.num_cpu_devices >= 1, "num_cpu_devices", self.num_cpu_devices, "must be >= 1")
        require(self.auto.data_source != "dataset" or bool(self.data_config), "data_config",
                self.data_config, "give a YAML with a `data:` section or set auto.data_source")  # fmt: skip
