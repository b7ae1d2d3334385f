"""Dataset mixes: a YAML listing dataset files, how much of each to take, and where their media live.

# configs/my_mix.yaml (paths relative to this file)
image_root: /data/llava/images         # default for every dataset (else the dataset's folder)
video_root: /data/llava/videos
audio_root: /data/audio                # relative `audio` paths
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
phases:                                # optional: a curriculum, read in this order (see `phase_order`)
  - samples: 4096                      # records of the phase (a multiple of the global batch)
    weights: [1, 1, 0, 1]              # per dataset, in `datasets` order
  - samples: 8192
    weights: [0, 1, 3, 1]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dflop_jax.config import ConfigError, read_yaml
from dflop_jax.data.shards import Subset, concat, is_shard_source, open_shards, take
from dflop_jax.data.sources import MEDIA_KINDS, NO_ROOTS, MediaRoots, read_records, with_roots

_ROOT_KEYS = {f"{kind}_root" for kind in MEDIA_KINDS}
_DATASET_KEYS = {"path", "json_path", "sampling", "sampling_strategy", *_ROOT_KEYS}


def load_mix(
    path: str | Path,
    seed: int = 0,
    strict: bool = False,
    roots: MediaRoots = NO_ROOTS,
    cache_dir: str = "",
) -> Sequence[dict]:
    """Records of every dataset of the mix, sampled, in mix order (a list, or a lazy sequence when an
    entry names shards). The set `roots` override the mix's; `cache_dir` keeps tar indexes."""
    path = Path(path)
    spec = read_yaml(path)
    allowed = {"datasets", "phases", *_ROOT_KEYS}
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise ConfigError(
            f"{path}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}"
        )
    datasets = spec.get("datasets")
    if not isinstance(datasets, list) or not datasets:
        raise ConfigError(
            f"{path}: `datasets` must be a non-empty list of {{path, sampling}} entries"
        )
    parts = [
        _load_entry(path, i, entry, spec, seed, strict, roots, cache_dir)
        for i, entry in enumerate(datasets)
    ]
    if "phases" not in spec:
        return concat(parts)
    phases = _phases(path, spec["phases"], len(parts))
    indices, ends = phase_order([len(p) for p in parts], phases, seed, str(path))
    return Phased(concat(parts), indices, ends)


class Phased(Subset):
    """A curriculum's records in reading order. The loader reads it as is (it shuffles any other
    source as a whole), and each of `phase_ends` (a record count) must be a multiple of the global
    batch, so every global batch comes from one phase."""

    def __init__(self, base: Sequence, indices: Sequence[int], phase_ends: Sequence[int]):
        super().__init__(base, indices)
        self.phase_ends = tuple(phase_ends)


def _phases(path: Path, phases, num_datasets: int) -> list[tuple[int, list[float]]]:
    """(samples, weights) of every `phases` entry, checked."""
    if not isinstance(phases, list) or not phases:
        raise ConfigError(f"{path}: `phases` must be a non-empty list of {{samples, weights}}")
    out = []
    for k, phase in enumerate(phases):
        where = f"{path}: phases[{k}]"
        if not isinstance(phase, dict) or set(phase) != {"samples", "weights"}:
            raise ConfigError(f"{where}: expected {{samples: N, weights: [w, ...]}}, got {phase!r}")
        n, w = phase["samples"], phase["weights"]
        ok = isinstance(w, list) and len(w) == num_datasets
        if not ok or not all(isinstance(x, int | float) and x >= 0 for x in w) or not sum(w):
            raise ConfigError(
                f"{where}: weights={w!r}: give {num_datasets} weights >= 0 (one per dataset, "
                "in `datasets` order), not all 0"
            )
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"{where}: samples={n!r}: must be a count >= 1")
        out.append((n, [float(x) for x in w]))
    return out


def phase_order(
    sizes: Sequence[int], phases: Sequence[tuple[int, Sequence[float]]], seed: int, where: str = ""
) -> tuple[list[int], list[int]]:
    """(record positions in reading order, each phase's end) of a curriculum over datasets of `sizes`
    records (positions count through the datasets in order).

    Phase k takes `allot(samples, weights)` records of each dataset, drawn without replacement from a
    seeded permutation of that dataset (later phases go on where earlier ones stopped), and shuffles
    them together (seeded): deterministic in `seed`, so a resumed run reads the same order."""
    starts = np.cumsum([0, *sizes])
    perms = [np.random.default_rng([seed, i, 1]).permutation(n) for i, n in enumerate(sizes)]
    used = [0] * len(sizes)
    order, ends = [], []
    for k, (samples, weights) in enumerate(phases):
        phase = []
        for i, count in enumerate(allot(samples, weights)):
            if used[i] + count > sizes[i]:
                raise ConfigError(
                    f"{where}: phases[{k}] needs {count} records of datasets[{i}], which has "
                    f"{sizes[i] - used[i]} left of {sizes[i]}"
                )
            phase += (starts[i] + perms[i][used[i] : used[i] + count]).tolist()
            used[i] += count
        order += np.random.default_rng([seed, len(sizes), k]).permutation(phase).tolist()
        ends.append(len(order))
    return order, ends


def allot(total: int, weights: Sequence[float]) -> np.ndarray:
    """Integer counts summing to `total`, proportional to `weights` (largest remainders)."""
    exact = total * np.asarray(weights, float) / sum(weights)
    counts = np.floor(exact).astype(int)
    counts[np.argsort(counts - exact)[: total - counts.sum()]] += 1
    return counts


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
    roots = roots.or_else(
        MediaRoots(*(str(_root(mix_path, entry, spec, f"{k}_root") or "") for k in MEDIA_KINDS))
    )
    if is_shard_source(file):
        try:
            shards = open_shards(file, roots=roots, cache_dir=cache_dir)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        return take(shards, sample_indices(len(shards), strategy, rng))
    if not file.is_file():
        raise ConfigError(f"{where}: dataset file not found: {file}")
    records = sample_records(list(read_records(file, strict=strict)), strategy, rng)
    return with_roots(records, roots.under(file.parent))


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
