"""Building blocks shared by the decoders and encoders: parameters with logical axes, RMSNorm,
rotary embeddings (default and llama3 scaling), SwiGLU MLP, token embedding, activation constraints,
random init keyed by name / global layer index (`keyed_rngs`), and cutting a layer range out of a full
model as a stage that shares its arrays.

Every parameter carries logical axis names (`out_sharding` metadata, as `nnx.with_partitioning`
sets); `dflop_jax/programs/sharding.py` maps them to mesh axes. Logical names used here:
  "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm"  (parameters)
  "batch", "length", "act_embed", "act_heads", "act_kv_heads", "act_mlp", "act_vocab"  (activations)
No mesh axis name appears in models/.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd as core_spmd
from jax.sharding import PartitionSpec

Initializer = Callable[[jax.Array, Sequence[int], jnp.dtype], jax.Array]


def _on_mesh() -> bool:
    return not jax.sharding.get_abstract_mesh().empty


def make_param(
    rngs: nnx.Rngs,
    init: Initializer,
    shape: Sequence[int],
    axes: Sequence[str | None],
    dtype: jnp.dtype,
) -> nnx.Param:
    """A parameter with logical axis names.

    Sharded eagerly only when built under a mesh (`with jax.set_mesh(mesh), nnx.logical_axis_rules(..)`),
    so the same module also builds on a single device without any mesh.
    """
    assert len(shape) == len(axes), (shape, axes)
    value = init(rngs.params(), tuple(shape), dtype)
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=_on_mesh())


def keyed_rngs(rngs: nnx.Rngs, *path: str | int) -> nnx.Rngs:
    """Fresh `Rngs` keyed by `path` under the base key of `rngs` (its count is neither read nor advanced).

    Why: a part's random init must not depend on what was built before it, so a pipeline stage
    holding layers [a, b) draws exactly what the whole model draws for them. Callers key layers by
    their GLOBAL index (`keyed_rngs(rngs, "layer", first_layer + j)`) and other parts by name.
    """
    key = rngs.params.key[...]
    for part in path:
        key = jax.random.fold_in(key, part if isinstance(part, int) else zlib.crc32(part.encode()))
    return nnx.Rngs(params=key)


def _rules_table() -> dict:
    table: dict = {}
    for name, mesh_axes in core_spmd.get_logical_axis_rules():  # first match wins, as in flax
        table.setdefault(name, mesh_axes)
    return table


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Activation sharding hint by logical axes; a no-op outside a mesh or without rules."""
    if not _on_mesh() or not core_spmd.get_logical_axis_rules():
        return x
    table, manual = _rules_table(), _manual_axes()
    spec = PartitionSpec(*(_drop(table.get(a), manual) if a is not None else None for a in axes))
    return jax.lax.with_sharding_constraint(x, spec)


def auto_mesh_axes(logical: str) -> tuple[str, ...]:
    """The mesh axes (not Manual here) that the rules map logical axis `logical` to; () outside a
    mesh or without rules."""
    if not _on_mesh() or not core_spmd.get_logical_axis_rules():
        return ()
    kept = _drop(_rules_table().get(logical), _manual_axes())
    return () if kept is None else ((kept,) if isinstance(kept, str) else tuple(kept))


def _manual_axes() -> frozenset[str]:
    """Mesh axes that are Manual here (inside a `shard_map` over them, e.g. the runtime's per-replica
    backward over "data"): a constraint cannot name them, and the dimension is already local."""
    mesh = jax.sharding.get_abstract_mesh()
    return frozenset(
        n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Manual
    )


def _drop(mesh_axes, manual: frozenset[str]):
    """`mesh_axes` (None, a name or a tuple of names) without the `manual` ones."""
    if mesh_axes is None or not manual:
        return mesh_axes
    names = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    kept = tuple(n for n in names if n not in manual)
    return kept[0] if len(kept) == 1 else (kept or None)


def extract_layer_range(
    stage_factory: Callable[[], nnx.Module],
    full_state: dict,
    prefix: tuple,
    layer_key: tuple,
    first_layer: int,
) -> nnx.Module:
    """A stage built abstractly by `stage_factory` and filled with arrays of a full model (no copy).

    Args:
      full_state: flat state {path: variable} of the full model (`nnx.to_flat_state`).
      prefix: path of the stage's subtree in the full model, e.g. ("encoder",) (or () for the root).
      layer_key: path of the stage's layer list, e.g. ("decoder", "layers"); the stage's layer j is
        the full model's layer `first_layer + j`.
    """
    graphdef, abs_state = nnx.split(nnx.eval_shape(stage_factory))
    n = len(layer_key)
    flat = []
    for path, _ in nnx.to_flat_state(abs_state):
        src = path
        if path[:n] == layer_key:
            src = (*layer_key, first_layer + path[n], *path[n + 1 :])
        flat.append((path, full_state[(*prefix, *src)]))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


