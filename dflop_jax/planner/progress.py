"""A rich progress bar behind the planner's `progress(phase, done, total)` callback (stderr only)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextlib.contextmanager
def progress_bar(enabled: bool = True, lines: bool = False) -> Iterator:
    """Yields a progress callback; a no-op when disabled. When stderr is not a terminal (a log file,
    a batch job) it is a no-op too, or with `lines` one line per update (for work of minutes per
    step, which a log should show is still moving)."""
    if not enabled or (not sys.stderr.isatty() and not lines):
        yield lambda *_: None
        return
    if not sys.stderr.isatty():
        t0 = time.monotonic()
        yield lambda phase, done, total: print(
            f"{phase}: {done}/{total} ({time.monotonic() - t0:.0f}s)", file=sys.stderr, flush=True
        )
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        tasks: dict[str, int] = {}

        def update(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total)
            bar.update(tasks[phase], completed=done, total=total)

        yield update
