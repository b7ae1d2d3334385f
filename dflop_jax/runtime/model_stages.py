"""Stages of the real models: `models/` nnx stage modules -> rules, pure functions, jitted programs.

The one builder of real-model stage programs, used by the trainer and by the model profiler:
  stage_rules(model_cfg, spec)        logical->mesh rules (`runtime/sharding.py` table of the stage's
                                      kind, axes that tp does not divide replicated)
  stage_fns(graphdef, spec, rules, multimodal=...)   the stage's pure functions (`StageFns`)
  stage_blueprint(module, model_cfg, spec, mesh)     graphdef, state, shardings and functions of a module
  abstract_stage(model_cfg, spec, mesh)              the same for a fresh module, without arrays
  build_llm_stages / build_mllm_stages               a whole pipeline from a model's params
The programs themselves come from `runtime/stages.py` (`stage_jits`). The profiler compiles
`abstract_stage(...)` through `stage_jits`; the trainer places a cut of the model's params and wraps the
same blueprint in a `StageProgram`.

Two model kinds: a decoder-only LLM (`models.decoder.Decoder`, stage module `DecoderStage`) and a
ViT + projector + decoder MLLM (`models.mllm.MLLM`, e.g. LLaVA-OneVision or InternVL; stage modules
`EncoderStage`, `LLMStage`). Params are built ONCE for the whole model on the host's default device
(seeded, or loaded from an HF directory) and then cut per stage and placed with the stage's rules, so
every layout of a run starts from the same weights (the parity tests rely on it).

Stage functions (side inputs are `PackedMicrobatch` fields, sharded over "data"):
  encoder, first:   tiles [v_dp*T, H, W, 3] -> hidden [v_dp*T, N, Dv]
  encoder, other:   hidden -> hidden; the last one (+ tile_pool) -> features [v_dp*T, tokens_per_tile, D]
  LLM, first:       tokens, segment_ids, positions -> hidden [l_dp, S, D]; in an MLLM also the encoder
                    features as x (REPLICATED on its mesh, x_spec P(): any packed row may gather any
                    tile's features) placed by feature_index, or by feature_taps / feature_weight
                    [l_dp, S, K] when the microbatch has them (LLaVA-OV's exact bilinear taps)
  LLM, other:       hidden -> hidden; the last one (+ targets, loss_mask) -> (loss_sum, count)
                    (`DecoderStage.loss`: chunked cross-entropy, no full-vocabulary logits)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dflop_jax.costs.layout import Layout, StageSpec
from dflop_jax.runtime.sharding import Rules, rules_for, state_shardings
from dflop_jax.runtime.stages import StageFns, StageProgram, put_host

TAP_KEYS = ("feature_taps", "feature_weight")


def is_multimodal(model_cfg) -> bool:
    """True for an MLLM config (vision + text), False for a decoder-only `DecoderConfig`."""
    from models.decoder_config import DecoderConfig

    return not isinstance(model_cfg, DecoderConfig)


def stage_rules(model_cfg, spec: StageSpec) -> Rules:
    """The rules of a stage: its kind's table, replicating the axes whose sizes tp does not divide
    (e.g. an odd HF vocabulary, or fewer KV heads than tp)."""
    if spec.module == "encoder":
        v, kind = model_cfg.vision, "vision"
        sizes = dict(heads=v.num_heads, kv_heads=v.num_heads, mlp=v.intermediate_size)
    else:
        t, kind = model_cfg.text if is_multimodal(model_cfg) else model_cfg, "decoder"
        sizes = dict(vocab=t.vocab_size, heads=t.num_heads, kv_heads=t.num_kv_heads,
                     mlp=t.intermediate_size)  # fmt: skip
    return rules_for(kind, {name: None for name, n in sizes.items() if n % spec.tp})


def stage_fns(graphdef, spec: StageSpec, rules: Rules, *, multimodal: bool) -> StageFns:
    """Pure functions of one stage module (`EncoderStage`, `LLMStage` or `DecoderStage`).

    Args:
      graphdef: the stage module's nnx graphdef (its params are the functions' `params`).
      spec: the stage (module, layers, embedding / head).
      rules: its logical->mesh rules (`stage_rules`).
      multimodal: an MLLM (the first LLM stage takes the encoder's features as x).
    """
    if spec.module == "encoder":
        return _encoder_fns(graphdef, spec, rules)
    return _llm_fns(graphdef, spec, rules, features=multimodal and spec.has_embedding)


def _encoder_fns(graphdef, spec: StageSpec, rules: Rules) -> StageFns:
    side = (("tiles",) if spec.has_embedding else ()) + (("tile_pool",) if spec.has_head else ())

    def forward(params, x, s):
        with nnx.logical_axis_rules(rules):
            stage = nnx.merge(graphdef, params)
            inp = s["tiles"] if spec.has_embedding else x
            return stage(inp, s["tile_pool"]) if spec.has_head else stage(inp)

    return StageFns(
        forward=forward, side_keys=side, x_spec=None if spec.has_embedding else P("data")
    )


def _llm_fns(graphdef, spec: StageSpec, rules: Rules, *, features: bool) -> StageFns:
    side = ("segment_ids", "positions")
    if spec.has_embedding:
        side = ("tokens",) + (("feature_index",) if features else ()) + side

    def hidden(params, x, s):
        with nnx.logical_axis_rules(rules):
            stage = nnx.merge(graphdef, params)
            if features:
                x = stage.embed(s["tokens"], x, *_placement(s))
            elif spec.has_embedding:
                x = stage.embed(s["tokens"])
            return stage, stage(x, s["segment_ids"], s["positions"])

    x_spec = (P() if features else None) if spec.has_embedding else P("data")
    optional = TAP_KEYS if features else ()
    if not spec.has_head:
        return StageFns(
            forward=lambda p, x, s: hidden(p, x, s)[1],
            side_keys=side,
            optional_keys=optional,
            x_spec=x_spec,
        )

    def loss(params, x, s):
        stage, h = hidden(params, x, s)
        with nnx.logical_axis_rules(rules):
            return stage.loss(h, s["targets"], s["loss_mask"])

    return StageFns(
        loss=loss, side_keys=side + ("targets", "loss_mask"), optional_keys=optional, x_spec=x_spec
    )


def _placement(side) -> tuple:
    """(index, weight) for `place_features`: the exact taps when present, else the plain gather."""
    if "feature_taps" in side:
        return side["feature_taps"], side["feature_weight"]
    return side["feature_index"], None


@dataclasses.dataclass(frozen=True)
class StageBlueprint:
    """Everything of a stage but its placed params.

    Attributes:
      graphdef: the stage module's nnx graphdef.
      state: its params (real arrays, or ShapeDtypeStructs from `abstract_stage`).
      shardings: NamedShardings of `state` on the stage mesh.
      fns: the stage's pure functions.
    """

    graphdef: Any
    state: nnx.State
    shardings: nnx.State
    fns: StageFns


def stage_blueprint(module: nnx.Module, model_cfg, spec: StageSpec, mesh: Mesh) -> StageBlueprint:
    """The blueprint of a stage module of `model_cfg` on `mesh`."""
    rules = stage_rules(model_cfg, spec)
    graphdef, state = nnx.split(module)
    fns = stage_fns(graphdef, spec, rules, multimodal=is_multimodal(model_cfg))
    return StageBlueprint(graphdef, state, state_shardings(state, mesh, rules), fns)


def stage_module(model_cfg, spec: StageSpec, rngs: nnx.Rngs) -> nnx.Module:
    """A fresh stage module of `spec` (the module class the model's `extract_*` functions cut)."""
    flags = dict(first_layer=spec.first_layer, num_layers=spec.num_layers,
                 has_embedding=spec.has_embedding, has_head=spec.has_head)  # fmt: skip
    if not is_multimodal(model_cfg):
        from models.decoder import DecoderStage

        if spec.module == "encoder":
            raise ValueError("a decoder-only model has no encoder stage; use module='llm'")
        return DecoderStage(model_cfg, **flags, rngs=rngs)
    from models.mllm import EncoderStage, LLMStage

    cls = EncoderStage if spec.module == "encoder" else LLMStage
    return cls(model_cfg, **flags, rngs=rngs)


def abstract_stage(model_cfg, spec: StageSpec, mesh: Mesh) -> StageBlueprint:
    """The blueprint of a fresh stage module without allocating it: `state` holds ShapeDtypeStructs
    carrying their shardings (what the profiler compiles from)."""
    with jax.set_mesh(mesh), nnx.logical_axis_rules(stage_rules(model_cfg, spec)):
        module = nnx.eval_shape(lambda: stage_module(model_cfg, spec, nnx.Rngs(0)))
    bp = stage_blueprint(module, model_cfg, spec, mesh)
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), bp.state, bp.shardings
    )
    return dataclasses.replace(bp, state=state)


