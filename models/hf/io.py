"""HF checkpoint I/O: safetensors (single file or sharded index) read/write, name/layout mapping,
loading straight onto a (sharded) mesh, and export back to HF layout.

A model family describes itself with a `ModelAdapter` (config conversion, module factory, name map);
`models.hf.load_pretrained` dispatches on config.json `model_type` to one.

Name map: our flat state path (e.g. ("stage", "layers", 0, "attn", "q_kernel")) -> `TensorMap` (HF key,
HF->ours and ours->HF array transforms), or `StackedMap` (a fused parameter stacked from several HF
tensors, e.g. a ViT's q / k / v projections). Loading places every tensor with `jax.make_array_from_callback`
under its NamedSharding: the callback runs for this process's devices only and reads just the slice
of the safetensors tensor that its shard needs (`models/hf/slices.py`), so a host never holds a whole
tensor its devices do not keep whole. `CheckpointReader.bytes_read` counts what was read.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from models.hf.slices import Box, LazyView, index_box, read_box

Path_ = tuple[Any, ...]
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_LISTED = 12


class CheckpointError(ValueError):
    """A checkpoint does not fit the model: lists every missing / unsupported / mis-shaped key."""


def identity(x: np.ndarray) -> np.ndarray:
    return x


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One parameter's HF name and layout transforms (both directions).

    Transforms use array methods only (`.T`, `.reshape`, `.transpose`) so they work on numpy arrays
    and, for shape checks, on abstract values under `jax.eval_shape`.
    """

    hf_key: str
    to_ours: Callable[[np.ndarray], np.ndarray] = identity
    to_hf: Callable[[np.ndarray], np.ndarray] = identity


@dataclasses.dataclass(frozen=True)
class StackedMap:
    """One parameter stacked from several HF tensors along `axis` of our layout, e.g. a fused q / k / v
    kernel [D, 3, H, Dh] from HF's q_proj, k_proj and v_proj: part i is `parts[i]` (its `to_ours`
    gives our layout without `axis`) at index i of `axis`. Loading reads each part's slice alone."""

    parts: tuple[TensorMap, ...]
    axis: int


NameMap = dict[Path_, TensorMap | StackedMap]


def hf_keys(entry: TensorMap | StackedMap) -> tuple[str, ...]:
    """The HF keys a name-map entry reads."""
    return (
        tuple(p.hf_key for p in entry.parts) if isinstance(entry, StackedMap) else (entry.hf_key,)
    )


def _take(to_hf: Callable, axis: int, index: int, value):
    return to_hf(value.take(index, axis=axis))


def tensor_maps(entry: TensorMap | StackedMap) -> list[TensorMap]:
    """One `TensorMap` per HF tensor of an entry, each `to_hf` taking the WHOLE parameter (for a
    stacked entry: its part's slice, then the part's `to_hf`; `to_ours` stays the part's)."""
    if isinstance(entry, TensorMap):
        return [entry]
    return [
        TensorMap(p.hf_key, p.to_ours, functools.partial(_take, p.to_hf, entry.axis, i))
        for i, p in enumerate(entry.parts)
    ]


@dataclasses.dataclass(frozen=True)
class ModelAdapter:
    """How one HF `model_type` maps onto a models/ module.

    config_from_hf(hf_config: dict, dtype: str, param_dtype: str) -> our config
    config_to_hf(config) -> dict written as config.json
    build(config, rngs) -> nnx.Module
    name_map(config) -> NameMap for the module `build` returns
    matches(config) -> bool: whether `save_pretrained` should export this config with this adapter
    ignored_keys: HF keys that carry nothing we need (e.g. rotary caches), skipped silently.
    stage_name_map(config, checkpoint_keys, module, **flags) -> NameMap of `models.stage_modules.stage_module(
      config, module, **flags)` (state paths from the stage's root); None for a model with no
      pipeline stages (a bare vision tower).
    checkpoint_name_map(config, checkpoint_keys) -> NameMap in the key layout the checkpoint uses,
      for a family whose checkpoints come in several (None: `name_map`, the export's layout).
    """

    config_from_hf: Callable[[dict, str, str], Any]
    config_to_hf: Callable[[Any], dict]
    build: Callable[[Any, nnx.Rngs], nnx.Module]
    name_map: Callable[[Any], NameMap]
    matches: Callable[[Any], bool]
    ignored_keys: tuple[str, ...] = ()
    stage_name_map: Callable[..., NameMap] | None = None
    checkpoint_name_map: Callable[[Any, list[str]], NameMap] | None = None


