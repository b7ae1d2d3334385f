"""Weights cast once per step: the stage programs take the parameters' bf16 copies, which the
optimizer's update makes from the new fp32 masters (`programs/stage_program.py`).

A pipelined bf16 run over several steps (tied embedding, a saving residual policy on one stage)
equals, bit for bit, the same run whose programs are given the fp32 masters and cast them inside:
the same losses, accumulated gradients and masters. After every update each copy is its master
rounded to bf16. What the programs trace to shows it: given the copies, the forward and backward
(and the last stage's fused program) convert no weight from f32 to bf16; given the masters, they
do. At fp32 compute the copies are the masters themselves (no memory added). A frozen token
embedding, which only its gather reads, has no copy, and its compiled programs convert only the
rows they gather.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models_fixtures import tiny_decoder_config
from pipeline_fixtures import DECODER_LAYOUT, decoder_microbatch

from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.programs.param_paths import tied_groups
from dflop_jax.programs.stage_builder import build_stages
from dflop_jax.runtime.driver import run_pipeline
from dflop_jax.runtime.optimizer_config import OptimizerConfig
from dflop_jax.runtime.train_state import StageOptimizer, apply_updates

OPT = OptimizerConfig(lr=1e-2, warmup_steps=1, decay_steps=10, clip_norm=1.0)
CFG = tiny_decoder_config(num_layers=3, dtype="bfloat16", tie_embeddings=True)
RESIDUALS = ["all", "recompute", "recompute"]


def _stages(dtype=jnp.bfloat16):
    return build_stages(CFG, DECODER_LAYOUT, stage_meshes(DECODER_LAYOUT), 0, compute_dtype=dtype,
                        residuals=RESIDUALS)  # fmt: skip


def _cast_inside(stages) -> None:
    """The reference design: every program given the fp32 masters (it casts them inside). A test
    hook: the trainer never does this."""
    for s in stages:
        s._compute = list(s.leaves)


def _host(leaves) -> list[np.ndarray]:
    return [np.asarray(jax.device_get(a)) for a in leaves]


def _run(stages, batches, reference: bool) -> list[dict]:
    opts = [StageOptimizer(s, OPT.build()) for s in stages]
    tied = tied_groups(list(DECODER_LAYOUT.stages), [s.params for s in stages])
    steps = []
    for mbs in batches:
        if reference:
            _cast_inside(stages)
        norm = sum(float(m["loss_mask"].sum()) for m in mbs)
        out = run_pipeline(stages, mbs, norm, "1f1b")
        grads = [_host(g) for g in out.grads]
        apply_updates(opts, out.grads, OPT.clip_norm, out.loss, tied=tied)
        steps.append({
            "loss": [float(x) for x in out.loss],
            "grads": grads,
            "masters": [_host(s.leaves) for s in stages],
            "copies": [_host(s.compute_leaves) for s in stages],
        })  # fmt: skip
    return steps


def test_programs_on_the_copies_equal_programs_casting_the_masters_bit_for_bit():
    rng = np.random.default_rng(0)
    batches = [[decoder_microbatch(rng, CFG.vocab_size, 2, 16) for _ in range(3)] for _ in range(3)]
    got, ref = _run(_stages(), batches, False), _run(_stages(), batches, True)
    for step, (g, r) in enumerate(zip(got, ref)):
        assert g["loss"] == r["loss"], step
        for a, b in zip(g["grads"], r["grads"]):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
        for a, b in zip(g["masters"], r["masters"]):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
        # every copy is its (updated) master rounded to bf16
        for masters, copies in zip(g["masters"], g["copies"]):
            for m, c in zip(masters, copies):
                assert c.dtype == jnp.bfloat16
                np.testing.assert_array_equal(c, m.astype(jnp.bfloat16))
    first, last = got[0]["masters"][1], got[-1]["masters"][1]
    assert not any(map(np.array_equal, first, last))  # the updates moved every weight


def _weight_casts(jaxpr, shapes: set[tuple[int, ...]]) -> int:
    """f32 -> bf16 converts of a weight-shaped value in `jaxpr` and the jaxprs inside it (a shard_map
    body, a layer scan). A weight gradient is no such convert: the transpose of a cast is the
    upcast, and a dot on bf16 copies gives its gradient in bf16 directly."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type":
            (a,) = eqn.invars
            aval = getattr(a, "aval", None)
            count += (
                aval is not None
                and aval.dtype == jnp.float32
                and eqn.params["new_dtype"] == jnp.bfloat16
                and tuple(aval.shape) in shapes
            )
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    count += _weight_casts(inner, shapes)
    return count


@pytest.mark.parametrize("index", [1, 2])
def test_the_stage_programs_cast_no_weight(index):
    """A middle stage (tp 2: its weights' shards) and the last stage (forward, loss and backward in
    one program), traced on the copies as the trainer calls them: no f32 -> bf16 convert of a
    weight; traced on the masters, one per weight matrix at least (so the count can see one)."""
    stage = _stages()[index]
    mb = decoder_microbatch(np.random.default_rng(1), CFG.vocab_size, 2, 16)
    side = stage.side_structs(mb)
    y = jax.ShapeDtypeStruct((2, 16, CFG.hidden_size), jnp.bfloat16)
    x = stage.x_struct(y)
    matrices = [a for a in stage.leaves if a.ndim > 1]
    shapes = {tuple(a.shape) for a in matrices} | {
        tuple(a.sharding.shard_shape(a.shape)) for a in matrices
    }
    gacc = list(stage.accumulator.structs)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)

    def casts(params) -> list[int]:
        with jax.set_mesh(stage.mesh):
            if stage.is_last:
                traced = [stage.jits.last.trace(params, x, side, scalar, gacc)]
            else:
                traced = [stage.jits.forward.trace(params, x, side),
                          stage.jits.backward.trace(params, x, side, stage.y_struct(y), gacc)]  # fmt: skip
        return [_weight_casts(t.jaxpr.jaxpr, shapes) for t in traced]

    assert casts(stage.compute_params) == [0] * (1 if stage.is_last else 2)
    assert all(n >= len(matrices) for n in casts(stage.params))


