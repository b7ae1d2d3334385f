"""The FLOP formulas against XLA's own count (`compiled.cost_analysis()`) of hand-written jnp layers.

An independent reference: XLA counts 2 FLOPs per multiply-add of every dot it compiles. Dense (masked)
attention computes all S x S pairs, so the decoder layer is compared at pairs = S * S. Elementwise work
(norms, softmax, activations) is what separates the two counts; at these widths it is < 1% of the dots,
hence the 2% tolerance.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from dflop_jax.costs import LLMArch, VisionArch, llm_layer_flops, vision_layer_flops


def _xla_flops(fn, *shapes) -> float:
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"])


def _rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)


def test_gqa_decoder_layer_matches_xla():
    llm = LLMArch("xla-check", 1, 256, 4, 2, 1024, 1000)
    s, d, h, k, dh, f = 256, 256, 4, 2, 64, 1024

    def layer(x, wq, wk, wv, wo, wg, wu, wd):
        y = _rms(x)
        q = (y @ wq).reshape(s, h, dh)
        kk = jnp.repeat((y @ wk).reshape(s, k, dh), h // k, axis=1)
        v = jnp.repeat((y @ wv).reshape(s, k, dh), h // k, axis=1)
        scores = jnp.einsum("qhd,khd->hqk", q, kk) / dh**0.5
        mask = jnp.tril(jnp.ones((s, s), bool))
        p = jax.nn.softmax(jnp.where(mask, scores, -1e9), -1)
        a = jnp.einsum("hqk,khd->qhd", p, v).reshape(s, h * dh)
        x = x + a @ wo
        y = _rms(x)
        return x + (jax.nn.silu(y @ wg) * (y @ wu)) @ wd

    xla = _xla_flops(
        layer, (s, d), (d, h * dh), (d, k * dh), (d, k * dh), (h * dh, d), (d, f), (d, f), (f, d)
    )
    assert xla == pytest.approx(llm_layer_flops(llm, s, s * s), rel=0.02)
    # and the MHA variant differs by exactly the extra K/V projection work in both counts
    mha = dataclasses.replace(llm, num_kv_heads=4)
    assert llm_layer_flops(mha, s, s * s) - llm_layer_flops(llm, s, s * s) == 2 * 2 * s * d * 2 * dh


def test_vit_layer_matches_xla():
    vit = VisionArch("xla-check", 1, 256, 4, 1024, 14, 224, 256)  # 16 x 16 = 256 patches per tile
    tiles, n, d, h, dh, f = 2, 256, 256, 4, 64, 1024

    def layer(x, wqkv, wo, w1, w2):
        y = _rms(x)
        q, kk, v = jnp.split((y @ wqkv).reshape(tiles, n, 3, h, dh), 3, axis=2)
        scores = jnp.einsum("tqhd,tkhd->thqk", q[:, :, 0], kk[:, :, 0]) / dh**0.5
        a = jnp.einsum("thqk,tkhd->tqhd", jax.nn.softmax(scores, -1), v[:, :, 0]).reshape(
            tiles, n, d
        )
        x = x + a @ wo
        return x + jax.nn.gelu(_rms(x) @ w1) @ w2

    xla = _xla_flops(layer, (tiles, n, d), (d, 3 * d), (d, d), (d, f), (f, d))
    assert xla == pytest.approx(vision_layer_flops(vit, tiles), rel=0.02)
