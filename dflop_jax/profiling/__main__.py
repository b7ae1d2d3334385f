"""Profile -> plan from a YAML, reusing fresh outputs (DFLOP's profiling and optimization steps).

    python -m dflop_jax.profiling --config configs/auto_plan_tiny_cpu.yaml [key=value ...]
    python -m dflop_jax.profiling --config ... --profile-only     # data + model profile only

Outputs in `cache_dir`: data/shape_distribution.json, cost_table.json (+ .png), plan.yaml,
cost_sources.json, timings.json (see `dflop_jax.profiling.pipeline`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from dflop_jax.config import ConfigError, load_config, read_yaml, require
from dflop_jax.host_devices import simulate_cpu_devices
from dflop_jax.profiling.pipeline import AutoPlanConfig


@dataclasses.dataclass(frozen=True)
class AutoPlanRunConfig:
    """Attributes: arch (LLaVA-style name), cache_dir, data_config (YAML with a `data:` section, for
    auto.data_source == "dataset"), num_cpu_devices (simulated on CPU), auto (the pipeline settings)."""

    arch: str = "tiny"
    cache_dir: str = "runs/auto_plan"
    data_config: str = ""
    num_cpu_devices: int = 8
    auto: AutoPlanConfig = AutoPlanConfig()

    def __post_init__(self):
        require(self.num_cpu_devices >= 1, "num_cpu_devices", self.num_cpu_devices, "must be >= 1")
        require(self.auto.data_source != "dataset" or bool(self.data_config), "data_config",
                self.data_config, "give a YAML with a `data:` section or set auto.data_source")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dflop_jax.profiling", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--config", default=None, help="AutoPlanRunConfig YAML")
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. auto.num_devices=8")
    ap.add_argument(
        "--profile-only", action="store_true", help="stop after the data and model profiles"
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    try:
        cfg = load_config(AutoPlanRunConfig, args.config, args.overrides)
        data_cfg = None
        if cfg.auto.data_source == "dataset":
            from dflop_jax.config.loader import from_dict
            from dflop_jax.data.config import DataConfig

            raw = read_yaml(cfg.data_config)
            if "data" not in raw:
                raise ConfigError(f"data_config={cfg.data_config}: no `data:` section; add one")
            data_cfg = from_dict(DataConfig, raw["data"], "data")
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    simulate_cpu_devices(cfg.num_cpu_devices)
    from dflop_jax.planner import PlanningError, describe_layout
    from dflop_jax.profiling.model_config import model_config_for_arch
    from dflop_jax.profiling.pipeline import ensure_plan

    try:
        model_cfg = model_config_for_arch(cfg.arch, cfg.auto.profile.compute_dtype)
        plan = ensure_plan(cfg.auto, model_cfg, cfg.cache_dir, data_cfg, name=cfg.arch,
                           plan=not args.profile_only)  # fmt: skip
    except (ConfigError, PlanningError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if plan is not None:
        print(f"{describe_layout(plan.layout)} | M={plan.microbatches}: step "
              f"{plan.step_time_mean_s * 1e3:.1f} ms -> {cfg.cache_dir}/plan.yaml")  # fmt: skip
    else:
        print(f"profiles in {cfg.cache_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
