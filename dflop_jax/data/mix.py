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
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from dflop_jax.config import ConfigError, read_yaml
from dflop_jax.data.sources import read_records, with_roots

_DATASET_KEYS = {"path", "json_path", "sampling", "sampling_strategy", "image_root", "video_root"}


def load_mix(
    path: str | Path,
    seed: int = 0,
    strict: bool = False,
    image_root: str = "",
    video_root: str = "",
) -> list[dict]:
    """Records of every dataset of the mix, sampled, in mix order. `image_root`/`video_root` override all."""
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
    out: list[dict] = []
    for i, entry in enumerate(datasets):
        out.extend(_load_entry(path, i, entry, spec, seed, strict, image_root, video_root))
    return out


def _load_entry(mix_path, i, entry, spec, seed, strict, image_root, video_root) -> list[dict]:
    where = f"{mix_path}: datasets[{i}]"
    if not isinstance(entry, dict) or not ({"path", "json_path"} & set(entry)):
        raise ConfigError(f"{where}: expected a mapping with `path`, got {entry!r}")
    unknown = sorted(set(entry) - _DATASET_KEYS)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(_DATASET_KEYS))}"
        )
    file = _resolve(mix_path.parent, entry["path"] if "path" in entry else entry["json_path"])
    if not file.is_file():
        raise ConfigError(f"{where}: dataset file not found: {file}")
    strategy = str(
        entry["sampling"] if "sampling" in entry else entry.get("sampling_strategy", "all")
    )
    records = sample_records(
        list(read_records(file, strict=strict)), strategy, np.random.default_rng([seed, i])
    )
    img = image_root or _root(mix_path, entry, spec, "image_root") or file.parent
    vid = video_root or _root(mix_path, entry, spec, "video_root") or file.parent
    return with_roots(records, img, vid)


def _root(mix_path: Path, entry: dict, spec: dict, key: str) -> Path | None:
    value = entry[key] if key in entry else spec.get(key)
    return _resolve(mix_path.parent, value) if value else None


def _resolve(base: Path, value) -> Path:
    p = Path(str(value)).expanduser()
    return p if p.is_absolute() else base / p


def sample_records(records: list, strategy: str, rng: np.random.Generator) -> list:
    """Applies one sampling strategy: all, first:N, first:P%, end:N, end:P%, random:N, random:P%."""
    if strategy == "all":
        return records
    kind, _, amount = strategy.partition(":")
    if kind not in ("first", "end", "random") or not amount:
        raise ConfigError(
            f"sampling={strategy!r}: use all, first:N, first:P%, end:N, random:N (or P%)"
        )
    n = _count(amount, len(records), strategy)
    if kind == "first":
        return records[:n]
    if kind == "end":
        return records[len(records) - n :] if n else []
    keep = np.sort(rng.choice(len(records), size=n, replace=False)) if n else []
    return [records[j] for j in keep]


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
