"""Per-device memory of a pipeline stage: parameters, gradients, optimizer state, activations.

Precision (DESIGN section 5): bf16 parameters for compute (2 B), fp32 gradient accumulators (4 B), fp32
master weights + AdamW m and v (12 B) -> 18 B per parameter, replicated across data parallelism (no
ZeRO), sharded by tensor parallelism (matrices split over tp, norms replicated).

Activations saved for backward, per token per layer, in `compute_bytes` units, with flash-style
attention (no S x S score matrix is stored) and no sequence parallelism (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", without the dropout masks and the
5*a*s/h score term):
- LLM block: replicated [norm-1 input, qkv input, norm-2 input, mlp input] = 4D, plus sharded over tp
  q, k, v (H + 2K) * Dh, attention output H * Dh, gate, up and act (3F).
- ViT block: 4D replicated, plus sharded q, k, v, attention output (4 * H * Dh) and fc1/gelu outputs (2F).
With full remat only each layer's input (D, replicated) is kept, and backward rebuilds one layer at a
time (counted in `temp`).
"""

from __future__ import annotations

import dataclasses

from dflop_jax.costs import flops
from dflop_jax.costs.architectures import LLMArch, MLLMArch, VisionArch
from dflop_jax.costs.layout import StageSpec

PARAM_BYTES = 2  # bf16 compute copy
GRAD_BYTES = 4  # fp32 accumulation across microbatches
OPTIMIZER_BYTES = 12  # fp32 master + AdamW m + v
LOGIT_BYTES = 4  # the loss is computed from fp32 logits


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


def llm_activation_bytes_per_token(
    m: LLMArch, tp: int = 1, remat: bool = False, compute_bytes: int = 2
) -> float:
    """Activation bytes saved per token per decoder layer on one device."""
    d = m.hidden_size
    if remat:
        return float(d * compute_bytes)
    sharded = (
        (m.num_heads + 2 * m.num_kv_heads) * m.dh + m.num_heads * m.dh + 3 * m.intermediate_size
    )
    return (4 * d + sharded / tp) * compute_bytes


def vision_activation_bytes_per_token(
    v: VisionArch, tp: int = 1, remat: bool = False, compute_bytes: int = 2
) -> float:
    """Activation bytes saved per token per ViT layer on one device."""
    d = v.hidden_size
    if remat:
        return float(d * compute_bytes)
    return (4 * d + (4 * v.num_heads * v.dh + 2 * v.intermediate_size) / tp) * compute_bytes


def _sharded(layer_params: float, replicated: float, tp: int) -> float:
    return (layer_params - replicated) / tp + replicated


def encoder_stage_memory(
    arch: MLLMArch, stage: StageSpec, tiles: int, remat: bool = False, compute_bytes: int = 2
) -> StageMemory:
    """Memory of an encoder stage (its layers, + patch embedding / projector if it holds them) at `tiles`."""
    v, p, tp = arch.vision, arch.projector, stage.tp
    norm = 2 * v.hidden_size * (2 if v.norm == "layer_norm" else 1)
    n_params = stage.num_layers * _sharded(flops.vision_layer_params(v), norm, tp)
    tokens = tiles * v.seq_len
    per_tok = vision_activation_bytes_per_token(v, tp, remat, compute_bytes)
    full_tok = vision_activation_bytes_per_token(v, tp, False, compute_bytes)
    acts = stage.num_layers * per_tok * tokens
    temp = full_tok * tokens if stage.num_layers else 0.0
    if stage.has_embedding:
        n_params += flops.vision_embedding_params(v)
        acts += tiles * v.patches_per_tile * 3 * v.patch_size**2 * compute_bytes  # patch pixels
    if stage.has_head:
        n_params += flops.projector_params(p) / tp
        out_tokens = tiles * v.tokens_per_tile
        acts += out_tokens * (p.in_dim + 2 * p.out_dim / tp) * compute_bytes
    return StageMemory(*state_bytes(n_params), acts, temp)


def llm_stage_memory(
    arch: MLLMArch, stage: StageSpec, tokens: int, remat: bool = False, compute_bytes: int = 2
) -> StageMemory:
    """Memory of an LLM stage (its layers, + embedding / head if it holds them) at a packed row of `tokens`."""
    m, tp = arch.llm, stage.tp
    n_params = stage.num_layers * _sharded(flops.llm_layer_params(m), 2 * m.hidden_size, tp)
    per_tok = llm_activation_bytes_per_token(m, tp, remat, compute_bytes)
    full_tok = llm_activation_bytes_per_token(m, tp, False, compute_bytes)
    acts = stage.num_layers * per_tok * tokens
    temp = full_tok * tokens if stage.num_layers else 0.0
    embed = m.vocab_size * m.hidden_size / tp  # vocab-parallel
    if stage.has_embedding:
        n_params += embed
    if stage.has_head:
        # A tied head on a different stage than the embedding still holds its own copy.
        n_params += m.hidden_size + (0 if (m.tie_embeddings and stage.has_embedding) else embed)
        acts += tokens * m.hidden_size * compute_bytes  # final-norm output, input of the head
        temp = max(temp, 2 * tokens * m.vocab_size / tp * LOGIT_BYTES)  # logits + their gradient
    return StageMemory(*state_bytes(n_params), acts, temp)


def stage_memory(
    arch: MLLMArch, stage: StageSpec, bucket: int, remat: bool = False, compute_bytes: int = 2
) -> StageMemory:
    """Memory of one stage at its bucket (tiles per shard for encoder stages, tokens for LLM stages)."""
    fn = encoder_stage_memory if stage.module == "encoder" else llm_stage_memory
    return fn(arch, stage, bucket, remat, compute_bytes)
