"""HF InternVL weights <-> ours: the InternViT vision tower (`InternVLVisionModel`) and the InternVL
projector (pixel shuffle + LayerNorm + MLP). The whole `InternVLForConditionalGeneration` is composed in
`models/internvl.py`; its loader lives there too (`load_internvl`).

HF vision keys (relative to `vision_tower.` in a full checkpoint, none in a vision-only save):
  embeddings.cls_token [1,1,D], embeddings.position_embeddings [1,N+1,D],
  embeddings.patch_embeddings.projection.{weight,bias}, encoder.layer.{i}.attention.{q,k,v}_proj,
  .projection_layer, .q_norm/.k_norm, lambda_1/lambda_2, layernorm_before/after, mlp.fc1/fc2,
  layernorm (only when use_mean_pooling is False).
"""

from __future__ import annotations

from collections.abc import Mapping

from models.hf.siglip import (
    Entry,
    assign,
    export,
    heads_vec,
    linear_in,
    linear_out,
    patch_conv,
    prefixed,
    same,
    strip_prefix,
    transpose,
)
from models.internvit import InternViTConfig
from models.vit import ViTConfig

__all__ = [
    "Entry",
    "assign",
    "export",
    "internvit_config_from_hf",
    "internvit_entries",
    "prefixed",
    "strip_prefix",
]


def internvit_config_from_hf(d: Mapping, **overrides) -> InternViTConfig:
    """`InternVLVisionConfig` dict -> `InternViTConfig`."""
    acts = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}
    if d.get("hidden_act", "gelu") not in acts:
        raise ValueError(
            f"InternViT hidden_act={d['hidden_act']!r} is not supported; use one of {sorted(acts)}"
        )
    image, patch = d.get("image_size", 448), d.get("patch_size", 14)
    image = image[0] if isinstance(image, (list, tuple)) else image
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    if not d.get("use_absolute_position_embeddings", True) or d.get("use_mask_token", False):
        raise ValueError(
            "InternViT without absolute position embeddings or with a mask token is not supported"
        )
    return InternViTConfig(
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=d["num_attention_heads"],
        image_size=image,
        patch_size=patch,
        num_channels=d.get("num_channels", 3),
        norm=d.get("norm_type", "layer_norm"),
        norm_eps=d.get("layer_norm_eps", 1e-6),
        act=acts[d.get("hidden_act", "gelu")],
        qkv_bias=d.get("attention_bias", False),
        qk_norm=d.get("use_qk_norm", False),
        layer_scale=True,
        cls_token=True,
        post_norm=not d.get("use_mean_pooling", True),
        **overrides,
    )


def internvit_entries(
    cfg: ViTConfig, *, first_layer: int, num_layers: int, embedding: bool, head: bool
) -> list[Entry]:
    """Entries of an InternViT `VisionStage` (HF keys relative to the vision model)."""
    d, h, dh = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    qi, qo = linear_in(d, h, dh)
    oi, oo = linear_out(d, h, dh)
    bi, bo = heads_vec(h, dh)
    ti, to = transpose()
    out: list[Entry] = []
    if embedding:
        pi, po = patch_conv(cfg)
        out += [
            Entry("embeddings.patch_embeddings.projection.weight", ("patch_kernel",), pi, po),
            Entry("embeddings.patch_embeddings.projection.bias", ("patch_bias",), same, same),
            Entry(
                "embeddings.position_embeddings", ("pos_embed",), lambda x: x[0], lambda x: x[None]
            ),
            Entry("embeddings.cls_token", ("cls",), lambda x: x[0, 0], lambda x: x[None, None]),
        ]
    for i in range(num_layers):
        k, p = f"encoder.layer.{first_layer + i}.", ("layers", i)
        for n in ("q", "k", "v"):
            out.append(Entry(f"{k}attention.{n}_proj.weight", (*p, "attn", f"{n}_kernel"), qi, qo))
            if cfg.qkv_bias:
                out.append(Entry(f"{k}attention.{n}_proj.bias", (*p, "attn", f"{n}_bias"), bi, bo))
        if cfg.qk_norm:
            out.append(Entry(f"{k}attention.q_norm.weight", (*p, "attn", "q_norm"), bi, bo))
            out.append(Entry(f"{k}attention.k_norm.weight", (*p, "attn", "k_norm"), bi, bo))
        out += [
            Entry(f"{k}attention.projection_layer.weight", (*p, "attn", "o_kernel"), oi, oo),
            Entry(f"{k}attention.projection_layer.bias", (*p, "attn", "o_bias"), same, same),
            Entry(f"{k}lambda_1", (*p, "ls1"), same, same),
            Entry(f"{k}lambda_2", (*p, "ls2"), same, same),
            Entry(f"{k}mlp.fc1.weight", (*p, "mlp", "fc1"), ti, to),
            Entry(f"{k}mlp.fc1.bias", (*p, "mlp", "fc1_bias"), same, same),
            Entry(f"{k}mlp.fc2.weight", (*p, "mlp", "fc2"), ti, to),
            Entry(f"{k}mlp.fc2.bias", (*p, "mlp", "fc2_bias"), same, same),
        ]
        for hf_name, ours in (("layernorm_before", "norm1"), ("layernorm_after", "norm2")):
            out.append(Entry(f"{k}{hf_name}.weight", (*p, ours, "scale"), same, same))
            if cfg.norm == "layer_norm":
                out.append(Entry(f"{k}{hf_name}.bias", (*p, ours, "bias"), same, same))
    if head and cfg.post_norm:
        out.append(Entry("layernorm.weight", ("post_norm", "scale"), same, same))
        if cfg.norm == "layer_norm":
            out.append(Entry("layernorm.bias", ("post_norm", "bias"), same, same))
    return out
