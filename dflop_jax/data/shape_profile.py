"""Data profiler: the (tiles, tokens, modality, audio) distribution of a dataset sample, from metadata only.

    python -m dflop_jax.profile data --config configs/data_internvl_stats.yaml profile.data_samples=2000

Writes `<out>/shape_distribution.json` (the shared shape-distribution format the planner reads),
`<out>/shape_histogram.png`, and prints percentiles per modality, means per source, skipped records by
reason, and (once, not per record) how many records carried keys the data layer ignores.
Image sizes come from the encoded headers (files or the bytes parquet/tar shards embed; no pixel is
decoded); shapes are cached per dataset file or shard, and shards are profiled in parallel processes.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np

from dflop_jax.contracts import SampleShape
from dflop_jax.contracts.shape_distribution import save_shape_distribution
from dflop_jax.data.audio import encoder_outputs
from dflop_jax.data.bad_sample import BadSample
from dflop_jax.data.config import DataConfig
from dflop_jax.data.dataset import load_source
from dflop_jax.data.metadata import MetadataCache
from dflop_jax.data.process import Processor
from dflop_jax.data.shards import group_key, take

log = logging.getLogger(__name__)
# progress(phase, done, total): how the profile reports its records (`planner.progress.progress_bar`)
ProgressFn = Callable[[str, int, int], None]
PHASE = "data profile"
PERCENTILES = (50, 90, 99)
MAX_PROFILE_WORKERS = 8  # shard groups profiled at once (header reads and tokenizing: CPU-bound)
RECORDS_PER_WORKER = 1000  # fewer records per worker than this: starting a process costs more


def profile_data(
    cfg: DataConfig,
    num_samples: int = 10000,
    seed: int = 0,
    out_dir: str | Path = "runs/profile",
    progress: ProgressFn | None = None,
) -> Path:
    """Profiles up to `num_samples` records (seeded draw), reporting `progress("data profile", done,
    total)` as records are read; returns the shape-distribution file's path."""
    records = load_source(cfg, seed)
    if len(records) > num_samples:
        keep = np.sort(np.random.default_rng(seed).choice(len(records), num_samples, replace=False))
        records = take(records, keep.tolist())
    results, names, extra, hits = profile_records(cfg, records, progress)
    shapes, sources, bad = [], [], Counter()
    for name, res in zip(names, results):
        if isinstance(res, BadSample):
            bad[res.reason] += 1
            log.warning("skipping %s", res)
            continue
        shapes.append(res)
        sources.append(name)
    if not shapes:
        raise ValueError(
            f"data.source={cfg.source!r}: no usable sample among {len(records)} ({dict(bad)})"
        )
    summary = summarize(shapes, sources)
    summary.update(
        bad=dict(bad), records=len(records), cache_hits=hits, cache_misses=len(records) - hits
    )
    summary["extra_keys"] = {**extra, "ignored": not cfg.strict}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "shape_distribution.json"
    save_shape_distribution(shapes, path, str(cfg.source), summary)
    plot_histogram(shapes, out / "shape_histogram.png")
    print_summary(summary)
    return path


def profile_records(
    cfg: DataConfig, records: Sequence[dict], progress: ProgressFn | None = None
) -> tuple[list, list, dict, int]:
    """(shape or BadSample per record, source name per record, extra keys: {"records": how many
    carry keys the data layer ignores, "keys": {key: records carrying it}}, cache hits).

    One pass over the records, through the shape-metadata cache. Lazy (sharded) sources run one
    process per shard group, up to the CPUs; a list (JSON) runs here (its records would have to be
    shipped to the workers)."""
    groups: dict = defaultdict(list)
    if not isinstance(records, list):
        for i in range(len(records)):
            groups[group_key(records, i)].append(i)
    workers = profile_workers(len(groups), len(records))
    report = progress or (lambda *_: None)
    if workers <= 1:
        return _profile_part(cfg, records, report)
    parts = [take(records, idx) for idx in groups.values()]
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold JAX threads
    done, read = [None] * len(parts), 0
    report(PHASE, 0, len(records))
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        futures = {pool.submit(_profile_part, cfg, part): k for k, part in enumerate(parts)}
        for future in as_completed(futures):  # progress per shard group as workers finish
            k = futures[future]
            done[k] = future.result()
            read += len(parts[k])
            report(PHASE, read, len(records))
    results, names, hits = [None] * len(records), [None] * len(records), 0
    keys: Counter[str] = Counter()
    carrying = 0
    for idx, (res, nm, extra, h) in zip(groups.values(), done):
        for j, i in enumerate(idx):
            results[i], names[i] = res[j], nm[j]
        keys.update(extra["keys"])
        carrying += extra["records"]
        hits += h
    return results, names, {"records": carrying, "keys": dict(sorted(keys.items()))}, hits


