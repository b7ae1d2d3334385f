"""Dataset mixes: a YAML listing dataset files, how much of each to take, and where their media live.

# configs/my_mix.yaml (paths relative to this file)
image_root: /data/llava/images         # default for every dataset (else the dataset's folder)
video_root: /data/llava/videos
datasets:
  - path: ai2d.jsonl                   # LLaVA-OV's `json_path` is accepted too
    sampling: all                      # all | first:N | first:P% | end:N | end:P% | random:N | random:P%
  - path: m4_instruct.json
    sampling: first:60000
    image_root: /data/m4/images        # per-dataset override
  - path: video_178k.jsonl
    sampling: random:5000              # seeded by load_mix(seed)
  - path: hf/LLaVA-OneVision-Data/     # parquet or tar shards: a file, a glob or a directory
    sampling: random:10%
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dflop_jax.config import ConfigError, read_yaml
from dflop_jax.data.shards import concat, is_shard_source, open_shards, take
from dflop_jax.data.sources import read_records, with_roots

_DATASET_KEYS = {"path", "json_path", "sampling", "sampling_strategy", "image_root", "video_root"}


def load_mix(
    path: str | Path,
    seed: int = 0,
    strict: bool = False,
    image_root: str = "",
    video_root: str = "",
    cache_dir: str = "",
) -> Sequence[dict]:
    """Records of every dataset of the mix, sampled, in mix order (a list, or a lazy sequence when an
    entry names shards). `image_root`/`video_root` override all; `cache_dir` keeps tar indexes."""
    path = Path(path)
    spec = read_yaml(path)
    unknown = sorted(set(spec) - {"datasets", "image_root", "video_root"})
    if unknown:
        raise ConfigError(
            f"{path}: unknown key {unknown[0]!r}; allowed: datasets, image_root, video_root"
        )
    datasets = spec.get("datasets")
    if not isinstance(datasets, list) or not datasets:
        raise ConfigError(
            f"{path}: `datasets` must be a non-empty list of {{path, sampling}} entries"
        )
    roots = (image_root, video_root)
    return concat(
        [
            _load_entry(path, i, entry, spec, seed, strict, roots, cache_dir)
            for i, entry in enumerate(datasets)
        ]
    )


def _load_entry(mix_path, i, entry, spec, seed, strict, roots, cache_dir) -> Sequence[dict]:
    where = f"{mix_path}: datasets[{i}]"
    if not isinstance(entry, dict) or not ({"path", "json_path"} & set(entry)):
        raise ConfigError(f"{where}: expected a mapping with `path`, got {entry!r}")
    unknown = sorted(set(entry) - _DATASET_KEYS)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(_DATASET_KEYS))}"
        )
    file = _resolve(mix_path.parent, entry["path"] if "path" in entry else entry["json_path"])
    strategy = str(
        entry["sampling"] if "sampling" in entry else entry.get("sampling_strategy", "all")
    )
    rng = np.random.default_rng([seed, i])
    img = roots[0] or _root(mix_path, entry, spec, "image_root")
    vid = roots[1] or _root(mix_path, entry, spec, "video_root")
    if is_shard_source(file):
        try:
            shards = open_shards(
                file, image_root=img or "", video_root=vid or "", cache_dir=cache_dir
            )
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        return take(shards, sample_indices(len(shards), strategy, rng))
    if not file.is_file():
        raise ConfigError(f"{where}: dataset file not found: {file}")
    records = sample_records(list(read_records(file, strict=strict)), strategy, rng)
    return with_roots(records, img or file.parent, vid or file.parent)


def _root(mix_path: Path, entry: dict, spec: dict, key: str) -> Path | None:
    value = entry[key] if key in entry else spec.get(key)
    return _resolve(mix_path.parent, value) if value else None


def _resolve(base: Path, value) -> Path:
    p = Path(str(value)).expanduser()
    return p if p.is_absolute() else base / p


def sample_records(records: list, strategy: str, rng: np.random.Generator) -> list:
    """Applies one sampling strategy: all, first:N, first:P%, end:N, end:P%, random:N, random:P%."""
    return take(records, sample_indices(len(records), strategy, rng))


def sample_indices(total: int, strategy: str, rng: np.random.Generator) -> Sequence[int]:
    """The positions (ascending) one sampling strategy keeps out of `total` records."""
    if strategy == "all":
        return range(total)
    kind, _, amount = strategy.partition(":")
    if kind not in ("first", "end", "random") or not amount:
        raise ConfigError(
            f"sampling={strategy!r}: use all, first:N, first:P%, end:N, random:N (or P%)"
        )
    n = _count(amount, total, strategy)
    if kind == "first":
        return range(n)
    if kind == "end":
        return range(total - n, total)
    return np.sort(rng.choice(total, size=n, replace=False)).tolist() if n else []


def _count(amount: str, total: int, strategy: str) -> int:
    try:
        if amount.endswith("%"):
            pct = float(amount[:-1])
            if not 0 <= pct <= 100:
                raise ValueError
            return min(total, math.ceil(total * pct / 100))
        n = int(amount)
        if n < 0:
            raise ValueError
        return min(total, n)
    except ValueError:
        raise ConfigError(
            f"sampling={strategy!r}: {amount!r} must be a count N >= 0 or a percentage P%"
        ) from None
