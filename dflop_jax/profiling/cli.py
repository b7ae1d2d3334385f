"""`python -m dflop_jax.profile model`: profile a model's stage parts into a cost table (+ PNG).

    python -m dflop_jax.profile model --config configs/profile_tiny_cpu.yaml [key=value ...]
    python -m dflop_jax.profile model arch=tiny profile.tps=[1,2] out=runs/profile/cost_table.json

Runs on the devices JAX sees (on CPU: `num_cpu_devices` simulated devices).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from dflop_jax.config import ConfigError, load_config, require
from dflop_jax.host_devices import simulate_cpu_devices
from dflop_jax.profiling.settings import ProfileSettings


@dataclasses.dataclass(frozen=True)
class ModelProfileConfig:
    """Root config of `profile model`.

    Attributes:
      arch: architecture name (`dflop_jax.costs.list_archs()`, LLaVA-style) whose real `models/`
        stages are profiled with random weights.
      num_cpu_devices: simulated devices when running on CPU.
      profile: grid and timing settings.
      out: cost-table path (the PNG goes beside it).
    """

    arch: str = "tiny"
    num_cpu_devices: int = 8
    profile: ProfileSettings = ProfileSettings()
    out: str = "runs/profile/cost_table.json"

    def __post_init__(self):
        require(self.num_cpu_devices >= 1, "num_cpu_devices", self.num_cpu_devices, "must be >= 1")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML with arch / profile / out")
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. profile.runs=10")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_model(args: argparse.Namespace) -> int:
    """Entry of the `model` subcommand (parsed args from `add_model_args`)."""
    if args.config is None and not args.overrides:  # a bare `profile model` would run for long
        print("error: give --config YAML or key=value overrides (e.g. `profile model arch=tiny`)",
              file=sys.stderr)  # fmt: skip
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    try:
        cfg = load_config(ModelProfileConfig, args.config, args.overrides)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    simulate_cpu_devices(cfg.num_cpu_devices)
    from dflop_jax.planner.progress import progress_bar
    from dflop_jax.profiling.model_config import model_config_for_arch
    from dflop_jax.profiling.model_profiler import profile_model

    try:
        model_cfg = model_config_for_arch(cfg.arch, cfg.profile.compute_dtype)
        with progress_bar(not args.no_progress) as progress:
            table = profile_model(model_cfg, None, cfg.profile, cfg.out, model_name=cfg.arch,
                                  progress=progress)  # fmt: skip
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ok = sum(e.ok for e in table.entries.values())
    print(f"wrote {cfg.out} ({ok} entries, {len(table.skipped())} skipped) and "
          f"{os.path.splitext(cfg.out)[0]}.png")  # fmt: skip
    return 0
