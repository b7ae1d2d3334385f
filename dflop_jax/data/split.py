"""The held-out split: a deterministic share of a dataset's records that training never sees.

    train, held_out = split_records(records, fraction=0.05, seed=0)

A record is held out when a hash of (seed, its key) falls below `fraction`. Its key is its `id` when
it has one, so duplicates of a sample land on the same side (no copy of an evaluated sample is
trained on) and the split does not move when the dataset is reordered or grows; a record without
an id is keyed by its position. The hash is blake2b, not Python's `hash` (salted per process), so
every process of a run, and every run, splits alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from dflop_jax.config import ConfigError
from dflop_jax.data.shards import take


def record_key(record: Any, index: int) -> str:
    """What the split hashes: the record's `id`, else its position in the dataset."""
    if isinstance(record, dict) and record.get("id") is not None:
        return f"id:{record['id']}"
    return f"index:{index}"


def held_out(key: str, fraction: float, seed: int) -> bool:
    """Whether the record with `key` is held out (a uniform draw in [0, 1) below `fraction`)."""
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def split_records(records: Sequence[Any], fraction: float, seed: int) -> tuple[Sequence, Sequence]:
    """(training records, held-out records), each in dataset order; fraction 0 holds out nothing.

    A list gives lists; a lazy source (shards) gives lazy views of it (each record is read once here,
    for its key, and not kept)."""
    if fraction <= 0:
        return (list(records) if isinstance(records, list) else records), []
    if getattr(records, "phase_ends", None) is not None:
        raise ConfigError(
            f"held-out fraction {fraction}: a data mix with `phases` (a curriculum) holds nothing "
            "out; evaluate on a source of its own (eval.source) with eval.fraction=0"
        )
    train, held = [], []
    for i in range(len(records)):
        (held if held_out(record_key(records[i], i), fraction, seed) else train).append(i)
    return take(records, train), take(records, held)
