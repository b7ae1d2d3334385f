"""Schedule one global batch from a JSON-lines sample file.

    python -m dflop_jax.schedule samples=S.jsonl out=OUT.json llm_dp=4 encoder_dp=4 \
        "microbatches=[8]" solver=auto time_limit_s=1

Input lines: {"id": ..., "tiles": int, "tokens": int}. Stage costs: the analytic cost model of `arch`
on `device` over `stages=[E,L]` encoder/LLM stages. `baseline=NAME` schedules with a DESIGN section 8
baseline instead (same objective measure).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Literal

from dflop_jax.config import ConfigError, require, require_seed
from dflop_jax.config.cli import Command, config_error, load_command_config
from dflop_jax.config.inputs import InputPath
from dflop_jax.contracts import BucketSet
from dflop_jax.costs import DEFAULT_ARCH
from dflop_jax.scheduler import BASELINES, SchedulerConfig, default_buckets, schedule_batch
from dflop_jax.scheduler.model_problem import model_problem
from dflop_jax.scheduler.report import read_samples_jsonl, schedule_to_json

COMMAND = Command(
    prog="python -m dflop_jax.schedule",
    description=__doc__.split("\n")[0],
    example="python -m dflop_jax.schedule samples=configs/examples/batch.jsonl llm_dp=2 arch=tiny device=cpu",
    modes={"json": "print the JSON report"},
)


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """One global batch to schedule, and the problem it is scheduled for.

    Attributes:
      samples: JSON lines {"id", "tiles", "tokens"}, one global batch.
      out: write the JSON schedule here ("" = do not write).
      llm_dp, encoder_dp: data-parallel degrees (encoder_dp 0 = llm_dp).
      microbatches: [N] or [MIN, MAX] microbatches.
      tile_buckets, length_buckets: the bucket ladders ([] = geometric, from the samples).
      arch: architecture name (`python -m dflop_jax.costs --list`).
      device: device preset of the analytic costs.
      stages, tp: [encoder, LLM] pipeline stages and tensor parallelism.
      time_limit_s: the solver's wall-clock backstop.
      solver: "greedy", "cpsat" or "auto".
      baseline: a DESIGN section 8 baseline to use instead of the solver ("" = none).
      seed: the solver's seed.
    """

    samples: str = ""
    out: str = ""
    llm_dp: int = 1
    encoder_dp: int = 0
    microbatches: tuple[int, ...] = (4,)
    tile_buckets: tuple[int, ...] = ()
    length_buckets: tuple[int, ...] = ()
    arch: str = DEFAULT_ARCH
    device: str = "h100"
    stages: tuple[int, ...] = (1, 1)
    tp: tuple[int, ...] = (1, 1)
    time_limit_s: float = 1.0
    solver: Literal["greedy", "cpsat", "auto"] = "auto"
    baseline: str = ""
    seed: int = 0

    def __post_init__(self):
        require(bool(self.samples), "samples", self.samples, "give a JSON-lines sample file")
        require(self.llm_dp >= 1, "llm_dp", self.llm_dp, "must be >= 1")
        require(self.encoder_dp >= 0, "encoder_dp", self.encoder_dp, "0 (= llm_dp) or >= 1")
        mb = self.microbatches
        require(len(mb) in (1, 2), "microbatches", list(mb), "give [N] or [MIN, MAX]")
        require(1 <= mb[0] <= mb[-1], "microbatches", list(mb), "need 1 <= MIN <= MAX")
        for name in ("stages", "tp"):
            value = getattr(self, name)
            require(
                len(value) == 2 and min(value) >= 1, name, list(value), "give [encoder, LLM] >= 1"
            )
        require(
            not self.baseline or self.baseline in BASELINES,
            "baseline",
            self.baseline,
            f"use one of {sorted(BASELINES)} or leave it empty",
        )
        require(self.time_limit_s > 0, "time_limit_s", self.time_limit_s, "must be > 0")
        require_seed(self.seed, "seed")

    def inputs(self) -> list[InputPath]:
        return [InputPath("samples", self.samples, "file", "give a JSON-lines sample file")]


def run(cfg: ScheduleConfig) -> dict:
    shapes = read_samples_jsonl(cfg.samples)
    counts = (cfg.microbatches[0], cfg.microbatches[-1])
    edp = cfg.encoder_dp or cfg.llm_dp
    guess = default_buckets(shapes, counts[0], edp, cfg.llm_dp, by_row=True)  # `model_problem`'s
    buckets = BucketSet(cfg.tile_buckets or guess.tiles, cfg.length_buckets or guess.lengths)
    problem = model_problem(
        cfg.arch, cfg.device, buckets, counts, edp, cfg.llm_dp, cfg.stages, cfg.tp
    )
    if cfg.baseline:
        sched = BASELINES[cfg.baseline](shapes, problem, counts[1])
    else:
        config = SchedulerConfig(solver=cfg.solver, time_limit_s=cfg.time_limit_s, seed=cfg.seed)
        sched = schedule_batch(shapes, problem, config)
    out = schedule_to_json(sched, shapes)
    out.update(
        model=cfg.arch,
        device=cfg.device,
        tile_buckets=list(buckets.tiles),
        length_buckets=list(buckets.lengths),
    )
    return out


def main(argv: list[str] | None = None) -> int:
    args = COMMAND.parse(argv)
    try:
        cfg = load_command_config(ScheduleConfig, args)
        out = run(cfg)
    except ConfigError as e:
        return config_error(e)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(out, indent=1))
    print(
        f"{len(out['microbatches'])} microbatches, objective {out['objective']:.4f}s, lower bound "
        f"{out['lower_bound']:.4f}s (gap {out['gap']:.2%}), solver {out['solver']}, {out['time_s']:.3f}s",
        file=sys.stderr,
    )
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
