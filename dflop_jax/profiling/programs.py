"""The programs the model profiler compiles and times: one part of a stage (STAGE_KINDS) at one shape.

Built from the real stage modules of `models/mllm.py` (`EncoderStage`, `LLMStage`) on a ("data", "model")
= (1, tp) mesh with the runtime's logical->mesh rules (`runtime/sharding.py`). The runtime's
`StageProgram` (runtime/stages.py) is not reused directly because its jits are private and it has no
encoder adapter yet; these programs follow its design exactly: params cast to the compute dtype inside
the program; forward = the stage function; backward = re-run the forward under `jax.vjp` from the saved
input and add dL/dparams into a donated fp32 accumulator; the head part fuses forward + loss + backward
(`jax.value_and_grad`) like the runtime's last stage.

Shapes per dp shard (bucket b): encoder kinds take T = b tiles (pixels [T,H,W,3] for the embedding,
hidden [T,N,Dv] otherwise); LLM kinds take one packed row of S = b tokens ([1,S] ids, [1,S,D] hidden).
The LLM embedding part places image features of F = max(1, S // (2 tokens_per_tile)) tiles (half the
row as image tokens, a typical mix).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dflop_jax.runtime.sharding import rules_for, state_shardings


@dataclasses.dataclass(frozen=True)
class PartProgram:
    """A compiled-and-runnable profiling program pair for one (kind, tp, bucket, layers).

    Attributes:
      mesh: the (1, tp) mesh the programs run on.
      fwd, bwd: jitted functions; fwd(params, x, side); bwd(params, x, side, gy, gacc) (gy unused by
        the head part, whose bwd is forward + loss + backward).
      params_abs, x_abs, side_abs, gy_abs: abstract (ShapeDtypeStruct with sharding) arguments.
      make_params(rng): real (random) sharded params; make_inputs(rng) -> (x, side, gy) real arrays.
    """

    mesh: Mesh
    fwd: Callable
    bwd: Callable
    params_abs: Any
    x_abs: Any
    side_abs: dict
    gy_abs: Any
    make_params: Callable[[np.random.Generator], Any]
    make_inputs: Callable[[np.random.Generator], tuple]


def profile_mesh(devices, tp: int) -> Mesh:
    """A (1, tp) Auto-axis ("data", "model") mesh on the first tp devices."""
    grid = np.array(list(devices)[:tp], dtype=object).reshape(1, tp)
    return Mesh(grid, ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def _cast(tree, dtype):
    return jax.tree.map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
    )


@dataclasses.dataclass(frozen=True)
class StageShape:
    """What one program computes: a module's layer count with or without its embedding / head.

    A table part is a StageShape with one component (`part_shape`); the cost-model benchmark builds
    whole stages (several components in one program) to check the sum-of-parts prediction.
    """

    module: str  # "encoder" | "llm"
    layers: int
    has_embedding: bool = False
    has_head: bool = False


def part_shape(kind: str, layers: int) -> StageShape:
    module, part = kind.split("_", 1)
    return StageShape(
        module, layers if part == "layers" else 0, part == "embedding", part == "head"
    )


def _shapes(model_cfg, st: StageShape, bucket: int) -> tuple[Any, dict]:
    """(x, side) as (shape, dtype) specs of a program at a bucket."""
    v, t = model_cfg.vision, model_cfg.text
    if st.module == "encoder":
        if st.has_embedding:
            return ((bucket, v.image_size, v.image_size, v.num_channels), jnp.float32), {}
        return ((bucket, v.seq_len, v.hidden_size), jnp.float32), {}
    row = (1, bucket)
    side = {}
    if st.has_embedding:
        tiles = max(1, bucket // (2 * model_cfg.tokens_per_tile))
        x = ((tiles, model_cfg.tokens_per_tile, t.hidden_size), jnp.float32)
        side.update(tokens=(row, jnp.int32), feature_index=(row, jnp.int32))
    else:
        x = ((1, bucket, t.hidden_size), jnp.float32)
    if st.layers:
        side.update(segment_ids=(row, jnp.int32), positions=(row, jnp.int32))
    if st.has_head:
        side.update(targets=(row, jnp.int32), loss_mask=(row, jnp.int32))
    return x, side


def _module(model_cfg, st: StageShape):
    """(factory of the stage module, rules kind, apply(module, x, side) -> y or (loss_sum, count))."""
    from models.mllm import EncoderStage, LLMStage

    enc = st.module == "encoder"
    flags = dict(first_layer=0, num_layers=st.layers, has_embedding=st.has_embedding,
                 has_head=st.has_head)  # fmt: skip
    cls = EncoderStage if enc else LLMStage

    def factory():
        return cls(model_cfg, **flags, rngs=nnx.Rngs(0))

    def apply(m, x, side):
        if enc:
            return m(x)
        h = m.embed(side["tokens"], x, side["feature_index"]) if st.has_embedding else x
        if st.layers:
            h = m(h, side["segment_ids"], side["positions"])
        return m.loss(h, side["targets"], side["loss_mask"]) if st.has_head else h

    return factory, "vision" if enc else "decoder", apply


def _real_inputs(
    model_cfg, st: StageShape, bucket: int, rng: np.random.Generator
) -> tuple[Any, dict]:
    (xs, xd), side_specs = _shapes(model_cfg, st, bucket)
    x = rng.standard_normal(xs).astype(np.float32)
    side = {}
    for name, (shape, _) in side_specs.items():
        if name == "tokens" or name == "targets":
            side[name] = rng.integers(0, model_cfg.text.vocab_size, shape, dtype=np.int32)
        elif name == "feature_index":  # first half text, second half the image features in order
            index = np.full(shape, -1, np.int32)
            n = min(shape[1] // 2, xs[0] * xs[1])
            index[:, shape[1] - n :] = np.arange(n, dtype=np.int32)
            side[name] = index
        elif name == "positions":
            side[name] = np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape).copy()
        else:  # segment_ids, loss_mask
            side[name] = np.ones(shape, np.int32)
    return x, side


def build_part(
    model_cfg, kind: str, tp: int, bucket: int, layers: int, devices, compute_dtype
) -> PartProgram:
    """The profiling programs of one table part (see the module docstring). Nothing is compiled."""
    return build_program(model_cfg, part_shape(kind, layers), tp, bucket, devices, compute_dtype)


def build_program(
    model_cfg, st: StageShape, tp: int, bucket: int, devices, compute_dtype
) -> PartProgram:
    """The forward / backward programs of `st` on a (1, tp) mesh at `bucket`. Nothing is compiled."""
    mesh = profile_mesh(devices, tp)
    factory, rules_kind, apply = _module(model_cfg, st)
    overrides = {"kv_heads": None} if model_cfg.text.num_kv_heads % tp else None
    rules = rules_for(rules_kind, overrides if rules_kind == "decoder" else None)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        graphdef, abs_state = nnx.split(nnx.eval_shape(factory))
    shardings = state_shardings(abs_state, mesh, rules)
    params_abs = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abs_state, shardings
    )
    data = NamedSharding(mesh, P("data"))
    scalar = NamedSharding(mesh, P())
    (xs, xd), side_specs = _shapes(model_cfg, st, bucket)
    x_abs = jax.ShapeDtypeStruct(xs, xd, sharding=data)
    side_abs = {k: jax.ShapeDtypeStruct(s, d, sharding=data) for k, (s, d) in side_specs.items()}
    head = st.module == "llm" and st.has_head  # the loss; an encoder head is the projector
    diff_x = not (st.module == "encoder" and st.has_embedding)  # pixels need no gradient

    def run(params, x, side):
        with nnx.logical_axis_rules(rules):
            m = nnx.merge(graphdef, _cast(params, compute_dtype))
            return apply(m, x.astype(compute_dtype), side)

    def fwd(params, x, side):
        return run(params, x, side)

    def bwd(params, x, side, gy, gacc):
        if head:

            def objective(p, x_):
                loss_sum, count = run(p, x_, side)
                return loss_sum.astype(jnp.float32), count

            (loss, _), (gp, gx) = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(
                params, x
            )
            return loss, gx, jax.tree.map(jnp.add, gacc, gp)
        if diff_x:
            _, vjp = jax.vjp(lambda p, x_: run(p, x_, side), params, x)
            gp, gx = vjp(gy)
        else:
            _, vjp = jax.vjp(lambda p: run(p, x, side), params)
            (gp,) = vjp(gy)
            gx = None
        return gx, jax.tree.map(jnp.add, gacc, gp)

    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        y_abs = jax.eval_shape(fwd, params_abs, x_abs, side_abs)
    gy_abs = None if head else jax.ShapeDtypeStruct(y_abs.shape, y_abs.dtype, sharding=data)
    out_y = (scalar, scalar) if head else data
    gx_sharding = data if diff_x else None
    bwd_out = (scalar, data, shardings) if head else (gx_sharding, shardings)
    fwd_jit = jax.jit(fwd, in_shardings=(shardings, data, data), out_shardings=out_y)
    bwd_jit = jax.jit(
        bwd,
        in_shardings=(shardings, data, data, None if head else data, shardings),
        out_shardings=bwd_out,
        donate_argnums=(4,),
    )

    def make_params(rng: np.random.Generator):
        # random values are enough for timing; host init + device_put avoids compiling an init program
        def leaf(a):
            value = (0.02 * rng.standard_normal(a.shape)).astype(a.dtype)
            return jax.device_put(value, a.sharding)

        return jax.tree.map(leaf, params_abs)

    def make_inputs(rng):
        x, side = _real_inputs(model_cfg, st, bucket, rng)
        gy = None
        if not head:
            gy = jax.device_put(rng.standard_normal(y_abs.shape).astype(y_abs.dtype), data)
        return jax.device_put(x, data), {k: jax.device_put(v, data) for k, v in side.items()}, gy

    return PartProgram(
        mesh, fwd_jit, bwd_jit, params_abs, x_abs, side_abs, gy_abs, make_params, make_inputs
    )


def per_device_bytes(tree) -> float:
    """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (the largest shard)."""
    total = 0.0
    for a in jax.tree.leaves(tree):
        shape = a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape
        total += float(np.prod(shape, dtype=np.float64)) * jnp.dtype(a.dtype).itemsize
    return total
