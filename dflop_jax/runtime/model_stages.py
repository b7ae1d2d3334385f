"""Stage programs of the real models: `models/` nnx modules split by a `Layout` onto stage meshes.

Two model kinds: a decoder-only LLM (`models.decoder.Decoder`, `build_llm_stages`) and a ViT +
projector + decoder MLLM (`models.mllm.MLLM`, e.g. LLaVA-OneVision, `build_mllm_stages`).

Params are built ONCE for the whole model on the host's default device (seeded, or loaded from an HF
directory) and then cut per stage (`models.decoder.extract_stage`) and placed with the stage's
logical->mesh rules (`runtime/sharding.py`). So every layout of a run starts from the same weights (the
parity tests rely on it); a model too big for one device would instead be created per stage with
`create_sharded` (not needed by the tiny/demo models).

LLM stage functions (side inputs are PackedMicrobatch fields, sharded over "data"):
  first stage:  tokens, feature_index, segment_ids, positions (+ encoder features as x) -> hidden;
                an MLLM's first LLM stage also takes feature_taps / feature_weight [l_dp, S, K] when the
                microbatch has them (LLaVA-OV's exact bilinear taps) and then places with those
  inner stage:  hidden [l_dp, S, D], segment_ids, positions -> hidden
  last stage:   ... + targets, loss_mask -> (loss_sum, count)  (models.loss.cross_entropy_sum)
Encoder stage functions (MLLM):
  first stage:  tiles [v_dp*T, H, W, 3] -> hidden [v_dp*T, N, Dv]   (sharded over the encoder "data")
  last stage:   ... + tile_pool -> projected features [v_dp*T, tokens_per_tile, D]
The encoder -> LLM hand-off puts the features REPLICATED on LLM stage 0's mesh (x_spec P()): any
packed row may gather any tile's features (`models.placement.place_features` with the loader's
feature_index); `jax.device_put` moves them shard by shard, never through one device.
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
from dflop_jax.runtime.stages import StageFns, StageProgram, put_host

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
        raise ValueError(
            "a decoder-only model has no encoder: give a layout without encoder stages"
        )
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
        params = jax.tree.map(put_host, jax.device_get(state), shardings)
        fns = llm_stage_fns(graphdef, spec, rules, has_x=not spec.has_embedding and i > 0)
        programs.append(StageProgram(mesh, fns, params, compute_dtype))
    return programs


def _place(module, mesh: Mesh, rules):
    """(graphdef, params on `mesh`) of an nnx module; buffers copied via host (the stage owns them)."""
    graphdef, state = nnx.split(module)
    shardings = state_shardings(state, mesh, rules)
    return graphdef, jax.tree.map(put_host, jax.device_get(state), shardings)


def encoder_stage_fns(graphdef, spec: StageSpec, rules, *, first_in_pipeline: bool) -> StageFns:
    """Pure functions of one vision encoder stage (`models.mllm.EncoderStage`)."""
    side = (("tiles",) if spec.has_embedding else ()) + (("tile_pool",) if spec.has_head else ())

    def forward(params, x, s):
        with nnx.logical_axis_rules(rules):
            stage = nnx.merge(graphdef, params)
            inp = s["tiles"] if spec.has_embedding else x
            return stage(inp, s["tile_pool"]) if spec.has_head else stage(inp)

    return StageFns(
        forward=forward, side_keys=side, x_spec=None if first_in_pipeline else P("data")
    )


def mllm_llm_stage_fns(graphdef, spec: StageSpec, rules, *, has_features: bool) -> StageFns:
    """Pure functions of one LLM stage of an MLLM (`models.mllm.LLMStage`)."""
    side = ("segment_ids", "positions")
    if spec.has_embedding:
        side = ("tokens", "feature_index") + side

    # Exact LLaVA-OV placement: [B,S,K] taps + weights when the microbatch has them (data/types.py).
    optional = TAP_KEYS if spec.has_embedding and has_features else ()

    def hidden(params, x, s):
        with nnx.logical_axis_rules(rules):
            stage = nnx.merge(graphdef, params)
            if spec.has_embedding:
                placement = _placement(s) if has_features else (None, None)
                x = stage.embed(s["tokens"], x, *placement)
            return stage, stage(x, s["segment_ids"], s["positions"])

    x_spec = (P() if has_features else None) if spec.has_embedding else P("data")
    if spec.has_head:

        def loss(params, x, s):
            stage, h = hidden(params, x, s)
            with nnx.logical_axis_rules(rules):
                return stage.loss(h, s["targets"], s["loss_mask"])

        return StageFns(
            loss=loss,
            side_keys=side + ("targets", "loss_mask"),
            optional_keys=optional,
            x_spec=x_spec,
        )
    return StageFns(
        forward=lambda p, x, s: hidden(p, x, s)[1],
        side_keys=side,
        optional_keys=optional,
        x_spec=x_spec,
    )


TAP_KEYS = ("feature_taps", "feature_weight")


def _placement(side) -> tuple:
    """(index, weight) for `place_features`: the exact taps when present, else the plain gather."""
    if "feature_taps" in side:
        return side["feature_taps"], side["feature_weight"]
    return side["feature_index"], None


def build_mllm_stages(
    model,
    layout: Layout,
    meshes: Sequence[Mesh],
    *,
    compute_dtype=jnp.bfloat16,
) -> list[StageProgram]:
    """One StageProgram per stage of `layout` (encoder stages, then LLM stages) of an MLLM.

    Args:
      model: a `models.mllm.MLLM` (e.g. `LlavaOnevision`) holding the full model's fp32 params.
      layout: needs >= 1 encoder stage (the encoder runs on its own stages, never colocated).
      meshes: one mesh per stage.
      compute_dtype: dtype the stage programs compute in.
    """
    from models.mllm import extract_stages

    if not layout.encoder_stages:
        raise ValueError(
            "an MLLM layout needs at least one encoder stage; add encoder stages to the plan"
        )
    cfg = model.cfg
    encoders, llms = extract_stages(
        model,
        [s.num_layers for s in layout.encoder_stages],
        [s.num_layers for s in layout.llm_stages],
    )
    programs = []
    n_enc = len(encoders)
    for i, (spec, mesh, module) in enumerate(zip(layout.stages, meshes, encoders + llms)):
        if spec.module == "encoder":
            rules = rules_for("vision", _indivisible_vision(cfg.vision, spec.tp))
            graphdef, params = _place(module, mesh, rules)
            fns = encoder_stage_fns(graphdef, spec, rules, first_in_pipeline=i == 0)
        else:
            rules = rules_for("decoder", _indivisible(cfg.text, spec.tp))
            graphdef, params = _place(module, mesh, rules)
            fns = mllm_llm_stage_fns(graphdef, spec, rules, has_features=i == n_enc)
        programs.append(StageProgram(mesh, fns, params, compute_dtype))
    return programs


def _indivisible_vision(cfg, tp: int) -> dict:
    sizes = {"heads": cfg.num_heads, "kv_heads": cfg.num_heads, "mlp": cfg.intermediate_size}
    return {name: None for name, n in sizes.items() if n % tp}
