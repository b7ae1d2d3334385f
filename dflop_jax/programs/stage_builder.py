"""Stages of the real models: `models/` nnx stage modules -> rules, pure functions, jitted programs.

The one builder of real-model stage programs, used by the trainer and by the model profiler:
  stage_rules(model_cfg, spec)        logical->mesh rules (`programs/sharding.py` table of the stage's
                                      kind, axes that tp does not divide replicated)
  stage_fns(graphdef, spec, rules, multimodal=...)   the stage's pure functions (`StageFns`)
  stage_blueprint(module, model_cfg, spec, mesh)     graphdef, state, shardings and functions of a module
  abstract_stage(model_cfg, spec, mesh)              the same for a fresh module, without arrays
  init_stage(model_cfg, spec, mesh, source)          the same with params made in their sharding
  build_stages(model_cfg, layout, meshes, source)    a whole pipeline
The programs themselves come from `programs/stage_jits.py` (`stage_jits`). The profiler compiles
`abstract_stage(...)` through `stage_jits`; the trainer wraps `init_stage(...)` in a `StageProgram`.

Three model kinds: a decoder-only LLM (`models.decoder.Decoder`, stage module `DecoderStage`), a
ViT + projector + decoder MLLM (`models.mllm.MLLM`, e.g. LLaVA-OneVision or InternVL; stage modules
`EncoderStage`, `LLMStage`) and an omni model (`models.omni.Omni`: that MLLM + an audio encoder, whose
first LLM stage is an `OmniFirstStage`). Each stage's params are made on its own mesh, never whole on one device or
host: a seeded random init keyed by global layer index (so every layout of a run starts from the same
weights, equal to the unsplit model built with the same seed: the parity tests rely on it), or the
stage's own tensors of an HF checkpoint, read slice by slice. A stage with no device on this process
holds abstract params (ShapeDtypeStructs with shardings).

Stage functions (side inputs are `PackedMicrobatch` fields, sharded over "data"):
  encoder, first:   tiles [l_dp*R, H, W, 3] -> hidden [l_dp*R, N, Dv] (v_dp*T tiles, T = l_dp*R/v_dp
                    per encoder shard)
  encoder, other:   hidden -> hidden; the last one (+ tile_pool) -> features [l_dp*R, tokens_per_tile, D]
  LLM, first:       tokens, segment_ids, positions -> hidden [l_dp, S, D]; in an MLLM also the encoder
                    features as x, placed by feature_index, or by feature_taps / feature_weight
                    [l_dp, S, K] when the microbatch has them (LLaVA-OV's exact bilinear taps).
                    Tiles are packed BY ROW (`ScheduledMicrobatch.tiles_by_row`): row r's samples' tiles
                    fill slots r*R ... (r+1)*R - 1, R the row's tile bucket padded to a multiple of
                    l_tp and so that v_dp divides l_dp*R (`contracts.row_tile_slots`; the padding
                    ends each block, so no end padding by `stage_fns.boundary_shape` is needed).
                    The features arrive ONCE, their tile axis split over all the stage's devices
                    (x_spec FEATURES_SPEC = P(("data", "model")): row r's block split over row r's
                    tp devices); the program all-gathers each block over "model" only
                    (x_compute_spec ROW_FEATURES_SPEC = P("data")) and each row gathers its
                    features from its own block (`LLMStage.embed(per_row=True)`: feature_index /
                    taps taken modulo the block, the row-local index). dL/dx comes back the same
                    way (per row, to its tp devices' pieces). So the boundary carries one copy and
                    each device holds one row's features whatever l_dp.
                    Tiles POOLED (`Layout.pooled_tiles`): the encoder's v_dp*T slots hold the
                    microbatch's tiles in sample order; they arrive the same way (end-padded to
                    split evenly), the program gathers the whole pool on every device
                    (POOLED_FEATURES_SPEC = P()) and rows place features by their pool slot
                    (`per_row=False`); each data replica's share of dL/dx is summed over "data".
  LLM, other:       hidden -> hidden; the last one (+ targets, loss_mask) -> (loss_sum, count)
                    (`DecoderStage.loss`: chunked cross-entropy, no full-vocabulary logits)
  colocated:        a layout with no encoder stages runs the whole encoder on LLM stage 0's mesh
                    (`models.mllm.ColocatedStage`, `colocated=True` below): tiles [l_dp*T, H, W, 3]
                    (row r's tiles in slots r*T ..., `ScheduledMicrobatch.tiles_by_row`),
                    tile_pool, tokens, feature_index, ... -> hidden [l_dp, S, D] (or the loss); no x.
                    Tiles and rows are both sharded over "data", and each row gathers only its own
                    tiles' features: the encoder is data-parallel and no feature crosses shards.
  omni, first LLM:  an omni model's first LLM stage (`models.omni.OmniFirstStage`) also runs the
                    whole audio encoder: the audio rows (`AUDIO_KEYS`: audio [l_dp, A, M],
                    audio_windows, audio_valid [l_dp, A], audio_index [l_dp, S]), sharded over
                    "data" like the LLM rows, each row placing only its own outputs; optional (a
                    microbatch without audio has none), the vision features arriving as above
                    (or, colocated, the tiles).
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

from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.costs.recipe import stage_role
from dflop_jax.programs.executable_store import ExecutableStore
from dflop_jax.programs.param_paths import gathered_mask, trained_mask
from dflop_jax.programs.sharding import Rules, create_sharded, rules_for, state_shardings
from dflop_jax.programs.stage_fns import StageFns, check_residual_policy
from dflop_jax.programs.stage_program import StageProgram
from models.stage_modules import TRAINABLE_PARTS, gathered_paths

TAP_KEYS = ("feature_taps", "feature_weight")
# The audio rows of a microbatch that has audio (`data.packing`), in `OmniFirstStage.embed`'s order.
AUDIO_KEYS = ("audio", "audio_windows", "audio_valid", "audio_index")
# How the first LLM stage of an MLLM takes the encoder features [tiles, tokens_per_tile, D] from the
# transfer: the tile axis (packed by row) split over every device of its mesh, so one copy crosses
# the boundary and row r's block lands on row r's tp devices ...
FEATURES_SPEC = P(("data", "model"))
# ... and how its programs compute on them: each row's block gathered over its tp devices only,
ROW_FEATURES_SPEC = P("data")
# or, tiles pooled (`Layout.pooled_tiles`), the whole pool gathered onto every device.
POOLED_FEATURES_SPEC = P()
# Where a run's params come from: an int seed (keyed random init) or an HF model directory.
ParamSource = int | str | os.PathLike


def has_vision(model_cfg) -> bool:
    """True for a model with a vision encoder (LLaVA-OV, InternVL, omni), whose features the first LLM
    stage takes; False for a decoder-only or a Qwen2-Audio model."""
    return hasattr(model_cfg, "vision")


def has_audio(model_cfg) -> bool:
    """True for a model with an audio encoder (`models.omni.OmniConfig`,
    `models.qwen2_audio.Qwen2AudioConfig`): its first LLM stage joins the audio branch
    (`models.omni.OmniFirstStage`)."""
    from models.stage_modules import audio_part

    return audio_part(model_cfg) is not None


def has_encoder(model_cfg) -> bool:
    """True for a model with a vision or an audio encoder: something runs before the first LLM
    stage's layers (`costs.recipe.stage_role`'s `multimodal`)."""
    return has_vision(model_cfg) or has_audio(model_cfg)


def holds_audio(model_cfg, spec: StageSpec, audio_apart: bool = False) -> bool:
    """Whether `spec` is the stage that runs the whole audio encoder: an omni model's first LLM
    stage, unless the audio encoder has stages of its own (`audio_apart`)."""
    return has_audio(model_cfg) and spec.module == "llm" and spec.has_embedding and not audio_apart


def takes_audio(model_cfg, spec: StageSpec, audio_apart: bool) -> bool:
    """Whether `spec` takes the audio encoder's features from its stages: an omni model's first LLM
    stage when the audio encoder has stages of its own."""
    return has_audio(model_cfg) and spec.module == "llm" and spec.has_embedding and audio_apart


def stage_rules(
    model_cfg, spec: StageSpec, *, colocated: bool = False, audio_apart: bool = False
) -> Rules:
    """The rules of a stage: its kind's table, replicating the axes whose sizes tp does not divide
    (e.g. an odd HF vocabulary, or fewer KV heads than tp). A stage holding a whole encoder
    (`colocated`, or the audio encoder of an omni model's first LLM stage) replicates an axis that
    any of its models' tp does not divide (all use one table: the same logical names)."""
    from models.stage_modules import audio_part

    v = getattr(model_cfg, "vision", None)
    vision = dict(heads=v.num_heads, kv_heads=v.num_heads, mlp=v.intermediate_size) if v else {}
    t = getattr(model_cfg, "text", model_cfg)
    text = dict(vocab=t.vocab_size, heads=t.num_heads, kv_heads=t.num_kv_heads,
                mlp=t.intermediate_size)  # fmt: skip
    audio = {}
    if has_audio(model_cfg):
        a = audio_part(model_cfg).audio
        audio = dict(heads=a.num_heads, kv_heads=a.num_heads, mlp=a.intermediate_size)
    if spec.module == "encoder":
        kind, sizes = "vision", [vision]
    elif spec.module == "audio":
        kind, sizes = "vision", [audio]
    else:
        kind, sizes = "decoder", [text, vision] if colocated else [text]
    if holds_audio(model_cfg, spec, audio_apart):
        sizes.append(audio)
    odd = {name for part in sizes for name, n in part.items() if n % spec.tp}
    return rules_for(kind, {name: None for name in odd})


def colocated(model_cfg, layout: Layout) -> bool:
    """Whether `layout` runs the vision encoder colocated on LLM stage 0 (no encoder stages)."""
    return has_vision(model_cfg) and not layout.encoder_stages


def check_colocated(model_cfg, layout: Layout) -> None:
    """Raises ValueError (with the reason) when the runtime cannot colocate the encoder as `layout`
    asks: the colocated stage runs both models at LLM stage 0's tp, which must divide both models'
    attention heads (a head split across devices is not a tensor-parallel layout)."""
    stage = layout.llm_stages[0]
    own = layout.colocated_encoder_tp
    if own is not None and own != stage.tp:
        raise ValueError(
            f"colocated_encoder_tp={own}: the runtime runs a colocated encoder at LLM stage 0's "
            f"tp={stage.tp} (an encoder at its own smaller tp is not implemented); plan without it"
        )
    heads = {"vision": model_cfg.vision.num_heads, "text": model_cfg.text.num_heads}
    if has_audio(model_cfg) and not layout.audio_stages:
        heads["audio"] = model_cfg.audio.audio.num_heads  # an omni model's (it has vision)
    bad = {name: n for name, n in heads.items() if n % stage.tp}
    if bad:
        raise ValueError(
            f"encoder colocated on LLM stage 0 at tp={stage.tp}: tp must divide every model's "
            f"attention heads ({', '.join(f'{k} {v}' for k, v in heads.items())}); choose a tp "
            "dividing both or give the encoder its own stages (layout.encoder_layers)"
        )


def stage_fns(
    graphdef,
    spec: StageSpec,
    rules: Rules,
    *,
    multimodal: bool,
    colocated: bool = False,
    audio: bool = False,
    audio_x: bool = False,
    pooled: bool = False,
) -> StageFns:
    """Pure functions of one stage module (`EncoderStage`, `LLMStage`, `DecoderStage` or, with
    `colocated`, `ColocatedStage`).

    Args:
      graphdef: the stage module's nnx graphdef (its params are the functions' `params`).
      spec: the stage (module, layers, embedding / head).
      rules: its logical->mesh rules (`stage_rules`).
      multimodal: a model with a vision encoder (the first LLM stage takes its features as x).
      colocated: the first LLM stage also runs the encoder (tiles in, no x).
      audio: the first LLM stage also runs the audio encoder (`OmniFirstStage`) on the
        microbatch's audio rows, when it has them (`AUDIO_KEYS`: a microbatch without audio is
        another signature, one more compile of this stage only).
      audio_x: the first LLM stage takes the audio encoder's features from its own stages
        (`_joining_fns`).
      pooled: the first LLM stage takes the features of a pooled encoder (`Layout.pooled_tiles`):
        it gathers the whole pool onto every device and each row places its features by their
        slots in the pool.
    """
    if spec.module == "encoder":
        return _encoder_fns(graphdef, spec, rules)
    if spec.module == "audio":
        return _audio_fns(graphdef, spec, rules)
    if audio_x:
        return _joining_fns(graphdef, spec, rules, colocated=colocated, vision=multimodal)
    features = multimodal and spec.has_embedding
    return _llm_fns(graphdef, spec, rules, features=features, colocated=colocated, audio=audio,
                    pooled=pooled)  # fmt: skip


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


def _audio_fns(graphdef, spec: StageSpec, rules: Rules) -> StageFns:
    """An audio encoder stage (`AudioEncoderStage` on packed rows): the first takes the audio rows,
    the others the hidden rows; every one reads the windows (its attention stays within each)."""
    side = (("audio",) if spec.has_embedding else ()) + ("audio_windows", "audio_valid")

    def forward(params, x, s):
        with nnx.logical_axis_rules(rules):
            stage = nnx.merge(graphdef, params)
            inp = s["audio"] if spec.has_embedding else x
            return stage(inp, None, s["audio_windows"], s["audio_valid"])

    return StageFns(
        forward=forward, side_keys=side, x_spec=None if spec.has_embedding else P("data")
    )


def _joining_fns(
    graphdef, spec: StageSpec, rules: Rules, *, colocated: bool, vision: bool
) -> StageFns:
    """The first LLM stage of a model with an audio encoder on stages of its own: x is the two
    branches' outputs, {"encoder": vision features, "audio": audio features [l_dp, A/4, D]} (the
    vision features as `_llm_fns` takes them), or, with the vision encoder colocated or without
    one (`vision` False: Qwen2-Audio), the audio features alone. Each row places its own audio
    outputs (`audio_index` modulo A/4)."""
    placed = ("feature_index",) if vision else ()
    side = ("tokens", *placed, "segment_ids", "positions", "audio_index")
    if colocated:
        side = ("tiles", "tile_pool") + side
    branches = vision and not colocated  # x holds both branches' outputs

    def hidden(params, x, s):
        with nnx.logical_axis_rules(rules):
            stage = nnx.merge(graphdef, params)
            if branches:
                features, sound = x["encoder"], x["audio"]
            else:  # the tiles of a colocated vision encoder, or no vision at all
                features, sound = ((s["tiles"], s["tile_pool"]) if colocated else None), x
            placement = _placement(s) if vision else (None, None)
            x = stage.embed(features, s["tokens"], *placement, sound, None, None,
                            s["audio_index"])  # fmt: skip
            return stage, stage(x, s["segment_ids"], s["positions"])

    x_spec = {"encoder": FEATURES_SPEC, "audio": P("data")} if branches else P("data")
    inner = {"encoder": ROW_FEATURES_SPEC, "audio": P("data")} if branches else None
    taps = TAP_KEYS if vision else ()
    return _decoder_stage_fns(hidden, spec, rules, side, taps, x_spec, inner)


def _llm_fns(
    graphdef,
    spec: StageSpec,
    rules: Rules,
    *,
    features: bool,
    colocated: bool,
    audio: bool,
    pooled: bool = False,
) -> StageFns:
    side = ("segment_ids", "positions")
    if spec.has_embedding:
        side = ("tokens",) + (("feature_index",) if features else ()) + side
    if colocated:
        side = ("tiles", "tile_pool") + side

    def hidden(params, x, s):
        with nnx.logical_axis_rules(rules):
            stage = nnx.merge(graphdef, params)
            if audio:  # OmniFirstStage: the vision features (or the tiles) and the audio rows
                vision = (s["tiles"], s["tile_pool"]) if colocated else x
                sound = tuple(s[k] for k in AUDIO_KEYS) if "audio" in s else (None,) * 4
                placement = _placement(s) if features or colocated else (None, None)
                x = stage.embed(vision, s["tokens"], *placement, *sound, per_row=not pooled)
            elif colocated:
                x = stage.embed(s["tiles"], s["tile_pool"], s["tokens"], *_placement(s))
            elif features:
                x = stage.embed(s["tokens"], x, *_placement(s), per_row=not pooled)
            elif spec.has_embedding:
                x = stage.embed(s["tokens"])
            return stage, stage(x, s["segment_ids"], s["positions"])

    x_spec = (FEATURES_SPEC if features else None) if spec.has_embedding else P("data")
    if colocated:
        x_spec = None
    # the features arrive split over the stage's devices; each row's block is gathered over its
    # tp devices (docstring), or a pool is gathered whole
    inner = None
    if features and not colocated:
        inner = POOLED_FEATURES_SPEC if pooled else ROW_FEATURES_SPEC
    optional = (TAP_KEYS if features else ()) + (AUDIO_KEYS if audio else ())
    return _decoder_stage_fns(hidden, spec, rules, side, optional, x_spec, inner)


def _decoder_stage_fns(hidden, spec: StageSpec, rules: Rules, side, optional, x_spec, inner):
    """The `StageFns` of an LLM stage from its `hidden(params, x, side) -> (stage, h)`: the
    forward, or on the last stage the loss of h (which also reads the targets and loss mask)."""
    if not spec.has_head:
        return StageFns(forward=lambda p, x, s: hidden(p, x, s)[1], side_keys=side,
                        optional_keys=optional, x_spec=x_spec, x_compute_spec=inner)  # fmt: skip

    def loss(params, x, s):
        stage, h = hidden(params, x, s)
        with nnx.logical_axis_rules(rules):
            return stage.loss(h, s["targets"], s["loss_mask"])

    return StageFns(loss=loss, side_keys=side + ("targets", "loss_mask"), optional_keys=optional,
                    x_spec=x_spec, x_compute_spec=inner)  # fmt: skip


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
      gathered: bool per leaf of `state`, whether the stage reads it only by a gather
        (`models.stage_modules.gathered_paths`): frozen, it needs no compute-dtype copy
        (`StageProgram`).
    """

    graphdef: Any
    state: nnx.State
    shardings: nnx.State
    fns: StageFns
    gathered: Any


def stage_blueprint(
    module: nnx.Module,
    model_cfg,
    spec: StageSpec,
    mesh: Mesh,
    *,
    colocated: bool = False,
    audio_apart: bool = False,
    pooled: bool = False,
) -> StageBlueprint:
    """The blueprint of a stage module of `model_cfg` on `mesh` (`colocated`: a `ColocatedStage`;
    `audio_apart`: an omni model's audio encoder has stages of its own; `pooled`: the first LLM
    stage takes a pooled encoder's features, `stage_fns`)."""
    rules = stage_rules(model_cfg, spec, colocated=colocated, audio_apart=audio_apart)
    graphdef, state = nnx.split(module)
    fns = stage_fns(graphdef, spec, rules, multimodal=has_vision(model_cfg),
                    colocated=colocated, audio=holds_audio(model_cfg, spec, audio_apart),
                    audio_x=takes_audio(model_cfg, spec, audio_apart), pooled=pooled)  # fmt: skip
    gathered = gathered_mask(state, gathered_paths(module))
    return StageBlueprint(graphdef, state, state_shardings(state, mesh, rules), fns, gathered)


def _flags(spec: StageSpec) -> dict:
    return dict(first_layer=spec.first_layer, num_layers=spec.num_layers,
                has_embedding=spec.has_embedding, has_head=spec.has_head)  # fmt: skip


def stage_module(
    model_cfg,
    spec: StageSpec,
    rngs: nnx.Rngs,
    *,
    colocated: bool = False,
    audio_apart: bool = False,
) -> nnx.Module:
    """A fresh stage module of `spec` (`models.stage_modules.stage_module`: random init keyed by global layer)."""
    from models.stage_modules import stage_module as build

    return build(model_cfg, spec.module, **_flags(spec), rngs=rngs, colocated=colocated,
                 audio_apart=audio_apart, joins_audio=True)  # fmt: skip


def abstract_stage(
    model_cfg,
    spec: StageSpec,
    mesh: Mesh,
    *,
    colocated: bool = False,
    audio_apart: bool = False,
    pooled: bool = False,
) -> StageBlueprint:
    """The blueprint of a fresh stage module without allocating it: `state` holds ShapeDtypeStructs
    carrying their shardings (what the profiler compiles from, and a non-local stage's params)."""
    where = dict(colocated=colocated, audio_apart=audio_apart)
    rules = stage_rules(model_cfg, spec, **where)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        module = nnx.eval_shape(lambda: stage_module(model_cfg, spec, nnx.Rngs(0), **where))
    bp = stage_blueprint(module, model_cfg, spec, mesh, **where, pooled=pooled)
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), bp.state, bp.shardings
    )
    return dataclasses.replace(bp, state=state)


