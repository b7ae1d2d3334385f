"""The per-step console line: named columns, step k/N, elapsed and an ETA that leaves compile steps out."""

import io
import itertools

from metrics_fixtures import step_metrics
from rich.console import Console

from dflop_jax.runtime.metrics import MetricsLog


def _log(tmp_path, times, every=1, total=10):
    """A MetricsLog whose clock reads `times` in order (the first read is its start)."""
    out = io.StringIO()
    console = Console(file=out, width=400, color_system=None)
    ticks = iter(times)
    log = MetricsLog(tmp_path, every, False, console, total_steps=total, clock=lambda: next(ticks))
    return log, out


def test_console_line_names_every_column(tmp_path):
    log, out = _log(tmp_path, [0.0, 10.0])
    log.log(step_metrics(1, recompiles=3))
    line = out.getvalue().strip()
    assert line == (
        "step 1/10 | elapsed 0:10 | ETA ? | loss 2.3457 | grad norm 0.812 | lr 3.00e-03 | "
        "step time 1.50s | tokens/s 1,234 | MFU 12.50% | padding 10.0% | data wait 0.01s | "
        "microbatches 4 | compiles 3"
    )


def test_eta_is_the_mean_of_steps_that_compiled_nothing(tmp_path):
    # start 0; step 1 compiles (10 s); 2 steady (2 s); 3 compiles a new bucket (10 s); 4 steady (4 s).
    log, out = _log(tmp_path, [0.0, 10.0, 12.0, 22.0, 26.0])
    for step, recompiles in [(1, 3), (2, 0), (3, 1), (4, 0)]:
        log.log(step_metrics(step, recompiles))
    lines = out.getvalue().strip().splitlines()
    # After step 2: 8 steps left x 2 s; after step 3 still 2 s per step (the compile step is left out),
    # 7 left; after step 4 the steady mean is (2 + 4) / 2 = 3 s, 6 left.
    assert [line.split(" | loss")[0] for line in lines] == [
        "step 1/10 | elapsed 0:10 | ETA ?",
        "step 2/10 | elapsed 0:12 | ETA 0:16",
        "step 3/10 | elapsed 0:22 | ETA 0:14",
        "step 4/10 | elapsed 0:26 | ETA 0:18",
    ]


def test_long_runs_show_hours_and_only_every_nth_step(tmp_path):
    clock = itertools.count(0.0, 600.0)  # every step takes 10 minutes
    log, out = _log(tmp_path, clock, every=5, total=100)
    for step in range(1, 11):
        log.log(step_metrics(step, recompiles=0))
    lines = out.getvalue().strip().splitlines()
    assert [line.split(" | loss")[0] for line in lines] == [
        "step 1/100 | elapsed 10:00 | ETA ?",  # the first step includes setup: never in the mean
        "step 5/100 | elapsed 50:00 | ETA 15:50:00",
        "step 10/100 | elapsed 1:40:00 | ETA 15:00:00",
    ]