def read_config(path: str | Path) -> dict:
    """config.json of an HF model directory."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path}: no config.json; pass an HF model directory")
    return json.loads(file.read_text())


class CheckpointReader:
    """Reads tensors by HF key from `model.safetensors` or a sharded `model.safetensors.index.json`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {key: self.path / name for key, name in weight_map.items()}
        elif (self.path / SINGLE_FILE).is_file():
            self._files = self._keys_of(self.path / SINGLE_FILE)
        else:
            raise CheckpointError(
                f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found; export the model with "
                "save_pretrained(..., safe_serialization=True)"
            )
        self._handles: dict[Path, Any] = {}
        self.bytes_read = 0

    @staticmethod
    def _keys_of(file: Path) -> dict[str, Path]:
        with safe_open(str(file), framework="np") as f:
            return {key: file for key in f.keys()}  # noqa: SIM118 (safe_open is not a dict)

    def keys(self) -> list[str]:
        return sorted(self._files)

    def _handle(self, key: str):
        file = self._files[key]
        if file not in self._handles:
            if not file.is_file():
                raise CheckpointError(
                    f"{self.path}: {file.name} (listed in {INDEX_FILE}) is missing"
                )
            self._handles[file] = safe_open(str(file), framework="np")
        return self._handles[file]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle(key).get_slice(key).get_shape())

    def get(self, key: str) -> np.ndarray:
        out = self._handle(key).get_tensor(key)
        self.bytes_read += out.nbytes
        return out

    def read(self, key: str, view: LazyView, box: Box) -> np.ndarray:
        """The block `box` of our layout of tensor `key` (`view` = to_ours(LazyView(shape))), reading
        only the aligned box of the stored tensor that it needs."""
        return read_box(view, _Counted(self, self._handle(key).get_slice(key)), box)


class _Counted:
    """A safetensors slice handle that adds what it reads to its reader's `bytes_read`."""

    def __init__(self, reader: CheckpointReader, handle):
        self.reader, self.handle = reader, handle

    def __getitem__(self, index):
        out = self.handle[index]
        self.reader.bytes_read += out.nbytes
        return out


def shard_plan(sizes: Mapping[str, int], max_shard_bytes: int | None = None) -> list[list[str]]:
    """HF keys per file, in the given order: one file, or consecutive shards of at most
    `max_shard_bytes` each (a bigger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, nbytes in sizes.items():
        if max_shard_bytes and size and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def write_shards(
    shards: list[list[str]],
    read: Callable[[list[str]], Mapping[str, np.ndarray]],
    path: str | Path,
) -> list[Path]:
    """Writes `shard_plan`'s files (`model.safetensors`, or `model-0000i-of-0000n.safetensors` plus
    `model.safetensors.index.json`), fetching each file's tensors with one `read(keys)` when it is
    written (a checkpoint reader reads them together): one file's tensors are in memory at a time.
    Returns the files written."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = 0
    for name, keys in zip(names, shards):
        read_in = read(keys)
        tensors = {key: np.ascontiguousarray(read_in[key]) for key in keys}
        del read_in
        total += sum(a.nbytes for a in tensors.values())
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        del tensors
    if len(shards) == 1:
        return [path / SINGLE_FILE]
    index = {
        "metadata": {"total_size": int(total)},
        "weight_map": {key: name for name, keys in zip(names, shards) for key in keys},
    }
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return [path / n for n in names] + [path / INDEX_FILE]


def write_safetensors(
    tensors: Mapping[str, np.ndarray], path: str | Path, max_shard_bytes: int | None = None
) -> list[Path]:
    """Writes `model.safetensors`, or shards plus `model.safetensors.index.json` when the total
    exceeds `max_shard_bytes`. Returns the files written."""
    sizes = {key: np.asarray(tensors[key]).nbytes for key in sorted(tensors)}
    return write_shards(
        shard_plan(sizes, max_shard_bytes), lambda keys: {k: tensors[k] for k in keys}, path
    )