def test_at_fp32_the_copies_are_the_masters():
    for stage in _stages(jnp.float32):
        assert not any(stage.cast_leaves)
        assert all(c is m for c, m in zip(stage.compute_leaves, stage.leaves))


def _projector_only_stages(trainable=("projector",)):
    """LLaVA-OV over 2 encoder + 2 LLM stages in bf16 under LLaVA's stage-1 recipe (projectors
    only): the first LLM stage (tp 2) holds the frozen token embedding, which only its gather
    reads; the head stage's untied LM head is frozen too, and a dot reads it. The vocabulary is 80
    so that the table's per-device shard, [40, 32], is a shape no other array of the stage has."""
    from pipeline_fixtures import MLLM_TEXT, SEPARATE_LAYOUT, SEPARATE_VISION

    from models.llava_onevision import llava_onevision_config

    text = dataclasses.replace(MLLM_TEXT, vocab_size=TABLE[0])
    cfg = llava_onevision_config(SEPARATE_VISION, text)
    return build_stages(cfg, SEPARATE_LAYOUT, stage_meshes(SEPARATE_LAYOUT), 0,
                        compute_dtype=jnp.bfloat16, trainable=trainable)  # fmt: skip


TABLE = (80, 32)  # the token embedding's shape in `_projector_only_stages`


def _materialized(hlo: str, shape: str) -> bool:
    """Whether the compiled program's HLO text holds a buffer of `shape` (e.g. "bf16[40,32]"): an
    instruction of that shape outside the computations fusions call. Inside a fusion a value is
    computed per element of the fusion's output (the table's convert fused into the gather that
    reads its rows), not stored."""
    fused = set(re.findall(r"calls=(%[\w.\-]+)", hlo))
    computations = re.split(r"\n(?=\S)", hlo)  # each starts at an unindented header line
    return any(
        shape in line.split("=", 1)[-1].split("(", 1)[0]
        for comp in computations
        if comp.split("(", 1)[0].split()[-1] not in fused
        for line in comp.splitlines()[1:]
        if "=" in line
    )


def test_a_frozen_table_only_a_gather_reads_has_no_copy_and_is_never_cast_whole():
    """The frozen token embedding of the first LLM stage: its programs take the fp32 master (no
    resident copy) and XLA converts only the gathered rows: the compiled forward and dx-only
    backward hold no bf16 array of the table's per-device shape, where the same programs given a
    bf16 copy of the table do (so the check can fail). The forward's output is the same bit for
    bit (a row cast after the gather is that row of the cast table). Trained, or read by a dot
    (the frozen LM head), a leaf keeps its copy."""
    from pipeline_fixtures import separate_batch

    stages = _projector_only_stages()
    first, head = stages[2], stages[3]
    (e,) = [i for i, a in enumerate(first.leaves) if a.shape == TABLE]
    assert first.compute_leaves[e] is first.leaves[e]
    others = [c.dtype for i, c in enumerate(first.compute_leaves) if i != e]
    assert others and set(others) == {jnp.dtype(jnp.bfloat16)}
    assert all(head.cast_leaves)  # the untied head (a dot reads it) and the final norm
    trained = _projector_only_stages(("projector", "llm"))[2]
    assert trained.cast_leaves[e] and trained.compute_leaves[e].dtype == jnp.bfloat16

    mb = separate_batch()[0]
    y = None
    for s in stages[:2]:
        y = s.output_struct(s.x_struct(y) if s.has_x else None, s.side_structs(mb))
    x, side = first.x_struct(y), first.side_structs(mb)
    gy = first.y_struct(first.output_struct(x, side))
    copied = list(first.compute_leaves)
    copied[e] = first.leaves[e].astype(jnp.bfloat16)
    shard = f"bf16[{TABLE[0] // 2},{TABLE[1]}]"

    def hlo(leaves) -> list[str]:
        params = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in leaves]
        with jax.set_mesh(first.mesh):
            fwd = first.jits.forward.jit.lower(params, x, side)
            bwd = first.jits.backward.jit.lower(
                params, x, side, gy, list(first.accumulator.structs)
            )
        return [p.compile().as_text() for p in (fwd, bwd)]

    assert not any(_materialized(text, shard) for text in hlo(first.compute_leaves))
    assert all(_materialized(text, shard) for text in hlo(copied))

    rng = np.random.default_rng(0)
    xs = jax.device_put(rng.standard_normal(x.shape).astype(x.dtype), x.sharding)
    sides = first.put_side(mb)
    with jax.set_mesh(first.mesh):
        got = first.jits.forward.jit(first.compute_leaves, xs, sides)
        want = first.jits.forward.jit(copied, xs, sides)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                  np.asarray(want.astype(jnp.float32)))  # fmt: skip
