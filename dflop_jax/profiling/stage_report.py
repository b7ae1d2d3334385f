"""Per-stage figures of the compiled training programs, for `python -m dflop_jax.train --dry-run`.

    stage_flops(layout, buckets, model_cfg, residuals)   -> per stage flops_forward / flops_backward
    transfer_bytes_per_microbatch(layout, buckets, model_cfg) -> per stage boundary, bytes moved

FLOPs are XLA's cost analysis (`compiled.cost_analysis()["flops"]`) of the programs the trainer runs,
built by the profiler's builder (`programs.stage_program`, hence `runtime.stages.stage_jits`) from
abstract arrays, summed over every bucket of the plan the stage runs (tile buckets on encoder stages,
length buckets on LLM stages, every (tiles, length) pair on a colocated stage). XLA
counts a loop's body once whatever its trip count, in the forward and in the backward alike, so the
two figures compare. What each figure is, per stage kind:
  inner stage, saving policy ("all", "layers"): the forward that returns the residuals, and the
    backward from them;
  inner stage, "recompute": the forward, and the backward that re-runs it under `jax.vjp`;
  last stage: the forward + loss without gradients, and the fused training program minus it (its
    backward share);
  a stage that runs forward only: its forward, and 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from dflop_jax.contracts import BucketSet
from dflop_jax.costs.layout import Layout
from dflop_jax.costs.recipe import TRAINABLE_PARTS
from dflop_jax.profiling.programs import PartProgram
from dflop_jax.runtime.stages import boundary_shape


def program_flops(compiled) -> float:
    """XLA's FLOP count of a compiled program (0 where the backend reports none)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


def training_flops(prog: PartProgram) -> tuple[float, float]:
    """(forward, backward) FLOPs of the programs a stage trains with at `prog`'s shape (module
    docstring)."""
    from dflop_jax.profiling.programs import compile_residual_programs

    jits = prog.jits
    args = (prog.params_abs, prog.x_abs, prog.side_abs)
    if jits.forward_residuals is not None:
        fwd, bwd = compile_residual_programs(prog)
        return program_flops(fwd), program_flops(bwd)
    with jax.set_mesh(prog.mesh):
        fwd = program_flops(jits.forward.lower(*args).compile())
        if prog.bwd is None:
            return fwd, 0.0
        bwd = program_flops(prog.bwd.lower(*args, prog.seed_abs, prog.gacc_abs).compile())
    return fwd, (bwd - fwd if prog.bwd is jits.last else bwd)


def stage_flops(
    layout: Layout,
    buckets: BucketSet,
    model_cfg,
    residuals: Sequence[str],
    devices: Sequence[jax.Device] | None = None,
    compute_dtype=jnp.bfloat16,
    trainable: Sequence[str] = TRAINABLE_PARTS,
    progress: Callable[[str, int, int], None] = lambda *_: None,
) -> list[dict]:
    """Per stage: {"residuals", "flops_forward", "flops_backward"} summed over the plan's buckets
    (module docstring); `progress(phase, done, total)` after each bucket's programs compile."""
    from dflop_jax.profiling.compile_check import _devices, colocated_stage_index, stage_program_at
    from dflop_jax.runtime.mesh import stage_meshes

    devices = _devices(layout.num_devices) if devices is None else list(devices)
    meshes = stage_meshes(layout, devices)
    coloc = colocated_stage_index(layout, model_cfg)
    pairs = [
        _stage_buckets(i == coloc, spec.module, buckets) for i, spec in enumerate(layout.stages)
    ]
    total, done = sum(map(len, pairs)), 0
    out = []
    for i, (mesh, policy, stage_pairs) in enumerate(zip(meshes, residuals, pairs)):
        fwd = bwd = 0.0
        for t, n in stage_pairs:
            _, prog = stage_program_at(layout, i, model_cfg, mesh, t, n, compute_dtype, trainable,
                                       policy)  # fmt: skip
            f, b = training_flops(prog)
            fwd, bwd = fwd + f, bwd + b
            done += 1
            progress("FLOPs: compiling training programs per bucket", done, total)
        out.append({"residuals": policy, "flops_forward": fwd, "flops_backward": bwd})
    return out


def _stage_buckets(colocated: bool, module: str, buckets: BucketSet) -> list[tuple[int, int]]:
    """The (tiles, length) buckets a stage runs: its tile buckets (encoder), its length buckets
    (LLM), or every pair (the colocated stage)."""
    tiles, lengths = buckets.tiles, buckets.lengths
    if colocated:
        return [(t, n) for t in tiles for n in lengths]
    if module == "encoder":
        return [(t, lengths[-1]) for t in tiles]
    return [(tiles[-1], n) for n in lengths]


def transfer_bytes_per_microbatch(
    layout: Layout,
    buckets: BucketSet,
    model_cfg,
    compute_dtype=jnp.bfloat16,
    trainable: Sequence[str] = TRAINABLE_PARTS,
) -> list[dict]:
    """Per stage boundary, the bytes one microbatch at the largest of `buckets` moves between
    devices: `forward_bytes` (the stage's output into the next stage's input sharding) and
    `backward_bytes` (dL/dx back, 0 where the next stage passes none under the recipe). The figures
    are the runtime's transfer programs' (`runtime.transfer.transfer_bytes`, what a training step
    adds to `StepOutput.transfer_bytes`) between the shardings of the stage programs the dry run
    compiles (`compile_check.stage_programs`); nothing is compiled."""
    from dflop_jax.costs.recipe import stage_role
    from dflop_jax.profiling.compile_check import _devices, stage_programs
    from dflop_jax.runtime.mesh import stage_meshes
    from dflop_jax.runtime.model_stages import is_multimodal
    from dflop_jax.runtime.transfer import transfer_bytes

    meshes = stage_meshes(layout, _devices(layout.num_devices))
    progs = [p for _, p in stage_programs(layout, buckets, model_cfg, meshes, compute_dtype,
                                          trainable)]  # fmt: skip
    out = []
    for s, (a, b, spec) in enumerate(zip(progs, progs[1:], layout.stages[1:])):
        y, x = a.seed_abs, b.x_abs  # an inner stage's backward seed is dL/dy: y's struct
        if boundary_shape(y.shape, x.sharding) != x.shape:
            raise ValueError(f"stage {s} outputs {y.shape}, stage {s + 1} takes {x.shape}")
        back = stage_role(spec, trainable, is_multimodal(model_cfg)).input_grad
        out.append({"stage": s, "forward_bytes": transfer_bytes(y, x.sharding, x.shape),
                    "backward_bytes": transfer_bytes(x, y.sharding, y.shape) if back else 0})  # fmt: skip
    return out
