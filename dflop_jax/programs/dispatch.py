"""What the dispatching thread issues: every program of a training step goes through `issue`.

    out = issue(STAGE, stage.mesh, program, *args)   # counted, called under the mesh

`issue` counts each program by kind (stage programs, transfers, update programs: `KINDS`) in the
process-wide `ISSUED`, and calls it under its mesh (`jax.set_mesh`: the context mesh is part of
jax's cache key, so a call must enter the mesh its program was lowered under). The trainer reads
the counts around each step (`Issued.snapshot`) into the step's metrics (`dispatch_programs`, ...),
with the first time the dispatching thread waited on a device (`note_wait`: a measured step's
sampled microbatch). `record` keeps the calls of a stretch of dispatching (argument shapes and which
arguments were donated) so a benchmark can call the same executables again in a tight loop
(`bench/dispatch.py`); recording is off in training.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jax

STAGE, TRANSFER, UPDATE = 0, 1, 2
KINDS = ("stage", "transfer", "update")


@dataclasses.dataclass(frozen=True)
class Call:
    """One recorded program call: `fn(*args)` under `mesh`.

    Attributes:
      args: the arguments, each array as a `jax.ShapeDtypeStruct` with its sharding (other values
        as they were: static arguments, None).
      donated: per array leaf of `args` (in `jax.tree.leaves` order), whether the call donated it.
    """

    kind: int
    mesh: Any
    fn: Callable
    args: tuple
    donated: tuple[bool, ...]


class Issued:
    """Programs issued so far in this process, by kind, and the clock of the first device wait
    since `reset_wait`."""

    def __init__(self):
        self.counts = [0] * len(KINDS)
        self.first_wait: float | None = None
        self.calls: list[Call] | None = None  # recording (`record`), else None

    def snapshot(self) -> tuple[int, ...]:
        return tuple(self.counts)

    def note_wait(self, clock: Callable[[], float] = time.perf_counter) -> None:
        """The dispatching thread is about to wait on a device: keeps the first such clock."""
        if self.first_wait is None:
            self.first_wait = clock()

    def reset_wait(self) -> None:
        self.first_wait = None


ISSUED = Issued()


def issue(kind: int, mesh, fn: Callable, *args):
    """Calls the jitted program `fn(*args)` under `mesh` (None: no mesh context), counted as `kind`."""
    ISSUED.counts[kind] += 1
    if ISSUED.calls is not None:
        return _recorded(kind, mesh, fn, args)
    if mesh is None:
        return fn(*args)
    with jax.set_mesh(mesh):
        return fn(*args)


@contextmanager
def record() -> Iterator[list[Call]]:
    """Records every `issue`d call inside the block into the yielded list (`Call`)."""
    ISSUED.calls = calls = []
    try:
        yield calls
    finally:
        ISSUED.calls = None


def _struct(x):
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x


def _recorded(kind: int, mesh, fn: Callable, args: tuple):
    leaves = [x for x in jax.tree.leaves(args) if isinstance(x, jax.Array)]
    structs = jax.tree.map(_struct, args)
    if mesh is None:
        out = fn(*args)
    else:
        with jax.set_mesh(mesh):
            out = fn(*args)
    donated = tuple(x.is_deleted() for x in leaves)
    ISSUED.calls.append(Call(kind, mesh, fn, structs, donated))
    return out
