"""Model FLOPs and parameter counts of the vision tower, projector, audio encoder and LLM (pure arithmetic).

Conventions (the usual ones, e.g. Kaplan et al. 2020 / Narayanan et al. 2021 "Megatron-LM at scale"):
- A matmul [n, a] x [a, b] costs 2*n*a*b FLOPs, so a linear layer costs 2 * params per token.
- Attention scores QK^T and the weighted sum AV cost 2*Dh per (query, key) pair per head each, so
  attention costs 2 * 2 * Dh * H * pairs. Bidirectional (ViT): pairs = n^2 per tile. Causal within a
  segment of length L: pairs = L * (L + 1) / 2 (the diagonal included); a packed row's pairs are the sum
  over its segments (attention never crosses samples).
- GQA: the K and V projections are D x (K * Dh) each, i.e. 2 * D * K * Dh FLOPs per token each (the
  reference scales them by H / K instead of K / H; that is its bug, not ours).
- Norms, activations, softmax, RoPE, residual adds and the embedding gather are ignored (< 1% of
  XLA's count for the LLM and ViT; Whisper's exact GELU is 4-20% of XLA's count at small widths,
  which the audio formulas leave out too: they equal the lowered program's matmul work).
- Audio (Whisper): a row of A mel frames runs the convolutions over A and A / 2 positions and the
  layers over A / 2, attention within 30 s windows (a bucket is priced as whole windows).
- Model FLOPs of training = 3 x forward (backward = 2 x forward) with no recompute; MFU uses these.
  `hardware_flops(recompute=True)` adds one extra forward of the transformer layers (full remat).
"""

from __future__ import annotations

from collections.abc import Sequence

from dflop_jax.costs.architectures import AudioArch, LLMArch, MLLMArch, ProjectorArch, VisionArch

# ---------------------------------------------------------------- parameter counts


def _norm_params(width: int, kind: str) -> int:
    return 2 * width if kind == "layer_norm" else width


def vision_layer_params(v: VisionArch) -> int:
    """One ViT block: 2 norms, qkv (+bias), out proj (+bias), fc1/fc2 (+bias), optional qk-norm/scale."""
    d, f, inner = v.hidden_size, v.intermediate_size, v.num_heads * v.dh
    attn = 3 * d * inner + (3 * inner if v.qkv_bias else 0) + inner * d + d
    mlp = d * f + f + f * d + d
    extra = (2 * inner if v.qk_norm else 0) + (2 * d if v.layer_scale else 0)
    return attn + mlp + 2 * _norm_params(d, v.norm) + extra


def vision_embedding_params(v: VisionArch) -> int:
    """Patch conv (+bias), position embeddings, class token."""
    d = v.hidden_size
    return 3 * v.patch_size**2 * d + d + v.seq_len * d + (d if v.class_token else 0)


def vision_params(v: VisionArch) -> int:
    """The whole tower as used by the MLLM (embeddings + layers; SigLIP's unused post-norm excluded)."""
    return vision_embedding_params(v) + v.num_layers * vision_layer_params(v)


def projector_params(p: ProjectorArch) -> int:
    norm = 2 * p.in_dim if p.kind == "internvl_mlp" else 0
    return norm + p.in_dim * p.out_dim + p.out_dim + p.out_dim * p.out_dim + p.out_dim


def audio_layer_params(a: AudioArch) -> int:
    """One Whisper layer: 2 LayerNorms, q/k/v (biases on q and v), out proj (+bias), fc1/fc2 (+bias)."""
    d, f = a.hidden_size, a.intermediate_size
    return 3 * d * d + 2 * d + d * d + d + d * f + f + f * d + d + 2 * 2 * d


def audio_params(a: AudioArch, out_dim: int = 0) -> int:
    """The whole audio encoder: convolutions (+biases), position table, layers, final LayerNorm, and
    a linear projector (+bias) into `out_dim` when given."""
    d, m = a.hidden_size, a.num_mel_bins
    embed = 3 * m * d + d + 3 * d * d + d + a.max_source_positions * d
    projector = d * out_dim + out_dim if out_dim else 0
    return embed + a.num_layers * audio_layer_params(a) + 2 * d + projector


def llm_layer_params(m: LLMArch) -> int:
    """One decoder block: q/k/v (GQA, optional bias), o, SwiGLU gate/up/down, 2 RMSNorms."""
    d, q, kv = m.hidden_size, m.num_heads * m.dh, m.num_kv_heads * m.dh
    attn = d * q + 2 * d * kv + q * d + ((q + 2 * kv) if m.qkv_bias else 0)
    return attn + 3 * d * m.intermediate_size + 2 * d


def llm_params(m: LLMArch) -> int:
    """Embedding + layers + final norm + LM head (unless tied)."""
    emb = m.vocab_size * m.hidden_size
    head = 0 if m.tie_embeddings else emb
    return emb + m.num_layers * llm_layer_params(m) + m.hidden_size + head


