"""`DataConfig`: where samples come from and how they become tiles and tokens (one frozen dataclass).

Defaults are the demo's: synthetic LLaVA-OV data, the bundled byte tokenizer, Qwen2.5 chat template.
Family-dependent values (tile size, pixel mean/std) are derived when left at 0 / empty.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from dflop_jax.config import InputPath, require, require_seed

# Pixel normalization as the HF image processors use it.
SIGLIP_MEAN = (0.5, 0.5, 0.5)
SIGLIP_STD = (0.5, 0.5, 0.5)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

SYNTH_MIXES = (
    "llava-ov", "internvl", "text", "single-image", "multi-image", "video", "dflop", "audio", "omni",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Data source and per-sample processing.

    Attributes:
      source: a dataset-mix YAML, one JSON/JSONL file, parquet or WebDataset tar shards (a file, a glob
        or a directory, e.g. a downloaded HF dataset: `data/shards.py`), or "synthetic" (generated
        into `synth_dir`).
      synth_dir: where synthetic data is written (reused if already complete).
      synth_samples, synth_mix, synth_seed: the synthetic dataset (see `dflop_jax.data.synth`).
      image_root, video_root, audio_root: folders relative image/video/audio paths resolve against
        ("" = the JSON's folder).
      model_family: "llava_ov" (SigLIP anyres, 729 tokens/tile) or "internvl" (448 px dynamic tiles, 256).
      tile_size: encoder tile side in pixels; 0 = auto: with `model.hf_dir` its
        preprocessor_config.json's `size` (or `crop_size`), else its config.json's vision
        `image_size`; without hf_dir 384 (llava_ov) / 448 (internvl). It must equal the vision tower's `image_size` (its position embeddings).
      patch_size: encoder patch side; tokens per tile = (tile/patch)^2 (InternVL: ((tile/patch)/2)^2).
      anyres_max: LLaVA-OV anyres_max_N feature budget for the grid.
      max_grid: LLaVA-OV pinpoints are every a x b grid of tiles with a, b <= max_grid; 0 = auto:
        with `model.hf_dir` the largest of its preprocessor_config.json `image_grid_pinpoints` over the
        tile size, else 6 (LLaVA-OV's).
      max_tiles: InternVL maximum dynamic tiles (a thumbnail is added when more than one); 0 = auto:
        with `model.hf_dir` its preprocessor_config.json `max_patches` or config.json
        `max_dynamic_patch`, else 12 (InternVL's).
      use_thumbnail: InternVL thumbnail tile.
      video_fps: frames sampled per second of video; max_frames: upper bound (uniform if more).
      max_audio_s: longest audio clip, in seconds; a longer one is a counted skip ("audio_too_long").
        Clips are cut into 30 s encoder windows (`data/audio.py`), each adding up to 750 tokens.
      audio_mels: log-mel bins of the audio features: the audio encoder's `num_mel_bins` (128 for
        Qwen2-Audio and Whisper large-v3, 80 for earlier Whisper sizes).
      tokenizer: "bundled" (byte-level, ships with the package) or an HF model/tokenizer directory.
      chat_template: "qwen2.5" | "llama3" (built in) | "from_tokenizer" (the tokenizer directory's
        chat_template.jinja or tokenizer_config.json `chat_template`) | "auto": with `model.hf_dir` whose
        tokenizer is used and has a template, from_tokenizer; else qwen2.5.
      system_prompt: a system turn added when the record has none; None = the template's own default.
      max_tokens: longest sample (LLM tokens) the scheduler may see; longer ones per `too_long`.
      too_long: "skip" (BadSample too_long) or "truncate" (text cut; refused if images would be cut).
      strict: raise on the first bad record instead of counting and skipping it, and treat a record
        with keys beyond the format and `extra_fields` as bad ("unknown_fields"). By default such keys
        (source tags, metadata, sample ids of real LLaVA data) are ignored and the record is kept.
      extra_fields: record (or turn) keys accepted even under `strict`, beyond
        id/image/video/conversations/text/data_source/source (turns: from/value).
      cache_dir: shape-metadata cache ("" disables caching).
      pixel_mean, pixel_std: normalization; empty = auto: with `model.hf_dir` its
        preprocessor_config.json's `image_mean` / `image_std`, else (or without that file) the family's
        (SigLIP 0.5/0.5, InternVL ImageNet).
        Tiles stay uint8 up to the device; the first encoder stage applies these (the trainer passes
        them into the model config).
      decode_workers: processes decoding each batch's images/videos (`data.decode_pool`) while the
        schedule stays in the training process; -1 = automatic: min(4, cpus - 1) for image/video
        data at tiles >= 224 px on hosts with >= 4 CPUs, else 0 (text and tiny tiles decode faster
        than a worker ships them back; `data/decode_pool.py`); 0 = decode in the loader's
        background thread.
    """

    source: str = "synthetic"
    synth_dir: str = "runs/synth_data"
    synth_samples: int = 512
    synth_mix: str = "llava-ov"
    synth_seed: int = 0
    image_root: str = ""
    video_root: str = ""
    audio_root: str = ""
    model_family: Literal["llava_ov", "internvl"] = "llava_ov"
    tile_size: int = 0
    patch_size: int = 14
    anyres_max: int = 9
    max_grid: int = 0
    max_tiles: int = 0
    use_thumbnail: bool = True
    video_fps: float = 1.0
    max_frames: int = 32
    max_audio_s: float = 300.0
    audio_mels: int = 128
    tokenizer: str = "bundled"
    chat_template: Literal["auto", "qwen2.5", "llama3", "from_tokenizer"] = "auto"
    system_prompt: str | None = None
    max_tokens: int = 32768
    too_long: Literal["skip", "truncate"] = "skip"
    strict: bool = False
    extra_fields: tuple[str, ...] = ()
    cache_dir: str = "data_cache/metadata"
    pixel_mean: tuple[float, ...] = ()
    pixel_std: tuple[float, ...] = ()
    decode_workers: int = -1

    def __post_init__(self):
        require(
            bool(self.source),
            "data.source",
            self.source,
            "give a mix YAML, a JSON/JSONL file, parquet/tar shards or 'synthetic'",
        )
        require(self.synth_samples > 0, "data.synth_samples", self.synth_samples, "must be >= 1")
        require_seed(self.synth_seed, "data.synth_seed")
        require(
            self.source != "synthetic" or bool(self.synth_dir),
            "data.synth_dir",
            self.synth_dir,
            "give a directory for the synthetic data",
        )
        require(
            self.chat_template != "from_tokenizer" or self.tokenizer != "bundled",
            "data.chat_template",
            self.chat_template,
            "the bundled tokenizer has no template: use qwen2.5 or llama3, or an HF data.tokenizer",
        )
        require(
            self.synth_mix in SYNTH_MIXES,
            "data.synth_mix",
            self.synth_mix,
            f"choose one of {SYNTH_MIXES}",
        )
        require(
            self.tile_size >= 0,
            "data.tile_size",
            self.tile_size,
            "use 0 (auto: model.hf_dir's or the family's) or a pixel size",
        )
        require(self.patch_size >= 1, "data.patch_size", self.patch_size, "must be >= 1")
        # Patches per side = tile // patch (SigLIP 384 / 14 -> 27: the convolution drops the remainder).
        fix = f"must be at least data.patch_size={self.patch_size}"
        require(self.tile_px >= self.patch_size, "data.tile_size", self.tile_px, fix)
        if self.model_family == "internvl":  # pixel shuffle halves each side
            fix = "InternVL needs an even number of patches per tile side"
            require((self.tile_px // self.patch_size) % 2 == 0, "data.tile_size", self.tile_px, fix)
        require(self.anyres_max >= 1, "data.anyres_max", self.anyres_max, "must be >= 1")
        require(
            0 <= self.max_grid <= 12,
            "data.max_grid",
            self.max_grid,
            "use 0 (auto) or 1..12 (LLaVA-OV uses 6)",
        )
        fix = "use 0 (auto) or a tile count >= 1"
        require(self.max_tiles >= 0, "data.max_tiles", self.max_tiles, fix)
        require(
            self.video_fps > 0, "data.video_fps", self.video_fps, "must be > 0 frames per second"
        )
        require(self.max_frames >= 1, "data.max_frames", self.max_frames, "must be >= 1")
        fix = "must be > 0 seconds (clips longer than it are skipped as audio_too_long)"
        require(self.max_audio_s > 0, "data.max_audio_s", self.max_audio_s, fix)
        fix = "use the audio encoder's num_mel_bins (128 for Qwen2-Audio, 80 for Whisper <= v2)"
        require(self.audio_mels >= 1, "data.audio_mels", self.audio_mels, fix)
        require(self.max_tokens >= 16, "data.max_tokens", self.max_tokens, "must be >= 16")
        for name in ("pixel_mean", "pixel_std"):
            value = getattr(self, name)
            require(len(value) in (0, 3), f"data.{name}", value, "give 3 values (RGB) or none")
        require(all(s > 0 for s in self.pixel_std), "data.pixel_std", self.pixel_std, "must be > 0")
        fix = "use -1 (automatic), 0 (decode in-process) or a process count"
        require(self.decode_workers >= -1, "data.decode_workers", self.decode_workers, fix)

    def inputs(self) -> list[InputPath]:
        """The files and folders this data config reads (synthetic data is generated, not read)."""
        out = []
        fix = "give a mix YAML, a JSON/JSONL file, parquet/tar shards or 'synthetic'"
        if self.source != "synthetic" and not any(c in self.source for c in "*?["):
            # a glob is checked when it is expanded (it must match at least one shard)
            kind = "dir" if Path(self.source).expanduser().is_dir() else "file"
            out.append(InputPath("source", self.source, kind, fix))
        if self.tokenizer != "bundled":
            fix = "give an HF model/tokenizer directory or 'bundled'"
            out.append(
                InputPath("tokenizer", self.tokenizer, "dir", fix, contains="tokenizer.json")
            )
        for name in ("image_root", "video_root", "audio_root"):
            if getattr(self, name):
                fix = "give the media folder or '' (paths relative to the dataset file)"
                out.append(InputPath(name, getattr(self, name), "dir", fix))
        return out

    @property
    def tile_px(self) -> int:
        """The encoder tile side in pixels."""
        if self.tile_size:
            return self.tile_size
        return 384 if self.model_family == "llava_ov" else 448

    @property
    def anyres_grid(self) -> int:
        """The largest LLaVA-OV anyres grid side (`max_grid`, 0 = 6)."""
        return self.max_grid or 6

    @property
    def dynamic_max_tiles(self) -> int:
        """The InternVL dynamic-tiling budget (`max_tiles`, 0 = 12)."""
        return self.max_tiles or 12

    @property
    def mean(self) -> tuple[float, float, float]:
        if self.pixel_mean:
            return tuple(self.pixel_mean)
        return SIGLIP_MEAN if self.model_family == "llava_ov" else IMAGENET_MEAN

    @property
    def std(self) -> tuple[float, float, float]:
        if self.pixel_std:
            return tuple(self.pixel_std)
        return SIGLIP_STD if self.model_family == "llava_ov" else IMAGENET_STD

    def processing_key(self) -> dict:
        """Every field that changes a sample's tiles or tokens (the metadata cache key)."""
        keep = (
            "model_family", "tile_size", "patch_size", "anyres_max", "max_grid", "max_tiles", "use_thumbnail",
            "video_fps", "max_frames", "max_audio_s", "audio_mels", "tokenizer", "chat_template", "system_prompt", "max_tokens", "too_long",
            "strict", "extra_fields",  # under strict, extra keys make a record bad
        )  # fmt: skip
        return {k: getattr(self, k) for k in keep}
