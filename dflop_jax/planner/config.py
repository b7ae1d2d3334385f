"""The planner's search space and scoring settings (DESIGN section 7)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from dflop_jax.config import require, require_seed
from dflop_jax.costs.recipe import TRAINABLE_PARTS


def _positive_ints(values: tuple[int, ...], key: str) -> None:
    require(len(values) > 0, key, values, "give at least one value")
    require(
        all(isinstance(v, int) and v >= 1 for v in values),
        key,
        values,
        "all values must be integers >= 1",
    )
    require(len(set(values)) == len(values), key, values, "values must be distinct")


@dataclasses.dataclass(frozen=True)
class PlannerConfig:
    """What the planner may choose and how it scores a candidate.

    Attributes:
      mode: "dflop" (the data-aware search) or "uniform" (the data-blind baseline: one tp/pp/dp for the
        whole model, the encoder colocated; DESIGN section 8).
      tp: candidate tensor-parallel degrees (per module; kept only if they divide the module's heads,
        its KV heads, and fit in one host of the device preset).
      encoder_tp: candidate tensor-parallel degrees of the encoder in DFLOP mode (kept only if they
        divide its heads and fit in a host); empty = `tp`. Lets the encoder take a degree the LLM
        cannot (InternViT-6B's 25 heads: 1 or 5, Qwen2.5's 28 / 64 heads: 1, 2, 4, 8). A colocated
        encoder's tp must still divide LLM stage 0's; the uniform baseline uses one tp for both.
      encoder_pp: candidate encoder pipeline depths (separate encoder stages).
      audio_stages: a model with an audio encoder: also consider layouts with it on stages of its
        own (a second encoder branch beside the vision one, `Layout.audio_stages`); it is always
        considered on the first LLM stage too, where that stage's tp divides its heads and MLP.
      audio_tp: candidate tensor-parallel degrees of audio stages (kept only if they divide the
        audio encoder's heads and MLP and fit in a host); empty = `tp`.
      audio_pp: candidate audio pipeline depths; audio dp is any divisor of the LLM's dp (each
        audio replica encodes whole LLM rows).
      llm_pp: candidate LLM pipeline depths (layers split into balanced contiguous ranges).
      microbatches: candidate microbatch counts M per global batch.
      microbatch_slack: the scheduler may use M .. ceil(M x (1 + slack)) microbatches (absorbs batches
        that do not fit M microbatches of the largest buckets; the simulation scores what it picks).
      num_buckets: candidate sizes of the tile and length bucket ladders (planner/buckets.py): more
        sizes pad less and compile more programs, and with `steps` the planner prices both (a
        short run takes fewer); one size is the top of the ladder, the largest shape (what the
        uniform baseline always uses), scheduled data-aware all the same.
      steps: the run's optimizer steps: a candidate's compile time (its programs, `costs/compile.py`)
        is added to its expected step time amortized over them, so the ladder (and the sparse set
        of (tile, length) pairs a stage seeing both compiles) is chosen for the run's length. A
        training run's planner takes the run's `steps` (unless `price_compile` is off); 0 =
        compiling is not priced (the full grid of pairs).
      price_compile: a training run's planner prices compiling over the run's steps (False: it
        plans the full grid of (tile, length) pairs without pricing them).
      length_align: length buckets are multiples of this many tokens.
      memory_margin: fraction of device memory kept free (a layout must fit in (1 - margin) x capacity).
      samples: K global batches sampled from the shape distribution to score a candidate.
      global_batch: samples per global batch.
      max_idle_devices: candidates may leave at most this many of the requested devices unused.
      colocate: also consider layouts with the encoder colocated on the first LLM stage.
      encoder_stages: also consider layouts with separate encoder stages (a decoder-only
        training run's planner turns it off: it has no encoder to place).
      pooled_tiles: an encoder on stages of its own may also take a microbatch's tiles as one
        pool (`Layout.pooled_tiles`: fewer padded tiles, the first LLM stage gathering the whole
        pool) besides packed by LLM row (fewer bytes): both priced, chosen per layout.
      colocate_own_tp: a colocated encoder may also run at its own tp, a divisor of the stage's
        (`Layout.colocated_encoder_tp`; the trainer's planner turns it off: the runtime runs the
        colocated encoder at the stage's tp).
      virtual_stages: model chunks per LLM pipeline stage the data-blind baseline (uniform mode) may
        use, interleaved 1F1B (Megatron's virtual pipeline stages; 1, plain 1F1B, is always searched).
        DFLOP mode uses 1: the runtime's schedule is 1F1B.
      remat: activation recomputation settings to search (e.g. (False, True): both, chosen per layout);
        empty = the cost provider's own setting. Needs analytic costs (a measured table has one).
      screen_top: candidates that pass memory are first ranked by a mean-shape simulation; this many
        go on to the full expected-step-time scoring,
      screen_per_group: plus this many of each (microbatch count, colocated encoder or not) group.
      solver: scheduler solver used for scoring ("greedy" is fast; "auto"/"cpsat" refine).
      refine_top: re-score the best few with `refine_solver` (0 = off).
      refine_solver, refine_time_limit_s: solver and per-batch time box of that refinement.
      schedule: pipeline schedule simulated ("1f1b" or "gpipe").
      trainable: the training recipe's trained parts ("vision", "projector", "llm"; the training
        config's `optimizer.trainable`, which a training run's planner takes): frozen stages cost
        what the runtime runs for them (costs/recipe.py). The cost provider is re-made for it.
      seed: seeds batch sampling and the scheduler.
      top_n: alternatives written to plan.yaml.
      replan_every: a training run measures data drift every this many steps (0: never): the
        running plan and the best plan the planner finds for the last `replan_batches` global
        batches, scored on them, logged as `plan_regret` (planner/drift.py). Read with any `plan`.
      replan_batches: the recent global batches a drift measurement scores (K).
      replan: "log" (measure and log) or "on_drift": a measurement whose plan_regret exceeds
        `replan_threshold` makes the run re-plan at its next checkpoint (runtime/replan.py).
      replan_threshold: the plan_regret past which "on_drift" re-plans (0.1: the best plan found
        is at least ~9% faster).
    """

    mode: Literal["dflop", "uniform"] = "dflop"
    tp: tuple[int, ...] = (1, 2, 4, 8)
    encoder_tp: tuple[int, ...] = ()
    encoder_pp: tuple[int, ...] = (1, 2)
    audio_stages: bool = True
    audio_tp: tuple[int, ...] = ()
    audio_pp: tuple[int, ...] = (1,)
    llm_pp: tuple[int, ...] = (1, 2, 4, 7, 8)
    microbatches: tuple[int, ...] = (8, 16, 32, 64)
    microbatch_slack: float = 0.25
    num_buckets: tuple[int, ...] = (1, 2, 3, 4, 6)
    steps: int = 0
    price_compile: bool = True
    length_align: int = 64
    memory_margin: float = 0.1
    samples: int = 4
    global_batch: int = 256
    max_idle_devices: int = 0
    colocate: bool = True
    colocate_own_tp: bool = True
    encoder_stages: bool = True
    pooled_tiles: bool = True
    virtual_stages: tuple[int, ...] = (1,)
    remat: tuple[bool, ...] = ()
    screen_top: int = 8
    screen_per_group: int = 2
    solver: Literal["greedy", "auto", "cpsat"] = "greedy"
    refine_top: int = 0
    refine_solver: Literal["auto", "cpsat"] = "auto"
    refine_time_limit_s: float = 1.0
    schedule: Literal["1f1b", "gpipe"] = "1f1b"
    trainable: tuple[str, ...] = TRAINABLE_PARTS
    seed: int = 0
    top_n: int = 5
    replan_every: int = 0
    replan_batches: int = 8
    replan: Literal["log", "on_drift"] = "log"
    replan_threshold: float = 0.1

    def __post_init__(self):
        if self.encoder_tp:
            _positive_ints(self.encoder_tp, "planner.encoder_tp")
        if self.audio_tp:
            _positive_ints(self.audio_tp, "planner.audio_tp")
        for key in (
            "tp",
            "encoder_pp",
            "audio_pp",
            "llm_pp",
            "microbatches",
            "num_buckets",
            "virtual_stages",
        ):
            _positive_ints(getattr(self, key), f"planner.{key}")
        require(
            self.microbatch_slack >= 0,
            "planner.microbatch_slack",
            self.microbatch_slack,
            "must be >= 0",
        )
        require(
            all(isinstance(r, bool) for r in self.remat)
            and len(set(self.remat)) == len(self.remat),
            "planner.remat",
            self.remat,
            "give distinct booleans, e.g. [false, true], or [] for the cost provider's setting",
        )
        require(self.length_align >= 1, "planner.length_align", self.length_align, "must be >= 1")
        fix = "0 (compile time not priced) or the run's optimizer steps"
        require(self.steps >= 0, "planner.steps", self.steps, fix)
        require(
            0.0 <= self.memory_margin < 1.0,
            "planner.memory_margin",
            self.memory_margin,
            "must be in [0, 1), e.g. 0.1 keeps 10% free",
        )
        require(
            self.samples >= 1, "planner.samples", self.samples, "must be >= 1 (K sampled batches)"
        )
        require(self.global_batch >= 1, "planner.global_batch", self.global_batch, "must be >= 1")
        require(
            self.max_idle_devices >= 0,
            "planner.max_idle_devices",
            self.max_idle_devices,
            "must be >= 0",
        )
        require(self.replan_every >= 0, "planner.replan_every", self.replan_every,
                "0 (off) or steps between drift measurements")  # fmt: skip
        require(self.replan_batches >= 1, "planner.replan_batches", self.replan_batches,
                "must be >= 1 (recent global batches scored)")  # fmt: skip
        require(self.replan_threshold >= 0, "planner.replan_threshold", self.replan_threshold,
                "must be >= 0 (a plan_regret, e.g. 0.1)")  # fmt: skip
        require(self.screen_top >= 1, "planner.screen_top", self.screen_top, "must be >= 1")
        require(
            self.screen_per_group >= 0,
            "planner.screen_per_group",
            self.screen_per_group,
            "must be >= 0",
        )
        require(self.refine_top >= 0, "planner.refine_top", self.refine_top, "must be >= 0")
        require(
            self.refine_time_limit_s > 0,
            "planner.refine_time_limit_s",
            self.refine_time_limit_s,
            "must be > 0 seconds",
        )
        chosen = self.trainable
        ok = (
            bool(chosen) and len(set(chosen)) == len(chosen) and set(chosen) <= set(TRAINABLE_PARTS)
        )
        require(
            ok,
            "planner.trainable",
            list(chosen),
            f"give a non-empty subset of {list(TRAINABLE_PARTS)}, no repeats",
        )
        require(self.top_n >= 0, "planner.top_n", self.top_n, "must be >= 0")
        require_seed(self.seed, "planner.seed")
