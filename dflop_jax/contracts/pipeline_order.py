"""The order a pipeline stage runs its microbatches in: one definition for the runtime and the simulator.

`runtime/driver.py` dispatches the stage programs in this order and `sim/pipeline.py` simulates the
same order, so the simulated step and the trained step agree by construction (DESIGN section 5).

    stage_order("1f1b", stage=0, num_stages=3, num_microbatches=4)
    -> [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]

Encoder branches (two encoders feeding the first LLM stage): the stages form an in-tree, each stage
but the last feeding one `child`. A stage's 1F1B warm-up is then set by its depth, the stages from
it to the last (`depths`): a branch stage runs as the stage of a chain that many stages from the end
(`chain_position`).
"""

from __future__ import annotations

import functools

SCHEDULES_BY_STAGE = ("1f1b", "gpipe")


def stage_order(
    schedule: str, stage: int, num_stages: int, num_microbatches: int
) -> list[tuple[str, int]]:
    """The (kind, microbatch) sequence stage `stage` of `num_stages` executes: "F" forward, "B"
    backward. GPipe: every forward, then every backward. 1F1B: stage s warms up with
    min(P - 1 - s, M) forwards (what bounds its in-flight microbatches), then alternates one forward
    and one backward, then drains the remaining backwards."""
    m = num_microbatches
    if schedule == "gpipe":
        return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"pipeline order {schedule!r}: choose one of {SCHEDULES_BY_STAGE}")
    warmup = min(num_stages - stage - 1, m)
    order = [("F", k) for k in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", k) for k in range(m - warmup, m)]
    return order


def depths(children: tuple[int, ...]) -> tuple[int, ...]:
    """Per stage, the stages from it to the last inclusive, given each stage's child (the stage its
    output feeds; -1 for the last stage, which must be the only one). A chain's children are
    (1, 2, ..., P - 1, -1) and its depths (P, P - 1, ..., 1)."""
    p = len(children)
    if [j for j, c in enumerate(children) if c < 0] != [p - 1] or any(
        not j < c < p for j, c in enumerate(children[:-1])
    ):
        raise ValueError(
            f"children={list(children)}: each stage but the last feeds one later stage (the last "
            "feeds none: -1)"
        )
    out = [1] * p
    for j in range(p - 2, -1, -1):
        out[j] = out[children[j]] + 1
    return tuple(out)


@functools.cache  # the driver asks per dispatched op: one tuple per (tree, stage)
def parents(children: tuple[int, ...], stage: int) -> tuple[int, ...]:
    """The stages whose outputs `stage` takes (those whose child it is), ascending: none for a
    branch's first stage, two for the stage joining two branches."""
    return tuple(j for j, c in enumerate(children) if c == stage)


def chain_position(depth: int, num_stages: int) -> int:
    """The chain stage whose 1F1B order a stage `depth` stages from the end runs."""
    return num_stages - depth
