"""Memory model: state bytes and tp sharding, and activations against what jax autodiff actually saves."""

import contextlib
import dataclasses
import io
import re

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import print_saved_residuals

from dflop_jax.costs import (
    AnalyticCostProvider,
    LLMArch,
    StageSpec,
    VisionArch,
    get_arch,
    get_device,
    llm_activation_bytes_per_token,
    llm_layer_params,
    vision_activation_bytes_per_token,
)
from dflop_jax.costs.memory import (
    RESIDUAL_POLICIES,
    dense_attention_bytes,
    pick_residuals,
    stage_memory,
)

ARCH = get_arch("siglip-so400m+qwen2.5-7b")
H100 = get_device("h100")


def test_state_bytes_and_tp_sharding():
    prov = AnalyticCostProvider(ARCH, H100)
    m1 = prov.stage_memory(StageSpec("llm", 0, 14, tp=1), 8192)
    m4 = prov.stage_memory(StageSpec("llm", 0, 14, tp=4), 8192)
    n = 14 * llm_layer_params(ARCH.llm)
    # the fp32 master and its bf16 copy (the programs take the copy, cast once per step)
    assert m1.params == pytest.approx((4 + 2) * n) and m1.grads == pytest.approx(4 * n)
    assert m1.optimizer == pytest.approx(8 * n)
    assert m4.params == pytest.approx(m1.params / 4, rel=0.01)
    assert m4.optimizer == pytest.approx(m1.optimizer / 4, rel=0.01)
    # an in-flight microbatch holds only its stage input: hidden [S, D] bf16 + segment ids, positions
    assert m1.activations_per_microbatch == m4.activations_per_microbatch == 8192 * (3584 * 2 + 8)
    assert m1.temp / 4 < m4.temp < m1.temp


def test_remat_keeps_layer_inputs_and_rebuilds_one_layer():
    stage, tokens, d = StageSpec("llm", 0, 14), 8192, 3584
    plain = AnalyticCostProvider(ARCH, H100).stage_memory(stage, tokens)
    remat = AnalyticCostProvider(ARCH, H100, remat=True).stage_memory(stage, tokens)
    full = llm_activation_bytes_per_token(ARCH.llm, 1, False, 2)
    # every layer keeps its bf16 input; one layer's full residuals exist at a time instead of 14
    assert plain.temp - remat.temp == pytest.approx(tokens * (13 * full - 14 * 2 * d))
    assert remat.activations_per_microbatch == plain.activations_per_microbatch
    n = 14 * llm_layer_params(ARCH.llm)
    fp32 = AnalyticCostProvider(ARCH, H100, remat=True, compute_bytes=4).stage_memory(stage, tokens)
    full32 = llm_activation_bytes_per_token(ARCH.llm, 1, False, 4)
    # fp32: no weight copies, the fp32 gradient only (4 B/param instead of bf16's 2 + 4)
    residuals = (14 * 4 * d + full32) * tokens + 2 * tokens * d * 4  # + dx, dy
    assert fp32.temp == pytest.approx(4 * n + residuals) and fp32.params == pytest.approx(4 * n)
    assert remat.temp - (14 * 2 * d + full) * tokens - 2 * tokens * d * 2 == pytest.approx(6 * n)


def test_remat_policy_per_module():
    policy = {"vision": "none", "llm": "dots"}
    prov = AnalyticCostProvider(ARCH, H100, remat=policy)
    llm, enc = StageSpec("llm", 0, 4), StageSpec("encoder", 0, 4)
    dots = prov.stage_memory(llm, 4096).temp
    assert AnalyticCostProvider(ARCH, H100, remat=True).stage_memory(llm, 4096).temp < dots
    assert dots < AnalyticCostProvider(ARCH, H100).stage_memory(llm, 4096).temp
    assert prov.stage_memory(enc, 8) == AnalyticCostProvider(ARCH, H100).stage_memory(enc, 8)
    assert prov.name.endswith("+remat:vision=none,llm=dots")
    with pytest.raises(ValueError, match="remat"):
        AnalyticCostProvider(ARCH, H100, remat={"vision": "some", "llm": "none"})


