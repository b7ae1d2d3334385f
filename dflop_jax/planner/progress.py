"""Progress of long work behind one callback, `progress(phase, done, total)`, on a terminal and in logs.

    with progress_bar() as progress:          # a rich bar on a terminal, lines in a log
        for i, item in enumerate(items):
            work(item)
            progress("profile model", i + 1, len(items))

Every phase a user may wait on for more than a few seconds (the data profile, the model profile,
planning, compiling, a checkpoint restore) reports through it. On a terminal (stderr a tty) each
phase is a rich progress bar with its count and elapsed time. Otherwise (a log file, a batch job)
it writes a line per phase when it starts, then at most one every `every_s` seconds while it runs,
and one when it ends, e.g. `compile: 12/40 (31s)`: a log shows the work is moving, with counts, and
never stays silent for long. Pure Python (rich only): the planner, the profiler, the data profile
and the runtime all report through it.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

ProgressFn = Callable[[str, int, int], None]
LINE_EVERY_S = 10.0


def silent(phase: str, done: int, total: int) -> None:
    """The callback that reports nothing."""


@contextlib.contextmanager
def progress_bar(
    enabled: bool = True, every_s: float = LINE_EVERY_S, stream=None, clock=time.monotonic
) -> Iterator[ProgressFn]:
    """Yields a progress callback (module docstring): a rich bar when `stream` (default stderr) is a
    terminal, else lines at most every `every_s` seconds per phase; `silent` when not `enabled`."""
    stream = stream or sys.stderr
    if not enabled:
        yield silent
        return
    if not stream.isatty():
        yield LineProgress(stream, every_s, clock)
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(file=stream), transient=True) as bar:
        tasks: dict[str, int] = {}

        def update(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total)
            bar.update(tasks[phase], completed=done, total=total)

        yield update


class LineProgress:
    """Progress as log lines: `phase: done/total (elapsed)`, when a phase starts, at most every
    `every_s` seconds, and when it ends."""

    def __init__(self, stream, every_s: float = LINE_EVERY_S, clock=time.monotonic):
        self.stream, self.every_s, self.clock = stream, every_s, clock
        self.started: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.ended: set[str] = set()

    def __call__(self, phase: str, done: int, total: int) -> None:
        now = self.clock()
        if done >= total and phase in self.ended:
            return  # its end is written already
        if done < total and phase in self.ended:  # the phase runs again (another bucket, stage)
            self.ended.discard(phase)
            self.started.pop(phase)
            self.last.pop(phase)
        start = self.started.setdefault(phase, now)
        first = phase not in self.last
        if not (first or done >= total or now - self.last[phase] >= self.every_s):
            return
        self.last[phase] = now
        if done >= total:
            self.ended.add(phase)
        print(f"{phase}: {done}/{total} ({now - start:.0f}s)", file=self.stream, flush=True)
