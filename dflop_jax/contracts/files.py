"""Content hashes of the files a run reads: cache keys, and the record a plan keeps of its inputs."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_hash(path: str | Path, chunk: int = 1 << 20) -> str:
    """sha256 of the file's bytes (hex)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
