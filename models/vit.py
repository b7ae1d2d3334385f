"""Pre-norm vision transformer shared by SigLIP (`models/siglip.py`) and InternViT (`models/internvit.py`).

`VisionStage` holds encoder layers [first_layer, first_layer + num_layers) plus, optionally, the
embedding (pixels [T,H,W,C] -> [T,N,D]) and the head (the post-norm when the config asks for it), so a
pipeline stage materializes only its own layers. HF `hidden_states[k]` (k = 0 embeddings, k = i after
layer i) is what a stage ending at layer k returns without its head.

Parameter layouts and logical axes (see `dflop_jax/programs/sharding.py`):
  patch_kernel [P*P*C, D] ("patch","embed") (HF conv weight [D,C,P,P] transposed to (py,px,c) rows);
  pos_embed [N(+1), D] ("pos","embed"); cls_token [D] ("embed");
  qkv_kernel [D,3,H,Dh] ("embed","qkv","heads","head_dim"): q, k and v in one matmul, heads kept
  as their own axis so tensor parallelism splits heads (never the fused column); qkv_bias [3,H,Dh];
  o_kernel [H,Dh,D];
  qk-norm scales [H,Dh] ("heads","head_dim") (RMSNorm over all heads, as InternViT-6B);
  fc1 [D,F] ("embed","mlp"), fc2 [F,D] ("mlp","embed"); norms [D] ("norm"); layer scales [D] ("layer_scale").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import attention
from models.decoder_config import ATTENTION_IMPLS, REMAT_MODES
from models.layers import constrain, keyed_rngs, make_param, run_layers

NORMS = ("layer_norm", "rms_norm")
ACTS = ("gelu_tanh", "gelu")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """Shapes and numerics of a pre-norm ViT. `num_layers` counts the layers that are built.

    post_norm: apply the final norm in the head (SigLIP `post_layernorm`; InternViT without mean pooling).
    pixel_mean, pixel_std: per-channel normalization of uint8 pixels, applied by the embedding
      ((x / 255 - mean) / std, as the HF image processors do); the defaults are SigLIP's. Float
      pixels are taken as already normalized (HF parity tests feed the processor's output).
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    norm: str = "layer_norm"
    norm_eps: float = 1e-6
    act: str = "gelu_tanh"
    qkv_bias: bool = True
    qk_norm: bool = False
    layer_scale: bool = False
    cls_token: bool = False
    post_norm: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"
    attention_impl: str | None = "xla"
    remat: str = "none"
    pixel_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    pixel_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_heads", "image_size", "patch_size"):
            _check(
                getattr(self, name) > 0,
                f"{type(self).__name__}.{name}={getattr(self, name)} must be > 0",
            )
        _check(
            self.num_layers >= 0, f"{type(self).__name__}.num_layers={self.num_layers} must be >= 0"
        )
        _check(
            self.hidden_size % self.num_heads == 0,
            f"{type(self).__name__}.hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}",
        )
        _check(self.norm in NORMS, f"{type(self).__name__}.norm={self.norm!r}; use one of {NORMS}")
        _check(self.act in ACTS, f"{type(self).__name__}.act={self.act!r}; use one of {ACTS}")
        _check(
            self.remat in REMAT_MODES,
            f"{type(self).__name__}.remat={self.remat!r}; use one of {REMAT_MODES}",
        )
        _check(
            self.attention_impl in ATTENTION_IMPLS,
            f"{type(self).__name__}.attention_impl={self.attention_impl!r}; use one of "
            f"{ATTENTION_IMPLS}",
        )
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            _check(
                value in ("float32", "bfloat16", "float16"),
                f"{type(self).__name__}.{name}={value!r}; use 'float32', 'bfloat16' or 'float16'",
            )
        for name in ("pixel_mean", "pixel_std"):
            value = getattr(self, name)
            _check(
                len(value) == self.num_channels,
                f"{type(self).__name__}.{name}={value!r}; give one value per channel "
                f"({self.num_channels})",
            )
        _check(
            all(s > 0 for s in self.pixel_std),
            f"{type(self).__name__}.pixel_std={self.pixel_std!r} must be > 0",
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side**2

    @property
    def seq_len(self) -> int:
        """Tokens per tile inside the encoder (patches, plus the CLS token if any)."""
        return self.num_patches + int(self.cls_token)

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


class Norm(nnx.Module):
    """LayerNorm (scale + bias) or RMSNorm (scale), statistics in float32 as torch does."""

    def __init__(self, dim: int, kind: str, eps: float, param_dtype, rngs: nnx.Rngs):
        self.kind, self.eps = kind, eps
        self.scale = make_param(rngs, nnx.initializers.ones, (dim,), ("norm",), param_dtype)
        if kind == "layer_norm":
            self.bias = make_param(rngs, nnx.initializers.zeros, (dim,), ("norm",), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., D] -> [..., D] in x.dtype."""
        xf = x.astype(jnp.float32)
        if self.kind == "layer_norm":
            xf = xf - jnp.mean(xf, axis=-1, keepdims=True)
        y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + self.eps)
        y = y * self.scale[...].astype(jnp.float32)
        if self.kind == "layer_norm":
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


def gelu(x: jax.Array, act: str) -> jax.Array:
    return jax.nn.gelu(x, approximate=(act == "gelu_tanh"))


def stacked_init(init, n: int):
    """Initializer of a [D, n, ...] kernel as n independent draws of `init` over [D, ...]: the fused
    q / k / v kernel keeps the distribution of three separate ones."""

    def draw(key, shape, dtype):
        assert shape[1] == n, (shape, n)
        keys = jax.random.split(key, n)
        return jnp.stack([init(k, (shape[0], *shape[2:]), dtype) for k in keys], axis=1)

    return draw


class ViTAttention(nnx.Module):
    """Bidirectional multi-head self-attention with optional biases and qk RMSNorm; q, k and v come
    from one fused projection."""

    def __init__(self, cfg: ViTConfig, rngs: nnx.Rngs):
        d, h, dh, pd = cfg.hidden_size, cfg.num_heads, cfg.head_dim, jnp.dtype(cfg.param_dtype)
        init, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros
        self.cfg = cfg
        axes = ("embed", "qkv", "heads", "head_dim")
        self.qkv_kernel = make_param(rngs, stacked_init(init, 3), (d, 3, h, dh), axes, pd)
        if cfg.qkv_bias:
            self.qkv_bias = make_param(rngs, zeros, (3, h, dh), axes[1:], pd)
        self.o_kernel = make_param(rngs, init, (h, dh, d), ("heads", "head_dim", "embed"), pd)
        self.o_bias = make_param(rngs, zeros, (d,), ("embed",), pd)
        if cfg.qk_norm:
            ones = nnx.initializers.ones
            self.q_norm = make_param(rngs, ones, (h, dh), ("heads", "head_dim"), pd)
            self.k_norm = make_param(rngs, ones, (h, dh), ("heads", "head_dim"), pd)

    def _project(self, x):
        """x [T,N,D] -> q, k, v [T,N,H,Dh] from one matmul [T*N, D] x [D, 3*H*Dh]."""
        y = jnp.einsum("tnd,dchk->tnchk", x, self.qkv_kernel[...].astype(x.dtype))  # [T,N,3,H,Dh]
        if self.cfg.qkv_bias:
            y = y + self.qkv_bias[...].astype(x.dtype)
        return y[:, :, 0], y[:, :, 1], y[:, :, 2]

    def _rms_all_heads(self, y, scale):
        """RMSNorm over the flattened heads (HF normalizes the [.., H*Dh] projection)."""
        yf = y.astype(jnp.float32)
        var = jnp.mean(jnp.square(yf), axis=(-2, -1), keepdims=True)
        return (yf * jax.lax.rsqrt(var + 1e-6)).astype(y.dtype) * scale[...].astype(y.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [T,N,D] -> [T,N,D]."""
        q, k, v = self._project(x)
        if self.cfg.qk_norm:
            q, k = self._rms_all_heads(q, self.q_norm), self._rms_all_heads(k, self.k_norm)
        q = constrain(q, ("batch", "length", "act_heads", "head_dim"))
        o = attention(
            q, k, v, segment_ids=None, causal=False, implementation=self.cfg.attention_impl
        )
        out = jnp.einsum("tnhk,hkd->tnd", o, self.o_kernel[...].astype(x.dtype))
        return out + self.o_bias[...].astype(x.dtype)


class ViTMLP(nnx.Module):
    """fc2(gelu(fc1 x)), column split then row split on "mlp"."""

    def __init__(self, cfg: ViTConfig, rngs: nnx.Rngs):
        d, f, pd = cfg.hidden_size, cfg.intermediate_size, jnp.dtype(cfg.param_dtype)
        init, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros
        self.act = cfg.act
        self.fc1 = make_param(rngs, init, (d, f), ("embed", "mlp"), pd)
        self.fc1_bias = make_param(rngs, zeros, (f,), ("mlp",), pd)
        self.fc2 = make_param(rngs, init, (f, d), ("mlp", "embed"), pd)
        self.fc2_bias = make_param(rngs, zeros, (d,), ("embed",), pd)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [T,N,D] -> [T,N,D]."""
        h = jnp.einsum("tnd,df->tnf", x, self.fc1[...].astype(x.dtype)) + self.fc1_bias[...].astype(
            x.dtype
        )
        h = constrain(gelu(h, self.act), ("batch", "length", "act_mlp"))
        return jnp.einsum("tnf,fd->tnd", h, self.fc2[...].astype(x.dtype)) + self.fc2_bias[
            ...
        ].astype(x.dtype)


class ViTLayer(nnx.Module):
    """x + ls1 * attn(norm1 x), then x + ls2 * mlp(norm2 x) (layer scales only if configured)."""

    def __init__(self, cfg: ViTConfig, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        self.norm1 = Norm(cfg.hidden_size, cfg.norm, cfg.norm_eps, pd, rngs)
        self.attn = ViTAttention(cfg, rngs)
        self.norm2 = Norm(cfg.hidden_size, cfg.norm, cfg.norm_eps, pd, rngs)
        self.mlp = ViTMLP(cfg, rngs)
        self.layer_scale = cfg.layer_scale
        if cfg.layer_scale:
            init = nnx.initializers.constant(0.1)
            self.ls1 = make_param(rngs, init, (cfg.hidden_size,), ("layer_scale",), pd)
            self.ls2 = make_param(rngs, init, (cfg.hidden_size,), ("layer_scale",), pd)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [T,N,D] -> [T,N,D]."""
        a = self.attn(self.norm1(x))
        if self.layer_scale:
            a = a * self.ls1[...].astype(x.dtype)
        x = x + a
        m = self.mlp(self.norm2(x))
        if self.layer_scale:
            m = m * self.ls2[...].astype(x.dtype)
        return constrain(x + m, ("batch", "length", "act_embed"))


def normalize_pixels(pixels: jax.Array, mean, std) -> jax.Array:
    """uint8 [..., C] -> float32 (x / 255 - mean) / std; float pixels pass unchanged (already normalized).

    Runs inside the first encoder stage's program, so tiles cross host -> device as uint8 (a quarter
    of float32's bytes). The arithmetic is the host's former `data.images.normalize`, step for step:
    x * (1 / (255 std)) - mean / std in float32.
    """
    if pixels.dtype != jnp.uint8:
        return pixels
    std = jnp.asarray(std, jnp.float32)
    scale = jnp.float32(1.0) / (jnp.float32(255.0) * std)
    return pixels.astype(jnp.float32) * scale - jnp.asarray(mean, jnp.float32) / std


def patchify(pixels: jax.Array, patch: int) -> jax.Array:
    """[T,H,W,C] -> [T, (H//P)*(W//P), P*P*C], patches row-major, features ordered (py, px, c)."""
    t, h, w, c = pixels.shape
    nh, nw = h // patch, w // patch
    # A "valid" conv ignores the remainder (SigLIP: 384 px / 14 -> 27 patches, the last 6 px unused).
    x = pixels[:, : nh * patch, : nw * patch].reshape(t, nh, patch, nw, patch, c)
    x = x.transpose(0, 1, 3, 2, 4, 5)  # [T, nh, nw, P, P, C]
    return x.reshape(t, nh * nw, patch * patch * c)


class VisionStage(nnx.Module):
    """ViT layers [first_layer, first_layer + num_layers), with optional embedding and head.

    Random init is keyed like `models.decoder.DecoderStage` (global layer index; "embed", "head").
    """

    def __init__(
        self,
        cfg: ViTConfig,
        *,
        first_layer: int,
        num_layers: int,
        has_embedding: bool,
        has_head: bool,
        rngs: nnx.Rngs,
    ):
        if first_layer < 0 or num_layers < 0 or first_layer + num_layers > cfg.num_layers:
            raise ValueError(
                f"vision stage layers [{first_layer}, {first_layer + num_layers}) fall outside the "
                f"encoder's {cfg.num_layers} layers; pick a range inside it"
            )
        pd = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        self.first_layer, self.num_layers = first_layer, num_layers
        self.has_embedding, self.has_head = has_embedding, has_head
        if has_embedding:
            p, d, emb = cfg.patch_size, cfg.hidden_size, keyed_rngs(rngs, "embed")
            init = nnx.initializers.lecun_normal()
            self.patch_kernel = make_param(
                emb, init, (p * p * cfg.num_channels, d), ("patch", "embed"), pd
            )
            self.patch_bias = make_param(emb, nnx.initializers.zeros, (d,), ("embed",), pd)
            normal = nnx.initializers.normal(0.02)
            self.pos_embed = make_param(emb, normal, (cfg.seq_len, d), ("pos", "embed"), pd)
            if cfg.cls_token:
                self.cls = make_param(emb, normal, (d,), ("embed",), pd)
        self.layers = nnx.List(
            [ViTLayer(cfg, keyed_rngs(rngs, "layer", first_layer + j)) for j in range(num_layers)]
        )
        if has_head and cfg.post_norm:
            head = keyed_rngs(rngs, "head")
            self.post_norm = Norm(cfg.hidden_size, cfg.norm, cfg.norm_eps, pd, head)

    def embed(self, pixels: jax.Array) -> jax.Array:
        """pixels [T,H,W,C] (uint8, or float already normalized) -> [T,N(+1),D] in the compute dtype."""
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        pixels = normalize_pixels(pixels, cfg.pixel_mean, cfg.pixel_std)
        x = patchify(pixels.astype(dt), cfg.patch_size)
        x = jnp.einsum("tnp,pd->tnd", x, self.patch_kernel[...].astype(dt)) + self.patch_bias[
            ...
        ].astype(dt)
        if cfg.cls_token:
            cls = jnp.broadcast_to(self.cls[...].astype(dt), (x.shape[0], 1, x.shape[2]))
            x = jnp.concatenate([cls, x], axis=1)
        return x + self.pos_embed[...].astype(dt)

    def __call__(self, x: jax.Array) -> jax.Array:
        """pixels [T,H,W,C] (if has_embedding) or hidden [T,N,D] -> hidden [T,N,D] (post-normed if head)."""
        if self.has_embedding:
            x = self.embed(x)
        x = constrain(x.astype(jnp.dtype(self.cfg.dtype)), ("batch", "length", "act_embed"))
        x = run_layers(self.layers, x, remat=self.cfg.remat)
        if self.has_head and self.cfg.post_norm:
            x = self.post_norm(x)
        return x


class VisionTower(nnx.Module):
    """The whole encoder as one stage: pixels [T,H,W,C] -> last hidden state [T,N,D]."""

    def __init__(self, cfg: ViTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.stage = VisionStage(
            cfg,
            first_layer=0,
            num_layers=cfg.num_layers,
            has_embedding=True,
            has_head=True,
            rngs=rngs,
        )

    def __call__(self, pixels: jax.Array) -> jax.Array:
        return self.stage(pixels)