def is_local(mesh: Mesh) -> bool:
    """Whether this process owns a device of `mesh` (else the stage is NON-LOCAL here)."""
    me = jax.process_index()
    return any(d.process_index == me for d in mesh.devices.flat)


def init_stage(
    model_cfg,
    spec: StageSpec,
    mesh: Mesh,
    source: ParamSource,
    *,
    colocated: bool = False,
    audio_apart: bool = False,
    pooled: bool = False,
    store: ExecutableStore | None = None,
) -> StageBlueprint:
    """The blueprint of a stage with its params created directly in their stage sharding.

    Args:
      source: an int seed (random init keyed by global layer index, equal to the same range of the
        whole model built with `nnx.Rngs(seed)`) or an HF model directory (only this stage's tensors,
        each device's slice read on its own: `models.hf.load_stage`).

    A stage whose mesh has no device of this process gets abstract params (ShapeDtypeStructs with
    their shardings): nothing of it is compiled, read or allocated here. `colocated`: the stage
    also holds the whole encoder (`ColocatedStage`); `audio_apart`: an omni model's audio encoder
    has stages of its own; `pooled`: as `stage_fns`'s; `store`: where a random init's program
    comes from on a process JAX's cache does not write from (`programs/executable_store.py`).
    """
    where = dict(colocated=colocated, audio_apart=audio_apart)
    if not is_local(mesh):
        return abstract_stage(model_cfg, spec, mesh, **where, pooled=pooled)
    rules = stage_rules(model_cfg, spec, **where)
    if isinstance(source, int):
        module = create_sharded(
            lambda rngs: stage_module(model_cfg, spec, rngs, **where), source, mesh, rules, store
        )
    else:
        module = _load_hf(source, model_cfg, spec, mesh, rules, colocated, audio_apart)
    return stage_blueprint(module, model_cfg, spec, mesh, **where, pooled=pooled)


