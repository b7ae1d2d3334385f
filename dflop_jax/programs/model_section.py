"""The `model:` section of a run config (`ModelConfig`) and what it becomes: a `models/` config (from
the fields, an HF directory's config.json, or a named architecture) and, through
`costs.arch_of_model`, the cost model's architecture.

Named architectures: LLaVA-style archs (a ViT without class token or pixel shuffle + `mlp2x_gelu`
projector + decoder) map to `models.llava_onevision.LlavaOnevisionConfig`; InternVL-style archs (class
token, pixel shuffle 0.5, LayerNorm + MLP projector) to `models.internvl.InternVLConfig`. Weights are
random: only shapes matter.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from dflop_jax.config import require, require_seed
from dflop_jax.config.inputs import InputPath
from dflop_jax.costs import MLLMArch, get_arch
from models.decoder_config import ATTENTION_IMPLS, REMAT_MODES


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model trained: a named architecture, the fields below, or an HF directory.

    `model: siglip-so400m+qwen2.5-7b` is short for `model: {arch: siglip-so400m+qwen2.5-7b}`.

    Attributes:
      arch: a named architecture (`dflop_jax.costs.list_archs()`) whose shapes the model takes
        (random weights unless `hf_dir` is given); "" = the fields below. Its kind is set from it.
      kind: "llava_ov" (SigLIP-style ViT + mlp2x_gelu projector + decoder), "internvl" (InternViT-style
        ViT + pixel shuffle 0.5 + LayerNorm/MLP projector + decoder; (tile/patch / 2)^2 tokens per tile,
        256 at 448 px), "omni" (llava_ov's vision tower and projector + Qwen2-Audio's Whisper audio
        encoder and linear projector + the decoder: `models.omni`; from the fields only, its
        log-mel bins data.audio_mels; the audio encoder runs on the first LLM stage),
        "qwen2_audio" (Qwen2-Audio: that audio encoder and projector + the decoder, no vision; from
        the fields or a Qwen2-Audio `hf_dir`) or "decoder" (text only). A vision kind must equal
        data.model_family (omni: llava_ov).
      hf_dir: an HF model directory (config.json + safetensors) to load; "" = build from `arch` or
        the fields. With `arch` too, the directory's config.json must describe that architecture.
        Its tokenizer (tokenizer.json there) replaces the bundled byte tokenizer (`data.tokenizer`
        left at "bundled"; another directory given there is kept).
      vocab_size: 0 = the tokenizer's vocabulary size (padded to a multiple of 128).
      hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim: decoder shapes.
      vision_*: ViT shapes (llava_ov); its image and patch sizes are the data's tile and patch sizes.
      audio_*: the audio encoder's shapes (omni, qwen2_audio): a Whisper encoder over 30 s windows
        (1500 positions), pooled by 2, as Qwen2-Audio's.
      init_seed: seed of the random initialization (ignored when loading).
      vision_remat, llm_remat: activation recomputation in the backward of each vision / decoder
        layer: "none", "full" (keep only the layer's input) or "dots" (also keep the matmul
        outputs). Training from a plan.yaml applies the plan's policy instead (`resolve.RunContext`); the
        planner's memory model assumes the same policy (`costs/memory.py`).
      attention_impl: the attention kernel of every layer (vision and decoder, also with `hf_dir`):
        "auto" picks per device and part, once per process (`programs.devices.attention_kernels`:
        "xla" off GPU; on Hopper or newer "cudnn", the decoder "pallas" where cuDNN's packed layout
        is unusable; on older GPUs "pallas"), or one of "xla" (portable), "pallas" (our flash
        kernels), "cudnn" (`models/cudnn_attention.py`). The model config carries the resolved names.
      vision_attention_impl: the vision tower's kernel where it differs ("": `attention_impl`;
        "auto" as above).
      llm_layers_kept: keep only the first N decoder layers of `arch` or `hf_dir` (0 = all of them):
        a real model cut to fit fewer devices (`configs/llava_ov_7b_1gpu.yaml`). The vision tower,
        projector, embedding, final norm and LM head stay whole; from `hf_dir` the first N layers'
        weights are read and the rest are not. Planning, memory, FLOPs and MFU are the cut
        model's; an export writes the cut model. Only with `arch` or `hf_dir` (else set
        `num_layers`).
    """

    SHORTHAND = "arch"  # a bare string given for the section sets this key

    kind: Literal["llava_ov", "internvl", "omni", "qwen2_audio", "decoder"] = "llava_ov"
    arch: str = ""
    hf_dir: str = ""
    vocab_size: int = 0
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    vision_hidden_size: int = 32
    vision_intermediate_size: int = 64
    vision_num_layers: int = 2
    vision_num_heads: int = 2
    audio_hidden_size: int = 32
    audio_intermediate_size: int = 64
    audio_num_layers: int = 2
    audio_num_heads: int = 2
    init_seed: int = 0
    vision_remat: str = "none"
    llm_remat: str = "none"
    attention_impl: str = "auto"
    vision_attention_impl: str = ""
    llm_layers_kept: int = 0

    def __post_init__(self):
        fix = "an omni model is built from the fields (model.arch and model.hf_dir give '')"
        require(self.kind != "omni" or not (self.arch or self.hf_dir), "model.kind", self.kind, fix)
        fix = "the named architectures are vision models: build it from the fields or model.hf_dir"
        require(self.kind != "qwen2_audio" or not self.arch, "model.kind", self.kind, fix)
        if self.arch:
            from dflop_jax.costs import get_arch, list_archs

            require(self.arch in list_archs(), "model.arch", self.arch,
                    f"use one of {', '.join(list_archs())}")  # fmt: skip
            family = "internvl" if get_arch(self.arch).vision.class_token else "llava_ov"
            object.__setattr__(self, "kind", family)  # the architecture's family, not the default
            total = get_arch(self.arch).llm.num_layers
            require(self.llm_layers_kept <= total, "model.llm_layers_kept", self.llm_layers_kept,
                    f"{self.arch} has {total} decoder layers: keep 1..{total} (0 = all)")  # fmt: skip
        require(self.llm_layers_kept >= 0, "model.llm_layers_kept", self.llm_layers_kept,
                "0 (every layer) or the number of first decoder layers to keep")  # fmt: skip
        fix = "it cuts model.arch or model.hf_dir; a model built from the fields sets model.num_layers"
        require(not self.llm_layers_kept or bool(self.arch or self.hf_dir),
                "model.llm_layers_kept", self.llm_layers_kept, fix)  # fmt: skip
        impls = [*(i for i in ATTENTION_IMPLS if i), "auto"]
        require(self.attention_impl in impls, "model.attention_impl", self.attention_impl,
                f"use one of {impls}")  # fmt: skip
        require(self.vision_attention_impl in ["", *impls], "model.vision_attention_impl",
                self.vision_attention_impl, f"use one of {impls}, or '' for model.attention_impl")  # fmt: skip
        for name in ("vision_remat", "llm_remat"):
            value = getattr(self, name)
            require(value in REMAT_MODES, f"model.{name}", value, f"use one of {REMAT_MODES}")
        require(self.vocab_size >= 0, "model.vocab_size", self.vocab_size, "0 (tokenizer's) or > 0")
        for name in MODEL_SIZES:
            value = getattr(self, name)
            require(value >= 1, f"model.{name}", value, "must be >= 1")
        require(
            self.num_heads % self.num_kv_heads == 0,
            "model.num_heads",
            self.num_heads,
            f"must be a multiple of model.num_kv_heads={self.num_kv_heads} (grouped-query attention)",
        )
        require(self.head_dim % 2 == 0, "model.head_dim", self.head_dim, "must be even (RoPE)")
        for tower in ("vision", "audio"):
            width, heads = (
                getattr(self, f"{tower}_hidden_size"),
                getattr(self, f"{tower}_num_heads"),
            )
            require(width % heads == 0, f"model.{tower}_hidden_size", width,
                    f"must be a multiple of model.{tower}_num_heads={heads}")  # fmt: skip
        require_seed(self.init_seed, "model.init_seed")

    def inputs(self) -> list[InputPath]:
        if not self.hf_dir:
            return []
        fix = (
            "give an HF model directory (config.json + safetensors) or '' to build from the fields"
        )
        return [InputPath("hf_dir", self.hf_dir, "dir", fix, contains="config.json")]

    @property
    def has_vision(self) -> bool:
        """Whether the model has a vision encoder (its tiles are encoded)."""
        return self.kind in ("llava_ov", "internvl", "omni")

    @property
    def has_audio(self) -> bool:
        """Whether the model has an audio encoder (its audio windows are encoded)."""
        return self.kind in ("omni", "qwen2_audio")

    @property
    def remat(self) -> dict[str, str]:
        """The per-module policy, as plan.yaml records it ({"vision": ..., "llm": ...})."""
        return {"vision": self.vision_remat, "llm": self.llm_remat}

    def with_sizes_of(self, model_cfg) -> ModelConfig:
        """This section with the kind and sizes of `model_cfg`, the model built from it, for the run's
        config.yaml: with `hf_dir` or `arch` those come from config.json or the architecture (the
        fields here are ignored and would keep their defaults); otherwise the section is returned
        unchanged (its fields are the model's, `vocab_size` 0 still meaning the tokenizer's)."""
        if not (self.hf_dir or self.arch):
            return self
        text = getattr(model_cfg, "text", model_cfg)
        sizes = {
            "vocab_size": text.vocab_size, "hidden_size": text.hidden_size,
            "intermediate_size": text.intermediate_size, "num_layers": text.num_layers,
            "num_heads": text.num_heads, "num_kv_heads": text.num_kv_heads,
            "head_dim": text.head_dim,
        }  # fmt: skip
        vision = getattr(model_cfg, "vision", None)
        audio = getattr(model_cfg, "audio", None)
        if vision is None and audio is not None:  # Qwen2-Audio
            sizes |= {
                "audio_hidden_size": audio.hidden_size,
                "audio_intermediate_size": audio.intermediate_size,
                "audio_num_layers": audio.num_layers, "audio_num_heads": audio.num_heads,
            }  # fmt: skip
            return dataclasses.replace(self, kind="qwen2_audio", **sizes)
        if vision is None:
            return dataclasses.replace(self, kind="decoder", **sizes)
        sizes |= {
            "vision_hidden_size": vision.hidden_size,
            "vision_intermediate_size": vision.intermediate_size,
            "vision_num_layers": vision.num_layers, "vision_num_heads": vision.num_heads,
        }  # fmt: skip
        from models.internvl import InternVLConfig

        kind = "internvl" if isinstance(model_cfg, InternVLConfig) else "llava_ov"
        return dataclasses.replace(self, kind=kind, **sizes)

    def attention_kernels(self) -> tuple[str, str]:
        """(vision, decoder) attention implementations with "auto" resolved for this process's
        device (`programs.devices.local_attention_kernels`, asked only when "auto" is set)."""
        vision = self.vision_attention_impl or self.attention_impl
        llm = self.attention_impl
        if "auto" in (vision, llm):
            from dflop_jax.programs.devices import local_attention_kernels

            auto = local_attention_kernels()
            vision = auto.vision if vision == "auto" else vision
            llm = auto.llm if llm == "auto" else llm
        return vision, llm

    @property
    def source(self) -> int | str:
        """Where the params come from (`programs.stage_builder.ParamSource`): the HF directory, else
        the init seed."""
        return self.hf_dir or self.init_seed

    def model_config(
        self,
        tokenizer_vocab: int,
        *,
        tile_px: int,
        patch_size: int,
        compute_dtype: str,
        pixel_norm: tuple[tuple[float, ...], tuple[float, ...]] | None = None,
        audio_mels: int = 128,
    ):
        """The `models` config of the model (fp32 master params): from the fields, or from `hf_dir`'s
        config.json. No parameter is made here: each pipeline stage makes its own
        (`programs.stage_builder.build_stages(model_cfg, layout, meshes, self.source)`).

        Args:
          tokenizer_vocab: the tokenizer's vocabulary (used when `vocab_size` is 0, padded to a
            multiple of 128 so tp divides it; the padding rows are never targeted).
          tile_px, patch_size: the data's tile and patch size (the ViT's image and patch size).
          compute_dtype: dtype of the matmuls.
          pixel_norm: the data's (mean, std) (`DataConfig.mean`, `.std`), which the first encoder
            stage applies to the uint8 tiles; None = the vision family's default.
          audio_mels: the data's log-mel bins (`data.audio_mels`), the audio encoder's input width
            (omni).

        Returns:
          A `DecoderConfig`, `LlavaOnevisionConfig`, `InternVLConfig`, `OmniConfig` or
          `Qwen2AudioConfig`.
        """
        from models.decoder_config import DecoderConfig

        vision_impl, llm_impl = self.attention_kernels()
        if self.arch and not self.hf_dir:
            from models.stage_modules import with_attention, with_remat

            cfg = model_config_for_arch(self.arch, compute_dtype)
            cfg = with_attention(with_remat(cfg, self.remat), llm_impl, vision_impl)
            return _with_pixel_norm(self._cut(cfg), pixel_norm)
        if self.hf_dir:
            from models.hf import load_config
            from models.stage_modules import with_attention, with_remat

            cfg = load_config(self.hf_dir, dtype=compute_dtype, param_dtype="float32")
            self._check_hf_kind(cfg, audio_mels)
            cfg = with_attention(with_remat(cfg, self.remat), llm_impl, vision_impl)
            return _with_pixel_norm(self._cut(cfg), pixel_norm)
        dcfg = DecoderConfig(
            vocab_size=self.vocab_size or -(-tokenizer_vocab // 128) * 128,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=compute_dtype,
            param_dtype="float32",
            remat=self.llm_remat,
            attention_impl=llm_impl,
        )
        vision = {
            "hidden_size": self.vision_hidden_size,
            "intermediate_size": self.vision_intermediate_size,
            "num_layers": self.vision_num_layers,
            "num_heads": self.vision_num_heads,
            "image_size": tile_px,
            "patch_size": patch_size,
            "dtype": compute_dtype,
            "remat": self.vision_remat,
            "attention_impl": vision_impl,
        }
        if self.kind == "decoder":
            return dcfg
        if self.kind == "qwen2_audio":
            from models.qwen2_audio import Qwen2AudioConfig

            return Qwen2AudioConfig(self._audio_tower(audio_mels, compute_dtype, vision_impl), dcfg)
        if self.kind == "internvl":
            from models.internvit import InternViTConfig
            from models.internvl import internvl_config

            return _with_pixel_norm(internvl_config(InternViTConfig(**vision), dcfg), pixel_norm)
        from models.llava_onevision import llava_onevision_config
        from models.siglip import SiglipConfig

        llava = _with_pixel_norm(llava_onevision_config(SiglipConfig(**vision), dcfg), pixel_norm)
        if self.kind != "omni":
            return llava
        return self._omni(llava, audio_mels, compute_dtype, vision_impl)

    def _omni(self, llava, audio_mels: int, compute_dtype: str, impl: str):
        """The `OmniConfig` of `llava` and an audio encoder of the `audio_*` sizes."""
        from models.omni import OmniConfig
        from models.qwen2_audio import Qwen2AudioConfig

        tower = self._audio_tower(audio_mels, compute_dtype, impl)
        return OmniConfig.compose(llava, Qwen2AudioConfig(tower, llava.text))

    def _audio_tower(self, audio_mels: int, compute_dtype: str, impl: str):
        """The Whisper encoder of the `audio_*` sizes, pooled by 2 (its remat and attention kernel
        the vision tower's: the encoders')."""
        from models.whisper import WhisperEncoderConfig

        return WhisperEncoderConfig(
            hidden_size=self.audio_hidden_size, intermediate_size=self.audio_intermediate_size,
            num_layers=self.audio_num_layers, num_heads=self.audio_num_heads,
            num_mel_bins=audio_mels, pool=2, dtype=compute_dtype, remat=self.vision_remat,
            attention_impl=impl,
        )  # fmt: skip

    def _check_hf_kind(self, model_cfg, audio_mels: int) -> None:
        """Raises ConfigError when `hf_dir` holds a Qwen2-Audio model and `kind` is not
        qwen2_audio, or the other way round (the kind decides the layout and the data's media),
        or when its audio encoder reads other mel bins than the data's `audio_mels`."""
        from models.qwen2_audio import Qwen2AudioConfig

        audio = isinstance(model_cfg, Qwen2AudioConfig)
        what = "a Qwen2-Audio model" if audio else f"a {type(model_cfg).__name__}"
        fix = f"{self.hf_dir} holds {what}: set model.kind to " + (
            "qwen2_audio" if audio else "the model's family (llava_ov, internvl or decoder)"
        )
        require(audio == (self.kind == "qwen2_audio"), "model.kind", self.kind, fix)
        if audio:
            mels = model_cfg.audio.num_mel_bins
            fix = f"{self.hf_dir}'s audio encoder reads {mels} log-mel bins: set data.audio_mels={mels}"
            require(mels == audio_mels, "data.audio_mels", audio_mels, fix)

    def _cut(self, model_cfg):
        """`model_cfg` with only its first `llm_layers_kept` decoder layers (unchanged at 0)."""
        n = self.llm_layers_kept
        if not n:
            return model_cfg
        text = getattr(model_cfg, "text", model_cfg)
        fix = f"the model has {text.num_layers} decoder layers: keep 1..{text.num_layers} (0 = all)"
        require(n <= text.num_layers, "model.llm_layers_kept", n, fix)
        if text is model_cfg:  # a decoder-only model
            return text.replace(num_layers=n)
        return dataclasses.replace(model_cfg, text=text.replace(num_layers=n))


def _with_pixel_norm(model_cfg, pixel_norm):
    """`model_cfg` whose vision tower normalizes uint8 tiles with the data's (mean, std)."""
    if pixel_norm is None or not hasattr(model_cfg, "vision"):
        return model_cfg
    mean, std = map(tuple, pixel_norm)
    vision = model_cfg.vision.replace(pixel_mean=mean, pixel_std=std)
    return dataclasses.replace(model_cfg, vision=vision)


# Sizes of a ModelConfig that must be >= 1 (and that a run config ignores where the shapes come from elsewhere).
MODEL_SIZES = (
    "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
    "vision_hidden_size", "vision_intermediate_size", "vision_num_layers", "vision_num_heads",
    "audio_hidden_size", "audio_intermediate_size", "audio_num_layers", "audio_num_heads",
)  # fmt: skip


def model_config_for_arch(arch: MLLMArch | str, compute_dtype: str = "bfloat16"):
    """A `LlavaOnevisionConfig` or `InternVLConfig` with the sizes of `arch` (fp32 params).

    Raises:
      ValueError: the architecture mixes the two families (e.g. pixel shuffle without a class token).
    """
    from models.decoder_config import DecoderConfig

    arch = get_arch(arch) if isinstance(arch, str) else arch
    v, m = arch.vision, arch.llm
    text = DecoderConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
        head_dim=m.dh, qkv_bias=m.qkv_bias, tie_embeddings=m.tie_embeddings, dtype=compute_dtype,
    )  # fmt: skip
    vision = dict(
        hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, num_layers=v.num_layers,
        num_heads=v.num_heads, image_size=v.image_size, patch_size=v.patch_size,
        norm=v.norm, qkv_bias=v.qkv_bias, qk_norm=v.qk_norm, layer_scale=v.layer_scale,
        post_norm=False, dtype=compute_dtype,
    )  # fmt: skip
    if v.pixel_shuffle and v.class_token and arch.projector.kind != "mlp2x_gelu":
        return _internvl(arch, vision, text)
    if v.pixel_shuffle or v.class_token or arch.projector.kind != "mlp2x_gelu":
        raise ValueError(
            f"arch {arch.name!r}: the profiler builds LLaVA-style models (no class token, no pixel "
            "shuffle, mlp2x_gelu projector) or InternVL-style ones (class token + pixel shuffle + "
            f"InternVL projector); this one has class_token={v.class_token}, pixel_shuffle="
            f"{v.pixel_shuffle}, projector={arch.projector.kind!r}"
        )
    from models.llava_onevision import LlavaOnevisionConfig
    from models.vit import ViTConfig

    return LlavaOnevisionConfig(vision=ViTConfig(**vision), text=text)


def _internvl(arch: MLLMArch, vision: dict, text):
    from models.internvit import InternViTConfig
    from models.internvl import InternVLConfig

    cfg = InternVLConfig(vision=InternViTConfig(**vision, cls_token=True), text=text)
    if cfg.tokens_per_tile != arch.vision.tokens_per_tile:
        raise ValueError(
            f"arch {arch.name!r}: {arch.vision.tokens_per_tile} tokens per tile, but pixel shuffle "
            f"0.5 of a {cfg.vision.patches_per_side}-patch grid gives {cfg.tokens_per_tile}"
        )
    return cfg
