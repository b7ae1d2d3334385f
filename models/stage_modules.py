"""The stage module of a model config: one pipeline stage built on its own (never cut from a whole model).

    stage_module(cfg, "llm", first_layer=2, num_layers=3, has_embedding=False, has_head=True, rngs=...)

A `DecoderConfig` gives `DecoderStage`s (module "llm" only); an MLLM config (LLaVA-OV, InternVL) gives
`EncoderStage` ("encoder": vision layers, + patch embedding if first, + projector if last) or
`LLMStage` ("llm"); a Qwen2-Audio config `AudioEncoderStage` ("audio", or "encoder" as its HF
checkpoint names its one encoder: audio layers, + conv embedding if first, + pool, norm and
projector if last) or `LLMStage` (with `joins_audio`, the first one an `OmniFirstStage`, as in an
omni model); an omni config (`models.omni`) its vision
`EncoderStage`, its `AudioEncoderStage` ("audio": the audio encoder on stages of its own), an
`OmniFirstStage` (the first LLM stage: with the whole audio encoder unless `audio_apart`, and with
`colocated` the whole vision encoder too) or `LLMStage`. Random init is keyed by global layer index and part name (`models.layers.keyed_rngs`),
so `stage_module(cfg, ..., rngs=nnx.Rngs(s))` holds exactly the params that the whole model built with
`nnx.Rngs(s)` holds for that range: a stage can be initialized alone, in its own sharding.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from models.decoder import DecoderStage
from models.decoder_config import DecoderConfig
from models.mllm import ColocatedStage, EncoderStage, LLMStage
from models.omni import OmniConfig, OmniFirstStage
from models.qwen2_audio import AudioEncoderStage, Qwen2AudioConfig

MODULES = ("encoder", "audio", "llm")
# The stage modules of a vision MLLM (what its HF checkpoints hold); an omni model adds "audio".
MLLM_MODULES = ("encoder", "llm")
# The parts a training recipe freezes or slows down (LLaVA-NeXT `mm_tunable_parts`: mm_vision_tower,
# mm_mlp_adapter, mm_language_model).
TRAINABLE_PARTS = ("vision", "projector", "llm")


def gathered_paths(module: nnx.Module) -> frozenset[tuple[str, ...]]:
    """The paths (key names from the stage module's root) of the params it reads only by a gather
    of rows (`DecoderStage.gathered_params`, wherever a decoder stage sits in it): a frozen one
    needs no compute-dtype copy (`programs/stage_program.py`)."""
    return frozenset(
        (*map(str, path), *names)
        for path, node in nnx.iter_graph(module)
        if isinstance(node, DecoderStage)
        for names in node.gathered_params()
    )


def audio_part(cfg) -> Qwen2AudioConfig | None:
    """The Qwen2-Audio config of a model's audio encoder and projector (a Qwen2-Audio model's own
    config, an omni model's `audio`), None for a model without one."""
    if isinstance(cfg, OmniConfig):
        return cfg.audio
    return cfg if isinstance(cfg, Qwen2AudioConfig) else None


def param_part(path: tuple[str, ...]) -> str:
    """The part of a stage module's parameter at `path` (key names from the stage's root): an encoder
    stage's "vision" / "projector" subtrees, else "llm". LLaVA-OV's image newline (in the first LLM
    stage) counts as "llm", as in LLaVA-NeXT's train.py, where `mm_language_model` unfreezes every
    parameter outside the vision tower and `mm_projector`. A colocated stage (`ColocatedStage`) holds
    them under "encoder" (and its LLM layers under "llm"); an omni first stage (`OmniFirstStage`)
    also holds the audio encoder under "audio".

    The parts are the recipe's (an encoder tower, the projectors, the LLM): an audio tower counts as
    "vision" (the encoder towers a recipe freezes or trains together) and its projector as
    "projector", so LLaVA's stage-1 recipe (projectors only) aligns both modalities."""
    if path[0] in ("encoder", "audio") and len(path) > 1 and path[1] in _ENCODER_PARTS:
        path = path[1:]
    if path[0] in ("vision", "projector"):
        return path[0]
    return "vision" if path[0] == "audio" else "llm"


# The subtrees of an encoder stage: a vision tower, an audio tower, their projector.
_ENCODER_PARTS = ("vision", "audio", "projector")


def stage_module(
    cfg,
    module: str,
    *,
    first_layer: int,
    num_layers: int,
    has_embedding: bool,
    has_head: bool,
    rngs: nnx.Rngs,
    colocated: bool = False,
    audio_apart: bool = False,
    joins_audio: bool = False,
) -> nnx.Module:
    """A fresh stage module of `cfg` holding layers [first_layer, first_layer + num_layers) of `module`.

    colocated: the first LLM stage of an MLLM also holds the whole encoder (`ColocatedStage`).
    audio_apart: an omni model's audio encoder runs on stages of its own (module "audio"), so its
      first LLM stage takes the audio features instead of holding the encoder.
    joins_audio: a Qwen2-Audio model's first LLM stage joins the audio branch as a pipeline's does
      (`OmniFirstStage`: the whole audio encoder inside, or its features with `audio_apart`);
      without it that stage is the HF checkpoint's plain `LLMStage` (`models.hf.load_stage`).
    """
    if module not in MODULES:
        raise ValueError(f"stage module={module!r}; use one of {MODULES}")
    if isinstance(cfg, OmniConfig):
        return _omni_stage(cfg, module, first_layer, num_layers, has_embedding, has_head, rngs,
                           colocated, audio_apart)  # fmt: skip
    if isinstance(cfg, Qwen2AudioConfig):
        return _audio_stage(cfg, module, first_layer, num_layers, has_embedding, has_head, rngs,
                            colocated, audio_apart, joins_audio)  # fmt: skip
    if module == "audio":
        raise ValueError("stage module='audio' is an audio model's (Qwen2AudioConfig, OmniConfig)")
    if colocated:
        if isinstance(cfg, DecoderConfig) or module != "llm" or not has_embedding:
            raise ValueError(
                "colocated: only a vision MLLM's first LLM stage (module='llm', has_embedding) "
                "can hold the encoder"
            )
        encoder = EncoderStage(cfg, first_layer=0, num_layers=cfg.vision.num_layers,
                               has_embedding=True, has_head=True, rngs=rngs)  # fmt: skip
        flags = dict(first_layer=first_layer, num_layers=num_layers, has_embedding=True,
                     has_head=has_head, rngs=rngs)  # fmt: skip
        return ColocatedStage(encoder, LLMStage(cfg, **flags))
    flags = dict(first_layer=first_layer, num_layers=num_layers,
                 has_embedding=has_embedding, has_head=has_head, rngs=rngs)  # fmt: skip
    if isinstance(cfg, DecoderConfig):
        if module == "encoder":
            raise ValueError("a decoder-only model has no encoder stage; use module='llm'")
        return DecoderStage(cfg, **flags)
    return (EncoderStage if module == "encoder" else LLMStage)(cfg, **flags)


def _audio_stage(cfg, module, first_layer, num_layers, has_embedding, has_head, rngs, colocated,
                 audio_apart, joins_audio):  # fmt: skip
    """A Qwen2-Audio model's stage: its audio encoder's ("audio" or "encoder") or its decoder's."""
    if colocated:
        raise ValueError(
            "colocated: a Qwen2-Audio model has no vision encoder; its first LLM stage holds the "
            "audio encoder with joins_audio"
        )
    flags = dict(first_layer=first_layer, num_layers=num_layers, has_embedding=has_embedding,
                 has_head=has_head, rngs=rngs)  # fmt: skip
    if module != "llm":
        return AudioEncoderStage(cfg, **flags)
    llm = LLMStage(cfg, **flags)
    if not (joins_audio and has_embedding):
        return llm
    whole = dict(first_layer=0, has_embedding=True, has_head=True, rngs=rngs)
    audio = (
        None if audio_apart else AudioEncoderStage(cfg, num_layers=cfg.audio.num_layers, **whole)
    )
    return OmniFirstStage(audio, llm)


def _omni_stage(cfg, module, first_layer, num_layers, has_embedding, has_head, rngs, colocated,
                audio_apart):  # fmt: skip
    flags = dict(first_layer=first_layer, num_layers=num_layers, has_embedding=has_embedding,
                 has_head=has_head, rngs=rngs)  # fmt: skip
    if module != "llm" or not has_embedding:
        if colocated:
            raise ValueError("colocated: only the first LLM stage can hold the encoders")
        if module == "audio":
            return AudioEncoderStage(cfg.audio, **flags)
        return (EncoderStage if module == "encoder" else LLMStage)(cfg.llava, **flags)
    whole = dict(first_layer=0, has_embedding=True, has_head=True, rngs=rngs)
    encoder = audio = None
    if colocated:
        encoder = EncoderStage(cfg.llava, num_layers=cfg.vision.num_layers, **whole)
    if not audio_apart:
        audio = AudioEncoderStage(cfg.audio, num_layers=cfg.audio.audio.num_layers, **whole)
    return OmniFirstStage(audio, LLMStage(cfg.llava, **flags), encoder)


def with_attention(model_cfg, implementation: str, vision: str | None = None):
    """`model_cfg` whose decoder runs attention `implementation` ("xla", "pallas" or "cudnn":
    `models.attention`) and whose vision tower (when it has one) runs `vision` (None: the same)."""
    if isinstance(model_cfg, DecoderConfig):
        return model_cfg.replace(attention_impl=implementation)
    if isinstance(model_cfg, OmniConfig):  # each part's towers, the audio one as an encoder
        parts = (
            with_attention(p, implementation, vision) for p in (model_cfg.llava, model_cfg.audio)
        )
        return OmniConfig(*parts)
    tower = "audio" if isinstance(model_cfg, Qwen2AudioConfig) else "vision"
    return dataclasses.replace(
        model_cfg,
        **{tower: getattr(model_cfg, tower).replace(attention_impl=vision or implementation)},
        text=model_cfg.text.replace(attention_impl=implementation),
    )


def with_remat(model_cfg, remat: dict[str, str]):
    """`model_cfg` with the per-module activation recomputation `remat` ({"vision": ..., "llm": ...},
    each "none" / "full" / "dots"): the `remat` of its vision tower and of its decoder. An audio
    tower takes `remat["audio"]`, else the vision tower's policy (the encoders' one)."""
    if isinstance(model_cfg, DecoderConfig):
        return model_cfg.replace(remat=remat["llm"])
    if isinstance(model_cfg, OmniConfig):
        return OmniConfig(with_remat(model_cfg.llava, remat), with_remat(model_cfg.audio, remat))
    if isinstance(model_cfg, Qwen2AudioConfig):
        tower = {"audio": model_cfg.audio.replace(remat=remat.get("audio", remat["vision"]))}
    else:
        tower = {"vision": model_cfg.vision.replace(remat=remat["vision"])}
    return dataclasses.replace(model_cfg, **tower, text=model_cfg.text.replace(remat=remat["llm"]))
