"""Profiling entry point: DFLOP's profiling engine (data, model) and its run up to a plan (auto).

    python -m dflop_jax.profile data --config RUN.yaml [key=value ...]
    python -m dflop_jax.profile model --config RUN.yaml [--no-progress]
    python -m dflop_jax.profile auto --config RUN.yaml [--profile-only]

Every step reads the run config (`TrainConfig`, the file `python -m dflop_jax.train` and
`python -m dflop_jax.plan` read; default `configs/demo.yaml`) and writes into `run_dir/auto_plan`,
each output reused while fresh (`dflop_jax.profiling.auto_plan`): the same files `train plan=auto`
reads, so a run trains on what these commands measured.
data:  the shape distribution of the run's `data` (`profile.data_samples` records drawn with `seed`)
       -> data/shape_distribution.json (+ histogram; `dflop_jax.data.shape_profile`).
model: per-stage cost table (+ PNG) of the run's model (`model`: random weights) on the devices JAX
       sees (on CPU: `num_devices` or `num_cpu_devices` simulated devices), grid from `profile`,
       under the run's recipe (`optimizer.trainable`) -> cost_table.json.
auto:  data -> model -> plan.yaml (+ cost_sources.json, timings.json); `--profile-only` stops before
       the plan. `python -m dflop_jax.plan` instead plans into `run_dir/plan.yaml`.
"""

from __future__ import annotations

import logging
import sys

from dflop_jax.config import ConfigError
from dflop_jax.config.cli import Command, config_error, load_command_config
from dflop_jax.host_devices import simulate_cpu_devices

COMMAND = Command(
    prog="python -m dflop_jax.profile",
    description=__doc__.split("\n")[0],
    example="python -m dflop_jax.profile data --config configs/data_llava_ov.yaml "
    "data.synth_samples=64 profile.data_samples=64",
    modes={
        "no-progress": "no progress (a bar on a terminal, else a line every 10 s)",
        "profile-only": "auto: stop after the data and model profiles",
    },
    positional=("what", ("data", "model", "auto")),
)


def main(argv: list[str] | None = None) -> int:
    from dflop_jax.runtime.config import TrainConfig
    from dflop_jax.train import DEMO_CONFIG

    args = COMMAND.parse(argv)
    logging.basicConfig(level=logging.WARNING if args.what == "data" else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")  # fmt: skip
    logging.getLogger("jax").setLevel(logging.WARNING)
    try:
        cfg = load_command_config(TrainConfig, args, DEMO_CONFIG)
    except (ConfigError, ValueError) as e:
        return config_error(e)
    simulate_cpu_devices(cfg.num_devices or cfg.num_cpu_devices)  # before JAX starts

    from dflop_jax.planner import PlanningError

    try:
        return {"data": _data, "model": _model, "auto": _auto}[args.what](cfg, args)
    except ConfigError as e:
        return config_error(e)
    except (PlanningError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _steps(cfg):
    """(the run's context, the auto-plan workflow's settings)."""
    from dflop_jax.resolve import RunContext
    from dflop_jax.resolve.plan_sources import auto_plan_config

    ctx = RunContext.build(cfg)
    return ctx, auto_plan_config(ctx)


def _data(cfg, args) -> int:
    from dflop_jax.planner.progress import progress_bar
    from dflop_jax.profiling.auto_plan import AutoPlanConfig, data_profile
    from dflop_jax.resolve.run_context import auto_plan_dir

    # the data step reads only these (the model and its search space play no part)
    auto = AutoPlanConfig(data_source=cfg.profile.data_source,
                          data_samples=cfg.profile.data_samples, seed=cfg.seed)  # fmt: skip
    cache = auto_plan_dir(cfg)
    if auto.data_source != "dataset":
        print(f"profile.data_source={auto.data_source}: the plan reads that, nothing to profile")
        return 0
    with progress_bar(not args.no_progress) as progress:
        path, _ = data_profile(auto, cfg.data, cache, {}, progress)
    print(f"wrote {path} and {path.with_name('shape_histogram.png')}")
    return 0


def _model(cfg, args) -> int:
    import jax

    from dflop_jax.planner.progress import progress_bar
    from dflop_jax.profiling.auto_plan import model_profile

    ctx, auto = _steps(cfg)
    cache = ctx.auto_plan_dir
    cache.mkdir(parents=True, exist_ok=True)
    with progress_bar(not args.no_progress) as progress:
        path, _ = model_profile(auto, ctx.model_cfg, cache, {}, name=ctx.arch.name,
                                devices=jax.devices(), progress=progress)  # fmt: skip
    from dflop_jax.contracts.cost_table import load_table

    table = load_table(path)
    ok = sum(e.ok for e in table.entries.values())
    print(f"wrote {path} ({ok} entries, {len(table.skipped())} skipped) and "
          f"{path.with_suffix('.png')}")  # fmt: skip
    return 0


def _auto(cfg, args) -> int:
    from dflop_jax.planner import describe_layout
    from dflop_jax.planner.progress import progress_bar
    from dflop_jax.profiling.auto_plan import ensure_plan

    ctx, auto = _steps(cfg)
    cache = ctx.auto_plan_dir
    with progress_bar(not args.no_progress) as progress:
        plan = ensure_plan(auto, ctx.model_cfg, cache, cfg.data, arch=ctx.arch,
                           plan=not args.profile_only, progress=progress)  # fmt: skip
    if plan is None:
        print(f"profiles in {cache}")
    else:
        print(f"{describe_layout(plan.layout)} | M={plan.microbatches}: step "
              f"{plan.step_time_mean_s * 1e3:.1f} ms -> {cache}/plan.yaml")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
