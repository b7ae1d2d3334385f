"""Time to first step: a new user's walk, timed step by step, against the full-grid ladder.

    python -m dflop_jax.bench first_step [devices=1,4] [records=240] [steps=4] [out=runs/bench_first_step]

What a user meets on the README's workflow with an HF checkpoint and HF parquet data: a tiny random
LLaVA-OV written as an HF directory (28 px tiles, no `image_grid_pinpoints`: the anyres grid is
LLaVA-OV's default 6 x 6, up to 37 tiles a sample), 2 parquet shards of images of many sizes,
image pairs and text rows (`image: []`), and one run config with `plan: auto` and the default
profile and planner settings. Per device count, each step a process of its own as typed: `profile
data`, `profile model`, then per arm `plan` and `train` twice (the second run with the persistent
compilation cache warm):
  priced   the defaults: the planner prices compiling over the run's steps (`planner.steps`) and
           narrows the pairs a stage seeing both buckets compiles (docs/design.md section 7);
  grid     the previous default, the strongest baseline: a 6 x 6 ladder, every pair of the grid
           (`planner.num_buckets=[6] planner.price_compile=false`).
Reported per (devices, arm): the programs compiled before step 1 (the trainer's precompile line),
the seconds they took, the train process's wall time (cold, then warm cache), the programs built
after the precompile (0 expected), mean token and tile padding and steady step time; then the
ratios grid / priced. On CPU the simulated devices share the host's cores: compile time is what
the walk measures, not step speed.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from dflop_jax.bench._cli import command, load
from dflop_jax.config import require

ARMS = {
    "priced": [],
    "grid": ["planner.num_buckets=[6]", "planner.price_compile=false"],
}
COMPILED = re.compile(r"compiled (\d+) programs .*? in ([\d.]+)s", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class FirstStepBench:
    """The walk (module docstring).

    Attributes:
      devices: simulated CPU device counts, one walk each.
      records: records in the parquet shards (a quarter text, a quarter image pairs).
      steps: optimizer steps each training run takes.
      global_batch: records per step.
      out: working directory (data, checkpoint, runs, report.json).
      seed: seed of the data and the model.
    """

    devices: tuple[int, ...] = (1, 4)
    records: int = 240
    steps: int = 4
    global_batch: int = 16
    out: str = "runs/bench_first_step"
    seed: int = 0

    def __post_init__(self):
        require(all(d >= 1 for d in self.devices), "devices", self.devices, "give counts >= 1")
        require(self.records >= 4 * self.global_batch, "records", self.records,
                f"give at least 4 global batches ({4 * self.global_batch})")  # fmt: skip
        require(self.steps >= 1, "steps", self.steps, "must be >= 1")
        require(self.global_batch >= 1, "global_batch", self.global_batch, "must be >= 1")


COMMAND = command(
    "first_step",
    __doc__.split("\n")[0],
    "python -m dflop_jax.bench first_step devices=1 records=96 steps=2 out=runs/bench_first_step",
)


def write_checkpoint(path: Path, seed: int) -> Path:
    """A tiny random LLaVA-OV as an HF directory (config.json, safetensors, the bundled byte
    tokenizer as tokenizer.json, its <image> / <video> ids the model's), written by our exporter."""
    from flax import nnx
    from tokenizers import Tokenizer

    from dflop_jax.data.tokenizer import ASSET
    from models.decoder_config import DecoderConfig
    from models.hf import save_pretrained
    from models.llava_onevision import LlavaOnevision, llava_onevision_config
    from models.siglip import SiglipConfig

    tok = Tokenizer.from_file(str(ASSET))
    text = DecoderConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8)  # fmt: skip
    vision = SiglipConfig(hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                          image_size=28, patch_size=7)  # fmt: skip
    cfg = dataclasses.replace(
        llava_onevision_config(vision, text),
        image_token_id=tok.token_to_id("<image>"),
        video_token_id=tok.token_to_id("<video>"),
    )
    save_pretrained(LlavaOnevision(cfg, rngs=nnx.Rngs(seed)), cfg, path)
    shutil.copy(ASSET, path / "tokenizer.json")
    return path


