"""A ScheduleProblem for a named architecture on a device preset (CLI and benchmark helper).

Stage costs come from the costs package's analytic provider over a simple layout: `encoder_stages`
encoder stages then `llm_stages` LLM stages, layers split as evenly as possible, one tp degree per
module. With 0 encoder stages the encoder runs colocated on the first LLM stage. Tiles are packed by
row as the runtime packs them (`Layout.tiles_by_row`): give tile buckets per row
(`default_buckets(..., by_row=True)`).
"""

from __future__ import annotations

from dflop_jax.contracts import BucketSet, ScheduleProblem
from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.costs import AnalyticCostProvider, get_arch, get_device, layout_stage_costs


def split_stages(
    module: str, num_layers: int, stages: int, tp: int, dp: int
) -> tuple[StageSpec, ...]:
    """`stages` StageSpecs covering `num_layers` layers (earlier stages take the remainder)."""
    if stages < 1 or stages > num_layers:
        raise ValueError(
            f"{module} stages={stages}: need 1..{num_layers} (the module's layer count)"
        )
    out, first = [], 0
    for j in range(stages):
        n = num_layers // stages + (1 if j < num_layers % stages else 0)
        out.append(
            StageSpec(module, first, n, tp, dp, has_embedding=j == 0, has_head=j == stages - 1)
        )
        first += n
    return tuple(out)


def simple_layout(
    model: str,
    encoder_stages: int,
    llm_stages: int,
    encoder_dp: int,
    llm_dp: int,
    tp: tuple[int, int] = (1, 1),
) -> Layout:
    """Encoder stages then LLM stages of `model` (see the module docstring)."""
    arch = get_arch(model)
    enc = (
        ()
        if encoder_stages == 0
        else split_stages("encoder", arch.vision.num_layers, encoder_stages, tp[0], encoder_dp)
    )
    return Layout(enc, split_stages("llm", arch.llm.num_layers, llm_stages, tp[1], llm_dp))


def model_problem(
    model: str,
    device: str,
    buckets: BucketSet,
    microbatches: tuple[int, int],
    encoder_dp: int = 1,
    llm_dp: int = 1,
    stages: tuple[int, int] = (1, 1),
    tp: tuple[int, int] = (1, 1),
) -> ScheduleProblem:
    """ScheduleProblem with analytic stage costs of `model` on `device` over `simple_layout`."""
    layout = simple_layout(model, stages[0], stages[1], encoder_dp, llm_dp, tp)
    provider = AnalyticCostProvider(get_arch(model), get_device(device))
    return ScheduleProblem(
        encoder_dp=layout.encoder_dp,
        llm_dp=llm_dp,
        num_stages=layout.num_stages,
        microbatches=microbatches,
        buckets=buckets,
        stage_costs=layout_stage_costs(provider, layout),
        tiles_by_row=layout.tiles_by_row,
        row_align=layout.row_align,
    )
