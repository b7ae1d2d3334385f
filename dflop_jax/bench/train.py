"""End-to-end A/B on the real runtime: DFLOP vs a data-blind trainer, each on its own planner's layout.

    python -m dflop_jax.bench train [run_config=configs/demo.yaml] [out=runs/bench_train]
        [train_overrides=[key=value,...]]

Trains the config twice, each arm in a fresh training process, on the same devices, data, global
batches (the same samples per step) and seed:
  dflop       the config as given (its `plan`: e.g. the demo's profile -> plan; its scheduler);
  data-blind  the data-blind planner's own layout (`make_plan(mode="uniform")`: the encoder colocated on
              the first LLM stage, one tp/pp/dp chosen from MEAN shapes, DESIGN section 8) on the same
              shapes and cost provider the first arm planned with (its measured cost table under
              `plan: auto`, else the analytic model), trained with `scheduler.solver=data_blind`
              (loader-order microbatches, each at the largest buckets, the smallest allowed count).
Checkpoints and in-loop stage timing are off in both arms, so every step is an ordinary step.
Reported per arm, from each run's metrics.jsonl: its layout, steady-state throughput (real tokens / s
over the steps that compiled nothing new), the same over all steps (compiles included), median step
time, mean token (LLM) and tile (encoder) padding, microbatches per step, compiles; then the ratios,
and the largest per-step loss difference: the loss is normalized over the global batch, so a different
layout or packing of the same samples gives the same loss up to round-off (bf16: ~1e-2; float32: ~1e-5)
-- a check that the arms differ in speed, not in the math.

What CPU can and cannot show (`CPU_EFFECTS`, printed with the table): simulated CPU devices share the
host's cores, so stages never overlap; the ratio measures the WORK each arm computes (padding, bucket
sizes, recompute, the number of compiled programs), not pipeline bubbles, the encoder's overlap with the
LLM on separate devices, tp/dp communication cost or memory limits, which need real accelerators
(`bench cluster` simulates those, `bench gpu` measures them).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from dflop_jax.bench._cli import command, load
from dflop_jax.config import require
from dflop_jax.config.cli import config_error
from dflop_jax.config.inputs import InputPath
from dflop_jax.host_devices import simulate_cpu_devices

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
# Both arms: no checkpoint writes, no serialized timing steps (they would add the same noise to both).
COMMON = ["checkpoint.every=0", "measure_stage_times_every=0"]
CPU_EFFECTS = (
    "CPU shows: padding (token and tile work computed for nothing), bucket sizes, microbatch counts, "
    "compiles, recompute.",
    "CPU cannot show: pipeline bubbles and stage overlap (the simulated devices share the host's "
    "cores), a separate encoder running beside the LLM, tp/dp communication, memory limits: use "
    "`bench cluster` (simulated) or `bench gpu` (measured) for those.",
)


def arm_summary(metrics_path: Path) -> dict:
    """Throughput and schedule figures of one run from its metrics.jsonl rows."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{metrics_path}: no steps recorded")
    tokens = np.array([r["tokens_per_s"] * r["step_time_s"] for r in rows])
    times = np.array([r["step_time_s"] for r in rows])
    steady = np.array([i > 0 and r["recompiles"] == 0 for i, r in enumerate(rows)])
    return {
        "steps": len(rows),
        "steady_steps": int(steady.sum()),
        "tokens_per_s_steady": float(tokens[steady].sum() / times[steady].sum())
        if steady.any()
        else None,
        "tokens_per_s_all": float(tokens.sum() / times.sum()),
        "step_time_s_median_steady": float(np.median(times[steady])) if steady.any() else None,
        "llm_padding_ratio_mean": float(np.mean([r["llm_padding_ratio"] for r in rows])),
        "encoder_padding_ratio_mean": float(np.mean([r["encoder_padding_ratio"] for r in rows])),
        "microbatches_mean": float(np.mean([r["microbatches"] for r in rows])),
        "compiles": int(rows[-1]["compiles"]),
        "losses": [float(r["loss"]) for r in rows],
    }


