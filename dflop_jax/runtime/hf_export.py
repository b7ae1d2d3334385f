"""A training run's checkpoint -> an HF model directory that transformers (and vLLM) load.

    ctx = RunContext.build(run_config(run_dir), read_plan=False)   # the run's config, resolved
    export_run(ctx.cfg, ctx.model_cfg, run_dir, "runs/demo/hf", step=8)
                                                          # python -m dflop_jax.export run=... out=...

The checkpoint stores each module's params layout-independently (`runtime/checkpoint.py`: global layer
indices, merged over stages, one orbax directory per group of owning processes), so any layout and any
process count exports alike. The HF names and layouts are the importer's own (`models.hf.module_tensors`:
the name maps `load_stage` reads with, whose `to_hf` inverts its `to_ours`), applied to the stage that
would hold ALL of a module. Tensors are read from orbax one at a time onto the host (no device, never the
whole model in memory: one safetensors shard's tensors at most) and written as HF does: shards of at most
`max_shard_bytes` plus `model.safetensors.index.json`. config.json is the adapter's `config_to_hf` of the
run's model config (the inverse of `models.hf.load_config`).

A run that started from `model.hf_dir` exports a complete directory: the tensors of that checkpoint its
model never builds (SigLIP's post-layernorm and pooling head, vision layers past the feature layer:
`models.hf.unread_tensors`) are copied unchanged, config.json keeping the structure they belong to.
The image processor's preprocessor_config.json is hf_dir's, or the family's, with the run's data
settings (`data.hf_settings.processor_config`: what `model.hf_dir=<export>` reads back), beside
hf_dir's other processor files and the run's tokenizer files.

A Qwen2-Audio run (`model.kind: qwen2_audio`) exports one Qwen2-Audio directory with a Whisper feature
extractor's preprocessor_config.json; its checkpoint's "audio" module is Qwen2-Audio's "encoder".
An omni run (`model.kind: omni`) exports two directories, as `models.hf.omni.save_omni` writes a
model: `vision/` (LLaVA-OneVision: the vision tower, its projector and the decoder) and `audio/`
(Qwen2-Audio: the audio tower, its projector and the same decoder, with a Whisper feature
extractor's preprocessor_config.json), each loadable alone; the checkpoint's "audio" module is
Qwen2-Audio's "encoder".
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflop_jax.config.parsing import from_dict, read_yaml
from dflop_jax.programs.param_paths import key_name
from dflop_jax.runtime.checkpoint import SavedState
from dflop_jax.runtime.config import TrainConfig

# What an HF tokenizer directory holds (copied when the run's tokenizer is one).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
# Processor files of an HF directory besides the image processor's (copied from model.hf_dir).
PROCESSOR_FILES = ("processor_config.json", "video_preprocessor_config.json")
DEFAULT_SHARD_BYTES = 4 << 30


class ExportError(ValueError):
    """The run cannot be exported (no config, no checkpoint, a checkpoint of another model): one line."""


@dataclasses.dataclass(frozen=True)
class ExportReport:
    """Attributes: step exported, files written, tensors and bytes of the weights, and how many of
    those tensors were copied unchanged from model.hf_dir."""

    step: int
    files: list[Path]
    tensors: int
    bytes: int
    copied: int = 0


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One HF tensor: where the checkpoint stores it and how it becomes HF's layout."""

    stored: tuple[str, ...]
    shape: tuple[int, ...]
    to_hf: object
    elements: int  # of the HF tensor (a fused parameter's HF tensors are parts of it)


def run_config(run_dir: Path) -> TrainConfig:
    """The run's resolved config (run_dir/config.yaml, written by the trainer); inputs not checked
    (exporting needs the model only, not the data files)."""
    file = run_dir / "config.yaml"
    if not file.is_file():
        raise ExportError(
            f"{run_dir}: no config.yaml; pass a run directory of python -m dflop_jax.train"
        )
    return from_dict(TrainConfig, read_yaml(file))


def with_token_ids(model_cfg, cfg: TrainConfig):
    """The run's `models` config (`RunContext.model_cfg`: fp32 params, as every command resolves
    it) with the image / video token ids of the run's tokenizer (the ones its data holds; HF finds
    the features by them)."""
    from dflop_jax.data import load_tokenizer

    tok = load_tokenizer(cfg.data.tokenizer)
    if cfg.model.kind == "qwen2_audio":
        return dataclasses.replace(model_cfg, audio_token_id=tok.token_id("<|AUDIO|>"))
    if not hasattr(model_cfg, "vision"):
        return model_cfg
    if cfg.model.kind == "omni":
        llava = dataclasses.replace(
            model_cfg.llava,
            image_token_id=tok.token_id("<image>"),
            video_token_id=tok.token_id("<video>"),
        )
        audio = dataclasses.replace(model_cfg.audio, audio_token_id=tok.token_id("<|AUDIO|>"))
        return dataclasses.replace(model_cfg, llava=llava, audio=audio)
    if cfg.model.kind == "internvl":
        return dataclasses.replace(model_cfg, image_token_id=tok.token_id("<IMG_CONTEXT>"))
    return dataclasses.replace(
        model_cfg, image_token_id=tok.token_id("<image>"), video_token_id=tok.token_id("<video>")
    )


