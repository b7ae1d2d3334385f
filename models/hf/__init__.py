"""HF checkpoint import/export: `load_pretrained(path) -> (model, config)`, `save_pretrained`, and one
pipeline stage at a time: `load_config(path)` then `load_stage(path, config, module, ...)`; an export
from stored stage params tensor by tensor: `module_tensors(config, module)` (state path -> HF key and
layout, the same name maps `load_stage` reads with) and `write_shards`.

Dispatches on config.json `model_type` through `MODEL_TYPES` (each family registers one line here).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
from flax import nnx

from models.hf import internvl, llama, llava_onevision, qwen2, qwen2_audio, siglip, whisper
from models.hf.causal_lm import decoder_name_map
from models.hf.io import (
    CheckpointError,
    CheckpointReader,
    ModelAdapter,
    NameMap,
    StackedMap,
    TensorMap,
    export_tensors,
    hf_keys,
    load_state,
    read_config,
    shard_plan,
    tensor_maps,
    write_safetensors,
    write_shards,
)
from models.stage_modules import MLLM_MODULES, stage_module

MODEL_TYPES: dict[str, ModelAdapter] = {
    "qwen2": qwen2.ADAPTER,
    "llama": llama.ADAPTER,
    "siglip_vision_model": siglip.VISION_ADAPTER,
    "siglip": siglip.DUAL_ADAPTER,
    "internvl_vision": internvl.VISION_ADAPTER,
    "internvl": internvl.ADAPTER,
    "llava_onevision": llava_onevision.ADAPTER,
    "whisper": whisper.WHISPER_ADAPTER,
    "qwen2_audio_encoder": whisper.QWEN2_AUDIO_ENCODER_ADAPTER,
    "qwen2_audio": qwen2_audio.ADAPTER,
}


def adapter_for(model_type: str) -> ModelAdapter:
    if model_type not in MODEL_TYPES:
        raise CheckpointError(
            f"model_type={model_type!r} is not supported; supported: {sorted(MODEL_TYPES)}"
        )
    return MODEL_TYPES[model_type]


def load_pretrained(
    path: str | Path,
    *,
    dtype: str | None = None,
    param_dtype: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    rules=None,
    configure=None,
):
    """Loads an HF model directory (config.json + safetensors, single or sharded index).

    Args:
      dtype: compute dtype ("float32" default, "bfloat16").
      param_dtype: stored parameter dtype ("float32" default: fp32 master weights).
      mesh, rules: if given, every tensor goes straight into its NamedSharding on `mesh` (logical
        axes mapped by `rules`, e.g. `dflop_jax.programs.sharding.rules_for("decoder")`).
      configure: config -> config applied to the config read from config.json before the model is
        built (settings the checkpoint does not hold, e.g. the layers' `remat` policy).

    Returns:
      (model, config): an nnx.Module (a `Decoder` for qwen2/llama: `model(input_ids) -> logits`)
      and its config dataclass.
    """
    hf_config = read_config(path)
    adapter = adapter_for(hf_config.get("model_type"))
    reader = CheckpointReader(path)
    cfg = adapter.config_from_hf(hf_config, dtype or "float32", param_dtype or "float32")
    cfg = cfg if configure is None else configure(cfg)
    if adapter.checkpoint_name_map is None:
        names = adapter.name_map(cfg)
    else:
        names = adapter.checkpoint_name_map(cfg, reader.keys())
    model = load_state(
        reader,
        lambda: adapter.build(cfg, nnx.Rngs(0)),
        names,
        ignored=adapter.ignored_keys,
        mesh=mesh,
        rules=rules,
    )
    return model, cfg


def load_config(path: str | Path, *, dtype: str = "float32", param_dtype: str = "float32"):
    """The model config of an HF directory (config.json only; no tensor is read)."""
    hf_config = read_config(path)
    return adapter_for(hf_config.get("model_type")).config_from_hf(hf_config, dtype, param_dtype)


def load_stage(
    path: str | Path,
    config,
    module: str,
    *,
    first_layer: int,
    num_layers: int,
    has_embedding: bool,
    has_head: bool,
    mesh: jax.sharding.Mesh | None = None,
    rules=None,
) -> nnx.Module:
    """One pipeline stage of an HF checkpoint: `models.stage_modules.stage_module(config, module, ...)` filled
    with only the tensors it holds (vision layers + projector for an encoder stage; a decoder layer
    range + embedding and/or head for an LLM stage), each device's shard read as a slice.

    Args:
      config: the model config (`load_config(path, ...)`: its dtypes are the stage's).
      module: "encoder" or "llm".
      mesh, rules: place every tensor straight into its NamedSharding on `mesh` (only the shards of
        this process's devices are read).
    """
    hf_config = read_config(path)
    adapter = adapter_for(hf_config.get("model_type"))
    if adapter.stage_name_map is None:
        raise CheckpointError(
            f"model_type={hf_config.get('model_type')!r} has no pipeline stages; load it with "
            "load_pretrained"
        )
    reader = CheckpointReader(path)
    flags = dict(first_layer=first_layer, num_layers=num_layers,
                 has_embedding=has_embedding, has_head=has_head)  # fmt: skip
    return load_state(
        reader,
        lambda: stage_module(config, module, **flags, rngs=nnx.Rngs(0)),
        adapter.stage_name_map(config, reader.keys(), module, **flags),
        full_keys=reader.keys(),  # other stages' keys are not this stage's concern
        ignored=adapter.ignored_keys,
        mesh=mesh,
        rules=rules,
    )


def adapter_of(config, model_type: str | None = None) -> tuple[str, ModelAdapter]:
    """(model_type, adapter) that exports `config`: `model_type`'s, else the first registered adapter
    that `matches(config)` (for a DecoderConfig: qwen2 when it has qkv bias, else llama)."""
    if model_type is None:
        found = [name for name, a in MODEL_TYPES.items() if a.matches(config)]
        if not found:
            raise CheckpointError(f"no HF adapter exports {type(config).__name__}; pass model_type")
        model_type = found[0]
    return model_type, adapter_for(model_type)


def module_tensors(config, module: str) -> list[tuple[tuple, jax.ShapeDtypeStruct, TensorMap]]:
    """(state path, abstract value, TensorMap) per HF tensor of every parameter of the stage that
    holds ALL of `module` ("encoder" or "llm"; paths from the stage's root, as `load_stage` maps
    them): what a layout-independent export reads, one tensor at a time. A fused parameter (a ViT's
    q / k / v) gives one row per HF tensor, each `to_hf` taking the whole parameter."""
    model_type, adapter = adapter_of(config)
    if adapter.stage_name_map is None:
        raise CheckpointError(f"model_type={model_type!r} has no pipeline stages")
    flags = dict(first_layer=0, num_layers=module_layers(config, module),
                 has_embedding=True, has_head=True)  # fmt: skip
    abstract = nnx.eval_shape(lambda: stage_module(config, module, **flags, rngs=nnx.Rngs(0)))
    names = adapter.stage_name_map(config, [], module, **flags)
    out = []
    for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        if path not in names:
            raise CheckpointError(f"{model_type}: parameter {path} has no HF name (adapter bug)")
        value = jax.ShapeDtypeStruct(var.shape, var.dtype)
        out.extend((path, value, tm) for tm in tensor_maps(names[path]))
    return out


def unread_tensors(config, keys: list[str]) -> dict[str, str]:
    """The tensors of a checkpoint (its `keys`, in its own key layout) that no parameter of
    `config`'s model reads (SigLIP's post-layernorm and pooling head, vision layers past the feature
    layer, ...), as {key in the export's layout: key in the checkpoint}: what an export of a model
    trained from that checkpoint copies unchanged to stay complete. A tied model's stored head is
    left out (its weights are the embedding's)."""
    model_type, adapter = adapter_of(config)
    if adapter.stage_name_map is None:
        raise CheckpointError(f"model_type={model_type!r} has no pipeline stages")
    read, prefixes = set(), set()
    for module in MLLM_MODULES if _encoder(config) is not None else ("llm",):
        flags = dict(first_layer=0, num_layers=module_layers(config, module),
                     has_embedding=True, has_head=True)  # fmt: skip
        ours = adapter.stage_name_map(config, [], module, **flags)
        for path, entry in adapter.stage_name_map(config, keys, module, **flags).items():
            for key, mine in zip(hf_keys(entry), hf_keys(ours[path])):  # a stacked entry: each part
                read.add(key)
                prefixes.add(_prefixes(key, mine))
    renames = sorted(((a, b) for a, b in prefixes if a and a != b), key=lambda ab: -len(ab[0]))
    tied = (config.text if hasattr(config, "text") else config).tie_embeddings
    out = {}
    for key in keys:
        if key in read or (tied and key.endswith("lm_head.weight")):
            continue
        a, b = next(((a, b) for a, b in renames if key.startswith(a)), ("", ""))
        out[b + key[len(a) :]] = key
    return out


def _prefixes(source: str, ours: str) -> tuple[str, str]:
    """The prefixes of two names of one tensor before their longest common dotted suffix."""
    a, b = source.split("."), ours.split(".")
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return "".join(f"{x}." for x in a[: len(a) - n]), "".join(f"{x}." for x in b[: len(b) - n])


def _encoder(config):
    """The encoder config of an MLLM config (`vision` or `audio`); None for a decoder alone."""
    return getattr(config, "vision", None) or getattr(config, "audio", None)


def module_layers(config, module: str) -> int:
    """Layers of `module` in `config` (vision or audio layers for "encoder", decoder layers for
    "llm")."""
    if module == "encoder":
        return _encoder(config).num_layers
    return (config.text if hasattr(config, "text") else config).num_layers


def save_pretrained(
    model: nnx.Module,
    config,
    path: str | Path,
    *,
    model_type: str | None = None,
    max_shard_bytes: int | None = None,
) -> list[Path]:
    """Exports `model` in HF layout: config.json + model.safetensors (or shards + index).

    model_type: the HF family to write; default `adapter_of(config)`'s.
    """
    _, adapter = adapter_of(config, model_type)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(adapter.config_to_hf(config), indent=2))
    tensors = dict(export_tensors(model, adapter.name_map(config)))
    return [path / "config.json", *write_safetensors(tensors, path, max_shard_bytes)]


__all__ = [
    "MODEL_TYPES",
    "CheckpointError",
    "CheckpointReader",
    "ModelAdapter",
    "NameMap",
    "StackedMap",
    "TensorMap",
    "adapter_for",
    "adapter_of",
    "decoder_name_map",
    "export_tensors",
    "hf_keys",
    "load_config",
    "load_pretrained",
    "load_stage",
    "load_state",
    "module_layers",
    "module_tensors",
    "read_config",
    "save_pretrained",
    "shard_plan",
    "tensor_maps",
    "unread_tensors",
    "write_safetensors",
    "write_shards",
]
