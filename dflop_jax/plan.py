"""Plan a layout: config + device count + shape distribution -> plan.yaml.

    python -m dflop_jax.plan --config configs/llava_ov_7b_h100x64.yaml [key=value ...] [--json]

Overrides use the config's dotted keys (e.g. `num_devices=32 planner.samples=8 out=runs/plan.yaml`).
Writes `out` (plan.yaml) and the resolved config beside it (`<out stem>.config.yaml`). An infeasible
request exits with status 2 and a one-line explanation.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from dflop_jax.config import ConfigError, dump_yaml, load_config
from dflop_jax.planner import (
    Plan,
    PlanningError,
    describe_layout,
    make_plan,
    plan_to_dict,
    save_plan,
)
from dflop_jax.planner.progress import progress_bar
from dflop_jax.planner.run_config import PlanRunConfig, load_shapes


def run(cfg: PlanRunConfig, progress=None) -> Plan:
    """Plans per `cfg` and writes plan.yaml and the resolved config; returns the plan."""
    from dflop_jax.costs import AnalyticCostProvider, get_arch, get_device

    arch, device = get_arch(cfg.model), get_device(cfg.device)
    provider = AnalyticCostProvider(arch, device, remat=cfg.remat)
    shapes = load_shapes(cfg.data)
    plan = make_plan(
        arch, device, cfg.num_devices, shapes, cfg.planner, provider, progress, cfg.mode
    )
    dump_yaml(cfg, cfg.out.with_name(cfg.out.stem + ".config.yaml"))
    save_plan(plan, cfg.out)
    return plan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dflop_jax.plan", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--config", help="PlanRunConfig YAML (configs/*.yaml); defaults apply without it"
    )
    ap.add_argument(
        "overrides", nargs="*", help="key=value overrides, e.g. num_devices=32 planner.samples=8"
    )
    ap.add_argument("--json", action="store_true", help="print the plan as JSON on stdout")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(PlanRunConfig, args.config, args.overrides)
        with progress_bar(not args.no_progress) as progress:
            plan = run(cfg, progress)
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
              f"idle {plan.idle_fraction:.1%} -> {cfg.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
