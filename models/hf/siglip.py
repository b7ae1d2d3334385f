"""HF SigLIP vision weights <-> `models.vit.VisionStage` / `VisionTower`, and the `siglip_vision_model`
and `siglip` adapters of `models.hf.load_pretrained`.

Name maps follow `models/hf/io.py` (our state path -> `TensorMap(hf_key, to_ours, to_hf)`; the fused
q / k / v kernel and bias stack HF's three projections, `StackedMap`). The patch embedding is one
matmul: HF's conv kernel [D, C, P, P] maps to our [P*P*C, D] (`patch_conv`). Vision
keys are built with an HF prefix: "" for a transformers-5 `SiglipVisionModel` save, "vision_model."
for a full `SiglipModel` (google/siglip-*), "vision_tower." inside LLaVA-OneVision. A `siglip`
checkpoint's text tower, logit scale/bias and the vision pooling head are skipped (`IGNORED_KEYS`):
MLLMs read patch features only. Keys are skipped only when no parameter uses them.
"""

from __future__ import annotations

from collections.abc import Mapping

from models.hf.io import ModelAdapter, NameMap, StackedMap, TensorMap
from models.siglip import SiglipConfig
from models.vit import VisionTower, ViTConfig


def linear_in(d: int, h: int, dh: int) -> dict:
    """torch Linear [H*Dh, D] <-> ours [D, H, Dh]."""
    return dict(to_ours=lambda w: w.T.reshape(d, h, dh), to_hf=lambda w: w.reshape(d, h * dh).T)


def linear_out(d: int, h: int, dh: int) -> dict:
    """torch Linear [D, H*Dh] <-> ours [H, Dh, D]."""
    return dict(to_ours=lambda w: w.T.reshape(h, dh, d), to_hf=lambda w: w.reshape(h * dh, d).T)


def heads_vec(h: int, dh: int) -> dict:
    """[H*Dh] <-> [H, Dh]."""
    return dict(to_ours=lambda b: b.reshape(h, dh), to_hf=lambda b: b.reshape(h * dh))


def fused_qkv(keys: str, d: int, h: int, dh: int) -> tuple[StackedMap, StackedMap]:
    """HF's separate q / k / v projections <-> our fused `qkv_kernel` [D, 3, H, Dh] and `qkv_bias`
    [3, H, Dh]. `keys` holds "{}" where HF puts q / k / v (e.g. "l.0.self_attn.{}_proj")."""
    kernel = [TensorMap(f"{keys.format(n)}.weight", **linear_in(d, h, dh)) for n in "qkv"]
    bias = [TensorMap(f"{keys.format(n)}.bias", **heads_vec(h, dh)) for n in "qkv"]
    return StackedMap(tuple(kernel), axis=1), StackedMap(tuple(bias), axis=0)


def transpose() -> dict:
    return dict(to_ours=lambda w: w.T, to_hf=lambda w: w.T)


def patch_conv(cfg: ViTConfig) -> dict:
    """torch conv [D, C, P, P] <-> ours [P*P*C, D] (rows ordered py, px, c as `models.vit.patchify`)."""
    p, c, d = cfg.patch_size, cfg.num_channels, cfg.hidden_size
    return dict(
        to_ours=lambda w: w.transpose(2, 3, 1, 0).reshape(p * p * c, d),
        to_hf=lambda w: w.reshape(p, p, c, d).transpose(3, 2, 0, 1),
    )


def siglip_config_from_hf(d: Mapping, **overrides) -> SiglipConfig:
    """`SiglipVisionConfig` dict (config.json or its vision_config) -> `SiglipConfig`."""
    act = d.get("hidden_act", "gelu_pytorch_tanh")
    acts = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}
    if act not in acts:
        raise ValueError(f"SigLIP hidden_act={act!r} is not supported; use one of {sorted(acts)}")
    return SiglipConfig(
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=d["num_attention_heads"],
        image_size=d["image_size"],
        patch_size=d["patch_size"],
        num_channels=d.get("num_channels", 3),
        norm_eps=d.get("layer_norm_eps", 1e-6),
        act=acts[act],
        **overrides,
    )


