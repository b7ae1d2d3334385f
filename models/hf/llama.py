"""HF `model_type: llama` (Llama 2/3/3.1 causal LMs, incl. llama3 RoPE scaling) -> `Decoder`."""

from __future__ import annotations

from models.decoder_config import DecoderConfig
from models.hf.causal_lm import causal_lm_adapter, decoder_config_from_hf, decoder_config_to_hf
from models.hf.io import CheckpointError


def config_from_hf(hf: dict, dtype: str, param_dtype: str) -> DecoderConfig:
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key, False):
            raise CheckpointError(f"llama {key}=true is not supported (bias-free projections only)")
    return decoder_config_from_hf(hf, qkv_bias=False, dtype=dtype, param_dtype=param_dtype)


def config_to_hf(cfg: DecoderConfig) -> dict:
    out = decoder_config_to_hf(cfg, "llama", "LlamaForCausalLM")
    out.update(attention_bias=False, mlp_bias=False)
    return out


ADAPTER = causal_lm_adapter(
    config_from_hf,
    config_to_hf,
    matches=lambda cfg: isinstance(cfg, DecoderConfig) and not cfg.qkv_bias,
)
