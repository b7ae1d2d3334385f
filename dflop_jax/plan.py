"""Plan a layout: config + device count + shape distribution -> plan.yaml.

    python -m dflop_jax.plan --config configs/plan_llava_ov_7b_h100x64.yaml [key=value ...] [--json] [--check]

Overrides use the config's dotted keys (e.g. `num_devices=32 planner.samples=8 out=runs/plan.yaml`);
`planner.trainable=[projector]` plans a training recipe with frozen parts (costs/recipe.py).
Writes `out` (plan.yaml) and the resolved config beside it (`<out stem>.config.yaml`). An infeasible
request exits with status 2 and a one-line explanation. `--check` then compiles every stage program of
the chosen layout at its real sizes from abstract arrays on `num_devices` (simulated CPU) devices and
writes each stage's `compiled_memory_gib` and `compile_s` beside its predicted `memory_gib`
(`profiling/compile_check.py`), each as it trains under the plan's recipe (a forward-only stage
compiles its forward, frozen leaves hold no accumulator or optimizer state); stages more than 15% apart
are warned. With `--check` the planner keeps
a colocated encoder at its stage's tp (`planner.colocate_own_tp=false`): what is compiled is what trains.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys

from dflop_jax.config import ConfigError, dump_yaml
from dflop_jax.config.cli import Command, load_command_config
from dflop_jax.host_devices import simulate_cpu_devices
from dflop_jax.planner import (
    Plan,
    PlanningError,
    describe_layout,
    make_plan,
    plan_to_dict,
    save_plan,
)
from dflop_jax.planner.progress import progress_bar
from dflop_jax.planner.run_config import PlanRunConfig, load_shapes, plan_inputs
from dflop_jax.planner.space import fit_search_space

log = logging.getLogger(__name__)


def run(cfg: PlanRunConfig, progress=None, check: bool = False) -> Plan:
    """Plans per `cfg` and writes plan.yaml and the resolved config; returns the plan. With `check`
    the stage programs are compiled too (JAX must see `cfg.num_devices` devices)."""
    from dflop_jax.costs import AnalyticCostProvider, get_arch
    from dflop_jax.costs.measured import MeasuredCostProvider
    from dflop_jax.runtime.device import run_device

    if check and cfg.planner.colocate_own_tp:
        # What is compiled must be what trains: the runtime runs a colocated encoder at its stage's tp.
        logging.getLogger(__name__).warning(
            "--check plans layouts the runtime trains: planner.colocate_own_tp=false"
        )
        cfg = dataclasses.replace(
            cfg, planner=dataclasses.replace(cfg.planner, colocate_own_tp=False)
        )
    arch, device = get_arch(cfg.model), run_device(cfg.device)
    provider = AnalyticCostProvider(arch, device, remat=cfg.remat)
    if cfg.cost_table:
        provider = MeasuredCostProvider(cfg.cost_table, arch, device, fallback=provider)
    else:
        log.info("no cost_table given: the analytic cost model prices the stages")
    planner = cfg.planner
    if cfg.mode == "dflop":
        planner = fit_search_space(arch, cfg.num_devices, device, planner)
    shapes = load_shapes(cfg.data)
    plan = make_plan(arch, device, cfg.num_devices, shapes, planner, provider, progress, cfg.mode)
    plan = dataclasses.replace(plan, inputs=plan_inputs(cfg))
    dump_yaml(cfg, cfg.out.with_name(cfg.out.stem + ".config.yaml"))
    save_plan(plan, cfg.out)
    if check:
        plan = check_compiled(plan)
        save_plan(plan, cfg.out)
    return plan


def check_compiled(plan: Plan) -> Plan:
    """`plan` with `checks`: its stage programs compiled for the plan's model and remat policy."""
    from dflop_jax.profiling.compile_check import check_plan
    from dflop_jax.profiling.model_config import model_config_for_arch
    from models.stages import with_remat

    model_cfg = with_remat(model_config_for_arch(plan.model), plan.remat)
    return dataclasses.replace(plan, checks=tuple(check_plan(plan, model_cfg)))


def _recipe(cfg: PlanRunConfig) -> str:
    """ ", trains projector,llm" when the plan's recipe freezes a part, else ""."""
    trainable = cfg.planner.trainable
    return "" if len(trainable) == 3 else f", trains {','.join(trainable)}"


COMMAND = Command(
    prog="python -m dflop_jax.plan",
    description=__doc__.split("\n\n")[0],
    example="python -m dflop_jax.plan --config configs/plan_tiny_cpu.yaml out=runs/example/plan.yaml",
    modes={
        "check": "then compile every stage program at its real sizes (simulated CPU devices)",
        "json": "print the plan as JSON on stdout",
        "no-progress": "no progress bar",
    },
)


def main(argv: list[str] | None = None) -> int:
    args = COMMAND.parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_command_config(PlanRunConfig, args)
        if args.check:
            simulate_cpu_devices(cfg.num_devices)  # before JAX starts
        with progress_bar(not args.no_progress) as progress:
            plan = run(cfg, progress, args.check)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (PlanningError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan_to_dict(plan), indent=1))
    else:
        print(f"{describe_layout(plan.layout)} | M={plan.microbatches} on {plan.layout.num_devices}/{plan.num_devices} "
              f"{plan.device}: step {plan.step_time_mean_s * 1e3:.1f} ms (p90 {plan.step_time_p90_s * 1e3:.1f}), "
              f"idle {plan.idle_fraction:.1%}{_recipe(cfg)} -> {cfg.out}")  # fmt: skip
    for c, predicted in zip(plan.checks, plan.stage_memory_bytes):
        print(f"stage {c.stage} ({'+'.join(c.parts)}): predicted {predicted / 2**30:.2f} GiB, "
              f"compiled {c.total / 2**30:.2f} GiB, compile {c.compile_s:.1f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
