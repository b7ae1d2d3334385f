"""Stage programs of the real models: `models/` nnx modules split by a `Layout` onto stage meshes.

Params are built ONCE for the whole model on the host's default device (seeded, or loaded from an HF
directory) and then cut per stage (`models.decoder.extract_stage`) and placed with the stage's
logical->mesh rules (`runtime/sharding.py`). So every layout of a run starts from the same weights (the
parity tests rely on it); a model too big for one device would instead be created per stage with
`create_sharded` (not needed by the tiny/demo models).

LLM stage functions (side inputs are PackedMicrobatch fields, sharded over "data"):
  first stage:  tokens, feature_index, segment_ids, positions (+ encoder features as x) -> hidden
  inner stage:  hidden [l_dp, S, D], segment_ids, positions -> hidden
  last stage:   ... + targets, loss_mask -> (loss_sum, count)  (models.loss.cross_entropy_sum)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dflop_jax.costs.layout import Layout, StageSpec
from dflop_jax.runtime.sharding import rules_for, state_shardings
from dflop_jax.runtime.stages import StageFns, StageProgram

# (embeds [B,S,D], features [n, D], feature_index [B,S], params) -> embeds with features placed.
FeaturePlacer = Callable[..., jax.Array]


def llm_stage_fns(graphdef, spec: StageSpec, rules, *, has_x: bool) -> StageFns:
    """Pure functions of one decoder stage (an nnx graphdef + params state)."""
    from models.loss import cross_entropy_sum

    side = ("segment_ids", "positions")
    if spec.has_embedding:
        side = ("tokens", "feature_index") + side
        if has_x:
            raise NotImplementedError("encoder -> LLM feature placement needs models/placement.py")

    def hidden(params, x, s):
        with nnx.logical_axis_rules(rules):
            stage = nnx.merge(graphdef, params)
            h = stage.embed(s["tokens"]) if spec.has_embedding else x
            return stage, stage(h, s["segment_ids"], s["positions"])

    if spec.has_head:

        def loss(params, x, s):
            stage, h = hidden(params, x, s)
            with nnx.logical_axis_rules(rules):
                logits = stage.logits(h)
            return cross_entropy_sum(logits, s["targets"], s["loss_mask"])

        return StageFns(
            loss=loss,
            side_keys=side + ("targets", "loss_mask"),
            x_spec=None if not has_x and spec.has_embedding else P("data"),
        )
    return StageFns(
        forward=lambda p, x, s: hidden(p, x, s)[1],
        side_keys=side,
        x_spec=None if spec.has_embedding else P("data"),
    )


def _indivisible(cfg, tp: int) -> dict:
    """Replicates the logical axes whose sizes tp does not divide (e.g. an odd HF vocabulary)."""
    sizes = {
        "vocab": cfg.vocab_size,
        "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "mlp": cfg.intermediate_size,
    }
    return {name: None for name, n in sizes.items() if n % tp}


def build_llm_stages(
    decoder,
    layout: Layout,
    meshes: Sequence[Mesh],
    *,
    compute_dtype=jnp.bfloat16,
    rule_overrides: dict | None = None,
) -> list[StageProgram]:
    """Decoder-only pipelines: one StageProgram per LLM stage of `layout` (no encoder stages).

    Args:
      decoder: a `models.decoder.Decoder` holding the full model's fp32 params (host / device 0).
      layout: the layout (its encoder stages must be empty here).
      meshes: one mesh per stage (`runtime.mesh.stage_meshes`).
      compute_dtype: dtype the stage programs compute in (params cast inside the program).
      rule_overrides: logical-axis overrides for `rules_for("decoder", ...)`.
    """
    from models.decoder import extract_stage

    if layout.encoder_stages:
        raise NotImplementedError("encoder stages need the vision model adapter (models-vision)")
    programs = []
    for i, (spec, mesh) in enumerate(zip(layout.stages, meshes)):
        rules = rules_for(
            "decoder", {**_indivisible(decoder.cfg, spec.tp), **(rule_overrides or {})}
        )
        stage = extract_stage(
            decoder,
            first_layer=spec.first_layer,
            num_layers=spec.num_layers,
            has_embedding=spec.has_embedding,
            has_head=spec.has_head,
        )
        graphdef, state = nnx.split(stage)
        shardings = state_shardings(state, mesh, rules)
        # Via host memory: the stage must own its buffers (updates donate them; the model keeps its own).
        params = jax.device_put(jax.device_get(state), shardings)
        fns = llm_stage_fns(graphdef, spec, rules, has_x=not spec.has_embedding and i > 0)
        programs.append(StageProgram(mesh, fns, params, compute_dtype))
    return programs
