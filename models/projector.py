"""Vision -> LLM projectors and the per-tile post-processing of LLaVA-OneVision video frames.

- `MlpProjector`: LLaVA-OV `mlp2x_gelu` (linear, GELU, linear; HF `LlavaOnevisionMultiModalProjector`),
  optionally with a LayerNorm in front (InternVL's projector after the pixel shuffle).
- `pixel_shuffle`: InternVL's 0.5 space-to-depth of a tile's patch grid (HF `InternVLModel.pixel_shuffle`,
  reproduced step by step, including its width/height naming swap).
- `pool_tiles`: LLaVA-OV video frames pooled 2x2 (bilinear to ceil(p/2), HF `apply_pooling`) on tiles
  flagged `tile_pool`; the pooled features fill the FIRST ceil(p/2)^2 rows of the tile's slot (the
  convention of `models/layouts.py`), the remaining rows are zero.

Logical axes: linear_1 [Din, D] ("embed", "mlp") column split, linear_2 [D, D] ("mlp", "embed") row split.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.layers import constrain, make_param
from models.layouts import bilinear_taps
from models.vit import Norm, gelu


class MlpProjector(nnx.Module):
    """[T, N, Din] -> [T, N, D]: (LayerNorm) -> linear_1 -> GELU -> linear_2."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        bias: bool = True,
        act: str = "gelu",
        pre_norm_eps: float | None = None,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        init, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros
        self.act, self.bias, self.dtype = act, bias, dtype
        self.has_norm = pre_norm_eps is not None
        if self.has_norm:
            self.norm = Norm(d_in, "layer_norm", pre_norm_eps, param_dtype, rngs)
        self.linear_1 = make_param(rngs, init, (d_in, d_out), ("embed", "mlp"), param_dtype)
        self.linear_2 = make_param(rngs, init, (d_out, d_out), ("mlp", "embed"), param_dtype)
        if bias:
            self.bias_1 = make_param(rngs, zeros, (d_out,), ("mlp",), param_dtype)
            self.bias_2 = make_param(rngs, zeros, (d_out,), ("embed",), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(self.dtype)
        if self.has_norm:
            x = self.norm(x)
        h = jnp.einsum("tnc,cd->tnd", x, self.linear_1[...].astype(x.dtype))
        if self.bias:
            h = h + self.bias_1[...].astype(x.dtype)
        h = constrain(gelu(h, self.act), ("batch", "length", "act_mlp"))
        out = jnp.einsum("tnd,de->tne", h, self.linear_2[...].astype(x.dtype))
        if self.bias:
            out = out + self.bias_2[...].astype(x.dtype)
        return out


def pixel_shuffle(x: jax.Array, ratio: float = 0.5) -> jax.Array:
    """[T, N, C] patch features (N = s*s, row-major) -> [T, N*ratio^2, C/ratio^2] as HF InternVL."""
    t, n, c = x.shape
    s = math.isqrt(n)
    if s * s != n or (s * ratio) != int(s * ratio):
        raise ValueError(f"pixel_shuffle: {n} patches is not a square grid divisible by 1/{ratio}")
    r = int(round(1 / ratio))
    x = x.reshape(t, s, s // r, c * r)  # HF view(b, w, h*s, c/s)
    x = x.transpose(0, 2, 1, 3)  # [T, s/r, s, C*r]
    x = x.reshape(t, s // r, s // r, c * r * r)
    x = x.transpose(0, 2, 1, 3)  # [T, s/r, s/r, C*r*r]
    return x.reshape(t, (s // r) ** 2, c * r * r)


def _pool_matrix(p: int) -> np.ndarray:
    """[ceil(p/2), p] bilinear (align_corners=False) interpolation matrix, as torch `interpolate`."""
    q = math.ceil(p / 2)
    idx, w = bilinear_taps(p, q)
    m = np.zeros((q, p), np.float64)
    np.add.at(m, (np.arange(q)[:, None], idx), w)
    return m


def pool_2x2(features: jax.Array, patches_per_side: int) -> jax.Array:
    """[T, p*p, D] -> [T, ceil(p/2)^2, D]: bilinear downscale of each tile's p x p feature map."""
    p = patches_per_side
    m = jnp.asarray(_pool_matrix(p), features.dtype)
    grid = features.reshape(features.shape[0], p, p, features.shape[-1])
    pooled = jnp.einsum("iy,jx,tyxd->tijd", m, m, grid)
    return pooled.reshape(features.shape[0], -1, features.shape[-1])


def pool_tiles(features: jax.Array, tile_pool: jax.Array, patches_per_side: int) -> jax.Array:
    """[T, p*p, D] with pooled tiles' features moved to their slot's first rows (rest zero).

    tile_pool: [T] bool, True for video frames.
    """
    pooled = pool_2x2(features, patches_per_side)
    pad = features.shape[1] - pooled.shape[1]
    pooled = jnp.pad(pooled, ((0, 0), (0, pad), (0, 0)))
    return jnp.where(tile_pool[:, None, None], pooled, features)
