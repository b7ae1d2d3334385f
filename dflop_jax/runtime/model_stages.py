"""Stages of the real models: `models/` nnx stage modules -> rules, pure functions, jitted programs.

The one builder of real-model stage programs, used by the trainer and by the model profiler:
  stage_rules(model_cfg, spec)        logical->mesh rules (`runtime/sharding.py` table of the stage's
                                      kind, axes that tp does not divide replicated)
  stage_fns(graphdef, spec, rules, multimodal=...)   the stage's pure functions (`StageFns`)
  stage_blueprint(module, model_cfg, spec, mesh)     graphdef, state, shardings and functions of a module
  abstract_stage(model_cfg, spec, mesh)              the same for a fresh module, without arrays
  init_stage(model_cfg, spec, mesh, source)          the same with params made in their sharding
  build_stages(model_cfg, layout, meshes, source)    a whole pipeline
The programs themselves come from `runtime/stages.py` (`stage_jits`). The profiler compiles
`abstract_stage(...)` through `stage_jits`; the trainer wraps `init_stage(...)` in a `StageProgram`.

Two model kinds: a decoder-only LLM (`models.decoder.Decoder`, stage module `DecoderStage`) and a
ViT + projector + decoder MLLM (`models.mllm.MLLM`, e.g. LLaVA-OneVision or InternVL; stage modules
`EncoderStage`, `LLMStage`). Each stage's params are made on its own mesh, never whole on one device or
host: a seeded random init keyed by global layer index (so every layout of a run starts from the same
weights, equal to the unsplit model built with the same seed: the parity tests rely on it), or the
stage's own tensors of an HF checkpoint, read slice by slice. A stage with no device on this process
holds abstract params (ShapeDtypeStructs with shardings).

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
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dflop_jax.costs.layout import Layout, StageSpec
from dflop_jax.runtime.sharding import Rules, create_sharded, rules_for, state_shardings
from dflop_jax.runtime.stages import StageFns, StageProgram

TAP_KEYS = ("feature_taps", "feature_weight")
# Where a run's params come from: an int seed (keyed random init) or an HF model directory.
ParamSource = int | str | os.PathLike


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
    """A fresh stage module of `spec` (`models.stages.stage_module`: random init keyed by global layer)."""
    from models.stages import stage_module as build

    flags = dict(first_layer=spec.first_layer, num_layers=spec.num_layers,
                 has_embedding=spec.has_embedding, has_head=spec.has_head)  # fmt: skip
    return build(model_cfg, spec.module, **flags, rngs=rngs)


def abstract_stage(model_cfg, spec: StageSpec, mesh: Mesh) -> StageBlueprint:
    """The blueprint of a fresh stage module without allocating it: `state` holds ShapeDtypeStructs
    carrying their shardings (what the profiler compiles from, and a non-local stage's params)."""
    with jax.set_mesh(mesh), nnx.logical_axis_rules(stage_rules(model_cfg, spec)):
        module = nnx.eval_shape(lambda: stage_module(model_cfg, spec, nnx.Rngs(0)))
    bp = stage_blueprint(module, model_cfg, spec, mesh)
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), bp.state, bp.shardings
    )
    return dataclasses.replace(bp, state=state)


def is_local(mesh: Mesh) -> bool:
    """Whether this process owns a device of `mesh` (else the stage is NON-LOCAL here)."""
    me = jax.process_index()
    return any(d.process_index == me for d in mesh.devices.flat)


def init_stage(model_cfg, spec: StageSpec, mesh: Mesh, source: ParamSource) -> StageBlueprint:
    """The blueprint of a stage with its params created directly in their stage sharding.

    Args:
      source: an int seed (random init keyed by global layer index, equal to the same range of the
        whole model built with `nnx.Rngs(seed)`) or an HF model directory (only this stage's tensors,
        each device's slice read on its own: `models.hf.load_stage`).

    A stage whose mesh has no device of this process gets abstract params (ShapeDtypeStructs with
    their shardings): nothing of it is compiled, read or allocated here.
    """
    if not is_local(mesh):
        return abstract_stage(model_cfg, spec, mesh)
    rules = stage_rules(model_cfg, spec)
    if isinstance(source, int):
        module = create_sharded(
            lambda: stage_module(model_cfg, spec, nnx.Rngs(source)), mesh, rules
        )
    else:
        from models.hf import load_stage

        flags = dict(first_layer=spec.first_layer, num_layers=spec.num_layers,
                     has_embedding=spec.has_embedding, has_head=spec.has_head)  # fmt: skip
        module = load_stage(source, model_cfg, spec.module, **flags, mesh=mesh, rules=rules)
    return stage_blueprint(module, model_cfg, spec, mesh)


def build_stages(
    model_cfg,
    layout: Layout,
    meshes: Sequence[Mesh],
    source: ParamSource,
    *,
    compute_dtype=jnp.bfloat16,
) -> list[StageProgram]:
    """One StageProgram per stage of `layout` (encoder stages, then LLM stages), each stage's params
    made on its own mesh (`init_stage`): the whole model never exists on one device or host.

    Args:
      model_cfg: a `DecoderConfig` (decoder-only: no encoder stages) or an MLLM config (LLaVA-OV,
        InternVL: >= 1 encoder stage, the encoder runs on its own stages).
      meshes: one mesh per stage (`runtime.mesh.stage_meshes`).
      source: an int seed or an HF model directory (see `init_stage`).
      compute_dtype: dtype the stage programs compute in (params cast inside the program).
    """
    if is_multimodal(model_cfg) and not layout.encoder_stages:
        raise ValueError(
            "an MLLM layout needs at least one encoder stage; add encoder stages to the plan"
        )
    if not is_multimodal(model_cfg) and layout.encoder_stages:
        raise ValueError(
            "a decoder-only model has no encoder: give a layout without encoder stages"
        )
    programs = []
    for spec, mesh in zip(layout.stages, meshes):
        bp = init_stage(model_cfg, spec, mesh, source)
        programs.append(StageProgram(mesh, bp.fns, bp.state, compute_dtype))
    return programs
