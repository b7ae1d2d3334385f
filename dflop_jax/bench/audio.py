"""Audio encoder work: clips packed by LLM row into fitted frame buckets, against padding them.

    python -m dflop_jax.bench audio mix=omni samples=512 batch=64 microbatches=8 llm_dp=4 buckets=4

A synthetic mix (`mix`: `omni`, speech clips of 1-35 s and sound clips of 20-65 s beside images, video
and text, a quarter of the samples holding audio; or `audio`, clips only) is written and read by the
data layer: every clip decoded, cut into 30 s windows, each
window's valid frames known (`SampleShape.audio_windows`). Global batches of `batch` samples are
scheduled as a run schedules them (greedy scheduler, analytic H100 costs of SigLIP-SO400M + Qwen2.5-7B,
`microbatches` x `llm_dp` rows, bucket ladders fitted to the data by the planner's rule), each
microbatch's audio bucket the smallest holding its fullest row. Per global batch, the audio encoder's
frames and forward FLOPs (Qwen2-Audio's tower, priced by `costs.audio_flops`) of three ways to feed it:

- padded to 30 s: every window padded to 3000 frames, one window per encoder row (what Qwen2-Audio's
  feature extractor hands HF's encoder);
- padded per microbatch: every window at its kept frames, padded to the microbatch's longest window
  (a batch of windows without packing);
- packed rows (the runtime's contract): each LLM row's windows back to back in llm_dp rows of the
  microbatch's audio bucket (`models.whisper` packed windows), so the fullest LLM row sets it;
- packed pool: the microbatch's windows as one pool over llm_dp rows (longest first, each to the
  emptiest row) at the smallest audio bucket holding the fullest: what an encoder that regroups
  its outputs into LLM rows afterwards would compute (not built).

Padding = 1 - kept frames / computed frames. The ratios are against the 30 s arm.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from dflop_jax.bench._cli import command, load
from dflop_jax.config import require, require_seed
from dflop_jax.contracts import SampleShape, kept_frames
from dflop_jax.costs import AUDIO_PRESETS, audio_flops

COMMAND = command(
    "audio",
    __doc__.split("\n\n")[0],
    "python -m dflop_jax.bench audio samples=96 batch=32 microbatches=4 llm_dp=2 out=runs/bench_audio",
)
MODEL = "siglip-so400m+qwen2.5-7b"
TOWER = AUDIO_PRESETS["qwen2-audio"]
WINDOW = 3000


@dataclasses.dataclass(frozen=True)
class AudioBenchConfig:
    """The data and the schedule the arms are counted on.

    Attributes:
      mix: the synthetic mix, "omni" or "audio".
      samples: records of the mix written (and read back) under `out`.
      batch: samples per global batch; microbatches, llm_dp: the rows a batch is packed into.
      buckets: sizes per ladder (tiles, lengths and audio frames per row).
      batches: global batches drawn (seeded) and averaged over.
      seed: seed of the data and the draws; out: folder for the data and bench_audio.json.
    """

    mix: str = "omni"
    samples: int = 512
    batch: int = 64
    microbatches: int = 8
    llm_dp: int = 4
    buckets: int = 4
    batches: int = 8
    seed: int = 0
    out: str = "runs/bench_audio"

    def __post_init__(self):
        for name in ("samples", "batch", "microbatches", "llm_dp", "buckets", "batches"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        require(self.batch >= self.microbatches, "batch", self.batch, "must be >= microbatches")
        require(self.mix in ("omni", "audio"), "mix", self.mix, "use omni or audio")
        require_seed(self.seed, "seed")


def mix_shapes(cfg: AudioBenchConfig) -> list[SampleShape]:
    """The mix's shapes as the data layer reads them (bad records left out, counted)."""
    from dflop_jax.data.bad_sample import BadSample
    from dflop_jax.data.config import DataConfig
    from dflop_jax.data.dataset import load_source
    from dflop_jax.data.process import Processor

    data = DataConfig(synth_dir=str(Path(cfg.out) / f"data_{cfg.mix}"), synth_samples=cfg.samples,
                      synth_mix=cfg.mix, synth_seed=cfg.seed, cache_dir="")  # fmt: skip
    proc, shapes = Processor(data), []
    for record in load_source(data, cfg.seed):
        try:
            shapes.append(proc.shape(record))
        except BadSample:
            continue
    return shapes


