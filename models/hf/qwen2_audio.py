"""HF Qwen2-Audio checkpoints (`Qwen2AudioForConditionalGeneration`, `model_type: qwen2_audio`) <->
`models.qwen2_audio`; the adapter of `models.hf.load_pretrained`.

Key layouts: transformers 5 `save_pretrained` (and Qwen/Qwen2-Audio-7B) write `audio_tower.*`,
`multi_modal_projector.linear.*`, `language_model.model.*` and `language_model.lm_head.weight`
(`LAYOUT_SAVED`, what the export writes); the module-style names of transformers 5's state dict
(`model.audio_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.weight`)
are detected from a checkpoint's keys and read as well.
"""

from __future__ import annotations

import dataclasses

from models.hf import llama, qwen2
from models.hf.causal_lm import IGNORED_KEYS as TEXT_IGNORED
from models.hf.causal_lm import decoder_name_map
from models.hf.io import CheckpointError, ModelAdapter, NameMap, TensorMap
from models.hf.siglip import transpose
from models.hf.whisper import whisper_config_from_hf, whisper_config_to_hf, whisper_name_map
from models.qwen2_audio import Qwen2Audio, Qwen2AudioConfig

TEXT_FAMILIES = {"qwen2": qwen2, "llama": llama}


@dataclasses.dataclass(frozen=True)
class KeyLayout:
    """HF key prefixes of one checkpoint layout."""

    audio: str
    projector: str
    text_body: str
    text_head: str


LAYOUT_SAVED = KeyLayout(
    "audio_tower.",
    "multi_modal_projector.",
    "language_model.model.",
    "language_model.lm_head.weight",
)
LAYOUT_MODULE = KeyLayout(
    "model.audio_tower.", "model.multi_modal_projector.", "model.language_model.", "lm_head.weight"
)


def detect_layout(keys: list[str]) -> KeyLayout:
    """`LAYOUT_MODULE` when the checkpoint's keys use it, else `LAYOUT_SAVED`."""
    module = any(k.startswith(LAYOUT_MODULE.audio) for k in keys)
    return LAYOUT_MODULE if module else LAYOUT_SAVED


def config_from_hf(hf: dict, dtype: str, param_dtype: str) -> Qwen2AudioConfig:
    """`Qwen2AudioConfig` from an HF config.json dict."""
    text_d = dict(hf["text_config"])
    text_type = text_d.get("model_type", "qwen2")
    if text_type not in TEXT_FAMILIES:
        raise CheckpointError(
            f"Qwen2-Audio text model_type={text_type!r}; use one of {sorted(TEXT_FAMILIES)}"
        )
    text_d["tie_word_embeddings"] = hf.get("tie_word_embeddings", False) or text_d.get(
        "tie_word_embeddings", False
    )
    audio = whisper_config_from_hf(hf["audio_config"], pool=2, dtype=dtype, param_dtype=param_dtype)
    return Qwen2AudioConfig(
        audio=audio,
        text=TEXT_FAMILIES[text_type].config_from_hf(text_d, dtype, param_dtype),
        audio_token_id=hf.get("audio_token_index", hf.get("audio_token_id", 151646)),
    )


def config_to_hf(cfg: Qwen2AudioConfig) -> dict:
    """config.json of `cfg`."""
    text = (qwen2 if cfg.text.qkv_bias else llama).config_to_hf(cfg.text)
    return {
        "architectures": ["Qwen2AudioForConditionalGeneration"],
        "model_type": "qwen2_audio",
        "audio_config": whisper_config_to_hf(cfg.audio, "qwen2_audio_encoder"),
        "text_config": text,
        "audio_token_index": cfg.audio_token_id,
        "tie_word_embeddings": cfg.text.tie_embeddings,
    }


def encoder_name_map(
    cfg: Qwen2AudioConfig, layout: KeyLayout, *, prefix: tuple = (), **flags
) -> NameMap:
    """An `AudioEncoderStage` (Whisper layers, + projector on the head stage) at state path `prefix`."""
    out = whisper_name_map(cfg.audio, prefix=(*prefix, "audio"), hf_prefix=layout.audio, **flags)
    if flags["has_head"]:
        out[(*prefix, "projector", "kernel")] = TensorMap(
            f"{layout.projector}linear.weight", **transpose()
        )
        out[(*prefix, "projector", "bias")] = TensorMap(f"{layout.projector}linear.bias")
    return out


def llm_name_map(cfg: Qwen2AudioConfig, layout: KeyLayout, *, prefix: tuple = (), **flags):
    """An `LLMStage` (decoder layers) at state path `prefix`."""
    return decoder_name_map(
        cfg.text, prefix=(*prefix, "decoder"), hf_body=layout.text_body, hf_head=layout.text_head,
        **flags,
    )  # fmt: skip


def name_map(cfg: Qwen2AudioConfig, layout: KeyLayout = LAYOUT_SAVED) -> NameMap:
    """Every parameter of `Qwen2Audio(cfg)` with its HF key in `layout`."""
    whole = dict(first_layer=0, has_embedding=True, has_head=True)
    return {
        **encoder_name_map(cfg, layout, prefix=("encoder",), num_layers=cfg.audio.num_layers, **whole),
        **llm_name_map(cfg, layout, prefix=("llm",), num_layers=cfg.text.num_layers, **whole),
    }  # fmt: skip


def stage_name_map(cfg: Qwen2AudioConfig, keys: list[str], module: str, **flags) -> NameMap:
    """One stage's name map, in the key layout the checkpoint uses."""
    stage_map = encoder_name_map if module == "encoder" else llm_name_map
    return stage_map(cfg, detect_layout(keys), **flags)


ADAPTER = ModelAdapter(
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    build=lambda cfg, rngs: Qwen2Audio(cfg, rngs=rngs),
    name_map=name_map,
    matches=lambda cfg: isinstance(cfg, Qwen2AudioConfig),
    # A tied model's checkpoint may still hold the head it never reads (an untied one needs it).
    ignored_keys=(*TEXT_IGNORED, "lm_head.weight"),
    stage_name_map=stage_name_map,
    checkpoint_name_map=lambda cfg, keys: name_map(cfg, detect_layout(keys)),
)