def profile_workers(num_groups: int, num_records: int) -> int:
    """Processes profiling shard groups: one per group, at most CPUs - 1 (the parent only waits; a
    2-CPU host profiles in-process), and only with `RECORDS_PER_WORKER` records each (a spawned
    worker first spends seconds importing the data layer)."""
    cpus = (os.cpu_count() or 1) - 1
    return min(num_groups, cpus, MAX_PROFILE_WORKERS, num_records // RECORDS_PER_WORKER)


def _profile_part(
    cfg: DataConfig, records: Sequence[dict], progress: ProgressFn | None = None
) -> tuple[list, list, dict, int]:
    processor = Processor(cfg)
    names: list[str] = [""] * len(records)
    keys: Counter[str] = Counter()
    carrying, seen = 0, 0

    def visit(i: int, record: dict) -> None:
        nonlocal carrying, seen
        seen += 1
        if progress is not None:
            progress(PHASE, seen, len(records))
        names[i] = _source_name(record)
        extra = processor.extra_keys(record) if isinstance(record, dict) else ()
        carrying += bool(extra)
        keys.update(extra)

    cache = MetadataCache(cfg.cache_dir, processor)
    results = cache.shapes(records, visit)
    extra = {"records": carrying, "keys": dict(sorted(keys.items()))}
    return results, names, extra, cache.hits


def extra_keys_line(extra: dict) -> str:
    """One report line, e.g. "12,345 records carried extra keys: metadata, source (ignored)"."""
    verdict = "ignored" if extra["ignored"] else "rejected: data.strict"
    return (
        f"{extra['records']:,} records carried extra keys: {', '.join(extra['keys'])} ({verdict})"
    )


def _source_name(record: dict) -> str:
    if not isinstance(record, dict):
        return "-"
    if "data_source" in record:
        return str(record["data_source"])
    return Path(record["_file"]).stem if "_file" in record else "-"


def _stats(values: np.ndarray) -> dict:
    top = values.max()
    out = {
        "mean": float(values.mean()),
        "max": float(top) if values.dtype.kind == "f" else int(top),
    }
    out.update({f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES})
    return out


def audio_tokens(shape: SampleShape) -> int:
    """The sample's audio placeholder tokens (one per encoder output of its windows)."""
    return sum(encoder_outputs(v) for v in shape.audio_windows)


def summarize(shapes: list[SampleShape], sources: list[str]) -> dict:
    """{"all"|modality: {count, tiles: stats, tokens: stats[, audio_seconds, audio_tokens: stats over
    the samples with audio]}, "by_source": {name: {count, tiles_mean, tokens_mean}}}."""
    groups: dict[str, list[SampleShape]] = defaultdict(list)
    for s in shapes:
        groups[s.modality].append(s)
    summary = {}
    for name, group in [("all", shapes), *sorted(groups.items())]:
        tiles = np.array([s.tiles for s in group])
        tokens = np.array([s.tokens for s in group])
        summary[name] = {"count": len(group), "tiles": _stats(tiles), "tokens": _stats(tokens)}
        heard = [s for s in group if s.audio_windows]
        if heard:
            summary[name]["audio_seconds"] = _stats(np.array([s.audio_seconds for s in heard]))
            summary[name]["audio_tokens"] = _stats(np.array([audio_tokens(s) for s in heard]))
    by_source: dict[str, list[SampleShape]] = defaultdict(list)
    for s, src in zip(shapes, sources):
        by_source[src].append(s)
    summary["by_source"] = {
        src: {
            "count": len(g),
            "tiles_mean": float(np.mean([s.tiles for s in g])),
            "tokens_mean": float(np.mean([s.tokens for s in g])),
        }
        for src, g in sorted(by_source.items())
    }
    return summary


def print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Data shape distribution (tiles / LLM tokens per sample)")
    for col in (
        "group",
        "n",
        "tiles mean",
        "tiles p50/p90/p99/max",
        "tokens mean",
        "tokens p50/p90/p99/max",
    ):
        table.add_column(col, justify="right")
    rows = [(k, v) for k, v in summary.items() if isinstance(v, dict) and "tiles" in v]
    for name, v in rows:
        t, k = v["tiles"], v["tokens"]
        table.add_row(
            name, str(v["count"]), f"{t['mean']:.2f}", _pcts(t), f"{k['mean']:.0f}", _pcts(k),
        )  # fmt: skip
    for src, v in summary["by_source"].items():
        table.add_row(
            f"source {src}",
            str(v["count"]),
            f"{v['tiles_mean']:.2f}",
            "",
            f"{v['tokens_mean']:.0f}",
            "",
        )
    console = Console(width=max(130, Console().width))  # piped output defaults to 80 columns
    console.print(table)
    heard = [(k, v) for k, v in rows if "audio_seconds" in v]
    if heard:
        audio = Table(title="Audio (per sample with audio)")
        for col in ("group", "seconds mean", "seconds p50/p90/p99/max", "tokens mean",
                    "tokens p50/p90/p99/max"):  # fmt: skip
            audio.add_column(col, justify="right")
        for name, v in heard:
            s, k = v["audio_seconds"], v["audio_tokens"]
            audio.add_row(name, f"{s['mean']:.1f}", _pcts(s), f"{k['mean']:.0f}", _pcts(k))
        console.print(audio)
    if summary.get("extra_keys", {}).get("records"):
        console.print(extra_keys_line(summary["extra_keys"]))
    if summary.get("bad"):
        console.print(f"skipped records by reason: {summary['bad']}")


def _pcts(s: dict) -> str:
    return "/".join(f"{s[f'p{p}']:.0f}" for p in PERCENTILES) + f"/{s['max']:.0f}"


def plot_histogram(shapes: list[SampleShape], path: Path) -> None:
    """Two panels: LLM tokens and encoder tiles per sample, stacked by modality."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modalities = sorted({s.modality for s in shapes})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, field, bins in (
        (axes[0], "tokens", 40),
        (axes[1], "tiles", max(2, max(s.tiles for s in shapes) + 1)),
    ):
        data = [[getattr(s, field) for s in shapes if s.modality == m] for m in modalities]
        ax.hist(data, bins=bins, stacked=True, label=modalities)
        ax.set_xlabel(f"{field} per sample")
        ax.set_ylabel("samples")
    axes[0].legend()
    fig.suptitle(f"{len(shapes)} samples")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
