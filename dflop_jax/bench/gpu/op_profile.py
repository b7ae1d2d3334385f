"""`bench gpu parts=ops`: the vision tower's training step, op by op, from a `jax.profiler` trace.

The tower (patch embedding + every layer, at the size's tile bucket: 16 tiles of 729 tokens for
SigLIP-so400m at `size=real`) is built as the runtime's stage program under "all" (the forward keeping
its residuals, the backward from them) with the attention kernel `model.attention_impl: auto` picks
here, timed forward and backward, then `runs` more steps are traced. The trace's op events give, per
XLA op (an HLO instruction of the compiled forward or backward), its time summed over the traced
steps, its calls and its share of all op time; the `TOP` most expensive make the table, each named by
its HLO from the compiled programs' text (opcode; a fusion's kind, a custom call's target).

Where the op times come from (`op_times`):
  GPU  the kernels on the device's stream lines (process "/device:GPU:N", threads "Stream #..."),
       each carrying the `hlo_op` / `hlo_module` it ran for; an op launching several kernels sums
       them, and the longest kernel's name is kept.
  CPU  XLA:CPU's op events on its runtime threads ("tf_XLA..."), named by the op: the same table,
       so CI runs this path; the figures are CPU figures.
A trace with neither (a GPU without CUPTI) is an error naming what the trace held.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
import shutil
import time
from pathlib import Path

import numpy as np

from dflop_jax.bench.gpu.sizes import CPU_BANNER

TOP = 20  # rows of the table
_PROGRAMS = ("fwd", "bwd")


# ------------------------------------------------------------------------------------------- trace


def trace_events(log_dir: Path) -> list[dict]:
    """The Chrome-trace events `jax.profiler.trace(log_dir)` wrote (its `*.trace.json.gz`, else the
    Perfetto export), [] when there is none."""
    files = sorted(Path(log_dir).rglob("*.trace.json.gz"))
    files = [f for f in files if "perfetto" not in f.name] or files
    files = files or sorted(Path(log_dir).rglob("perfetto_trace.json.gz"))
    if not files:
        return []
    with gzip.open(files[-1], "rt") as f:
        data = json.load(f)
    return data.get("traceEvents", []) if isinstance(data, dict) else data


def _names(events: list[dict]) -> tuple[dict, dict]:
    """({pid: process name}, {(pid, tid): thread name}) from the trace's metadata events."""
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") != "M":
            continue
        name = (e.get("args") or {}).get("name", "")
        if e.get("name") == "process_name":
            procs[e.get("pid")] = name
        elif e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = name
    return procs, threads


def _cpu_op(name: str) -> bool:
    """An XLA:CPU op event (not the runtime's own bookkeeping, not an op's "end: " marker)."""
    return bool(name) and not name.startswith("end: ") and "::" not in name


def op_times(events: list[dict]) -> tuple[str, dict[tuple[str, str], dict]]:
    """(source, {(hlo module or "", op): {"us": summed duration, "calls": n, "kernel": longest
    kernel's name}}) of a trace's op events (module docstring); source is "gpu streams",
    "cpu threads" or "none"."""
    procs, threads = _names(events)
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    devices = {p for p, n in procs.items() if n.startswith("/device:") and "CPU" not in n}
    rows: dict[tuple[str, str], dict] = {}

    def add(key, e):
        r = rows.setdefault(key, {"us": 0.0, "calls": 0, "kernel": "", "_longest": -1.0})
        dur = float(e["dur"])
        r["us"] += dur
        r["calls"] += 1
        if dur > r["_longest"]:
            r["_longest"], r["kernel"] = dur, e.get("name", "")

    if devices:
        streams = {k for k, n in threads.items() if k[0] in devices and n.startswith("Stream")}
        for e in spans:
            if e.get("pid") not in devices:
                continue
            args = e.get("args") or {}
            on_stream = (e.get("pid"), e.get("tid")) in streams
            if on_stream or (not streams and "hlo_op" in args):
                add((args.get("hlo_module", ""), args.get("hlo_op") or e.get("name", "")), e)
        source = "gpu streams"
    else:
        xla = {k for k, n in threads.items() if n.startswith("tf_XLA")}
        for e in spans:
            if (e.get("pid"), e.get("tid")) in xla and _cpu_op(e.get("name", "")):
                add(("", e["name"]), e)
        source = "cpu threads"
    for r in rows.values():
        r.pop("_longest")
    return (source if rows else "none"), rows


