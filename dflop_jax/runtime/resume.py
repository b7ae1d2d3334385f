"""Resuming on another cluster shape: what of a checkpoint's scheduler state a new layout keeps.

Params, optimizer moments and the loader position need nothing here: the checkpoint's model tree is
layout-independent (`runtime/checkpoint.py`), ZeRO-1 state is saved unpadded and re-cut into the new
stages' shards on restore, and the loader's position counts global batches, which hold the same
samples whatever the layout (the loader draws them from `seed` and the batch index). The scheduler's
cost corrections are per (bucket pair, stage, direction): a factor learned for one stage is the
measured / predicted ratio of that stage's programs, so it carries over only to a stage that runs the
same programs on the same submesh shape. `carry_corrections` keeps the factors of every new stage
whose spec (module, layers, tp, dp, embedding, head, and for LLM stage 0 the colocated encoder) is
one of the old layout's, resets the others to 1, and drops what was measured per stage of the old
layout but not yet folded in (the lagged observations, the error windows).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dflop_jax.contracts.layout import Layout, StageSpec


def layout_from_dict(d: dict) -> Layout:
    """The `Layout` of a checkpoint's meta (`dataclasses.asdict(layout)`)."""
    return Layout(
        tuple(StageSpec(**s) for s in d["encoder_stages"]),
        tuple(StageSpec(**s) for s in d["llm_stages"]),
        d.get("colocated_encoder_tp"),
        tuple(StageSpec(**s) for s in d.get("audio_stages", ())),
        bool(d.get("pooled_tiles", False)),
    )


def stage_keys(layout: Layout) -> list[tuple]:
    """What a stage's programs depend on, per stage of `layout` in pipeline order: its spec, and for
    LLM stage 0 of a colocated layout the encoder it also runs (and whether the audio encoder has
    stages of its own, or the encoder's tiles come pooled)."""
    colocated = not layout.encoder_stages
    first_llm = layout.first_llm
    own = (colocated, layout.colocated_encoder_tp) + ((True,) if layout.audio_stages else ())
    own += ("pooled",) if layout.pooled_tiles else ()
    return [(dataclasses.astuple(s), own if i == first_llm else None)
            for i, s in enumerate(layout.stages)]  # fmt: skip


def stage_map(old: Layout, new: Layout) -> list[int | None]:
    """For each stage of `new`, the index of the old stage that means the same, or None."""
    old_index = {k: i for i, k in enumerate(stage_keys(old))}
    return [old_index.get(k) for k in stage_keys(new)]


@dataclasses.dataclass(frozen=True)
class CarriedCorrections:
    """The lagged scheduler state for the new layout and what was kept.

    Attributes:
      state: a `LaggedSchedule.state` for the new layout's scheduler.
      kept: new stage indices whose factors came from the checkpoint.
      reset: new stage indices whose factors start at 1.
    """

    state: dict
    kept: tuple[int, ...]
    reset: tuple[int, ...]
    same_buckets: bool = True

    def message(self) -> str:
        if not self.same_buckets:
            return (
                "the checkpoint's plan has other buckets; every stage's scheduler corrections reset"
            )
        if not self.reset:
            return (
                "the checkpoint comes from another layout; every stage's scheduler corrections kept"
            )
        kept = list(self.kept) or "none"
        return (
            "the checkpoint comes from another layout; scheduler corrections kept for stages "
            f"{kept}, reset for stages {list(self.reset)} (another split, tp or dp)"
        )


def carry_corrections(saved: dict, old: Layout, new: Layout, fresh: dict) -> CarriedCorrections:
    """The lagged scheduler state `saved` (`LaggedSchedule.state`, saved under layout `old`) for a
    scheduler of layout `new` whose own fresh `Scheduler.state_dict()` is `fresh`.

    Factors of the stages `stage_map` pairs are kept; other stages start at 1. Bucket counts and the
    observation count are kept (they count microbatches, not stages). The error windows and the
    observations not yet folded in were measured per old stage and are dropped; so is a checkpoint
    whose buckets differ from the new plan's (every stage reset).
    """
    old_sched = saved["scheduler"]
    mapping = stage_map(old, new)
    same = same_buckets(old_sched, fresh)
    if not same:
        mapping = [None] * new.num_stages
    sched = dict(fresh)
    if any(m is not None for m in mapping):
        old_f, new_f = np.asarray(old_sched["factors"]), np.array(fresh["factors"])
        for p, q in enumerate(mapping):
            if q is not None:
                new_f[:, :, p] = old_f[:, :, q]
        sched.update(
            factors=new_f.tolist(),
            counts=old_sched["counts"],
            observations=old_sched["observations"],
        )
    sched["steps"] = old_sched["steps"]
    state = dict(saved, scheduler=sched, observations={})
    kept = tuple(p for p, q in enumerate(mapping) if q is not None)
    reset = tuple(p for p, q in enumerate(mapping) if q is None)
    return CarriedCorrections(state, kept, reset, same)


def same_buckets(saved: dict, fresh: dict) -> bool:
    """Whether two `Scheduler.state_dict()`s are over the same bucket ladders (a re-plan may keep
    the layout and change only its buckets)."""
    return (list(saved["tiles"]), list(saved["lengths"])) == (
        list(fresh["tiles"]),
        list(fresh["lengths"]),
    )
