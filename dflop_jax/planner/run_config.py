"""`PlanRunConfig`: the root config of `python -m dflop_jax.plan` (model, device, devices, data, planner).

python -m dflop_jax.plan --config configs/plan_llava_ov_7b_h100x64.yaml planner.samples=8
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from dflop_jax.config import InputPath, require, require_seed
from dflop_jax.costs.devices import DeviceConfig
from dflop_jax.planner.config import PlannerConfig

SYNTHETIC_DATA = ("llava-ov", "omnibal")


@dataclasses.dataclass(frozen=True)
class ShapeSourceConfig:
    """Where the planner's shape distribution comes from (the `data:` section of a plan config; the
    training data itself is `dflop_jax.data.DataConfig`).

    Attributes:
      source: a shape-distribution JSON file (the data profiler's output), or "llava-ov" (synthetic
        LLaVA-OV-like mix of `synth_samples` samples) or "omnibal" (the real InternVL statistics).
      synth_samples: size of the synthetic llava-ov mix.
      seed: seed of the synthetic mix.
    """

    source: str = "llava-ov"
    synth_samples: int = 4000
    seed: int = 0

    def __post_init__(self):
        require(
            bool(self.source),
            "data.source",
            self.source,
            f"give a shape file or one of {SYNTHETIC_DATA}",
        )
        require(
            self.synth_samples >= 1,
            "data.synth_samples",
            self.synth_samples,
            "must be >= 1",
        )
        require_seed(self.seed, "data.seed")

    def inputs(self) -> list[InputPath]:
        if self.source in SYNTHETIC_DATA:
            return []
        fix = f"give a shape-distribution JSON (python -m dflop_jax.profile data) or one of {SYNTHETIC_DATA}"
        return [InputPath("source", self.source, "file", fix)]


@dataclasses.dataclass(frozen=True)
class PlanRunConfig:
    """One planning run.

    Attributes:
      model: architecture name (`dflop_jax.costs.list_archs()`).
      device: the accelerator (`DeviceConfig`): "auto" = the one JAX reports here, or a preset name
        (`device=h100 num_devices=64` plans for a cluster one is not on).
      num_devices: devices available.
      remat: the cost provider assumes full activation recomputation (less memory, more time).
      mode: "dflop" (data-aware) or "uniform" (the data-blind baseline layout).
      data: the shape distribution.
      cost_table: a measured cost table (`cost_table.json` of `python -m dflop_jax.profile model`) the
        planner prices stages with, the analytic model filling what it lacks; "" = the analytic model.
      planner: search space and scoring.
      out: where plan.yaml goes (the resolved config is written beside it as plan.config.yaml).
    """

    model: str = "siglip-so400m+qwen2.5-7b"
    device: DeviceConfig = DeviceConfig()
    num_devices: int = 8
    remat: bool = False
    mode: Literal["dflop", "uniform"] = "dflop"
    data: ShapeSourceConfig = dataclasses.field(default_factory=ShapeSourceConfig)
    cost_table: str = ""
    planner: PlannerConfig = dataclasses.field(default_factory=PlannerConfig)
    out: Path = Path("plan.yaml")

    def __post_init__(self):
        from dflop_jax.costs import list_archs

        require(
            self.model in list_archs(),
            "model",
            self.model,
            f"choose one of {', '.join(list_archs())}",
        )
        require(self.num_devices >= 1, "num_devices", self.num_devices, "need at least 1 device")
        require(self.out.suffix in (".yaml", ".yml"), "out", str(self.out),
                "give the plan.yaml path to write")  # fmt: skip

    def inputs(self) -> list[InputPath]:
        if not self.cost_table:
            return []
        fix = "give a cost_table.json (python -m dflop_jax.profile model) or '' for analytic costs"
        return [InputPath("cost_table", self.cost_table, "file", fix)]


def plan_inputs(cfg: PlanRunConfig) -> dict:
    """What a plan made from `cfg` was made from (`Plan.inputs`): files by path and content hash."""
    from dflop_jax.contracts.files import file_hash

    def source(path: str) -> dict:
        return {"path": str(Path(path).resolve()), "sha256": file_hash(path)}

    shapes = cfg.data.source
    out = {"shapes": shapes if shapes in SYNTHETIC_DATA else source(shapes)}
    out["cost_table"] = source(cfg.cost_table) if cfg.cost_table else "analytic"
    return out


def load_shapes(data: ShapeSourceConfig):
    """The shape distribution named by `data` (list of SampleShape)."""
    from dflop_jax.scheduler import llava_ov_mix, load_shape_distribution, omnibal_shapes

    if data.source == "llava-ov":
        return llava_ov_mix(data.synth_samples, data.seed)
    if data.source == "omnibal":
        return omnibal_shapes()
    return load_shape_distribution(data.source)