# --------------------------------------------------------------------------------------------- HLO

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.+)$")


def _after_shape(rest: str) -> str:
    """The instruction text after its result shape (a tuple shape is parenthesized)."""
    if rest.startswith("("):
        depth = 0
        for i, c in enumerate(rest):
            depth += (c == "(") - (c == ")")
            if depth == 0:
                return rest[i + 1 :].strip()
        return ""
    return rest.split(" ", 1)[1] if " " in rest else ""


def hlo_ops(text: str) -> tuple[str, dict[str, str]]:
    """(module name, {instruction name: "opcode", "fusion kLoop", "custom-call <target>"}) of a
    compiled program's HLO text (`compiled.as_text()`), every computation's instructions."""
    module, out = "", {}
    for line in text.splitlines():
        if line.startswith("HloModule "):
            module = line.split()[1].rstrip(",")
            continue
        m = _INSTR.match(line)
        if not m or "(" not in m["rest"]:
            continue
        body = _after_shape(m["rest"])
        opcode = body.split("(", 1)[0].strip()
        if not opcode or " " in opcode:
            continue
        desc = opcode
        if kind := re.search(r"\bkind=(k\w+)", body):
            desc += f" {kind[1]}"
        if target := re.search(r'custom_call_target="([^"]+)"', body):
            desc += f" {target[1]}"
        out[m["name"]] = desc
    return module, out


def top_ops(rows: dict[tuple[str, str], dict], programs: dict[str, tuple[str, dict]],
            steps: int, top: int = TOP) -> tuple[list[dict], float]:  # fmt: skip
    """The `top` most expensive ops (ms per step, share of all op time, calls per step, program
    and HLO description from `programs` = {"fwd"|"bwd": hlo_ops(...)}), and all op time per step
    in ms. An op event without a module (CPU) is looked up in every program: "fwd+bwd" where both
    have an op of that name (its time is then both ops')."""
    total_us = sum(r["us"] for r in rows.values())
    table = []
    for (module, op), r in sorted(rows.items(), key=lambda kv: -kv[1]["us"])[:top]:
        found = [(p, ops[op]) for p, (name, ops) in programs.items()
                 if op in ops and (not module or module == name)]  # fmt: skip
        # without a module (CPU) an op named alike in both programs is both, its times summed
        program = "+".join(p for p, _ in found)
        hlo = " / ".join(dict.fromkeys(h for _, h in found))
        table.append({"op": op, "program": program, "hlo": hlo, "kernel": r["kernel"],
                      "ms_per_step": r["us"] / 1e3 / steps, "share": r["us"] / total_us,
                      "calls_per_step": r["calls"] / steps})  # fmt: skip
    return table, total_us / 1e3 / steps


