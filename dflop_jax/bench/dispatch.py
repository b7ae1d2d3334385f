"""Host time per dispatched program: the trainer's dispatch path against its own executables in a loop.

    python -m dflop_jax.bench dispatch [parts=demo,real,jax] [steps=8] [rounds=5] [out=runs/bench_dispatch]

  demo  configs/demo.yaml's model on an explicit layout of 8 simulated CPU devices (2 encoder stages
        of dp 2, 2 LLM stages of tp 2; 8-tile, 1024-token buckets; 4-8 microbatches of a global batch
        of 8), trained `steps` steps in this process (`dflop_jax.train.run`): per step, from its
        metrics.jsonl rows after the first 2, the programs issued by kind, host microseconds per
        program (wall; and the dispatching thread's CPU time) and the time before the first device
        wait. Then, on the trained stages and one all-padding microbatch per scheduled slot (4),
        `rounds` times each, devices idle at the start: the dispatch path (`run_pipeline` +
        `apply_updates`, as the trainer calls them) against its floor, the same executables called
        in a tight loop (recorded from one dispatch with `programs.dispatch.record`, their arguments
        made ahead, donated ones fresh per round); the ratio path / floor, wall and CPU; and the
        floor per program (calls, arrays in and out, CPU microseconds per call), which names what
        the floor is made of.
  real  the stage programs of a real-size stage (Qwen2.5-7B, 4 LLM layers at tp 4, 4096 tokens per
        row, abstract parameters from `programs.stage_builder.abstract_stage`): the Python layers of the
        dispatch path (`StageProgram.zero_grads`, `forward_train`, `backward_from` over 4
        microbatches) with each jitted program stubbed by a function that returns its outputs'
        shapes (nothing is compiled or run): host microseconds per program call of OUR layers at
        the real stage's parameter, residual and side-input counts (jax's own dispatch excluded:
        the demo's floor measures it).
  jax   jax's own call of a jitted program on this backend, nothing of ours around it: host CPU
        microseconds per call of a program taking n [64, 64] f32 leaves (replicated on 1, 2 or 4
        devices) and returning 1 or n of them, in a tight loop; and a least-squares fit per device
        count, microseconds = fixed + per input leaf x inputs + per output leaf x outputs. It names
        what the demo's floor is made of: a program's outputs, not its inputs, dominate.

Figures are medians. On CPU the 8 simulated devices run programs on the cores the dispatching
thread uses, and a program on several devices returns only once XLA:CPU's client pool has launched
it on each (that pool also runs the programs): wall time per program includes that wait, CPU time
does not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
from pathlib import Path

import numpy as np

from dflop_jax.bench._cli import command, load
from dflop_jax.config import require

PARTS = ("demo", "real", "jax")
WARMUP = 2  # first steps left out of the trainer's figures (step 1 compiles its small programs)
DEMO_LAYOUT = [
    "plan=explicit", "layout.encoder_layers=[1, 1]", "layout.encoder_tp=[1]",
    "layout.encoder_dp=2", "layout.llm_layers=[2, 2]", "layout.llm_tp=[2]", "layout.llm_dp=1",
    "layout.tiles=[8]", "layout.lengths=[1024]", "layout.microbatches=[4, 8]",
    "scheduler.solver=greedy", "checkpoint.every=0", "measure_stage_times_every=0",
    "global_batch=8", "log_every=100",
]  # fmt: skip
FLOOR_MICROBATCHES = 4


def _median(rows, key) -> float:
    return float(np.median([r[key] for r in rows]))


def trainer_figures(rows: list[dict]) -> dict:
    """Medians of the trainer's per-step dispatch fields over the steps after WARMUP."""
    rows = rows[WARMUP:] or rows
    keys = ("dispatch_s", "dispatch_cpu_s", "dispatch_programs", "dispatch_stage_programs",
            "dispatch_transfer_programs", "dispatch_update_programs", "dispatch_us_per_program",
            "dispatch_cpu_us_per_program", "dispatch_first_wait_s", "step_time_s")  # fmt: skip
    return {"steps": len(rows), "microbatches": [r["microbatches"] for r in rows],
            **{k: _median(rows, k) for k in keys}}  # fmt: skip