def _programs(modules, model_cfg, layout: Layout, meshes, compute_dtype) -> list[StageProgram]:
    """One StageProgram per (module, stage, mesh); params copied via host so each stage owns its
    buffers (updates donate them; the model keeps its own)."""
    programs = []
    for module, spec, mesh in zip(modules, layout.stages, meshes):
        bp = stage_blueprint(module, model_cfg, spec, mesh)
        params = jax.tree.map(put_host, jax.device_get(bp.state), bp.shardings)
        programs.append(StageProgram(mesh, bp.fns, params, compute_dtype))
    return programs


def build_llm_stages(
    decoder, layout: Layout, meshes: Sequence[Mesh], *, compute_dtype=jnp.bfloat16
) -> list[StageProgram]:
    """Decoder-only pipelines: one StageProgram per LLM stage of `layout` (no encoder stages).

    Args:
      decoder: a `models.decoder.Decoder` holding the full model's fp32 params (host / device 0).
      layout: the layout (its encoder stages must be empty here).
      meshes: one mesh per stage (`runtime.mesh.stage_meshes`).
      compute_dtype: dtype the stage programs compute in (params cast inside the program).
    """
    from models.decoder import extract_stage

    if layout.encoder_stages:
        raise ValueError(
            "a decoder-only model has no encoder: give a layout without encoder stages"
        )
    modules = [
        extract_stage(decoder, first_layer=s.first_layer, num_layers=s.num_layers,
                      has_embedding=s.has_embedding, has_head=s.has_head)
        for s in layout.stages
    ]  # fmt: skip
    return _programs(modules, decoder.cfg, layout, meshes, compute_dtype)


def build_mllm_stages(
    model, layout: Layout, meshes: Sequence[Mesh], *, compute_dtype=jnp.bfloat16
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
    encoders, llms = extract_stages(
        model,
        [s.num_layers for s in layout.encoder_stages],
        [s.num_layers for s in layout.llm_stages],
    )
    return _programs(encoders + llms, model.cfg, layout, meshes, compute_dtype)