def _load_hf(source, model_cfg, spec: StageSpec, mesh: Mesh, rules: Rules, colocated: bool,
             audio_apart: bool):  # fmt: skip
    """The stage's tensors of an HF checkpoint; with an encoder, its stage and the LLM's, joined."""
    from models.hf import load_stage
    from models.mllm import ColocatedStage
    from models.omni import OmniConfig, OmniFirstStage

    if isinstance(model_cfg, OmniConfig):
        raise ValueError(
            "an omni model's stages are built from a seed (model.init_seed); loading them from HF "
            "checkpoints is models.hf.omni.load_omni's, not the pipeline's yet"
        )
    # A Qwen2-Audio checkpoint names its audio encoder "encoder" (the pipeline's "audio" module).
    module = "encoder" if spec.module == "audio" else spec.module
    llm = load_stage(source, model_cfg, module, **_flags(spec), mesh=mesh, rules=rules)
    if has_audio(model_cfg) and spec.module == "llm" and spec.has_embedding:
        audio = None
        if holds_audio(model_cfg, spec, audio_apart):
            whole = dict(first_layer=0, num_layers=model_cfg.audio.num_layers, has_embedding=True,
                         has_head=True)  # fmt: skip
            audio = load_stage(source, model_cfg, "encoder", **whole, mesh=mesh, rules=rules)
        return OmniFirstStage(audio, llm)
    if not colocated:
        return llm
    whole = dict(first_layer=0, num_layers=model_cfg.vision.num_layers, has_embedding=True,
                 has_head=True)  # fmt: skip
    encoder = load_stage(source, model_cfg, "encoder", **whole, mesh=mesh, rules=rules)
    return ColocatedStage(encoder, llm)


