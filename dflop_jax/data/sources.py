"""Reading LLaVA-style dataset files: JSON lists or JSONL files of records (a whole `DataConfig` source,
mixes included, is `dflop_jax.data.dataset.load_source`).

A record (LLaVA-OneVision format):
    {"id": "x1", "image": "a.jpg" | ["a.jpg", "b.jpg"], "conversations": [{"from": "human", "value":
     "<image>\\nWhat is it?"}, {"from": "gpt", "value": "A cat."}]}
    {"id": "v1", "video": "clip.mp4" | "frames_dir/", "conversations": [...]}
    {"id": "t1", "text": "plain text to learn from"}        # plain text (loss on every token)

Every record gets internal fields (leading underscore, never part of the data format):
  `_location` ("file:line" or "file[index]"), `_file`, and per media kind its root
  (`_image_root`, `_video_root`, `_audio_root`: `MediaRoots`).
A line that is not valid JSON becomes `{"_error": "invalid_json", ...}` so the processor raises
`BadSample("invalid_json")` for it and the loader counts it like any other bad sample.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

from dflop_jax.data.bad_sample import BadSample


def read_records(path: str | Path, strict: bool = False) -> Iterator[dict]:
    """Yields the records of a JSON list (`.json`) or JSON-lines file (anything else), in file order.

    Invalid JSON yields an `_error` record (or raises BadSample("invalid_json") when `strict`).
    """
    path = Path(path)
    if not path.is_file():
        raise BadSample("missing_file", str(path), "dataset file not found")
    if path.suffix == ".json":
        yield from _read_json_list(path, strict)
        return
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            location = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                yield _error_record(location, path, f"line is not JSON ({e.msg})", strict)
                continue
            yield _tag(record, location, path, strict)


def _read_json_list(path: Path, strict: bool) -> Iterator[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        yield _error_record(str(path), path, f"file is not JSON ({e})", strict)
        return
    if not isinstance(data, list):
        yield _error_record(str(path), path, "a .json dataset must be a list of records", strict)
        return
    for i, record in enumerate(data):
        yield _tag(record, f"{path}[{i}]", path, strict)


def _tag(record, location: str, path: Path, strict: bool) -> dict:
    if not isinstance(record, dict):
        return _error_record(
            location, path, f"record is a {type(record).__name__}, not an object", strict
        )
    record["_location"] = location
    record["_file"] = str(path)
    return record


def _error_record(location: str, path: Path, detail: str, strict: bool) -> dict:
    if strict:
        raise BadSample("invalid_json", location, detail)
    return {"_location": location, "_file": str(path), "_error": "invalid_json", "_detail": detail}


MEDIA_KINDS = ("image", "video", "audio")


@dataclasses.dataclass(frozen=True)
class MediaRoots:
    """The folders a record's relative media paths resolve against, one per kind ("" = unset).

    Set by `data.image_root` / `video_root` / `audio_root` or a mix's keys; an unset one falls back
    to the dataset file's folder (`under`)."""

    image: str = ""
    video: str = ""
    audio: str = ""

    @classmethod
    def of(cls, cfg) -> MediaRoots:
        """The roots a `DataConfig` (or anything with `<kind>_root` attributes) sets."""
        return cls(*(str(getattr(cfg, f"{kind}_root") or "") for kind in MEDIA_KINDS))

    def under(self, folder: str | Path) -> MediaRoots:
        """These roots, each unset one replaced by `folder`."""
        return MediaRoots(*(str(getattr(self, kind) or folder) for kind in MEDIA_KINDS))

    def or_else(self, other: MediaRoots) -> MediaRoots:
        """These roots, each unset one taken from `other`."""
        return MediaRoots(*(getattr(self, k) or getattr(other, k) for k in MEDIA_KINDS))

    def key(self) -> tuple[str, ...]:
        return tuple(getattr(self, kind) for kind in MEDIA_KINDS)

    def tag(self, record: dict) -> dict:
        """Sets `record`'s internal `_<kind>_root` fields (in place) and returns it."""
        for kind in MEDIA_KINDS:
            record[f"_{kind}_root"] = getattr(self, kind)
        return record


NO_ROOTS = MediaRoots()  # every kind under the dataset file's folder


def with_roots(records: list[dict], roots: MediaRoots) -> list[dict]:
    """Sets each record's media roots (in place, `MediaRoots.tag`) and returns the list."""
    for r in records:
        roots.tag(r)
    return records