def table_markdown(report: dict) -> str:
    """The part's report as a Markdown table (the file the GPU check brings back)."""
    lines = [
        f"# {report['program']}: {report['tiles']} tiles x {report['tokens_per_tile']} tokens, "
        f"attention {report['attention']}, {report['device']}",
        "",
        f"forward {report['fwd_s'] * 1e3:.2f} ms + backward {report['bwd_s'] * 1e3:.2f} ms per step "
        f"(median of {report['runs']}); op time in the trace {report['op_ms_per_step']:.2f} ms per "
        f"step over {report['traced_steps']} traced steps (source: {report['source']}); the "
        f"{len(report['top'])} most expensive ops of {report['ops']}:",
        "",
        "| # | op | program | HLO | ms / step | share | calls / step | longest kernel |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(report["top"], 1):
        kernel = r["kernel"] if r["kernel"] != r["op"] else ""
        lines.append(f"| {i} | {r['op']} | {r['program']} | {r['hlo']} | {r['ms_per_step']:.3f} | "
                     f"{r['share']:.1%} | {r['calls_per_step']:g} | {kernel[:80]} |")  # fmt: skip
    if report.get("banner"):
        lines += ["", report["banner"]]
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------------------- part


def ops_part(size, info: dict, out: Path, warmup: int, runs: int) -> dict:
    """The tower at `size.encoder_tiles` tiles (module docstring): timed, traced, its top ops."""
    import jax
    import jax.numpy as jnp

    from dflop_jax.costs import get_arch
    from dflop_jax.profiling.model_profiler import compile_residual_programs, time_call
    from dflop_jax.profiling.programs import StageShape, build_program
    from dflop_jax.programs.devices import local_attention_kernels
    from dflop_jax.programs.model_section import model_config_for_arch

    arch = get_arch(size.arch)
    impl = local_attention_kernels().vision
    base = model_config_for_arch(arch, "bfloat16")
    model_cfg = dataclasses.replace(base, vision=base.vision.replace(attention_impl=impl))
    shape = StageShape("encoder", arch.vision.num_layers, has_embedding=True)
    tiles = size.encoder_tiles
    prog = build_program(model_cfg, shape, 1, tiles, jax.devices()[:1], jnp.bfloat16,
                         residuals="all")  # fmt: skip
    fwd_c, bwd_c = compile_residual_programs(prog)
    programs = {"fwd": hlo_ops(fwd_c.as_text()), "bwd": hlo_ops(bwd_c.as_text())}
    rng = np.random.default_rng(0)
    params = prog.make_params(rng)
    x, side, seed = prog.make_inputs(rng)
    zeros = lambda a: jax.device_put(np.zeros(a.shape, a.dtype), a.sharding)  # noqa: E731
    gacc = [jax.tree.map(zeros, prog.gacc_abs)]

    def forward():
        return fwd_c(params, x, side)

    def backward():
        res = forward()[1]
        out_ = bwd_c(params, res, seed, gacc[0])
        gacc[0] = out_[-1]  # donated: feed the accumulator back
        return out_

    held = forward()[1]

    def backward_only():
        out_ = bwd_c(params, held, seed, gacc[0])
        gacc[0] = out_[-1]
        return out_

    with jax.set_mesh(prog.mesh):
        fwd_s = time_call(forward, warmup, runs, "median")
        bwd_s = time_call(backward_only, warmup, runs, "median")
        trace_dir = out / "ops_trace"
        shutil.rmtree(trace_dir, ignore_errors=True)
        t0 = time.perf_counter()
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            for _ in range(runs):
                jax.block_until_ready(backward())
        traced_s = time.perf_counter() - t0
    source, rows = op_times(trace_events(trace_dir))
    if not rows:
        procs, threads = _names(trace_events(trace_dir))
        raise RuntimeError(f"no op events in the trace at {trace_dir} (processes "
                           f"{sorted(procs.values())}, {len(threads)} threads)")  # fmt: skip
    top, op_ms = top_ops(rows, programs, runs)
    report = {"program": f"vision tower {arch.vision.num_layers} layers + patch embedding",
              "arch": size.arch, "tiles": tiles, "tokens_per_tile": arch.vision.tokens_per_tile,
              "attention": impl, "device": info["gpu_name"] or info["device_kind"],
              "fwd_s": fwd_s, "bwd_s": bwd_s, "runs": runs, "traced_steps": runs,
              "traced_s": traced_s, "source": source, "ops": len(rows),
              "op_ms_per_step": op_ms, "modules": {p: m for p, (m, _) in programs.items()},
              "top": top, "banner": None if info["gpu"] else CPU_BANNER}  # fmt: skip
    report["table_md"] = table_markdown(report)
    return report


def print_ops(rep: dict, info: dict, label: str) -> None:
    print("\n## per-op profile: " + rep["table_md"].splitlines()[0].lstrip("# ") + label)
    print("\n".join(rep["table_md"].splitlines()[1:]))
