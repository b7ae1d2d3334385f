"""The MPMD pipeline driver: one Python loop dispatching stage programs in 1F1B (or GPipe) order.

Every process runs this same loop (same programs, same transfers, same order). JAX dispatch is
asynchronous, so on accelerators the stages overlap; the order below is what a real 1F1B pipeline
would execute, and the dependencies make it valid for any stage count and microbatch count.

Measured steps (`measure=True`): before each op the driver waits for its inputs, then times the program
until its outputs are ready, giving per-stage, per-microbatch seconds for the scheduler's adaptive
correction. This serializes that step (no stage overlap, so its step time is not representative); on
CPU the simulated devices share the cores anyway. An op whose call compiled a new program is marked
invalid (its time is mostly compilation).

Transfers: a stage's output goes to the next stage with `jax.device_put(y, next.x_sharding)` (shard to
shard between submeshes, never through one device); cotangents go back the same way.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import jax
import numpy as np

from dflop_jax.data.types import PackedMicrobatch
from dflop_jax.runtime.stages import PyTree, StageProgram

Order = Literal["1f1b", "gpipe"]


@dataclasses.dataclass(frozen=True)
class Op:
    """One dispatch: forward ("F") or backward ("B") of microbatch `mb` on stage `stage`."""

    stage: int
    mb: int
    kind: Literal["F", "B"]


def stage_ops(stage: int, num_stages: int, num_mb: int, order: Order) -> list[Op]:
    """The op sequence one stage executes. The last stage's forward is fused with its backward."""
    if stage == num_stages - 1:
        return [Op(stage, m, "F") for m in range(num_mb)]
    if order == "gpipe":
        return [Op(stage, m, "F") for m in range(num_mb)] + [
            Op(stage, m, "B") for m in range(num_mb)
        ]
    if order != "1f1b":
        raise ValueError(f"pipeline order {order!r}: choose '1f1b' or 'gpipe'")
    warmup = min(num_stages - 1 - stage, num_mb)
    ops = [Op(stage, m, "F") for m in range(warmup)]
    for i in range(num_mb - warmup):
        ops += [Op(stage, warmup + i, "F"), Op(stage, i, "B")]
    ops += [Op(stage, m, "B") for m in range(num_mb - warmup, num_mb)]
    return ops


def pipeline_order(num_stages: int, num_mb: int, order: Order) -> list[Op]:
    """Merges the per-stage sequences into one dispatch order respecting data dependencies.

    Round by round, each stage issues its next op if its input is ready (a forward needs the previous
    stage's forward of that microbatch; a backward needs the next stage's backward, or the next stage's
    fused forward+backward when that stage is the last).
    """
    queues = [stage_ops(s, num_stages, num_mb, order) for s in range(num_stages)]
    done: set[Op] = set()
    out: list[Op] = []
    heads = [0] * num_stages
    last = num_stages - 1
    while len(out) < sum(len(q) for q in queues):
        issued = []
        for s in range(num_stages):
            if heads[s] == len(queues[s]):
                continue
            op = queues[s][heads[s]]
            if op.kind == "F":
                ready = s == 0 or Op(s - 1, op.mb, "F") in done
            else:
                ready = Op(s + 1, op.mb, "F" if s + 1 == last else "B") in done
            if ready:
                issued.append(op)
                heads[s] += 1
        if not issued:
            raise RuntimeError(f"pipeline order {order} deadlocked at {heads}; this is a bug")
        done.update(issued)
        out.extend(issued)
    return out


@dataclasses.dataclass
class StepOutput:
    """What one pipelined step produced (device values; pull to host only when needed).

    Attributes:
      loss: per-microbatch normalized loss contributions (sum = the step's loss), on the last stage.
      grads: accumulated fp32 gradients per stage, on each stage's mesh.
      stage_times: measured steps only: [M, P, 2] seconds (fwd, bwd) per microbatch and stage; the
        last stage's fused forward+backward program is reported whole in the fwd slot (bwd = 0).
      timing_valid: measured steps only: [M] bool, False where an op of the microbatch compiled.
    """

    loss: list[jax.Array]
    grads: list[PyTree]
    stage_times: np.ndarray | None = None
    timing_valid: np.ndarray | None = None


