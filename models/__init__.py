"""Flax NNX model zoo: ViT encoders, decoder LLMs, projectors, MLLM compositions, HF weight import.

Knows nothing of dflop_jax. Entry points: `models.hf.load_pretrained(path)`, `models.Decoder(cfg, rngs=...)`,
one pipeline stage alone: `models.stage_module(cfg, "llm", first_layer=..., ...)` (random init keyed by
global layer index) or `models.hf.load_stage(path, cfg, "llm", ...)`.
"""

from models.attention import attention, attention_mask
from models.decoder import Decoder, DecoderLayer, DecoderStage, extract_stage
from models.decoder_config import DECODER_PRESETS, DecoderConfig
from models.layers import Llama3RopeScaling, RMSNorm, SwiGLU, constrain, keyed_rngs, make_param
from models.loss import cross_entropy_sum
from models.stage_modules import stage_module

__all__ = [
    "DECODER_PRESETS",
    "Decoder",
    "DecoderConfig",
    "DecoderLayer",
    "DecoderStage",
    "Llama3RopeScaling",
    "RMSNorm",
    "SwiGLU",
    "attention",
    "attention_mask",
    "constrain",
    "cross_entropy_sum",
    "extract_stage",
    "keyed_rngs",
    "make_param",
    "stage_module",
]
