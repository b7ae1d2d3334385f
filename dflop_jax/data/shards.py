"""Datasets as they ship: HF parquet shards with embedded images, and WebDataset tar shards.

    records = open_shards("hf/LLaVA-OneVision-Data/", roots=NO_ROOTS, cache_dir="")
    records[i]      # the record dict the JSON reader makes, built on access

Both are random-access sequences of records (`__len__` / `__getitem__`), so grain's index sampler
(shuffle, sharding over readers, a checkpointed position) runs on them unchanged, and no shard is ever
read whole:
  - Parquet (`data/train-*.parquet`, the HF datasets layout): only footers are read up front; record i
    is found by (shard, row group) and its row group is read and decoded on access. A small LRU of
    decoded row groups (`ROW_GROUPS_HELD`) serves the neighbours of a sequential pass.
    `image` (`audio`) is HF's Image (Audio) struct {bytes, path} or a list of them (kept as is: the processor reads
    the bytes, or resolves `path` under the image root when bytes are absent); null columns are dropped
    and an empty `image` list is kept (both are text-only rows, `Processor`); `data_source` stays the
    record's group for the data profile.
  - Tar (WebDataset): members group by key (`<dir>/<key>.<ext>`, the key ends at the basename's first
    dot): `<key>.json` holds the record, image members (`<key>.jpg`, `<key>.1.png`, ...) are its images
    and audio members (`<key>.wav`, `<key>.flac`, `<key>.mp3`, ...) its clips, in member order, as
    {bytes, path} structs. An index of member offsets per shard, built once and
    cached under `cache_dir` by the shard's content hash, gives one positioned read per member.
Records carry `_location` = `shard:row` (parquet) or `shard.tar:key` (tar), so a bad row is counted by
reason and `data.strict` names it. A row that cannot be read (a corrupt row group, a truncated tar
member) becomes an `_error` record ("corrupt_shard").
"""

from __future__ import annotations

import bisect
import glob
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from dflop_jax.config import ConfigError
from dflop_jax.contracts.files import file_hash
from dflop_jax.data.sources import MEDIA_KINDS, NO_ROOTS, MediaRoots

ROW_GROUPS_HELD = 4  # decoded parquet row groups kept per reader (HF image shards: ~100 rows each)
SHARD_SUFFIXES = (".parquet", ".tar")
IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff"})
AUDIO_EXTS = frozenset({"wav", "flac", "mp3", "ogg", "opus", "m4a", "aac", "webm"})


def is_shard_source(spec: str | Path) -> bool:
    """Whether `spec` names shards (a .parquet/.tar file, a glob, or a directory) rather than JSON."""
    s = str(spec)
    return (
        any(c in s for c in "*?[")
        or Path(s).expanduser().is_dir()
        or Path(s).suffix in SHARD_SUFFIXES
    )


def shard_files(spec: str | Path) -> list[Path]:
    """The shard files `spec` names, sorted: a file, a glob, or a directory searched recursively
    (where some shards are a `train` split, as in the HF layout `data/train-00000-of-00004.parquet`,
    only those)."""
    s = str(Path(str(spec)).expanduser())
    if any(c in s for c in "*?["):
        files = [Path(p) for p in glob.glob(s, recursive=True) if Path(p).is_file()]
    elif Path(s).is_dir():
        files = [p for suffix in SHARD_SUFFIXES for p in Path(s).rglob(f"*{suffix}")]
        train = [p for p in files if p.name.startswith("train") or "train" in p.parent.parts]
        files = train or files
    else:
        files = [Path(s)] if Path(s).is_file() else []
    files = sorted(p for p in files if p.suffix in SHARD_SUFFIXES)
    if not files:
        raise ConfigError(f"{spec!r}: no .parquet or .tar shard found")
    kinds = {p.suffix for p in files}
    if len(kinds) > 1:
        raise ConfigError(f"{spec!r}: both parquet and tar shards; name one kind (a glob)")
    return files


def open_shards(spec: str | Path, *, roots: MediaRoots = NO_ROOTS, cache_dir="") -> ShardRecords:
    """The records of the shards `spec` names; relative media paths resolve against the roots, else
    each shard's folder. `cache_dir` keeps tar indexes ("" = rebuilt in memory each time)."""
    files = shard_files(spec)
    if files[0].suffix == ".parquet":
        _pyarrow_parquet(spec)  # missing: one line naming the source
        return ParquetRecords(files, roots)
    return TarRecords(files, roots, cache_dir)