def arms(batch: list[SampleShape], schedule, buckets, llm_dp: int) -> dict[str, dict[str, float]]:
    """Frames computed, kept frames and forward FLOPs of each arm for one scheduled global batch."""
    kept = [[kept_frames(v) for v in s.audio_windows] for s in batch]
    real = float(sum(map(sum, kept)))
    windows = sum(len(k) for k in kept)
    out = {"padded to 30 s": (windows * WINDOW, windows * audio_flops(TOWER, WINDOW))}
    per_mb = packed = pooled = 0.0
    mb_flops = packed_flops = pooled_flops = 0.0
    for mb in schedule.microbatches:
        frames = sorted((f for i in mb.samples() for f in kept[i]), reverse=True)
        longest = frames[0] if frames else 0
        per_mb += len(frames) * longest
        mb_flops += len(frames) * audio_flops(TOWER, longest) if longest else 0.0
        packed += llm_dp * mb.audio_bucket
        packed_flops += llm_dp * audio_flops(TOWER, mb.audio_bucket) if mb.audio_bucket else 0.0
        rows = np.zeros(llm_dp)
        for f in frames:
            rows[rows.argmin()] += f
        pool = buckets.audio_bucket(int(rows.max()))
        pooled += llm_dp * pool
        pooled_flops += llm_dp * audio_flops(TOWER, pool) if pool else 0.0
    out["padded per microbatch"] = (per_mb, mb_flops)
    out["packed rows"] = (packed, packed_flops)
    out["packed pool"] = (pooled, pooled_flops)
    return {name: {"frames": f, "kept": real, "flops": fl} for name, (f, fl) in out.items()}


def run(cfg: AudioBenchConfig) -> dict:
    from dflop_jax.planner.buckets import ShapeStats, bucket_set
    from dflop_jax.scheduler import SchedulerConfig, sample_global_batch, schedule_batch
    from dflop_jax.scheduler.model_problem import model_problem

    shapes = mix_shapes(cfg)
    buckets = bucket_set(ShapeStats.of(shapes), cfg.batch, cfg.microbatches, cfg.llm_dp,
                         cfg.llm_dp, cfg.buckets, 128, by_row=True)  # fmt: skip
    problem = model_problem(MODEL, "h100", buckets, (cfg.microbatches, 2 * cfg.microbatches),
                            cfg.llm_dp, cfg.llm_dp)  # fmt: skip
    problem = dataclasses.replace(problem, tiles_by_row=True)
    rng = np.random.default_rng(cfg.seed)
    totals: dict[str, dict[str, float]] = {}
    for _ in range(cfg.batches):
        batch = sample_global_batch(shapes, cfg.batch, rng)
        schedule = schedule_batch(batch, problem, SchedulerConfig(solver="greedy"))
        for name, row in arms(batch, schedule, buckets, cfg.llm_dp).items():
            for key, value in row.items():
                totals.setdefault(name, {}).setdefault(key, 0.0)
                totals[name][key] += value / cfg.batches
    heard = [s for s in shapes if s.audio_windows]
    return {
        "config": dataclasses.asdict(cfg),
        "samples": len(shapes),
        "with_audio": len(heard),
        "audio_seconds_mean": float(np.mean([s.audio_seconds for s in heard])) if heard else 0.0,
        "audio_ladder": list(buckets.audio),
        "arms": totals,
    }


def print_table(result: dict) -> None:
    base = result["arms"]["padded to 30 s"]
    print(f"{result['samples']} samples, {result['with_audio']} with audio "
          f"({result['audio_seconds_mean']:.1f} s mean); audio ladder {result['audio_ladder']}")  # fmt: skip
    print(f"{'arm':<24}{'frames':>12}{'padding':>10}{'TFLOP':>10}{'vs 30 s':>10}")
    for name, row in result["arms"].items():
        pad = 1 - row["kept"] / row["frames"] if row["frames"] else 0.0
        ratio = row["flops"] / base["flops"] if base["flops"] else 0.0
        print(f"{name:<24}{row['frames']:>12.0f}{pad:>10.1%}{row['flops'] / 1e12:>10.2f}"
              f"{ratio:>9.2f}x")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    cfg, _ = load(COMMAND, AudioBenchConfig, argv)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    result = run(cfg)
    (out / "bench_audio.json").write_text(json.dumps(result, indent=1))
    print_table(result)
    return 0