def run_pipeline(
    stages: Sequence[StageProgram],
    microbatches: Sequence[PackedMicrobatch | Mapping[str, np.ndarray]],
    normalizer: float,
    order: Order = "1f1b",
    *,
    measure: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> StepOutput:
    """Forward + backward of one global batch through the pipeline, accumulating gradients.

    Args:
      stages: stage programs in pipeline order (encoder stages, then LLM stages).
      microbatches: the packed microbatches (`PackedMicrobatch`, or its arrays by field name).
      normalizer: loss tokens of the whole global batch; each microbatch's loss sum is divided by it,
        so the objective does not depend on how samples were packed or split.
      order: "1f1b" or "gpipe".
      measure: time every op (blocking; module docstring) into `StepOutput.stage_times`.
      clock: the timer of measured steps (seconds).

    Returns:
      StepOutput with the loss contributions and the accumulated gradients.
    """
    num_stages, num_mb = len(stages), len(microbatches)
    grads = [s.zero_grads() for s in stages]
    inputs: dict[tuple[int, int], jax.Array | None] = {(0, m): None for m in range(num_mb)}
    sides: dict[tuple[int, int], dict] = {}
    cotangents: dict[tuple[int, int], jax.Array] = {}
    losses: list[jax.Array | None] = [None] * num_mb
    times = np.zeros((num_mb, num_stages, 2)) if measure else None
    valid = np.ones(num_mb, bool) if measure else None
    for op in pipeline_order(num_stages, num_mb, order):
        s, m = op.stage, op.mb
        stage = stages[s]
        if op.kind == "F":
            sides[s, m] = stage.put_side(_fields(microbatches[m]))
        if measure:  # inputs ready first, so only the program is timed
            jax.block_until_ready((inputs[s, m], sides[s, m], cotangents.get((s, m)), grads[s]))
            compiles, t0 = stage.compiles, clock()
        if op.kind == "F":
            x = inputs[s, m]
            if stage.is_last:
                loss, _, gx, grads[s] = stage.forward_backward_loss(
                    x, sides.pop((s, m)), normalizer, grads[s]
                )
                inputs.pop((s, m))
                losses[m] = loss
                out = (loss, gx, grads[s])
            else:
                y = stage.forward(x, sides[s, m])
                out = y
        else:
            gy = cotangents.pop((s, m))
            gx, grads[s] = stage.backward(inputs.pop((s, m)), sides.pop((s, m)), gy, grads[s])
            out = (gx, grads[s])
        if measure:
            jax.block_until_ready(out)
            times[m, s, 0 if op.kind == "F" else 1] = clock() - t0
            valid[m] &= stage.compiles == compiles
        if op.kind == "F" and not stage.is_last:
            inputs[s + 1, m] = jax.device_put(y, stages[s + 1].x_sharding)
        else:
            _send_back(stages, s, m, gx, cotangents)
    return StepOutput(loss=losses, grads=grads, stage_times=times, timing_valid=valid)


def _fields(mb: PackedMicrobatch | Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """The microbatch's arrays by field name, without copying them (`dataclasses.asdict` would)."""
    if isinstance(mb, PackedMicrobatch):
        return {f.name: getattr(mb, f.name) for f in dataclasses.fields(mb)}
    return mb


def _send_back(stages, s: int, m: int, gx, cotangents) -> None:
    """Moves dL/dx of stage s to stage s-1's output sharding (nothing to send from stage 0)."""
    if s > 0:
        cotangents[s - 1, m] = jax.device_put(gx, stages[s - 1].y_sharding)
