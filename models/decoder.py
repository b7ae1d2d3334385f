"""Decoder-only LLM (Qwen2 / Qwen2.5 and Llama 3 in one config-driven implementation), cut into stages.

`DecoderStage` holds only a contiguous layer range (plus the embedding table when it is the first
stage, plus final norm and head when it is the last), so a pipeline stage materializes only its own
weights. `Decoder` is the whole model: `Decoder(cfg, rngs=...)(input_ids) -> logits`.

Tied embeddings across stages: a head stage that does not also hold the embedding keeps its own copy
of the embedding matrix in `embed_tokens` (used as the output head). The runtime must keep the two
copies equal (sum their gradients) — exactly what a tied parameter means under pipeline parallelism.

Parameter layouts (head-aligned, Megatron column/row split on "heads"/"kv_heads"/"mlp"):
  q_kernel [D,H,Dh] k_kernel/v_kernel [D,K,Dh] o_kernel [H,Dh,D]; gate/up [D,F] down [F,D];
  embed_tokens.weight [V,D]; lm_head [D,V]; norms [D].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import attention
from models.decoder_config import DecoderConfig
from models.layers import (
    Embedding,
    RMSNorm,
    SwiGLU,
    apply_rope,
    constrain,
    extract_layer_range,
    keyed_rngs,
    make_param,
    rope_cos_sin,
    rope_inv_freq,
    run_layers,
)
from models.loss import chunked_cross_entropy_sum


class SelfAttention(nnx.Module):
    """GQA self-attention with optional q/k/v bias and RoPE, causal within packed segments."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pd = cfg.param_jnp_dtype
        init = nnx.initializers.lecun_normal()
        self.cfg = cfg
        self.q_kernel = make_param(rngs, init, (d, h, dh), ("embed", "heads", "head_dim"), pd)
        self.k_kernel = make_param(rngs, init, (d, k, dh), ("embed", "kv_heads", "head_dim"), pd)
        self.v_kernel = make_param(rngs, init, (d, k, dh), ("embed", "kv_heads", "head_dim"), pd)
        self.o_kernel = make_param(rngs, init, (h, dh, d), ("heads", "head_dim", "embed"), pd)
        if cfg.qkv_bias:
            zeros = nnx.initializers.zeros
            self.q_bias = make_param(rngs, zeros, (h, dh), ("heads", "head_dim"), pd)
            self.k_bias = make_param(rngs, zeros, (k, dh), ("kv_heads", "head_dim"), pd)
            self.v_bias = make_param(rngs, zeros, (k, dh), ("kv_heads", "head_dim"), pd)

    def _project(self, x, kernel, bias, axes):
        y = jnp.einsum("bsd,dhk->bshk", x, kernel[...].astype(x.dtype))
        if bias is not None:
            y = y + bias[...].astype(x.dtype)
        return constrain(y, ("batch", "length", axes, "head_dim"))

    def __call__(self, x, segment_ids, cos, sin):
        """x [B,S,D]; segment_ids [B,S] or None; cos, sin [B,S,Dh/2] -> [B,S,D]."""
        bias = self.cfg.qkv_bias
        q = self._project(x, self.q_kernel, self.q_bias if bias else None, "act_heads")
        k = self._project(x, self.k_kernel, self.k_bias if bias else None, "act_kv_heads")
        v = self._project(x, self.v_kernel, self.v_bias if bias else None, "act_kv_heads")
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attention(
            q, k, v, segment_ids=segment_ids, causal=True,
            implementation=self.cfg.attention_impl, single_sample=self.cfg.single_sample_rows,
        )  # fmt: skip
        return jnp.einsum("bshk,hkd->bsd", o, self.o_kernel[...].astype(x.dtype))


