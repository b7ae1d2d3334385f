"""The FLOP formulas against XLA's own count (`compiled.cost_analysis()`) of hand-written jnp layers.

An independent reference: XLA counts 2 FLOPs per multiply-add of every dot it compiles. Dense (masked)
attention computes all S x S pairs, so the decoder layer is compared at pairs = S * S. Elementwise work
(norms, softmax, activations) is what separates the two counts; at these widths it is < 1% of the dots,
hence the 2% tolerance.
"""

import dataclasses
import math
import re

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


@pytest.mark.parametrize(
    ("name", "published"),
    # HF meta-device counts of the encoders (WhisperEncoder of openai/whisper-large-v3 and
    # openai/whisper-base; Qwen2AudioEncoder of Qwen/Qwen2-Audio-7B), positions included; and
    # Qwen2-Audio-7B's multi_modal_projector (1280 -> 4096, with bias).
    [("whisper-large-v3", 636_968_960), ("whisper-base", 20_590_592), ("qwen2-audio", 636_968_960)],
)
def test_audio_encoder_params_are_the_published_counts(name, published):
    from dflop_jax.costs import AUDIO_PRESETS, audio_params

    assert audio_params(AUDIO_PRESETS[name]) == published
    if name == "qwen2-audio":
        assert audio_params(AUDIO_PRESETS[name], 4096) - published == 1280 * 4096 + 4096


def _dot_flops(lowered_text: str) -> float:
    """2 x output elements x contracted size of every `stablehlo.dot_general` of a lowered program:
    its matmul work as jax lowers it (XLA's own count adds elementwise work, which Whisper's exact
    GELU makes 4-20% here, and which the model-FLOP convention leaves out)."""
    total = 0.0
    for line in lowered_text.splitlines():
        if "stablehlo.dot_general" not in line:
            continue
        contracted = re.search(r"contracting_dims = \[([\d, ]*)\]", line).group(1)
        lhs, out = re.search(r": \(tensor<([\dx]+)x\w+>,.*-> tensor<([\dx]+)x\w+>", line).groups()
        lhs_dims = [int(v) for v in lhs.split("x")]
        k = math.prod(lhs_dims[int(i)] for i in contracted.split(","))
        total += 2.0 * math.prod(int(v) for v in out.split("x")) * k
    return total


def test_audio_encoder_forward_matches_its_lowered_matmuls():
    """`models.whisper.AudioStage` on a packed row of two windows (256 frames, 128 positions: one
    dense attention pass): the audio FLOP formulas equal the matmul work of the lowered program,
    and XLA's whole count is within the elementwise share above them."""
    from flax import nnx

    from dflop_jax.costs import AudioArch, audio_flops
    from models.whisper import AudioStage, WhisperEncoderConfig

    d, f, m, frames = 256, 1024, 80, 256
    cfg = WhisperEncoderConfig(hidden_size=d, intermediate_size=f, num_layers=2, num_heads=4,
                               num_mel_bins=m, max_source_positions=128, pool=2)  # fmt: skip
    arch = AudioArch("xla-check", 2, d, 4, f, m, max_source_positions=128, pool=2)
    stage = AudioStage(cfg, first_layer=0, num_layers=2, has_embedding=True, has_head=True,
                       rngs=nnx.Rngs(0))  # fmt: skip
    graph, state = nnx.split(stage)
    windows = jnp.concatenate([jnp.full((1, 96), 1), jnp.full((1, 160), 2)], axis=1)

    def forward(state, x):
        return nnx.merge(graph, state)(x, None, windows, windows > 0)

    lowered = jax.jit(forward).lower(state, jax.ShapeDtypeStruct((1, frames, m), jnp.float32))
    assert _dot_flops(lowered.as_text()) == pytest.approx(audio_flops(arch, frames), rel=1e-6)
    cost = lowered.compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert 1.0 < float(cost["flops"]) / audio_flops(arch, frames) < 1.1