def _variable_suffix() -> tuple[str, ...]:
    """The key path inside one nnx Variable as the checkpoint stores it (("value",))."""
    ((path, _),) = jax.tree_util.tree_flatten_with_path(nnx.Param(jnp.zeros(())))[0]
    return tuple(key_name(k) for k in path)


def hf_tensors(model_cfg, stored_as: dict[str, str] | None = None) -> dict[str, _Tensor]:
    """HF key -> where its tensor is stored, in module then parameter order (tied copies once).
    `stored_as`: the checkpoint's module of an HF module where they differ (an omni run's audio
    tower, Qwen2-Audio's "encoder", is stored as "audio")."""
    from models.hf import module_tensors
    from models.qwen2_audio import Qwen2AudioConfig
    from models.stage_modules import MLLM_MODULES

    suffix = _variable_suffix()
    encoder = hasattr(model_cfg, "vision") or isinstance(model_cfg, Qwen2AudioConfig)
    modules = MLLM_MODULES if encoder else ("llm",)
    out: dict[str, _Tensor] = {}
    for module in modules:
        for path, value, tm in module_tensors(model_cfg, module):
            stored = ((stored_as or {}).get(module, module), "params", *map(str, path), *suffix)
            elements = math.prod(jax.eval_shape(tm.to_hf, value).shape)
            out.setdefault(tm.hf_key, _Tensor(stored, tuple(value.shape), tm.to_hf, elements))
    return out


def _check_fits(saved: SavedState, tensors: dict[str, _Tensor], checkpoints: Path) -> None:
    """Raises ExportError (one line) unless the checkpoint's params are exactly the model's."""
    stored = {p: md for p, (_, md) in saved.leaves.items() if len(p) > 1 and p[1] == "params"}
    want = {t.stored: t.shape for t in tensors.values()}
    problems = []
    missing = sorted("/".join(p) for p in want.keys() - stored.keys())
    if missing:
        problems.append(f"{len(missing)} params missing (e.g. {missing[0]})")
    extra = sorted("/".join(p) for p in stored.keys() - want.keys())
    if extra:
        problems.append(f"{len(extra)} params the model lacks (e.g. {extra[0]})")
    wrong = [
        f"{'/'.join(p)} {tuple(stored[p].shape)} != {shape}"
        for p, shape in want.items()
        if p in stored and tuple(stored[p].shape) != shape
    ]
    if wrong:
        problems.append(f"{len(wrong)} shapes differ (e.g. {wrong[0]})")
    if problems:
        raise ExportError(
            f"{checkpoints} step {saved.step} is not a checkpoint of this run's model (config.yaml): "
            + "; ".join(problems)
        )


def _itemsize(saved: SavedState, tensor: _Tensor) -> int:
    return np.dtype(saved.leaves[tensor.stored][1].dtype).itemsize


def copy_tokenizer(cfg: TrainConfig, out: Path) -> list[Path]:
    """The run's tokenizer files into `out`: an HF tokenizer directory's, or the bundled tokenizer
    as tokenizer.json + a tokenizer_config.json (`PreTrainedTokenizerFast`)."""
    if cfg.data.tokenizer == "bundled":
        from dflop_jax.data.tokenizer import ASSET

        shutil.copyfile(ASSET, out / "tokenizer.json")
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        return [out / "tokenizer.json", out / "tokenizer_config.json"]
    source = Path(cfg.data.tokenizer)
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
            copied.append(out / name)
    return copied