def demo_config(out: Path, steps: int):
    from dflop_jax.config import load_config
    from dflop_jax.runtime.config import TrainConfig
    from dflop_jax.train import DEMO_CONFIG

    over = [*DEMO_LAYOUT, f"steps={steps}", f"run_dir={out / 'demo_run'}",
            f"data.synth_dir={out / 'synth'}", f"compilation_cache={out / 'jax_cache'}"]  # fmt: skip
    return load_config(TrainConfig, DEMO_CONFIG, over)


def _problem(cfg):
    """The run's scheduling problem (its buckets and data-parallel geometry)."""
    from dflop_jax.resolve import RunContext, resolve_plan

    return resolve_plan(RunContext.build(cfg)).problem()


def _times(fn) -> tuple[float, float]:
    """(wall, CPU of this thread) seconds of `fn()`."""
    c0, w0 = time.thread_time(), time.perf_counter()
    fn()
    return time.perf_counter() - w0, time.thread_time() - c0


def path_and_floor(stages, opts, microbatches, clip_norm: float, rounds: int) -> dict:
    """The dispatch path (`run_pipeline` + `apply_updates`) against the same executables called in
    a tight loop, `rounds` times each, devices idle at each start."""
    import jax

    from dflop_jax.programs.dispatch import ISSUED, record
    from dflop_jax.runtime.driver import place_sides, run_pipeline
    from dflop_jax.runtime.train_state import apply_updates

    state = {"stats": None}

    def step():
        placed = place_sides(stages, microbatches)  # the loader's thread places them in training
        jax.block_until_ready(placed)

        def dispatch():
            out = run_pipeline(stages, microbatches, None, placed=placed)
            state["stats"] = apply_updates(opts, out.grads, clip_norm, out.loss, state["stats"])[-1]

        return dispatch

    path, programs = [], 0
    for _ in range(rounds + 1):  # the first round: programs outside the precompiled set compile
        before, go = ISSUED.snapshot(), step()
        path.append(_times(go))
        programs = sum(ISSUED.snapshot()) - sum(before)
        jax.block_until_ready(state["stats"])
    go = step()
    with record() as calls:
        go()
    jax.block_until_ready(state["stats"])
    fixed = [_arguments(c.args, c.donated, fresh=False) for c in calls]
    floor, each = [], [[] for _ in calls]
    for _ in range(rounds):
        args = [_arguments(c.args, c.donated, fresh=True, kept=f) for c, f in zip(calls, fixed)]
        jax.block_until_ready(args)
        outs = []

        def loop(args=args, outs=outs):
            for c, a, mine in zip(calls, args, each):
                c0 = time.thread_time()
                with contextlib.nullcontext() if c.mesh is None else jax.set_mesh(c.mesh):
                    outs.append(c.fn(*a))
                mine.append(time.thread_time() - c0)

        floor.append(_times(loop))
        jax.block_until_ready(outs)
    path = path[1:]
    med = lambda xs, i: float(np.median([x[i] for x in xs]))  # noqa: E731
    out = {"programs": programs, "recorded": len(calls), "rounds": rounds,
           "path_us_per_program": med(path, 0) / programs * 1e6,
           "path_cpu_us_per_program": med(path, 1) / programs * 1e6,
           "floor_us_per_program": med(floor, 0) / len(calls) * 1e6,
           "floor_cpu_us_per_program": med(floor, 1) / len(calls) * 1e6}  # fmt: skip
    out["path_over_floor"] = out["path_us_per_program"] / out["floor_us_per_program"]
    out["path_over_floor_cpu"] = out["path_cpu_us_per_program"] / out["floor_cpu_us_per_program"]
    out["floor_by_program"] = floor_by_program(calls, outs, each)
    return out