class ShardRecords(Sequence):
    """Records of shard files by global index: i -> (shard, position in shard), built on access."""

    def __init__(self, files: list[Path], counts: list[int], roots: MediaRoots):
        self.files = [str(f) for f in files]
        self.starts = [0]
        for n in counts:
            self.starts.append(self.starts[-1] + n)
        self.roots = roots
        self._lock = threading.Lock()  # the loader's prefetch thread and the caller share caches

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Subset(self, range(len(self))[i])
        shard, pos = self._find(i)
        record = self._read(shard, pos)
        record["_file"] = self.files[shard]
        return self.roots.under(Path(self.files[shard]).parent).tag(record)

    def _find(self, i: int) -> tuple[int, int]:
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"record {i} of {len(self)}")
        shard = bisect.bisect_right(self.starts, i) - 1
        return shard, i - self.starts[shard]

    def group_key(self, i: int) -> tuple[str, ...]:
        """(shard file, *media roots) of record i without reading it (metadata cache)."""
        shard, _ = self._find(i)
        return self.files[shard], *self.roots.under(Path(self.files[shard]).parent).key()

    def _read(self, shard: int, pos: int) -> dict:
        raise NotImplementedError

    def __getstate__(self) -> dict:  # grain workers get the index, not open files or caches
        state = dict(self.__dict__)
        state.update(_lock=None, **self._fresh_caches())
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _fresh_caches(self) -> dict:
        return {}


class ParquetRecords(ShardRecords):
    """HF-layout parquet shards, read by (shard, row group); see the module docstring."""

    def __init__(self, files: list[Path], roots: MediaRoots = NO_ROOTS):
        pq = _pyarrow_parquet()
        metas = []
        for f in files:
            try:
                metas.append(pq.read_metadata(f))
            except (OSError, ValueError) as e:  # pyarrow's errors derive from these
                raise ConfigError(f"{f}: not a readable parquet file ({e})") from None
        super().__init__(files, [m.num_rows for m in metas], roots)
        self.group_starts = []  # per shard: first row of each row group, then the row count
        for m in metas:
            starts = [0]
            for g in range(m.num_row_groups):
                starts.append(starts[-1] + m.row_group(g).num_rows)
            self.group_starts.append(starts)
        self.__dict__.update(self._fresh_caches())

    def _fresh_caches(self) -> dict:
        return {"_groups": OrderedDict(), "_handles": {}}

    def rows_held(self) -> int:
        """Decoded rows held in the row-group cache (bounded by `ROW_GROUPS_HELD` row groups)."""
        return sum(len(rows) for rows in self._groups.values())

    def _read(self, shard: int, pos: int) -> dict:
        starts = self.group_starts[shard]
        group = bisect.bisect_right(starts, pos) - 1
        location = f"{self.files[shard]}:{pos}"
        rows = self._row_group(shard, group)
        if isinstance(rows, str):
            return {"_location": location, "_error": "corrupt_shard", "_detail": rows}
        return hf_row_record(rows[pos - starts[group]], location)

    def _row_group(self, shard: int, group: int) -> list[dict] | str:
        """The row group's rows as dicts (cached), or why it cannot be read."""
        key = (shard, group)
        with self._lock:
            if key in self._groups:
                self._groups.move_to_end(key)
                return self._groups[key]
            try:
                if shard not in self._handles:
                    self._handles[shard] = _pyarrow_parquet().ParquetFile(self.files[shard])
                rows = self._handles[shard].read_row_group(group).to_pylist()
            except (OSError, ValueError) as e:
                rows = f"row group {group} unreadable: {e}"
            self._groups[key] = rows
            while len(self._groups) > ROW_GROUPS_HELD:
                self._groups.popitem(last=False)
            return rows


def hf_row_record(row: dict, location: str) -> dict:
    """A parquet row as the JSON reader's record: null columns dropped (text-only rows, absent media)."""
    record = {k: v for k, v in row.items() if v is not None}
    record["_location"] = location
    return record


PYARROW_MISSING = (
    "parquet shards need pyarrow, which is not installed: "
    "pip install -c constraints.txt -e '.[parquet]' in the repository"
)


