"""Loader benchmark: samples/s of the grain loader on a synthetic dataset, and the scheduler hook's time.

    python -m dflop_jax.bench loader [--quick] [--json] [--samples N] [--batch B] [--batches K]
        [--workers 0,2] [--decode-workers 0,2] [--solvers greedy,auto] [--tile-size PX] [--mix llava-ov]
        [--step-time S]

Writes (or reuses) a synthetic dataset under `--out`, then measures
  metadata: `Processor.shape` per record (headers + tokenization, no pixels), samples/s;
  loader: end-to-end `GlobalBatch`es per second with a consumer that does nothing (so the figure is the
    loader's own rate), per (grain worker processes, decode worker processes, scheduler solver): samples/s, scheduler hook time per
    global batch (mean, max), load+pack time per batch, padding ratios.
Problem: the demo model ("tiny" costs on "cpu"), encoder_dp = llm_dp = 2, `--microbatches` per batch,
buckets from `default_buckets` of the dataset's shapes. With `--step-time S` each row also says whether
the loader outpaces a training step of S seconds (time per batch < S).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from dflop_jax.data.config import DataConfig
from dflop_jax.data.dataset import load_source
from dflop_jax.data.loader import make_loader
from dflop_jax.data.process import Processor
from dflop_jax.data.synth import synth_dataset
from dflop_jax.scheduler import Scheduler, SchedulerConfig, default_buckets
from dflop_jax.scheduler.model_problem import model_problem

DP = 2


def measure_metadata(cfg: DataConfig, records: list) -> tuple[list, float]:
    """(shapes, samples/s) of `Processor.shape` over all records."""
    proc = Processor(cfg)
    start = time.perf_counter()
    shapes = [proc.shape(r) for r in records]
    return shapes, len(records) / (time.perf_counter() - start)


def measure_loader(
    cfg,
    records,
    problem,
    solver: str,
    workers: int,
    batch: int,
    batches: int,
    decode_workers: int = 0,
) -> dict:
    """One row: the loader's rate over `batches` global batches after a first (warm-up) batch."""
    sched = Scheduler(problem, SchedulerConfig(solver=solver, correction="off"))
    start = time.perf_counter()
    with make_loader(
        cfg,
        records,
        problem,
        sched.schedule,
        global_batch_size=batch,
        seed=0,
        num_workers=workers,
        decode_workers=decode_workers,
        prefetch=2,
    ) as loader:
        next(loader)
        first_s = time.perf_counter() - start
        start = time.perf_counter()
        batches_got = [next(loader) for _ in range(batches)]
        elapsed = time.perf_counter() - start
    got = [b.stats for b in batches_got]
    n_samples = sum(s.num_samples for s in got)
    lat = np.array([s.scheduler_latency_s for s in got])
    return {
        "workers": workers,
        "decode_workers": decode_workers,
        "solver": solver,
        "batches": batches,
        "samples_per_s": n_samples / elapsed,
        "host_bytes_per_sample": sum(map(batch_bytes, batches_got)) / max(n_samples, 1),
        "batch_s": elapsed / batches,
        "first_batch_s": first_s,
        "sched_ms_mean": 1e3 * float(lat.mean()),
        "sched_ms_max": 1e3 * float(lat.max()),
        "load_pack_ms_mean": 1e3 * float(np.mean([s.load_s for s in got])),
        "microbatches_mean": float(np.mean([s.num_microbatches for s in got])),
        "llm_padding": float(np.mean([s.llm_padding_ratio for s in got])),
        "encoder_padding": float(np.mean([s.encoder_padding_ratio for s in got])),
    }


def batch_bytes(batch) -> int:
    """Bytes of every array the global batch sends to the devices (the packed microbatches)."""
    return sum(
        a.nbytes
        for mb in batch.microbatches
        for a in dataclasses.asdict(mb).values()
        if a is not None
    )