def floor_by_program(calls, outs, each) -> list[dict]:
    """The floor per program (kind and jax's name for it): calls, arrays in and out per call, and
    the dispatching thread's median CPU microseconds per call, most total time first."""
    import jax

    from dflop_jax.programs.dispatch import KINDS

    rows: dict[tuple, dict] = {}
    for c, o, times in zip(calls, outs, each):
        name = getattr(c.fn, "__name__", type(c.fn).__name__)
        arrays_in = sum(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(c.args))
        r = rows.setdefault((KINDS[c.kind], name), {"kind": KINDS[c.kind], "program": name,
                                                    "calls": 0, "in": 0, "out": 0, "us": []})  # fmt: skip
        r["calls"] += 1
        r["in"] += arrays_in
        r["out"] += len(jax.tree.leaves(o))
        r["us"].append(float(np.median(times)) * 1e6)
    table = [{"kind": r["kind"], "program": r["program"], "calls": r["calls"],
              "inputs": r["in"] / r["calls"], "outputs": r["out"] / r["calls"],
              "cpu_us_per_call": float(np.mean(r["us"])), "cpu_us_total": float(np.sum(r["us"]))}
             for r in rows.values()]  # fmt: skip
    return sorted(table, key=lambda r: -r["cpu_us_total"])


def _arguments(args: tuple, donated: tuple[bool, ...], fresh: bool, kept: tuple | None = None):
    """A recorded call's arguments as zero arrays: the non-donated ones made once (`fresh` False),
    the donated ones anew (`fresh` True, the others taken from `kept`)."""
    import jax

    flags = iter(donated)
    old = iter(jax.tree.leaves(kept, is_leaf=lambda x: x is None)) if kept is not None else None

    def leaf(x):
        prev = next(old) if old is not None else None
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        gone = next(flags)
        if gone != fresh:
            return prev if fresh else None
        return jax.device_put(np.zeros(x.shape, x.dtype), x.sharding)

    return jax.tree.map(leaf, args, is_leaf=lambda x: x is None)


def demo_part(out: Path, steps: int, rounds: int) -> dict:
    from dflop_jax.runtime.precompile import bucket_microbatches
    from dflop_jax.train import run

    cfg = demo_config(out, steps)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)  # a fresh run (metrics.jsonl is appended to)
    report = run(cfg)
    rows = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").open()]
    trainer = trainer_figures(rows)
    batch = bucket_microbatches(_problem(cfg), cfg.data)[0]
    floor = path_and_floor(report.stages, report.optimizers, [batch] * FLOOR_MICROBATCHES,
                           cfg.optimizer.clip_norm, rounds)  # fmt: skip
    layout = " + ".join(f"{s.module}[dp{s.dp} x tp{s.tp}]" for s in report.layout.stages)
    return {"layout": layout, "trainer": trainer, "isolated": floor}