def param_count(part: VisionArch | ProjectorArch | LLMArch | MLLMArch) -> int:
    """Parameters of a vision tower, projector, LLM, or a whole MLLM."""
    if isinstance(part, VisionArch):
        return vision_params(part)
    if isinstance(part, ProjectorArch):
        return projector_params(part)
    if isinstance(part, LLMArch):
        return llm_params(part)
    if isinstance(part, MLLMArch):
        return vision_params(part.vision) + projector_params(part.projector) + llm_params(part.llm)
    raise TypeError(f"param_count: unsupported {type(part).__name__}")


# ---------------------------------------------------------------- forward FLOPs


def vision_layer_flops(v: VisionArch, tiles: float = 1.0) -> float:
    """Forward FLOPs of one ViT block over `tiles` tiles (bidirectional attention within a tile)."""
    n, d, f, inner = v.seq_len, v.hidden_size, v.intermediate_size, v.num_heads * v.dh
    linear = 2 * n * (3 * d * inner + inner * d + 2 * d * f)
    attn = 2 * 2 * v.dh * v.num_heads * n * n
    return tiles * (linear + attn)


def vision_embedding_flops(v: VisionArch) -> float:
    """Forward FLOPs of the patch embedding (a [patches, 3*p*p] x [3*p*p, D] matmul) per tile."""
    return 2.0 * v.patches_per_tile * 3 * v.patch_size**2 * v.hidden_size


def vision_flops_per_tile(v: VisionArch) -> float:
    """Forward FLOPs of the whole tower (patch embedding + all layers) for one tile."""
    return vision_embedding_flops(v) + v.num_layers * vision_layer_flops(v)


def projector_flops_per_tile(arch: MLLMArch) -> float:
    """Forward FLOPs of the projector for one tile's tokens (after pixel shuffle for InternVL)."""
    p = arch.projector
    return 2.0 * arch.vision.tokens_per_tile * (p.in_dim * p.out_dim + p.out_dim * p.out_dim)


def audio_layer_flops(a: AudioArch, frames: float) -> float:
    """Forward FLOPs of one audio layer over a row of `frames` mel frames (`frames` / 2 positions
    after the stride-2 convolution): its projections and MLP, and bidirectional attention within
    each 30 s window, the row taken as whole windows (a bucket's worst case)."""
    t, d, f = frames / 2, a.hidden_size, a.intermediate_size
    pairs = t * min(t, a.max_source_positions)
    return 2 * t * (4 * d * d + 2 * d * f) + 2 * 2 * d * pairs


def audio_embedding_flops(a: AudioArch, frames: float) -> float:
    """Forward FLOPs of the two convolutions (kernel 3; the second at stride 2) over `frames`."""
    d, m = a.hidden_size, a.num_mel_bins
    return 2 * frames * 3 * m * d + 2 * (frames / 2) * 3 * d * d


def audio_projector_flops(a: AudioArch, frames: float, out_dim: int) -> float:
    """Forward FLOPs of the linear projector over the pooled outputs of `frames`."""
    return 2 * frames / (2 * a.pool) * a.hidden_size * out_dim


def audio_flops(a: AudioArch, frames: float, out_dim: int = 0) -> float:
    """Forward FLOPs of the whole audio encoder (+ projector into `out_dim`) over `frames`."""
    body = a.num_layers * audio_layer_flops(a, frames) + audio_embedding_flops(a, frames)
    return body + (audio_projector_flops(a, frames, out_dim) if out_dim else 0.0)