def _fresh(run_dir: Path) -> None:
    """Removes a previous run (the trainer would resume it) but keeps a reusable auto-plan cache."""
    if not run_dir.is_dir():
        return
    for child in run_dir.iterdir():
        if child.name != "auto_plan":
            shutil.rmtree(child) if child.is_dir() else child.unlink()


def _train(arm: str, config: Path, overrides: list[str]):
    """Trains one arm in a fresh `python -m dflop_jax.train` process (its output streams through);
    returns the arm's config. A fresh process per arm: no compiled program, cached transfer or
    thread of one arm's runtime is in the other's measurement."""
    from dflop_jax.config import load_config
    from dflop_jax.runtime.config import TrainConfig

    cfg = load_config(TrainConfig, config, overrides)
    _fresh(Path(cfg.run_dir))
    cmd = [sys.executable, "-m", "dflop_jax.train", "--config", str(config), *overrides]
    done = subprocess.run(cmd, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {arm} arm exited {done.returncode} (its run: {cfg.run_dir})")
    return cfg


def _layout(cfg, run_dir: Path):
    """The layout an arm trained: its plan file's, or the config's explicit one."""
    from dflop_jax.planner import load_plan

    if cfg.plan == "explicit":
        return cfg.layout.layout()
    named = {"auto": run_dir / "auto_plan" / "plan.yaml", "analytic": run_dir / "plan.yaml"}
    return load_plan(named.get(cfg.plan, cfg.plan)).layout


def blind_plan(cfg, dflop_dir: Path, path: Path) -> Path:
    """The data-blind planner's plan (`make_plan(mode="uniform")`) for the run `cfg` (the DFLOP arm,
    trained in `dflop_dir`), on the same devices (the run's `num_devices`, else those JAX sees),
    dataset shapes and cost provider DFLOP planned with; saved to `path`."""
    from dflop_jax.costs import AnalyticCostProvider
    from dflop_jax.costs.measured import MeasuredCostProvider
    from dflop_jax.costs.provider import remat_suffix
    from dflop_jax.planner import make_plan, save_plan
    from dflop_jax.planner.resolve import training_planner
    from dflop_jax.resolve import RunContext
    from dflop_jax.resolve.plan_sources import sample_shapes

    ctx = RunContext.build(cfg)
    arch, device = ctx.arch, ctx.device
    provider = AnalyticCostProvider(arch, device, remat=cfg.model.remat)
    table = dflop_dir / "auto_plan" / "cost_table.json"
    if cfg.plan == "auto":  # DFLOP planned on its measured table: so does the baseline
        provider = MeasuredCostProvider(table, arch, device, fallback=provider)
    planner = training_planner(
        cfg.planner, cfg.global_batch, cfg.model.kind != "decoder", steps=cfg.steps
    )
    plan = make_plan(arch, device, ctx.num_devices, sample_shapes(cfg), planner, provider,
                     mode="uniform")  # fmt: skip
    if cfg.plan == "auto":  # the table timed the run's model, its remat too: the plan says so
        name = plan.cost_provider + remat_suffix(cfg.model.remat)
        plan = dataclasses.replace(plan, cost_provider=name)
    return save_plan(plan, path)


def run_ab(config: Path, out: Path, overrides: list[str]) -> dict:
    """Trains both arms (module docstring) into `out/dflop` and `out/data_blind`; returns (and
    writes to `out/bench_train.json`) their summaries and ratios."""
    from dflop_jax.planner.candidates import describe_layout

    dflop_dir, blind_dir = out / "dflop", out / "data_blind"
    cfg = _train("dflop", config, [*overrides, *COMMON, f"run_dir={dflop_dir}"])
    plan = blind_plan(cfg, dflop_dir, out / "data_blind_plan.yaml")
    blind_overrides = [*overrides, *COMMON, f"run_dir={blind_dir}", f"plan={plan}",
                       "scheduler.solver=data_blind"]  # fmt: skip
    blind_cfg = _train("data_blind", config, blind_overrides)
    a, b = arm_summary(dflop_dir / "metrics.jsonl"), arm_summary(blind_dir / "metrics.jsonl")
    a["layout"] = describe_layout(_layout(cfg, dflop_dir))
    b["layout"] = describe_layout(_layout(blind_cfg, blind_dir))
    n = min(len(a["losses"]), len(b["losses"]))
    report = {
        "config": str(config),
        "plan": str(plan),
        "dflop": a,
        "data_blind": b,
        "speedup_steady": a["tokens_per_s_steady"] / b["tokens_per_s_steady"]
        if a["tokens_per_s_steady"] and b["tokens_per_s_steady"]
        else None,
        "speedup_all_steps": a["tokens_per_s_all"] / b["tokens_per_s_all"],
        "max_loss_diff": float(np.max(np.abs(np.subtract(a["losses"][:n], b["losses"][:n])))),
        "cpu_effects": list(CPU_EFFECTS),
    }
    (out / "bench_train.json").write_text(json.dumps(report, indent=1))
    return report


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _print(report: dict) -> None:
    print(f"\ndata-blind plan: {report['plan']}")
    print("| arm | layout | tokens/s steady | tokens/s all steps | step s (median, steady) | token padding | "
          "tile padding | microbatches | compiles |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name in ("dflop", "data_blind"):
        r = report[name]
        layout = r["layout"].replace(" | ", " + ")  # a table cell holds no "|"
        cells = [name, layout, _fmt(r["tokens_per_s_steady"], ".0f"), _fmt(r["tokens_per_s_all"], ".0f"),
                 _fmt(r["step_time_s_median_steady"], ".2f"), _fmt(r["llm_padding_ratio_mean"], ".1%"),
                 _fmt(r["encoder_padding_ratio_mean"], ".1%"), _fmt(r["microbatches_mean"], ".1f"),
                 str(r["compiles"])]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    print(f"speedup dflop / data-blind: {_fmt(report['speedup_steady'], '.2f')}x steady, "
          f"{report['speedup_all_steps']:.2f}x over all steps (compiles included)")  # fmt: skip
    print(f"largest per-step loss difference between the arms: {report['max_loss_diff']:.2e}")
    for line in report["cpu_effects"]:
        print(line)


COMMAND = command(
    "train",
    __doc__.split("\n\n")[0],
    "python -m dflop_jax.bench train out=runs/bench_train "
    "train_overrides=[steps=3,plan=analytic,compute_dtype=float32,data.synth_samples=48]",
)


@dataclasses.dataclass(frozen=True)
class TrainBenchConfig:
    """The training run both arms train, and where their run folders go.

    Attributes:
      run_config: the training YAML ("" = configs/demo.yaml).
      train_overrides: key=value overrides of the training config, for both arms, e.g. [steps=30].
      out: folder for the two arms' run folders and bench_train.json.
    """

    run_config: str = ""
    train_overrides: tuple[str, ...] = ()
    out: str = "runs/bench_train"

    def __post_init__(self):
        bad = [o for o in self.train_overrides if "=" not in o]
        require(not bad, "train_overrides", list(self.train_overrides), "give key=value items")

    def inputs(self) -> list[InputPath]:
        if not self.run_config:
            return []
        return [InputPath("run_config", self.run_config, "file", "give a training YAML")]


def main(argv: list[str] | None = None) -> int:
    cfg, _ = load(COMMAND, TrainBenchConfig, argv)
    from dflop_jax.config import ConfigError, load_config
    from dflop_jax.runtime.config import TrainConfig

    config = Path(cfg.run_config) if cfg.run_config else DEMO_CONFIG
    overrides = list(cfg.train_overrides)
    try:
        run_cfg = load_config(TrainConfig, config, overrides)
    except ConfigError as e:
        return config_error(e)
    simulate_cpu_devices(run_cfg.num_cpu_devices)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    _print(run_ab(config, out, overrides))
    return 0
