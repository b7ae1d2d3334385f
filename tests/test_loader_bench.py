"""`python -m dflop_jax.bench loader` end to end on a tiny synthetic dataset."""

from __future__ import annotations

import argparse

from dflop_jax.bench import loader as bench


def test_loader_benchmark_reports_rates(tmp_path, capsys):
    args = argparse.Namespace(
        out=str(tmp_path), mix="llava-ov", samples=24, batch=8, batches=2, microbatches=2,
        workers=[0], solvers=["greedy"], tile_size=28, max_frames=4, step_time=1e6,
    )  # fmt: skip
    report = bench.run(args)
    (row,) = report["rows"]
    assert report["dataset"]["samples"] == 24 and report["metadata_samples_per_s"] > 0
    # Nothing is skipped here, so every measured batch holds 8 samples.
    assert abs(row["samples_per_s"] * row["batch_s"] - 8) < 1e-6
    assert row["sched_ms_mean"] > 0 and row["sched_ms_max"] >= row["sched_ms_mean"]
    assert row["microbatches_mean"] >= 1 and 0 <= row["llm_padding"] < 1
    assert row["outpaces_step"] is True
    bench.print_report(report)
    out = capsys.readouterr().out
    assert "samples/s" in out and "greedy" in out