def _listing(title: str, items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    more = f" (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return f"{title} ({len(items)}): {shown}{more}"


def _check_coverage(
    reader: CheckpointReader, abs_flat: list, name_map: NameMap, ignored: tuple[str, ...], full_keys
) -> None:
    """Raises one CheckpointError naming every missing, unsupported and mis-shaped tensor."""
    problems = []
    unmapped = [repr(p) for p, _ in abs_flat if p not in name_map]
    if unmapped:
        problems.append(_listing("model parameters without an HF name (adapter bug)", unmapped))
    available = set(reader.keys())
    missing = [k for p, _ in abs_flat if p in name_map for k in hf_keys(name_map[p])]
    missing = [k for k in missing if k not in available]
    if missing:
        problems.append(_listing("missing from checkpoint", missing))
    unsupported = sorted(
        k for k in available - set(full_keys) if not any(k.endswith(s) for s in ignored)
    )
    if unsupported:
        problems.append(_listing("unsupported checkpoint keys", unsupported))
    mismatched = []
    for p, var in abs_flat:
        entry = name_map.get(p)
        if entry is None or not all(k in available for k in hf_keys(entry)):
            continue
        parts = entry.parts if isinstance(entry, StackedMap) else (entry,)
        for tm in parts:
            hf_shape = reader.shape(tm.hf_key)
            ours = jax.eval_shape(tm.to_ours, jax.ShapeDtypeStruct(hf_shape, jnp.float32)).shape
            want = tuple(var.shape)
            if isinstance(entry, StackedMap):  # part i: the parameter without the stacked axis
                want = want[: entry.axis] + want[entry.axis + 1 :]
            if tuple(ours) != want:
                mismatched.append(f"{tm.hf_key} {hf_shape} -> {tuple(ours)} != expected {want}")
        if isinstance(entry, StackedMap) and var.shape[entry.axis] != len(parts):
            mismatched.append(f"{p}: {len(parts)} HF tensors stacked into axis {entry.axis} of "
                              f"{var.shape}")  # fmt: skip
    if mismatched:
        problems.append(_listing("shape mismatches", mismatched))
    if problems:
        raise CheckpointError(
            f"{reader.path}: checkpoint does not fit the model; " + "; ".join(problems)
        )


def _load(reader: CheckpointReader, entry: TensorMap | StackedMap, var, sharding) -> jax.Array:
    """One parameter: whole onto the default device, or each addressable shard read on its own (a
    stacked parameter: each part's slice of the shard from its own HF tensor)."""
    parts = entry.parts if isinstance(entry, StackedMap) else (entry,)
    views = [tm.to_ours(LazyView(reader.shape(tm.hf_key))) for tm in parts]

    def block(index) -> np.ndarray:
        box = index_box(index, var.shape)
        if isinstance(entry, TensorMap):
            return reader.read(entry.hf_key, views[0], box).astype(var.dtype)
        lo, hi = box[entry.axis]
        rest = box[: entry.axis] + box[entry.axis + 1 :]
        read = [reader.read(parts[i].hf_key, views[i], rest) for i in range(lo, hi)]
        return np.stack(read, axis=entry.axis).astype(var.dtype)

    if sharding is None:
        return jnp.asarray(block(()))
    return jax.make_array_from_callback(tuple(var.shape), sharding, block)


def load_state(
    reader: CheckpointReader,
    module_factory: Callable[[], nnx.Module],
    name_map: NameMap,
    *,
    full_keys: list[str] | None = None,
    ignored: tuple[str, ...] = (),
    mesh: jax.sharding.Mesh | None = None,
    rules=None,
) -> nnx.Module:
    """Builds `module_factory()` abstractly and fills it from the checkpoint, tensor by tensor.

    Args:
      full_keys: every HF key the whole model uses (default: those of `name_map`); keys outside it
        are reported as unsupported. Pass the full model's keys when loading a single stage.
      mesh, rules: place each parameter directly in its NamedSharding (logical axes -> mesh via rules).
    """
    if (mesh is None) != (rules is None):
        raise ValueError("load_state: pass mesh and rules together (or neither)")
    if mesh is None:
        graphdef, abs_state = nnx.split(nnx.eval_shape(module_factory))
        shardings = None
    else:
        with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
            graphdef, abs_state = nnx.split(nnx.eval_shape(module_factory))
            shardings = dict(nnx.to_flat_state(nnx.get_named_sharding(abs_state, mesh)))
    abs_flat = list(nnx.to_flat_state(abs_state))
    if full_keys is None:
        full_keys = [k for entry in name_map.values() for k in hf_keys(entry)]
    _check_coverage(reader, abs_flat, name_map, ignored, full_keys)
    flat = []
    for path, var in abs_flat:
        sharding = None if shardings is None else shardings[path].get_value()
        flat.append((path, var.replace(_load(reader, name_map[path], var, sharding))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def export_tensors(
    module: nnx.Module, name_map: NameMap, ignore: Collection[tuple] = ()
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF key, host array in HF layout) for every parameter but the paths in `ignore` (those the
    target family does not hold); a key shared by several parameters (e.g. tied copies) is emitted
    once."""
    seen = set()
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        if path in ignore:
            continue
        value = None
        for tm in tensor_maps(name_map[path]):
            if tm.hf_key in seen:
                continue
            seen.add(tm.hf_key)
            value = np.asarray(jax.device_get(var[...])) if value is None else value
            yield tm.hf_key, np.asarray(tm.to_hf(value))