def test_dense_attention_adds_the_square():
    flash = AnalyticCostProvider(ARCH, H100).stage_memory(StageSpec("llm", 0, 2), 4096)
    dense = AnalyticCostProvider(ARCH, H100, flash_attention=False).stage_memory(
        StageSpec("llm", 0, 2), 4096
    )
    extra = 2 * 28 * 4096**2 * (1 + 4 + 4 + 2)
    assert dense.temp - flash.temp == pytest.approx(extra)


_BYTES = {"bf16": 2, "f32": 4, "bool": 1}


def _saved_bytes(fn, args, s):
    """(per-token bytes, bytes of [.., s, s] squares) of the residuals autodiff saves, args excluded."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_saved_residuals(fn, *args)
    per_token = square = 0
    for line in buf.getvalue().splitlines():
        m = re.match(r"(\w+)\[([\d,]*)\] (.*)", line)
        if not m or "from the argument" in m.group(3):
            continue
        dims = [int(x) for x in m.group(2).split(",") if x]
        size = _BYTES[m.group(1)] * int(jnp.prod(jnp.array(dims))) if dims else 0
        if dims.count(s) >= 2:
            square += size
        elif dims.count(s) == 1:
            per_token += size
    return per_token / s, square


def test_llm_activations_match_jax_saved_residuals():
    # A Qwen2-style layer written as the runtime computes it: RMSNorm with f32 statistics, f32 RoPE,
    # GQA dense attention with a causal mask, SwiGLU; bf16 compute from fp32 weights.
    s, d, h, k, dh, f = 96, 256, 4, 2, 64, 1024
    bf = jnp.bfloat16

    def norm(x, w):
        xf = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(xf), -1, keepdims=True)
        return w.astype(bf) * (xf * jax.lax.rsqrt(var + 1e-6)).astype(bf)

    def rope(x, cos, sin):
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        c, sn = cos[:, None, :], sin[:, None, :]
        return jnp.concatenate([x1 * c - x2 * sn, x2 * c + x1 * sn], -1).astype(bf)

    def layer(x, n1, n2, wq, wk, wv, wo, wg, wu, wd, positions):
        angles = positions.astype(jnp.float32)[:, None] * (1e4 ** -(jnp.arange(0, dh, 2) / dh))
        cos, sin = jnp.cos(angles), jnp.sin(angles)  # [s, dh/2], from integer positions
        y = norm(x, n1)
        q = rope((y @ wq.astype(bf)).reshape(s, h, dh), cos, sin)
        kk = rope((y @ wk.astype(bf)).reshape(s, k, dh), cos, sin)
        v = (y @ wv.astype(bf)).reshape(s, k, dh)
        qg = q.reshape(s, k, h // k, dh)
        logits = jnp.einsum("skgd,tkd->kgst", qg, kk, preferred_element_type=jnp.float32)
        logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -1e30)
        p = jax.nn.softmax(logits, -1).astype(bf)
        a = jnp.einsum("kgst,tkd->skgd", p, v).reshape(s, h * dh)
        x = x + a @ wo.astype(bf)
        y = norm(x, n2)
        return x + (jax.nn.silu(y @ wg.astype(bf)) * (y @ wu.astype(bf))) @ wd.astype(bf)

    shapes = [
        (d,),
        (d,),
        (d, h * dh),
        (d, k * dh),
        (d, k * dh),
        (h * dh, d),
        (d, f),
        (d, f),
        (f, d),
    ]
    args = [jnp.ones((s, d), bf)] + [jnp.ones(sh, jnp.float32) for sh in shapes]
    args += [jnp.arange(s)]
    per_token, square = _saved_bytes(layer, args, s)
    llm = LLMArch("probe", 1, d, h, k, f, 1000)
    flash_lse = 4 * h  # the formula's flash log-sum-exp, absent from this dense layer
    assert per_token == pytest.approx(llm_activation_bytes_per_token(llm) - flash_lse, rel=0.01)
    assert square == pytest.approx(dense_attention_bytes(h, s, 1, causal=True), rel=0.01)


def test_vit_activations_match_jax_saved_residuals():
    # A SigLIP-style block as the runtime computes it: LayerNorm with f32 statistics, biased q/k/v,
    # bidirectional dense attention, tanh-GELU MLP; bf16 compute from fp32 weights; 3 tiles of 100.
    t, n, d, h, dh, f = 3, 100, 256, 4, 64, 1024
    bf = jnp.bfloat16

    def norm(x, w, b):
        xf = x.astype(jnp.float32)
        xf = xf - jnp.mean(xf, -1, keepdims=True)
        y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), -1, keepdims=True) + 1e-6)
        return (y * w + b).astype(bf)

    def layer(x, n1w, n1b, n2w, n2b, wq, wk, wv, bq, bk, bv, wo, bo, w1, b1, w2, b2):
        y = norm(x, n1w, n1b)
        q, k, v = (
            (y @ w.astype(bf) + b.astype(bf)).reshape(t, n, h, dh)
            for w, b in ((wq, bq), (wk, bk), (wv, bv))
        )
        logits = jnp.einsum("tqhd,tkhd->thqk", q, k, preferred_element_type=jnp.float32)
        p = jax.nn.softmax(logits, -1).astype(bf)
        a = jnp.einsum("thqk,tkhd->tqhd", p, v).reshape(t, n, h * dh)
        x = x + a @ wo.astype(bf) + bo.astype(bf)
        y = norm(x, n2w, n2b)
        g = jax.nn.gelu(y @ w1.astype(bf) + b1.astype(bf), approximate=True)
        return x + g @ w2.astype(bf) + b2.astype(bf)

    shapes = (
        [(d,)] * 4
        + [(d, h * dh)] * 3
        + [(h * dh,)] * 3
        + [(h * dh, d), (d,), (d, f), (f,), (f, d), (d,)]
    )
    args = [jnp.ones((t, n, d), bf)] + [jnp.ones(sh, jnp.float32) for sh in shapes]
    per_token, square = _saved_bytes(layer, args, n)
    per_token /= t  # _saved_bytes divides by n only
    vit = VisionArch("probe", 1, d, h, f, 14, 140, 100)  # 10 x 10 patches
    flash_lse = 4 * h
    assert per_token == pytest.approx(vision_activation_bytes_per_token(vit) - flash_lse, rel=0.01)
    assert square == pytest.approx(t * dense_attention_bytes(h, n, 1, causal=False), rel=0.01)


def test_encoder_tile_short_enough_to_run_dense_keeps_its_attention_square(monkeypatch):
    """A SigLIP tile (729 tokens <= DENSE_MAX_TOKENS) runs the runtime's dense attention path on
    accelerators whatever the device's flash flag: its square is in the encoder stage's transient
    (the rebuilt layer's, under remat); a longer tile keeps only the flash log-sum-exp."""
    import dataclasses

    from dflop_jax.costs import memory
    from models.attention import dense_max

    assert dense_max("gpu") == memory.DENSE_MAX_TOKENS
    spec, tiles, v = StageSpec("encoder", 0, 4, has_embedding=True, has_head=True), 8, ARCH.vision
    flash = memory.encoder_stage_memory(ARCH, spec, tiles, remat=True, flash_attention=True)
    dense = memory.encoder_stage_memory(ARCH, spec, tiles, remat=True, flash_attention=False)
    assert flash.temp == dense.temp
    monkeypatch.setattr(memory, "DENSE_MAX_TOKENS", v.seq_len - 1)  # as if the tile ran blocked
    blocked = memory.encoder_stage_memory(ARCH, spec, tiles, remat=True, flash_attention=True)
    square = 16 * 729 * 729 * (4 + 2)  # heads x pairs x (f32 exp + bf16 probabilities)
    assert flash.temp - blocked.temp == pytest.approx(tiles * square)
    monkeypatch.undo()
    big = dataclasses.replace(ARCH, vision=dataclasses.replace(v, image_size=14 * 40))  # 1600
    long_flash = memory.encoder_stage_memory(big, spec, tiles, remat=True, flash_attention=True)
    long_dense = memory.encoder_stage_memory(big, spec, tiles, remat=True, flash_attention=False)
    assert long_dense.temp - long_flash.temp == pytest.approx(tiles * 16 * 1600**2 * 6)


def test_saved_residuals_are_held_by_every_in_flight_microbatch():
    """A saving policy moves an inner stage's layer residuals from the backward's transient into
    each in-flight microbatch, instead of its input (the driver keeps only the input the running
    forward reads): "all" holds every layer's, "layers" each layer's input and bf16 weight slice
    (one layer rebuilt at a time stays transient). Without remat the backward from them also holds
    one layer's cotangents beside them (its arguments are not freed). The last stage's fused program
    holds nothing between programs; the planner's pick is the policy with the least backward work
    that fits."""
    from dflop_jax.costs.memory import FEATURE_TAPS

    inner = StageSpec("llm", 0, 8, tp=2, dp=1, has_embedding=True)
    last = StageSpec("llm", 8, 8, tp=2, dp=1, has_head=True)
    tokens, d = 4096, ARCH.llm.hidden_size
    mem = {r: stage_memory(ARCH, inner, tokens, residuals=r) for r in RESIDUAL_POLICIES}
    remat = {r: stage_memory(ARCH, inner, tokens, True, residuals=r) for r in RESIDUAL_POLICIES}
    full = llm_activation_bytes_per_token(ARCH.llm, 2, False) * tokens
    kept = d * 2 * tokens
    # the feature placement's select mask, indices and bilinear taps
    placed = tokens * (d + 8 + FEATURE_TAPS * (4 + 2))
    assert mem["all"].activations_per_microbatch == pytest.approx(8 * full + placed)
    weights = 8 * llm_layer_params(ARCH.llm) / 2 * 2  # tp 2, bf16 (norms replicated: ~)
    assert mem["layers"].activations_per_microbatch == pytest.approx(8 * kept + weights + placed,
                                                                     rel=1e-3)  # fmt: skip
    inputs = mem["recompute"].activations_per_microbatch
    for r in ("all", "layers"):
        held = mem[r].activations_per_microbatch
        # (n - 1) more microbatches' residuals alive, not their inputs
        assert mem[r].total(3) - mem[r].total(1) == pytest.approx(2 * held)
        assert mem[r].total(3) - mem["recompute"].total(3) < 2 * held - 2 * inputs + held
    # one microbatch: the recompute backward's bytes, plus one layer's cotangents without remat
    assert mem["all"].total(1) == pytest.approx(mem["recompute"].total(1) + full)
    assert mem["layers"].total(1) == pytest.approx(remat["recompute"].total(1))
    tail = {r: stage_memory(ARCH, last, tokens, residuals=r) for r in RESIDUAL_POLICIES}
    assert tail["all"] == dataclasses.replace(tail["recompute"], residuals="all")
    # without layer remat, recompute rebuilds all 8 layers' residuals at once: more than "layers"
    assert mem["layers"].total(3) < mem["recompute"].total(3) < mem["all"].total(3)
    budgets = [mem["all"].total(3), mem["recompute"].total(3), 0.0]
    assert [pick_residuals(mem, 3, b) for b in budgets] == ["all", "layers", "layers"]
    assert pick_residuals(remat, 3, remat["recompute"].total(3)) == "recompute"


def test_saving_encoder_head_stage_holds_its_projector_and_pixels():
    """An encoder stage with the patch embedding and the projector under a saving policy holds, per
    in-flight microbatch, the layers' residuals, the patch pixels the embedding's backward reads
    and the projector's residuals (its input, and four bf16 values and a boolean per element of
    fc1's output), not the packed tiles."""
    from dflop_jax.costs.flops import vision_layer_params
    from dflop_jax.costs.memory import encoder_stage_memory, projector_activation_bytes_per_token

    v, p = ARCH.vision, ARCH.projector
    spec = StageSpec("encoder", 0, 4, has_embedding=True, has_head=True)
    tiles = 3
    rec = encoder_stage_memory(ARCH, spec, tiles, remat=True)
    mem = encoder_stage_memory(ARCH, spec, tiles, remat=True, residuals="all")
    assert projector_activation_bytes_per_token(p) == p.in_dim * 2 + 9 * p.out_dim
    pixels = tiles * v.patches_per_tile * 3 * v.patch_size**2 * 2
    projector = tiles * v.tokens_per_tile * projector_activation_bytes_per_token(p)
    layers = 4 * tiles * v.seq_len * v.hidden_size * 2
    weights = 4 * vision_layer_params(v) * 2  # the remat'd layers' bf16 weight slices
    assert mem.activations_per_microbatch == pytest.approx(pixels + projector + layers + weights)
    assert mem.total(1) == pytest.approx(rec.total(1))  # with remat: nothing on top
    assert mem.total(2) - mem.total(1) == pytest.approx(mem.activations_per_microbatch)


@pytest.mark.parametrize("policy", ["all", "layers"])
def test_held_residuals_match_the_residual_programs_outputs(policy):
    """What a saving stage's forward returns per microbatch (its residuals, per device) is what the
    memory model holds per in-flight microbatch, at two lengths (so per token and the fixed part: under
    "layers" the layers' bf16 weight slices; no full weight copy under "all")."""
    from dflop_jax.profiling.programs import per_device_bytes, profile_mesh, stage_program
    from dflop_jax.programs.model_section import model_config_for_arch

    cfg, arch = model_config_for_arch("tiny", "bfloat16"), get_arch("tiny")
    spec = StageSpec("llm", 0, 4, tp=1, dp=1)
    mesh = profile_mesh(jax.devices(), 1)
    for tokens in (256, 512):
        prog = stage_program(cfg, spec, mesh, tokens, jnp.bfloat16, residuals=policy)
        with jax.set_mesh(mesh):
            fwd = prog.jits.forward_residuals
            _, kept = jax.eval_shape(fwd, prog.params_abs, prog.x_abs, prog.side_abs)
        mem = stage_memory(arch, spec, tokens, residuals=policy)  # residuals instead of the input
        assert mem.activations_per_microbatch == pytest.approx(per_device_bytes(kept), rel=0.1)


def test_audio_activations_match_jax_saved_residuals():
    """`models.whisper.AudioLayer` itself (bf16 compute from fp32 weights, the dense path of a
    packed row masked to its windows): what autodiff saves per position, against the model."""
    from flax import nnx

    from dflop_jax.costs import AudioArch
    from dflop_jax.costs.memory import audio_activation_bytes_per_position
    from models.whisper import AudioLayer, WhisperEncoderConfig

    t, d, h, f = 100, 256, 4, 1024
    cfg = WhisperEncoderConfig(hidden_size=d, intermediate_size=f, num_layers=1, num_heads=h,
                               num_mel_bins=16, dtype="bfloat16")  # fmt: skip
    graph, state = nnx.split(AudioLayer(cfg, nnx.Rngs(0)))
    windows = jnp.concatenate([jnp.ones((2, 60), jnp.int32), 2 * jnp.ones((2, 40), jnp.int32)], 1)

    def layer(state, x):
        return nnx.merge(graph, state)(x, windows)

    per_token, square = _saved_bytes(layer, [state, jnp.ones((2, t, d), jnp.bfloat16)], t)
    per_token /= 2  # two rows
    arch = AudioArch("probe", 1, d, h, f, 16)
    flash_lse = 4 * h
    model = audio_activation_bytes_per_position(arch)
    assert per_token == pytest.approx(model - flash_lse, rel=0.01)
    assert square == pytest.approx(2 * dense_attention_bytes(h, t, 1, causal=True), rel=0.01)
    assert audio_activation_bytes_per_position(arch, remat=True) == d * 2


def test_audio_stage_memory_counts_the_audio_stage_params():
    """`audio_stage_memory`'s parameters (fp32 bytes / 4) equal the real `AudioEncoderStage`'s of
    each part an audio stage can hold (layers; + the convolutions and positions; + the pool's norm
    and the projector), counted from the nnx module; a frozen tower (projector-only recipe) moves
    the tower's bytes out of the gradients and optimizer state."""
    from flax import nnx
    from pipeline_fixtures import OMNI

    from dflop_jax.contracts.layout import StageSpec
    from dflop_jax.costs import arch_of_model
    from dflop_jax.costs.memory import audio_stage_memory
    from models.qwen2_audio import AudioEncoderStage

    arch = arch_of_model(OMNI)
    layers = OMNI.audio.audio.num_layers
    for emb, head in [(True, True), (False, True), (True, False), (False, False)]:
        spec = StageSpec("audio", 0, layers, has_embedding=emb, has_head=head)
        module = AudioEncoderStage(OMNI.audio, first_layer=0, num_layers=layers,
                                   has_embedding=emb, has_head=head, rngs=nnx.Rngs(0))  # fmt: skip
        real = sum(x.size for x in jax.tree.leaves(nnx.state(module, nnx.Param)))
        assert audio_stage_memory(arch, spec, 64).params == (4 + 2) * real, (emb, head)
    whole = StageSpec("audio", 0, layers, has_embedding=True, has_head=True)
    frozen = audio_stage_memory(arch, whole, 64, trainable=("projector",))
    trained = audio_stage_memory(arch, whole, 64)
    assert frozen.params == trained.params and frozen.optimizer < trained.optimizer
