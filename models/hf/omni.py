"""The omni model (`models.omni`) from and to HF checkpoints: one LLaVA-OneVision checkpoint and one
Qwen2-Audio checkpoint.

    model, cfg = load_omni("llava-onevision-qwen2-7b-ov-hf", "Qwen2-Audio-7B")
    save_omni(model, cfg, "out")   # out/vision: LLaVA-OneVision, out/audio: Qwen2-Audio

No HF class holds both encoders, so the export writes each part where its own class reads it:
`vision/` is a LLaVA-OneVision checkpoint (vision tower, projector, image newline, decoder) and
`audio/` a Qwen2-Audio checkpoint (audio tower, projector, and the same decoder, which
`Qwen2AudioForConditionalGeneration` needs to load). The decoder is written twice; each directory
loads alone in transformers and gives the omni model's logits on prompts of its modality.
Only the audio tower and projector of the Qwen2-Audio checkpoint are read (its LLM is not: the
decoder is the vision checkpoint's).
"""

from __future__ import annotations

import json
from pathlib import Path

from flax import nnx

from models.hf import llava_onevision as hf_llava_ov
from models.hf import qwen2_audio as hf_qwen2_audio
from models.hf.io import CheckpointError, export_tensors, write_safetensors
from models.llava_onevision import LlavaOnevisionConfig
from models.omni import Omni, OmniConfig
from models.qwen2_audio import Qwen2AudioConfig

VISION_DIR, AUDIO_DIR = "vision", "audio"
_WHOLE = dict(first_layer=0, has_embedding=True, has_head=True)


def load_omni(
    vision_dir: str | Path,
    audio_dir: str | Path,
    *,
    dtype: str | None = None,
    param_dtype: str | None = None,
) -> tuple[Omni, OmniConfig]:
    """The omni model of a LLaVA-OneVision checkpoint (vision tower, projector, decoder) and a
    Qwen2-Audio checkpoint (audio tower and projector), and its config."""
    from models.hf import load_config, load_pretrained, load_stage

    kw = dict(dtype=dtype or "float32", param_dtype=param_dtype or "float32")
    vision_cfg = load_config(vision_dir, **kw)
    audio_cfg = load_config(audio_dir, **kw)
    _check_kind(vision_dir, vision_cfg, LlavaOnevisionConfig, "LLaVA-OneVision")
    _check_kind(audio_dir, audio_cfg, Qwen2AudioConfig, "Qwen2-Audio")
    try:
        cfg = OmniConfig.compose(vision_cfg, audio_cfg)
    except ValueError as e:
        raise CheckpointError(f"{audio_dir}: {e}") from None
    vision, _ = load_pretrained(vision_dir, **kw)
    audio = load_stage(audio_dir, audio_cfg, "encoder", num_layers=audio_cfg.audio.num_layers,
                       **_WHOLE)  # fmt: skip
    audio.cfg = cfg.audio
    model = nnx.eval_shape(lambda: Omni(cfg, rngs=nnx.Rngs(0)))  # shapes only: the parts replace it
    model.encoder, model.audio, model.llm = vision.encoder, audio, vision.llm
    return model, cfg


def save_omni(model: Omni, cfg: OmniConfig, path: str | Path) -> list[Path]:
    """Writes `path/vision` (LLaVA-OneVision) and `path/audio` (Qwen2-Audio); returns the files."""
    path = Path(path)
    vision, audio = path / VISION_DIR, path / AUDIO_DIR
    n_text = cfg.text.num_layers
    vision_tensors = {
        **dict(export_tensors(model.encoder, hf_llava_ov.encoder_name_map(
            cfg.llava, hf_llava_ov.LAYOUT_SAVED, num_layers=cfg.vision.num_layers,
            **_WHOLE))),
        **dict(export_tensors(model.llm, hf_llava_ov.llm_name_map(
            cfg.llava, hf_llava_ov.LAYOUT_SAVED, num_layers=n_text, **_WHOLE))),
    }  # fmt: skip
    audio_tensors = {
        **dict(export_tensors(model.audio, hf_qwen2_audio.encoder_name_map(
            cfg.audio, hf_qwen2_audio.LAYOUT_SAVED, num_layers=cfg.audio.audio.num_layers,
            **_WHOLE))),
        # Qwen2-Audio's decoder has no image newline: the one tensor of `llm` it does not hold.
        **dict(export_tensors(model.llm, hf_qwen2_audio.llm_name_map(
            cfg.audio, hf_qwen2_audio.LAYOUT_SAVED, num_layers=n_text, **_WHOLE),
            ignore={("image_newline",)})),
    }  # fmt: skip
    files = []
    for folder, config, tensors in (
        (vision, hf_llava_ov.config_to_hf(cfg.llava), vision_tensors),
        (audio, hf_qwen2_audio.config_to_hf(cfg.audio), audio_tensors),
    ):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        files += [folder / "config.json", *write_safetensors(tensors, folder)]
    return files


def _check_kind(path, cfg, kind: type, name: str) -> None:
    if not isinstance(cfg, kind):
        raise CheckpointError(
            f"{path}: a {type(cfg).__name__} checkpoint; the omni model needs a {name} one here"
        )
