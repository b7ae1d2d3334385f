"""Whisper's audio encoder (HF `WhisperEncoder`; with `pool=2`, HF `Qwen2AudioEncoder`), cut into stages.

Input: log-mel features [B, F, M] (time-major: F frames at 100 per second, M mel bins; HF feeds
[B, M, F]), and optionally `lengths` [B], each clip's valid frames. The embedding is two 1-D
convolutions (kernel 3, padding 1; the second stride 2), each followed by exact GELU, plus the
stored position table; then pre-LN transformer layers (q / v projections with bias, k without, as
HF); the head is, for Qwen2-Audio, an average pool of stride 2 over time, then the final LayerNorm
(HF's order: pool first).

Variable length. HF's Whisper and Qwen2-Audio encoders take exactly 2 * max_source_positions frames
(3000, 30 s) and raise otherwise; Qwen2-Audio pads every clip to 30 s and masks the padded positions
as attention keys after the convolutions. Here F may be any multiple of `cfg.frame_multiple`
(2 * pool) up to 3000: the position table's first F / 2 rows are used, and `lengths` masks the keys
past each clip's valid conv outputs (`conv_lengths`), so a clip's cost follows its length. The
valid outputs equal HF's on the same clip padded to 30 s when the frames past `lengths` are the
same as HF's padding frames (the log-mel of appended silence; `dflop_jax.data.audio` computes
them) for at least the two frames the convolutions read past the last valid one.

Packed windows. A row may instead hold several windows back to back, as an LLM row holds samples:
`windows` [B, F] numbers each frame's window (1, 2, ...; 0 on the row's padding) and `valid` [B, F]
marks each window's valid frames. Every window starts at a multiple of 4 frames (its kept frames are
a multiple of 2 * pool), so the stride-2 convolution and the pool never straddle two windows; the
convolutions read zeros past a window's edges (HF's conv padding), the positions restart at each
window, and attention stays within a window's valid outputs. Each window's valid outputs equal HF's
on that clip alone, and the encoder's work follows the row's kept frames, not a window per clip.

`AudioStage` holds layers [first_layer, first_layer + num_layers), plus the embedding if first and
the head if last, as `models.vit.VisionStage` does for images.

Parameter layouts and logical axes:
  conv1_kernel [3, M, D], conv2_kernel [3, D, D] (None, None, "embed"): replicated, being small (HF
  Conv1d weight [out, in, 3] reversed); pos_embed [P, D] ("pos", "embed"), frozen as
  HF freezes it (its gradient is zero); qkv_kernel [D, 3, H, Dh]; qv_bias [2, H, Dh] (q and v; k has
  no bias); o_kernel [H, Dh, D]; fc1 [D, F], fc2 [F, D]; norms [D].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import attention
from models.decoder_config import ATTENTION_IMPLS, REMAT_MODES
from models.layers import constrain, keyed_rngs, make_param, run_layers
from models.vit import ACTS, Norm, ViTMLP, stacked_init

DTYPES = ("float32", "bfloat16", "float16")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclasses.dataclass(frozen=True)
class WhisperEncoderConfig:
    """Shapes and numerics of a Whisper encoder (defaults: Whisper-large-v3's, Qwen2-Audio's tower).

    pool: average-pool stride over time before the final LayerNorm (1: Whisper; 2: Qwen2-Audio).
    max_source_positions: rows of the position table (conv outputs of a 30 s window).
    """

    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_layers: int = 32
    num_heads: int = 20
    num_mel_bins: int = 128
    max_source_positions: int = 1500
    pool: int = 1
    norm_eps: float = 1e-5
    act: str = "gelu"
    dtype: str = "float32"
    param_dtype: str = "float32"
    attention_impl: str | None = "xla"
    remat: str = "none"

    def __post_init__(self):
        name = type(self).__name__
        for field in ("hidden_size", "intermediate_size", "num_heads", "num_mel_bins",
                      "max_source_positions", "pool"):  # fmt: skip
            value = getattr(self, field)
            _check(value > 0, f"{name}.{field}={value} must be > 0")
        _check(self.num_layers >= 0, f"{name}.num_layers={self.num_layers} must be >= 0")
        _check(
            self.hidden_size % self.num_heads == 0,
            f"{name}.hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}",
        )
        _check(self.act in ACTS, f"{name}.act={self.act!r}; use one of {ACTS}")
        _check(self.remat in REMAT_MODES, f"{name}.remat={self.remat!r}; use one of {REMAT_MODES}")
        _check(
            self.attention_impl in ATTENTION_IMPLS,
            f"{name}.attention_impl={self.attention_impl!r}; use one of {ATTENTION_IMPLS}",
        )
        for field in ("dtype", "param_dtype"):
            value = getattr(self, field)
            _check(value in DTYPES, f"{name}.{field}={value!r}; use one of {DTYPES}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_frames(self) -> int:
        """Mel frames of one 30 s window (2 * max_source_positions: 3000)."""
        return 2 * self.max_source_positions

    @property
    def frame_multiple(self) -> int:
        """A frame count the encoder takes is a multiple of this (conv stride 2, then the pool)."""
        return 2 * self.pool

    def conv_lengths(self, frames):
        """Valid conv outputs of `frames` valid mel frames (HF `_get_feat_extract_output_lengths`)."""
        return (frames - 1) // 2 + 1

    def output_lengths(self, frames):
        """Valid encoder outputs (Qwen2-Audio: audio tokens) of `frames` valid mel frames."""
        return self.conv_lengths(frames) // self.pool

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


def conv1d(x: jax.Array, kernel: jax.Array, bias: jax.Array, stride: int) -> jax.Array:
    """x [B, T, Cin], kernel [3, Cin, Cout] -> [B, ceil(T / stride), Cout]: torch Conv1d(k=3, padding=1)."""
    y = jax.lax.conv_general_dilated(
        x, kernel.astype(x.dtype), (stride,), [(1, 1)], dimension_numbers=("NWC", "WIO", "NWC")
    )
    return y + bias.astype(x.dtype)


class AudioAttention(nnx.Module):
    """Bidirectional multi-head attention; q, k and v from one fused projection, biases on q and v."""

    def __init__(self, cfg: WhisperEncoderConfig, rngs: nnx.Rngs):
        d, h, dh, pd = cfg.hidden_size, cfg.num_heads, cfg.head_dim, jnp.dtype(cfg.param_dtype)
        init, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros
        self.cfg = cfg
        axes = ("embed", "qkv", "heads", "head_dim")
        self.qkv_kernel = make_param(rngs, stacked_init(init, 3), (d, 3, h, dh), axes, pd)
        self.qv_bias = make_param(rngs, zeros, (2, h, dh), axes[1:], pd)
        self.o_kernel = make_param(rngs, init, (h, dh, d), ("heads", "head_dim", "embed"), pd)
        self.o_bias = make_param(rngs, zeros, (d,), ("embed",), pd)

    def __call__(
        self, x: jax.Array, segment_ids: jax.Array | None, packed: bool = False
    ) -> jax.Array:
        """x [B,T,D]; segment_ids [B,T] (1 valid, 0 padding) or None, or with `packed` the
        windows' numbers (`packed_segments`: several per row) -> [B,T,D]."""
        y = jnp.einsum("btd,dchk->btchk", x, self.qkv_kernel[...].astype(x.dtype))  # [B,T,3,H,Dh]
        bias = self.qv_bias[...].astype(x.dtype)
        q, k, v = y[:, :, 0] + bias[0], y[:, :, 1], y[:, :, 2] + bias[1]
        q = constrain(q, ("batch", "length", "act_heads", "head_dim"))
        o = attention(
            q, k, v, segment_ids=segment_ids, causal=False,
            implementation=self.cfg.attention_impl, single_sample=not packed,
        )  # fmt: skip
        out = jnp.einsum("bthk,hkd->btd", o, self.o_kernel[...].astype(x.dtype))
        return out + self.o_bias[...].astype(x.dtype)


