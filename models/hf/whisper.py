"""HF Whisper encoder weights <-> `models.whisper.AudioStage` / `AudioTower`: the `whisper` adapter (the
encoder of a Whisper checkpoint) and the `qwen2_audio_encoder` adapter (a bare Qwen2-Audio tower).

Key layouts of a `whisper` checkpoint: `WhisperForConditionalGeneration` saves `model.encoder.*`,
`WhisperModel` `encoder.*`, a bare `WhisperEncoder` no prefix (what our export writes); the layout
is detected from the checkpoint's keys. The decoder's tensors are skipped (`IGNORED_KEYS`): the
encoder is what an audio LLM reads. The fused q / k / v kernel stacks HF's three projections
(`StackedMap`); HF's k_proj has no bias, so the bias parameter stacks only q_proj's and v_proj's.
Conv1d weights [out, in, 3] map to our [3, in, out] kernels.
"""

from __future__ import annotations

from collections.abc import Mapping

from models.hf.io import CheckpointError, ModelAdapter, NameMap, StackedMap, TensorMap
from models.hf.siglip import heads_vec, linear_in, linear_out, transpose
from models.whisper import AudioTower, WhisperEncoderConfig

# HF activation names -> ours (HF ACT2FN: "gelu" is exact).
ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
PREFIXES = ("model.encoder.", "encoder.", "")


def conv_kernel() -> dict:
    """torch Conv1d [out, in, 3] <-> ours [3, in, out]."""
    return dict(to_ours=lambda w: w.transpose(2, 1, 0), to_hf=lambda w: w.transpose(2, 1, 0))


def whisper_config_from_hf(d: Mapping, *, pool: int = 1, **overrides) -> WhisperEncoderConfig:
    """A Whisper / Qwen2-Audio encoder config dict -> `WhisperEncoderConfig`."""
    act = d.get("activation_function", "gelu")
    if act not in ACTS:
        raise CheckpointError(f"Whisper activation_function={act!r}; use one of {sorted(ACTS)}")
    return WhisperEncoderConfig(
        hidden_size=d["d_model"],
        intermediate_size=d["encoder_ffn_dim"],
        num_layers=d["encoder_layers"],
        num_heads=d["encoder_attention_heads"],
        num_mel_bins=d.get("num_mel_bins", 80),
        max_source_positions=d.get("max_source_positions", 1500),
        pool=pool,
        act=ACTS[act],
        **overrides,
    )


def whisper_config_to_hf(cfg: WhisperEncoderConfig, model_type: str = "whisper") -> dict:
    """The encoder fields of a `WhisperConfig` (`model_type` "whisper") or a
    `Qwen2AudioEncoderConfig` ("qwen2_audio_encoder")."""
    out = {
        "model_type": model_type,
        "d_model": cfg.hidden_size,
        "encoder_ffn_dim": cfg.intermediate_size,
        "encoder_layers": cfg.num_layers,
        "encoder_attention_heads": cfg.num_heads,
        "num_mel_bins": cfg.num_mel_bins,
        "max_source_positions": cfg.max_source_positions,
        "activation_function": {"gelu": "gelu", "gelu_tanh": "gelu_new"}[cfg.act],
        "scale_embedding": False,
    }
    if model_type == "whisper":
        out["architectures"] = ["WhisperEncoder"]
    return out


def _layer_map(cfg: WhisperEncoderConfig, ours: tuple, hf: str) -> NameMap:
    d, h, dh = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    attn = f"{hf}self_attn."
    kernel = [TensorMap(f"{attn}{n}_proj.weight", **linear_in(d, h, dh)) for n in "qkv"]
    bias = [TensorMap(f"{attn}{n}_proj.bias", **heads_vec(h, dh)) for n in "qv"]
    out: NameMap = {
        (*ours, "attn", "qkv_kernel"): StackedMap(tuple(kernel), axis=1),
        (*ours, "attn", "qv_bias"): StackedMap(tuple(bias), axis=0),
        (*ours, "attn", "o_kernel"): TensorMap(f"{attn}out_proj.weight", **linear_out(d, h, dh)),
        (*ours, "attn", "o_bias"): TensorMap(f"{attn}out_proj.bias"),
    }
    for j in (1, 2):
        out[(*ours, "mlp", f"fc{j}")] = TensorMap(f"{hf}fc{j}.weight", **transpose())
        out[(*ours, "mlp", f"fc{j}_bias")] = TensorMap(f"{hf}fc{j}.bias")
    for norm, key in (("norm1", "self_attn_layer_norm"), ("norm2", "final_layer_norm")):
        out[(*ours, norm, "scale")] = TensorMap(f"{hf}{key}.weight")
        out[(*ours, norm, "bias")] = TensorMap(f"{hf}{key}.bias")
    return out