def run(args) -> dict:
    out = Path(args.out)
    mix_path = synth_dataset(
        out / f"synth_{args.mix}_{args.samples}_{args.tile_size}",
        args.samples,
        args.mix,
        seed=0,
        tile=args.tile_size,
    )
    cfg = DataConfig(
        source=str(mix_path), tile_size=args.tile_size, max_frames=args.max_frames, cache_dir=""
    )
    records = load_source(cfg)
    shapes, meta_rate = measure_metadata(cfg, records)
    buckets = default_buckets(shapes, args.microbatches, DP, DP, batch_size=args.batch)
    problem = model_problem("tiny", "cpu", buckets, (1, 2 * args.microbatches), DP, DP)
    rows = []
    combos = [(w, d) for w in args.workers for d in args.decode_workers if not (w and d)]
    for workers, decode in combos:
        for solver in args.solvers:
            row = measure_loader(
                cfg, records, problem, solver, workers, args.batch, args.batches, decode
            )
            if args.step_time:
                row["outpaces_step"] = row["batch_s"] < args.step_time
            rows.append(row)
    return {
        "dataset": {"mix": args.mix, "samples": len(records), "tile_px": args.tile_size},
        "global_batch": args.batch,
        "buckets": {"tiles": list(buckets.tiles), "lengths": list(buckets.lengths)},
        "metadata_samples_per_s": meta_rate,
        "step_time_s": args.step_time,
        "rows": rows,
    }


def print_report(report: dict) -> None:
    d = report["dataset"]
    print(
        f"loader benchmark: {d['samples']} synthetic {d['mix']} samples, {d['tile_px']} px tiles, "
        f"global batch {report['global_batch']}, buckets {report['buckets']}"
    )
    print(f"metadata (Processor.shape): {report['metadata_samples_per_s']:.0f} samples/s")
    head = (
        "workers decode solver  samples/s  MiB/sample  batch_s  sched_ms(mean/max)  load+pack_ms  mbs  "
        "pad_llm pad_enc"
    )
    print(head + ("  < step?" if report["step_time_s"] else ""))
    for r in report["rows"]:
        line = (
            f"{r['workers']:>7} {r['decode_workers']:>6} {r['solver']:<7} {r['samples_per_s']:>9.1f}  "
            f"{r['host_bytes_per_sample'] / 2**20:>10.2f}  {r['batch_s']:>7.3f}  "
            f"{r['sched_ms_mean']:>8.1f}/{r['sched_ms_max']:<8.1f}  {r['load_pack_ms_mean']:>12.1f}  "
            f"{r['microbatches_mean']:>3.1f}  {r['llm_padding']:>7.3f} {r['encoder_padding']:>7.3f}"
        )
        if "outpaces_step" in r:
            line += f"  {'yes' if r['outpaces_step'] else 'NO'}"
        print(line)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dflop_jax.bench loader", description=__doc__.split("\n")[0]
    )
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--mix", default="llava-ov")
    p.add_argument("--batch", type=int, default=32, help="global batch size (records)")
    p.add_argument("--batches", type=int, default=10, help="measured global batches per row")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--workers", default="0", help="comma-separated grain worker-process counts")
    p.add_argument(
        "--decode-workers", default="0,2", help="comma-separated decode worker-process counts"
    )
    p.add_argument("--solvers", default="greedy,auto", help="comma-separated scheduler solvers")
    p.add_argument(
        "--tile-size", type=int, default=56, help="tile px (56 = the demo model; 384 = SigLIP)"
    )
    p.add_argument("--max-frames", type=int, default=32)
    p.add_argument(
        "--step-time", type=float, default=0.0, help="training step seconds to compare against"
    )
    p.add_argument("--out", default="runs/bench_loader")
    p.add_argument(
        "--quick", action="store_true", help="128 samples, batch 16, 4 batches, workers 0, greedy"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    args.workers = [int(w) for w in args.workers.split(",")]
    args.decode_workers = [int(w) for w in args.decode_workers.split(",")]
    args.solvers = args.solvers.split(",")
    if args.quick:
        args.samples, args.batch, args.batches, args.solvers = 128, 16, 4, ["greedy"]
        args.workers, args.decode_workers = [0], [0]
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_report(report)
    return 0
