"""HF InternVL checkpoints <-> ours: the InternViT tower (`model_type: internvl_vision`,
`InternVLVisionModel`) and the whole model (`model_type: internvl`, `InternVLForConditionalGeneration`:
InternViT + pixel-shuffle projector + Qwen2 / Llama decoder), adapters for `models.hf.load_pretrained`.

HF vision keys (prefix "" in a vision-only save, "vision_tower." in the full model):
  embeddings.cls_token [1,1,D], embeddings.position_embeddings [1,N+1,D],
  embeddings.patch_embeddings.projection.{weight,bias}, encoder.layer.{i}.attention.{q,k,v}_proj
  (+bias if attention_bias; stacked into our fused qkv_kernel / qkv_bias), .projection_layer, .q_norm/.k_norm (use_qk_norm), lambda_1/lambda_2,
  layernorm_before/after, mlp.fc1/fc2; layernorm (only when use_mean_pooling is False).
Full model: multi_modal_projector.{layer_norm,linear_1,linear_2}, language_model.model.* (decoder),
lm_head.weight (absent when tied) — the layout transformers 5 `save_pretrained` writes.
"""

from __future__ import annotations

from collections.abc import Mapping

from models.hf import llama, qwen2
from models.hf.causal_lm import decoder_name_map
from models.hf.io import CheckpointError, ModelAdapter, NameMap, TensorMap
from models.hf.siglip import (
    IGNORED_KEYS,
    fused_qkv,
    heads_vec,
    linear_out,
    patch_conv,
    transpose,
)
from models.internvit import InternViTConfig
from models.internvl import InternVL, InternVLConfig, internvl_config
from models.vit import VisionTower, ViTConfig

_TEXT_ADAPTERS = {"qwen2": qwen2, "llama": llama}


def internvit_config_from_hf(d: Mapping, **overrides) -> InternViTConfig:
    """`InternVLVisionConfig` dict -> `InternViTConfig`."""
    acts = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}
    act = d.get("hidden_act", "gelu")
    if act not in acts:
        raise CheckpointError(
            f"InternViT hidden_act={act!r} is not supported; use one of {sorted(acts)}"
        )
    if not d.get("use_absolute_position_embeddings", True) or d.get("use_mask_token", False):
        raise CheckpointError(
            "InternViT without absolute position embeddings or with a mask token is not supported"
        )
    image, patch = d.get("image_size", 448), d.get("patch_size", 14)
    return InternViTConfig(
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=d["num_attention_heads"],
        image_size=image[0] if isinstance(image, (list, tuple)) else image,
        patch_size=patch[0] if isinstance(patch, (list, tuple)) else patch,
        num_channels=d.get("num_channels", 3),
        norm=d.get("norm_type", "layer_norm"),
        norm_eps=d.get("layer_norm_eps", 1e-6),
        act=acts[act],
        qkv_bias=d.get("attention_bias", False),
        qk_norm=d.get("use_qk_norm", False),
        post_norm=not d.get("use_mean_pooling", True),
        **overrides,
    )


