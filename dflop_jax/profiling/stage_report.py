"""Per-stage figures of the compiled training programs, for `python -m dflop_jax.train --dry-run`.

    stage_flops(layout, buckets, arch, checks)   -> per stage flops_forward / flops_backward
    transfer_bytes_per_microbatch(layout, buckets, model_cfg) -> per stage boundary, bytes moved

FLOPs: XLA's cost analysis of the programs the trainer runs, compiled once per stage kind at the
plan's largest buckets by the memory check (`compile_check.check_layout`: `StageCheck.flops_*`),
scaled to every bucket signature the stage runs (`costs.compile.stage_buckets`: its tile buckets,
its length buckets, or the pairs a stage seeing both runs) by the cost model's FLOP counts
(`costs.flops.stage_forward_flops`), and summed: compiling every bucket only to count FLOPs would
take the dry run of a real model hours. XLA counts a loop's body once whatever its trip count, in the
forward and in the backward alike, so the two figures compare. What each figure is, per stage kind:
  inner stage, saving policy ("all", "layers"): the forward that returns the residuals, and the
    backward from them;
  inner stage, "recompute": the forward, and the backward that re-runs it under `jax.vjp`;
  last stage: the forward + loss without gradients, and the fused training program minus it (its
    backward share);
  a stage that runs forward only: its forward, and 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp

from dflop_jax.contracts import BucketSet
from dflop_jax.contracts.layout import Layout
from dflop_jax.costs.compile import signature_length, stage_buckets
from dflop_jax.costs.flops import stage_forward_flops
from dflop_jax.costs.provider import colocated_audio_stage, colocated_encoder_stage
from dflop_jax.costs.recipe import TRAINABLE_PARTS
from dflop_jax.planner.plan_file import StageCheck
from dflop_jax.programs.stage_fns import boundary_shape

SCALED = "compiled at the largest buckets, scaled to the others by the cost model's FLOP counts"


def stage_flops(
    layout: Layout, buckets: BucketSet, arch, checks: Sequence[StageCheck], multimodal: bool = True
) -> list[dict]:
    """Per stage: {"residuals", "flops_forward", "flops_backward"} summed over the bucket signatures
    it runs (module docstring), from each stage's compiled counts at the largest buckets
    (`checks`)."""
    encoder = (
        colocated_encoder_stage(arch, layout) if multimodal and not layout.encoder_stages else None
    )
    audio, first = colocated_audio_stage(arch, layout), layout.first_llm

    def analytic(i: int, sig: tuple) -> float:
        stage = layout.stages[i]
        if stage.module == "audio":  # its rows' frames
            return stage_forward_flops(arch, stage, layout.audio_frames(sig[0]))
        bucket = (
            layout.encoder_tiles(sig[0]) if stage.module == "encoder" else signature_length(sig)
        )
        flops = stage_forward_flops(arch, stage, bucket)
        if encoder is not None and i == first:
            flops += stage_forward_flops(arch, encoder, layout.encoder_tiles(sig[0]))
        if audio is not None and i == first and len(sig) > 2:  # the audio encoder on LLM stage 0
            flops += stage_forward_flops(arch, audio, sig[2])
        return flops

    out = []
    for i, (sigs, check) in enumerate(zip(stage_buckets(layout, buckets, multimodal), checks)):
        largest = analytic(i, sigs[-1])  # ascending: the largest tiles, length or pair is last
        scale = sum(analytic(i, sig) for sig in sigs) / largest if largest else float(len(sigs))
        out.append({"residuals": check.policy, "flops_forward": check.flops_forward * scale,
                    "flops_backward": check.flops_backward * scale})  # fmt: skip
    return out


def transfer_bytes_per_microbatch(
    layout: Layout,
    buckets: BucketSet,
    model_cfg,
    compute_dtype=jnp.bfloat16,
    trainable: Sequence[str] = TRAINABLE_PARTS,
) -> list[dict]:
    """Per stage boundary (each stage to the one its output feeds, `Layout.children`: the last
    vision and audio stages both feed LLM stage 0), the bytes one microbatch at the largest of
    `buckets` moves between devices: `forward_bytes` (the stage's output into the next stage's input sharding) and
    `backward_bytes` (dL/dx back, 0 where the next stage passes none under the recipe). The figures
    are the runtime's transfer programs' (`programs.transfer.transfer_bytes`, what a training step
    adds to `StepOutput.transfer_bytes`) between the shardings of the stage programs the dry run
    compiles (`compile_check.stage_programs`); nothing is compiled."""
    from dflop_jax.costs.recipe import stage_role
    from dflop_jax.profiling.compile_check import _devices, stage_programs
    from dflop_jax.programs.meshes import stage_meshes
    from dflop_jax.programs.stage_builder import has_encoder, has_vision, holds_audio, takes_audio
    from dflop_jax.programs.transfer import transfer_bytes

    meshes = stage_meshes(layout, _devices(layout.num_devices))
    progs = [p for _, p in stage_programs(layout, buckets, model_cfg, meshes, compute_dtype,
                                          trainable)]  # fmt: skip
    apart = bool(layout.audio_stages)
    colocated = has_vision(model_cfg) and not layout.encoder_stages
    out = []
    for s, c in enumerate(layout.children):
        if c < 0:
            continue
        y, x = progs[s].seed_abs, progs[c].x_abs  # an inner stage's backward seed is dL/dy
        if isinstance(x, dict):  # a joining stage: the part this encoder delivers
            x = x[layout.stages[s].module]
        if boundary_shape(y.shape, x.sharding) != x.shape:
            raise ValueError(f"stage {s} outputs {y.shape}, stage {c} takes {x.shape}")
        spec = layout.stages[c]
        back = stage_role(spec, trainable, has_encoder(model_cfg), colocated=colocated and c == layout.first_llm,
                          audio=holds_audio(model_cfg, spec, apart),
                          audio_x=takes_audio(model_cfg, spec, apart)).input_grad  # fmt: skip
        out.append({"stage": s, "forward_bytes": transfer_bytes(y, x.sharding, x.shape),
                    "backward_bytes": transfer_bytes(x, y.sharding, y.shape) if back else 0})  # fmt: skip
    return out
