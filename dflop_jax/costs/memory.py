"""Per-device memory of a pipeline stage, as the runtime holds it: state, in-flight inputs, transient.

State, per parameter, sharded by tensor parallelism (matrices split over tp, norms replicated): fp32
master parameters (4 B, replicated over data parallelism) and their compute-dtype copies (2 B at
bf16), which every program takes in their place (cast once per step by the optimizer's update:
`programs/stage_program.py`), the fp32 gradient
accumulator (4 B: each device holds its own data replica's sum, reduced once per step), AdamW m and v
(8 B, ZeRO-1: sharded over the stage's dp, `programs/zero1_layout.py`; a leaf no axis of which divides is
padded to a multiple, so 8 / dp holds up to that padding).

In flight (`activations_per_microbatch`, times the stage's 1F1B in-flight count): under the residual
policy "recompute" the runtime's backward recomputes its stage's forward from the saved stage INPUT
(`programs/stage_jits.py`), so a microbatch waiting for its backward holds only that input: x (the
previous stage's output, or the packed tiles, or on the first LLM stage of an MLLM the image features
of the device's own row, split over the row's tp devices as the transfer delivers them) and its side
arrays (token ids, segment ids, positions, targets, loss mask, feature taps). That stage's program
gathers each row's features over its tp devices: the row's copy (and in the backward its gradient)
is transient. Under "all" / "layers" an inner stage's microbatch holds its residuals INSTEAD (`_held`):
every layer's, or each layer's input and bf16 weight slice with layer remat, and those of the parts
around the layers (the patch pixels, the projector's, the feature placement's), which then leave
the transient; the driver drops the input once the saving forward has run, so only one
microbatch's input (the one a forward reads) is alive, in the transient.

Transient (`temp`): one microbatch's training program on top of that: the residuals saved for
backward (all layers' without remat; with remat each layer's input, or under "dots" also its matmul
outputs, plus one layer rebuilt at a time), the incoming gradient dy and outgoing dx, one loss
chunk's logits on the last stage, and per trained parameter its gradient in the compute dtype and
that gradient's fp32 form (`weight_transient_bytes`: 6 B at bf16). The
backward from saved residuals cannot free them (they are its arguments): without remat it holds
one layer's cotangents on top (`_workspace`; with remat they reuse the rebuilt layer's space).

Residuals per token per layer, calibrated against `jax.ad_checkpoint.print_saved_residuals` of the
runtime's layers (models/decoder.py: RMSNorm with f32 statistics, f32 RoPE tables, SwiGLU;
tests/costs/test_costs_memory.py re-derives it from a hand-written layer). `cb` = compute bytes, no
sequence parallelism:
- LLM RMSNorm: its f32 input and f32 normalized value, and the cb-byte cast and scaled output:
  (8 + 2 cb) * D each (replicated over tp);
- RoPE: cos and sin broadcast for q and for k, f32: 8 * Dh (replicated);
- LLM: q, k, v after RoPE and the attention output, cb * ((H + 2K) Dh + H Dh) / tp; SwiGLU gate, up,
  three silu internals and the product, 6F * cb / tp;
- ViT (models/vit.py): each norm keeps three f32 [N, D] values and its cast output, (12 + cb) * D;
  q, k, v, attention output 4 H Dh cb / tp; fc1 output plus the five tanh-GELU intermediates,
  6F * cb / tp; qk-norm (8 + cb) H Dh / tp for each of q and k; layer scale the two scaled branches (2 cb D);
- attention scores: a flash kernel keeps only a per-head f32 log-sum-exp (4 H / tp per token); XLA's
  dense attention (`flash_attention=False`) keeps per head and (query, key) pair of the full
  S x S square (n x n per tile) the f32 exp and the cb-byte probabilities, plus for a masked (causal
  LLM) square the mask and the f32 masked scores: 11 B (LLM) / 6 B (ViT) at bf16.
  A ViT tile is short: the runtime's attention (`models.attention`, implementation "xla", what the
  models run) takes the dense path for rows up to `DENSE_MAX_TOKENS` on accelerators, so an encoder
  tile of <= 1024 tokens (SigLIP's 729) keeps its n x n square whatever `flash_attention` says. On
  XLA:CPU such a tile takes the blocked path (`dense_max` is one 128-token block there), whose two
  loops XLA unrolls (6 x 6 blocks at 729 tokens padded to 768), so the rebuilt layer's backward holds
  all blocks' f32 scores at once: measured 52.6 MB per tile beyond the model without this term, vs
  the dense square's 51.0 MB (SigLIP-400M, 16 heads; compiled encoder stages at 1-4 layers and 4-16
  tiles, docs/benchmarks.md). Without remat the blocked path saves no square (CPU holds it only
  while a layer's backward runs), so there the term overstates the CPU figure; GPU keeps it.
By attention implementation (`attention_impl`, `models.attention`; `attention_transient_bytes`):
  "xla" and "pallas" keep per layer what a flash kernel keeps (above). Pallas's backward also holds,
  for the one layer it differentiates at a time, the per-query-head f32 dk / dv partials (summed over
  each kv group after the kernel) and the f32 row sums delta: (8 Dh + 4) H / tp per token. "cudnn"
  builds no mask. On packed LLM rows (`models.cudnn_packed`) cuDNN keeps its softmax statistics per
  segment slot, [M, H, S] f32 per row for M = `cudnn_segment_bound(S)` slots: M - 1 more f32 per
  head and token than a flash kernel, a per-layer residual like the rest; and the program also
  holds the Pallas kernels for rows with more runs than M (a `lax.cond`, which keeps both branches'
  residuals: Pallas's is the flash log-sum-exp already counted), so the transient is Pallas's. A vision tile's padding to 64 tokens (729 -> 768) is not counted (5% of q, k, v for one
  layer). The "cudnn" figures are reasoned from jax's source, not measured (no GPU has run them).
  The encoder stage prices the decoder's implementation (the provider holds one): Pallas's partials
  where the vision tower runs cuDNN beside a Pallas decoder, an overstatement.
Frozen parts (a recipe's `trainable`, costs/recipe.py): their fp32 parameters and copies stay (a
frozen token embedding only its gather reads has no copy: the programs convert only the rows they
gather from its master, `programs/stage_program.py`), but they get no gradient accumulator and no
optimizer state, and the program holds nothing more for them where the backend's dots read the
compute dtype (`dot_bytes`; a GPU runs bf16 dots natively, reasoned from the HLO, not measured on a
GPU). XLA:CPU (`DeviceSpec.dot_bytes` 4) has no bf16 dot:
it converts the weights to f32, and what the layer loop's transposed dots in a dx-only backward read
is an f32 stack of every layer's weights (f32[L, ...] in the buffer assignment) plus one layer's f32
slice in the loop body, measured 4.0 B per frozen layer parameter on a dx-only Qwen2.5-7B-width
stage at tp 1 (tests/profiling/test_profiling_compile_check.py); a forward-only program converts one
layer's slice at a time. The other frozen weights a dot reads (the LM head) XLA:CPU lays out anew in
the compute dtype (measured: the whole dx-only stage's transient is the model's within 10%), while a
frozen token embedding read only by its gather is read in place. The trained parameters' 6 B above
are not split by backend (XLA:CPU's f32 weight stack and bf16 gradient stack are 6 B too).
A forward-only stage keeps no stage input for a backward
(`activations_per_microbatch` 0) and no residuals: its transient is one layer's activations at a time
and its input (and on XLA:CPU the weights it converts). An encoder head stage training only its projector keeps no residuals
of its frozen layers (one layer's at a time while they are recomputed). No input gradient (dx, or the image features'
gradient on the first LLM stage) is held where the stage input needs none.
`python -m dflop_jax.plan --check` compares these terms with the compiled programs
(`profiling/compile_check.py`; figures in docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses

from dflop_jax.contracts.cost_table import RESIDUAL_POLICIES
from dflop_jax.contracts.layout import StageSpec
from dflop_jax.costs import flops
from dflop_jax.costs.architectures import AudioArch, LLMArch, MLLMArch, ProjectorArch, VisionArch
from dflop_jax.costs.recipe import TRAINABLE_PARTS, StageRole, stage_role

PARAM_BYTES = 4  # fp32 parameters = master copy
GRAD_BYTES = 4  # fp32 accumulation across microbatches
OPTIMIZER_BYTES = 8  # AdamW m + v, fp32
LOGIT_BYTES = 4  # the loss is computed from fp32 logits
F32 = 4
LOSS_CHUNK = 1024  # positions whose logits the loss computes at once (DecoderConfig.loss_chunk)
FEATURE_TAPS = 4  # bilinear taps per image position (data.sample_arrays.FEATURE_TAPS)
DENSE_MAX_TOKENS = 1024  # models.attention.dense_max on accelerators: shorter rows run unblocked
REMAT_POLICIES = ("none", "full", "dots")  # models.layers.REMAT_POLICIES
CPU_DOT_BYTES = F32  # XLA:CPU upcasts bf16 dot operands to f32 (module docstring: frozen parts)
ATTENTION_IMPLS = (
    "xla",
    "pallas",
    "cudnn",
)  # models.attention.IMPLEMENTATIONS, concrete ("auto" is resolved first; costs import no JAX)
CUDNN_SEGMENT_TOKENS, CUDNN_MAX_SEGMENTS = 256, 64  # models.cudnn_packed.segment_bound's constants


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Bytes per device of one stage.

    Attributes:
      params, grads, optimizer: resident state.
      activations_per_microbatch: held by one in-flight microbatch (its stage input, or under a
        saving residual policy its residuals instead).
      temp: the training program's transient peak on top (residuals, gradients, weight casts).
      in_flight: microbatches alive at once on this stage (1F1B: P - stage index); `total()` default.
      residuals: the stage's residual policy (`RESIDUAL_POLICIES`): under "all" / "layers" an inner
        stage's saved residuals are `activations_per_microbatch` (held by every in-flight
        microbatch until its backward), not part of `temp`, which holds the one input a forward
        reads.
    """

    params: float
    grads: float
    optimizer: float
    activations_per_microbatch: float
    temp: float
    in_flight: int = 1
    residuals: str = "recompute"

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
            self.residuals,
        )

    def with_in_flight(self, in_flight: int) -> StageMemory:
        return dataclasses.replace(self, in_flight=in_flight)


