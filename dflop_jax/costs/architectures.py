"""Named model architectures with their real sizes, for cost and memory modelling (no weights).

`get_arch("siglip-so400m+qwen2.5-7b")` builds an `MLLMArch` from a vision preset and an LLM preset; the
projector follows the vision family (SigLIP -> LLaVA-OneVision `mlp2x_gelu`; InternViT -> InternVL's
LayerNorm + MLP after a 0.5 pixel shuffle). Sizes are copied from the published HF configs:

- siglip-so400m: google/siglip-so400m-patch14-384 as LLaVA-OneVision uses it: 384 px, patch 14 -> 27x27 =
  729 tokens/tile, hidden 1152, 16 heads, MLP 4304. The published tower has 27 layers + a pooling head
  (428M params); LLaVA-OV drops the last layer and the head (transformers' LlavaOnevisionConfig default
  vision config has `num_hidden_layers=26, vision_use_head=False` and `vision_feature_layer=-1`, i.e. the
  output of layer 26 before post_layernorm), so the preset has 26 layers (~398M params).
- siglip-1b, siglip-6b: the DFLOP reference's scaled SigLIP towers (its `dflop/model.py` `sig_lip_configs`;
  no checkpoint exists): "1b" = hidden 1728, 32 heads, MLP 6912, 27 layers (~0.97B params); "6b" = hidden
  2304, 48 heads, MLP 8608, 40 layers (the reference's default encoder; ~2.44B params despite its name).
  Both keep so400m's 384 px / patch 14 (729 tokens per tile) and LLaVA-OV projector. The reference's own
  "400m" keeps all 27 layers; ours follows LLaVA-OV (26), a 4% smaller encoder.
- internvit-300m: OpenGVLab/InternViT-300M-448px: 24 layers, hidden 1024, 16 heads, MLP 4096, qkv bias,
  448 px, patch 14 -> 1024 patches (+1 class token in the encoder), pixel shuffle 0.5 -> 256 tokens/tile.
- internvit-6b: OpenGVLab/InternViT-6B-448px-V1-5 (InternVL 1.5/2): 45 layers (the 48-layer original minus
  its last 3 blocks, published as 5.54B params), hidden 3200, 25 heads, MLP 12800, RMSNorm, qk-norm,
  layer scale, no qkv bias.
- internvit-1b: the reference's scaled InternViT ("1b" in `internvit_configs`; no checkpoint exists):
  hidden 1792, 28 heads, MLP 7168, 28 layers, RMSNorm, qk-norm, no qkv bias (~1.08B params).
- internvit-6b-dflop: the reference's own "6b" InternViT: 30 layers of hidden 3200 with 16 heads of 200
  (~3.69B params), unlike the published 45-layer, 25-head tower above; kept so its figures can be compared.
- LLMs: Qwen/Qwen2.5-{0.5B,7B,32B,72B} and meta-llama/Meta-Llama-3-{8B,70B} config.json values.
- Audio encoders (`AUDIO_PRESETS`): openai/whisper-large-v3's encoder (32 layers, d_model 1280, 20
  heads, FFN 5120, 128 mel bins, 1500 positions), Qwen/Qwen2-Audio-7B's tower (the same, pooled by 2,
  its projector a single linear into the LLM), and openai/whisper-base's (6 layers, 512, 8 heads,
  2048, 80 mel bins).
- tiny: a small demo model (may be changed later to match configs/demo.yaml).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

ProjectorKind = Literal["mlp2x_gelu", "internvl_mlp"]


@dataclasses.dataclass(frozen=True)
class VisionArch:
    """A ViT encoder.

    Attributes:
      num_layers, hidden_size (D), num_heads (H), intermediate_size (F): transformer sizes.
      patch_size, image_size: pixels; patches per tile = (image_size // patch_size) ** 2 (a stride-p
        conv drops the remainder: 384 // 14 = 27).
      tokens_per_tile: LLM tokens one tile becomes (after pixel shuffle if any).
      qk_norm: RMSNorm over q and k (InternViT-6B).
      pixel_shuffle: the projector input is pixel-shuffled (InternVL).
      qkv_bias: q/k/v projections carry a bias.
      class_token: a class token is prepended (sequence = patches + 1; dropped before the projector).
      norm: "layer_norm" (weight + bias) or "rms_norm" (weight only).
      layer_scale: per-channel layer-scale vectors on both residual branches (InternViT).
      head_dim: Dh; defaults to hidden_size // num_heads.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    image_size: int
    tokens_per_tile: int
    qk_norm: bool = False
    pixel_shuffle: bool = False
    qkv_bias: bool = True
    class_token: bool = False
    norm: Literal["layer_norm", "rms_norm"] = "layer_norm"
    layer_scale: bool = False
    head_dim: int | None = None

    def __post_init__(self):
        if self.hidden_size % self.num_heads and self.head_dim is None:
            raise ValueError(f"{self.name}: hidden_size={self.hidden_size} not divisible by heads")
        if self.image_size < self.patch_size:
            raise ValueError(f"{self.name}: image_size={self.image_size} < patch_size")

    @property
    def dh(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def patches_per_tile(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def seq_len(self) -> int:
        """Tokens the encoder's transformer layers see per tile (patches + class token)."""
        return self.patches_per_tile + int(self.class_token)


@dataclasses.dataclass(frozen=True)
class LLMArch:
    """A decoder LLM (Llama/Qwen2 style: RMSNorm, RoPE, GQA, SwiGLU MLP).

    Attributes:
      num_layers (L), hidden_size (D), num_heads (H), num_kv_heads (K), intermediate_size (F),
      vocab_size (V): transformer sizes.
      tie_embeddings: the LM head reuses the token embedding.
      qkv_bias: q/k/v projections carry a bias (Qwen2).
      head_dim: Dh; defaults to hidden_size // num_heads.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    head_dim: int | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: heads={self.num_heads} not divisible by kv={self.num_kv_heads}"
            )

    @property
    def dh(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads


@dataclasses.dataclass(frozen=True)
class ProjectorArch:
    """Vision -> LLM projector.

    Attributes:
      kind: "mlp2x_gelu" (LLaVA: Linear(in,out), GELU, Linear(out,out)) or "internvl_mlp"
        (LayerNorm(in), Linear(in,out), GELU, Linear(out,out)).
      in_dim: projector input width (after pixel shuffle: vision hidden / factor**2).
      out_dim: LLM hidden size.
      pixel_shuffle_factor: spatial downsample per side (0.5 for InternVL, 1.0 = none).
    """

    kind: ProjectorKind
    in_dim: int
    out_dim: int
    pixel_shuffle_factor: float = 1.0

    def __post_init__(self):
        if self.kind not in ("mlp2x_gelu", "internvl_mlp"):
            raise ValueError(f"projector kind={self.kind!r}: use 'mlp2x_gelu' or 'internvl_mlp'")


@dataclasses.dataclass(frozen=True)
class AudioArch:
    """A Whisper-style audio encoder (two 1-D convolutions, pre-LN layers; `models.whisper`).

    Attributes:
      num_layers, hidden_size (D), num_heads (H), intermediate_size (F): transformer sizes.
      num_mel_bins (M): log-mel input width.
      max_source_positions: conv outputs of one 30 s window (attention stays within a window).
      pool: average pool over time before the projector (2 for Qwen2-Audio, 1 for Whisper).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    num_mel_bins: int
    max_source_positions: int = 1500
    pool: int = 2

    @property
    def dh(self) -> int:
        return self.hidden_size // self.num_heads


AUDIO_PRESETS: dict[str, AudioArch] = {
    a.name: a
    for a in (
        AudioArch("whisper-large-v3", 32, 1280, 20, 5120, 128, pool=1),
        AudioArch("qwen2-audio", 32, 1280, 20, 5120, 128, pool=2),
        AudioArch("whisper-base", 6, 512, 8, 2048, 80, pool=1),
    )
}


@dataclasses.dataclass(frozen=True)
class MLLMArch:
    """A multimodal LLM: vision encoder + projector + LLM (+ an audio encoder, whose linear projector
    into the LLM width is counted with it: `audio_params`). `has_vision` False: a model without a
    vision encoder (decoder-only, Qwen2-Audio), whose `vision` ("tiny") is a placeholder that
    nothing prices: no tile is encoded and no encoder is colocated."""

    name: str
    vision: VisionArch
    projector: ProjectorArch
    llm: LLMArch
    audio: AudioArch | None = None
    has_vision: bool = True


VISION_PRESETS: dict[str, VisionArch] = {
    v.name: v
    for v in (
        VisionArch("siglip-so400m", 26, 1152, 16, 4304, 14, 384, 729),
        VisionArch("siglip-1b", 27, 1728, 32, 6912, 14, 384, 729),
        VisionArch("siglip-6b", 40, 2304, 48, 8608, 14, 384, 729),
        VisionArch("internvit-300m", 24, 1024, 16, 4096, 14, 448, 256, pixel_shuffle=True,
                   class_token=True, layer_scale=True),
        VisionArch("internvit-6b", 45, 3200, 25, 12800, 14, 448, 256, qk_norm=True,
                   pixel_shuffle=True, qkv_bias=False, class_token=True, norm="rms_norm",
                   layer_scale=True),
        VisionArch("internvit-1b", 28, 1792, 28, 7168, 14, 448, 256, qk_norm=True,
                   pixel_shuffle=True, qkv_bias=False, class_token=True, norm="rms_norm",
                   layer_scale=True),
        VisionArch("internvit-6b-dflop", 30, 3200, 16, 12800, 14, 448, 256, qk_norm=True,
                   pixel_shuffle=True, qkv_bias=False, class_token=True, norm="rms_norm",
                   layer_scale=True),
        VisionArch("tiny", 2, 64, 4, 128, 14, 56, 16),
    )
}  # fmt: skip

LLM_PRESETS: dict[str, LLMArch] = {
    m.name: m
    for m in (
        LLMArch("qwen2.5-0.5b", 24, 896, 14, 2, 4864, 151936, tie_embeddings=True, qkv_bias=True),
        LLMArch("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, qkv_bias=True),
        LLMArch("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064, qkv_bias=True),
        LLMArch("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, qkv_bias=True),
        LLMArch("llama3-8b", 32, 4096, 32, 8, 14336, 128256),
        LLMArch("llama3-70b", 80, 8192, 64, 8, 28672, 128256),
        LLMArch("tiny", 4, 64, 4, 2, 128, 512),
    )
}

# The two-part names a user may pass (and "tiny"); any vision preset pairs with any LLM preset.
DEFAULT_ARCH = "siglip-so400m+qwen2.5-7b"


def projector_for(vision: VisionArch, llm: LLMArch) -> ProjectorArch:
    """The projector the vision family uses: InternViT -> InternVL MLP after pixel shuffle, else LLaVA."""
    if vision.pixel_shuffle:
        return ProjectorArch("internvl_mlp", vision.hidden_size * 4, llm.hidden_size, 0.5)
    return ProjectorArch("mlp2x_gelu", vision.hidden_size, llm.hidden_size, 1.0)


def list_archs() -> list[str]:
    """Every name `get_arch` accepts: "tiny" and "<vision>+<llm>" for all real presets."""
    real_v = [v for v in VISION_PRESETS if v != "tiny"]
    real_l = [m for m in LLM_PRESETS if m != "tiny"]
    return ["tiny"] + [f"{v}+{m}" for v in real_v for m in real_l]


def get_vision(name: str) -> VisionArch:
    if name not in VISION_PRESETS:
        raise ValueError(f"unknown vision arch {name!r}; known: {', '.join(VISION_PRESETS)}")
    return VISION_PRESETS[name]


def get_llm(name: str) -> LLMArch:
    if name not in LLM_PRESETS:
        raise ValueError(f"unknown LLM arch {name!r}; known: {', '.join(LLM_PRESETS)}")
    return LLM_PRESETS[name]


def get_arch(name: str) -> MLLMArch:
    """An `MLLMArch` by name: "tiny" or "<vision>+<llm>" (e.g. "siglip-so400m+qwen2.5-7b"), or with
    an audio encoder "<vision>+<llm>+<audio>" (e.g. "siglip-so400m+qwen2.5-7b+qwen2-audio", an
    omni model; `AUDIO_PRESETS`).

    Raises:
      ValueError: unknown name, listing the known vision, LLM and audio presets.
    """
    if name == "tiny":
        return MLLMArch(name, VISION_PRESETS["tiny"], projector_for(VISION_PRESETS["tiny"],
                        LLM_PRESETS["tiny"]), LLM_PRESETS["tiny"])  # fmt: skip
    parts = name.split("+")
    known = (
        len(parts) in (2, 3)
        and parts[0] in VISION_PRESETS
        and parts[1] in LLM_PRESETS
        and (len(parts) == 2 or parts[2] in AUDIO_PRESETS)
    )
    if not known:
        raise ValueError(
            f"unknown arch {name!r}: use 'tiny', '<vision>+<llm>' or '<vision>+<llm>+<audio>' with "
            f"vision in {{{', '.join(VISION_PRESETS)}}}, llm in {{{', '.join(LLM_PRESETS)}}} and "
            f"audio in {{{', '.join(AUDIO_PRESETS)}}}"
        )
    vision, llm = VISION_PRESETS[parts[0]], LLM_PRESETS[parts[1]]
    audio = AUDIO_PRESETS[parts[2]] if len(parts) == 3 else None
    return MLLMArch(name, vision, projector_for(vision, llm), llm, audio)


def llm_arch_from_config(cfg, name: str = "custom-llm") -> LLMArch:
    """An `LLMArch` from any decoder config with the usual fields (e.g. `models.decoder_config.
    DecoderConfig`: hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, vocab_size,
    head_dim, tie_embeddings, qkv_bias). Duck-typed, so this package never imports the models."""
    return LLMArch(
        name, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
        cfg.intermediate_size, cfg.vocab_size, tie_embeddings=cfg.tie_embeddings,
        qkv_bias=cfg.qkv_bias, head_dim=cfg.head_dim,
    )  # fmt: skip


def vision_arch_from_config(cfg, tokens_per_tile: int, name: str = "custom-vision") -> VisionArch:
    """A `VisionArch` from a ViT config (e.g. `models.vit.ViTConfig`: hidden_size, num_layers,
    num_heads, intermediate_size, patch_size, image_size, qk_norm, qkv_bias, cls_token, norm,
    layer_scale), with the LLM tokens each tile becomes (after pixel shuffle if any)."""
    patches = (cfg.image_size // cfg.patch_size) ** 2
    return VisionArch(
        name, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.intermediate_size,
        cfg.patch_size, cfg.image_size, tokens_per_tile, qk_norm=cfg.qk_norm,
        pixel_shuffle=tokens_per_tile < patches, qkv_bias=cfg.qkv_bias,
        class_token=cfg.cls_token, norm=cfg.norm, layer_scale=cfg.layer_scale,
    )  # fmt: skip


def arch_from_configs(vision_cfg, llm_cfg, tokens_per_tile: int, name: str = "custom") -> MLLMArch:
    """An `MLLMArch` for a model built from config objects (the runtime's own model, for MFU and
    plans); the projector follows the vision family as in `get_arch`."""
    vision = vision_arch_from_config(vision_cfg, tokens_per_tile, f"{name}-vision")
    llm = llm_arch_from_config(llm_cfg, f"{name}-llm")
    return MLLMArch(name, vision, projector_for(vision, llm), llm)


def arch_of_model(model_cfg, name: str = "run") -> MLLMArch:
    """The cost-model `MLLMArch` of a `models` config (duck-typed): an MLLM config (vision, text,
    tokens_per_tile), an omni config (`llava` + `audio`), a Qwen2-Audio config (`audio` tower +
    `text`) or a decoder-only config. A model without a vision tower gets the "tiny" one as a
    placeholder (`has_vision` False)."""
    if hasattr(model_cfg, "llava"):  # an omni model: the vision model's arch + the audio encoder
        arch = arch_of_model(model_cfg.llava, name)
    elif hasattr(model_cfg, "vision"):
        return arch_from_configs(model_cfg.vision, model_cfg.text, model_cfg.tokens_per_tile, name)
    else:
        llm = llm_arch_from_config(getattr(model_cfg, "text", model_cfg), f"{name}-llm")
        vision = get_vision("tiny")
        arch = MLLMArch(name, vision, projector_for(vision, llm), llm, has_vision=False)
    if not hasattr(model_cfg, "audio"):
        return arch
    a = getattr(model_cfg.audio, "audio", model_cfg.audio)  # an omni model's Qwen2-Audio part's
    audio = AudioArch(f"{name}-audio", a.num_layers, a.hidden_size, a.num_heads,
                      a.intermediate_size, a.num_mel_bins, a.max_source_positions, a.pool)  # fmt: skip
    return dataclasses.replace(arch, audio=audio)


def pad_vision_heads(arch: MLLMArch, tp: int) -> MLLMArch:
    """`arch` with its encoder's attention heads padded up to a multiple of `tp` (unchanged if they divide).

    Megatron-LM requires heads divisible by tp, so NVLM trains InternViT-6B (25 heads) at tp 8 with 7
    zero dummy heads (32 in all): the padded heads cost real weights, FLOPs and activations, which this
    arch counts. The head width stays the original's; the projector is unaffected.
    """
    v = arch.vision
    heads = -(-v.num_heads // tp) * tp
    if heads == v.num_heads:
        return arch
    padded = dataclasses.replace(v, name=f"{v.name}-pad{heads}", num_heads=heads, head_dim=v.dh)
    return dataclasses.replace(arch, vision=padded)
