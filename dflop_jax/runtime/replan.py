"""Re-planning a running job when its data drifts (`planner.replan: on_drift`).

A drift measurement (`planner/drift.py`) whose `plan_regret` exceeds `planner.replan_threshold` makes
the run, at its next checkpoint, save, take the planner's pick for the recent batches, rebuild its
stages on the same devices and restore them from that checkpoint (`runtime/resume.py`: any layout
resumes any checkpoint), then go on. The pick's bucket ladders are extended to the running plan's
largest buckets, so every sample the run accepted still fits a row. Every process decides alike: in
this mode a due measurement waits for the one before it (none is skipped) and the checkpoint waits
for the last one, so every process holds the same measurements, and the planner is deterministic
(greedy scoring, no refinement).
"""

from __future__ import annotations

import hashlib

from dflop_jax.contracts import BucketSet
from dflop_jax.planner.drift import Drift
from dflop_jax.planner.resolve import ResolvedPlan


def wants_replan(drift: Drift | None, threshold: float) -> bool:
    """Whether `drift` calls for a new plan: a pick whose regret is above `threshold`."""
    return drift is not None and drift.best is not None and drift.regret > threshold


def pick_digest(drift: Drift | None) -> int:
    """A 56-bit digest of the drift's pick (layout, buckets, microbatch range; 0 for none): what the
    processes of a job compare before they re-plan together."""
    if drift is None or drift.best is None:
        return 0
    best = drift.best
    text = repr((best.layout, best.buckets, best.microbatch_range))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")


def covering(new: BucketSet, old: BucketSet) -> BucketSet:
    """`new`'s ladders, each topped with `old`'s largest bucket where that is larger; a sparse pair
    set keeps its pairs and gains the new largest pair (the one anything fits)."""

    def top(ladder: tuple[int, ...], largest: int) -> tuple[int, ...]:
        return (*ladder, largest) if largest > ladder[-1] else tuple(ladder)

    tiles, lengths = top(new.tiles, max(old.tiles)), top(new.lengths, max(old.lengths))
    pairs = tuple(sorted({*new.pairs, (tiles[-1], lengths[-1])})) if new.pairs else ()
    audio = top(new.audio, max(old.audio)) if new.audio and old.audio else new.audio
    return BucketSet(tiles, lengths, pairs, audio)


def next_plan(drift: Drift, running: ResolvedPlan) -> ResolvedPlan:
    """The plan to go on with: the drift's pick (its layout, microbatch range, residual policies),
    covering buckets, the running cost provider."""
    plan = drift.best
    buckets = covering(plan.buckets, running.buckets)
    residuals = plan.residuals or None
    return ResolvedPlan(plan.layout, buckets, plan.microbatch_range, running.provider, residuals)


def describe(drift: Drift, old: ResolvedPlan, new: ResolvedPlan, step: int) -> str:
    """The log line of a re-plan: why, and both layouts with their predicted step times."""
    return (
        f"re-plan after step {step}: plan_regret {drift.regret:.1%} (measured after step "
        f"{drift.step}) over the threshold; old {_layout(old.layout)} {drift.running_s * 1e3:.1f} "
        f"ms/step on the recent data -> new {_layout(new.layout)} {drift.planned_s * 1e3:.1f} "
        f"ms/step, buckets tiles={list(new.buckets.tiles)} lengths={list(new.buckets.lengths)}"
    )


def _layout(layout) -> str:
    return " + ".join(f"{s.module}[{s.first_layer}..{s.first_layer + s.num_layers - 1} dp{s.dp} "
                      f"tp{s.tp}]" for s in layout.stages)  # fmt: skip