def state_bytes(num_params: float, dp: int = 1) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes for `num_params` parameters on one device of a stage with
    `dp` data replicas (ZeRO-1 shards the optimizer state over them)."""
    return num_params * PARAM_BYTES, num_params * GRAD_BYTES, num_params * OPTIMIZER_BYTES / dp


def weight_copy_bytes(num_params: float, compute_bytes: int) -> float:
    """Bytes of `num_params` parameters' compute-dtype copies (none when the compute dtype is the
    masters' fp32)."""
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


def audio_activation_bytes_per_position(
    a: AudioArch, tp: int = 1, remat: bool = False, compute_bytes: int = 2
) -> float:
    """Activation bytes saved per position (a conv output: 2 mel frames) per audio layer on one
    device (flash attention; a packed row's dense square, masked to its windows, is
    `dense_attention_bytes(..., causal=True)`): its two LayerNorms as a ViT's, q, k, v and the
    attention output, and fc1's output through exact GELU, whose backward reads four compute-dtype
    values (`models.whisper.AudioLayer`, per `print_saved_residuals`)."""
    d, cb, inner = a.hidden_size, compute_bytes, a.num_heads * a.dh
    if remat:
        return float(d * cb)
    replicated = 2 * (3 * F32 + cb) * d
    sharded = (4 * inner + 4 * a.intermediate_size) * cb + F32 * a.num_heads
    return replicated + sharded / tp