class AudioLayer(nnx.Module):
    """x + attn(norm1 x), then x + mlp(norm2 x) (HF self_attn_layer_norm / final_layer_norm)."""

    def __init__(self, cfg: WhisperEncoderConfig, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        self.norm1 = Norm(cfg.hidden_size, "layer_norm", cfg.norm_eps, pd, rngs)
        self.attn = AudioAttention(cfg, rngs)
        self.norm2 = Norm(cfg.hidden_size, "layer_norm", cfg.norm_eps, pd, rngs)
        self.mlp = ViTMLP(cfg, rngs)

    def __call__(
        self, x: jax.Array, segment_ids: jax.Array | None, packed: bool = False
    ) -> jax.Array:
        """x [B,T,D] -> [B,T,D] (`AudioAttention`'s arguments)."""
        x = x + self.attn(self.norm1(x), segment_ids, packed)
        return constrain(x + self.mlp(self.norm2(x)), ("batch", "length", "act_embed"))


def valid_segments(lengths: jax.Array | None, cfg: WhisperEncoderConfig, t: int):
    """[B,T] int32: 1 at each clip's valid conv outputs, 0 after them; None when `lengths` is None."""
    if lengths is None:
        return None
    valid = cfg.conv_lengths(jnp.asarray(lengths, jnp.int32))
    return (jnp.arange(t, dtype=jnp.int32)[None, :] < valid[:, None]).astype(jnp.int32)


def packed_segments(windows: jax.Array, valid: jax.Array) -> jax.Array:
    """[B,F/2] int32 attention segments of packed windows: conv output j belongs to the window of
    frame 2j and is valid when that frame is (conv_lengths: j < (valid - 1) // 2 + 1)."""
    return jnp.where(valid[:, ::2], windows[:, ::2], 0).astype(jnp.int32)


def _shifted(x: jax.Array, by: int, keep: jax.Array) -> jax.Array:
    """x [B,T,C] moved `by` steps along T (x[t - by] at t), zero where `keep` [B,T] is False or
    the step leaves the row."""
    pad = [(0, 0), (max(by, 0), max(-by, 0)), (0, 0)]
    moved = jnp.pad(x, pad)[:, max(-by, 0) : x.shape[1] + max(-by, 0)]
    return jnp.where(keep[..., None], moved, 0)


def packed_conv1d(x, kernel, bias, windows) -> jax.Array:
    """`conv1d` with stride 1 over packed windows: x [B,F,Cin], windows [B,F] -> [B,F,Cout], each
    window convolved alone (zeros past its edges)."""
    k = kernel.astype(x.dtype)
    same_prev = jnp.pad(windows[:, 1:] == windows[:, :-1], [(0, 0), (1, 0)])
    same_next = jnp.pad(windows[:, :-1] == windows[:, 1:], [(0, 0), (0, 1)])
    y = jnp.einsum("btc,cd->btd", _shifted(x, 1, same_prev), k[0])
    y = y + jnp.einsum("btc,cd->btd", x, k[1])
    y = y + jnp.einsum("btc,cd->btd", _shifted(x, -1, same_next), k[2])
    return y + bias.astype(x.dtype)


def packed_conv1d_stride2(x, kernel, bias, windows) -> jax.Array:
    """`conv1d` with stride 2 over packed windows that start at even frames: output j reads frames
    2j - 1 (zero at a window's first frame), 2j and 2j + 1 (always in 2j's window)."""
    k = kernel.astype(x.dtype)
    even, odd = x[:, 0::2], x[:, 1::2]
    starts = jnp.pad(windows[:, 1:] != windows[:, :-1], [(0, 0), (1, 0)], constant_values=True)
    prev = _shifted(odd, 1, ~starts[:, 0::2])
    y = jnp.einsum("btc,cd->btd", prev, k[0]) + jnp.einsum("btc,cd->btd", even, k[1])
    return y + jnp.einsum("btc,cd->btd", odd, k[2]) + bias.astype(x.dtype)


def window_positions(windows: jax.Array) -> jax.Array:
    """[B,F/2] int32: each conv output's index within its window (positions restart per window)."""
    w = windows[:, ::2]
    idx = jnp.broadcast_to(jnp.arange(w.shape[1], dtype=jnp.int32), w.shape)
    starts = jnp.pad(w[:, 1:] != w[:, :-1], [(0, 0), (1, 0)], constant_values=True)
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


class AudioStage(nnx.Module):
    """Encoder layers [first_layer, first_layer + num_layers), with optional embedding and head.

    Random init is keyed like `models.vit.VisionStage` (global layer index; "embed", "head").
    """

    def __init__(
        self,
        cfg: WhisperEncoderConfig,
        *,
        first_layer: int,
        num_layers: int,
        has_embedding: bool,
        has_head: bool,
        rngs: nnx.Rngs,
    ):
        if first_layer < 0 or num_layers < 0 or first_layer + num_layers > cfg.num_layers:
            raise ValueError(
                f"audio stage layers [{first_layer}, {first_layer + num_layers}) fall outside the "
                f"encoder's {cfg.num_layers} layers; pick a range inside it"
            )
        self.cfg = cfg
        self.first_layer, self.num_layers = first_layer, num_layers
        self.has_embedding, self.has_head = has_embedding, has_head
        if has_embedding:
            self._init_embedding(cfg, keyed_rngs(rngs, "embed"))
        self.layers = nnx.List(
            [AudioLayer(cfg, keyed_rngs(rngs, "layer", first_layer + j)) for j in range(num_layers)]
        )
        if has_head:
            pd = jnp.dtype(cfg.param_dtype)
            head = keyed_rngs(rngs, "head")
            self.post_norm = Norm(cfg.hidden_size, "layer_norm", cfg.norm_eps, pd, head)

    def _init_embedding(self, cfg: WhisperEncoderConfig, rngs: nnx.Rngs) -> None:
        d, m, pd = cfg.hidden_size, cfg.num_mel_bins, jnp.dtype(cfg.param_dtype)
        init, zeros = nnx.initializers.lecun_normal(in_axis=(0, 1)), nnx.initializers.zeros
        self.conv1_kernel = make_param(rngs, init, (3, m, d), (None, None, "embed"), pd)
        self.conv1_bias = make_param(rngs, zeros, (d,), ("embed",), pd)
        self.conv2_kernel = make_param(rngs, init, (3, d, d), (None, None, "embed"), pd)
        self.conv2_bias = make_param(rngs, zeros, (d,), ("embed",), pd)
        pos = nnx.initializers.normal(0.02)
        self.pos_embed = make_param(rngs, pos, (cfg.max_source_positions, d), ("pos", "embed"), pd)

    def embed(self, features: jax.Array, windows: jax.Array | None = None) -> jax.Array:
        """features [B,F,M] -> [B,F/2,D] in the compute dtype (F a multiple of `frame_multiple`; at
        most one 30 s window unless `windows` [B,F] packs several, see the module docstring)."""
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        f = features.shape[1]
        longest = cfg.max_frames if windows is None else f
        if features.shape[2] != cfg.num_mel_bins or f % cfg.frame_multiple or f > longest:
            raise ValueError(
                f"audio features {features.shape}: want [B, F, {cfg.num_mel_bins}] with F a "
                f"multiple of {cfg.frame_multiple} and at most {cfg.max_frames} (one 30 s window)"
            )
        gelu = functools.partial(jax.nn.gelu, approximate=False)  # after both convs, as HF
        k1, b1, k2, b2 = (p[...] for p in (self.conv1_kernel, self.conv1_bias,
                                           self.conv2_kernel, self.conv2_bias))  # fmt: skip
        if windows is None:
            x = gelu(conv1d(gelu(conv1d(features.astype(dt), k1, b1, 1)), k2, b2, 2))
            pos = self.pos_embed[: x.shape[1]]
        else:
            x = gelu(packed_conv1d(features.astype(dt), k1, b1, windows))
            x = gelu(packed_conv1d_stride2(x, k2, b2, windows))
            pos = self.pos_embed[...][
                jnp.minimum(window_positions(windows), cfg.max_source_positions - 1)
            ]
        return x + jax.lax.stop_gradient(pos).astype(dt)  # the table is frozen, as HF's

    def head(self, x: jax.Array) -> jax.Array:
        """[B,T,D] -> [B,T/pool,D]: average pool over time (floor, as torch AvgPool1d), final norm."""
        p = self.cfg.pool
        if p > 1:
            b, t, d = x.shape
            x = x[:, : t // p * p].reshape(b, t // p, p, d).mean(axis=2)  # [B, T/p, D]
        return self.post_norm(x)

    def __call__(
        self,
        x: jax.Array,
        lengths: jax.Array | None = None,
        windows: jax.Array | None = None,
        valid: jax.Array | None = None,
    ) -> jax.Array:
        """features [B,F,M] (if has_embedding) or hidden [B,T,D] -> hidden [B,T,D] (or the head's
        [B,T/pool,D]). lengths [B]: valid mel frames per clip (None: every frame is valid); or,
        packed, windows and valid [B,F]: each frame's window and validity (module docstring)."""
        if self.has_embedding:
            x = self.embed(x, windows)
        x = constrain(x.astype(jnp.dtype(self.cfg.dtype)), ("batch", "length", "act_embed"))
        if windows is not None:
            segment_ids = packed_segments(windows, valid)
        else:
            segment_ids = valid_segments(lengths, self.cfg, x.shape[1])
        packed = windows is not None  # several windows per row: not a one-sample row's kernel
        x = run_layers(self.layers, x, segment_ids, packed, remat=self.cfg.remat)
        return self.head(x) if self.has_head else x


class AudioTower(nnx.Module):
    """The whole encoder as one stage: features [B,F,M] -> last hidden state [B,F/(2 pool),D]."""

    def __init__(self, cfg: WhisperEncoderConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.stage = AudioStage(
            cfg,
            first_layer=0,
            num_layers=cfg.num_layers,
            has_embedding=True,
            has_head=True,
            rngs=rngs,
        )

    def __call__(self, features: jax.Array, lengths: jax.Array | None = None) -> jax.Array:
        return self.stage(features, lengths)


WHISPER_PRESETS: dict[str, WhisperEncoderConfig] = {
    # openai/whisper-large-v3 encoder (128 mel bins).
    "whisper-large-v3": WhisperEncoderConfig(dtype="bfloat16"),
    # openai/whisper-base encoder (80 mel bins).
    "whisper-base": WhisperEncoderConfig(
        hidden_size=512,
        intermediate_size=2048,
        num_layers=6,
        num_heads=8,
        num_mel_bins=80,
        dtype="bfloat16",
    ),  # fmt: skip
    # Qwen/Qwen2-Audio-7B audio tower: Whisper-large-v3's shapes, pooled by 2 before the norm.
    "qwen2-audio": WhisperEncoderConfig(pool=2, dtype="bfloat16"),
}
