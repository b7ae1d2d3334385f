"""HF LLaVA-OneVision checkpoints (`LlavaOnevisionForConditionalGeneration`, `model_type:
llava_onevision`) <-> `models.llava_onevision`; the adapter of `models.hf.load_pretrained`.

Key layouts: transformers 5 `save_pretrained` writes `vision_tower.*` (SigLIP keys without
`vision_model.`), `multi_modal_projector.*`, `image_newline`, `language_model.model.*` and
`language_model.lm_head.weight` (`LAYOUT_SAVED`, what the registry's adapter and export use). Older
llava-hf checkpoints use `vision_tower.vision_model.*` and module-style variants (`model.*`, `lm_head`):
`load_llava_onevision(path)` detects the layout from the checkpoint's keys and handles all of them.
Vision layers past `vision_feature_layer` and SigLIP's `post_layernorm` are never read by LLaVA-OV:
they are skipped on import and absent from our model's export (`unread_tensors` lists them for a
caller that copies them from the checkpoint it started from).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
from flax import nnx

from models.decoder_config import DecoderConfig
from models.hf import llama, qwen2
from models.hf.causal_lm import decoder_name_map
from models.hf.io import (
    CheckpointError,
    CheckpointReader,
    ModelAdapter,
    NameMap,
    TensorMap,
    load_state,
    read_config,
)
from models.hf.siglip import (
    IGNORED_KEYS,
    siglip_config_from_hf,
    siglip_config_to_hf,
    siglip_name_map,
    transpose,
)
from models.layouts import LLAVA_OV_PINPOINTS
from models.llava_onevision import LlavaOnevision, LlavaOnevisionConfig, llava_onevision_config

# Decoder families LLaVA-OV's text model may be (HF builds `text_config` with AutoModel).
TEXT_FAMILIES = {"qwen2": qwen2, "llama": llama}


@dataclasses.dataclass(frozen=True)
class KeyLayout:
    """HF key prefixes of one checkpoint layout."""

    vision: str
    projector: str
    newline: str
    text_body: str
    text_head: str


LAYOUT_SAVED = KeyLayout(
    "vision_tower.",
    "multi_modal_projector.",
    "image_newline",
    "language_model.model.",
    "language_model.lm_head.weight",
)
_CANDIDATES = {
    "vision": (
        "vision_tower.vision_model.",
        "model.vision_tower.vision_model.",
        "vision_tower.",
        "model.vision_tower.",
    ),
    "projector": ("multi_modal_projector.", "model.multi_modal_projector."),
    "newline": ("image_newline", "model.image_newline"),
    "text_body": ("language_model.model.", "model.language_model.", "language_model."),
    "text_head": ("language_model.lm_head.weight", "lm_head.weight"),
}


def detect_layout(keys: list[str]) -> KeyLayout:
    """The layout whose prefixes the checkpoint's keys use (first candidate that matches, per part)."""
    found = {}
    for part, candidates in _CANDIDATES.items():
        hits = [c for c in candidates if any(k.startswith(c) for k in keys)]
        found[part] = hits[0] if hits else getattr(LAYOUT_SAVED, part)
    return KeyLayout(**found)


def config_from_hf(hf: dict, dtype: str, param_dtype: str) -> LlavaOnevisionConfig:
    """`LlavaOnevisionConfig` from an HF config.json dict."""
    if hf.get("vision_feature_select_strategy", "full") != "full":
        raise CheckpointError(
            "LLaVA-OV vision_feature_select_strategy must be 'full' (SigLIP has no CLS token)"
        )
    layer = hf.get("vision_feature_layer", -1)
    if not isinstance(layer, int):
        raise CheckpointError(
            f"LLaVA-OV vision_feature_layer={layer!r}: only a single int layer is supported"
        )
    acts = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}
    if hf.get("projector_hidden_act", "gelu") not in acts:
        raise CheckpointError(
            f"projector_hidden_act={hf['projector_hidden_act']!r}; use one of {sorted(acts)}"
        )
    text_d = dict(hf["text_config"])
    text_type = text_d.get("model_type", "qwen2")
    if text_type not in TEXT_FAMILIES:
        raise CheckpointError(
            f"LLaVA-OV text model_type={text_type!r}; use one of {sorted(TEXT_FAMILIES)}"
        )
    text_d["tie_word_embeddings"] = hf.get("tie_word_embeddings", False) or text_d.get(
        "tie_word_embeddings", False
    )
    return llava_onevision_config(
        siglip_config_from_hf(hf["vision_config"], dtype=dtype, param_dtype=param_dtype),
        TEXT_FAMILIES[text_type].config_from_hf(text_d, dtype, param_dtype),
        vision_feature_layer=layer,
        image_token_id=hf.get("image_token_index", hf.get("image_token_id", 151646)),
        video_token_id=hf.get("video_token_index", hf.get("video_token_id", 151647)),
        projector_bias=hf.get("multimodal_projector_bias", True),
        projector_act=acts[hf.get("projector_hidden_act", "gelu")],
        pinpoints=tuple(tuple(p) for p in hf.get("image_grid_pinpoints") or LLAVA_OV_PINPOINTS),
        vision_aspect_ratio=hf.get("vision_aspect_ratio", "anyres_max_9"),
    )