def causal_pairs(segment_lengths: Sequence[int]) -> float:
    """(query, key) pairs of segment-causal attention: sum of L*(L+1)/2 over segments."""
    return float(sum(n * (n + 1) // 2 for n in segment_lengths))


def visited_pairs(
    segment_lengths: Sequence[int], row: int, block: int, causal: bool = True
) -> float:
    """(query, key) pairs a segment-bounded flash kernel computes on one packed row: whole
    `block` x `block` tiles, each query block visiting the key blocks from the start of its first
    query's sample through its own block (causal) or the end of its last query's sample. Samples
    lie contiguous from the row's start, the padding tail is one more segment and the row is padded
    to whole blocks (`models.pallas_attention`; the XLA blocked path at its block size visits the
    same tiles on such a row). The gap to `causal_pairs` is the masked work inside visited tiles;
    a kernel that visits every causal tile computes about row^2 / 2."""
    n = -(-row // block)
    bounds, pos = [], 0  # (start, end) of each segment, padding included
    for length in [*segment_lengths, row - sum(segment_lengths)]:
        if length > 0:
            bounds.append((pos, pos + length))
            pos += length
    bounds.append((row, n * block))  # the kernel's own padding to whole blocks

    def segment(token: int) -> tuple[int, int]:
        return next(b for b in bounds if b[0] <= token < b[1])

    tiles = 0
    for i in range(n):
        lo = segment(i * block)[0] // block
        hi = i + 1 if causal else -(-segment(i * block + block - 1)[1] // block)
        tiles += hi - lo
    return float(tiles * block * block)


def llm_layer_flops(llm: LLMArch, seq_len_linear: float, attn_pairs: float) -> float:
    """Forward FLOPs of one decoder block.

    Args:
      seq_len_linear: tokens through the projections and MLP.
      attn_pairs: (query, key) pairs attended, summed over heads' shared pattern (per head).
    """
    d, q, kv = llm.hidden_size, llm.num_heads * llm.dh, llm.num_kv_heads * llm.dh
    linear = 2.0 * seq_len_linear * (d * q + 2 * d * kv + q * d + 3 * d * llm.intermediate_size)
    return linear + 2.0 * 2 * llm.dh * llm.num_heads * attn_pairs


def llm_head_flops(llm: LLMArch, tokens: float) -> float:
    """Forward FLOPs of the LM head ([tokens, D] x [D, V])."""
    return 2.0 * tokens * llm.hidden_size * llm.vocab_size


def stage_forward_flops(arch: MLLMArch, stage, bucket: int) -> float:
    """Forward FLOPs of one data shard of a pipeline stage (`contracts.layout.StageSpec`) at `bucket`:
    tiles through an encoder stage's blocks, `bucket` mel frames through an audio stage's, or one
    packed row of `bucket` tokens through an LLM stage's (attention over S^2 / 2 causal pairs, as
    the analytic time prices it)."""
    if stage.module == "audio":
        a = arch.audio
        body = stage.num_layers * audio_layer_flops(a, bucket)
        body += audio_embedding_flops(a, bucket) if stage.has_embedding else 0.0
        return body + (
            audio_projector_flops(a, bucket, arch.llm.hidden_size) if stage.has_head else 0.0
        )
    if stage.module == "encoder":
        per_tile = stage.num_layers * vision_layer_flops(arch.vision)
        per_tile += vision_embedding_flops(arch.vision) if stage.has_embedding else 0.0
        per_tile += projector_flops_per_tile(arch) if stage.has_head else 0.0
        return bucket * per_tile
    body = stage.num_layers * llm_layer_flops(arch.llm, bucket, bucket * bucket / 2.0)
    return body + (llm_head_flops(arch.llm, bucket) if stage.has_head else 0.0)


def llm_flops(llm: LLMArch, segment_lengths: Sequence[int], include_head: bool = True) -> float:
    """Forward FLOPs of all decoder layers (+ LM head) over one packed row of the given segments."""
    tokens = float(sum(segment_lengths))
    body = llm.num_layers * llm_layer_flops(llm, tokens, causal_pairs(segment_lengths))
    return body + (llm_head_flops(llm, tokens) if include_head else 0.0)


def sample_model_flops(arch: MLLMArch, tiles: int, tokens: int) -> float:
    """Training model FLOPs (3 x forward, no recompute) of one sample: its tiles and its LLM tokens."""
    enc = tiles * (vision_flops_per_tile(arch.vision) + projector_flops_per_tile(arch))
    return 3.0 * (enc + llm_flops(arch.llm, [tokens]) if tokens else 3.0 * enc)


def hardware_flops(arch: MLLMArch, tiles: int, tokens: int, recompute: bool = True) -> float:
    """FLOPs the hardware executes for one sample's training step.

    With full recompute the transformer layers (vision and LLM; not the patch embedding, projector or
    LM head) run their forward twice, adding one forward of those layers to the model FLOPs.
    """
    model = sample_model_flops(arch, tiles, tokens)
    if not recompute:
        return model
    v = arch.vision
    extra = tiles * v.num_layers * vision_layer_flops(v)
    if tokens:
        extra += llm_flops(arch.llm, [tokens], include_head=False)
    return model + extra


def batch_model_flops(
    arch: MLLMArch, shapes: Sequence[tuple[int, int]], audio_windows: Sequence[int] = ()
) -> float:
    """Training model FLOPs of a batch of (tiles, tokens) samples and, for a model with an audio
    encoder, of its audio windows (each window's valid frames, encoder and projector; 3 x forward):
    real work only, no padding."""
    flops = float(sum(sample_model_flops(arch, tiles, tokens) for tiles, tokens in shapes))
    if arch.audio is not None:
        d = arch.llm.hidden_size
        flops += 3.0 * sum(audio_flops(arch.audio, frames, d) for frames in audio_windows)
    return flops


def mfu(model_flops: float, step_time_s: float, num_devices: int, peak_flops: float) -> float:
    """Model FLOPs utilization (DESIGN section 9): model FLOPs / (step time x devices x peak FLOP/s)."""
    if step_time_s <= 0 or num_devices < 1 or peak_flops <= 0:
        raise ValueError(
            f"mfu: step_time_s={step_time_s}, num_devices={num_devices}, peak={peak_flops} must be > 0"
        )
    return model_flops / (step_time_s * num_devices * peak_flops)