class RMSNorm(nnx.Module):
    """y = w * x / sqrt(mean(x^2) + eps), statistics in float32 (as HF Qwen2/Llama)."""

    def __init__(self, dim: int, *, eps: float, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.weight = make_param(rngs, nnx.initializers.ones, (dim,), ("norm",), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., D] -> [..., D] in x.dtype."""
        xf = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
        normed = (xf * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        return self.weight[...].astype(x.dtype) * normed


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency scaling (HF `rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None) -> jax.Array:
    """Inverse frequencies [Dh/2] in float32, llama3-scaled if `scaling` is given."""
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [B,S] int -> (cos, sin) each [B,S,Dh/2] float32."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B,S,Dh/2]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF convention: first and second halves of Dh are the pair).

    x: [B,S,H,Dh]; cos, sin: [B,S,Dh/2]. Computed in float32, returned in x.dtype.
    """
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype)


class SwiGLU(nnx.Module):
    """down(silu(x @ gate) * (x @ up)); gate/up column-split and down row-split on "mlp"."""

    def __init__(
        self, dim: int, hidden: int, *, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs
    ):
        init = nnx.initializers.lecun_normal()
        self.dtype = dtype
        self.gate = make_param(rngs, init, (dim, hidden), ("embed", "mlp"), param_dtype)
        self.up = make_param(rngs, init, (dim, hidden), ("embed", "mlp"), param_dtype)
        self.down = make_param(rngs, init, (hidden, dim), ("mlp", "embed"), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [B,S,D] -> [B,S,D]."""
        x = x.astype(self.dtype)
        g = jnp.einsum("bsd,df->bsf", x, self.gate[...].astype(self.dtype))
        u = jnp.einsum("bsd,df->bsf", x, self.up[...].astype(self.dtype))
        h = constrain(jax.nn.silu(g) * u, ("batch", "length", "act_mlp"))
        return jnp.einsum("bsf,fd->bsd", h, self.down[...].astype(self.dtype))


class Embedding(nnx.Module):
    """Token embedding table [V, D] ("vocab", "embed"); `attend` gives tied-head logits."""

    def __init__(
        self, vocab: int, dim: int, *, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs
    ):
        self.dtype = dtype
        init = nnx.initializers.normal(stddev=0.02)
        self.weight = make_param(rngs, init, (vocab, dim), ("vocab", "embed"), param_dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens [B,S] int -> [B,S,D] in the compute dtype."""
        out = jnp.take(self.weight[...], tokens, axis=0).astype(self.dtype)
        return constrain(out, ("batch", "length", "act_embed"))

    def attend(self, h: jax.Array) -> jax.Array:
        """h [B,S,D] -> logits [B,S,V] against the table (tied head)."""
        w = self.weight[...].astype(self.dtype)
        return jnp.einsum("bsd,vd->bsv", h.astype(self.dtype), w)


# Activation recomputation of a layer in backward: "none", "full" (save only its input) or "dots"
# (also save the matmul outputs, recompute the rest).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def run_layers(layers: Sequence[nnx.Module], h: jax.Array, *args, remat: str = "none") -> jax.Array:
    """h -> layers[-1](...layers[0](h, *args)..., *args); under remat as ONE `lax.scan` over the
    layers' weights.

    Remat ("full" / "dots") needs the scan: in an unrolled loop XLA's scheduler hoists every layer's
    recompute ahead of the backward, which erased remat's saving on CPU (a 28-layer Qwen-7B stage
    compiled to 27.7 GiB of temporaries with and without remat; scanned, 11.9 GiB). The weights
    (already cast to the compute dtype by the caller's program) are stacked inside the program, so
    the param tree stays one module per layer, and the body compiles once whatever the depth.
    Without remat the loop stays unrolled: a scan must keep every iteration's residuals as JAX saves
    them, while unrolled XLA fuses and recomputes cheap ones (28 layers: 36.6 GiB scanned, 27.7
    unrolled). Layers whose structure differs (nnx graphdefs) always run unrolled.
    """
    if not layers:
        return h
    splits = [nnx.split(layer) for layer in layers]
    graphdef = splits[0][0]
    scanned = remat != "none" and len(layers) > 1 and all(g == graphdef for g, _ in splits[1:])

    def step_of(graphdef):
        def step(state, h):
            return nnx.merge(graphdef, state)(h, *args)

        if remat == "none":
            return step
        return jax.checkpoint(step, policy=REMAT_POLICIES[remat], prevent_cse=not scanned)

    if not scanned:
        for g, state in splits:
            h = step_of(g)(state, h)
        return h
    step = step_of(graphdef)
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(s for _, s in splits))
    h, _ = jax.lax.scan(lambda carry, state: (step(state, carry), None), h, stacked)
    return h