def text_config_to_hf(text: DecoderConfig) -> dict:
    """The text_config of a decoder: Qwen2 (LLaVA-OV's own) when it has q/k/v biases, else Llama
    (a decoder built without biases, e.g. the demo's; transformers builds either as the text model)."""
    return (qwen2 if text.qkv_bias else llama).config_to_hf(text)


def config_to_hf(cfg: LlavaOnevisionConfig) -> dict:
    """config.json of `cfg` (the vision tower holds exactly the layers read: feature layer -1)."""
    return {
        "architectures": ["LlavaOnevisionForConditionalGeneration"],
        "model_type": "llava_onevision",
        "vision_config": siglip_config_to_hf(cfg.vision),
        "text_config": text_config_to_hf(cfg.text),
        "image_token_index": cfg.image_token_id,
        "video_token_index": cfg.video_token_id,
        "projector_hidden_act": {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[
            cfg.projector_act
        ],
        "multimodal_projector_bias": cfg.projector_bias,
        "vision_feature_select_strategy": "full",
        "vision_feature_layer": -1,
        "image_grid_pinpoints": [list(p) for p in cfg.pinpoints],
        "vision_aspect_ratio": cfg.vision_aspect_ratio,
        "tie_word_embeddings": cfg.text.tie_embeddings,
    }


def encoder_name_map(
    cfg: LlavaOnevisionConfig, layout: KeyLayout, *, prefix: tuple = (), **flags
) -> NameMap:
    """An `EncoderStage` (SigLIP layers, + projector on the head stage) at state path `prefix`."""
    out = siglip_name_map(cfg.vision, prefix=(*prefix, "vision"), hf_prefix=layout.vision, **flags)
    if flags["has_head"]:
        for j in (1, 2):
            out[(*prefix, "projector", f"linear_{j}")] = TensorMap(
                f"{layout.projector}linear_{j}.weight", **transpose()
            )
            if cfg.projector_bias:
                out[(*prefix, "projector", f"bias_{j}")] = TensorMap(
                    f"{layout.projector}linear_{j}.bias"
                )
    return out


def llm_name_map(cfg: LlavaOnevisionConfig, layout: KeyLayout, *, prefix: tuple = (), **flags):
    """An `LLMStage` (Qwen2 layers, + image newline on the embedding stage) at state path `prefix`."""
    out = decoder_name_map(
        cfg.text, prefix=(*prefix, "decoder"), hf_body=layout.text_body, hf_head=layout.text_head,
        **flags,
    )  # fmt: skip
    if flags["has_embedding"]:
        out[(*prefix, "image_newline")] = TensorMap(layout.newline)
    return out


def name_map(cfg: LlavaOnevisionConfig, layout: KeyLayout = LAYOUT_SAVED) -> NameMap:
    """Every parameter of `LlavaOnevision(cfg)` with its HF key in `layout`."""
    whole = dict(first_layer=0, has_embedding=True, has_head=True)
    return {
        **encoder_name_map(
            cfg, layout, prefix=("encoder",), num_layers=cfg.vision.num_layers, **whole
        ),
        **llm_name_map(cfg, layout, prefix=("llm",), num_layers=cfg.text.num_layers, **whole),
    }


def stage_name_map(cfg: LlavaOnevisionConfig, keys: list[str], module: str, **flags) -> NameMap:
    """One stage's name map, in the key layout the checkpoint uses."""
    stage_map = encoder_name_map if module == "encoder" else llm_name_map
    return stage_map(cfg, detect_layout(keys), **flags)


ADAPTER = ModelAdapter(
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    build=lambda cfg, rngs: LlavaOnevision(cfg, rngs=rngs),
    name_map=name_map,
    matches=lambda cfg: isinstance(cfg, LlavaOnevisionConfig),
    ignored_keys=IGNORED_KEYS,
    stage_name_map=stage_name_map,
)


def load_llava_onevision(
    path: str | Path,
    *,
    dtype: str = "float32",
    param_dtype: str = "float32",
    mesh: jax.sharding.Mesh | None = None,
    rules=None,
) -> tuple[LlavaOnevision, LlavaOnevisionConfig]:
    """(model, cfg) from an HF LLaVA-OneVision directory in any key layout; sharded if mesh + rules."""
    cfg = config_from_hf(read_config(path), dtype, param_dtype)
    reader = CheckpointReader(path)
    layout = detect_layout(reader.keys())
    model = load_state(
        reader,
        lambda: LlavaOnevision(cfg, rngs=nnx.Rngs(0)),
        name_map(cfg, layout),
        ignored=(*IGNORED_KEYS, layout.text_head if cfg.text.tie_embeddings else "\0"),
        mesh=mesh,
        rules=rules,
    )
    return model, cfg
