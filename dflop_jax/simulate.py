"""Simulate a plan on samples: schedule each global batch, then run the pipeline simulator.

    python -m dflop_jax.simulate plan=plan.yaml samples=batch.jsonl [png=timeline.png] [--json]
    python -m dflop_jax.simulate plan=plan.yaml mix=llava-ov batches=4 [pipeline=gpipe]

`samples` is one global batch, one JSON object per line: {"id": ..., "tiles": int, "tokens": int}.
`mix` (llava-ov, omnibal) or `shapes` (a shape-distribution file) draw `batches` global batches of the
plan's size. The scheduler is the plan's (online DFLOP scheduler; data-blind for a uniform plan)
unless `scheduler` says otherwise. Prints step time and idle fraction per batch and their mean.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Literal

from dflop_jax.config import ConfigError, require, require_seed
from dflop_jax.config.cli import Command, config_error, load_command_config
from dflop_jax.config.inputs import InputPath
from dflop_jax.planner import Plan, load_plan
from dflop_jax.planner.replay import read_samples_jsonl, replay
from dflop_jax.planner.scoring import sample_batches
from dflop_jax.scheduler import SampleShape

COMMAND = Command(
    prog="python -m dflop_jax.simulate",
    description=__doc__.split("\n\n")[0],
    example="python -m dflop_jax.simulate plan=runs/example/plan.yaml mix=llava-ov batches=2",
    modes={"json": "print the report as JSON"},
)


@dataclasses.dataclass(frozen=True)
class SimulateConfig:
    """A plan and the batches to simulate it on (one of samples, mix, shapes).

    Attributes:
      plan: plan.yaml from `python -m dflop_jax.plan`.
      samples: one global batch as JSON lines {"id", "tiles", "tokens"}.
      mix: draw batches from a built-in distribution: "llava-ov" or "omnibal".
      shapes: draw batches from a shape-distribution JSON file (`profile data` writes one).
      batches: global batches to draw (mix, shapes).
      seed: seed of the drawn batches.
      scheduler: "plan" (the plan's own), "greedy", "auto", "cpsat" or "data_blind".
      pipeline: "1f1b" or "gpipe".
      png: write the first batch's timeline here ("" = none).
    """

    plan: str = ""
    samples: str = ""
    mix: Literal["", "llava-ov", "omnibal"] = ""
    shapes: str = ""
    batches: int = 4
    seed: int = 0
    scheduler: Literal["plan", "greedy", "auto", "cpsat", "data_blind"] = "plan"
    pipeline: Literal["1f1b", "gpipe"] = "1f1b"
    png: str = ""

    def __post_init__(self):
        require(
            bool(self.plan), "plan", self.plan, "give a plan.yaml from python -m dflop_jax.plan"
        )
        given = [k for k in ("samples", "mix", "shapes") if getattr(self, k)]
        require(len(given) == 1, "samples", given, "give exactly one of samples=, mix=, shapes=")
        require(self.batches >= 1, "batches", self.batches, "must be >= 1")
        require_seed(self.seed, "seed")

    def inputs(self) -> list[InputPath]:
        out = [InputPath("plan", self.plan, "file", "give a plan.yaml")]
        for key in ("samples", "shapes"):
            if getattr(self, key):
                out.append(
                    InputPath(key, getattr(self, key), "file", f"give an existing {key} file")
                )
        return out


def main(argv: list[str] | None = None) -> int:
    args = COMMAND.parse(argv)
    try:
        cfg = load_command_config(SimulateConfig, args)
        plan = load_plan(cfg.plan)
        batches = _batches(cfg, plan)
        scheduler = (
            cfg.scheduler
            if cfg.scheduler != "plan"
            else ("data_blind" if plan.mode == "uniform" else "greedy")
        )
        report = replay(plan, batches, scheduler, cfg.pipeline, cfg.png or None)
    except ConfigError as e:
        return config_error(e)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    for i, r in enumerate(report["batches"]):
        print(f"batch {i}: {r['samples']} samples, {r['microbatches']} microbatches, "
              f"step {r['step_time_s'] * 1e3:.1f} ms, idle {r['idle_fraction']:.1%} ({r['solver']})")  # fmt: skip
    print(f"mean: step {report['step_time_mean_s'] * 1e3:.1f} ms, idle {report['idle_fraction_mean']:.1%}"
          + (f"; timeline -> {cfg.png}" if cfg.png else ""))  # fmt: skip
    return 0


def _batches(cfg: SimulateConfig, plan: Plan) -> list[list[SampleShape]]:
    if cfg.samples:
        return [read_samples_jsonl(cfg.samples)]
    from dflop_jax.scheduler import llava_ov_mix, load_shape_distribution, omnibal_shapes

    if cfg.mix == "llava-ov":
        shapes = llava_ov_mix(4000, cfg.seed)
    elif cfg.mix == "omnibal":
        shapes = omnibal_shapes()
    else:
        shapes = load_shape_distribution(cfg.shapes)
    return sample_batches(shapes, plan.global_batch, cfg.batches, cfg.seed)


if __name__ == "__main__":
    sys.exit(main())