def _pyarrow_parquet(source: str | Path | None = None):
    """`pyarrow.parquet`, or a one-line ConfigError (naming `source`) saying how to install it."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        where = f"{str(source)!r}: " if source is not None else ""
        raise ConfigError(where + PYARROW_MISSING) from None
    return pq


class TarRecords(ShardRecords):
    """WebDataset tar shards with a cached member-offset index; see the module docstring.

    Every shard's index stays in memory (a key and its members' offsets, ~200 bytes per sample):
    a shuffled pass touches every shard all the time, so reloading indexes would cost a file read
    per record."""

    def __init__(self, files: list[Path], roots: MediaRoots = NO_ROOTS, cache_dir=""):
        self.indexes = [tar_index(f, str(cache_dir)) for f in files]
        super().__init__(files, [len(ix) for ix in self.indexes], roots)

    def _read(self, shard: int, pos: int) -> dict:
        path = self.files[shard]
        key, members = self.indexes[shard][pos]
        location = f"{path}:{key}"
        blobs = []
        with open(path, "rb") as f:
            for ext, offset, size in members:
                data = os.pread(f.fileno(), size, offset)
                if len(data) != size:
                    detail = f"member {key}.{ext} truncated ({len(data)} of {size} bytes)"
                    return {"_location": location, "_error": "corrupt_shard", "_detail": detail}
                blobs.append((ext, data))
        return tar_sample_record(key, blobs, location)


def tar_sample_record(key: str, blobs: list[tuple[str, bytes]], location: str) -> dict:
    """One WebDataset sample (its members' extensions and bytes, in member order) as a record."""
    error = {"_location": location, "_error": "invalid_json"}
    texts = [data for ext, data in blobs if ext == "json"]
    if len(texts) != 1:
        return {**error, "_detail": f"{len(texts)} {key}.json members (need one)"}
    try:
        record = json.loads(texts[0])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return {**error, "_detail": f"{key}.json is not JSON ({e})"}
    if not isinstance(record, dict):
        return {**error, "_detail": f"{key}.json is a {type(record).__name__}, not an object"}
    for field, exts in (("image", IMAGE_EXTS), ("audio", AUDIO_EXTS)):
        media = [
            {"bytes": data, "path": f"{key}.{ext}"}
            for ext, data in blobs
            if ext.rsplit(".", 1)[-1].lower() in exts
        ]
        if media:
            record[field] = media[0] if len(media) == 1 else media
    record["_location"] = location
    return record


def tar_index(path: Path, cache_dir: str = "") -> list:
    """[(key, [(ext, data offset, size), ...]), ...] of a tar shard in member order; cached as JSON
    under `cache_dir/tar_index` by the shard's content hash."""
    cache = None
    if cache_dir:
        cache = Path(cache_dir) / "tar_index" / f"{path.stem}-{file_hash(path)[:16]}.json"
        if cache.is_file():
            try:
                return [(k, [tuple(m) for m in ms]) for k, ms in json.loads(cache.read_text())]
            except (json.JSONDecodeError, OSError, ValueError):
                pass  # a torn or foreign file: rebuild it
    index = _scan_tar(path)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(index))
        os.replace(tmp, cache)  # atomic: concurrent readers never see a torn index
    return index


def _scan_tar(path: Path) -> list:
    """Reads member headers only (tarfile seeks over the data of an uncompressed tar)."""
    import tarfile

    samples: dict[str, list] = {}
    try:
        with tarfile.open(path, "r:") as tf:
            while True:
                try:
                    member = tf.next()
                except tarfile.TarError:  # a truncated tail: keep what came before it
                    break
                if member is None:
                    break
                if not member.isfile():
                    continue
                folder, _, base = member.name.rpartition("/")
                stem, dot, ext = base.partition(".")
                if not dot:
                    continue
                key = f"{folder}/{stem}" if folder else stem
                samples.setdefault(key, []).append((ext, member.offset_data, member.size))
    except (tarfile.TarError, OSError) as e:
        raise ConfigError(f"{path}: not a readable tar shard ({e})") from None
    return list(samples.items())


class Subset(Sequence):
    """`base[indices[j]]` for j: a sampled or split view of a lazy source (nothing is read)."""

    def __init__(self, base: Sequence, indices: Sequence[int]):
        self.base, self.indices = base, list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, j):
        if isinstance(j, slice):
            return Subset(self.base, self.indices[j])
        return self.base[self.indices[j]]

    def group_key(self, j: int):
        return group_key(self.base, self.indices[j])


class Concat(Sequence):
    """Sources one after another (a mix with shard sources)."""

    def __init__(self, parts: list[Sequence]):
        self.parts = parts
        self.starts = [0]
        for p in parts:
            self.starts.append(self.starts[-1] + len(p))

    def __len__(self) -> int:
        return self.starts[-1]

    def _find(self, i: int) -> tuple[Sequence, int]:
        i = int(i) + (len(self) if int(i) < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(f"record {i} of {len(self)}")
        k = bisect.bisect_right(self.starts, i) - 1
        return self.parts[k], i - self.starts[k]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Subset(self, range(len(self))[i])
        part, j = self._find(i)
        return part[j]

    def group_key(self, i: int):
        return group_key(*self._find(i))


def take(records: Sequence, indices: Sequence[int]) -> Sequence:
    """The records at `indices`: a list for a list (records in memory), else a lazy `Subset`."""
    if isinstance(records, list):
        return [records[i] for i in indices]
    return Subset(records, indices)


def group_key(records: Sequence, i: int) -> tuple[str, ...] | None:
    """(file, *media roots) record i came from (the metadata cache's unit), or None; lazy sources
    answer without reading the record."""
    if hasattr(records, "group_key"):
        return records.group_key(i)
    r = records[i]
    if not isinstance(r, dict) or "_file" not in r:
        return None
    return r["_file"], *(r.get(f"_{kind}_root", "") for kind in MEDIA_KINDS)


def concat(parts: list[Sequence]) -> Sequence:
    """One sequence of all parts: a list when every part is one, else a lazy `Concat`."""
    if all(isinstance(p, list) for p in parts):
        return [r for p in parts for r in p]
    return Concat(parts)


__all__ = [
    "Concat",
    "ParquetRecords",
    "ShardRecords",
    "Subset",
    "TarRecords",
    "concat",
    "group_key",
    "hf_row_record",
    "is_shard_source",
    "open_shards",
    "shard_files",
    "tar_index",
    "take",
]
