"""InternVL (2.5 / 3 "-hf" layout): InternViT encoder + pixel shuffle 0.5 + LayerNorm/MLP projector +
Qwen2 / Llama decoder, as pipeline stages (`models.mllm`).

Each 448 px tile gives 32 x 32 patches; the CLS token is dropped ("default" strategy), the grid is
pixel-shuffled to 16 x 16 = 256 tokens of 4 * D_vision channels, normalized and projected. Tiles of an
image (`models.layouts.internvl_image_layout`: grid row-major, thumbnail last) fill 256 placeholder
tokens each; no newline tokens. `vision_feature_layer == -1` reads the last hidden state after the
final layernorm (an identity when HF `use_mean_pooling`), another k reads `hidden_states[k]`.
"""

from __future__ import annotations

import dataclasses

from models.decoder_config import DecoderConfig
from models.internvit import InternViTConfig
from models.mllm import MLLM, EncoderStage, LLMStage, extract_stages
from models.siglip import feature_layer_config
from models.vit import ViTConfig

__all__ = [
    "EncoderStage",
    "InternVL",
    "InternVLConfig",
    "LLMStage",
    "extract_stages",
    "internvl_config",
]


@dataclasses.dataclass(frozen=True)
class InternVLConfig:
    """InternVL shapes. `vision` holds only the encoder layers the feature layer needs."""

    vision: ViTConfig
    text: DecoderConfig
    image_token_id: int = 151667
    downsample_ratio: float = 0.5
    projector_act: str = "gelu"
    projector_norm_eps: float = 1e-5  # torch nn.LayerNorm default, as HF's projector uses it

    def __post_init__(self):
        if not self.vision.cls_token:
            raise ValueError(
                "InternVLConfig.vision must be an InternViT with a CLS token (cls_token=True)"
            )
        side = self.vision.patches_per_side * self.downsample_ratio
        if side != int(side) or self.downsample_ratio <= 0:
            raise ValueError(
                f"InternVLConfig.downsample_ratio={self.downsample_ratio} must divide the "
                f"{self.vision.patches_per_side}-patch grid evenly (InternVL uses 0.5)"
            )

    @property
    def tokens_per_tile(self) -> int:
        return int(self.vision.patches_per_side * self.downsample_ratio) ** 2

    @property
    def projector_in(self) -> int:
        return self.vision.hidden_size * int(round(1 / self.downsample_ratio)) ** 2

    @property
    def shuffle_ratio(self) -> float:
        return self.downsample_ratio

    drop_cls = True
    projector_bias = True
    has_newline = False
    pool_video = False


def internvl_config(
    vision: InternViTConfig, text: DecoderConfig, *, vision_feature_layer: int = -1, **kwargs
) -> InternVLConfig:
    """Config from a full InternViT config and HF's `vision_feature_layer`."""
    if vision_feature_layer != -1:
        vision = feature_layer_config(vision, vision_feature_layer)
    return InternVLConfig(vision=vision, text=text, **kwargs)


class InternVL(MLLM):
    """The unsplit InternVL model; see `models.mllm.MLLM` for the call signature."""