def whisper_name_map(
    cfg: WhisperEncoderConfig,
    *,
    first_layer: int = 0,
    num_layers: int | None = None,
    has_embedding: bool = True,
    has_head: bool = True,
    prefix: tuple = ("stage",),
    hf_prefix: str = "",
) -> NameMap:
    """Name map of an `AudioStage` at state path `prefix`; stage layer i is HF layer first+i."""
    num_layers = cfg.num_layers - first_layer if num_layers is None else num_layers
    out: NameMap = {}
    if has_embedding:
        for j in (1, 2):
            out[(*prefix, f"conv{j}_kernel")] = TensorMap(
                f"{hf_prefix}conv{j}.weight", **conv_kernel()
            )
            out[(*prefix, f"conv{j}_bias")] = TensorMap(f"{hf_prefix}conv{j}.bias")
        out[(*prefix, "pos_embed")] = TensorMap(f"{hf_prefix}embed_positions.weight")
    for i in range(num_layers):
        hf = f"{hf_prefix}layers.{first_layer + i}."
        out.update(_layer_map(cfg, (*prefix, "layers", i), hf))
    if has_head:
        out[(*prefix, "post_norm", "scale")] = TensorMap(f"{hf_prefix}layer_norm.weight")
        out[(*prefix, "post_norm", "bias")] = TensorMap(f"{hf_prefix}layer_norm.bias")
    return out


def detect_prefix(keys: list[str]) -> str:
    """The encoder prefix of a Whisper checkpoint's keys (`PREFIXES`, first whose conv1 is there)."""
    for prefix in PREFIXES:
        if f"{prefix}conv1.weight" in keys:
            return prefix
    return ""


_ATTN = ("q_proj", "k_proj", "v_proj", "out_proj")
# A Whisper checkpoint's decoder (and its output head): io.py skips an unused key ending in one of
# these; keys the encoder needs are still required.
IGNORED_KEYS = (
    *(f"{m}.{p}.{w}" for m in ("self_attn", "encoder_attn") for p in _ATTN for w in ("weight", "bias")),
    *(f"{n}.{w}" for n in ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm",
                           "fc1", "fc2", "layer_norm") for w in ("weight", "bias")),
    "embed_tokens.weight", "embed_positions.weight", "proj_out.weight",
)  # fmt: skip


def _build(cfg, rngs):
    return AudioTower(cfg, rngs=rngs)


WHISPER_ADAPTER = ModelAdapter(
    config_from_hf=lambda hf, dtype, param_dtype: whisper_config_from_hf(
        hf, dtype=dtype, param_dtype=param_dtype
    ),
    config_to_hf=whisper_config_to_hf,
    build=_build,
    name_map=lambda cfg: whisper_name_map(cfg),
    matches=lambda cfg: isinstance(cfg, WhisperEncoderConfig) and cfg.pool == 1,
    ignored_keys=IGNORED_KEYS,
    checkpoint_name_map=lambda cfg, keys: whisper_name_map(cfg, hf_prefix=detect_prefix(keys)),
)

# A bare Qwen2-Audio tower (`Qwen2AudioEncoder.save_pretrained`): pooled by 2 before its norm.
QWEN2_AUDIO_ENCODER_ADAPTER = ModelAdapter(
    config_from_hf=lambda hf, dtype, param_dtype: whisper_config_from_hf(
        hf, pool=2, dtype=dtype, param_dtype=param_dtype
    ),
    config_to_hf=lambda cfg: whisper_config_to_hf(cfg, "qwen2_audio_encoder"),
    build=_build,
    name_map=lambda cfg: whisper_name_map(cfg),
    matches=lambda cfg: isinstance(cfg, WhisperEncoderConfig) and cfg.pool == 2,
)
