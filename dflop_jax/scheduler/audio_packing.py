"""Audio frames in the packing search: an omni batch's third resource (DESIGN section 4).

The tile/length search (greedy, refinement, the makespan pick) packs on tiles and tokens; a
microbatch's audio bucket is then its fullest row's frames (`objective.with_audio`, which first
re-packs the rows within the chosen buckets). That search cannot see that two clips in one row
double the microbatch's audio bucket, so beside its answer `pick_with_audio` builds one candidate
per microbatch count the greedy tries with a three-resource LPT (`greedy.lpt_assign` with frames:
each sample to the row whose worst normalized load, the row's tokens, its tiles (its microbatch's
when tiles are pooled) or the row's audio frames, grows least), finished as the runtime receives any candidate (`select.finish`) and given its
audio buckets. Every candidate is priced with each microbatch at its audio bucket
(`ScheduleProblem.microbatch_costs`) and chosen by the rule the tile/length search uses (`select.py`:
the 1F1B makespan of a good order with several stages, else the objective), the tile/length answer
on ties; the winner's microbatches run in the order found for those audio-priced costs
(`order.order_microbatches`), so the 1F1B order sees the audio encoder too. Deterministic, as the
rest of the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dflop_jax.contracts import SampleShape, ScheduledMicrobatch, ScheduleProblem
from dflop_jax.scheduler.config import SchedulerConfig
from dflop_jax.scheduler.greedy import candidate_counts, lpt_assign
from dflop_jax.scheduler.objective import (
    CostTable,
    evaluate,
    padding_ratios,
    surrogate_step_time,
    to_plans,
    with_audio,
)
from dflop_jax.scheduler.order import order_microbatches
from dflop_jax.scheduler.select import finish


def _candidate(tokens, tiles, frames, m, shapes, problem, capped, table):
    """The three-resource LPT's plans at m microbatches with their audio buckets, or None where a
    microbatch needs more than the largest buckets (LPT balances loads, it does not cap them)."""
    bin_of = lpt_assign(tokens, tiles, m, capped, capped.tiles_by_row, frames)
    bin_of, m = finish(bin_of, m, tokens, tiles, capped, table, capped.microbatches[0])
    try:
        obj, _, ti, si = evaluate(bin_of, m, tokens, tiles, capped, table)
        if not np.isfinite(obj):  # packed by row: a row over the largest tile bucket
            return None
        plans = to_plans(bin_of, m, ti, si, problem, table)
        return with_audio(plans, shapes, problem.buckets, problem.audio_always)
    except ValueError:  # over the largest length or audio bucket
        return None


def audio_costs(plans: Sequence[ScheduledMicrobatch], problem: ScheduleProblem) -> np.ndarray:
    """[M, P, 2] stage costs of `plans`, each at its audio bucket."""
    return np.stack([problem.microbatch_costs(p) for p in plans])


def pick_with_audio(
    plans: tuple[ScheduledMicrobatch, ...] | None,
    shapes: Sequence[SampleShape],
    problem: ScheduleProblem,
    capped: ScheduleProblem,
    table: CostTable,
    config: SchedulerConfig,
    info: dict,
) -> tuple[tuple[ScheduledMicrobatch, ...], float]:
    """(plans in run order, objective) of the best of `plans` (the tile/length search's answer,
    with audio buckets; None where one of its rows holds more audio than the largest bucket) and
    the three-resource candidates (module docstring); `capped`: the problem with its microbatch
    counts capped at the batch size. Records in `info` which packing won, the objectives, the
    audio-priced 1F1B makespan and the winner's padding (its load-balance figures stay the
    tile/length answer's).

    Chosen as `select.py` chooses (`config.select`): with several stages by the 1F1B makespan of
    each candidate's audio-priced costs (a short order search each, then the full one for the
    tile/length answer and the two best others, so the answer is never slower than the tile/length
    answer in its full search), else by the objective; ties to the tile/length answer."""
    cands = [plans] if plans is not None else []
    frames = np.array([s.audio_frames for s in shapes], dtype=np.float64)
    if frames.any():
        tokens = np.array([s.tokens for s in shapes], dtype=np.float64)
        tiles = np.array([s.tiles for s in shapes], dtype=np.float64)
        for m in candidate_counts(capped, len(shapes)):
            cand = _candidate(tokens, tiles, frames, m, shapes, problem, capped, table)
            if cand is not None:
                cands.append(cand)
    if not cands:
        raise ValueError(
            f"no packing of these {len(shapes)} samples keeps each LLM row's audio within the "
            f"largest audio bucket {problem.buckets.audio[-1]} frames: give a larger audio bucket "
            "or allow more microbatches"
        )
    searched = [0] if plans is not None else []  # the tile/length answer: always fully ordered
    costs = [audio_costs(c, problem) for c in cands]
    objs = [surrogate_step_time(c) for c in costs]
    if config.select == "makespan" and problem.num_stages > 1:
        quick = [order_microbatches(c, config.select_evaluations)[1] for c in costs]
        others = range(len(searched), len(cands))
        ranked = sorted(others, key=lambda i: (quick[i], objs[i], i))
        finals = {
            i: order_microbatches(costs[i], config.order_evaluations)
            for i in [*searched, *ranked[: 3 - len(searched)]]
        }
        best = min(finals, key=lambda i: (finals[i][1], objs[i], i))
        order, makespan = finals[best]
    else:
        best = min(range(len(cands)), key=lambda i: (objs[i], i))
        order, makespan = order_microbatches(costs[best], config.order_evaluations)
    audio_won = best != 0 or plans is None
    if audio_won:  # the report's padding is the winner's
        tokens = np.array([s.tokens for s in shapes], dtype=np.float64)
        tiles = np.array([s.tiles for s in shapes], dtype=np.float64)
        info.update(padding_ratios(cands[best], tokens, tiles, problem))
    info.update(
        audio_packing="three resources" if audio_won else "tiles and tokens",
        audio_searched_objective=objs[0] if searched else float("inf"),
        audio_objective=objs[best],
        microbatches=len(cands[best]),
        simulated_makespan_s=makespan,
    )
    return tuple(cands[best][k] for k in order), objs[best]
