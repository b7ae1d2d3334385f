"""ZeRO-1 on a mid-size model that trains here: memory per device and step time, ZeRO-1 off vs on.

    python -m dflop_jax.bench zero1 [steps=5] [size=mid] [out=DIR]

Both arms train the demo's LLaVA-OV model scaled up (`size=mid`: a 768 x 14-layer decoder and a
384 x 6-layer ViT, ~100M parameters) through `dflop_jax.train.run`, each in its own process over 8
simulated CPU devices, with the same explicit layout (one encoder stage at dp 2, two LLM stages at
dp 3), the same samples and float32 compute:
  off   `optimizer.zero1=false`: fp32 master weights and AdamW moments replicated over each stage's dp;
  on    `optimizer.zero1=true` (the default): AdamW moments (and the reduced gradient) sharded over dp.
Both arms accumulate each data replica's gradient unreduced and reduce once per step (that part has no
switch: the compiled-HLO evidence, no data-axis all-reduce in a microbatch's backward and one in the
step's reduce, is `tests/runtime/test_runtime_zero1.py`'s).

Reported per arm: the state each stage holds per device after training (fp32 params, AdamW state, the
per-replica gradient accumulator `programs.accumulator.accumulator_structs` allocates every step), the host's
peak RSS (all 8 simulated devices live in one process), and the median step and wall time over the
steps after the first 2 (compiles). On simulated devices sharing the host's cores, collectives are
memory copies: the memory figures are the real ones; the time figures show that ZeRO-1's sharded update
costs nothing measurable here, not what it saves on a GPU cluster.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np

from dflop_jax.bench._cli import command, load
from dflop_jax.config import require

REPO = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO / "configs" / "demo.yaml"
DEVICES = 8
WARMUP = 2  # first steps left out of the times (compiles)
LAYOUT = [
    "plan=explicit",
    "layout.encoder_tp=[1]",
    "layout.encoder_dp=2",
    "layout.llm_tp=[1]",
    "layout.llm_dp=3",
    "layout.tiles=[8]",
    "layout.lengths=[512]",
    "layout.microbatches=[2,3]",
]
# Widths divisible by 2 and 3 (the stages' dp): ZeRO-1 splits a leaf on an axis dp divides
# (`programs.zero1_layout.zero1_layout`); a leaf with none is padded to a multiple first.
SIZES = {
    "mid": [
        "model.hidden_size=768",
        "model.intermediate_size=2304",
        "model.num_layers=14",
        "model.num_heads=12",
        "model.num_kv_heads=4",
        "model.head_dim=64",
        "model.vision_hidden_size=384",
        "model.vision_intermediate_size=1536",
        "model.vision_num_layers=6",
        "model.vision_num_heads=6",
        "layout.encoder_layers=[6]",
        "layout.llm_layers=[7,7]",
    ],
    # A quick check that both arms run (tests).
    "tiny": [
        "model.hidden_size=96",
        "model.intermediate_size=192",
        "model.num_heads=6",
        "model.num_kv_heads=2",
        "model.head_dim=16",
        "model.vision_hidden_size=48",
        "model.vision_intermediate_size=96",
        "model.vision_num_heads=3",
        "layout.encoder_layers=[2]",
        "layout.llm_layers=[2,2]",
    ],
}
COMMON = [
    "scheduler.solver=greedy",
    "checkpoint.every=0",
    "log_every=1",
    "global_batch=6",
    "data.max_tokens=512",
    "compute_dtype=float32",
    "tensorboard=false",
]


def arm_overrides(size: str, zero1: bool, steps: int, out: Path) -> list[str]:
    """The train overrides of one arm (everything but `optimizer.zero1` is shared)."""
    return [
        *LAYOUT, *SIZES[size], *COMMON, f"steps={steps}", f"optimizer.zero1={str(zero1).lower()}",
        f"data.synth_dir={out / 'synth'}", f"run_dir={out / ('on' if zero1 else 'off')}",
    ]  # fmt: skip


def measure_arm(overrides: list[str]) -> dict:
    """Trains in this process (8 simulated devices) and measures what each stage holds per device."""
    from dflop_jax.host_devices import simulate_cpu_devices

    simulate_cpu_devices(DEVICES)
    import jax

    from dflop_jax.config import load_config
    from dflop_jax.profiling.programs import per_device_bytes
    from dflop_jax.programs.accumulator import accumulator_structs
    from dflop_jax.runtime.config import TrainConfig
    from dflop_jax.train import run

    cfg = load_config(TrainConfig, DEMO_CONFIG, overrides, [])
    report = run(cfg)
    mib = 2.0**20
    stages = []
    for stage, opt in zip(report.stages, report.optimizers, strict=True):
        state = [a for a in jax.tree.leaves(opt.shards) if a.ndim]  # live moments, not counts
        stages.append(
            {
                "devices": stage.mesh.size,
                "params_mib": per_device_bytes(stage.params) / mib,
                "optimizer_mib": per_device_bytes(state) / mib,
                "accumulator_mib": per_device_bytes(accumulator_structs(stage.params)) / mib,
                "param_count": sum(a.size for a in jax.tree.leaves(stage.params)),
            }
        )
    rows = [
        json.loads(line) for line in (report.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    timed = rows[WARMUP:] or rows
    return {
        "stages": stages,
        "host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "step_time_s_median": float(np.median([r["step_time_s"] for r in timed])),
        "wall_s_median": float(np.median([r["wall_s"] for r in timed])),
        "steps_timed": len(timed),
        "losses": [r["loss"] for r in rows],
    }


def run_arms(size: str, steps: int, out: Path) -> dict:
    """Each arm in its own process (its own 8 devices and RSS); returns {"off": ..., "on": ...}."""
    result = {}
    for zero1 in (False, True):
        name = "on" if zero1 else "off"
        path = out / f"arm_{name}.json"
        cmd = [sys.executable, "-m", __name__, "--arm", str(path),
               *arm_overrides(size, zero1, steps, out)]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(REPO))
        subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
        result[name] = json.loads(path.read_text())
        print(f"arm {name}: done", flush=True)
    return result


def print_table(result: dict) -> None:
    print("| arm | stage | devices | params M | fp32 params MiB/dev | AdamW MiB/dev | "
          "accumulator MiB/dev | state MiB/dev |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for arm in ("off", "on"):
        for i, s in enumerate(result[arm]["stages"]):
            total = s["params_mib"] + s["optimizer_mib"] + s["accumulator_mib"]
            print(f"| {arm} | {i} | {s['devices']} | {s['param_count'] / 1e6:.1f} | "
                  f"{s['params_mib']:.1f} | {s['optimizer_mib']:.1f} | {s['accumulator_mib']:.1f} | "
                  f"{total:.1f} |")  # fmt: skip
    print()
    print(
        "| arm | step_time_s median | wall s median | steps timed | host peak RSS GiB | last loss |"
    )
    print("|---|---|---|---|---|---|")
    for arm in ("off", "on"):
        r = result[arm]
        print(f"| {arm} | {r['step_time_s_median']:.2f} | {r['wall_s_median']:.2f} | "
              f"{r['steps_timed']} | {r['host_peak_rss_gib']:.2f} | {r['losses'][-1]:.4f} |")  # fmt: skip
    off, on = result["off"], result["on"]
    print(f"on/off wall time: {on['wall_s_median'] / off['wall_s_median']:.2f}x; "
          f"same losses: {np.allclose(off['losses'], on['losses'], rtol=1e-4)}")  # fmt: skip


COMMAND = command(
    "zero1",
    __doc__.split("\n\n")[0],
    "python -m dflop_jax.bench zero1 size=tiny steps=3 out=runs/bench_zero1",
)


@dataclasses.dataclass(frozen=True)
class Zero1BenchConfig:
    """The model size both arms train, for how long, and where.

    Attributes:
      size: model size, one of `SIZES` ("mid": ~100M parameters; "tiny": the demo's, for a smoke run).
      steps: training steps per arm (the first 2 compile and are left out of the times).
      out: folder for both arms' runs and bench_zero1.json.
    """

    size: str = "mid"
    steps: int = 5
    out: str = "runs/bench_zero1"

    def __post_init__(self):
        require(self.size in SIZES, "size", self.size, f"choose from {sorted(SIZES)}")
        require(self.steps > WARMUP, "steps", self.steps, f"must be > {WARMUP} (the first compile)")


def main(argv: list[str] | None = None) -> int:
    cfg, _ = load(COMMAND, Zero1BenchConfig, argv)
    out = Path(cfg.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    result = run_arms(cfg.size, cfg.steps, out)
    (out / "bench_zero1.json").write_text(json.dumps(result, indent=1))
    print_table(result)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--arm":  # one arm, in its own process (run_arms)
        Path(sys.argv[2]).write_text(json.dumps(measure_arm(sys.argv[3:])))
    else:
        sys.exit(main(sys.argv[1:]))
