"""HF LLaVA-OneVision checkpoints (`LlavaOnevisionForConditionalGeneration`) <-> `models.llava_onevision`.

`load_llava_onevision(path, mesh=None, rules=None) -> (model, cfg)` reads config.json and the
safetensors (one file or a sharded index), builds the model abstractly, and fills every parameter;
with a mesh (and logical-axis rules) each parameter goes straight to its sharding from host memory.
`export_llava_onevision(model) -> {hf_key: np.ndarray}` gives HF-layout arrays (keys in the layout
transformers 5 saves). Keys are accepted with either prefix layout (`model.vision_tower.` /
`vision_tower.`, `model.language_model.` / `language_model.model.`, ...). Vision layers past
`vision_feature_layer` and SigLIP's `post_layernorm` are never read by LLaVA-OV: they are skipped on
import (logged) and absent from the export.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path as FsPath

import jax
import numpy as np
from flax import nnx

from models.decoder_config import DecoderConfig
from models.hf.siglip import (
    Entry,
    assign,
    export,
    heads_vec,
    linear_in,
    linear_out,
    prefixed,
    same,
    siglip_config_from_hf,
    siglip_entries,
    strip_prefix,
    transpose,
)
from models.llava_onevision import LlavaOnevision, LlavaOnevisionConfig, llava_onevision_config

log = logging.getLogger(__name__)

# Canonical key layout: vision.<siglip keys>, projector.linear_{1,2}, image_newline, text.<qwen2 keys>.
PREFIX_RULES = [
    (r"^(model\.)?vision_tower\.(vision_model\.)?", "vision."),
    (r"^(model\.)?multi_modal_projector\.", "projector."),
    (r"^(model\.)?image_newline$", "image_newline"),
    (r"^(language_model\.model\.|model\.language_model\.)", "text.model."),
    (r"^(language_model\.)?lm_head\.", "text.lm_head."),
]
EXPORT_PREFIXES = {"vision.": "model.vision_tower.", "projector.": "model.multi_modal_projector.",
                   "image_newline": "model.image_newline", "text.model.": "model.language_model.",
                   "text.lm_head.": "lm_head."}  # fmt: skip


def read_safetensors(path: str | FsPath) -> dict[str, np.ndarray]:
    """All tensors of an HF model directory (single file or sharded `model.safetensors.index.json`)."""
    from safetensors.numpy import load_file

    path = FsPath(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}; pass an HF model directory")
    out: dict[str, np.ndarray] = {}
    for f in files:
        out.update(load_file(f))
    return out


def decoder_config_from_hf(d: Mapping, **overrides) -> DecoderConfig:
    """Qwen2 `text_config` dict -> DecoderConfig (rope from `rope_parameters` or `rope_theta`)."""
    if d.get("model_type", "qwen2") != "qwen2":
        raise ValueError(
            f"LLaVA-OV text model_type={d.get('model_type')!r} is not supported; expected 'qwen2'"
        )
    rope = d.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"Qwen2 rope_type={rope['rope_type']!r} is not supported; expected 'default'"
        )
    heads = d["num_attention_heads"]
    return DecoderConfig(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads", heads),
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        qkv_bias=True,
        tie_embeddings=d.get("tie_word_embeddings", False),
        max_position_embeddings=d.get("max_position_embeddings", 32768),
        **overrides,
    )


def decoder_entries(
    cfg: DecoderConfig, *, first_layer: int, num_layers: int, embedding: bool, head: bool
) -> list[Entry]:
    """Qwen2 keys (`model.*`, `lm_head.weight`) of a `DecoderStage`."""
    d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ti, to = transpose()
    out: list[Entry] = []
    if embedding or (head and cfg.tie_embeddings):
        out.append(Entry("model.embed_tokens.weight", ("embed_tokens", "weight"), same, same))
    for i in range(num_layers):
        key, p = f"model.layers.{first_layer + i}.", ("layers", i)
        for n, heads in (("q", h), ("k", k), ("v", k)):
            wi, wo = linear_in(d, heads, dh)
            bi, bo = heads_vec(heads, dh)
            out.append(
                Entry(f"{key}self_attn.{n}_proj.weight", (*p, "attn", f"{n}_kernel"), wi, wo)
            )
            if cfg.qkv_bias:
                out.append(
                    Entry(f"{key}self_attn.{n}_proj.bias", (*p, "attn", f"{n}_bias"), bi, bo)
                )
        oi, oo = linear_out(d, h, dh)
        out += [
            Entry(f"{key}self_attn.o_proj.weight", (*p, "attn", "o_kernel"), oi, oo),
            Entry(f"{key}mlp.gate_proj.weight", (*p, "mlp", "gate"), ti, to),
            Entry(f"{key}mlp.up_proj.weight", (*p, "mlp", "up"), ti, to),
            Entry(f"{key}mlp.down_proj.weight", (*p, "mlp", "down"), ti, to),
            Entry(f"{key}input_layernorm.weight", (*p, "input_norm", "weight"), same, same),
            Entry(
                f"{key}post_attention_layernorm.weight",
                (*p, "post_attn_norm", "weight"),
                same,
                same,
            ),
        ]
    if head:
        out.append(Entry("model.norm.weight", ("norm", "weight"), same, same))
        if not cfg.tie_embeddings:
            out.append(Entry("lm_head.weight", ("lm_head",), ti, to))
    return out


def config_from_hf(
    d: Mapping, *, dtype: str = "float32", param_dtype: str = "float32"
) -> LlavaOnevisionConfig:
    """`LlavaOnevisionConfig` from an HF config.json dict."""
    if d.get("vision_feature_select_strategy", "full") != "full":
        raise ValueError(
            "LLaVA-OV vision_feature_select_strategy must be 'full' (SigLIP has no CLS token)"
        )
    layer = d.get("vision_feature_layer", -1)
    if not isinstance(layer, int):
        raise ValueError(
            f"LLaVA-OV vision_feature_layer={layer!r}: only a single int layer is supported"
        )
    vision = siglip_config_from_hf(d["vision_config"], dtype=dtype, param_dtype=param_dtype)
    text_d = dict(d["text_config"])
    text_d.setdefault("tie_word_embeddings", d.get("tie_word_embeddings", False))
    text = decoder_config_from_hf(text_d, dtype=dtype, param_dtype=param_dtype)
    acts = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}
    return llava_onevision_config(
        vision,
        text,
        vision_feature_layer=layer,
        image_token_id=d.get("image_token_index", d.get("image_token_id", 151646)),
        video_token_id=d.get("video_token_index", d.get("video_token_id", 151647)),
        projector_bias=d.get("multimodal_projector_bias", True),
        projector_act=acts[d.get("projector_hidden_act", "gelu")],
        pinpoints=tuple(tuple(p) for p in d.get("image_grid_pinpoints") or ())
        or llava_config_default_pinpoints(),
        vision_aspect_ratio=d.get("vision_aspect_ratio", "anyres_max_9"),
    )


def llava_config_default_pinpoints():
    from models.layouts import LLAVA_OV_PINPOINTS

    return LLAVA_OV_PINPOINTS


def entries(cfg: LlavaOnevisionConfig) -> list[Entry]:
    """Every parameter of `LlavaOnevision(cfg)` with its canonical HF key."""
    v, t = cfg.vision, cfg.text
    out = prefixed(
        siglip_entries(v, first_layer=0, num_layers=v.num_layers, embedding=True, head=True),
        "vision.",
        ("encoder", "vision"),
    )
    ti, to = transpose()
    out.append(Entry("projector.linear_1.weight", ("encoder", "projector", "linear_1"), ti, to))
    out.append(Entry("projector.linear_2.weight", ("encoder", "projector", "linear_2"), ti, to))
    if cfg.projector_bias:
        out.append(Entry("projector.linear_1.bias", ("encoder", "projector", "bias_1"), same, same))
        out.append(Entry("projector.linear_2.bias", ("encoder", "projector", "bias_2"), same, same))
    out.append(Entry("image_newline", ("llm", "image_newline"), same, same))
    out += prefixed(
        decoder_entries(t, first_layer=0, num_layers=t.num_layers, embedding=True, head=True),
        "text.",
        ("llm", "decoder"),
    )
    return out


def _unused_vision_key(cfg: LlavaOnevisionConfig):
    def ignore(key: str) -> bool:
        if key.startswith(("vision.post_layernorm.", "vision.head.")):
            return True
        parts = key.split(".")
        return key.startswith("vision.encoder.layers.") and int(parts[3]) >= cfg.vision.num_layers

    return ignore


def load_llava_onevision(
    path: str | FsPath, *, mesh: jax.sharding.Mesh | None = None, rules=None, dtype: str = "float32",
    param_dtype: str = "float32",
) -> tuple[LlavaOnevision, LlavaOnevisionConfig]:  # fmt: skip
    """(model, cfg) from an HF LLaVA-OneVision directory; sharded onto `mesh` by `rules` if given."""
    path = FsPath(path)
    cfg = config_from_hf(
        json.loads((path / "config.json").read_text()), dtype=dtype, param_dtype=param_dtype
    )
    tensors = strip_prefix(read_safetensors(path), PREFIX_RULES)
    if "text.lm_head.weight" in tensors and cfg.text.tie_embeddings:
        tensors.pop(
            "text.lm_head.weight"
        )  # a tied head saved explicitly: same array as the embedding
    ignore = _unused_vision_key(cfg)
    skipped = sorted(k for k in tensors if ignore(k))
    if skipped:
        log.info(
            "LLaVA-OV import: %d vision keys unused by vision_feature_layer (e.g. %s)",
            len(skipped),
            skipped[0],
        )
    model, shardings = build_abstract(lambda: LlavaOnevision(cfg, rngs=nnx.Rngs(0)), mesh, rules)
    what = f"LLaVA-OneVision from {path}"
    assign(model, entries(cfg), tensors, ignore=ignore, what=what, shardings=shardings)
    return model, cfg


def build_abstract(factory, mesh, rules):
    """(module with shape-only parameters, {param path: NamedSharding} or None without a mesh)."""
    if mesh is None:
        return nnx.eval_shape(factory), None
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules or ()):
        model = nnx.eval_shape(factory)
        shardings = nnx.get_named_sharding(nnx.state(model, nnx.Param), mesh)
    return model, dict(nnx.to_flat_state(shardings))


def export_llava_onevision(model: LlavaOnevision) -> dict[str, np.ndarray]:
    """{HF key (transformers 5 layout): array} of every parameter."""
    out = {}
    for key, value in export(model, entries(model.cfg)).items():
        for canon, hf in EXPORT_PREFIXES.items():
            if key.startswith(canon):
                key = hf + key[len(canon) :]
                break
        out[key] = value
    return out