def write_processor(cfg: TrainConfig, out: Path) -> list[Path]:
    """The image processor's preprocessor_config.json (`processor_config`: model.hf_dir's, kept
    byte for byte when the run's data settings are its own, else the family's) and model.hf_dir's
    other processor files (`PROCESSOR_FILES`). Nothing for a decoder-only run."""
    from dflop_jax.data.hf_settings import processor_config

    if cfg.model.kind == "decoder":
        return []
    hf_dir = Path(cfg.model.hf_dir) if cfg.model.hf_dir else None
    if cfg.model.kind == "qwen2_audio":  # no image processor: the audio feature extractor's
        return [_write_feature_extractor(cfg, out), *_copy_processor_files(hf_dir, out)]
    source = hf_dir / "preprocessor_config.json" if hf_dir else None
    base = json.loads(source.read_text()) if source and source.is_file() else None
    config, target = processor_config(cfg.data, base), out / "preprocessor_config.json"
    if config == base:
        shutil.copyfile(source, target)
    else:
        target.write_text(json.dumps(config, indent=2))
    return [target, *_copy_processor_files(hf_dir, out)]


def _copy_processor_files(hf_dir: Path | None, out: Path) -> list[Path]:
    """model.hf_dir's `PROCESSOR_FILES` into `out` (none without an hf_dir)."""
    files = []
    for name in PROCESSOR_FILES if hf_dir else ():
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, out / name)
            files.append(out / name)
    return files


def without_cut_layers(kept: dict[str, str], tensors) -> dict[str, str]:
    """`kept` (unread source tensors, by export name) less the decoder layers past the model's own:
    a model cut to its first N layers (`model.llm_layers_kept`) exports as the cut model, its
    config.json saying N, so the checkpoint's later layers are not copied. Decoder layers are the
    `<prefix>layers.<i>.` names whose prefix is the model's own layer 0's outside the vision tower."""

    def index(name: str, prefix: str) -> int | None:
        i = name[len(prefix) + len("layers.") :].split(".", 1)[0]
        return int(i) if name.startswith(f"{prefix}layers.") and i.isdigit() else None

    prefixes = {k[: k.index("layers.0.")] for k in tensors if "layers.0." in k}
    own = {p: 1 + max(i for k in tensors if (i := index(k, p)) is not None)
           for p in prefixes if "vision" not in p}  # fmt: skip

    def past(name: str) -> bool:
        return any((i := index(name, p)) is not None and i >= n for p, n in own.items())

    return {k: v for k, v in kept.items() if not past(k)}


def _with_source_structure(config: dict, source: dict) -> dict:
    """config.json of an export that copies the source checkpoint's unread vision tensors: the
    source's vision tower keeps its pooling head (`vision_use_head`) and its layers past the feature
    layer (`num_hidden_layers`, `vision_feature_layer`), so transformers finds every tensor where
    it looks and computes the same features."""
    vision, theirs = dict(config.get("vision_config") or {}), source.get("vision_config") or {}
    if not vision:
        return config
    out = dict(config)
    if "vision_use_head" in theirs:
        vision["vision_use_head"] = theirs["vision_use_head"]
    if theirs.get("num_hidden_layers", 0) > vision.get("num_hidden_layers", 0):
        vision["num_hidden_layers"] = theirs["num_hidden_layers"]
        out["vision_feature_layer"] = source.get("vision_feature_layer", -1)
    out["vision_config"] = vision
    return out