def internvit_config_to_hf(cfg: ViTConfig) -> dict:
    return {
        "model_type": "internvl_vision",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "image_size": [cfg.image_size, cfg.image_size],
        "patch_size": [cfg.patch_size, cfg.patch_size],
        "num_channels": cfg.num_channels,
        "norm_type": cfg.norm,
        "layer_norm_eps": cfg.norm_eps,
        "hidden_act": {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[cfg.act],
        "attention_bias": cfg.qkv_bias,
        "use_qk_norm": cfg.qk_norm,
        "use_mean_pooling": not cfg.post_norm,
    }


def internvit_name_map(
    cfg: ViTConfig,
    *,
    first_layer: int = 0,
    num_layers: int | None = None,
    has_embedding: bool = True,
    has_head: bool = True,
    prefix: tuple = ("stage",),
    hf_prefix: str = "",
) -> NameMap:
    """Name map of an InternViT `VisionStage` at state path `prefix`."""
    num_layers = cfg.num_layers - first_layer if num_layers is None else num_layers
    d, h, dh = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    e = f"{hf_prefix}embeddings."
    out: NameMap = {}
    if has_embedding:
        out[(*prefix, "patch_kernel")] = TensorMap(
            f"{e}patch_embeddings.projection.weight", **patch_conv(cfg)
        )
        out[(*prefix, "patch_bias")] = TensorMap(f"{e}patch_embeddings.projection.bias")
        out[(*prefix, "pos_embed")] = TensorMap(
            f"{e}position_embeddings", to_ours=lambda x: x[0], to_hf=lambda x: x[None]
        )
        out[(*prefix, "cls")] = TensorMap(
            f"{e}cls_token", to_ours=lambda x: x[0, 0], to_hf=lambda x: x[None, None]
        )
    for i in range(num_layers):
        k, p = f"{hf_prefix}encoder.layer.{first_layer + i}.", (*prefix, "layers", i)
        qkv, qkv_bias = fused_qkv(f"{k}attention.{{}}_proj", d, h, dh)
        out[(*p, "attn", "qkv_kernel")] = qkv
        if cfg.qkv_bias:
            out[(*p, "attn", "qkv_bias")] = qkv_bias
        if cfg.qk_norm:
            out[(*p, "attn", "q_norm")] = TensorMap(
                f"{k}attention.q_norm.weight", **heads_vec(h, dh)
            )
            out[(*p, "attn", "k_norm")] = TensorMap(
                f"{k}attention.k_norm.weight", **heads_vec(h, dh)
            )
        out[(*p, "attn", "o_kernel")] = TensorMap(
            f"{k}attention.projection_layer.weight", **linear_out(d, h, dh)
        )
        out[(*p, "attn", "o_bias")] = TensorMap(f"{k}attention.projection_layer.bias")
        out[(*p, "ls1")] = TensorMap(f"{k}lambda_1")
        out[(*p, "ls2")] = TensorMap(f"{k}lambda_2")
        for j in (1, 2):
            out[(*p, "mlp", f"fc{j}")] = TensorMap(f"{k}mlp.fc{j}.weight", **transpose())
            out[(*p, "mlp", f"fc{j}_bias")] = TensorMap(f"{k}mlp.fc{j}.bias")
        for hf_name, ours in (("layernorm_before", "norm1"), ("layernorm_after", "norm2")):
            out[(*p, ours, "scale")] = TensorMap(f"{k}{hf_name}.weight")
            if cfg.norm == "layer_norm":
                out[(*p, ours, "bias")] = TensorMap(f"{k}{hf_name}.bias")
    if has_head and cfg.post_norm:
        out[(*prefix, "post_norm", "scale")] = TensorMap(f"{hf_prefix}layernorm.weight")
        if cfg.norm == "layer_norm":
            out[(*prefix, "post_norm", "bias")] = TensorMap(f"{hf_prefix}layernorm.bias")
    return out


def _text_module(d: Mapping):
    kind = d.get("model_type", "qwen2")
    if kind not in _TEXT_ADAPTERS:
        raise CheckpointError(
            f"InternVL text model_type={kind!r} is not supported; use one of {sorted(_TEXT_ADAPTERS)}"
        )
    return _TEXT_ADAPTERS[kind]


def config_from_hf(hf: dict, dtype: str, param_dtype: str) -> InternVLConfig:
    """`InternVLConfig` from an HF InternVL config.json dict."""
    if hf.get("vision_feature_select_strategy", "default") != "default":
        raise CheckpointError(
            "InternVL vision_feature_select_strategy must be 'default' (drop CLS)"
        )
    layer = hf.get("vision_feature_layer", -1)
    if not isinstance(layer, int):
        raise CheckpointError(
            f"InternVL vision_feature_layer={layer!r}: only a single int layer is supported"
        )
    vision = internvit_config_from_hf(hf["vision_config"], dtype=dtype, param_dtype=param_dtype)
    text_d = dict(hf["text_config"])
    text_d["tie_word_embeddings"] = hf.get(
        "tie_word_embeddings", text_d.get("tie_word_embeddings", True)
    )
    text = _text_module(text_d).config_from_hf(text_d, dtype, param_dtype)
    if hf.get("projector_hidden_act", "gelu") != "gelu":
        raise CheckpointError(
            f"InternVL projector_hidden_act={hf['projector_hidden_act']!r}; only 'gelu'"
        )
    return internvl_config(
        vision,
        text,
        vision_feature_layer=layer,
        image_token_id=hf.get("image_token_id", 151667),
        downsample_ratio=hf.get("downsample_ratio", 0.5),
    )


def config_to_hf(cfg: InternVLConfig) -> dict:
    text_type = "qwen2" if cfg.text.qkv_bias else "llama"
    return {
        "architectures": ["InternVLForConditionalGeneration"],
        "model_type": "internvl",
        "vision_config": internvit_config_to_hf(cfg.vision),
        "text_config": _TEXT_ADAPTERS[text_type].config_to_hf(cfg.text),
        "image_token_id": cfg.image_token_id,
        "downsample_ratio": cfg.downsample_ratio,
        "projector_hidden_act": "gelu",
        # our vision config holds exactly the layers read, post-normed only if HF normalizes them
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default",
        "tie_word_embeddings": cfg.text.tie_embeddings,
    }


def encoder_name_map(cfg: InternVLConfig, *, prefix: tuple = (), **flags) -> NameMap:
    """An `EncoderStage` (InternViT layers, + projector on the head stage) at state path `prefix`."""
    out = internvit_name_map(
        cfg.vision, prefix=(*prefix, "vision"), hf_prefix="vision_tower.", **flags
    )
    if flags["has_head"]:
        proj, hf = (*prefix, "projector"), "multi_modal_projector."
        out[(*proj, "norm", "scale")] = TensorMap(f"{hf}layer_norm.weight")
        out[(*proj, "norm", "bias")] = TensorMap(f"{hf}layer_norm.bias")
        for j in (1, 2):
            out[(*proj, f"linear_{j}")] = TensorMap(f"{hf}linear_{j}.weight", **transpose())
            out[(*proj, f"bias_{j}")] = TensorMap(f"{hf}linear_{j}.bias")
    return out


def llm_name_map(cfg: InternVLConfig, *, prefix: tuple = (), **flags) -> NameMap:
    """An `LLMStage` (decoder layers; InternVL has no image newline) at state path `prefix`."""
    return decoder_name_map(
        cfg.text, prefix=(*prefix, "decoder"), hf_body="language_model.model.",
        hf_head="lm_head.weight", **flags,
    )  # fmt: skip


def name_map(cfg: InternVLConfig) -> NameMap:
    whole = dict(first_layer=0, has_embedding=True, has_head=True)
    return {
        **encoder_name_map(cfg, prefix=("encoder",), num_layers=cfg.vision.num_layers, **whole),
        **llm_name_map(cfg, prefix=("llm",), num_layers=cfg.text.num_layers, **whole),
    }


def stage_name_map(cfg: InternVLConfig, keys: list[str], module: str, **flags) -> NameMap:
    return (encoder_name_map if module == "encoder" else llm_name_map)(cfg, **flags)


def _build_vision(cfg, rngs):
    return VisionTower(cfg, rngs=rngs)


VISION_ADAPTER = ModelAdapter(
    config_from_hf=lambda hf, dtype, param_dtype: internvit_config_from_hf(
        hf, dtype=dtype, param_dtype=param_dtype
    ),
    config_to_hf=internvit_config_to_hf,
    build=_build_vision,
    name_map=lambda cfg: internvit_name_map(cfg),
    matches=lambda cfg: isinstance(cfg, InternViTConfig),
    ignored_keys=("rotary_emb.inv_freq",),
)

ADAPTER = ModelAdapter(
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    build=lambda cfg, rngs: InternVL(cfg, rngs=rngs),
    name_map=name_map,
    matches=lambda cfg: isinstance(cfg, InternVLConfig),
    ignored_keys=IGNORED_KEYS,
    stage_name_map=stage_name_map,
)

__all__ = ["ADAPTER", "VISION_ADAPTER", "internvit_config_from_hf", "internvit_name_map"]
