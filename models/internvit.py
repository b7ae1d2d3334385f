"""InternViT (HF `InternVLVisionModel`): CLS token + learned positions, pre-norm blocks (LayerNorm or
RMSNorm), optional qk RMSNorm over all heads (InternViT-6B), per-channel layer scale, exact-GELU MLP.

Built from the shared pre-norm ViT of `models/vit.py` (`VisionStage` for any layer range). InternVL
reads `last_hidden_state` (after the final layernorm, an identity when `use_mean_pooling`) for
`vision_feature_layer == -1`, else `hidden_states[layer]`, then drops the CLS token ("default").
"""

from __future__ import annotations

import dataclasses

from models.vit import VisionStage, VisionTower, ViTConfig

__all__ = ["INTERNVIT_PRESETS", "InternViTConfig", "VisionStage", "VisionTower"]


@dataclasses.dataclass(frozen=True)
class InternViTConfig(ViTConfig):
    """InternViT shapes (defaults: InternViT-300M-448px, as InternVL2.5/3 small models use it)."""

    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_layers: int = 24
    num_heads: int = 16
    image_size: int = 448
    patch_size: int = 14
    norm: str = "layer_norm"
    norm_eps: float = 1e-6
    act: str = "gelu"
    qkv_bias: bool = True
    qk_norm: bool = False
    layer_scale: bool = True
    cls_token: bool = True
    post_norm: bool = False
    pixel_mean: tuple[float, float, float] = (
        0.485,
        0.456,
        0.406,
    )  # ImageNet, as InternVL's processor
    pixel_std: tuple[float, float, float] = (0.229, 0.224, 0.225)


INTERNVIT_PRESETS: dict[str, InternViTConfig] = {
    # OpenGVLab/InternViT-300M-448px-V2_5.
    "internvit-300m": InternViTConfig(dtype="bfloat16"),
    # OpenGVLab/InternViT-6B-448px-V2_5: RMSNorm, qk-norm, no qkv bias.
    "internvit-6b": InternViTConfig(
        hidden_size=3200,
        intermediate_size=12800,
        num_layers=45,
        num_heads=25,
        norm="rms_norm",
        qkv_bias=False,
        qk_norm=True,
        dtype="bfloat16",
    ),
}
