"""Is the colocated stage the sum the cost provider composes?

    python -m dflop_jax.bench colocated [rounds=3] [runs=5] [statistic=median|min] [json_out=out.json]

A colocated encoder runs inside LLM stage 0's program (`models.mllm.ColocatedStage`). The profiler
times that program with no LLM layer (table kind colocated_embedding), and the measured cost
provider scores the stage as that entry's encoder share plus the LLM stage's own parts
(`costs/measured.py`): share(T) = F_0(T, L0) - G_0(L0), stage = share(T) + G_n(S). This benchmark
times, on 8 simulated CPU devices with the tiny arch, the runtime's own programs (the profiler's
builder, `profiling.programs.stage_program`, which lowers to what the trainer runs):

    F_n(T, S)  the colocated stage with n LLM layers at T tiles and S tokens (what trains)
    F_0(T, S)  the same with no LLM layer (what the colocated_embedding entry times)
    G_n(S)     LLM stage 0 without the encoder (T tiles' features handed in), G_0(S) its embedding

and reports, per (tp, T, S), F_n against F_0 - G_0 + G_n at the same S ("composed", the additivity
assumption) and against share(T) at the smallest S plus G_n(S) ("provider", the row length the
provider takes the share at). Every program is timed in `rounds` interleaved rounds (median of `runs`
calls each, or their minimum with `statistic=min`); the spread of the rounds is the timing noise
the differences are compared with.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Literal

import numpy as np

from dflop_jax.bench._cli import command, load
from dflop_jax.config import require

TPS = (1, 2)
TILES = (2, 8)
LENGTHS = (128, 512)  # LENGTHS[0] plays the profiler's smallest LLM bucket (the share's row)
LAYERS = 2

COMMAND = command(
    "colocated",
    __doc__.split("\n\n")[0],
    "python -m dflop_jax.bench colocated rounds=1 runs=1",
)


@dataclasses.dataclass(frozen=True)
class ColocatedBenchConfig:
    """How each program is timed and where the rows go.

    Attributes:
      rounds: interleaved timing rounds per program (their spread is the timing noise).
      runs: timed calls per round.
      statistic: "median" or "min" of a round's calls.
      json_out: also write the rows as JSON here ("" = none).
    """

    rounds: int = 3
    runs: int = 5
    statistic: Literal["median", "min"] = "median"
    json_out: str = ""

    def __post_init__(self):
        require(self.rounds >= 1, "rounds", self.rounds, "must be >= 1")
        require(self.runs >= 1, "runs", self.runs, "must be >= 1")


def _programs(model_cfg, devices, dtype):
    """{(name, tp, T, S): PartProgram} of the four program families (module docstring)."""
    from dflop_jax.contracts.layout import StageSpec
    from dflop_jax.profiling.programs import profile_mesh, stage_program

    out = {}
    for tp in (t for t in TPS if t <= len(devices)):  # one GPU: tp 1 only
        mesh = profile_mesh(devices, tp)
        for n, fam in ((LAYERS, "F_n"), (0, "F_0")):
            spec = StageSpec("llm", 0, n, tp=tp, has_embedding=True)
            for t in TILES:
                for s in LENGTHS:
                    out[fam, tp, t, s] = stage_program(model_cfg, spec, mesh, s, dtype,
                                                       tile_bucket=t)  # fmt: skip
        for n, fam in ((LAYERS, "G_n"), (0, "G_0")):
            spec = StageSpec("llm", 0, n, tp=tp, has_embedding=True)
            for t in TILES:  # the features of the colocated stage's T tiles, handed in
                for s in LENGTHS:
                    out[fam, tp, t, s] = stage_program(model_cfg, spec, mesh, s, dtype, t)
    return out


def _runner(prog, seed: int):
    """(fwd(), bwd()) closures over compiled programs and real inputs (the accumulator fed back)."""
    import jax

    with jax.set_mesh(prog.mesh):
        fwd_c = prog.fwd.lower(prog.params_abs, prog.x_abs, prog.side_abs).compile()
        bwd_c = prog.bwd.lower(
            prog.params_abs, prog.x_abs, prog.side_abs, prog.seed_abs, prog.gacc_abs
        ).compile()
    rng = np.random.default_rng(seed)
    params = prog.make_params(rng)
    x, side, gy = prog.make_inputs(rng)
    gacc = [jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype), a.sharding),
                         prog.gacc_abs)]  # fmt: skip

    def bwd():
        out = bwd_c(params, x, side, gy, gacc[0])
        gacc[0] = out[-1]  # donated
        return out

    return (lambda: fwd_c(params, x, side)), bwd


def measure(rounds: int, runs: int, statistic: str = "median") -> dict:
    """Per program key, [rounds, 2] (fwd, bwd) times, rounds interleaved over all programs (the
    minimum `statistic` is the one to read on a contended host: other processes only add time)."""
    import jax
    import jax.numpy as jnp

    from dflop_jax.profiling.model_profiler import time_call
    from dflop_jax.programs.model_section import model_config_for_arch

    model_cfg = model_config_for_arch("tiny")
    progs = _programs(model_cfg, jax.devices(), jnp.dtype(jnp.float32))
    runners = {k: _runner(p, i) for i, (k, p) in enumerate(progs.items())}
    times = {k: np.zeros((rounds, 2)) for k in runners}
    for r in range(rounds):
        for k, (fwd, bwd) in runners.items():
            with jax.set_mesh(progs[k].mesh):
                times[k][r] = time_call(fwd, 1, runs, statistic), time_call(bwd, 1, runs, statistic)
    return times


def compare(times: dict) -> list[dict]:
    """Rows per (tp, T, S): F_n, composed, provider (seconds, fwd + bwd, median over rounds), their
    relative differences, and the rounds' noise (max relative spread of the programs involved)."""
    med = {k: np.median(v.sum(axis=1)) for k, v in times.items()}
    spread = {k: (v.sum(axis=1).max() - v.sum(axis=1).min()) / med[k] for k, v in times.items()}
    rows = []
    s0 = LENGTHS[0]
    for tp in sorted({k[1] for k in times}):
        for t in TILES:
            for s in LENGTHS:
                colocated = med["F_n", tp, t, s]
                composed = med["F_0", tp, t, s] - med["G_0", tp, t, s] + med["G_n", tp, t, s]
                provider = med["F_0", tp, t, s0] - med["G_0", tp, t, s0] + med["G_n", tp, t, s]
                keys = [(f, tp, t, x) for f in ("F_n", "F_0", "G_0", "G_n") for x in {s, s0}]
                rows.append(dict(tp=tp, tiles=t, length=s, colocated_s=colocated, composed_s=composed,
                                 provider_s=provider, composed_err=composed / colocated - 1,
                                 provider_err=provider / colocated - 1,
                                 noise=max(spread[k] for k in keys)))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    cfg, _ = load(COMMAND, ColocatedBenchConfig, argv)
    from dflop_jax.host_devices import simulate_cpu_devices

    simulate_cpu_devices(8)  # before jax starts its backend
    rows = compare(measure(cfg.rounds, cfg.runs, cfg.statistic))
    print(f"{'tp':>2} {'T':>2} {'S':>4} {'coloc ms':>9} {'composed':>9} {'err':>7} "
          f"{'provider':>9} {'err':>7} {'noise':>6}")  # fmt: skip
    for r in rows:
        print(f"{r['tp']:>2} {r['tiles']:>2} {r['length']:>4} {1e3 * r['colocated_s']:9.2f} "
              f"{1e3 * r['composed_s']:9.2f} {r['composed_err']:+7.1%} "
              f"{1e3 * r['provider_s']:9.2f} {r['provider_err']:+7.1%} {r['noise']:6.1%}")  # fmt: skip
    if cfg.json_out:
        Path(cfg.json_out).write_text(json.dumps(rows, indent=1))
    return 0
