"""The `models/` config of a named architecture: `model: NAME` in a run config, `model.arch=NAME`.

LLaVA-style archs (a ViT without class token or pixel shuffle + `mlp2x_gelu` projector + decoder) map to
`models.llava_onevision.LlavaOnevisionConfig`; InternVL-style archs (class token, pixel shuffle 0.5,
LayerNorm + MLP projector) to `models.internvl.InternVLConfig`. Weights are random: only shapes matter.
"""

from __future__ import annotations

from dflop_jax.costs import MLLMArch, arch_from_configs, get_arch


def model_config_for_arch(arch: MLLMArch | str, compute_dtype: str = "bfloat16"):
    """A `LlavaOnevisionConfig` or `InternVLConfig` with the sizes of `arch` (fp32 params).

    Raises:
      ValueError: the architecture mixes the two families (e.g. pixel shuffle without a class token).
    """
    from models.decoder_config import DecoderConfig

    arch = get_arch(arch) if isinstance(arch, str) else arch
    v, m = arch.vision, arch.llm
    text = DecoderConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
        head_dim=m.dh, qkv_bias=m.qkv_bias, tie_embeddings=m.tie_embeddings, dtype=compute_dtype,
    )  # fmt: skip
    vision = dict(
        hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, num_layers=v.num_layers,
        num_heads=v.num_heads, image_size=v.image_size, patch_size=v.patch_size,
        norm=v.norm, qkv_bias=v.qkv_bias, qk_norm=v.qk_norm, layer_scale=v.layer_scale,
        post_norm=False, dtype=compute_dtype,
    )  # fmt: skip
    if v.pixel_shuffle and v.class_token and arch.projector.kind != "mlp2x_gelu":
        return _internvl(arch, vision, text)
    if v.pixel_shuffle or v.class_token or arch.projector.kind != "mlp2x_gelu":
        raise ValueError(
            f"arch {arch.name!r}: the profiler builds LLaVA-style models (no class token, no pixel "
            "shuffle, mlp2x_gelu projector) or InternVL-style ones (class token + pixel shuffle + "
            f"InternVL projector); this one has class_token={v.class_token}, pixel_shuffle="
            f"{v.pixel_shuffle}, projector={arch.projector.kind!r}"
        )
    from models.llava_onevision import LlavaOnevisionConfig
    from models.vit import ViTConfig

    return LlavaOnevisionConfig(vision=ViTConfig(**vision), text=text)


def _internvl(arch: MLLMArch, vision: dict, text):
    from models.internvit import InternViTConfig
    from models.internvl import InternVLConfig

    cfg = InternVLConfig(vision=InternViTConfig(**vision, cls_token=True), text=text)
    if cfg.tokens_per_tile != arch.vision.tokens_per_tile:
        raise ValueError(
            f"arch {arch.name!r}: {arch.vision.tokens_per_tile} tokens per tile, but pixel shuffle "
            f"0.5 of a {cfg.vision.patches_per_side}-patch grid gives {cfg.tokens_per_tile}"
        )
    return cfg


def arch_for_model_config(model_cfg, name: str = "custom"):
    """The cost-model `MLLMArch` of a `models` MLLM config (inverse of `model_config_for_arch`)."""
    return arch_from_configs(model_cfg.vision, model_cfg.text, model_cfg.tokens_per_tile, name)
