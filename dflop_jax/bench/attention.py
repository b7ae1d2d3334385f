"""Attention benchmark: XLA-path time and FLOPs of a packed row vs one sample, before/after tile skipping.

    python -m dflop_jax.bench attention [length=4096] [samples=16] [heads=2] [kv_heads=1]
        [head_dim=32] [repeats=3] [causal=false] [--json]

One row of `length` tokens, either `samples` packed samples of equal length or one sample
filling the row. "before" is the pre-skipping long-row path (`dense_attention` in 512-query blocks:
every S x S pair, masked); "after" is `models.attention.attention` (tiles the mask removes are
skipped). Per case: median wall time of a jitted forward + backward (`jax.grad` of a weighted sum
w.r.t. q, k, v) over `repeats` runs (more for fast cases, up to 1 s) after one warm-up, `compiled.cost_analysis()["flops"]`, the
tiles the plan visits, and the analytic FLOPs of the visited pairs (4 S_q S_k H Dh forward,
2.5x that forward + backward). XLA's cost analysis counts a loop body once (not times its trip
count) and a conditional as its larger branch (probed at start-up and printed), so for both paths
it reports one block's cost, not the row's: time and the analytic count are the real measures.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflop_jax.bench._cli import command, load
from dflop_jax.config import require
from models.attention import attention, block_plan, block_size, dense_attention

COMMAND = command(
    "attention",
    __doc__.split("\n")[0],
    "python -m dflop_jax.bench attention length=256 samples=4 repeats=1",
    json="print the report as JSON",
)


@dataclasses.dataclass(frozen=True)
class AttentionBenchConfig:
    """One packed row of attention to time.

    Attributes:
      length: tokens in the row.
      samples: packed samples of equal length in the row (also timed: one sample filling it).
      heads: query heads.
      kv_heads: key/value heads (grouped-query attention; divides heads).
      head_dim: channels per head.
      repeats: timed runs per case (more for fast cases, up to 1 s).
      causal: causal attention within each sample.
    """

    length: int = 4096
    samples: int = 16
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 32
    repeats: int = 3
    causal: bool = True

    def __post_init__(self):
        require(self.length >= 1, "length", self.length, "must be >= 1")
        require(
            1 <= self.samples <= self.length, "samples", self.samples, "need 1 <= samples <= length"
        )
        require(self.kv_heads >= 1 and self.heads % self.kv_heads == 0, "kv_heads", self.kv_heads,
                "must be >= 1 and divide heads")  # fmt: skip
        require(self.head_dim >= 1, "head_dim", self.head_dim, "must be >= 1")
        require(self.repeats >= 1, "repeats", self.repeats, "must be >= 1")


BEFORE_QUERY_BLOCK = 512  # the query block of the replaced long-row path
MIN_SECONDS = 1.0  # fast cases repeat past --repeats until this much time is sampled


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", float("nan")))


def probe_cost_analysis() -> dict:
    """How XLA's cost analysis counts control flow: a 256^2 matmul inside loops and conditionals."""
    x = jnp.ones((256, 256), jnp.float32)

    def flops(f, *args):
        return _flops(jax.jit(f).lower(*args).compile())

    mm = flops(lambda x: x @ x, x)
    loop = flops(lambda x: jax.lax.fori_loop(0, 8, lambda i, y: y @ x, x), x)
    both = flops(lambda x, p: jax.lax.cond(p, lambda y: y @ y, lambda y: (y @ y) @ y, x), x, True)
    return {"loop_of_8_matmuls": loop / mm, "cond_1_or_2_matmuls": both / mm}


def segments(length: int, samples: int) -> np.ndarray:
    """[1, length] ids 1..samples of equal contiguous samples (the last one takes the remainder)."""
    ids = np.minimum(np.arange(length) // (length // samples), samples - 1) + 1
    return ids[None].astype(np.int32)


def measure(fn, args, repeats: int) -> dict:
    """Median wall and process-CPU seconds (all threads: less sensitive to other processes' load)
    of jitted forward + backward, and the compiled program's cost-analysis FLOPs."""
    q, k, v, w = args

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v) * w)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    compiled = step.lower(q, k, v).compile()
    jax.block_until_ready(compiled(q, k, v))
    times, cpu = [], []
    while len(times) < repeats or (sum(times) < MIN_SECONDS and len(times) < 50):
        start, start_cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(compiled(q, k, v))
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {
        "time_s": statistics.median(times),
        "cpu_s": statistics.median(cpu),
        "cost_flops": _flops(compiled),
    }


