"""Cost-balanced LLM layer splits: give the stage that also runs the encoder (or the LM head) fewer layers.

An even split (`candidates.split_layers`) ignores that LLM stage 0 of a colocated layout also runs the
whole encoder, and that the last stage runs the LM head. With a stage's cost at the mean-shape buckets
modelled as fixed_s + n_s x per_layer (fixed_s: encoder, embedding, head; per_layer: one decoder layer),
the split minimizing max_s cost is found by water-filling: start every stage at one layer and give each
next layer to the stage whose cost after taking it is lowest (optimal for this separable min-max).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dflop_jax.costs.layout import Layout, StageSpec


def balanced_llm_layout(
    provider, layout: Layout, stage_costs: np.ndarray, length_bucket: int
) -> Layout:
    """`layout` with its LLM layers re-split to balance `stage_costs` ([P, 2] at the mean-shape buckets).

    Returns `layout` itself when it has one LLM stage or the balanced split equals the current one.
    """
    llm = layout.llm_stages
    if len(llm) < 2:
        return layout
    first = len(layout.encoder_stages)
    plain = StageSpec("llm", 0, 1, tp=llm[0].tp, dp=llm[0].dp)
    per_layer = float(sum(provider.stage_time(plain, length_bucket)))
    totals = np.asarray(stage_costs, dtype=np.float64).sum(axis=1)[first:]  # [pp]
    fixed = [float(totals[i]) - s.num_layers * per_layer for i, s in enumerate(llm)]
    counts = [1] * len(llm)
    for _ in range(sum(s.num_layers for s in llm) - len(llm)):
        i = min(range(len(llm)), key=lambda j: (fixed[j] + (counts[j] + 1) * per_layer, j))
        counts[i] += 1
    if counts == [s.num_layers for s in llm]:
        return layout
    stages, start = [], 0
    for s, n in zip(llm, counts):
        stages.append(dataclasses.replace(s, first_layer=start, num_layers=n))
        start += n
    return Layout(layout.encoder_stages, tuple(stages))
