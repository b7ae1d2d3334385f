"""Multi-process training on this machine: the same run at 1, 2 and 4 processes, each process's share.

    python -m dflop_jax.bench multihost [processes=1,2,4] [steps=4] [out=runs/bench_multihost]
                                        [second_run=true] [train_overrides=[key=value,...]]

Every run uses 8 CPU devices in all (8 / processes per process) and the same explicit layout (default
`TINY_LLAVA_OV`: one encoder stage at tp 2, two LLM stages at dp 3, so the encoder's dp differs from the
LLM's and the first LLM stage spans processes at 2 and 4 processes). Each process is a real
`jax.distributed` process on 127.0.0.1 (`worker`, launched like `scripts/run_training.sh`) and reports:
  xla_compiles      executables built on this process (`jax.monitoring` compile events), and those
                    inside training steps (stage programs, transfers, updates: the per-process share;
                    the rest is model building, which is whole-model on every process for now),
                    and the stage programs among them; `xla_compiled`: how many per program name,
                    `xla_compile_s`: their seconds
  stage_compiles    stage programs compiled, per stage (0 for stages without devices here)
  cache_hits        executables loaded from the run's compilation cache: JAX's (also counted in
                    xla_compiles) and, on a process other than 0, the programs of its executable
                    store (not counted there: no jax event fires)
  decoded           samples this process decoded (only those its local shards need), [id, tiles]
  rss_mib           peak resident host memory
  transfer_mib      bytes moved between stages per step (every transfer of the step, all processes)
  step_s            host time issuing a step (data wait, dispatch), after the first (compiling) one
With `second_run=true` each process count runs twice with one compilation cache: the second run's
rows show what a second run of the same plan still compiles, process by process.
The losses of every process count are printed side by side: they must agree (to float32 round-off).
On CPU the simulated devices share the host's cores, so time per step says how much extra work the
processes do (dispatch, gloo transfers), not how a cluster would scale.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

from dflop_jax.bench._cli import command, load
from dflop_jax.config import require
from dflop_jax.host_devices import own_devices_env

DEVICES = 8
TINY_LLAVA_OV = [
    "plan=explicit",
    "model.kind=llava_ov",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.head_dim=8",
    "model.vision_hidden_size=16",
    "model.vision_intermediate_size=32",
    "model.vision_num_layers=2",
    "model.vision_num_heads=2",
    "data.synth_mix=llava-ov",
    "data.synth_samples=32",
    "data.tile_size=56",
    "data.patch_size=14",
    "data.max_grid=2",
    "data.max_frames=4",
    "data.max_tokens=512",
    "data.cache_dir=",
    "layout.encoder_layers=[2]",
    "layout.encoder_tp=[2]",
    "layout.encoder_dp=1",
    "layout.llm_layers=[1, 1]",
    "layout.llm_tp=[1]",
    "layout.llm_dp=3",
    "layout.tiles=[8, 16]",
    "layout.lengths=[512]",
    "layout.microbatches=[1, 4]",
    "scheduler.solver=greedy",
    "global_batch=6",
    "optimizer.lr=0.01",
    "optimizer.warmup_steps=1",
    "compute_dtype=float32",
    "measure_stage_times_every=0",
    "compilation_cache=",
    "checkpoint.every=0",
    "device.peak_flops=1000000000.0",
    "distributed.timeout_s=60",
]
# InternVL on the same layout (its pixel-shuffled tiles, plain feature gather).
TINY_INTERNVL = [
    *(a for a in TINY_LLAVA_OV if not a.startswith("model.kind")),
    "model.kind=internvl",
    "data.model_family=internvl",
    "data.max_tiles=4",
]


# The stage programs' jitted functions (`programs.stage_jits.stage_jits`), as XLA names them.
STAGE_PROGRAMS = ("jit(apply)", "jit(bwd)", "jit(last)", "jit(fwd_res)", "jit(bwd_res)")


def launch(
    processes: int,
    overrides: list[str],
    out: Path,
    timeout_s: int = 600,
    cache: Path | None = None,
) -> list[dict]:
    """Runs `worker` in `processes` OS processes (DEVICES / processes CPU devices each) and returns
    their reports, by process index. Raises with the failing process's output tail.

    `cache`: the runs' compilation cache (`compilation_cache`); None: none."""
    if DEVICES % processes:
        raise ValueError(f"processes={processes}: must divide the {DEVICES} devices")
    out.mkdir(parents=True, exist_ok=True)
    # Each process asks for its own devices (and pool), and compiles what it runs: with the suite's
    # compilation cache a process would load what another run compiled, and its share would not show.
    env = own_devices_env(os.environ)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), *filter(None, [env.get("PYTHONPATH")])]
    )
    common = [*overrides, f"num_cpu_devices={DEVICES // processes}", f"run_dir={out / 'run'}",
              f"compilation_cache={cache or ''}"]  # fmt: skip
    if processes > 1:
        base = _free_ports(2)  # the coordinator and, next to it, the watchdog hub
        env.update(DFLOP_NUM_PROCESSES=str(processes), DFLOP_COORDINATOR=f"127.0.0.1:{base}")
    procs = []
    for rank in range(processes):
        report = out / f"process_{rank}.json"
        report.unlink(missing_ok=True)
        cmd = ["timeout", "-k", "10", str(timeout_s), sys.executable, "-m", __name__, "--worker",
               str(report), *common]  # fmt: skip
        log = (out / f"process_{rank}.log").open("w")
        procs.append((subprocess.Popen(cmd, env=dict(env, DFLOP_PROCESS_ID=str(rank)), stdout=log,
                                       stderr=subprocess.STDOUT), log, report))  # fmt: skip
    reports = []
    for rank, (p, log, report) in enumerate(procs):
        p.wait(timeout_s + 30)
        log.close()
        if p.returncode != 0 or not report.is_file():
            tail = (out / f"process_{rank}.log").read_text()[-3000:]
            raise RuntimeError(f"process {rank}/{processes} exited {p.returncode}:\n{tail}")
        reports.append(json.loads(report.read_text()))
    return reports


