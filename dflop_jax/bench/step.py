"""The step never waits: host dispatch time vs step time, data wait, and step time before/after.

    python -m dflop_jax.bench step [models=demo,mid] [steps=12] [before_tree=DIR] [out=DIR]

Each model trains in its own process (`python -m dflop_jax.train`) with the CP-SAT solver at a 1 s
limit (`scheduler.solver=cpsat`, `time_limit_s=1`), adaptive correction on, stage times measured every
2 steps, no checkpoints and `plan=analytic` (no profiling, so the arms differ only in the runtime):
  after   this tree: steps issued without host reads (on-device clipping and skip), read at log steps
          after the next dispatch; the loader solves and decodes 2 batches ahead with corrections
          lagged by that (`runtime/lagged_schedule.py`); a measured step times one microbatch.
  before  `before_tree` (a checkout of the previous commit, e.g. `git worktree add /tmp/before
          HEAD~N`): the synchronous trainer (float() reads and a blocking update every step, no
          prefetch while correction is on, every measured step serialized).
Models: "demo" is configs/demo.yaml's model; "mid" is 4x its widths and 2x its depths (decoder 256 x 8
layers, ViT 128 x 4 layers), same data.

Reported per model and arm, over the steps after the first 2 (compiles): the median wall time per
step (previous step's end to this one's; `before`: step_time_s + data_wait_s, its loop being serial),
host seconds dispatching a step and its share of the wall time (after only: the old trainer did not
record it), data_wait_s and its share of the wall time, and before/after wall-time ratio. On CPU the
simulated devices share the host's cores: overlap of host work (solver, decoding) and device work is
what this measures, not device-side overlap between stages.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from dflop_jax.bench._cli import command, load
from dflop_jax.config import require

REPO = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO / "configs" / "demo.yaml"
COMMON = [
    "plan=analytic",
    "scheduler.solver=cpsat",
    "scheduler.time_limit_s=1.0",
    "scheduler.correction=on",
    "measure_stage_times_every=2",
    "checkpoint.every=0",
    "log_every=1",
]
MODELS = {
    "demo": [],
    "mid": [
        "model.hidden_size=256",
        "model.intermediate_size=512",
        "model.num_layers=8",
        "model.num_heads=8",
        "model.num_kv_heads=4",
        "model.head_dim=32",
        "model.vision_hidden_size=128",
        "model.vision_intermediate_size=256",
        "model.vision_num_layers=4",
        "model.vision_num_heads=4",
    ],
}
WARMUP = 2  # first steps left out (compiles)


def summarize(rows: list[dict], serial: bool) -> dict:
    """Medians over the steps after WARMUP; `serial`: the old loop (wall = step time + data wait)."""
    rows = rows[WARMUP:] or rows
    wall = np.array([r["step_time_s"] + r["data_wait_s"] if serial else r["wall_s"] for r in rows])
    wait = np.array([r["data_wait_s"] for r in rows])
    out = {
        "steps": len(rows),
        "wall_s_median": float(np.median(wall)),
        "step_time_s_median": float(np.median([r["step_time_s"] for r in rows])),
        "data_wait_s_median": float(np.median(wait)),
        "data_wait_share": float(wait.sum() / wall.sum()),
        "scheduler_latency_s_median": float(np.median([r["scheduler_latency_s"] for r in rows])),
        "loss_last": float(rows[-1]["loss"]),
    }
    if not serial:
        dispatch = np.array([r["dispatch_s"] for r in rows])
        out["dispatch_s_median"] = float(np.median(dispatch))
        out["dispatch_share"] = float(dispatch.sum() / wall.sum())
    return out


def train_arm(tree: Path, run_dir: Path, overrides: list[str]) -> list[dict]:
    """Trains in a subprocess importing dflop_jax from `tree`; returns its metrics rows."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "dflop_jax.train", "--config", str(DEMO_CONFIG), *overrides,
           f"run_dir={run_dir}"]  # fmt: skip
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run(models: list[str], steps: int, out: Path, before: Path | None) -> dict:
    report = {}
    for name in models:
        overrides = [*COMMON, *MODELS[name], f"steps={steps}", f"data.synth_dir={out / 'synth'}"]
        entry = {"after": summarize(train_arm(REPO, out / name / "after", overrides), False)}
        if before is not None:
            rows = train_arm(before, out / name / "before", overrides)
            entry["before"] = summarize(rows, True)
            entry["before_over_after_wall"] = (
                entry["before"]["wall_s_median"] / entry["after"]["wall_s_median"]
            )
        report[name] = entry
        print(json.dumps({name: entry}), flush=True)
    (out / "bench_step.json").write_text(json.dumps(report, indent=1))
    return report


def _print(report: dict) -> None:
    print("| model | arm | wall s/step | step_time_s | dispatch s (share) | data wait s (share) | "
          "solver s | before/after |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, entry in report.items():
        for arm in ("before", "after"):
            if arm not in entry:
                continue
            r = entry[arm]
            dispatch = (f"{r['dispatch_s_median']:.4f} ({r['dispatch_share']:.1%})"
                        if "dispatch_s_median" in r else "-")  # fmt: skip
            ratio = entry.get("before_over_after_wall") if arm == "after" else None
            print(f"| {name} | {arm} | {r['wall_s_median']:.3f} | {r['step_time_s_median']:.3f} | "
                  f"{dispatch} | {r['data_wait_s_median']:.4f} ({r['data_wait_share']:.1%}) | "
                  f"{r['scheduler_latency_s_median']:.3f} | "
                  f"{'-' if ratio is None else f'{ratio:.2f}x'} |")  # fmt: skip


COMMAND = command(
    "step",
    __doc__.split("\n\n")[0],
    "python -m dflop_jax.bench step models=demo steps=3 out=runs/bench_step",
)


@dataclasses.dataclass(frozen=True)
class StepBenchConfig:
    """The models to train, for how long, and the old trainer to compare with.

    Attributes:
      models: models to train, from "demo" and "mid" (one process each).
      steps: training steps per run (the first 2 compile and are left out).
      before_tree: checkout of the old trainer, timed as "before" ("" = the after arm only).
      out: folder for the runs and the shared synthetic dataset.
    """

    models: tuple[str, ...] = ("demo", "mid")
    steps: int = 12
    before_tree: str = ""
    out: str = "runs/bench_step"

    def __post_init__(self):
        unknown = sorted(set(self.models) - set(MODELS))
        require(bool(self.models) and not unknown, "models", list(self.models),
                f"choose from {sorted(MODELS)}")  # fmt: skip
        require(self.steps > WARMUP, "steps", self.steps, f"must be > {WARMUP} (the first compile)")
        require(not self.before_tree or (Path(self.before_tree) / "dflop_jax").is_dir(),
                "before_tree", self.before_tree, "give a checkout with a dflop_jax package")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    cfg, _ = load(COMMAND, StepBenchConfig, argv)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    before = Path(cfg.before_tree) if cfg.before_tree else None
    _print(run(list(cfg.models), cfg.steps, out.resolve(), before))
    return 0
