"""The per-step update that follows the pipeline: ZeRO-1 reduction, global-norm barrier, AdamW, gather.

What the runtime runs once per step on every stage (`runtime/train_state.py`, DESIGN section 5), with
N the stage's trained parameters per device (tp-sharded, `StageMemory.grads` / 4 B: frozen leaves have
no accumulator and cost nothing here), dp its data replicas and L the device's collective latency:

  reduce  = ring reduce-scatter of the fp32 accumulator into the ZeRO-1 shards:
            (dp - 1) / dp x 4N bytes at the dp group's bandwidth + (dp - 1) L,
            then the squared norm of the 1/dp shard (4N / dp bytes read at memory bandwidth);
  barrier = the global norm: every stage's partial moves to the last stage and the sum moves back
            (2 L); no stage applies its update before every stage's reduce has ended;
  apply   = AdamW on the shard (reads param, gradient, m, v, writes param, m, v: 28N / dp bytes at
            memory bandwidth), then the ring all-gather of the new fp32 params into the stage
            sharding: (dp - 1) / dp x 4N bytes + (dp - 1) L, and their compute-dtype copies for the
            next step's programs (read 4N, write 2N bytes at bf16: `programs/stage_program.py`).

The dp group's bandwidth: intra-host when the stage's devices sit on one host (stages on consecutive
device ids, as `stage_crosses_host` places them), else inter-host (a NIC per device: the ring's slowest
link). A colocated encoder's parameters join LLM stage 0's (the colocated stage reduces and updates both).
Not counted: the padding ZeRO-1 adds to a leaf no axis of which divides by dp (at most dp - 1 elements
per leaf), and the summing of a tied embedding's copies across stages (one [vocab, D] transfer).
"""

from __future__ import annotations

from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.costs.memory import GRAD_BYTES, PARAM_BYTES
from dflop_jax.costs.provider import colocated_encoder_stage

ADAMW_BYTES = 28  # per parameter of the shard: read p, g, m, v (16 B), write p, m, v (12 B), fp32
NORM_HOPS = 2  # partial norms to the last stage, the global norm back


def stage_update_time(
    provider, stage: StageSpec, multi_host: bool, colocated: StageSpec | None = None
) -> tuple[float, float]:
    """(reduce, apply) seconds of one stage's per-step update (module docstring).

    Args:
      provider: a `CostProvider` (its `stage_memory` gives the trained bytes, its `device` the rates).
      stage: the stage.
      multi_host: whether the stage's devices span hosts (its dp ring then runs at inter-host rate).
      colocated: the colocated encoder whose parameters the stage also updates, if any.
    """
    dev = provider.device
    grads = provider.stage_memory(stage, 1).grads
    if colocated is not None:
        grads += provider.stage_memory(colocated, 1).grads
    trained = grads / GRAD_BYTES
    dp = stage.dp
    bandwidth = dev.inter_host_bandwidth if multi_host else dev.intra_host_bandwidth
    ring = 0.0 if dp == 1 else (dp - 1) / dp / bandwidth
    steps = (dp - 1) * dev.collective_latency_s
    if not trained:
        return 0.0, 0.0
    reduce = ring * trained * GRAD_BYTES + steps + trained * GRAD_BYTES / dp / dev.memory_bandwidth
    cb = provider.compute_bytes
    cast = trained * (PARAM_BYTES + cb) / dev.memory_bandwidth if cb < PARAM_BYTES else 0.0
    apply = trained * ADAMW_BYTES / dp / dev.memory_bandwidth + ring * trained * PARAM_BYTES + steps
    apply += cast
    return reduce, apply


def norm_barrier_time(provider) -> float:
    """Seconds the global-norm exchange adds between the last reduce and the first apply."""
    return NORM_HOPS * provider.device.collective_latency_s


def stage_spans_hosts(layout: Layout, index: int, devices_per_host: int) -> bool:
    """Whether stage `index`'s devices span more than one host (stages on consecutive device ids in
    pipeline order, host = device id // devices_per_host)."""
    start = sum(s.num_devices for s in layout.stages[:index])
    end = start + layout.stages[index].num_devices - 1
    return start // devices_per_host != end // devices_per_host


def layout_update_times(provider, layout: Layout, chunks: int = 1) -> list[tuple[float, float]]:
    """Per device group, its (reduce, apply) seconds (`stage_update_time`), summed over its chunks.

    Args:
      layout: the layout, or with chunks > 1 its virtual layout (virtual stage j on group j % P,
        P = num_stages / chunks; the first P entries sit where the groups' devices do).
    """
    coloc = None if layout.encoder_stages else colocated_encoder_stage(provider.arch, layout)
    groups = layout.num_stages // chunks
    spans = [stage_spans_hosts(layout, d, provider.device.devices_per_host) for d in range(groups)]
    out = [(0.0, 0.0)] * groups
    for i, s in enumerate(layout.stages):
        reduce, apply = stage_update_time(provider, s, spans[i % groups], coloc if i == 0 else None)
        out[i % groups] = (out[i % groups][0] + reduce, out[i % groups][1] + apply)
    return out