def run_case(cfg: AttentionBenchConfig, samples: int) -> dict:
    """Before/after figures for one row layout."""
    s, h, kv, dh, causal = cfg.length, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.causal
    rng = np.random.default_rng(0)
    q, w = (jnp.asarray(rng.standard_normal((1, s, h, dh)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((1, s, kv, dh)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(segments(s, samples))
    block = block_size(s)
    plan = np.asarray(block_plan(seg, block, causal)) if s % block == 0 else None
    qb = BEFORE_QUERY_BLOCK if s % BEFORE_QUERY_BLOCK == 0 else None
    before = measure(
        lambda q, k, v: dense_attention(q, k, v, seg, causal, qb), (q, k, v, w), cfg.repeats
    )
    after = measure(
        lambda q, k, v: attention(q, k, v, segment_ids=seg, causal=causal),
        (q, k, v, w),
        cfg.repeats,
    )
    pair_flops = 2.5 * 4 * h * dh  # forward + backward per (query, key) pair
    visited = int(plan.sum()) if plan is not None else None
    return {
        "samples": samples,
        "block": block,
        "tiles_visited": visited,
        "tiles_total": (s // block) ** 2,
        "before": before | {"analytic_flops": pair_flops * s * s},
        "after": after
        | {"analytic_flops": pair_flops * visited * block * block if visited else float("nan")},
    }


def _print_table(report: dict) -> None:
    print(
        f"attention, XLA path, one row of {report['length']} tokens, H={report['heads']} "
        f"K={report['kv_heads']} Dh={report['head_dim']}, causal={report['causal']}, "
        f"forward+backward, median of >= {report['repeats']} runs"
    )
    print(
        "| row | tiles visited | wall s before | after | before/after | CPU s before | after "
        "| before/after | analytic GFLOP before | after | cost_analysis GFLOP before | after |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in report["cases"]:
        b, a = c["before"], c["after"]
        print(
            f"| {c['samples']} sample(s) | {c['tiles_visited']}/{c['tiles_total']} of {c['block']} "
            f"| {b['time_s']:.3f} | {a['time_s']:.3f} | {b['time_s'] / a['time_s']:.1f}x "
            f"| {b['cpu_s']:.3f} | {a['cpu_s']:.3f} | {b['cpu_s'] / a['cpu_s']:.1f}x "
            f"| {b['analytic_flops'] / 1e9:.2f} | {a['analytic_flops'] / 1e9:.2f} "
            f"| {b['cost_flops'] / 1e9:.3f} | {a['cost_flops'] / 1e9:.3f} |"
        )
    p = report["cost_analysis_probe"]
    print(
        f"cost_analysis counts a fori_loop of 8 matmuls as {p['loop_of_8_matmuls']:g} matmul(s) and "
        f"cond(1 matmul | 2 matmuls) as {p['cond_1_or_2_matmuls']:g}: loop bodies once, a "
        "conditional as its larger branch, so its figure is per block; time is the real measure"
    )
    print(f"load average {report['load'][0]:.1f} {report['load'][1]:.1f} on {os.cpu_count()} CPUs")


def main(argv: list[str] | None = None) -> int:
    cfg, args = load(COMMAND, AttentionBenchConfig, argv)
    report = {
        "length": cfg.length,
        "heads": cfg.heads,
        "kv_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "causal": cfg.causal,
        "repeats": cfg.repeats,
        "cost_analysis_probe": probe_cost_analysis(),
        "cases": [run_case(cfg, n) for n in sorted({cfg.samples, 1}, reverse=True)],
        "load": os.getloadavg(),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return 0
