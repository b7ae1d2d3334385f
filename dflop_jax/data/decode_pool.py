"""`DecodePool`: worker processes that decode a global batch's samples while the schedule stays here.

Decoding (image/video reads, resizes, tokenization) is the loader's heavy part; one process does it at
a few samples per second at 384 px. The pack stage hands the samples the schedule needs to this pool
and packs their results in order, so the output is the same as decoding in-process.

Why not grain's `mp_prefetch` workers: they run the whole pipeline on copies, the schedule stage
included, so the trainer's observations (`Scheduler.observe`, adaptive correction) never reach the
scheduler that solves the batch. This pool decodes only; scheduling keeps running in the caller.

Workers are spawned, not forked (the parent runs JAX's threads), and each builds its processor once
(`LazyProcessor` pickles as its config). Failures travel back as the worker's exception, `BadSample`
included, and are handled per sample by the pack stage as in-process ones are.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from collections.abc import Sequence
from typing import Any

_PROCESSOR = None  # this worker's processor (set once by `_init`)


def _init(processor) -> None:
    global _PROCESSOR
    _PROCESSOR = processor


def _process(record: Any):
    return _PROCESSOR.process(record)


def auto_decode_workers(tile_px: int, has_media: bool, cpus: int | None = None) -> int:
    """Decode workers when they pay: min(4, cpus - 1) for image/video data at real tile sizes
    (>= 224 px) on hosts with >= 4 CPUs, else 0. Text and tiny tiles (the demo's 56 px) decode
    faster than a worker ships the result back; on 2 CPUs the one worker competes with the training
    process for the same cores (measured slower there, docs/benchmarks.md)."""
    cpus = cpus or os.cpu_count() or 1
    if not has_media or tile_px < 224 or cpus < 4:
        return 0
    return min(4, cpus - 1)


class DecodePool:
    """`workers` spawned processes running `processor.process`; `decode` keeps the input order."""

    def __init__(self, processor, workers: int):
        if workers < 1:
            raise ValueError(
                f"decode workers={workers}: need >= 1 (0 = decode in-process, no pool)"
            )
        self.workers = workers
        self._pool = concurrent.futures.ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init,
            initargs=(processor,),
        )

    def decode(self, records: Sequence[Any]) -> list[concurrent.futures.Future]:
        """One future per record, in order; `.result()` returns the sample or raises its error."""
        return [self._pool.submit(_process, r) for r in records]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __getstate__(self):
        raise TypeError(
            "a DecodePool cannot be pickled into grain workers: use decode workers or grain "
            "num_workers, not both"
        )
