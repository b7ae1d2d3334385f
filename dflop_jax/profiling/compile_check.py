"""Will the plan fit? Compile every stage program of a plan at its real sizes, from abstract arrays.

    python -m dflop_jax.plan --config configs/plan_llava_ov_7b_h100x64.yaml --check
    checks = check_plan(plan, model_cfg)      # one StageCheck per stage (nothing is materialized)

MaxText's ahead-of-time compile habit, per MPMD stage: each stage's training program (the backward, or
on the last stage the fused forward + loss + backward) is built by the runtime's one builder
(`profiling.programs.stage_program` -> `programs.stage_builder.abstract_stage` -> `programs.stage_jits.
stage_jits`) on the stage's own ("data", "model") mesh of the layout (`programs.meshes.stage_meshes`; on a
host without enough accelerators, simulated CPU devices), at the plan's largest buckets, and compiled.

What the runtime holds per device for a stage, term by term (`StageCheck`):
  params      fp32 master weights and their compute-dtype copies (the programs take the copies, and
              the masters of the leaves without one: `programs/stage_program.py`)
  grads       the fp32 per-data-replica gradient accumulator (a donated argument, aliased with its
              output; each device holds its replica's sum, `programs.accumulator.accumulator_structs`)
  optimizer   AdamW m and v, fp32, the parameters' shapes in the ZeRO-1 layout (sharded over dp too,
              padded where no axis divides: `programs.zero1_layout.zero1_layout`)
  inputs      the stage inputs (x + side arrays) of the microbatches in flight: 1F1B keeps
              min(P - stage, M) of them until their backward (recompute-in-backward: nothing else)
  residuals   0 under "recompute"; under a saving policy ("all", "layers") the residuals each
              in-flight microbatch keeps from its forward to its backward (`programs.stage_program.Held`)
  transient   the rest of the program's peak: temporaries (`temp_size_in_bytes`: the residuals of the
              recomputed forward, XLA workspace), the incoming gradient dy and the
              outgoing dx.
`program_bytes` is `memory_analysis()`'s arguments + outputs - aliased + temporaries of the compiled
program; `total = params + grads + optimizer + in_flight x inputs + transient`, where the
transient is `program_bytes` less the parameters as the programs take them, the accumulator and
one microbatch's inputs.

Under each stage's residual policy (`residuals=`, `contracts.cost_table.RESIDUAL_POLICIES`; default
"recompute" everywhere) an inner stage under "all" / "layers" trains with two programs, the forward
that returns its residuals (`forward_residuals`) and the backward from them (`backward_residuals`):
both are compiled, the residuals per microbatch are the forward's outputs but y, and the driver keeps
those INSTEAD of the stage input (it drops x and the side arrays once the forward has run), so
`total = params + grads + optimizer + inputs (one microbatch's, the forward's) + in_flight x
residuals + the larger transient of the two programs`.

Under the plan's training recipe (`planner.trainable`, costs/recipe.py) each stage compiles the
programs it runs under it (`stage_program(..., trainable=)`, as `programs.stage_builder.build_stages`
builds them): grads and optimizer cover the trained leaves only; a forward-only stage (nothing
trained, nothing trained before it) compiles its forward program, has no accumulator and no
optimizer state, and keeps no input for a backward (in_flight 1: the one its forward reads).

An omni model's audio encoder runs inside LLM stage 0's program (compiled with the microbatch's
audio rows at the largest audio bucket) or on audio stages of their own (each on its LLM rows' audio,
LLM stage 0 then taking the two branches' outputs), as `build_stages` builds them.

A colocated encoder (`encoder_colocated` plans) runs inside LLM stage 0's program: that stage is
compiled as the runtime trains it, ONE colocated program (`models.mllm.ColocatedStage`, built by
`abstract_stage(..., colocated=True)`, part "encoder+llm") at the largest tile and length buckets,
tiles in (packed by row) and no feature input: its params, inputs and transient (the encoder's
features live through the LLM layers' backward) are those of the program that trains.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from dflop_jax.contracts import BucketSet
from dflop_jax.contracts.layout import Layout
from dflop_jax.costs.recipe import TRAINABLE_PARTS
from dflop_jax.planner.plan_file import Plan, StageCheck
from dflop_jax.planner.scoring import in_flight
from dflop_jax.profiling.programs import (
    PartProgram,
    compile_residual_programs,
    held_residual_bytes,
    per_device_bytes,
    stage_program,
)
from dflop_jax.programs.trees import prune

log = logging.getLogger(__name__)

DISAGREE = 0.15  # warn when compiled and predicted memory differ by more than this fraction


@dataclasses.dataclass(frozen=True)
class PartCheck:
    """One compiled program of a stage (bytes per device)."""

    part: str  # "encoder" | "llm"
    program_bytes: float
    params: float
    grads: float
    optimizer: float
    inputs: float
    transient: float
    compile_s: float
    residuals: float = 0.0  # per microbatch, kept for the backward by a saving policy's forward
    flops_forward: float = 0.0  # XLA's count of the training programs (`training_flops`)
    flops_backward: float = 0.0


def check_plan(
    plan: Plan,
    model_cfg,
    devices: Sequence[jax.Device] | None = None,
    compute_dtype=jnp.bfloat16,
    residuals: Sequence[str] | None = None,
) -> list[StageCheck]:
    """Compiles every stage program of `plan` for `model_cfg` (its remat policy included).

    Args:
      plan: the plan (layout, buckets, microbatch range, schedule, predicted memory).
      model_cfg: the `models` config of the plan's model (`model_config_for_arch`).
      devices: default: `jax.devices()`, or the CPU devices when there are fewer accelerators than
        the layout needs (simulate them with `host_devices.simulate_cpu_devices` before JAX starts).
      compute_dtype: the stage programs' compute dtype.
      residuals: each stage's residual policy (None: "recompute" everywhere).

    Returns:
      one `StageCheck` per stage in layout order.
    """
    counts = in_flight(plan.layout.num_stages, plan.max_microbatches, plan.schedule)
    trainable = tuple(plan.planner_config.get("trainable", TRAINABLE_PARTS))
    return check_layout(plan.layout, plan.buckets, counts, plan.stage_memory_bytes, model_cfg,
                        devices, compute_dtype, trainable, residuals=residuals)  # fmt: skip


def check_layout(
    layout: Layout,
    buckets: BucketSet,
    in_flight_counts: Sequence[int],
    predicted: Sequence[float],
    model_cfg,
    devices: Sequence[jax.Device] | None = None,
    compute_dtype=jnp.bfloat16,
    trainable: Sequence[str] = TRAINABLE_PARTS,
    progress: Callable[[str, int, int], None] = lambda *_: None,
    residuals: Sequence[str] | None = None,
) -> list[StageCheck]:
    """`check_plan` of a layout at the largest of `buckets`, with each stage's 1F1B in-flight count
    and predicted bytes (a warning names the stages more than `DISAGREE` apart), under the recipe
    `trainable` and each stage's residual policy `residuals` (None: "recompute" everywhere).
    Stages alike but for their layer range (the middle stages of a deep pipeline) compile once:
    their programs differ only in which layers' weights they hold. `progress(phase, done, total)`
    after each compile (minutes each at real sizes)."""
    from dflop_jax.programs.meshes import stage_meshes

    devices = _devices(layout.num_devices) if devices is None else list(devices)
    meshes = stage_meshes(layout, devices)
    policies = ["recompute"] * layout.num_stages if residuals is None else list(residuals)
    if len(policies) != layout.num_stages:
        raise ValueError(f"residuals has {len(policies)} entries for {layout.num_stages} stages")
    kinds = [_stage_kind(layout, i, policies[i]) for i in range(layout.num_stages)]
    tiles, length, audio = buckets.tiles[-1], buckets.lengths[-1], _largest_audio(buckets)
    compiled: dict[tuple, tuple[PartCheck, bool]] = {}
    out = []
    for i, (mesh, policy, kind) in enumerate(zip(meshes, policies, kinds)):
        if kind not in compiled:
            part, prog = stage_program_at(layout, i, model_cfg, mesh, tiles, length,
                                          compute_dtype, trainable, policy, audio)  # fmt: skip
            compiled[kind] = (compile_part(part, prog), prog.bwd is not None)
            progress("memory check: compiling stage programs", len(compiled), len(set(kinds)))
        check, trains = compiled[kind]
        held = in_flight_counts[i] if trains else 1  # forward only: keeps no input
        stage = _stage_check(i, [check], held)
        out.append(dataclasses.replace(stage, policy=policy, predicted=float(predicted[i])))
    warn_disagreements(out, predicted)
    return out


def _stage_kind(layout: Layout, index: int, policy: str) -> tuple:
    """What a stage's compiled programs depend on: its spec but its first layer, its position (the
    first LLM stage takes the features; the first stage of a colocated layout runs the encoder)
    and its residual policy."""
    spec = layout.stages[index]
    return (dataclasses.replace(spec, first_layer=0), index == layout.first_llm, policy)


def stage_programs(
    layout: Layout,
    buckets: BucketSet,
    model_cfg,
    meshes: Sequence[jax.sharding.Mesh],
    compute_dtype=jnp.bfloat16,
    trainable: Sequence[str] = TRAINABLE_PARTS,
    residuals: Sequence[str] | None = None,
) -> list[tuple[str, PartProgram]]:
    """(part, programs) of each stage of `layout` on its mesh, at the largest of `buckets`, as the
    runtime builds them (the colocated stage as one "encoder+llm" program) under each stage's
    residual policy (None: "recompute" everywhere). Nothing is compiled."""
    tiles, length, audio = buckets.tiles[-1], buckets.lengths[-1], _largest_audio(buckets)
    policies = ["recompute"] * layout.num_stages if residuals is None else list(residuals)
    if len(policies) != layout.num_stages:
        raise ValueError(f"residuals has {len(policies)} entries for {layout.num_stages} stages")
    return [
        stage_program_at(
            layout, i, model_cfg, mesh, tiles, length, compute_dtype, trainable, r, audio
        )  # fmt: skip
        for i, (mesh, r) in enumerate(zip(meshes, policies))
    ]


def _largest_audio(buckets: BucketSet) -> int:
    """The largest audio bucket (frames per LLM row), 0 without an audio ladder."""
    return buckets.audio[-1] if buckets.audio else 0


def stage_program_at(
    layout: Layout,
    stage: int,
    model_cfg,
    mesh: jax.sharding.Mesh,
    tiles: int,
    length: int,
    compute_dtype=jnp.bfloat16,
    trainable: Sequence[str] = TRAINABLE_PARTS,
    residuals: str = "recompute",
    audio: int = 0,
) -> tuple[str, PartProgram]:
    """(part, programs) of stage `stage` of `layout` for microbatches at tile bucket `tiles`,
    `length` tokens per LLM row and `audio` frames per LLM row (an omni model): an encoder stage
    runs at its tiles per shard (`Layout.encoder_tiles`), an audio stage on its LLM rows' audio,
    an LLM stage at the length (the first one taking each row's block of features, `encoder_dp` x
    that / `llm_dp` tiles per row, and running the audio encoder or taking its stages' features;
    with pooled tiles the whole pool, the same tiles over its rows), the colocated stage at both."""
    spec = layout.stages[stage]
    where = dict(trainable=trainable, residuals=residuals, audio_bucket=audio,
                 audio_apart=bool(layout.audio_stages), audio_rows=layout.llm_dp)  # fmt: skip
    if stage == colocated_stage_index(layout, model_cfg):
        prog = stage_program(model_cfg, spec, mesh, length, compute_dtype, tile_bucket=tiles,
                             **where)  # fmt: skip
        return "encoder+llm", prog
    per_shard = layout.encoder_tiles(tiles)
    bucket = {"encoder": per_shard, "audio": audio}.get(spec.module, length)
    first_llm = spec.module == "llm" and spec.has_embedding and layout.encoder_stages
    features = -(-layout.encoder_dp * per_shard // layout.llm_dp) if first_llm else None
    pooled = bool(first_llm) and layout.pooled_tiles
    prog = stage_program(model_cfg, spec, mesh, bucket, compute_dtype, features, **where,
                         pooled=pooled)  # fmt: skip
    return spec.module, prog


def lower_stage_programs(
    layout: Layout,
    buckets: BucketSet,
    model_cfg,
    meshes: Sequence[jax.sharding.Mesh],
    platform: str,
    compute_dtype=jnp.bfloat16,
    trainable: Sequence[str] = TRAINABLE_PARTS,
) -> list[dict[str, jax.stages.Lowered]]:
    """Lowers (does not compile) every stage program of `layout` for `platform` ("cuda", "rocm",
    "cpu"), whatever backend this host has: per stage {"forward": ..., "backward" or "last": ...}
    (a forward-only stage: its forward alone). Pallas kernels lower as they would run on that
    platform (Triton on "cuda", interpreted on "cpu"): a CPU host checks the GPU programs trace and
    lower, the Triton kernels included."""
    from models.pallas_attention import forced_mode

    platforms = (platform,)
    out = []
    with forced_mode(interpret=platform == "cpu"):
        for _, prog in stage_programs(layout, buckets, model_cfg, meshes, compute_dtype, trainable):
            with jax.set_mesh(prog.mesh):
                args = (prog.params_abs, prog.x_abs, prog.side_abs)
                lowered = {"forward": prog.fwd.trace(*args).lower(lowering_platforms=platforms)}
                if prog.bwd is not None:
                    name = "last" if prog.seed_abs.shape == () else "backward"
                    traced = prog.bwd.trace(*args, prog.seed_abs, prog.gacc_abs)
                    lowered[name] = traced.lower(lowering_platforms=platforms)
            out.append(lowered)
    return out


def colocated_stage_index(layout: Layout, model_cfg) -> int | None:
    """The index of the stage that also runs the encoder (the first LLM stage when an MLLM layout
    has no encoder stages: the runtime's `stage_builder.colocated`), else None."""
    from dflop_jax.programs.stage_builder import check_colocated, colocated

    if not colocated(model_cfg, layout):
        return None
    # the runtime refuses what it cannot colocate: so does the check
    check_colocated(model_cfg, layout)
    return layout.first_llm


def _devices(needed: int) -> list[jax.Device]:
    devices = jax.devices()
    if len(devices) < needed:
        devices = jax.devices("cpu")
    if len(devices) < needed:
        raise ValueError(
            f"the layout needs {needed} devices and only {len(devices)} exist; simulate CPU devices "
            "before JAX starts (dflop_jax.host_devices.simulate_cpu_devices)"
        )
    return devices


def compile_part(part: str, prog: PartProgram) -> PartCheck:
    """Compiles the training program of `prog` (backward, or the fused last step; the forward of a
    stage that runs forward only; under a saving residual policy the forward with residuals and the
    backward from them) and splits its `memory_analysis()` into the terms above."""
    if prog.jits is not None and prog.jits.forward_residuals is not None:
        return _compile_saving(part, prog)
    t0 = time.perf_counter()
    args = (prog.params_abs, prog.x_abs, prog.side_abs)
    with jax.set_mesh(prog.mesh):
        forward = prog.fwd.lower(*args).compile()
        if prog.bwd is not None:
            compiled = prog.bwd.lower(*args, prog.seed_abs, prog.gacc_abs).compile()
    seconds = time.perf_counter() - t0
    compiled = forward if prog.bwd is None else compiled
    total = program_bytes(compiled)  # the backward holds the memory
    params, grads, optimizer, inputs = _state_and_inputs(prog)
    transient = total - per_device_bytes(prog.params_abs) - grads - inputs
    # the forward's count from its compiled program (an uncompiled lowering counts what XLA drops)
    fwd = program_flops(forward)
    bwd = 0.0 if prog.bwd is None else program_flops(compiled)
    if prog.jits is not None and prog.bwd is prog.jits.last:  # fused: its forward share apart
        bwd -= fwd
    return PartCheck(part, total, params, grads, optimizer, inputs, transient, seconds,
                     flops_forward=fwd, flops_backward=bwd)  # fmt: skip


def _compile_saving(part: str, prog: PartProgram) -> PartCheck:
    """`compile_part` of an inner stage under a saving residual policy: its forward that returns the
    residuals and its backward from them, as `programs.stage_program.StageProgram.forward_train` and
    `backward_from` run them. `program_bytes` is the larger program's."""
    t0 = time.perf_counter()
    fwd, bwd = compile_residual_programs(prog)
    seconds = time.perf_counter() - t0
    params, grads, optimizer, inputs = _state_and_inputs(prog)
    residuals = held_residual_bytes(prog, fwd)
    taken = per_device_bytes(prog.params_abs)  # the weights as the programs take them
    forward = program_bytes(fwd) - taken - inputs - residuals  # y and temporaries
    backward = program_bytes(bwd) - taken - grads - residuals  # dy, dx and temporaries
    return PartCheck(part, max(program_bytes(fwd), program_bytes(bwd)), params, grads, optimizer,
                     inputs, max(forward, backward), seconds, residuals, program_flops(fwd),
                     program_flops(bwd))  # fmt: skip


def program_flops(program) -> float:
    """XLA's FLOP count of a lowered or compiled program (0 where the backend reports none)."""
    cost = program.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


def _state_and_inputs(prog: PartProgram) -> tuple[float, float, float, float]:
    """(params, grads, optimizer, inputs of one microbatch) of `prog`, bytes per device; params:
    the fp32 masters and the compute-dtype copies the programs take (`PartProgram.copy_bytes`)."""
    params = per_device_bytes(prog.masters) + prog.copy_bytes
    grads = per_device_bytes(prog.gacc_abs)  # the trained leaves' accumulator
    optimizer = 2 * per_device_bytes(_zero1(prune(prog.masters, prog.trained)))  # m and v
    return params, grads, optimizer, per_device_bytes((prog.x_abs, prog.side_abs))


def _zero1(params_abs):
    """fp32 leaves of the params in the ZeRO-1 optimizer layout (`programs.zero1_layout.zero1_layout`:
    padded, where no axis divides by tp x dp, to the shape the runtime's moments have)."""
    from dflop_jax.programs.zero1_layout import zero1_layout

    def leaf(a):
        lay = zero1_layout(a.shape, a.sharding)
        return jax.ShapeDtypeStruct(lay.padded, jnp.float32, sharding=lay.sharding)

    return jax.tree.map(leaf, params_abs)


def program_bytes(compiled) -> float:
    """Arguments + outputs - aliased (donated) + temporaries of a compiled program, per device."""
    m = compiled.memory_analysis()
    return float(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )


def _stage_check(index: int, parts: list[PartCheck], in_flight: int) -> StageCheck:
    params = sum(p.params for p in parts)
    # a saving policy's in-flight microbatches hold their residuals, not their inputs (`Held`): only
    # the one whose forward runs reads an input
    saving = any(p.residuals for p in parts)
    return StageCheck(
        stage=index,
        parts=tuple(p.part for p in parts),
        program_bytes=tuple(p.program_bytes for p in parts),
        params=params,
        grads=sum(p.grads for p in parts),
        optimizer=sum(p.optimizer for p in parts),
        inputs=(1 if saving else in_flight) * sum(p.inputs for p in parts),
        transient=max(p.transient for p in parts),
        in_flight=in_flight,
        compile_s=sum(p.compile_s for p in parts),
        residuals=in_flight * sum(p.residuals for p in parts),
        flops_forward=sum(p.flops_forward for p in parts),
        flops_backward=sum(p.flops_backward for p in parts),
    )


def warn_disagreements(checks: Sequence[StageCheck], predicted: Sequence[float]) -> list[int]:
    """Logs a warning for each stage whose compiled memory is more than `DISAGREE` from its
    prediction; returns their indices."""
    off = []
    for c, p in zip(checks, predicted):
        ratio = c.total / p if p > 0 else float("inf")
        if abs(ratio - 1) > DISAGREE:
            off.append(c.stage)
            log.warning(
                "stage %d: compiled %.2f GiB vs predicted %.2f GiB (%+.0f%%, more than %.0f%% apart)",
                c.stage, c.total / 2**30, p / 2**30, 100 * (ratio - 1), 100 * DISAGREE,
            )  # fmt: skip
    return off
