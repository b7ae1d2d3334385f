"""LLaVA-OneVision: SigLIP encoder + mlp2x_gelu projector + Qwen2 decoder, as pipeline stages.

Build: `LlavaOnevision(cfg, rngs=...)` is the unsplit model (`models.mllm.MLLM`);
`models.mllm.extract_stages(model, encoder_layers, llm_layers)` cuts it into stages.
Call: `model(tiles, tile_pool, tokens, segment_ids, positions, feature_index) -> logits`, with tiles cut
and `feature_index` built from `models/layouts.py` (anyres base tile first, unpadding, image newline
per row, anyres_max downscaling as bilinear taps, one tile + newline per image of a multi-image
sample, video frames pooled 2x2 with one final newline). Video frames are flagged in `tile_pool`.

HF semantics kept: `vision_feature_layer` selects HF `hidden_states[layer]` (pre post-layernorm; the
encoder holds only the layers it needs), strategy "full" (SigLIP has no CLS token), projector GELU
(exact) with biases, `image_newline` [D].
"""

from __future__ import annotations

import dataclasses

from models.decoder_config import DecoderConfig
from models.layouts import LLAVA_OV_PINPOINTS, parse_anyres_max
from models.mllm import MLLM, EncoderStage, LLMStage, extract_stages
from models.siglip import SiglipConfig, feature_layer_config
from models.vit import ViTConfig

__all__ = [
    "EncoderStage",
    "LLMStage",
    "LlavaOnevision",
    "LlavaOnevisionConfig",
    "extract_stages",
    "llava_onevision_config",
]


@dataclasses.dataclass(frozen=True)
class LlavaOnevisionConfig:
    """LLaVA-OneVision shapes. `vision` holds only the encoder layers the feature layer needs."""

    vision: ViTConfig
    text: DecoderConfig
    image_token_id: int = 151646
    video_token_id: int = 151647
    projector_bias: bool = True
    projector_act: str = "gelu"
    pinpoints: tuple[tuple[int, int], ...] = LLAVA_OV_PINPOINTS
    vision_aspect_ratio: str = "anyres_max_9"

    def __post_init__(self):
        if self.vision.post_norm or self.vision.cls_token:
            raise ValueError(
                "LlavaOnevisionConfig.vision must read a pre-norm hidden state without CLS token; "
                "build it with models.siglip.feature_layer_config(siglip_cfg, vision_feature_layer)"
            )
        if self.projector_act not in ("gelu", "gelu_tanh"):
            raise ValueError(
                f"LlavaOnevisionConfig.projector_act={self.projector_act!r}; use 'gelu' or 'gelu_tanh'"
            )
        parse_anyres_max(self.vision_aspect_ratio)

    # --- what models.mllm reads ---
    @property
    def tokens_per_tile(self) -> int:
        return self.vision.num_patches

    drop_cls = False
    shuffle_ratio = None
    projector_norm_eps = None
    has_newline = True
    pool_video = True

    @property
    def projector_in(self) -> int:
        return self.vision.hidden_size


def llava_onevision_config(
    vision: SiglipConfig, text: DecoderConfig, *, vision_feature_layer: int = -1, **kwargs
) -> LlavaOnevisionConfig:
    """Config from a full SigLIP config and HF's `vision_feature_layer` (-1: last layer, pre-norm)."""
    return LlavaOnevisionConfig(
        vision=feature_layer_config(vision, vision_feature_layer), text=text, **kwargs
    )


class LlavaOnevision(MLLM):
    """The unsplit LLaVA-OneVision model; see `models.mllm.MLLM` for the call signature."""