def _print_demo(rep: dict) -> None:
    t, f = rep["trainer"], rep["isolated"]
    print(f"\n## demo: {rep['layout']}, 8 simulated CPU devices")
    print(f"trainer, median of {t['steps']} steps (microbatches {t['microbatches']}): "
          f"{t['dispatch_programs']:.0f} programs (stage {t['dispatch_stage_programs']:.0f}, "
          f"transfer {t['dispatch_transfer_programs']:.0f}, update "
          f"{t['dispatch_update_programs']:.0f}), dispatch {t['dispatch_s'] * 1e3:.1f} ms "
          f"(CPU {t['dispatch_cpu_s'] * 1e3:.1f} ms) of a {t['step_time_s'] * 1e3:.0f} ms step: "
          f"{t['dispatch_us_per_program']:.0f} us per program "
          f"(CPU {t['dispatch_cpu_us_per_program']:.0f}); first device wait after "
          f"{t['dispatch_first_wait_s'] * 1e3:.1f} ms")  # fmt: skip
    print("| what | programs | wall us/program | CPU us/program |")
    print("|---|---|---|---|")
    print(f"| dispatch path | {f['programs']} | {f['path_us_per_program']:.0f} | "
          f"{f['path_cpu_us_per_program']:.0f} |")  # fmt: skip
    print(f"| floor: same executables, tight loop | {f['recorded']} | "
          f"{f['floor_us_per_program']:.0f} | {f['floor_cpu_us_per_program']:.0f} |")  # fmt: skip
    print(f"path / floor: {f['path_over_floor']:.2f}x wall, {f['path_over_floor_cpu']:.2f}x CPU "
          f"(median of {f['rounds']} rounds of {FLOOR_MICROBATCHES} microbatches)")  # fmt: skip
    print("floor by program (CPU us per call: median over rounds, mean over calls):")
    print("| kind | program | calls | arrays in | arrays out | CPU us per call | CPU us total |")
    print("|---|---|---|---|---|---|---|")
    for r in f["floor_by_program"]:
        print(
            f"| {r['kind']} | {r['program']} | {r['calls']} | {r['inputs']:.0f} | "
            f"{r['outputs']:.0f} | {r['cpu_us_per_call']:.0f} | {r['cpu_us_total']:.0f} |"
        )


REAL = dict(arch="siglip-so400m+qwen2.5-7b", first=4, layers=4, tp=4, tokens=4096, microbatches=4)


def real_part(rounds: int) -> dict:
    """The Python layers of a real-size stage's dispatch path, each jitted program stubbed by a
    function that flattens its arguments (as jax does) and returns its outputs' shapes."""
    import dataclasses as dc

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from dflop_jax.contracts import ScheduledMicrobatch
    from dflop_jax.contracts.layout import StageSpec
    from dflop_jax.data.packing import pack_microbatch
    from dflop_jax.programs.dispatch import ISSUED
    from dflop_jax.programs.model_section import model_config_for_arch
    from dflop_jax.programs.stage_builder import abstract_stage
    from dflop_jax.programs.stage_program import StageProgram

    r = REAL
    model_cfg = model_config_for_arch(r["arch"])
    spec = StageSpec("llm", r["first"], r["layers"], tp=r["tp"])
    mesh = Mesh(np.array(jax.devices()[: r["tp"]]).reshape(1, r["tp"]), ("data", "model"))
    bp = abstract_stage(model_cfg, spec, mesh)
    stage = StageProgram(mesh, bp.fns, bp.state, jnp.bfloat16, residuals="all")
    v = model_cfg.vision
    mb, _ = pack_microbatch(ScheduledMicrobatch(1, r["tokens"], ((),)), [], [], encoder_dp=1, llm_dp=1,
                            tile_shape=(v.image_size, v.image_size, v.num_channels),
                            tokens_per_tile=model_cfg.tokens_per_tile)  # fmt: skip
    side = stage.side_structs(dc.asdict(mb))
    hidden = model_cfg.text.hidden_size
    x = jax.ShapeDtypeStruct((1, r["tokens"], hidden), jnp.bfloat16, sharding=stage.x_sharding)
    jits = stage.jits
    with jax.set_mesh(mesh):  # traced, not compiled
        y, kept = jax.eval_shape(jits.forward_residuals, stage.compute_leaves, x, side)
        accs = jax.eval_shape(jits.zeros.jit, stage.leaves)
    gx = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=stage.x_sharding)

    # the accumulator as the tree of its leaves (how it crossed the jit boundary before packing)
    params, acc_tree = stage.params, stage.accumulator.tree
    acc_leaves = [jax.ShapeDtypeStruct((1, *s.shape), jnp.float32) for s in stage.accumulator.slots]
    acc = acc_tree.unflatten(acc_leaves)

    def stub(out, trees: bool, acc_in: bool, acc_out: bool):
        def program(*args):
            jax.tree.flatten(args)  # what jax's own call does first
            if trees:  # as when the parameter and accumulator trees crossed the jit boundary
                jax.tree.flatten((params, acc) if acc_in else params)
                if acc_out:
                    acc_tree.unflatten(acc_leaves)
            return out

        return program

    def step():
        acc = stage.zero_grads()
        held = [stage.forward_train(x, side) for _ in range(r["microbatches"])]
        for _, h in held:
            _, acc = stage.backward_from(h, y, acc)

    out = {**r, "param_leaves": len(stage.leaves), "accumulator_leaves": len(stage.accumulator.slots),
           "accumulator_buffers": len(accs),
           "residual_leaves": len(kept), "side_inputs": len(side)}  # fmt: skip
    for name, trees in (("", False), ("trees_", True)):
        jits.zeros.jit = stub(accs, trees, False, True)
        jits.forward_residuals.jit = stub((y, kept), trees, False, False)
        jits.backward_residuals.jit = stub((gx, accs), trees, True, True)
        times = []
        for _ in range(rounds + 1):
            before = ISSUED.snapshot()
            times.append(_times(step))
            calls = sum(ISSUED.snapshot()) - sum(before)
        for i, unit in ((0, "us"), (1, "cpu_us")):
            out[f"{name}{unit}_per_call"] = (
                float(np.median([t[i] for t in times[1:]])) / calls * 1e6
            )
    return dict(out, calls=calls)


