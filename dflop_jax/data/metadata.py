"""Per-sample shape metadata with an on-disk cache, so profiling or loading a dataset twice costs nothing.

    cache = MetadataCache(cfg.cache_dir, processor)
    shapes = cache.shapes(records)          # [SampleShape | BadSample], in record order

One cache file per (dataset file or shard, media roots): keyed by the file's content hash and a hash of every
processing setting (`DataConfig.processing_key()`) and of `SHAPE_RULES`, holding each record's (tiles, tokens, modality, audio windows) or its
bad-sample reason by location. A changed dataset or setting is a new key; media files are trusted not to
change under an unchanged dataset file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from dflop_jax.contracts import SampleShape
from dflop_jax.contracts.files import file_hash
from dflop_jax.data.bad_sample import BadSample
from dflop_jax.data.process import Processor
from dflop_jax.data.shards import group_key

# The processor's rules for what a record becomes (its shape, or its bad-sample reason), part of the
# cache key: raise it when a change makes a cached entry wrong (3: audio clips have shapes).
SHAPE_RULES = 3


def compute_shape(processor: Processor, record: dict) -> SampleShape | BadSample:
    """The record's shape, or the BadSample it raises (returned, so callers count instead of crash)."""
    try:
        return processor.shape(record)
    except BadSample as e:
        return e


class MetadataCache:
    """Shape metadata per record, cached per dataset file under `cache_dir` ("" = no caching).

    Attributes:
      hits, misses: records answered from the cache / computed since construction.
    """

    def __init__(self, cache_dir: str | Path, processor: Processor):
        self.dir = Path(cache_dir) if cache_dir else None
        self.processor = processor
        key = {**processor.cfg.processing_key(), "shape_rules": SHAPE_RULES}
        settings = json.dumps(key, sort_keys=True, default=str)
        self._settings = hashlib.sha256(settings.encode()).hexdigest()[:16]
        self._file_hashes: dict[str, str] = {}
        self.hits = self.misses = 0

    def shapes(
        self, records: Sequence[dict], visit: Callable[[int, dict], None] | None = None
    ) -> list[SampleShape | BadSample]:
        """[SampleShape | BadSample] for `records`, in order; cached records are not re-read.

        Each record is read once (lazy sources: shard by shard, in order), and `visit(i, record)`, if
        given, sees it (the profiler counts extra keys and groups there, in the same pass)."""
        out: list[SampleShape | BadSample | None] = [None] * len(records)
        groups: dict[tuple | None, list[int]] = defaultdict(list)
        for i in range(len(records)):
            groups[group_key(records, i) if self.dir is not None else None].append(i)
        for key, idx in groups.items():
            for i, shape in zip(idx, self._group(key, records, idx, visit)):
                out[i] = shape
        return out

    def _group(self, key, records, idx, visit) -> list[SampleShape | BadSample]:
        path = self._path(*key) if key is not None else None
        table = _read_table(path) if path is not None else {}
        result, changed = [], False
        for i in idx:
            r = records[i]
            if visit is not None:
                visit(i, r)
            loc = r.get("_location") if isinstance(r, dict) else None
            if loc is not None and loc in table:
                self.hits += 1
                result.append(_decode(table[loc], loc))
                continue
            self.misses += 1
            shape = compute_shape(self.processor, r)
            if path is not None and loc is not None:
                table[loc] = _encode(shape)
                changed = True
            result.append(shape)
        if changed:
            _write_table(path, table)
        return result

    def _path(self, file: str, *roots: str) -> Path:
        if file not in self._file_hashes:
            self._file_hashes[file] = file_hash(Path(file))
        roots = hashlib.sha256("|".join(str(Path(r).resolve()) for r in roots).encode()).hexdigest()
        name = f"{Path(file).stem}-{self._file_hashes[file][:16]}-{self._settings}-{roots[:8]}.json"
        return self.dir / name


def _encode(shape: SampleShape | BadSample) -> list | dict:
    if isinstance(shape, BadSample):
        return {"error": shape.reason, "detail": shape.detail}
    return [shape.id, shape.tiles, shape.tokens, shape.modality, list(shape.audio_windows)]


def _decode(entry, location: str) -> SampleShape | BadSample:
    if isinstance(entry, dict):
        return BadSample(entry["error"], location, entry["detail"])
    return SampleShape(entry[0], int(entry[1]), int(entry[2]), entry[3], tuple(entry[4]))


def _read_table(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, OSError):  # a torn or foreign file: recompute and overwrite
        return {}


def _write_table(path: Path, table: dict) -> None:
    """Atomic replace, so concurrent readers (other hosts, grain workers) never see a torn file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table))
    os.replace(tmp, path)
