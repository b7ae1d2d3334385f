"""One schedule per global batch on every process: the digest check and the shared observations.

Every process solves the same deterministic problem (`scheduler/solve.py`: no clock in the answer when
the wall-clock backstop is off, as it is in multi-process runs). That holds only if every process feeds
the scheduler the same observations, and it is checked, not assumed:

- `check_schedule`: before a batch is dispatched, the processes exchange its schedule digest; a
  difference is a `JobError` naming the step and each process's digest (dispatching different programs
  would hang the pipeline's transfers).
- `shared_stage_times`: a measured step times only the stage programs this process runs; the stage
  times of each stage are taken from the first process owning a device of it and exchanged bit for bit,
  so every process observes the same [M, P, 2] seconds (and the same validity mask: a microbatch is
  kept only if no process compiled during it).

Single process: both are free (no exchange).
"""

from __future__ import annotations

import jax
import numpy as np

from dflop_jax.programs.processes import exchange_host
from dflop_jax.programs.watchdog import JobError


class ScheduleMismatch(JobError):
    """The processes' schedules of one global batch differ."""


def check_schedule(step: int, digest: str) -> None:
    """Raises `ScheduleMismatch` unless every process scheduled this step's batch alike."""
    if jax.process_count() == 1:
        return
    mine = np.frombuffer(digest.encode().ljust(32)[:32], np.uint8)
    every = [bytes(row).decode().strip() for row in exchange_host(mine, f"step{step}/schedule")]
    if len(set(every)) > 1:
        groups: dict[str, list[int]] = {}
        for q, d in enumerate(every):
            groups.setdefault(d, []).append(q)
        said = "; ".join(f"process {', '.join(map(str, qs))}: {d}" for d, qs in groups.items())
        raise ScheduleMismatch(
            f"step {step}: the processes scheduled the global batch differently (digests {said}); "
            "check that every process runs the same config, data and code"
        )


def stage_owners(meshes) -> list[int]:
    """Per stage, the lowest process index among its mesh's devices (whose timings count)."""
    return [min(d.process_index for d in m.devices.flat) for m in meshes]


def shared_stage_times(
    times: np.ndarray, valid: np.ndarray, owners: list[int], step: int
) -> tuple[np.ndarray, np.ndarray]:
    """(times [M, P, 2], valid [M]) identical on every process: stage s's columns from owners[s]."""
    if jax.process_count() == 1:
        return times, valid
    m, p, _ = times.shape
    mine = np.concatenate([times.ravel(), valid.astype(np.float64)])
    return _owners_columns(exchange_host(mine, f"step{step}/stage_times"), m, p, owners)


def _owners_columns(every: np.ndarray, m: int, p: int, owners: list[int]):
    """every: [processes, M*P*2 + M] (times, then validity) -> (times [M, P, 2], valid [M])."""
    all_times = every[:, : m * p * 2].reshape(-1, m, p, 2)
    shared = np.stack([all_times[owners[s], :, s] for s in range(p)], axis=1)
    return shared, every[:, m * p * 2 :].min(axis=0) > 0
