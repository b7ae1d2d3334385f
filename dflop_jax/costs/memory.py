"""Per-device memory of a pipeline stage: parameters, gradients, optimizer state, activations.

State, per parameter, replicated across data parallelism (no ZeRO) and sharded by tensor parallelism
(matrices split over tp, norms replicated): fp32 parameters that double as the master copy (4 B; the
models keep `param_dtype=float32` and cast to the compute dtype per use), fp32 gradient accumulators
(4 B), AdamW m and v (8 B). With bf16 compute, jax autodiff also saves each cast weight for backward, so
every in-flight microbatch holds a bf16 copy of the stage's weights (2 B/param, in
`activations_per_microbatch`): 18 B/param at one microbatch in flight, as for the usual "bf16 params +
fp32 grads + fp32 master/m/v" accounting.

Activations saved for backward per token per layer, calibrated against
`jax.ad_checkpoint.print_saved_residuals` of the runtime's layers (models/decoder.py: RMSNorm with f32
statistics, f32 RoPE tables, SwiGLU; tests/test_costs_memory.py re-derives it from a hand-written
layer). `cb` = compute bytes, no sequence parallelism:
- LLM RMSNorm: its f32 input and f32 normalized value, and the cb-byte cast and scaled output:
  (8 + 2 cb) * D each (replicated over tp);
- RoPE: cos and sin broadcast for q and for k, f32: 8 * Dh (replicated);
- LLM: q, k, v after RoPE and the attention output, cb * ((H + 2K) Dh + H Dh) / tp; SwiGLU gate, up,
  three silu internals and the product, 6F * cb / tp;
- ViT (models/vit.py): each norm keeps three f32 [N, D] values and its cast output, (12 + cb) * D;
  q, k, v, attention output 4 H Dh cb / tp; fc1 output plus the five tanh-GELU intermediates,
  6F * cb / tp; qk-norm (8 + cb) H Dh / tp for each of q and k; layer scale the two scaled branches (2 cb D);
- attention scores: a flash kernel keeps only a per-head f32 log-sum-exp (4 H / tp per token); XLA's
  dense attention (`flash_attention=False`, as on CPU) keeps per head and (query, key) pair of the full
  S x S square (n x n per tile) the f32 exp and the cb-byte probabilities, plus for a masked (causal
  LLM) square the mask and the f32 masked scores: 11 B (LLM) / 6 B (ViT) at bf16.
With full remat a layer keeps only its input (cb * D per token); backward rebuilds one layer at a time
(counted in `temp`, with the head's f32 logits and their gradient on the last stage).
"""

from __future__ import annotations

import dataclasses

from dflop_jax.costs import flops
from dflop_jax.costs.architectures import LLMArch, MLLMArch, VisionArch
from dflop_jax.costs.layout import StageSpec

PARAM_BYTES = 4  # fp32 parameters = master copy
GRAD_BYTES = 4  # fp32 accumulation across microbatches
OPTIMIZER_BYTES = 8  # AdamW m + v, fp32
LOGIT_BYTES = 4  # the loss is computed from fp32 logits
F32 = 4


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Bytes per device of one stage.

    Attributes:
      params, grads, optimizer: resident state.
      activations_per_microbatch: saved for backward by one in-flight microbatch.
      temp: transient peak on top (one layer rebuilt in backward, logits of the LM head, workspace).
      in_flight: microbatches alive at once on this stage (1F1B: P - stage index); `total()` default.
    """

    params: float
    grads: float
    optimizer: float
    activations_per_microbatch: float
    temp: float
    in_flight: int = 1

    def total(self, in_flight: int | None = None) -> float:
        """Peak bytes with `in_flight` microbatches' activations alive (default: `self.in_flight`)."""
        n = self.in_flight if in_flight is None else in_flight
        return (
            self.params
            + self.grads
            + self.optimizer
            + n * self.activations_per_microbatch
            + self.temp
        )

    def __add__(self, other: StageMemory) -> StageMemory:
        return StageMemory(
            self.params + other.params,
            self.grads + other.grads,
            self.optimizer + other.optimizer,
            self.activations_per_microbatch + other.activations_per_microbatch,
            max(self.temp, other.temp),
            max(self.in_flight, other.in_flight),
        )

    def with_in_flight(self, in_flight: int) -> StageMemory:
        return dataclasses.replace(self, in_flight=in_flight)