def write_parquet(data: Path, records: int, seed: int) -> Path:
    """2 HF-layout parquet shards: images of many sizes (shard 0), image pairs and text rows with
    `image: []` (shard 1)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(seed)

    def image(h: int, w: int) -> dict:
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(out, "JPEG")
        return {"bytes": out.getvalue(), "path": "x.jpg"}

    shards: list[list[dict]] = [[], []]
    for i in range(records):
        kind = ("single", "single", "pair", "text")[i % 4]
        n = {"single": 1, "pair": 2, "text": 0}[kind]
        ims = [image(*(int(v) for v in rng.integers(20, 170, 2))) for _ in range(n)]
        ask = "<image>\n" * n + (
            f"What is in picture {i}?" if n else "Say something " * (1 + i % 7)
        )
        shards[kind != "single"].append({
            "id": f"r{i}", "data_source": kind, "image": ims,
            "conversations": [{"from": "human", "value": ask},
                              {"from": "gpt", "value": "Noise " * (1 + i % 9)}],
        })  # fmt: skip
    data.mkdir(parents=True, exist_ok=True)
    for k, rows in enumerate(shards):
        pq.write_table(pa.Table.from_pylist(rows), data / f"train-0000{k}-of-00002.parquet",
                       row_group_size=16)  # fmt: skip
    return data


def run_config(root: Path, cfg: FirstStepBench) -> Path:
    """The user's one config: the checkpoint, the data, plan: auto, default profile and planner."""
    config = {
        "model": {"hf_dir": str(root / "ckpt")},
        "data": {"source": str(root / "data"), "cache_dir": ""},
        "device": "cpu",
        "plan": "auto",
        "global_batch": cfg.global_batch,
        "steps": cfg.steps,
        "compilation_cache": str(root / "jax_cache"),
        "optimizer": {"lr": 0.01, "warmup_steps": 1, "decay_steps": cfg.steps},
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def step(root: Path, *argv: str) -> tuple[float, str]:
    """(wall seconds, output) of `python -m dflop_jax.<argv>` in `root`, as a user types it."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    print(f"{' '.join(a for a in argv if '=' not in a)} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", *argv], cwd=root, capture_output=True, text=True,
                         env=env, timeout=3600)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return time.perf_counter() - t0, out.stdout + out.stderr


def train_figures(output: str, run_dir: Path) -> dict:
    """The precompile line's programs and seconds, and the run's summary figures."""
    found = COMPILED.search(output)
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines() if r]
    later = rows[1:] or rows
    return {
        "programs": int(found.group(1)) if found else None,
        "compile_s": float(found.group(2)) if found else None,
        "after_precompile": sum(r["recompiles"] for r in rows),
        "padding_tokens": float(np.mean([r["llm_padding_ratio"] for r in rows])),
        "padding_tiles": float(np.mean([r["tile_padding_ratio"] or 0.0 for r in rows])),
        "step_s": float(np.median([r["step_time_s"] for r in later])),
    }


def walk(root: Path, cfg: FirstStepBench, devices: int) -> dict:
    """One device count's walk: the profiles once, then each arm's plan and two training runs."""
    config = str(root / "run.yaml")
    base = [f"num_devices={devices}", f"run_dir=runs/{devices}"]
    out = {"devices": devices}
    out["profile_data_s"], _ = step(root, "dflop_jax.profile", "data", "--config", config, *base)
    out["profile_model_s"], _ = step(root, "dflop_jax.profile", "model", "--config", config, *base)
    for arm, extra in ARMS.items():
        run_dir = root / "runs" / str(devices)
        plan_s, _ = step(root, "dflop_jax.plan", "--config", config, *base, *extra)
        plan_path = root / f"plan_{devices}_{arm}.yaml"
        shutil.copy(run_dir / "plan.yaml", plan_path)
        shutil.rmtree(root / "jax_cache", ignore_errors=True)
        runs = []
        for _ in range(2):  # cold, then with the persistent cache warm
            train_dir = root / "train" / f"{devices}_{arm}"
            shutil.rmtree(train_dir, ignore_errors=True)
            wall, output = step(root, "dflop_jax.train", "--config", config, *base, *extra,
                                f"plan={plan_path}", f"run_dir={train_dir}")  # fmt: skip
            runs.append({"train_s": wall, **train_figures(output, train_dir)})
        plan = yaml.safe_load(plan_path.read_text())
        out[arm] = {"plan_s": plan_s, "buckets": plan["buckets"], "cold": runs[0], "warm": runs[1]}
    return out


def report(walks: list[dict]) -> str:
    lines = ["| devices | arm | pairs | programs | compile s (cold / warm) | train s (cold / warm) "
             "| after precompile | token / tile padding | step s |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for w in walks:
        for arm in ARMS:
            a, c, h = w[arm], w[arm]["cold"], w[arm]["warm"]
            b = a["buckets"]
            pairs = len(b.get("pairs") or []) or len(b["tiles"]) * len(b["lengths"])
            lines.append(
                f"| {w['devices']} | {arm} | {pairs} | {c['programs']} | {c['compile_s']:.1f} / "
                f"{h['compile_s']:.1f} | {c['train_s']:.1f} / {h['train_s']:.1f} | "
                f"{c['after_precompile']} | {c['padding_tokens']:.1%} / {c['padding_tiles']:.1%} | "
                f"{c['step_s']:.3f} |"
            )
        g, p = w["grid"]["cold"], w["priced"]["cold"]
        lines.append(f"| {w['devices']} | grid / priced | | {g['programs'] / p['programs']:.1f}x | "
                     f"{g['compile_s'] / p['compile_s']:.1f}x | {g['train_s'] / p['train_s']:.1f}x "
                     "| | | |")  # fmt: skip
    profiles = ", ".join(
        f"{w['devices']} device(s): data {w['profile_data_s']:.0f} s, model "
        f"{w['profile_model_s']:.0f} s"
        for w in walks
    )
    return "\n".join(lines) + f"\n\nprofiles (shared by both arms): {profiles}"


def main(argv: list[str] | None = None) -> int:
    cfg, _ = load(COMMAND, FirstStepBench, argv)
    root = Path(cfg.out).resolve()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    write_checkpoint(root / "ckpt", cfg.seed)
    write_parquet(root / "data", cfg.records, cfg.seed)
    run_config(root, cfg)
    walks = [walk(root, cfg, n) for n in cfg.devices]
    (root / "report.json").write_text(json.dumps(walks, indent=1) + "\n")
    print(report(walks))
    print(f"wrote {root / 'report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