def export_run(
    cfg: TrainConfig,
    model_cfg,
    run_dir: str | Path,
    out: str | Path,
    *,
    step: int | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> ExportReport:
    """Writes the HF directory `out` from `run_dir`'s checkpoint of `step` (default the latest):
    `cfg` is the run's config (`run_config(run_dir)`), `model_cfg` its model's (`RunContext`).

    Raises:
      ExportError: no config.yaml, no complete checkpoint (of that step), or a checkpoint whose params
        are not the run's model's.
    """
    from models.hf import (
        CheckpointReader,
        adapter_of,
        read_config,
        unread_tensors,
    )

    run_dir, out = Path(run_dir), Path(out)
    model_cfg = with_token_ids(model_cfg, cfg)
    checkpoints = run_dir / "checkpoints"
    try:
        saved = SavedState(checkpoints, step)
    except FileNotFoundError as e:
        raise ExportError(f"{e} (train with checkpoint.every=N to write checkpoints)") from None
    if cfg.model.kind == "omni":
        return _export_omni(cfg, model_cfg, saved, checkpoints, out, max_shard_bytes)
    try:
        tensors = hf_tensors(model_cfg, AUDIO_STORED if cfg.model.kind == "qwen2_audio" else None)
        _check_fits(saved, tensors, checkpoints)
        config = adapter_of(model_cfg)[1].config_to_hf(model_cfg)
        # The starting checkpoint's tensors the model never builds: copied, one at a time.
        source = CheckpointReader(cfg.model.hf_dir) if cfg.model.hf_dir else None
        kept = unread_tensors(model_cfg, source.keys()) if source else {}
        kept = {k: key for k, key in kept.items() if k not in tensors}  # the run's own win
        kept = without_cut_layers(kept, tensors)
        if kept:
            config = _with_source_structure(config, read_config(cfg.model.hf_dir))
        files, sizes = _write_weights(out, config, tensors, saved, max_shard_bytes, source, kept)
    finally:
        saved.close()
    files += [*copy_tokenizer(cfg, out), *write_processor(cfg, out)]
    return ExportReport(saved.step, files, len(sizes), sum(sizes.values()), len(kept))


def _write_weights(out: Path, config: dict, tensors: dict[str, _Tensor], saved: SavedState,
                   max_shard_bytes: int, source=None, kept: dict[str, str] | None = None):  # fmt: skip
    """`out`'s config.json and safetensors shards: `tensors` read from the checkpoint (one read per
    shard file, `SavedState.read_many`) and `kept` ones (export name -> key) copied from the
    `source` checkpoint. Returns (the files written, bytes per tensor)."""
    from models.hf import shard_plan, write_shards

    kept = kept or {}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    sizes = {k: t.elements * _itemsize(saved, t) for k, t in tensors.items()}
    sizes |= {k: source.get(key).nbytes for k, key in kept.items()}

    def read(keys: list[str]) -> dict[str, np.ndarray]:
        paths = [tensors[k].stored for k in keys if k not in kept]
        # a fused stored param (qkv) gives several HF tensors: read once, kept until the last
        stored, uses = saved.read_many(paths), collections.Counter(paths)
        arrays = {}
        for k in keys:
            if k in kept:
                arrays[k] = source.get(kept[k])
                continue
            path = tensors[k].stored
            arrays[k] = np.asarray(tensors[k].to_hf(stored[path]))
            uses[path] -= 1
            if not uses[path]:  # let it go once converted: the file's tensors, plus one, in memory
                del stored[path]
        return arrays

    shards = write_shards(shard_plan(sizes, max_shard_bytes), read, out)
    return [out / "config.json", *shards], sizes


# Qwen2-Audio's "encoder" module, stored as the pipeline's "audio" module (an omni or qwen2_audio run).
AUDIO_STORED = {"encoder": "audio"}
# The omni checkpoint's modules per exported directory (`models.hf.omni.save_omni`'s layout).
OMNI_DIRS = {"vision": {}, "audio": AUDIO_STORED}


def _export_omni(cfg, model_cfg, saved: SavedState, checkpoints: Path, out: Path,
                 max_shard_bytes: int) -> ExportReport:  # fmt: skip
    """`vision/` and `audio/` (module docstring) from one checkpoint: every stored param in one of
    them (the decoder in both), each with its config.json, tokenizer and processor files."""
    from models.hf import adapter_of

    parts = {"vision": model_cfg.llava, "audio": model_cfg.audio}
    try:
        tensors = {d: hf_tensors(parts[d], OMNI_DIRS[d]) for d in parts}
        _check_fits(saved, {f"{d}/{k}": t for d, ts in tensors.items() for k, t in ts.items()},
                    checkpoints)  # fmt: skip
        files, count, total = [], 0, 0
        for d, part in parts.items():
            config = adapter_of(part)[1].config_to_hf(part)
            written, sizes = _write_weights(out / d, config, tensors[d], saved, max_shard_bytes)
            files += [*written, *copy_tokenizer(cfg, out / d)]
            count, total = count + len(sizes), total + sum(sizes.values())
        files += write_processor(cfg, out / "vision")
        files.append(_write_feature_extractor(cfg, out / "audio"))
    finally:
        saved.close()
    return ExportReport(saved.step, files, count, total, 0)


def _write_feature_extractor(cfg: TrainConfig, out: Path) -> Path:
    """Whisper's feature extractor settings with the run's mel bins (what `data/audio.py`
    computes: 16 kHz, 10 ms hops, 25 ms windows, 30 s chunks), as Qwen2-Audio's processor reads."""
    from dflop_jax.contracts.shapes import WINDOW_FRAMES
    from dflop_jax.data.audio import HOP, N_FFT, SAMPLE_RATE, WINDOW_SAMPLES

    config = {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "processor_class": "Qwen2AudioProcessor",
        "feature_size": cfg.data.audio_mels,
        "sampling_rate": SAMPLE_RATE,
        "hop_length": HOP,
        "n_fft": N_FFT,
        "chunk_length": WINDOW_SAMPLES // SAMPLE_RATE,
        "n_samples": WINDOW_SAMPLES,
        "nb_max_frames": WINDOW_FRAMES,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": True,
    }
    target = out / "preprocessor_config.json"
    target.write_text(json.dumps(config, indent=2))
    return target
