"""Flax NNX model zoo: ViT encoders, decoder LLMs, projectors, MLLM compositions, HF weight import.

Knows nothing of dflop_jax. Entry points: `models.hf.load_pretrained(path)`, `models.Decoder(cfg, rngs=...)`.
"""

from models.attention import attention, attention_mask
from models.decoder import Decoder, DecoderLayer, DecoderStage, extract_stage
from models.decoder_config import DECODER_PRESETS, DecoderConfig
from models.layers import Llama3RopeScaling, RMSNorm, SwiGLU, constrain, make_param
from models.loss import cross_entropy_sum

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
    "make_param",
]
