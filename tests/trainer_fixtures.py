"""The in-process trainer run the runtime tests share: the tiny decoder's config (`tiny_decoder_run`)
with stage times measured every step and the scheduler's correction on, and a deterministic clock."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

from models_fixtures import tiny_decoder_run

from dflop_jax.config import load_config
from dflop_jax.runtime.config import TrainConfig


def decoder_train_config(tmp_path: Path, name: str, **over) -> TrainConfig:
    """The tiny decoder's run `tmp_path / name` on 96 samples, 2-3 microbatches per step, stage times
    measured every step, correction on; `over` (dotted key -> value) adds or replaces keys."""
    over = {"layout.microbatches": "[2, 3]", "measure_stage_times_every": 1,
            "scheduler.correction": "'on'", **over}  # fmt: skip
    return load_config(TrainConfig, None, tiny_decoder_run(tmp_path, name, 96, **over))


def millisecond_clock() -> Callable[[], float]:
    """A clock under which every timed program takes 1 ms (two consecutive reads)."""
    ticks = itertools.count()
    return lambda: next(ticks) * 1e-3
