"""Plan a layout from the run config: the run's model, devices and data -> `run_dir/plan.yaml`.

    python -m dflop_jax.plan --config RUN.yaml [key=value ...] [--json] [--check]

The run config is the training config (`TrainConfig`; default `configs/demo.yaml`): the plan is for
its model (`model`), devices (`device`, `num_devices`), recipe (`optimizer.trainable`), global batch
and search space (`planner`; `planner.mode=uniform` plans the data-blind baseline). It reads what
`python -m dflop_jax.profile data` and `... profile model` wrote in `run_dir/auto_plan` (the shape
distribution, the cost table); where one is absent, one line says so and the data's shapes (from
metadata) or the analytic cost model stand in (`profile.data_source` may name a shape file or a
synthetic mix instead). Writes `run_dir/plan.yaml`, recording what it read (paths and sha256), and
the resolved config beside it (`run_dir/plan.config.yaml`); `train --config RUN.yaml
plan=RUN_DIR/plan.yaml` trains it. An infeasible request exits with status 2 and a one-line
explanation. `--check` then compiles every stage program of the chosen layout at its real sizes from
abstract arrays on the run's (simulated CPU) devices, as `train plan=RUN_DIR/plan.yaml` would train
them (the run's recipe, compute dtype and per-stage residual policy, `residuals`), and writes each
stage's `residuals`, `compiled_memory_gib` and `compile_s` beside the memory model's prediction for
the same programs (`checked_memory_gib`; `profiling/compile_check.py`); stages more than 15% apart
are warned.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path

from dflop_jax.config import ConfigError, dump_yaml
from dflop_jax.config.cli import Command, config_error, load_command_config
from dflop_jax.host_devices import simulate_cpu_devices

log = logging.getLogger(__name__)


def run(cfg, progress=None, check: bool = False):
    """Plans per the run config `cfg` and writes `run_dir/plan.yaml` and the resolved config; returns
    the plan. With `check` the stage programs are compiled too (JAX must see the run's devices)."""
    from dflop_jax.planner import save_plan
    from dflop_jax.resolve import RunContext
    from dflop_jax.resolve.plan_sources import plan_from_run_dir

    plan = plan_from_run_dir(RunContext.build(cfg), progress)
    out = plan_path(cfg)
    dump_yaml(cfg, out.with_name("plan.config.yaml"))
    save_plan(plan, out)
    if check:
        plan = dataclasses.replace(plan, checks=check_compiled(cfg, out, progress))
        save_plan(plan, out)
    return plan


def plan_path(cfg) -> Path:
    """Where `plan` writes the run's plan.yaml."""
    return Path(cfg.run_dir) / "plan.yaml"


def check_compiled(cfg, plan_file: Path, progress=None) -> tuple:
    """The stage programs of the plan at `plan_file` compiled as `train --config ... plan=PLAN_FILE`
    would train them: its remat, the run's compute dtype and recipe, and the residual policy each
    stage trains under (`residuals`, "auto": the least backward work that fits)."""
    from dflop_jax.resolve import RunContext, resolve_plan
    from dflop_jax.resolve.dry_run import compile_stages

    ctx = RunContext.build(dataclasses.replace(cfg, plan=str(plan_file)))
    return tuple(compile_stages(ctx, resolve_plan(ctx), progress))


def _recipe(cfg) -> str:
    """ ", trains projector,llm" when the plan's recipe freezes a part, else ""."""
    trainable = cfg.optimizer.trainable
    return "" if len(trainable) == 3 else f", trains {','.join(trainable)}"


COMMAND = Command(
    prog="python -m dflop_jax.plan",
    description=__doc__.split("\n\n")[0],
    example="python -m dflop_jax.plan --config configs/plan_tiny_cpu.yaml run_dir=runs/example",
    modes={
        "check": "then compile every stage program at its real sizes (simulated CPU devices)",
        "json": "print the plan as JSON on stdout",
        "no-progress": "no progress bar",
    },
)


def main(argv: list[str] | None = None) -> int:
    from dflop_jax.runtime.config import TrainConfig
    from dflop_jax.train import DEMO_CONFIG

    args = COMMAND.parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_command_config(TrainConfig, args, DEMO_CONFIG)
    except (ConfigError, ValueError) as e:
        return config_error(e)
    simulate_cpu_devices(cfg.num_devices or cfg.num_cpu_devices)  # before JAX starts

    from dflop_jax.planner import PlanningError, describe_layout, plan_to_dict
    from dflop_jax.planner.progress import progress_bar

    try:
        with progress_bar(not args.no_progress) as progress:
            plan = run(cfg, progress, args.check)
    except ConfigError as e:
        return config_error(e)
    except (PlanningError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan_to_dict(plan), indent=1))
    else:
        print(f"{describe_layout(plan.layout)} | M={plan.microbatches} on {plan.layout.num_devices}/{plan.num_devices} "
              f"{plan.device}: step {plan.step_time_mean_s * 1e3:.1f} ms (p90 {plan.step_time_p90_s * 1e3:.1f}), "
              f"idle {plan.idle_fraction:.1%}{_recipe(cfg)} -> {plan_path(cfg)}")  # fmt: skip
    for c in plan.checks:
        print(f"stage {c.stage} ({'+'.join(c.parts)}, residuals {c.policy}): predicted "
              f"{c.predicted / 2**30:.2f} GiB, compiled {c.total / 2**30:.2f} GiB "
              f"({c.total / c.predicted - 1:+.1%}), compile {c.compile_s:.1f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
