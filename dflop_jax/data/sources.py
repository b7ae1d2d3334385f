"""Reading LLaVA-style dataset files: JSON lists or JSONL files of records (a whole `DataConfig` source,
mixes included, is `dflop_jax.data.dataset.load_source`).

A record (LLaVA-OneVision format):
    {"id": "x1", "image": "a.jpg" | ["a.jpg", "b.jpg"], "conversations": [{"from": "human", "value":
     "<image>\\nWhat is it?"}, {"from": "gpt", "value": "A cat."}]}
    {"id": "v1", "video": "clip.mp4" | "frames_dir/", "conversations": [...]}
    {"id": "t1", "text": "plain text to learn from"}        # plain text (loss on every token)

Every record gets internal fields (leading underscore, never part of the data format):
  `_location` ("file:line" or "file[index]"), `_file`, `_image_root`, `_video_root`.
A line that is not valid JSON becomes `{"_error": "invalid_json", ...}` so the processor raises
`BadSample("invalid_json")` for it and the loader counts it like any other bad sample.
"""

from __future__ import annotations

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


def with_roots(records: list[dict], image_root: str | Path, video_root: str | Path) -> list[dict]:
    """Sets each record's `_image_root` / `_video_root` (in place) and returns the list."""
    for r in records:
        r["_image_root"] = str(image_root)
        r["_video_root"] = str(video_root)
    return records
