"""`python -m dflop_jax.bench loader` end to end on a tiny synthetic dataset, and its verdict against a
consumer that steps: a loader slower than the step keeps the trainer waiting; one that outpaces it
leaves (almost) no data wait, because prefetching prepares the next batch during the step."""

from __future__ import annotations

import time

from dflop_jax.bench import loader as bench


def _args(tmp_path, step_time: float) -> bench.LoaderBenchConfig:
    return bench.LoaderBenchConfig(
        out=str(tmp_path), mix="llava-ov", samples=24, batch=8, batches=2, microbatches=2,
        workers=(0,), decode_workers=(0,), solvers=("greedy",), tile_size=28, max_frames=4, step_time=step_time,
    )  # fmt: skip


def _waits(loader, step_s: float, batches: int) -> tuple[list[float], float]:
    """Per-batch data waits (the loader's own `data_wait_s`) of a consumer whose step takes `step_s`
    seconds, after a warm-up batch; and the consumer's elapsed time."""
    with loader:
        next(loader)
        start, waits = time.perf_counter(), []
        for _ in range(batches):
            time.sleep(step_s)
            waits.append(next(loader).stats.data_wait_s)
        return waits, time.perf_counter() - start


def test_loader_benchmark_verdict_matches_a_stepping_consumer(tmp_path, capsys, monkeypatch):
    made = []  # the bench's loader arguments, to build the same loader again below

    def recording(*args, **kwargs):
        made.append((args, kwargs))
        return real(*args, **kwargs)

    real = bench.make_loader
    monkeypatch.setattr(bench, "make_loader", recording)
    report = bench.run(_args(tmp_path, step_time=1e-6))
    (row,) = report["rows"]
    assert report["dataset"]["samples"] == 24
    # Nothing is skipped here, so every measured batch holds 8 samples.
    assert abs(row["samples_per_s"] * row["batch_s"] - 8) < 1e-6
    assert row["sched_ms_max"] >= row["sched_ms_mean"]
    assert row["microbatches_mean"] >= 1 and 0 <= row["llm_padding"] < 1
    assert row["outpaces_step"] is False  # no loader makes a batch in 1 us

    (args, kwargs) = made[0]
    # A consumer that does nothing (the benchmark's) waits on the loader for all of its time: the
    # benchmark's rate is the loader's own.
    waits, elapsed = _waits(real(*args, **kwargs), 0.0, 4)
    assert sum(waits) > 0.9 * elapsed
    # A step 5x the measured batch time: the verdict says the loader outpaces it, and the consumer
    # indeed finds each batch ready (prefetch 2: the next one is prepared during the step). Ready
    # means a queue pop (~0.2 ms against ~100 ms per batch here): on average well under a tenth of
    # the time the loader needs to make a batch.
    step = 5 * row["batch_s"]
    assert bench.run(_args(tmp_path, step_time=step))["rows"][0]["outpaces_step"] is True
    waits, _ = _waits(real(*args, **kwargs), step, 4)
    assert sum(waits) / len(waits) < 0.1 * row["batch_s"], (waits, row["batch_s"])

    bench.print_report(report)
    out = capsys.readouterr().out
    assert "samples/s" in out and "greedy" in out and f"{row['batch_s']:>7.3f}" in out
