"""HF `model_type: qwen2` (Qwen2 / Qwen2.5 causal LMs) -> `models.decoder.Decoder`."""

from __future__ import annotations

from models.decoder_config import DecoderConfig
from models.hf.causal_lm import causal_lm_adapter, decoder_config_from_hf, decoder_config_to_hf
from models.hf.io import CheckpointError


def config_from_hf(hf: dict, dtype: str, param_dtype: str) -> DecoderConfig:
    if hf.get("use_sliding_window", False):
        raise CheckpointError(
            "qwen2 use_sliding_window=true is not supported (full attention only)"
        )
    return decoder_config_from_hf(hf, qkv_bias=True, dtype=dtype, param_dtype=param_dtype)


def config_to_hf(cfg: DecoderConfig) -> dict:
    out = decoder_config_to_hf(cfg, "qwen2", "Qwen2ForCausalLM")
    out["use_sliding_window"] = False
    return out


ADAPTER = causal_lm_adapter(
    config_from_hf,
    config_to_hf,
    matches=lambda cfg: isinstance(cfg, DecoderConfig) and cfg.qkv_bias,
)
