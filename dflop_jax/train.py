"""Training entry point.

    python -m dflop_jax.train                                  # the embedded demo (configs/demo.yaml)
    python -m dflop_jax.train --config configs/x.yaml steps=100 optimizer.lr=1e-3
    python -m dflop_jax.train --config configs/x.yaml --dry-run   # compile every stage, train nothing
    scripts/run_training.sh <num_nodes> <rank> <coordinator host:port> [train args]   # multi-host

With no --config the demo runs: a tiny model on synthetic data (generated on first run), a pipeline of
several stages on 8 simulated CPU devices, a few dozen steps; it prints the plan and live metrics and
writes runs/demo (config.yaml, metrics.jsonl, checkpoints).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from dflop_jax.config.cli import Command, load_command_config
from dflop_jax.host_devices import simulate_cpu_devices

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


COMMAND = Command(
    prog="python -m dflop_jax.train",
    description=__doc__.split("\n")[0] + " (no --config: the demo, configs/demo.yaml)",
    example="python -m dflop_jax.train plan=analytic steps=2 checkpoint.every=2 run_dir=runs/demo",
    modes={
        "dry-run": "resolve the plan and compile every stage program at its real sizes; no training"
    },
)


def main(argv: list[str] | None = None) -> int:
    args = COMMAND.parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from dflop_jax.config import ConfigError
    from dflop_jax.programs.processes import initialize, resolve
    from dflop_jax.runtime.config import TrainConfig

    try:  # every value, combination and input file (and the env's process settings), before JAX
        cfg = load_command_config(TrainConfig, args, DEMO_CONFIG)
        dist = resolve(cfg.distributed, os.environ)
    except (ConfigError, ValueError) as e:
        return _config_error(e)
    simulate_cpu_devices(cfg.num_devices or cfg.num_cpu_devices)
    if dist is not None:
        # before any other JAX call; bounded by distributed.timeout_s
        initialize(dist, cfg.compilation_cache)

    from dflop_jax.programs.meshes import LayoutError

    try:
        # What only the run can see (a mix's dataset files, a layout needing more devices than
        # exist) is still a config problem: one line too.
        if args.dry_run:
            return _dry_run(cfg)
        report = run(cfg)
    except (ConfigError, LayoutError) as e:
        return _config_error(e)
    print(f"run directory: {report.run_dir}")
    return 0


def _dry_run(cfg) -> int:
    from dflop_jax.profiling.stage_report import SCALED
    from dflop_jax.resolve.dry_run import dry_run

    for s in dry_run(cfg, show=lambda line: print(line, flush=True)):
        print(f"stage {s['stage']} ({'+'.join(s['compiled']['parts'])}): predicted "
              f"{s['memory_gib']:.2f} GiB, compiled {s['compiled_memory_gib']:.2f} GiB, "
              f"compile {s['compile_s']:.1f} s, {s['flops_forward']:.3g} + "
              f"{s['flops_backward']:.3g} FLOPs per step's buckets")  # fmt: skip
    print(f"wrote {cfg.run_dir}/dry_run.yaml (FLOPs {SCALED})")
    return 0


def run(cfg, console=None, clock=time.perf_counter):
    """DFLOP's training run: the model's config, its plan (`resolve`), training (`trainer`: each
    stage makes its own params on its own mesh; the whole model is never built).

    Returns the `TrainReport`; `clock` times the sampled stage programs of measured steps (tests pass
    a deterministic one).
    """
    import jax

    from dflop_jax.planner.progress import progress_bar
    from dflop_jax.programs.devices import attention_hint
    from dflop_jax.resolve import RunContext, resolve_plan
    from dflop_jax.runtime.trainer import prepare_run_dir, train

    ctx = RunContext.build(cfg)  # a plan.yaml's remat policy applied before the model is built
    prepare_run_dir(ctx.cfg, ctx.model_cfg)  # config.yaml records the model's sizes
    hint = attention_hint(ctx.attention_impl)  # the resolved kernel (auto: never xla on a GPU)
    if hint:
        logging.getLogger(__name__).warning(hint)
    with progress_bar(jax.process_index() == 0) as progress:
        plan = resolve_plan(ctx, progress)
    return train(ctx.cfg, ctx.model_cfg, ctx.arch, ctx.device, plan, console, clock)


def _config_error(e: Exception) -> int:
    print(f"config error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
