"""Profiling entry point: DFLOP's profiling engine (data, model) and its run up to a plan (auto).

    python -m dflop_jax.profile data --config configs/data_internvl_stats.yaml [key=value ...]
    python -m dflop_jax.profile model arch=tiny "profile.tps=[1,2]" [--config X.yaml] [--no-progress]
    python -m dflop_jax.profile auto --config configs/auto_plan_tiny_cpu.yaml [--profile-only] [key=value ...]

data:  the shape distribution of a dataset sample (`dflop_jax.data.profile`).
model: per-stage cost table (+ PNG) of an architecture's real stage programs on the devices JAX sees
       (on CPU: `num_cpu_devices` simulated devices; `dflop_jax.profiling.model_profiler`).
auto:  data profile -> model profile -> plan in `cache_dir`, each reused while fresh
       (`dflop_jax.profiling.pipeline`): data/shape_distribution.json, cost_table.json (+ .png),
       plan.yaml, cost_sources.json, timings.json; `--profile-only` stops before the plan.
"""

from __future__ import annotations

import logging
import os
import sys

from dflop_jax.config import ConfigError, read_yaml
from dflop_jax.config.cli import Command, load_command_config
from dflop_jax.host_devices import simulate_cpu_devices

COMMAND = Command(
    prog="python -m dflop_jax.profile",
    description=__doc__.split("\n")[0],
    example="python -m dflop_jax.profile data --config configs/data_llava_ov.yaml data.synth_samples=64",
    modes={
        "no-progress": "model: no progress bar",
        "profile-only": "auto: stop after the data and model profiles",
    },
    positional=("what", ("data", "model", "auto")),
)


def main(argv: list[str] | None = None) -> int:
    args = COMMAND.parse(argv)
    if args.what == "model" and args.config is None and not args.overrides:
        return _error("give --config YAML or key=value overrides (e.g. `profile model arch=tiny`)")
    logging.basicConfig(level=logging.WARNING if args.what == "data" else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")  # fmt: skip
    logging.getLogger("jax").setLevel(logging.WARNING)
    try:
        cfg = load_command_config(_root(args.what), args)
        data_cfg = _training_data(cfg) if args.what == "auto" else None
    except (ConfigError, ValueError) as e:
        return _error(e)
    if args.what == "data":
        return _data(cfg)
    simulate_cpu_devices(cfg.num_cpu_devices)
    return (
        _model(cfg, args.no_progress)
        if args.what == "model"
        else _auto(cfg, data_cfg, args.profile_only)
    )


def _root(what: str):
    if what == "data":
        from dflop_jax.data.profile import DataProfileConfig

        return DataProfileConfig
    from dflop_jax.profiling.run_config import AutoPlanRunConfig, ModelProfileConfig

    return ModelProfileConfig if what == "model" else AutoPlanRunConfig


def _training_data(cfg):
    """The training `DataConfig` of `cfg.data_config` when the auto run profiles the dataset."""
    if cfg.auto.data_source != "dataset":
        return None
    from dflop_jax.config.loader import from_dict
    from dflop_jax.data.config import DataConfig

    raw = read_yaml(cfg.data_config)
    if "data" not in raw:
        raise ConfigError(f"data_config={cfg.data_config}: no `data:` section; add one")
    return from_dict(DataConfig, raw["data"], "data")


def _data(cfg) -> int:
    from dflop_jax.data.profile import profile_data

    try:
        path = profile_data(cfg.data, cfg.profile.num_samples, cfg.profile.seed, cfg.profile.out)
    except ValueError as e:
        return _error(e)
    print(f"wrote {path} and {path.with_name('shape_histogram.png')}")
    return 0


def _model(cfg, no_progress: bool) -> int:
    from dflop_jax.planner.progress import progress_bar
    from dflop_jax.profiling.model_config import model_config_for_arch
    from dflop_jax.profiling.model_profiler import profile_model

    try:
        model_cfg = model_config_for_arch(cfg.arch, cfg.profile.compute_dtype)
        with progress_bar(not no_progress) as progress:
            table = profile_model(model_cfg, None, cfg.profile, cfg.out, model_name=cfg.arch,
                                  progress=progress, trainable=cfg.trainable)  # fmt: skip
    except ValueError as e:
        return _error(e)
    ok = sum(e.ok for e in table.entries.values())
    print(f"wrote {cfg.out} ({ok} entries, {len(table.skipped())} skipped) and "
          f"{os.path.splitext(cfg.out)[0]}.png")  # fmt: skip
    return 0


def _auto(cfg, data_cfg, profile_only: bool) -> int:
    from dflop_jax.planner import PlanningError, describe_layout
    from dflop_jax.profiling.model_config import model_config_for_arch
    from dflop_jax.profiling.pipeline import ensure_plan

    try:
        model_cfg = model_config_for_arch(cfg.arch, cfg.auto.profile.compute_dtype)
        plan = ensure_plan(cfg.auto, model_cfg, cfg.cache_dir, data_cfg, name=cfg.arch,
                           plan=not profile_only)  # fmt: skip
    except (ConfigError, PlanningError, ValueError, FileNotFoundError) as e:
        return _error(e)
    if plan is None:
        print(f"profiles in {cfg.cache_dir}")
    else:
        print(f"{describe_layout(plan.layout)} | M={plan.microbatches}: step "
              f"{plan.step_time_mean_s * 1e3:.1f} ms -> {cfg.cache_dir}/plan.yaml")  # fmt: skip
    return 0


def _error(message) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
