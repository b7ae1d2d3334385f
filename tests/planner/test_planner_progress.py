"""Progress of long work in a log (not a terminal): a line when a phase starts, at most one per
interval while it runs, one when it ends; nothing when disabled."""

import io

from dflop_jax.planner.progress import LineProgress, progress_bar


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_lines_start_every_interval_and_end():
    out, clock = io.StringIO(), _Clock()
    progress = LineProgress(out, every_s=10.0, clock=clock)
    for done in range(101):  # one update a second for 100 s
        clock.now = float(done)
        progress("compile", done, 100)
    lines = out.getvalue().splitlines()
    assert lines[0] == "compile: 0/100 (0s)" and lines[-1] == "compile: 100/100 (100s)"
    assert len(lines) == 11  # the start, then one per 10 s (the last at the end)
    progress("compile", 100, 100)  # an end reported twice is written once
    assert len(out.getvalue().splitlines()) == 11
    clock.now = 200.0
    progress("compile", 0, 5)  # the phase runs again: its clock restarts
    assert out.getvalue().splitlines()[-1] == "compile: 0/5 (0s)"


def test_a_log_gets_lines_and_disabled_gets_nothing():
    log = io.StringIO()  # not a tty
    with progress_bar(stream=log) as progress:
        progress("profile model", 0, 3)
        progress("profile model", 3, 3)
    assert log.getvalue().splitlines() == ["profile model: 0/3 (0s)", "profile model: 3/3 (0s)"]
    quiet = io.StringIO()
    with progress_bar(False, stream=quiet) as progress:
        progress("plan", 1, 1)
    assert quiet.getvalue() == ""
