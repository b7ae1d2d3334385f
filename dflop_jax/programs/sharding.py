"""Logical-axis -> mesh-axis rules, one table per stage kind, and sharded module creation.

Mesh axes: "data" (data parallel) and "model" (tensor parallel). Models under `models/` name only the
logical axes below; this file is the single place that maps them onto a mesh (STYLE (b)6).

Logical axes (parameters):
  vocab     vocabulary rows of embedding / columns of the LM head      -> "model"
  embed     the model (residual) dimension D                            -> replicated
  heads     query heads (q columns, o rows: Megatron column/row split)  -> "model"
  kv_heads  key/value heads (GQA; must be divisible by tp, else override to None)  -> "model"
  head_dim  per-head dimension                                          -> replicated
  qkv       the 3-way index of a fused qkv kernel [D, 3, H, Dh]         -> replicated (head-aligned)
  mlp       MLP hidden F (up/gate column split, down row split)         -> "model"
  norm      norm scales / biases of size D                              -> replicated
  patch     flattened patch pixels (vision patch embedding input)       -> replicated
  pos       rows of a learned position-embedding table                  -> replicated
  layer_scale  per-channel layer-scale vectors                          -> replicated
Logical axes (activations, used by `models.layers.constrain`):
  batch -> "data"; length, act_embed -> replicated; act_heads, act_kv_heads, act_mlp, act_vocab ->
  "model".
A logical name missing from a table would be taken as a mesh axis name by flax and fail, so every table
covers every name above; `rules_for(kind, overrides)` replaces entries (e.g. {"kv_heads": None} when a
model has fewer kv heads than the tensor-parallel degree).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dflop_jax.programs.executable_store import ExecutableStore, call_once

Rules = tuple[tuple[str, str | None], ...]


def mesh_axes(entry) -> tuple[str, ...]:
    """The mesh axes one entry of a PartitionSpec names: None -> (), "model" -> ("model",),
    ("data", "model") -> both."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


DECODER_RULES: Rules = (
    ("batch", "data"),
    ("length", None),
    ("vocab", "model"),
    ("embed", None),
    ("heads", "model"),
    ("kv_heads", "model"),
    ("head_dim", None),
    ("qkv", None),
    ("mlp", "model"),
    ("norm", None),
    ("patch", None),
    ("pos", None),
    ("layer_scale", None),
    ("act_embed", None),
    ("act_heads", "model"),
    ("act_kv_heads", "model"),
    ("act_mlp", "model"),
    ("act_vocab", "model"),
)

# Vision encoders and projectors use the same names (a ViT has kv_heads == heads).
VISION_RULES: Rules = DECODER_RULES

STAGE_RULES: dict[str, Rules] = {
    "decoder": DECODER_RULES,
    "vision": VISION_RULES,
    "projector": VISION_RULES,
}


def rules_for(stage_kind: str, overrides: Mapping[str, str | None] | None = None) -> Rules:
    """The rules table of a stage kind ("decoder", "vision", "projector"), with entries replaced.

    Args:
      stage_kind: key of `STAGE_RULES`.
      overrides: logical name -> mesh axis (or None to replicate); names must exist in the table.
    """
    if stage_kind not in STAGE_RULES:
        raise ValueError(f"stage_kind={stage_kind!r} is unknown; use one of {sorted(STAGE_RULES)}")
    table = dict(STAGE_RULES[stage_kind])
    for name, mesh_axis in (overrides or {}).items():
        if name not in table:
            raise ValueError(
                f"sharding override {name!r} is not a logical axis; use one of {sorted(table)}"
            )
        if mesh_axis not in (None, "data", "model"):
            raise ValueError(
                f"sharding override {name}={mesh_axis!r}: mesh axis must be 'data', 'model' or None"
            )
        table[name] = mesh_axis
    return tuple(table.items())


def state_shardings(abstract_state: nnx.State, mesh: Mesh, rules: Rules) -> nnx.State:
    """NamedShardings (same tree as the state) from each Variable's logical axes."""
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        return nnx.get_named_sharding(abstract_state, mesh)


def create_sharded(
    module_factory: Callable[[nnx.Rngs], nnx.Module],
    seed: int,
    mesh: Mesh,
    rules: Rules,
    store: ExecutableStore | None = None,
) -> nnx.Module:
    """Builds `module_factory(nnx.Rngs(seed))` with every parameter created directly in its sharding.

    The factory runs once abstractly (`nnx.eval_shape`) to get the state tree and its shardings, then
    inside one `jit` with `out_shardings`, so no parameter is ever whole on one device. The seed is
    the jit's argument, not a constant inside it: with a constant key XLA folds the whole random
    init at compile time in its HLO interpreter (tens of seconds for a test-sized model). The key
    is made from it inside the program: `jax.random.key` called outside compiles two programs of
    its own, which no executable store holds. The parameters come out bit-identical either way
    (checked on the test LLaVA-OV model). With a `store` (`programs/executable_store.py`) the init
    program is loaded from it or written to it.
    """
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        graphdef, abs_state = nnx.split(nnx.eval_shape(lambda: module_factory(nnx.Rngs(seed))))
        shardings = nnx.get_named_sharding(abs_state, mesh)
        init = jax.jit(
            lambda s: nnx.state(module_factory(nnx.Rngs(jax.random.key(s)))),
            out_shardings=shardings,
        )
        state = call_once(init, (np.int32(seed),), list(mesh.devices.flat), store)
        return nnx.merge(graphdef, state)
