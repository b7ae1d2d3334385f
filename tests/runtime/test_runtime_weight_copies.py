"""Weights cast once per step: the stage programs take the parameters' bf16 copies, which the
optimizer's update makes from the new fp32 masters (`programs/stage_program.py`).

A pipelined bf16 run over several steps (tied embedding, a saving residual policy on one stage)
equals, bit for bit, the same run whose programs are given the fp32 masters and cast them inside:
the same losses, accumulated gradients and masters. After every update each copy is its master
rounded to bf16. What the programs trace to shows it: given the copies, the forward and backward
(and the last stage's fused program) convert no weight from f32 to bf16; given the masters, they
do. At fp32 compute the copies are the masters themselves (no memory added).
"""

from __future__ import annotations

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