def build_stages(
    model_cfg,
    layout: Layout,
    meshes: Sequence[Mesh],
    source: ParamSource,
    *,
    compute_dtype=jnp.bfloat16,
    trainable: Sequence[str] = TRAINABLE_PARTS,
    residuals: Sequence[str] | None = None,
    store: ExecutableStore | None = None,
) -> list[StageProgram]:
    """One StageProgram per stage of `layout` (encoder stages, then LLM stages), each stage's params
    made on its own mesh (`init_stage`): the whole model never exists on one device or host.

    Args:
      model_cfg: a `DecoderConfig` (decoder-only: no encoder stages) or an MLLM config (LLaVA-OV,
        InternVL: the encoder runs on its own stages, or with none, colocated on LLM stage 0:
        `check_colocated`).
      meshes: one mesh per stage (`programs.meshes.stage_meshes`).
      source: an int seed or an HF model directory (see `init_stage`).
      compute_dtype: dtype the stage programs compute in (they take the params' copies in it).
      trainable: the parts trained (`optimizer.trainable`); a frozen leaf gets no gradient, and each
        stage runs as its role says (`costs.recipe.stage_role`: trained, dx-only or forward-only).
      residuals: each stage's residual policy (`contracts.cost_table.RESIDUAL_POLICIES`; None: "recompute"
        everywhere); a "layers" stage is built with layer remat ("full") whatever `model_cfg` says.
      store: this process's executable store, if any (`init_stage`, and the cast making the
        weights' compute-dtype copies: `StageProgram`).
    """
    residuals = ["recompute"] * layout.num_stages if residuals is None else list(residuals)
    if len(residuals) != layout.num_stages:
        raise ValueError(
            f"{len(residuals)} residual policies for a layout of {layout.num_stages} stages"
        )
    if not has_vision(model_cfg) and layout.encoder_stages:
        raise ValueError(
            "a model without a vision encoder (decoder-only, Qwen2-Audio) has no encoder stages: "
            "give a layout without them"
        )
    coloc = colocated(model_cfg, layout)
    if coloc:
        check_colocated(model_cfg, layout)
    apart = bool(layout.audio_stages)
    if apart and not has_audio(model_cfg):
        raise ValueError(
            "a layout with audio stages needs a model with an audio encoder (omni, qwen2_audio)"
        )
    first = layout.first_llm
    blueprints = [
        init_stage(
            stage_config(model_cfg, policy),
            spec,
            mesh,
            source,
            colocated=coloc and i == first,
            audio_apart=apart,
            pooled=layout.pooled_tiles and i == first,
            store=store,
        )  # fmt: skip
        for i, (spec, mesh, policy) in enumerate(zip(layout.stages, meshes, residuals))
    ]
    masks = [trained_mask(bp.state, trainable) for bp in blueprints]
    trains = [any(jax.tree.leaves(m)) for m in masks]
    if not any(trains):
        raise ValueError(
            f"optimizer.trainable={list(trainable)} trains no parameter of this model "
            "(a decoder-only model has only 'llm')"
        )
    roles = [
        stage_role(
            spec,
            trainable,
            has_encoder(model_cfg),
            colocated=coloc and i == first,
            audio=holds_audio(model_cfg, spec, apart),
            audio_x=takes_audio(model_cfg, spec, apart),
        )  # fmt: skip
        for i, spec in enumerate(layout.stages)
    ]
    stages = [
        StageProgram(
            mesh,
            bp.fns,
            bp.state,
            compute_dtype,
            trained=mask,
            role=role,
            residuals=policy,
            store=store,
            gathered=bp.gathered,
        )  # fmt: skip
        for bp, mesh, mask, role, policy in zip(blueprints, meshes, masks, roles, residuals)
    ]
    for stage, child in zip(stages, layout.children):
        stage.feeds = child
    return stages


def stage_config(model_cfg, residuals: str):
    """The model config a stage under residual policy `residuals` is built with: layer remat
    ("full") for "layers" (its residuals are the layer inputs), `model_cfg` itself otherwise."""
    from models.stage_modules import with_remat

    if check_residual_policy(residuals) != "layers":
        return model_cfg
    return with_remat(model_cfg, {"vision": "full", "llm": "full"})
