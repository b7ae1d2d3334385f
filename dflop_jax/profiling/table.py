"""Staleness hashes of a profile (config and code); the cost-table file format is
`dflop_jax.contracts.cost_table` (re-exported here for the profiler's modules)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from dflop_jax.contracts.cost_table import (
    ALL_KINDS,
    AUDIO_KINDS,
    COLOCATED_KINDS,
    ENCODER_KINDS,
    LAYER_KINDS,
    LLM_KINDS,
    MEMORY_FIELDS,
    STAGE_KINDS,
    TABLE_VERSION,
    CostEntry,
    ProfiledCostTable,
    load_table,
    save_table,
)


def config_hash(obj: Any) -> str:
    """A short stable hash of a JSON-able description (dataclasses are converted with asdict)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    text = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def code_version(*packages: str) -> str:
    """Hash of the source files of the given directories or files of this repository (e.g. "models"),
    so a change to the model code makes earlier profiles stale. Not git-based: works without a clone."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for pkg in packages:
        path = root / pkg
        for f in [path] if path.is_file() else sorted(path.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


__all__ = [
    "ALL_KINDS",
    "AUDIO_KINDS",
    "COLOCATED_KINDS",
    "ENCODER_KINDS",
    "LAYER_KINDS",
    "LLM_KINDS",
    "MEMORY_FIELDS",
    "STAGE_KINDS",
    "TABLE_VERSION",
    "CostEntry",
    "ProfiledCostTable",
    "code_version",
    "config_hash",
    "load_table",
    "save_table",
]