class DecoderLayer(nnx.Module):
    """Pre-norm block: h + attn(norm(h)), then h + mlp(norm(h))."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        pd = cfg.param_jnp_dtype
        self.input_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)
        self.attn = SelfAttention(cfg, rngs=rngs)
        self.post_attn_norm = RMSNorm(
            cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pd, rngs=rngs
        )
        self.mlp = SwiGLU(
            cfg.hidden_size, cfg.intermediate_size, dtype=cfg.jnp_dtype, param_dtype=pd, rngs=rngs
        )

    def __call__(self, h, segment_ids, cos, sin):
        """h [B,S,D] -> [B,S,D]."""
        h = h + self.attn(self.input_norm(h), segment_ids, cos, sin)
        h = h + self.mlp(self.post_attn_norm(h))
        return constrain(h, ("batch", "length", "act_embed"))


class DecoderStage(nnx.Module):
    """Layers [first_layer, first_layer + num_layers) of the decoder, plus embedding and/or head.

    Random init is keyed (`keyed_rngs`): layer i by its global index, the embedding and the head by
    name, so this stage's params equal the same range of the whole `Decoder` built with the same rngs.
    """

    def __init__(
        self,
        cfg: DecoderConfig,
        *,
        first_layer: int,
        num_layers: int,
        has_embedding: bool,
        has_head: bool,
        rngs: nnx.Rngs,
    ):
        if first_layer < 0 or num_layers < 0 or first_layer + num_layers > cfg.num_layers:
            raise ValueError(
                f"stage layers [{first_layer}, {first_layer + num_layers}) fall outside the "
                f"model's {cfg.num_layers} layers; pick a range inside it"
            )
        dt, pd = cfg.jnp_dtype, cfg.param_jnp_dtype
        self.cfg = cfg
        self.first_layer, self.num_layers = first_layer, num_layers
        self.has_embedding, self.has_head = has_embedding, has_head
        if has_embedding or (has_head and cfg.tie_embeddings):  # the tied copy draws the same
            self.embed_tokens = Embedding(
                cfg.vocab_size, cfg.hidden_size, dtype=dt, param_dtype=pd,
                rngs=keyed_rngs(rngs, "embed"),
            )  # fmt: skip
        self.layers = nnx.List(
            [
                DecoderLayer(cfg, rngs=keyed_rngs(rngs, "layer", first_layer + j))
                for j in range(num_layers)
            ]
        )
        if has_head:
            head = keyed_rngs(rngs, "head")
            self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pd, rngs=head)
            if not cfg.tie_embeddings:
                init = nnx.initializers.normal(stddev=0.02)
                self.lm_head = make_param(
                    head, init, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), pd
                )

    def gathered_params(self) -> tuple[tuple[str, ...], ...]:
        """The paths (from this stage) of the params it reads only by a gather of rows, cast after
        it (`Embedding.__call__`): its token embedding, unless that is also its tied head."""
        if self.has_embedding and not (self.has_head and self.cfg.tie_embeddings):
            return (("embed_tokens", "weight"),)
        return ()

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [B,S] int32 -> [B,S,D] in the compute dtype."""
        if not self.has_embedding:
            raise ValueError("this stage holds no embedding (has_embedding=False)")
        return self.embed_tokens(tokens)

    def __call__(self, h: jax.Array, segment_ids: jax.Array | None, positions: jax.Array):
        """Runs this stage's layers. h [B,S,D]; segment_ids [B,S] or None; positions [B,S]."""
        cfg = self.cfg
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        cos, sin = rope_cos_sin(positions, inv_freq)
        h = constrain(h.astype(cfg.jnp_dtype), ("batch", "length", "act_embed"))
        return run_layers(self.layers, h, segment_ids, cos, sin, remat=cfg.remat)

    def _final_norm(self, h: jax.Array) -> jax.Array:
        if not self.has_head:
            raise ValueError("this stage holds no head (has_head=False)")
        return self.norm(h.astype(self.cfg.jnp_dtype))

    def _project(self, h: jax.Array) -> jax.Array:
        """Normed h [B,c,D] -> logits [B,c,V]; casts the stored weight inside (see `loss`)."""
        if self.cfg.tie_embeddings:
            out = self.embed_tokens.attend(h)
        else:
            out = jnp.einsum("bsd,dv->bsv", h, self.lm_head[...].astype(h.dtype))
        return constrain(out, ("batch", "length", "act_vocab"))

    def logits(self, h: jax.Array) -> jax.Array:
        """h [B,S,D] -> logits [B,S,V] (final norm + head), in the compute dtype."""
        return self._project(self._final_norm(h))

    def loss(
        self, h: jax.Array, targets: jax.Array, loss_mask: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """(summed cross-entropy, loss-token count) of h [B,S,D]; equals
        `cross_entropy_sum(self.logits(h), ...)` but projects `cfg.loss_chunk` positions at a time,
        so the [B,S,V] float32 logits never exist (forward or backward)."""
        return chunked_cross_entropy_sum(
            self._final_norm(h), self._project, targets, loss_mask, chunk=self.cfg.loss_chunk
        )


def default_positions(input_ids: jax.Array) -> jax.Array:
    """[B,S] -> positions 0..S-1 for every row (one segment per row)."""
    b, s = input_ids.shape
    return jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))


class Decoder(nnx.Module):
    """The whole decoder: one stage holding every layer, the embedding and the head."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.stage = DecoderStage(
            cfg,
            first_layer=0,
            num_layers=cfg.num_layers,
            has_embedding=True,
            has_head=True,
            rngs=rngs,
        )

    def embed(self, input_ids: jax.Array) -> jax.Array:
        """[B,S] int32 -> [B,S,D]."""
        return self.stage.embed(input_ids)

    def forward_embeddings(self, h, segment_ids=None, positions=None) -> jax.Array:
        """Embeddings h [B,S,D] (e.g. text with image features placed in) -> logits [B,S,V]."""
        if positions is None:
            positions = default_positions(h[..., 0])
        return self.stage.logits(self.stage(h, segment_ids, positions))

    def __call__(self, input_ids, segment_ids=None, positions=None) -> jax.Array:
        """input_ids [B,S] int32 -> logits [B,S,V]; defaults: one segment, positions 0..S-1."""
        return self.forward_embeddings(self.embed(input_ids), segment_ids, positions)

    def loss(self, input_ids, targets, loss_mask, segment_ids=None, positions=None):
        """(summed cross-entropy, loss-token count) of `self(input_ids, ...)` without full logits."""
        if positions is None:
            positions = default_positions(input_ids)
        h = self.stage(self.embed(input_ids), segment_ids, positions)
        return self.stage.loss(h, targets, loss_mask)


def extract_stage(
    decoder: Decoder, *, first_layer: int, num_layers: int, has_embedding: bool, has_head: bool
) -> DecoderStage:
    """A `DecoderStage` sharing the arrays of `decoder` for the given layer range (no copy)."""
    cfg = decoder.cfg
    full = dict(nnx.to_flat_state(nnx.state(decoder.stage)))
    return extract_layer_range(
        lambda: DecoderStage(
            cfg,
            first_layer=first_layer,
            num_layers=num_layers,
            has_embedding=has_embedding,
            has_head=has_head,
            rngs=nnx.Rngs(0),
        ),
        full,
        (),
        ("layers",),
        first_layer,
    )
