"""The cost provider each candidate is scored with: remat on or off, encoder heads padded for its tp.

A Megatron user (the data-blind baseline) who wants tp 8 for InternViT-6B's 25 heads pads them to 32
with zero dummy heads (NVLM does); the padded heads cost real time and memory, so a candidate whose
encoder tp does not divide the heads is scored on `pad_vision_heads(arch, tp)`. DFLOP mode never pads:
our runtime cannot run padded heads, so its encoder tp must divide them. Remat on/off is a candidate
choice when `PlannerConfig.remat` lists both. Both need analytic costs (a measured table holds one
model at one remat setting).
"""

from __future__ import annotations

import dataclasses

from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.costs import AnalyticCostProvider
from dflop_jax.costs.architectures import pad_vision_heads


def encoder_tp(layout: Layout) -> int:
    """The encoder's tp (`Layout.encoder_tp`)."""
    return layout.encoder_tp


def can_vary(provider) -> bool:
    """Whether variants (padded heads, another remat setting) of `provider` can be built."""
    return isinstance(provider, AnalyticCostProvider)


def provider_variant(base, layout: Layout, remat: bool | None, pad_heads: bool):
    """`base`, or an analytic provider like it with `remat` (None: base's) and, with `pad_heads`, the
    encoder's heads padded to a multiple of the layout's encoder tp.

    Raises:
      ValueError: a variant is needed but `base` is not analytic.
    """
    arch = pad_vision_heads(base.arch, encoder_tp(layout)) if pad_heads else base.arch
    same_remat = remat is None or remat == getattr(base, "remat", None)
    if arch is base.arch and same_remat:
        return base
    if not can_vary(base):
        raise ValueError(
            f"cost provider {base.name} cannot model remat={remat} or padded encoder heads: "
            "use analytic costs or leave planner.remat empty"
        )
    return AnalyticCostProvider(
        arch,
        base.device,
        remat=base.remat if remat is None else remat,
        compute_bytes=base.compute_bytes,
        flash_attention=base.flash_attention,
        trainable=base.trainable,
        attention_impl=base.attention_impl,
    )


class ProviderVariants:
    """Memoized `provider_variant`s of one base provider for one search."""

    def __init__(self, base, pad_heads: bool):
        self.base, self.pad_heads = base, pad_heads
        self._cache: dict[tuple[int, bool | None], object] = {}

    def get(self, layout: Layout, remat: bool | None):
        key = (encoder_tp(layout) if self.pad_heads else 0, remat)
        if key not in self._cache:
            self._cache[key] = provider_variant(self.base, layout, remat, self.pad_heads)
        return self._cache[key]


def plan_provider(plan, base):
    """The provider `plan` was chosen with, rebuilt from `base` (its remat and, for a uniform plan,
    padded encoder heads), to evaluate the plan on other batches."""
    pad = plan.mode == "uniform" and can_vary(base)
    return provider_variant(base, plan.layout, plan.search["remat"], pad)


def plan_virtual_layout(plan) -> tuple[Layout, int]:
    """(the layout `plan` is simulated on, its chunks per stage): the plan's own layout, or for an
    interleaved plan the virtual one rebuilt from `search["virtual_layers"]`."""
    chunks = int(plan.search.get("virtual_stages", 1))
    if chunks == 1:
        return plan.layout, 1
    first, counts, out = plan.layout.llm_stages[0], plan.search["virtual_layers"], []
    for j, n in enumerate(counts):
        start = sum(counts[:j])
        out.append(StageSpec("llm", start, n, tp=first.tp, dp=first.dp, has_embedding=j == 0,
                             has_head=j == len(counts) - 1))  # fmt: skip
    return dataclasses.replace(plan.layout, llm_stages=tuple(out)), chunks


def plan_costs(plan, base):
    """`LayoutCosts` of `plan` with the provider it was chosen with (`plan_provider`) and the stage
    residual policies it was planned under (`Plan.residuals`: a stage that runs its forward again in
    the backward costs it), interleaved plans on their virtual layout (planned as "recompute")."""
    from dflop_jax.planner.scoring import LayoutCosts

    layout, chunks = plan_virtual_layout(plan)
    return LayoutCosts.build(plan_provider(plan, base), layout, chunks, plan.residuals or None)
