"""Loader benchmark: samples/s of the grain loader on a synthetic dataset, and the scheduler hook's time.

    python -m dflop_jax.bench loader [--quick] [--json] [samples=N] [batch=B] [batches=K]
        [workers=0,2] [decode_workers=0,2] [solvers=greedy,auto] [tile_size=PX] [mix=llava-ov]
        [step_time=S]

Writes (or reuses) a synthetic dataset under `out`, then measures
  metadata: `Processor.shape` per record (headers + tokenization, no pixels), samples/s;
  loader: end-to-end `GlobalBatch`es per second with a consumer that does nothing (so the figure is the
    loader's own rate), per (grain worker processes, decode worker processes, scheduler solver): samples/s, scheduler hook time per
    global batch (mean, max), load+pack time per batch, padding ratios.
Problem: the demo model ("tiny" costs on "cpu"), encoder_dp = llm_dp = 2, `microbatches` per batch,
buckets from `default_buckets` of the dataset's shapes. With `step_time=S` each row also says whether
the loader outpaces a training step of S seconds (time per batch < S).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import get_args, get_type_hints

import numpy as np

from dflop_jax.bench._cli import command, load
from dflop_jax.config import require
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


def run(cfg: LoaderBenchConfig) -> dict:
    out = Path(cfg.out)
    mix_path = synth_dataset(
        out / f"synth_{cfg.mix}_{cfg.samples}_{cfg.tile_size}",
        cfg.samples,
        cfg.mix,
        seed=0,
        tile=cfg.tile_size,
    )
    data = DataConfig(
        source=str(mix_path), tile_size=cfg.tile_size, max_frames=cfg.max_frames, cache_dir=""
    )
    records = load_source(data)
    shapes, meta_rate = measure_metadata(data, records)
    buckets = default_buckets(shapes, cfg.microbatches, DP, DP, batch_size=cfg.batch, by_row=True)
    problem = model_problem("tiny", "cpu", buckets, (1, 2 * cfg.microbatches), DP, DP)
    rows = []
    combos = [(w, d) for w in cfg.workers for d in cfg.decode_workers if not (w and d)]
    for workers, decode in combos:
        for solver in cfg.solvers:
            row = measure_loader(
                data, records, problem, solver, workers, cfg.batch, cfg.batches, decode
            )
            if cfg.step_time:
                row["outpaces_step"] = row["batch_s"] < cfg.step_time
            rows.append(row)
    return {
        "dataset": {"mix": cfg.mix, "samples": len(records), "tile_px": cfg.tile_size},
        "global_batch": cfg.batch,
        "buckets": {"tiles": list(buckets.tiles), "lengths": list(buckets.lengths)},
        "metadata_samples_per_s": meta_rate,
        "step_time_s": cfg.step_time,
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


COMMAND = command(
    "loader",
    __doc__.split("\n")[0],
    "python -m dflop_jax.bench loader --quick",
    quick="at most 128 samples, batch 16, 4 batches; no worker processes, the greedy solver",
    json="print the report as JSON",
)


@dataclasses.dataclass(frozen=True)
class LoaderBenchConfig:
    """The synthetic dataset, the loader settings to sweep, and where the dataset goes.

    Attributes:
      samples: records in the synthetic dataset.
      mix: its sample mix, one of `dflop_jax.data.synth.MIXES`.
      batch: global batch size (records).
      batches: measured global batches per row.
      microbatches: microbatches per global batch.
      workers: grain worker-process counts (one row each).
      decode_workers: decode worker-process counts (one row each; rows with both non-zero are skipped).
      solvers: scheduler solvers (one row each).
      tile_size: tile px (56 = the demo model; 384 = SigLIP).
      max_frames: most video frames per sample.
      step_time: training step seconds to compare against (0 = none).
      out: folder for the synthetic dataset (reused when present).
    """

    samples: int = 512
    mix: str = "llava-ov"
    batch: int = 32
    batches: int = 10
    microbatches: int = 4
    workers: tuple[int, ...] = (0,)
    decode_workers: tuple[int, ...] = (0, 2)
    solvers: tuple[str, ...] = ("greedy", "auto")
    tile_size: int = 56
    max_frames: int = 32
    step_time: float = 0.0
    out: str = "runs/bench_loader"

    def __post_init__(self):
        from dflop_jax.data.synth import MIXES

        require(self.mix in MIXES, "mix", self.mix, f"choose from {', '.join(MIXES)}")
        for key in ("samples", "batch", "batches", "microbatches", "tile_size", "max_frames"):
            require(getattr(self, key) >= 1, key, getattr(self, key), "must be >= 1")
        for key in ("workers", "decode_workers"):
            value = getattr(self, key)
            require(bool(value) and min(value) >= 0, key, list(value), "give counts >= 0")
        solvers = get_args(get_type_hints(SchedulerConfig)["solver"])
        bad = [s for s in self.solvers if s not in solvers]
        require(bool(self.solvers) and not bad, "solvers", list(self.solvers),
                f"choose from {', '.join(solvers)}")  # fmt: skip
        require(self.step_time >= 0, "step_time", self.step_time, "must be >= 0")

    def quick(self) -> LoaderBenchConfig:
        """The `--quick` preset: a small dataset and one cheap row."""
        return dataclasses.replace(self, samples=min(self.samples, 128), batch=min(self.batch, 16),
                                   batches=min(self.batches, 4), solvers=("greedy",), workers=(0,),
                                   decode_workers=(0,))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    cfg, args = load(COMMAND, LoaderBenchConfig, argv)
    report = run(cfg.quick() if args.quick else cfg)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_report(report)
    return 0
