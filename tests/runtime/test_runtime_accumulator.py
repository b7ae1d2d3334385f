"""The packed gradient accumulator (`programs/accumulator.py`): which leaves share the flat buffer,
that a backward adds into it in place and locally (no temporary as large as the buffer, as a
concatenate of the sums would need; no collective), and that a stage's backward returns its few
buffers, holding per replica the gradient jax gives."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from models_fixtures import tiny_decoder_config

from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.programs.accumulator import Accumulator
from dflop_jax.programs.meshes import stage_meshes
from dflop_jax.programs.stage_builder import build_stages
from dflop_jax.programs.stage_fns import StageFns
from dflop_jax.programs.stage_program import StageProgram
from dflop_jax.programs.transfer import put_host

SHAPES = {"w_col": (16, 32), "b": (32,), "w_row": (32, 16), "scale": (16,), "w2": (16, 32)}
SPECS = {"w_col": P(None, "model"), "b": P(), "w_row": P("model", None), "scale": P(),
         "w2": P(None, "model")}  # fmt: skip


COLLECTIVES = re.compile(r"all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter")


def _mesh(dp: int, tp: int) -> Mesh:
    return Mesh(np.array(jax.devices()[: dp * tp]).reshape(dp, tp), ("data", "model"))


def _structs(mesh: Mesh) -> dict:
    return {k: jax.ShapeDtypeStruct(SHAPES[k], jnp.float32, sharding=NamedSharding(mesh, SPECS[k]))
            for k in SHAPES}  # fmt: skip


def test_leaves_pack_into_a_whole_and_a_split_buffer():
    """At tp 2 the leaves split over "model" share one (dp, tp, n) buffer split over "model", the
    rest one flat (dp, n) buffer, each in leaf order; at tp 1 every leaf is in the flat one. Each
    device's block of the split buffer is its own shards (nothing moves to pack or unpack), and
    unpack inverts pack."""
    mesh = _mesh(2, 2)
    acc = Accumulator.of(_structs(mesh))
    keys = sorted(SHAPES)  # the tree's leaf order
    split = sum(np.prod(SHAPES[k]) for k in ("w_col", "w_row", "w2")) // 2
    assert [s.shape for s in acc.structs] == [(2, 32 + 16), (2, 2, split)]
    assert [s.sharding.spec for s in acc.structs] == [P("data", None), P("data", "model", None)]
    assert [k for k, slot in zip(keys, acc.slots) if slot.kind == "whole"] == ["b", "scale"]
    one = Accumulator.of(_structs(_mesh(2, 1)))
    assert [s.shape for s in one.structs] == [(2, sum(np.prod(s) for s in SHAPES.values()))]
    rng = np.random.default_rng(0)
    tree = {k: rng.normal(size=(2, *SHAPES[k])).astype(np.float32) for k in SHAPES}
    for a in (acc, one):
        back = a.unpack(a.pack(tree))
        for k in SHAPES:
            np.testing.assert_array_equal(np.asarray(back[k]), tree[k])
    # device (replica 1, model 1) holds, for w_row (split on its rows), rows 16..31 of replica 1's
    bufs = [put_host(b, s.sharding) for b, s in zip(acc.pack(tree), acc.structs)]
    slot = acc.slots[keys.index("w_row")]
    block = next(sh.data for sh in bufs[1].addressable_shards if sh.device == mesh.devices[1, 1])
    piece = np.asarray(block)[0, 0, slot.offset : slot.offset + slot.size]
    np.testing.assert_array_equal(piece, tree["w_row"][1, 16:].ravel())


def test_backward_adds_into_the_donated_buffers_in_place():
    """A donated accumulator plus a gradient tree, as the backward programs add it: the compiled
    program aliases every buffer and holds no temporary (a concatenate of the sums would hold one
    as large as the flat buffer); the sums are the leaf-wise ones."""
    for tp in (1, 2):
        mesh = _mesh(2, tp)
        structs = _structs(mesh)
        acc = Accumulator.of(structs)

        def add(params, bufs, acc=acc):
            return acc.add(bufs, jax.tree.map(lambda p: jnp.sin(p) * 2.0, params))

        program = jax.jit(add, out_shardings=acc.shardings, donate_argnums=(1,))
        with jax.set_mesh(mesh):
            compiled = program.lower(structs, list(acc.structs)).compile()
        memory = compiled.memory_analysis()
        assert memory.temp_size_in_bytes == 0, (tp, memory)
        assert not COLLECTIVES.findall(compiled.as_text())
        per_device = sum(4 * np.prod(s.sharding.shard_shape(s.shape)) for s in acc.structs)
        assert memory.alias_size_in_bytes == per_device
        rng = np.random.default_rng(1)
        params = {k: put_host(rng.normal(size=SHAPES[k]).astype(np.float32), s.sharding)
                  for k, s in structs.items()}  # fmt: skip
        start = {k: rng.normal(size=(2, *SHAPES[k])).astype(np.float32) for k in SHAPES}
        bufs = [put_host(np.asarray(b), s.sharding) for b, s in zip(acc.pack(start), acc.structs)]
        with jax.set_mesh(mesh):
            got = acc.unpack(compiled(params, bufs))
        for k in SHAPES:
            want = start[k] + 2.0 * np.sin(np.asarray(params[k]))[None]
            np.testing.assert_allclose(np.asarray(got[k]), want, rtol=1e-6, atol=1e-6)


def test_stage_backward_returns_its_buffers_and_each_replicas_gradient():
    """A tp-1 decoder stage's backward returns dL/dx and ONE accumulator buffer (not a leaf per
    parameter); unpacked, replica r's slice is the gradient of replica r's rows (jax.grad)."""
    layout = Layout((), (StageSpec("llm", 0, 1, tp=1, dp=2, has_embedding=True),
                         StageSpec("llm", 1, 2, tp=1, dp=2, has_head=True)))  # fmt: skip
    cfg = tiny_decoder_config(num_layers=3, dtype="float32")
    stages = build_stages(cfg, layout, stage_meshes(layout), 0, compute_dtype=jnp.float32)
    inner = stages[0]
    assert len(inner.accumulator.structs) == 1 < len(jax.tree.leaves(inner.params))
    outs = jax.eval_shape(inner.jits.zeros.jit, inner.leaves)
    assert len(outs) == 1


def test_replicated_params_fold_into_the_flat_buffer_of_a_tp2_stage():
    """A tp-2 stage with a column-split weight and a replicated bias: dL/dw in the split buffer,
    dL/db in the flat one; both per replica equal jax's gradient of that replica's rows."""
    mesh = _mesh(2, 2)
    fns = StageFns(
        forward=lambda p, x, s: jnp.tanh(x @ p["w"] + p["b"]), side_keys=(), x_spec=P("data"),
    )  # fmt: skip
    rng = np.random.default_rng(2)
    w, b = rng.normal(size=(8, 8)).astype(np.float32), rng.normal(size=(8,)).astype(np.float32)
    x, gy = rng.normal(size=(4, 8)).astype(np.float32), rng.normal(size=(4, 8)).astype(np.float32)
    params = {"w": put_host(w, NamedSharding(mesh, P(None, "model"))),
              "b": put_host(b, NamedSharding(mesh, P()))}  # fmt: skip
    stage = StageProgram(mesh, fns, params, compute_dtype=jnp.float32)
    assert [s.shape for s in stage.accumulator.structs] == [(2, 8), (2, 2, 32)]
    _, acc = stage.backward(
        put_host(x, NamedSharding(mesh, P("data"))),
        stage.put_side({}),
        put_host(gy, NamedSharding(mesh, P("data"))),
        stage.zero_grads(),
    )
    for r in range(2):
        rows = slice(2 * r, 2 * r + 2)
        _, vjp = jax.vjp(lambda w_, b_, rows=rows: jnp.tanh(x[rows] @ w_ + b_), w, b)
        gw, gb = vjp(gy[rows])
        np.testing.assert_allclose(np.asarray(acc["w"])[r], gw, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(acc["b"])[r], gb, rtol=1e-5, atol=1e-6)