def _print_real(rep: dict) -> None:
    print(f"\n## real-size stage: {rep['arch']} LLM layers {rep['first']}..."
          f"{rep['first'] + rep['layers'] - 1} at tp {rep['tp']}, {rep['tokens']} tokens, "
          f"{rep['microbatches']} microbatches; programs stubbed (our layers only)")  # fmt: skip
    print(f"{rep['param_leaves']} parameter leaves, {rep['accumulator_leaves']} accumulator leaves "
          f"(in {rep['accumulator_buffers']} buffers), "
          f"{rep['residual_leaves']} residual leaves, {rep['side_inputs']} side inputs: "
          f"{rep['calls']} calls per round, {rep['us_per_call']:.1f} us per call "
          f"(CPU {rep['cpu_us_per_call']:.1f}); with the parameter and accumulator trees "
          f"flattened and rebuilt per call (as before they crossed as leaves): "
          f"{rep['trees_us_per_call']:.1f} us (CPU {rep['trees_cpu_us_per_call']:.1f})")  # fmt: skip


JAX_CALL = dict(devices=(1, 2, 4), leaves=(1, 16, 64), calls=100)


def jax_part(rounds: int, devices=JAX_CALL["devices"], leaves=JAX_CALL["leaves"],
             calls: int = JAX_CALL["calls"]) -> dict:  # fmt: skip
    """jax's own call cost (module docstring): per (devices, inputs, outputs) the median over
    `rounds` of the dispatching thread's CPU microseconds per call, and per device count the fit."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    one = jax.jit(lambda xs: xs[0] * 2.0)
    every = jax.jit(lambda xs: [x * 2.0 for x in xs])
    rows = []
    for d in devices:
        sharding = NamedSharding(Mesh(np.array(jax.devices()[:d]), ("d",)), P())
        for n in leaves:
            xs = [jax.device_put(np.ones((64, 64), np.float32), sharding) for _ in range(n)]
            for fn, outputs in ((one, 1), (every, n)) if n > 1 else ((one, 1),):
                jax.block_until_ready(fn(xs))  # compiled outside the timing
                cpu = []
                for _ in range(rounds):
                    outs = []
                    _, c = _times(
                        lambda fn=fn, xs=xs, outs=outs: outs.extend(fn(xs) for _ in range(calls))
                    )
                    cpu.append(c / calls * 1e6)
                    jax.block_until_ready(outs)
                rows.append({"devices": d, "inputs": n, "outputs": outputs,
                             "cpu_us_per_call": float(np.median(cpu))})  # fmt: skip
    return {"rows": rows, "fit": _fit_call_cost(rows)}


def _fit_call_cost(rows: list[dict]) -> dict:
    """Per device count, microseconds = fixed + per_input x inputs + per_output x outputs
    (least squares over that count's rows)."""
    out = {}
    for d in sorted({r["devices"] for r in rows}):
        mine = [r for r in rows if r["devices"] == d]
        a = np.array([[1.0, r["inputs"], r["outputs"]] for r in mine])
        y = np.array([r["cpu_us_per_call"] for r in mine])
        fixed, per_input, per_output = np.linalg.lstsq(a, y, rcond=None)[0]
        out[str(d)] = {"fixed_us": float(fixed), "per_input_us": float(per_input),
                       "per_output_us": float(per_output)}  # fmt: skip
    return out


def _print_jax(rep: dict) -> None:
    print("\n## jax's own call: CPU us per call of a program on replicated [64, 64] f32 leaves")
    print("| devices | inputs | outputs | CPU us per call |")
    print("|---|---|---|---|")
    for r in rep["rows"]:
        print(f"| {r['devices']} | {r['inputs']} | {r['outputs']} | {r['cpu_us_per_call']:.0f} |")
    for d, f in rep["fit"].items():
        print(f"{d} device(s): {f['fixed_us']:.0f} us + {f['per_input_us']:.2f} us per input leaf "
              f"+ {f['per_output_us']:.2f} us per output leaf")  # fmt: skip


COMMAND = command(
    "dispatch",
    __doc__.split("\n\n")[0],
    "python -m dflop_jax.bench dispatch parts=demo steps=3 rounds=2 out=runs/bench_dispatch "
    "json_out=runs/bench_dispatch/report.json",
)


@dataclasses.dataclass(frozen=True)
class DispatchBenchConfig:
    """What to measure, how long, and where the runs go.

    Attributes:
      parts: from demo, real and jax.
      steps: training steps of the demo part (the first 2 are left out of its figures).
      rounds: timed rounds of the dispatch path and of its floor (median), and of the real and
        jax parts.
      out: folder for the demo's run, data and compilation cache.
      json_out: write the report as JSON here ("" = none).
    """

    parts: tuple[str, ...] = PARTS
    steps: int = 8
    rounds: int = 5
    out: str = "runs/bench_dispatch"
    json_out: str = ""

    def __post_init__(self):
        bad = [p for p in self.parts if p not in PARTS]
        require(bool(self.parts) and not bad, "parts", list(self.parts),
                f"choose from {', '.join(PARTS)}")  # fmt: skip
        require(self.steps >= 1, "steps", self.steps, "must be >= 1")
        require(self.rounds >= 1, "rounds", self.rounds, "must be >= 1")


def run(cfg: DispatchBenchConfig) -> dict:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {}
    if "demo" in cfg.parts:
        report["demo"] = demo_part(out.resolve(), cfg.steps, cfg.rounds)
        _print_demo(report["demo"])
    if "real" in cfg.parts:
        report["real"] = real_part(cfg.rounds)
        _print_real(report["real"])
    if "jax" in cfg.parts:
        report["jax"] = jax_part(cfg.rounds)
        _print_jax(report["jax"])
    if cfg.json_out:
        Path(cfg.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.json_out).write_text(json.dumps(report, indent=1))
    return report


def main(argv: list[str] | None = None) -> int:
    cfg, _ = load(COMMAND, DispatchBenchConfig, argv)
    from dflop_jax.host_devices import simulate_cpu_devices

    simulate_cpu_devices(8)  # before jax starts its backend
    run(cfg)
    return 0
