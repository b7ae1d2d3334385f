"""SigLIP vision tower (HF `SiglipVisionModel`): conv patch embedding as a matmul, learned position
embedding, pre-norm LayerNorm blocks with a GELU(tanh) MLP, post layernorm.

The module is the shared pre-norm ViT of `models/vit.py` (`VisionStage` for any layer range,
`VisionTower` for the whole encoder); this file holds the SigLIP configuration and named real shapes.
HF `vision_feature_layer` semantics (LLaVA-OV reads `hidden_states[layer]`, the output of a layer
*before* `post_layernorm`): `feature_layer_config` builds only the layers up to the selected hidden
state and drops the post-norm. The attention-pooling head (`vision_use_head`) is not built: MLLMs read
patch features, never the pooled vector.
"""

from __future__ import annotations

import dataclasses

from models.vit import VisionStage, VisionTower, ViTConfig

__all__ = ["SIGLIP_PRESETS", "SiglipConfig", "VisionStage", "VisionTower", "feature_layer_config"]


@dataclasses.dataclass(frozen=True)
class SiglipConfig(ViTConfig):
    """SigLIP vision shapes (defaults: SigLIP-SO400M/14 at 384 px, as LLaVA-OneVision uses it)."""

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_layers: int = 27
    num_heads: int = 16
    image_size: int = 384
    patch_size: int = 14
    norm: str = "layer_norm"
    norm_eps: float = 1e-6
    act: str = "gelu_tanh"
    qkv_bias: bool = True
    qk_norm: bool = False
    layer_scale: bool = False
    cls_token: bool = False
    post_norm: bool = True


def feature_layer_config(cfg: ViTConfig, feature_layer: int) -> ViTConfig:
    """The encoder that computes HF `hidden_states[feature_layer]` of `cfg` (0 = embeddings).

    Negative values count from the end as in Python (-1 = after the last layer, still without the
    post-norm). Returns a config with `num_layers` = the layers needed and `post_norm=False`.
    """
    used = feature_layer if feature_layer >= 0 else cfg.num_layers + 1 + feature_layer
    if not 0 <= used <= cfg.num_layers:
        raise ValueError(
            f"vision_feature_layer={feature_layer} is outside the encoder's hidden states "
            f"(0..{cfg.num_layers} or -{cfg.num_layers + 1}..-1); pick a layer index inside it"
        )
    return cfg.replace(num_layers=used, post_norm=False)


SIGLIP_PRESETS: dict[str, SiglipConfig] = {
    # google/siglip-so400m-patch14-384 vision tower (LLaVA-OneVision's encoder).
    "siglip-so400m": SiglipConfig(dtype="bfloat16"),
    # google/siglip-base-patch16-224 vision tower.
    "siglip-base": SiglipConfig(
        hidden_size=768,
        intermediate_size=3072,
        num_layers=12,
        num_heads=12,
        image_size=224,
        patch_size=16,
        dtype="bfloat16",
    ),
}
