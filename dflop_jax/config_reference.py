"""`docs/config.md`: every command's root config, key by key (`config/reference.py` renders it).

`tests/cli/test_config_reference.py` fails when the file is stale. Regenerate with:

    python -m dflop_jax.config_reference out=docs/config.md
"""

from __future__ import annotations

import sys
from pathlib import Path

from dflop_jax.config.reference import render


def root_configs() -> list[tuple[str, type]]:
    """Every command's root config, the run config (train, plan, profile) first."""
    from dflop_jax.bench import (
        attention,
        cluster,
        colocated,
        costmodel,
        gpu,
        loader,
        loss,
        multihost,
        scheduler,
        step,
        train,
        zero1,
    )
    from dflop_jax.costs.__main__ import CostsConfig
    from dflop_jax.data.synth import SynthConfig
    from dflop_jax.export import ExportConfig
    from dflop_jax.runtime.config import TrainConfig
    from dflop_jax.schedule import ScheduleConfig
    from dflop_jax.simulate import SimulateConfig

    return [
        ("train, plan, profile data|model|auto (the run config)", TrainConfig),
        ("export", ExportConfig),
        ("schedule", ScheduleConfig),
        ("simulate", SimulateConfig),
        ("costs", CostsConfig),
        ("data.synth", SynthConfig),
        ("bench attention", attention.AttentionBenchConfig),
        ("bench cluster", cluster.ClusterBenchConfig),
        ("bench colocated", colocated.ColocatedBenchConfig),
        ("bench costmodel", costmodel.CostModelBenchConfig),
        ("bench gpu", gpu.GpuBenchConfig),
        ("bench loader", loader.LoaderBenchConfig),
        ("bench loss", loss.LossBenchConfig),
        ("bench multihost", multihost.MultihostBenchConfig),
        ("bench scheduler", scheduler.SchedulerBenchConfig),
        ("bench step", step.StepBenchConfig),
        ("bench train", train.TrainBenchConfig),
        ("bench zero1", zero1.Zero1BenchConfig),
    ]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    outs = [a.split("=", 1)[1] for a in args if a.startswith("out=")]
    if len(outs) != len(args) or len(outs) > 1:
        print("usage: python -m dflop_jax.config_reference [out=docs/config.md]", file=sys.stderr)
        return 2
    text = render(root_configs())
    if outs:
        Path(outs[0]).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