def siglip_config_to_hf(cfg: ViTConfig) -> dict:
    """`SiglipVisionConfig` dict of `cfg` (the pooling head is not part of our model)."""
    return {
        "model_type": "siglip_vision_model",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "image_size": cfg.image_size,
        "patch_size": cfg.patch_size,
        "num_channels": cfg.num_channels,
        "layer_norm_eps": cfg.norm_eps,
        "hidden_act": {"gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}[cfg.act],
        "vision_use_head": False,
    }


def siglip_name_map(
    cfg: ViTConfig,
    *,
    first_layer: int = 0,
    num_layers: int | None = None,
    has_embedding: bool = True,
    has_head: bool = True,
    prefix: tuple = ("stage",),
    hf_prefix: str = "",
) -> NameMap:
    """Name map of a SigLIP `VisionStage` at state path `prefix`; stage layer i is HF layer first+i."""
    num_layers = cfg.num_layers - first_layer if num_layers is None else num_layers
    d, h, dh = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    out: NameMap = {}
    if has_embedding:
        out[(*prefix, "patch_kernel")] = TensorMap(
            f"{hf_prefix}embeddings.patch_embedding.weight", **patch_conv(cfg)
        )
        out[(*prefix, "patch_bias")] = TensorMap(f"{hf_prefix}embeddings.patch_embedding.bias")
        out[(*prefix, "pos_embed")] = TensorMap(f"{hf_prefix}embeddings.position_embedding.weight")
    for i in range(num_layers):
        k, p = f"{hf_prefix}encoder.layers.{first_layer + i}.", (*prefix, "layers", i)
        qkv, qkv_bias = fused_qkv(f"{k}self_attn.{{}}_proj", d, h, dh)
        out[(*p, "attn", "qkv_kernel")], out[(*p, "attn", "qkv_bias")] = qkv, qkv_bias
        out[(*p, "attn", "o_kernel")] = TensorMap(
            f"{k}self_attn.out_proj.weight", **linear_out(d, h, dh)
        )
        out[(*p, "attn", "o_bias")] = TensorMap(f"{k}self_attn.out_proj.bias")
        for j in (1, 2):
            out[(*p, "mlp", f"fc{j}")] = TensorMap(f"{k}mlp.fc{j}.weight", **transpose())
            out[(*p, "mlp", f"fc{j}_bias")] = TensorMap(f"{k}mlp.fc{j}.bias")
            out[(*p, f"norm{j}", "scale")] = TensorMap(f"{k}layer_norm{j}.weight")
            out[(*p, f"norm{j}", "bias")] = TensorMap(f"{k}layer_norm{j}.bias")
    if has_head and cfg.post_norm:
        out[(*prefix, "post_norm", "scale")] = TensorMap(f"{hf_prefix}post_layernorm.weight")
        out[(*prefix, "post_norm", "bias")] = TensorMap(f"{hf_prefix}post_layernorm.bias")
    return out


_LAYER_SUFFIXES = tuple(
    f"{m}.{w}"
    for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2",
        "layer_norm1", "layer_norm2",
    )
    for w in ("weight", "bias")
)  # fmt: skip
# Keys no parameter of ours uses: the pooling head, the text tower of a dual `siglip` checkpoint, and
# (inside MLLMs) vision layers past `vision_feature_layer` and the post-layernorm. io.py skips an
# unused key ending in one of these; keys the model needs are still required.
IGNORED_KEYS = (
    *_LAYER_SUFFIXES,
    "post_layernorm.weight", "post_layernorm.bias", "final_layer_norm.weight", "final_layer_norm.bias",
    "head.probe", "head.attention.in_proj_weight", "head.attention.in_proj_bias",
    "head.attention.out_proj.weight", "head.attention.out_proj.bias", "head.layernorm.weight",
    "head.layernorm.bias", "head.mlp.fc1.weight", "head.mlp.fc1.bias", "head.mlp.fc2.weight",
    "head.mlp.fc2.bias", "head.weight", "head.bias", "token_embedding.weight", "position_embedding.weight",
    "logit_scale", "logit_bias", "rotary_emb.inv_freq",
)  # fmt: skip


def _build(cfg, rngs):
    return VisionTower(cfg, rngs=rngs)


def _is_siglip(cfg) -> bool:
    return isinstance(cfg, SiglipConfig)


VISION_ADAPTER = ModelAdapter(
    config_from_hf=lambda hf, dtype, param_dtype: siglip_config_from_hf(
        hf, dtype=dtype, param_dtype=param_dtype
    ),
    config_to_hf=siglip_config_to_hf,
    build=_build,
    name_map=lambda cfg: siglip_name_map(cfg),
    matches=_is_siglip,
    ignored_keys=IGNORED_KEYS,
)

# A dual SigLIP checkpoint (google/siglip-*): its vision tower only.
DUAL_ADAPTER = ModelAdapter(
    config_from_hf=lambda hf, dtype, param_dtype: siglip_config_from_hf(
        hf["vision_config"], dtype=dtype, param_dtype=param_dtype
    ),
    config_to_hf=lambda cfg: {"model_type": "siglip", "vision_config": siglip_config_to_hf(cfg)},
    build=_build,
    name_map=lambda cfg: siglip_name_map(cfg, hf_prefix="vision_model."),
    matches=lambda cfg: False,  # export a tower as siglip_vision_model
    ignored_keys=IGNORED_KEYS,
)