def projector_activation_bytes_per_token(
    p: ProjectorArch, tp: int = 1, compute_bytes: int = 2
) -> float:
    """Activation bytes the projector saves per output token on one device: its input (InternVL's
    LayerNorm keeps what a ViT norm keeps, `vision_activation_bytes_per_token`) and, per element of
    fc1's output, what GELU's and fc2's backward read: four compute-dtype values and a boolean (the
    residuals of the LLaVA-OV projector's saving forward at SigLIP widths)."""
    cb = compute_bytes
    norm = (3 * F32 + cb) * p.in_dim if p.kind == "internvl_mlp" else cb * p.in_dim
    return norm + (4 * cb + 1) * p.out_dim / tp


def dense_attention_bytes(
    heads: int, length: int, tp: int, causal: bool, compute_bytes: int = 2
) -> float:
    """Bytes XLA's dense attention saves per layer for one [length x length] square (all heads)."""
    per_pair = (1 + F32 if causal else 0) + F32 + compute_bytes
    return heads / tp * length**2 * per_pair


def cudnn_segment_bound(length: int) -> int:
    """Segment slots of cuDNN's packed call on rows of `length` tokens (`models.cudnn_packed`)."""
    return max(2, min(CUDNN_MAX_SEGMENTS, length // CUDNN_SEGMENT_TOKENS))


def cudnn_stats_bytes_per_token(heads: int, length: int, tp: int) -> float:
    """Per-layer residual bytes per token cuDNN's packed path keeps beyond a flash kernel's
    log-sum-exp: its f32 statistics per segment slot (module docstring)."""
    return (cudnn_segment_bound(length) - 1) * F32 * heads / tp


def attention_transient_bytes(
    impl: str, heads: int, dh: int, length: int, tp: int, backward: bool, compute_bytes: int = 2
) -> float:
    """Bytes a stage program holds beyond the flash residuals for one packed row of `length` tokens
    with attention implementation `impl` (module docstring): the Pallas backward's partials, which
    a "cudnn" program holds too (its fallback for rows of many samples)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={impl!r}: use one of {ATTENTION_IMPLS}")
    if impl in ("pallas", "cudnn") and backward:
        return heads / tp * length * (2 * F32 * dh + F32)
    return 0.0


def _placement_bytes_per_token(d: int, cb: int) -> float:
    """What placing the image features into the token embeddings saves for its backward, per token:
    the select's mask (a boolean per hidden element), the feature index and the clamped copy its
    gather reads (int32), each bilinear tap's index (int32) and weight (compute dtype)."""
    return d + 2 * 4 + FEATURE_TAPS * (4 + cb)


def _sharded(layer_params: float, replicated: float, tp: int) -> float:
    return (layer_params - replicated) / tp + replicated


def remat_policy(remat: bool | str) -> str:
    """A module's policy: "none", "full" or "dots" (True = "full", False = "none")."""
    policy = ("full" if remat else "none") if isinstance(remat, bool) else remat
    if policy not in REMAT_POLICIES:
        raise ValueError(f"remat={remat!r}: use one of {REMAT_POLICIES} (or a bool)")
    return policy


def weight_transient_bytes(num_params: float, compute_bytes: int) -> float:
    """Bytes per trained parameter the training program holds while it runs: the weights'
    gradient in the compute dtype and its fp32 form added into the accumulator (the program takes
    the weights as their resident compute-dtype copies: no cast of its own)."""
    return num_params * ((compute_bytes + F32) if compute_bytes < F32 else F32)


def _held(
    layers: int, tokens: int, saved: float, full: float, remat: str, layer_weights: float
) -> float:
    """The part of `_residuals` a saving residual policy keeps per in-flight microbatch: every
    layer's residuals without remat; with it each layer's kept part and the compute-dtype copy of
    its weights (`layer_weights` bytes per layer: the remat'd layer's inputs are its activation and
    the scan's weight slice, which the vjp keeps; measured on the tiny arch, the held bytes' intercept
    in tokens is the stage's bf16 layer weights), the one layer rebuilt at a time staying transient."""
    if remat == "none":
        return layers * tokens * full
    return layers * (tokens * saved + layer_weights)


def _workspace(tokens: int, full: float, remat: str) -> float:
    """What the backward from saved residuals holds beyond them while it differentiates a layer: that
    layer's cotangents, one per residual with its shape and dtype (`full` per token). The saved
    residuals are the program's arguments: nothing frees them, so without remat this comes on top
    of all of them. With remat the layer's rebuilt residuals (`_residuals`' one layer) are
    temporaries its backward frees as it consumes them, and the cotangents reuse that space."""
    return tokens * full if remat == "none" else 0.0


def _policy_remat(residuals: str, remat: str) -> str:
    """The layer remat a stage runs under residual policy `residuals` ("layers" builds it with full
    remat, `programs.stage_builder.stage_config`)."""
    if residuals not in RESIDUAL_POLICIES:
        raise ValueError(f"residual policy {residuals!r}: use one of {list(RESIDUAL_POLICIES)}")
    return "full" if residuals == "layers" else remat


def _residuals(layers: int, tokens: int, saved: float, full: float, remat: str) -> float:
    """Saved-for-backward bytes of `layers` layers of one microbatch: all of every layer without
    remat; with remat each layer's kept part (`saved` per token: its input, or under "dots" also its
    matmul outputs) plus one layer's full residuals, rebuilt one layer at a time in backward."""
    if not layers:
        return 0.0
    if remat == "none":
        return layers * full * tokens
    return (layers * saved + full) * tokens


def _llm_dots_bytes_per_token(m: LLMArch, tp: int, cb: int) -> float:
    """Layer input plus the matmul outputs "dots" keeps: q, k, v, o, gate, up, down."""
    sharded = ((m.num_heads + 2 * m.num_kv_heads) * m.dh + 2 * m.intermediate_size) * cb
    return 3 * m.hidden_size * cb + sharded / tp


def _vision_dots_bytes_per_token(v: VisionArch, tp: int, cb: int) -> float:
    """Layer input plus q, k, v, o, fc1, fc2 outputs."""
    sharded = (3 * v.num_heads * v.dh + v.intermediate_size) * cb
    return 3 * v.hidden_size * cb + sharded / tp


def _kept_per_token(d: int, dots: float, cb: int, remat: str) -> float:
    return dots if remat == "dots" else float(d * cb)


def frozen_weight_bytes(
    num_params: float,
    layers: int,
    layer_params: float,
    compute_bytes: int,
    dot_bytes: int | None = None,
    gathered: float = 0.0,
    backward: bool = True,
) -> float:
    """Bytes the program holds for `num_params` frozen parameters beyond their resident
    compute-dtype copies: `layers` x `layer_params` of them in its layer loop and `gathered` of them
    a table only a gather reads. Nothing where the backend's dots read the compute dtype
    (`dot_bytes`, default the compute dtype: the program reads the copies as they are). Where they
    read an upcast (XLA:CPU): one layer's converted slice in the loop body, and with a `backward`
    (dx) the loop's whole stack in that dtype, which its transposed dots read; and a compute-dtype
    copy of the other weights a dot reads (XLA:CPU lays them out anew for its dots; a gathered
    table is read in place). Module docstring."""
    dot = compute_bytes if dot_bytes is None else dot_bytes
    if dot <= compute_bytes:
        return 0.0
    loop = layers * layer_params
    held = ((loop if backward else 0.0) + layer_params) * dot if layers else 0.0
    return weight_copy_bytes(num_params - gathered - loop, compute_bytes) + held


def _state(
    n_trained: float,
    n_frozen: float,
    dp: int,
    cb: int,
    loop: tuple[int, float, float],
    dot_bytes: int | None,
    backward: bool = True,
) -> tuple[float, float, float, float]:
    """(params, grads, optimizer, weight transient) bytes: every parameter keeps its fp32 master
    and its compute-dtype copy, but a frozen table only a gather reads (`loop`'s last term: the
    programs read its master); frozen ones nothing else but what the dots read (`dot_bytes`)."""
    layers, layer, gathered = loop
    params, grads, optimizer = state_bytes(n_trained, dp)
    params += n_frozen * PARAM_BYTES + weight_copy_bytes(n_trained + n_frozen - gathered, cb)
    frozen = frozen_weight_bytes(n_frozen, layers, layer, cb, dot_bytes, gathered, backward)
    return params, grads, optimizer, weight_transient_bytes(n_trained, cb) + frozen


def _memory(
    role: StageRole,
    trained: float,
    frozen: float,
    loop: tuple[int, float, float],
    dp: int,
    cb: int,
    inputs: float,
    temp: float,
    dot_bytes: int | None,
    held: float | None = None,
    residuals: str = "recompute",
) -> StageMemory:
    """The StageMemory of a stage's terms (`loop`: its frozen layers, parameters per layer, and the
    frozen parameters only a gather reads). `held`: under a saving residual policy `residuals`, the
    residual bytes each in-flight microbatch keeps from its forward to its backward, which `temp`
    counts as the recomputing backward's; None where the stage keeps its input instead ("recompute",
    the last stage's fused program). A forward-only stage holds its input only while it runs."""
    forward = role.kind == "forward"
    params, grads, optimizer, weights = _state(trained, frozen, dp, cb, loop, dot_bytes,
                                               not forward)  # fmt: skip
    if forward:
        return StageMemory(params, grads, optimizer, 0.0, temp + inputs + weights)
    if held is None:
        return StageMemory(params, grads, optimizer, inputs, temp + weights, residuals=residuals)
    # the driver drops a microbatch's input once its saving forward has run: only the input the
    # running forward reads is alive, beside every in-flight microbatch's residuals
    return StageMemory(params, grads, optimizer, held, temp - held + inputs + weights,
                       residuals=residuals)  # fmt: skip


def _split(role: StageRole, counts: dict[str, float]) -> tuple[float, float]:
    """(trained, frozen) parameter counts of a stage from its per-part counts."""
    trained = sum(n for part, n in counts.items() if part in role.trains)
    return trained, sum(counts.values()) - trained


def encoder_stage_memory(
    arch: MLLMArch,
    stage: StageSpec,
    tiles: int,
    remat: bool | str = False,
    compute_bytes: int = 2,
    flash_attention: bool = True,
    trainable: tuple[str, ...] = TRAINABLE_PARTS,
    dot_bytes: int | None = None,
    residuals: str = "recompute",
    attention_impl: str = "xla",
) -> StageMemory:
    """Memory of an encoder stage (its layers, + patch embedding / projector if it holds them) at
    `tiles` per data shard, as the runtime holds it under the recipe `trainable` (module docstring;
    `dot_bytes`: bytes per weight element the backend's dots read, `CPU_DOT_BYTES` on XLA:CPU), the
    residual policy `residuals` and `attention_impl` (the ViT's tiles are unmasked, so only Pallas's
    backward partials count)."""
    v, p, tp, cb = arch.vision, arch.projector, stage.tp, compute_bytes
    remat = _policy_remat(residuals, remat_policy(remat))
    role = stage_role(stage, trainable, True)
    forward = role.kind == "forward"
    norm = 2 * v.hidden_size * (2 if v.norm == "layer_norm" else 1)
    n_layer = _sharded(flops.vision_layer_params(v), norm, tp)
    n_body = stage.num_layers * n_layer
    tokens = tiles * v.seq_len
    full = vision_activation_bytes_per_token(v, tp, False, cb)
    if not flash_attention or v.seq_len <= DENSE_MAX_TOKENS:  # a tile's square (module docstring)
        full += dense_attention_bytes(v.num_heads, v.seq_len, tp, False, cb) / v.seq_len
    kept = _kept_per_token(v.hidden_size, _vision_dots_bytes_per_token(v, tp, cb), cb, remat)
    saves = residuals != "recompute" and not forward
    layers = not (forward or role.head_only)  # a backward through the layers
    if not layers:  # one layer alive at a time
        temp = full * tokens if stage.num_layers else 0.0
    else:
        temp = _residuals(stage.num_layers, tokens, kept, full, remat)
    held = 0.0
    if saves and layers:
        held = _held(stage.num_layers, tokens, kept, full, remat, n_layer * cb)
        temp += _workspace(tokens, full, remat) if stage.num_layers else 0.0
    if stage.num_layers and attention_impl == "pallas":  # cuDNN on tiles: a flash kernel's lse
        temp += tiles * attention_transient_bytes(
            attention_impl, v.num_heads, v.dh, v.seq_len, tp, not forward, cb
        )
    hidden = tokens * v.hidden_size * cb
    n_head = 0.0
    if stage.has_embedding:
        n_body += flops.vision_embedding_params(v)
        inputs = tiles * v.image_size**2 * 3  # the packed tiles, uint8 (normalized on device)
        # the patch pixels, the patch embedding's input
        pixels = tiles * v.patches_per_tile * 3 * v.patch_size**2 * cb
        temp += pixels
        held += pixels if saves and layers else 0.0
    else:
        inputs = hidden
        temp += hidden if role.input_grad and not forward else 0.0  # dx
    if stage.has_head:
        n_head = flops.projector_params(p) / tp
        out_tokens = tiles * v.tokens_per_tile
        inputs += tiles  # tile_pool flags
        projector = out_tokens * projector_activation_bytes_per_token(p, tp, cb)
        temp += projector + (0.0 if forward else out_tokens * p.out_dim * cb)  # and dy
        held += projector if saves else 0.0
    elif not forward:
        temp += hidden  # dy
    trained, frozen = _split(role, {"vision": n_body, "projector": n_head})
    loop = (0, 0.0, 0.0) if "vision" in role.trains else (stage.num_layers, n_layer, 0.0)
    return _memory(role, trained, frozen, loop, stage.dp, cb, inputs, temp, dot_bytes,
                   held if saves else None, residuals)  # fmt: skip


def audio_stage_memory(
    arch: MLLMArch,
    stage: StageSpec,
    frames: int,
    remat: bool | str = False,
    compute_bytes: int = 2,
    flash_attention: bool = True,
    trainable: tuple[str, ...] = TRAINABLE_PARTS,
    dot_bytes: int | None = None,
    residuals: str = "recompute",
    attention_impl: str = "xla",
) -> StageMemory:
    """Memory of an audio encoder stage (its layers, + the convolutions / the projector if it holds
    them) at `frames` mel frames per data shard (its LLM rows' audio rows), as `encoder_stage_memory`
    counts a vision stage: the recipe's parts (tower "vision", projector "projector"), every layer's
    residuals per position (`audio_activation_bytes_per_position`; flash attention, the windows'
    dense squares not counted), the policy's kept layer inputs under remat."""
    del flash_attention, attention_impl
    a, tp, cb = arch.audio, stage.tp, compute_bytes
    remat = _policy_remat(residuals, remat_policy(remat))
    role = stage_role(stage, trainable, True)
    forward = role.kind == "forward"
    n_layer = _sharded(flops.audio_layer_params(a), 4 * a.hidden_size, tp)
    n_body = stage.num_layers * n_layer
    positions = frames // 2  # the stride-2 convolution's outputs
    full = audio_activation_bytes_per_position(a, tp, False, cb)
    kept = _kept_per_token(a.hidden_size, float(a.hidden_size * cb), cb, remat)
    saves = residuals != "recompute" and not forward
    temp = (
        full * positions if forward else _residuals(stage.num_layers, positions, kept, full, remat)
    )
    held = _held(stage.num_layers, positions, kept, full, remat, n_layer * cb) if saves else 0.0
    hidden = positions * a.hidden_size * cb
    if stage.has_embedding:
        d, m = a.hidden_size, a.num_mel_bins
        n_body += 3 * m * d + d + 3 * d * d + d + a.max_source_positions * d
        inputs = frames * (m * F32 + 4 + 1)  # the log-mel rows (float32), window ids, validity
        temp += frames * m * cb
    else:
        inputs = hidden + frames * 5
        temp += hidden if role.input_grad and not forward else 0.0  # dx
    n_head = 0.0
    if stage.has_head:
        out = positions // a.pool * arch.llm.hidden_size * cb
        n_head = (a.hidden_size * arch.llm.hidden_size + arch.llm.hidden_size) / tp
        n_body += 2 * a.hidden_size  # the final LayerNorm
        temp += 2 * out if not forward else out  # the features, and dy
    elif not forward:
        temp += hidden  # dy
    trained, frozen = _split(role, {"vision": n_body, "projector": n_head})
    loop = (0, 0.0, 0.0) if "vision" in role.trains else (stage.num_layers, n_layer, 0.0)
    return _memory(role, trained, frozen, loop, stage.dp, cb, inputs, temp, dot_bytes,
                   held if saves else None, residuals)  # fmt: skip


def llm_stage_memory(
    arch: MLLMArch,
    stage: StageSpec,
    tokens: int,
    remat: bool | str = False,
    compute_bytes: int = 2,
    flash_attention: bool = True,
    trainable: tuple[str, ...] = TRAINABLE_PARTS,
    dot_bytes: int | None = None,
    residuals: str = "recompute",
    attention_impl: str = "xla",
) -> StageMemory:
    """Memory of an LLM stage (its layers, + embedding / head if it holds them) at a packed row of
    `tokens` per data shard, as the runtime holds it under the recipe `trainable` (module docstring;
    `dot_bytes` as in `encoder_stage_memory`), the residual policy `residuals` (the last stage's
    fused program keeps nothing between programs: only its layer remat changes) and `attention_impl`
    (`attention_transient_bytes`)."""
    m, tp, cb = arch.llm, stage.tp, compute_bytes
    remat = _policy_remat(residuals, remat_policy(remat))
    role = stage_role(stage, trainable, arch.vision is not None)
    forward = role.kind == "forward"
    n_layer = _sharded(flops.llm_layer_params(m), 2 * m.hidden_size, tp)
    n_params = stage.num_layers * n_layer
    full = llm_activation_bytes_per_token(m, tp, False, cb)
    if not flash_attention:
        full += dense_attention_bytes(m.num_heads, tokens, tp, True, cb) / tokens
    if attention_impl == "cudnn":  # the packed path's statistics per segment slot
        full += cudnn_stats_bytes_per_token(m.num_heads, tokens, tp)
    kept = _kept_per_token(m.hidden_size, _llm_dots_bytes_per_token(m, tp, cb), cb, remat)
    saves = residuals != "recompute" and not forward and not stage.has_head  # the head: fused
    held = 0.0
    if forward:
        temp = full * tokens if stage.num_layers else 0.0
    else:
        temp = _residuals(stage.num_layers, tokens, kept, full, remat)
    if saves:
        held = _held(stage.num_layers, tokens, kept, full, remat, n_layer * cb)
        temp += _workspace(tokens, full, remat) if stage.num_layers else 0.0
    if stage.num_layers:
        temp += attention_transient_bytes(
            attention_impl, m.num_heads, m.dh, tokens, tp, not forward, cb
        )
    hidden = tokens * m.hidden_size * cb
    embed = m.vocab_size * m.hidden_size / tp  # vocab-parallel
    inputs = tokens * 2 * 4  # segment ids, positions (int32)
    if stage.has_embedding:
        n_params += embed
        inputs += tokens * 4  # token ids
        if arch.vision is not None:  # image features of the device's own row (at most a row)
            inputs += tokens * (4 + 2 * 4 * FEATURE_TAPS)  # feature index, taps and weights
            features = tokens * m.hidden_size * cb
            inputs += features / tp  # as they arrive: the row's block split over its tp devices
            temp += features if tp > 1 else 0.0  # gathered over the row's tp devices
            temp += features if role.input_grad and not forward else 0.0  # their gradient
            placed = tokens * _placement_bytes_per_token(m.hidden_size, cb)
            temp += placed if not forward else 0.0
            held += placed if saves else 0.0
    else:
        inputs += hidden
        temp += hidden if role.input_grad and not forward else 0.0  # dx
    if stage.has_head:
        # A tied head on a different stage than the embedding still holds its own copy.
        n_params += m.hidden_size + (0 if (m.tie_embeddings and stage.has_embedding) else embed)
        inputs += tokens * 2 * 4  # targets, loss mask
        temp += tokens * _norm_bytes(m.hidden_size, cb)  # final norm, input of the head
        # one chunk's cb-byte logits, their f32 upcast and its gradient (`models/loss.py`)
        temp += min(tokens, LOSS_CHUNK) * m.vocab_size / tp * (cb + 2 * LOGIT_BYTES)
    elif not forward:
        temp += hidden  # dy
    trained, frozen = _split(role, {"llm": n_params})
    gathered = embed if stage.has_embedding and not (stage.has_head and m.tie_embeddings) else 0.0
    loop = (0, 0.0, 0.0) if "llm" in role.trains else (stage.num_layers, n_layer, gathered)
    return _memory(role, trained, frozen, loop, stage.dp, cb, inputs, temp, dot_bytes,
                   held if saves else None, residuals)  # fmt: skip


def stage_memory(
    arch: MLLMArch,
    stage: StageSpec,
    bucket: int,
    remat: bool | str = False,
    compute_bytes: int = 2,
    flash_attention: bool = True,
    trainable: tuple[str, ...] = TRAINABLE_PARTS,
    dot_bytes: int | None = None,
    residuals: str = "recompute",
    attention_impl: str = "xla",
) -> StageMemory:
    """Memory of one stage at its bucket (tiles per shard for encoder stages, mel frames per shard
    for audio stages, tokens for LLM stages)
    under the recipe `trainable` (`dot_bytes`: `encoder_stage_memory`), residual policy and
    `attention_impl`."""
    fn = {"encoder": encoder_stage_memory, "audio": audio_stage_memory}.get(
        stage.module, llm_stage_memory
    )
    return fn(arch, stage, bucket, remat, compute_bytes, flash_attention, trainable, dot_bytes,
              residuals, attention_impl)  # fmt: skip


def pick_residuals(memories: dict[str, StageMemory], in_flight: int, budget: float) -> str:
    """The residual policy of a stage: the first of "all", "layers", "recompute" (least backward
    work first) whose peak with `in_flight` microbatches fits `budget` bytes; when none does, the
    one with the smallest peak (the planner's own fit test then judges the stage). "recompute" is
    not always the smallest: without layer remat its backward rebuilds every layer's residuals at
    once, more than a few microbatches' layer inputs. `memories`: the stage's StageMemory per
    policy."""
    for policy in RESIDUAL_POLICIES:
        if memories[policy].total(in_flight) <= budget:
            return policy
    return min(RESIDUAL_POLICIES, key=lambda r: memories[r].total(in_flight))
