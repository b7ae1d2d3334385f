"""Cost-balanced layer splits: give a stage that also runs something else (the colocated encoder, the
patch embedding, the projector, the LM head) fewer layers.

An even split (`candidates.split_layers`) ignores that LLM stage 0 of a colocated layout also runs the
whole encoder, that the last LLM stage runs the LM head, and that the encoder's first and last stages
run the patch embedding and the projector. With a stage's cost at the mean-shape buckets modelled as
fixed_s + n_s x per_layer (fixed_s: what the stage runs besides its layers; per_layer: one layer of its
module), the split minimizing max_s cost within one module is found by water-filling: start every stage
at one layer and give each next layer to the stage whose cost after taking it is lowest (optimal for
this separable min-max). Each module is balanced on its own (their layers cannot move across).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dflop_jax.costs.layout import Layout, StageSpec


def balanced_layout(
    provider, layout: Layout, stage_costs: np.ndarray, tile_bucket: int, length_bucket: int
) -> Layout:
    """`layout` with each pipelined module's layers re-split to balance `stage_costs` ([P, 2] at the
    mean-shape buckets: tiles per encoder shard, tokens per LLM row).

    Returns `layout` itself when no split changes.
    """
    totals = np.asarray(stage_costs, dtype=np.float64).sum(axis=1)  # [P]
    e = len(layout.encoder_stages)
    enc = _rebalanced(provider, layout.encoder_stages, totals[:e], tile_bucket)
    llm = _rebalanced(provider, layout.llm_stages, totals[e:], length_bucket)
    if enc == layout.encoder_stages and llm == layout.llm_stages:
        return layout
    return Layout(enc, llm)


def _rebalanced(provider, stages: tuple[StageSpec, ...], totals, bucket: int):
    """The stages of one module with their layer counts water-filled (see the module docstring)."""
    if len(stages) < 2:
        return stages
    one = StageSpec(stages[0].module, 0, 1, tp=stages[0].tp, dp=stages[0].dp)
    per_layer = float(sum(provider.stage_time(one, bucket)))
    fixed = [float(totals[i]) - s.num_layers * per_layer for i, s in enumerate(stages)]
    counts = [1] * len(stages)
    for _ in range(sum(s.num_layers for s in stages) - len(stages)):
        i = min(range(len(stages)), key=lambda j: (fixed[j] + (counts[j] + 1) * per_layer, j))
        counts[i] += 1
    if counts == [s.num_layers for s in stages]:
        return stages
    out, start = [], 0
    for s, n in zip(stages, counts):
        out.append(dataclasses.replace(s, first_layer=start, num_layers=n))
        start += n
    return tuple(out)