def state_bytes(num_params: float) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes for `num_params` parameters on one device."""
    return num_params * PARAM_BYTES, num_params * GRAD_BYTES, num_params * OPTIMIZER_BYTES


def weight_copy_bytes(num_params: float, compute_bytes: int) -> float:
    """Bytes of the compute-dtype weight casts autodiff saves per in-flight microbatch."""
    return num_params * compute_bytes if compute_bytes < PARAM_BYTES else 0.0


def _norm_bytes(d: int, cb: int) -> float:
    return (2 * F32 + 2 * cb) * d


def llm_activation_bytes_per_token(
    m: LLMArch, tp: int = 1, remat: bool = False, compute_bytes: int = 2
) -> float:
    """Activation bytes saved per token per decoder layer on one device (flash attention; the dense
    attention square is `dense_attention_bytes`)."""
    d, cb = m.hidden_size, compute_bytes
    if remat:
        return float(d * cb)
    qkvo = (m.num_heads + 2 * m.num_kv_heads) * m.dh + m.num_heads * m.dh
    sharded = (qkvo + 6 * m.intermediate_size) * cb + F32 * m.num_heads
    return 2 * _norm_bytes(d, cb) + 8 * m.dh + sharded / tp


def vision_activation_bytes_per_token(
    v: VisionArch, tp: int = 1, remat: bool = False, compute_bytes: int = 2
) -> float:
    """Activation bytes saved per token per ViT layer on one device (flash attention)."""
    d, cb, inner = v.hidden_size, compute_bytes, v.num_heads * v.dh
    if remat:
        return float(d * cb)
    replicated = 2 * (3 * F32 + cb) * d + (2 * cb * d if v.layer_scale else 0)
    sharded = (4 * inner + 6 * v.intermediate_size) * cb + F32 * v.num_heads
    if v.qk_norm:
        sharded += 2 * (2 * F32 + cb) * inner  # f32 input and normalized value, cast output
    return replicated + sharded / tp


def dense_attention_bytes(
    heads: int, length: int, tp: int, causal: bool, compute_bytes: int = 2
) -> float:
    """Bytes XLA's dense attention saves per layer for one [length x length] square (all heads)."""
    per_pair = (1 + F32 if causal else 0) + F32 + compute_bytes
    return heads / tp * length**2 * per_pair


def _sharded(layer_params: float, replicated: float, tp: int) -> float:
    return (layer_params - replicated) / tp + replicated


def encoder_stage_memory(
    arch: MLLMArch,
    stage: StageSpec,
    tiles: int,
    remat: bool = False,
    compute_bytes: int = 2,
    flash_attention: bool = True,
) -> StageMemory:
    """Memory of an encoder stage (its layers, + patch embedding / projector if it holds them) at `tiles`."""
    v, p, tp = arch.vision, arch.projector, stage.tp
    norm = 2 * v.hidden_size * (2 if v.norm == "layer_norm" else 1)
    n_params = stage.num_layers * _sharded(flops.vision_layer_params(v), norm, tp)
    tokens = tiles * v.seq_len
    per_tok = vision_activation_bytes_per_token(v, tp, remat, compute_bytes)
    full_tok = vision_activation_bytes_per_token(v, tp, False, compute_bytes)
    cb = compute_bytes
    scores = (
        0.0
        if flash_attention
        else tiles * dense_attention_bytes(v.num_heads, v.seq_len, tp, False, cb)
    )
    acts = stage.num_layers * (per_tok * tokens + (0.0 if remat else scores))
    temp = full_tok * tokens + scores if stage.num_layers else 0.0
    if stage.has_embedding:
        n_params += flops.vision_embedding_params(v)
        acts += tiles * v.patches_per_tile * 3 * v.patch_size**2 * cb  # patch pixels
    if stage.has_head:
        n_params += flops.projector_params(p) / tp
        out_tokens = tiles * v.tokens_per_tile
        # norm/fc1 input, fc1 output, GELU internals and output
        acts += out_tokens * (_norm_bytes(p.in_dim, cb) + 4 * p.out_dim * cb / tp)
    acts += weight_copy_bytes(n_params, cb)
    return StageMemory(*state_bytes(n_params), acts, temp)


def llm_stage_memory(
    arch: MLLMArch,
    stage: StageSpec,
    tokens: int,
    remat: bool = False,
    compute_bytes: int = 2,
    flash_attention: bool = True,
) -> StageMemory:
    """Memory of an LLM stage (its layers, + embedding / head if it holds them) at a packed row of `tokens`."""
    m, tp = arch.llm, stage.tp
    n_params = stage.num_layers * _sharded(flops.llm_layer_params(m), 2 * m.hidden_size, tp)
    per_tok = llm_activation_bytes_per_token(m, tp, remat, compute_bytes)
    full_tok = llm_activation_bytes_per_token(m, tp, False, compute_bytes)
    cb = compute_bytes
    scores = 0.0 if flash_attention else dense_attention_bytes(m.num_heads, tokens, tp, True, cb)
    acts = stage.num_layers * (per_tok * tokens + (0.0 if remat else scores))
    temp = full_tok * tokens + scores if stage.num_layers else 0.0
    embed = m.vocab_size * m.hidden_size / tp  # vocab-parallel
    if stage.has_embedding:
        n_params += embed
    if stage.has_head:
        # A tied head on a different stage than the embedding still holds its own copy.
        n_params += m.hidden_size + (0 if (m.tie_embeddings and stage.has_embedding) else embed)
        acts += tokens * _norm_bytes(m.hidden_size, cb)  # final norm, input of the head
        # cb-byte logits, their f32 upcast and its gradient (the last stage runs F and B back to back)
        temp = max(temp, tokens * m.vocab_size / tp * (cb + 2 * LOGIT_BYTES))
    acts += weight_copy_bytes(n_params, cb)
    return StageMemory(*state_bytes(n_params), acts, temp)


def stage_memory(
    arch: MLLMArch,
    stage: StageSpec,
    bucket: int,
    remat: bool = False,
    compute_bytes: int = 2,
    flash_attention: bool = True,
) -> StageMemory:
    """Memory of one stage at its bucket (tiles per shard for encoder stages, tokens for LLM stages)."""
    fn = encoder_stage_memory if stage.module == "encoder" else llm_stage_memory
    return fn(arch, stage, bucket, remat, compute_bytes, flash_attention)
