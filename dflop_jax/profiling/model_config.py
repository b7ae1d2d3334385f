"""The `models/` config of a named architecture, so `profile model --arch tiny` profiles a real model.

Only LLaVA-style models (a ViT without class token or pixel shuffle + `mlp2x_gelu` projector + decoder)
map to a `models.llava_onevision.LlavaOnevisionConfig` here; InternVL-style archs need their own mapping.
"""

from __future__ import annotations

from dflop_jax.costs import MLLMArch, arch_from_configs, get_arch


def model_config_for_arch(arch: MLLMArch | str, compute_dtype: str = "bfloat16"):
    """A `LlavaOnevisionConfig` with the sizes of `arch` (random weights; fp32 params).

    Raises:
      ValueError: the architecture is not LLaVA-style.
    """
    from models.decoder_config import DecoderConfig
    from models.llava_onevision import LlavaOnevisionConfig
    from models.vit import ViTConfig

    arch = get_arch(arch) if isinstance(arch, str) else arch
    v, m = arch.vision, arch.llm
    if v.pixel_shuffle or v.class_token or arch.projector.kind != "mlp2x_gelu":
        raise ValueError(
            f"arch {arch.name!r} is InternVL-style (pixel shuffle / class token); the profiler maps "
            "only LLaVA-style archs to models/ configs: use e.g. 'tiny' or 'siglip-so400m+...'"
        )
    vision = ViTConfig(
        hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, num_layers=v.num_layers,
        num_heads=v.num_heads, image_size=v.image_size, patch_size=v.patch_size,
        norm=v.norm, qkv_bias=v.qkv_bias, qk_norm=v.qk_norm, layer_scale=v.layer_scale,
        post_norm=False, dtype=compute_dtype,
    )  # fmt: skip
    text = DecoderConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
        head_dim=m.dh, qkv_bias=m.qkv_bias, tie_embeddings=m.tie_embeddings, dtype=compute_dtype,
    )  # fmt: skip
    return LlavaOnevisionConfig(vision=vision, text=text)


def arch_for_model_config(model_cfg, name: str = "custom"):
    """The cost-model `MLLMArch` of a `models` MLLM config (inverse of `model_config_for_arch`)."""
    return arch_from_configs(model_cfg.vision, model_cfg.text, model_cfg.tokens_per_tile, name)