def _free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 free now (a coordinator at p, its watchdog at p + 1)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65536:
            continue
        socks = [socket.socket() for _ in range(n)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports on 127.0.0.1")


def worker(report_path: Path, overrides: list[str]) -> None:
    """One process of a run: joins the job (env DFLOP_*), trains, writes its share to `report_path`."""
    from dflop_jax.config import load_config
    from dflop_jax.host_devices import simulate_cpu_devices
    from dflop_jax.programs.processes import initialize, resolve
    from dflop_jax.runtime.config import TrainConfig

    cfg = load_config(TrainConfig, None, overrides)
    dist = resolve(cfg.distributed, os.environ)
    simulate_cpu_devices(cfg.num_cpu_devices)
    if dist is not None:
        initialize(dist, cfg.compilation_cache)
    import jax

    from dflop_jax.data import loader as loader_mod
    from dflop_jax.runtime import trainer as trainer_mod
    from dflop_jax.runtime.precompile import CompileCounter
    from dflop_jax.train import run

    compiles, in_step = [], [False]  # (program name, compiled inside a training step, seconds)

    def on_event(event, seconds, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append((kw.get("fun_name"), in_step[0], seconds))

    jax.monitoring.register_event_duration_secs_listener(on_event)
    decoded, moved, step_s = [], [], []
    process = loader_mod.LazyProcessor.process
    loader_mod.LazyProcessor.process = lambda self, rec: _record(process(self, rec), decoded)
    pipeline = trainer_mod.run_pipeline
    trainer_mod.run_pipeline = lambda *a, **k: _record(pipeline(*a, **k), moved, "transfer_bytes")
    dispatch = trainer_mod._Trainer.dispatch

    def timed(self, n):
        t0, in_step[0] = time.perf_counter(), True
        dispatch(self, n)
        step_s.append(time.perf_counter() - t0)
        in_step[0] = False

    trainer_mod._Trainer.dispatch = timed
    report = run(cfg)
    share = {
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "losses": report.losses,
        "local_stages": [s.local for s in report.stages],
        "stage_compiles": [s.compiles for s in report.stages],
        "xla_compiles": len(compiles),
        "xla_compiled": dict(collections.Counter(name for name, *_ in compiles)),
        "xla_compile_s": sum(seconds for *_, seconds in compiles),
        "xla_compiles_in_steps": sum(inside for _, inside, _ in compiles),
        # Stage programs (`stage_jits`) XLA compiled here, before step 1 (`runtime/precompile.py`) and
        # inside steps: the per-process share.
        "xla_stage_programs": sum(name in STAGE_PROGRAMS for name, *_ in compiles),
        "xla_stage_programs_in_steps": sum(
            inside and name in STAGE_PROGRAMS for name, inside, _ in compiles
        ),
        # the run's own count (`runtime/precompile.py`): programs built after the precompile, and
        # those loaded from a compilation cache (JAX's, or the executable store of processes > 0)
        "programs_after_precompile": report.summary.get("programs_after_precompile"),
        "cache_hits": CompileCounter().cache_hits,
        "decoded": sorted(decoded),
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "transfer_bytes": moved,
        "step_s": step_s,
    }
    report_path.write_text(json.dumps(share))


def _record(value, into: list, attr: str | None = None):
    """Appends `value.attr` (a decoded sample: [id, tiles]) to `into`; returns `value`."""
    into.append(getattr(value, attr) if attr else [value.id, value.num_tiles])
    return value


def summarize(runs: dict[tuple[int, int], list[dict]]) -> list[dict]:
    """One row per (process count, run, process): the figures of the module docstring."""
    rows = []
    for (n, run), reports in sorted(runs.items()):
        for r in reports:
            later = r["step_s"][1:] or r["step_s"]
            rows.append({
                "processes": n,
                "run": run,
                "process": r["process"],
                "local_stages": "".join("x" if here else "." for here in r["local_stages"]),
                "xla_compiles": r["xla_compiles"],
                "xla_compiles_in_steps": r["xla_compiles_in_steps"],
                "xla_stage_programs": r["xla_stage_programs"],
                "xla_compile_s": round(r["xla_compile_s"], 2),
                "cache_hits": r["cache_hits"],
                "stage_compiles": sum(r["stage_compiles"]),
                "decoded": len(r["decoded"]),
                "rss_mib": round(r["rss_mib"], 1),
                "transfer_mib_per_step": round(sum(r["transfer_bytes"]) / len(r["transfer_bytes"]) / 2**20, 3),
                "step_s": round(sum(later) / len(later), 3),
            })  # fmt: skip
    return rows


COMMAND = command(
    "multihost",
    __doc__.split("\n")[0],
    "python -m dflop_jax.bench multihost processes=1 steps=2 out=runs/bench_multihost",
)


@dataclasses.dataclass(frozen=True)
class MultihostBenchConfig:
    """The process counts to compare and the run each of them trains.

    Attributes:
      processes: process counts (one run each; 8 CPU devices in all, divided among them).
      steps: training steps per run.
      model: the tiny layout, "llava_ov" (`TINY_LLAVA_OV`) or "internvl" (`TINY_INTERNVL`).
      out: folder for the runs, their logs and multihost.json.
      timeout_s: seconds per launch.
      train_overrides: extra key=value overrides of every run's training config, e.g. [optimizer.lr=1e-3].
      second_run: run each process count twice with one compilation cache (a fresh one), the
        second run's rows (`run` 2) showing what a second run of the same plan still compiles.
    """

    processes: tuple[int, ...] = (1, 2, 4)
    steps: int = 4
    model: Literal["llava_ov", "internvl"] = "llava_ov"
    out: str = "runs/bench_multihost"
    timeout_s: int = 600
    train_overrides: tuple[str, ...] = ()
    second_run: bool = False

    def __post_init__(self):
        ok = bool(self.processes) and all(n >= 1 and DEVICES % n == 0 for n in self.processes)
        require(ok, "processes", list(self.processes), f"give counts that divide {DEVICES}")
        require(self.steps >= 1, "steps", self.steps, "must be >= 1")
        require(self.timeout_s >= 1, "timeout_s", self.timeout_s, "must be >= 1")
        bad = [o for o in self.train_overrides if "=" not in o]
        require(not bad, "train_overrides", list(self.train_overrides), "give key=value items")


def main(argv: list[str] | None = None) -> int:
    cfg, _ = load(COMMAND, MultihostBenchConfig, argv)
    out = Path(cfg.out)
    base = TINY_LLAVA_OV if cfg.model == "llava_ov" else TINY_INTERNVL
    synth = out / "synth"
    overrides = [*base, f"data.synth_dir={synth}", f"steps={cfg.steps}", *cfg.train_overrides]
    runs = {}
    for n in cfg.processes:
        shutil.rmtree(out / f"p{n}", ignore_errors=True)
        cache = out / f"p{n}" / "cache" if cfg.second_run else None
        for run in (1, 2) if cfg.second_run else (1,):
            runs[n, run] = launch(n, overrides, out / f"p{n}" / f"run{run}", cfg.timeout_s, cache)
    rows = summarize(runs)
    keys = list(rows[0])
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(str(row[k]) for k in keys))
    for (n, run), reports in sorted(runs.items()):
        losses = [round(x, 6) for x in reports[0]["losses"]]
        print(f"losses at {n} process(es){f', run {run}' * cfg.second_run}: {losses}")
    loadavg = os.getloadavg()
    (out / "multihost.json").write_text(json.dumps({"rows": rows, "loadavg": loadavg,
        "losses": {f"{n}/{run}": r[0]["losses"] for (n, run), r in runs.items()}}, indent=1))  # fmt: skip
    print(
        f"load average {loadavg[0]:.2f} {loadavg[1]:.2f} {loadavg[2]:.2f}; wrote {out / 'multihost.json'}"
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), sys.argv[3:])
    else:
        sys.exit(main(sys.argv[1:]))
