"""`DecoderConfig` (Qwen2/Qwen2.5 and Llama 3 shapes) and named real configs `DECODER_PRESETS`.

Preset numbers are the published HF `config.json` values (shapes are what matter here; a real
checkpoint loaded with `models.hf.load_pretrained` always takes its numbers from its own config.json).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from models.layers import REMAT_POLICIES, Llama3RopeScaling

REMAT_MODES = tuple(REMAT_POLICIES)
ATTENTION_IMPLS = (None, "xla", "pallas", "cudnn")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Shapes and numerics of a decoder-only LLM.

    dtype is the compute dtype ("bfloat16" / "float32"); param_dtype the stored (master) dtype.
    remat: "none" | "full" (recompute every block) | "dots" (save matmul outputs, recompute the rest).
    loss_chunk: sequence positions whose vocabulary logits the loss computes at once
      (`models.loss.chunked_cross_entropy_sum`); the whole sequence when it is shorter.
    attention_impl: `models.attention` implementation ("xla" / None, "pallas", "cudnn"); a run's
      "auto" is resolved to one of these before the model is configured.
    single_sample_rows: every row the model is given holds one sample followed only by padding
      (a promise of whoever builds the rows; the data is not inspected): "cudnn" then runs cuDNN
      with each row's valid length instead of its packed layout. False for packed rows.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_embeddings: bool = False
    max_position_embeddings: int = 32768
    dtype: str = "float32"
    param_dtype: str = "float32"
    attention_impl: str | None = "xla"
    remat: str = "none"
    loss_chunk: int = 1024
    single_sample_rows: bool = False

    def __post_init__(self):
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "loss_chunk",
        )
        for name in positive:
            value = getattr(self, name)
            _check(value > 0, f"DecoderConfig.{name}={value} must be > 0")
        _check(
            self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0,
            f"DecoderConfig.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}",
        )
        _check(
            self.head_dim > 0 and self.head_dim % 2 == 0,
            f"DecoderConfig.head_dim={self.head_dim} must be even and > 0 (RoPE rotates pairs)",
        )
        _check(self.rope_theta > 0, f"DecoderConfig.rope_theta={self.rope_theta} must be > 0")
        _check(self.rms_norm_eps > 0, f"DecoderConfig.rms_norm_eps={self.rms_norm_eps} must be > 0")
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            _check(
                value in ("float32", "bfloat16", "float16"),
                f"DecoderConfig.{name}={value!r}; use 'float32', 'bfloat16' or 'float16'",
            )
        _check(
            self.attention_impl in ATTENTION_IMPLS,
            f"DecoderConfig.attention_impl={self.attention_impl!r}; use one of {ATTENTION_IMPLS}",
        )
        _check(
            self.remat in REMAT_MODES,
            f"DecoderConfig.remat={self.remat!r}; use one of {REMAT_MODES}",
        )

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def param_jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes) -> DecoderConfig:
        return dataclasses.replace(self, **changes)


def _qwen25(hidden, inter, layers, heads, kv, vocab, tied, eps, max_pos) -> DecoderConfig:
    return DecoderConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=hidden // heads,
        rope_theta=1_000_000.0,
        rms_norm_eps=eps,
        qkv_bias=True,
        tie_embeddings=tied,
        max_position_embeddings=max_pos,
        dtype="bfloat16",
    )


_LLAMA31_SCALING = Llama3RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def _llama3(hidden, inter, layers, heads, scaled: bool) -> DecoderConfig:
    return DecoderConfig(
        vocab_size=128256,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500_000.0,
        rope_scaling=_LLAMA31_SCALING if scaled else None,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072 if scaled else 8192,
        dtype="bfloat16",
    )


DECODER_PRESETS: dict[str, DecoderConfig] = {
    "qwen2.5-0.5b": _qwen25(896, 4864, 24, 14, 2, 151936, True, 1e-6, 32768),
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4, 152064, False, 1e-6, 131072),
    "qwen2.5-32b": _qwen25(5120, 27648, 64, 40, 8, 152064, False, 1e-5, 131072),
    "qwen2.5-72b": _qwen25(8192, 29568, 80, 64, 8, 152064, False, 1e-5, 131072),
    "llama3-8b": _llama3(4096, 14336, 32, 32, scaled=False),
    "llama3-70b": _llama3(8192, 28672, 80, 64, scaled=False),
    "llama3.1-8b": _llama3(4096, 14336, 32, 32, scaled=True),
    "llama3.1-70b": _llama3(8192, 28672, 80, 64, scaled=True),
}
