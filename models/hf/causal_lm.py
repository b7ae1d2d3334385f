"""Shared HF mapping of Qwen2 / Llama causal LMs onto `Decoder` / `DecoderStage`.

HF layout (both families): model.embed_tokens.weight [V,D]; model.layers.{i}.self_attn.{q,k,v}_proj
.weight [H*Dh or K*Dh, D] (+ .bias for Qwen2), o_proj.weight [D, H*Dh]; mlp.{gate,up}_proj.weight [F,D],
down_proj.weight [D,F]; input_layernorm / post_attention_layernorm .weight [D]; model.norm.weight;
lm_head.weight [V,D] (absent when tied). Our kernels are [in, ..., out] and head-aligned.
"""

from __future__ import annotations

from models.decoder import Decoder
from models.decoder_config import DecoderConfig
from models.hf.io import CheckpointError, ModelAdapter, NameMap, TensorMap
from models.layers import Llama3RopeScaling

IGNORED_KEYS = ("rotary_emb.inv_freq",)
_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "rms_norm_eps",
    "max_position_embeddings",
)


def _transpose() -> dict:
    return dict(to_ours=lambda x: x.T, to_hf=lambda x: x.T)


def _heads_in(d: int, heads: int, dh: int) -> dict:
    """HF [heads*Dh, D] <-> ours [D, heads, Dh] (column-parallel projections)."""
    return dict(
        to_ours=lambda x: x.T.reshape(d, heads, dh), to_hf=lambda x: x.reshape(d, heads * dh).T
    )


def _heads_out(d: int, heads: int, dh: int) -> dict:
    """HF [D, heads*Dh] <-> ours [heads, Dh, D] (row-parallel output projection)."""
    return dict(
        to_ours=lambda x: x.T.reshape(heads, dh, d), to_hf=lambda x: x.reshape(heads * dh, d).T
    )


def _bias(heads: int, dh: int) -> dict:
    return dict(to_ours=lambda x: x.reshape(heads, dh), to_hf=lambda x: x.reshape(heads * dh))


def _layer_map(cfg: DecoderConfig, ours: tuple, hf: str) -> NameMap:
    d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    out = {
        (*ours, "input_norm", "weight"): TensorMap(f"{hf}input_layernorm.weight"),
        (*ours, "post_attn_norm", "weight"): TensorMap(f"{hf}post_attention_layernorm.weight"),
        (*ours, "attn", "q_kernel"): TensorMap(
            f"{hf}self_attn.q_proj.weight", **_heads_in(d, h, dh)
        ),
        (*ours, "attn", "k_kernel"): TensorMap(
            f"{hf}self_attn.k_proj.weight", **_heads_in(d, k, dh)
        ),
        (*ours, "attn", "v_kernel"): TensorMap(
            f"{hf}self_attn.v_proj.weight", **_heads_in(d, k, dh)
        ),
        (*ours, "attn", "o_kernel"): TensorMap(
            f"{hf}self_attn.o_proj.weight", **_heads_out(d, h, dh)
        ),
        (*ours, "mlp", "gate"): TensorMap(f"{hf}mlp.gate_proj.weight", **_transpose()),
        (*ours, "mlp", "up"): TensorMap(f"{hf}mlp.up_proj.weight", **_transpose()),
        (*ours, "mlp", "down"): TensorMap(f"{hf}mlp.down_proj.weight", **_transpose()),
    }
    if cfg.qkv_bias:
        for name, heads in (("q", h), ("k", k), ("v", k)):
            out[(*ours, "attn", f"{name}_bias")] = TensorMap(
                f"{hf}self_attn.{name}_proj.bias", **_bias(heads, dh)
            )
    return out


def decoder_name_map(
    cfg: DecoderConfig,
    *,
    first_layer: int = 0,
    num_layers: int | None = None,
    has_embedding: bool = True,
    has_head: bool = True,
    prefix: tuple = ("stage",),
    hf_body: str = "model.",
    hf_head: str = "lm_head.weight",
) -> NameMap:
    """Name map of a `DecoderStage` (at state path `prefix`) onto HF keys.

    hf_body: HF prefix of the transformer body ("model." for Qwen2/Llama, "model.language_model."
    inside LLaVA-OneVision); hf_head: the LM head key. Stage layer i is HF layer first_layer + i.
    """
    num_layers = cfg.num_layers - first_layer if num_layers is None else num_layers
    out: NameMap = {}
    if has_embedding or (has_head and cfg.tie_embeddings):
        out[(*prefix, "embed_tokens", "weight")] = TensorMap(f"{hf_body}embed_tokens.weight")
    for i in range(num_layers):
        out.update(_layer_map(cfg, (*prefix, "layers", i), f"{hf_body}layers.{first_layer + i}."))
    if has_head:
        out[(*prefix, "norm", "weight")] = TensorMap(f"{hf_body}norm.weight")
        if not cfg.tie_embeddings:
            out[(*prefix, "lm_head")] = TensorMap(hf_head, **_transpose())
    return out


def _rope_from_hf(hf: dict) -> tuple[float, Llama3RopeScaling | None]:
    """(theta, scaling) from transformers-5 `rope_parameters` or legacy `rope_theta`/`rope_scaling`."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if not params:
        params = hf.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise CheckpointError(f"rope_type={kind!r} is not supported; supported: default, llama3")
    scaling = Llama3RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
    return float(theta), scaling


def decoder_config_from_hf(
    hf: dict, *, qkv_bias: bool, dtype: str, param_dtype: str
) -> DecoderConfig:
    """DecoderConfig from a Qwen2 / Llama config.json dict."""
    missing = [k for k in _REQUIRED_KEYS if k not in hf]
    if missing:
        raise CheckpointError(f"config.json lacks {missing}; is this a Qwen2/Llama causal LM?")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act={hf['hidden_act']!r} is not supported; only 'silu'")
    heads = hf["num_attention_heads"]
    theta, scaling = _rope_from_hf(hf)
    return DecoderConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=hf["rms_norm_eps"],
        qkv_bias=qkv_bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf["max_position_embeddings"],
        dtype=dtype,
        param_dtype=param_dtype,
    )


def decoder_config_to_hf(cfg: DecoderConfig, model_type: str, architecture: str) -> dict:
    """config.json dict (transformers 5 `rope_parameters`, plus legacy `rope_theta`/`rope_scaling`)."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope.update(
            rope_type="llama3",
            factor=s.factor,
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position_embeddings,
        )
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope,
        "torch_dtype": cfg.param_dtype,
    }


def causal_lm_adapter(config_from_hf, config_to_hf, matches) -> ModelAdapter:
    """Adapter for a family whose module is `Decoder` and names follow `decoder_name_map`."""
    return ModelAdapter(
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        build=lambda cfg, rngs: Decoder(cfg, rngs=rngs),
        name_map=lambda cfg: decoder_name_map(cfg),
        matches=matches,
        ignored_keys=IGNORED_KEYS,
        stage_name_map=lambda cfg, keys, module, **flags: decoder_name_map(cfg, prefix=(), **flags),
    )
