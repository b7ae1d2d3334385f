"""`ProfileSettings`: what the model profiler measures (its grid and timing), as a training config, the
profile CLI and the profiler itself name it. Pure Python, so configs parse it without jax and the
runtime's `TrainConfig` composes it without importing the profiler."""

from __future__ import annotations

import dataclasses

from dflop_jax.config import InputPath, require
from dflop_jax.contracts.cost_table import ALL_KINDS, RESIDUAL_POLICIES

# Shape mixes that stand in for a data profile: LLaVA-OV-like (`scheduler.llava_ov_mix`) and the
# published InternVL statistics (`scheduler.omnibal_shapes`).
SYNTHETIC_SHAPES = ("llava-ov", "omnibal")


@dataclasses.dataclass(frozen=True)
class ProfileSettings:
    """What the profiling steps measure: the data profile's sample and the model profiler's grid.

    Attributes:
      data_source: the shapes the plan is made for: "dataset" (`profile data` profiles the run's
        `data` section into `run_dir/auto_plan/data/shape_distribution.json`; `plan` reads it, or the
        data's shapes from metadata when it is absent), a shape-distribution JSON path, or a
        synthetic mix (`SYNTHETIC_SHAPES`: "llava-ov", "omnibal") to plan without data.
      data_samples: records the data profile draws (seeded by the run's `seed`), or samples of the
        synthetic llava-ov mix.
      tps: candidate tensor-parallel degrees (kept if they divide the heads and fit the devices).
      encoder_buckets: tiles per encoder shard to profile.
      llm_buckets: tokens per packed LLM row to profile.
      audio_buckets: mel frames of one packed audio row per shard to profile (multiples of 4: each
        audio window starts at one); only a model with an audio encoder profiles them.
      kinds: stage parts to profile (default: all, the colocated stage's program included).
      warmup: untimed runs per program after compiling.
      runs: timed runs per program.
      statistic: which of the timed runs is kept: "median" (default), or "min" (robust on a machine
        shared with other jobs: the minimum is the uncontended time).
      compute_dtype: dtype of the programs' matmuls ("bfloat16" as in training, or "float32").
      residuals: the residual policy whose programs are timed (`RESIDUAL_POLICIES`): "all" (what
        the run's "auto" trains wherever it fits: the forward keeping its residuals, the backward
        from them), "layers", or "recompute" (the backward re-runs the stage forward).
      memory_limit_bytes: per-device memory; entries whose compiled peak exceeds it are skipped.
    """

    data_source: str = "dataset"
    data_samples: int = 2000
    tps: tuple[int, ...] = (1, 2, 4, 8)
    encoder_buckets: tuple[int, ...] = (1, 2, 4, 8, 16)
    llm_buckets: tuple[int, ...] = (64, 128, 256, 512, 1024)
    audio_buckets: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    kinds: tuple[str, ...] = ALL_KINDS
    warmup: int = 2
    runs: int = 5
    statistic: str = "median"
    compute_dtype: str = "bfloat16"
    residuals: str = "all"
    memory_limit_bytes: float = 2 * 2**30

    def __post_init__(self):
        require(bool(self.data_source), "profile.data_source", self.data_source,
                f"give 'dataset', a shape-distribution JSON or one of {SYNTHETIC_SHAPES}")  # fmt: skip
        require(self.data_samples >= 1, "profile.data_samples", self.data_samples, "must be >= 1")
        for key in ("tps", "encoder_buckets", "llm_buckets", "audio_buckets"):
            values = getattr(self, key)
            require(len(values) > 0 and min(values) >= 1, f"profile.{key}", values,
                    "give integers >= 1")  # fmt: skip
            require(list(values) == sorted(set(values)), f"profile.{key}", values,
                    "give increasing values, no repeats")  # fmt: skip
        require(all(b % 4 == 0 for b in self.audio_buckets), "profile.audio_buckets",
                self.audio_buckets, "give multiples of 4 (audio windows start at one)")  # fmt: skip
        bad = [k for k in self.kinds if k not in ALL_KINDS]
        require(not bad, "profile.kinds", self.kinds, f"use names from {ALL_KINDS}")
        require(self.runs >= 1, "profile.runs", self.runs, "must be >= 1")
        require(self.statistic in ("median", "min"), "profile.statistic", self.statistic,
                "use 'median' or 'min'")  # fmt: skip
        require(self.warmup >= 0, "profile.warmup", self.warmup, "must be >= 0")
        require(self.compute_dtype in ("bfloat16", "float32"), "profile.compute_dtype",
                self.compute_dtype, "use 'bfloat16' or 'float32'")  # fmt: skip
        require(self.residuals in RESIDUAL_POLICIES, "profile.residuals", self.residuals,
                f"use one of {list(RESIDUAL_POLICIES)}")  # fmt: skip
        require(self.memory_limit_bytes > 0, "profile.memory_limit_bytes",
                self.memory_limit_bytes, "must be > 0")  # fmt: skip

    def inputs(self) -> list[InputPath]:
        if self.data_source in ("dataset", *SYNTHETIC_SHAPES):
            return []
        fix = f"give a shape-distribution JSON, 'dataset' or one of {SYNTHETIC_SHAPES}"
        return [InputPath("data_source", self.data_source, "file", fix)]
