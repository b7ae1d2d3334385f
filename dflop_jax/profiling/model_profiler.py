"""Model profiler (DESIGN section 6): compiled-step cost tables per stage part, tp and bucket.

    python -m dflop_jax.profile model --config configs/profile_tiny_cpu.yaml [key=value ...]

For every stage part (`profiling/table.py` STAGE_KINDS), candidate tp (dividing the module's heads and
KV heads, within the devices) and bucket: take the runtime's programs of the part
(`profiling/programs.py`; layer parts with 1 and 2 layers), lower and compile them from abstract
sharded inputs, record
`cost_analysis()` and `memory_analysis()`, skip what is over the device memory, then time the forward
and backward programs on the real devices (warm-up, median of `runs`). The programs are those of the
residual policy `profile.residuals` (default "all", what the run's "auto" trains wherever it fits:
the forward that keeps its residuals and the backward from them, no forward run twice). Writes the
cost table after every entry (so an interrupted run resumes: entries of a table with the same config
hash and code version are reused) and `<table stem>.png` (time vs bucket per part).

Under a training recipe (`trainable`, e.g. LLaVA-OV stage 1's projector only) every part is profiled
with the programs it runs under that recipe (`programs.stage_program`): a frozen part behind a trained
one times its dx-only backward, a frozen part with nothing trained before it has no backward (bwd_s 0),
so planning from the table uses measured frozen costs (`costs/measured.py`). The table records its
recipe (`ProfiledCostTable.trainable`) and the hash includes it: a table is never resumed across
recipes.

The colocated stage is measured too (kind colocated_embedding, COLOCATED_KINDS): the
runtime's own colocated stage program (`abstract_stage(..., colocated=True)`, as the trainer builds LLM
stage 0 of a layout without encoder stages) with no LLM layer, at each encoder bucket (tiles per shard)
and a row of the smallest LLM bucket, at the tps dividing both models' heads. The cost provider takes
the colocated stage's encoder share from it (`costs/measured.py`), so a colocated plan is scored with the
program that trains, not with a separately compiled encoder.

A model with an audio encoder (omni) adds the audio encoder's parts (AUDIO_KINDS: audio_embedding,
audio_layers, audio_head), each the runtime's audio stage program over one packed audio row of
`profile.audio_buckets` mel frames (windows of at most 30 s back to back), at the tps dividing the
audio heads and MLP. The provider prices audio stages from them, and the audio encoder LLM stage 0
runs (a layout without audio stages) as the same parts summed, re-run in that program's backward
when frozen (`costs/measured.py`); no audio encoder: no audio entries.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflop_jax.contracts.profile_settings import ProfileSettings
from dflop_jax.costs.recipe import TRAINABLE_PARTS, check_trainable
from dflop_jax.profiling.programs import (
    build_colocated,
    build_part,
    compile_residual_programs,
    held_residual_bytes,
    per_device_bytes,
)
from dflop_jax.profiling.table import (
    AUDIO_KINDS,
    COLOCATED_KINDS,
    LAYER_KINDS,
    STAGE_KINDS,
    CostEntry,
    ProfiledCostTable,
    code_version,
    config_hash,
    load_table,
    save_table,
)

log = logging.getLogger(__name__)
ProgressFn = Callable[[str, int, int], None]
# Directories and files whose code a table measures: the models, the profiler, the compiled programs
# (the one stage program builder, its rules, and what decides a recipe's trained leaves), what decides
# a stage's role and the packing that shapes its inputs.
CODE_PACKAGES = (
    "models",
    "dflop_jax/profiling",
    "dflop_jax/programs",
    "dflop_jax/costs/recipe.py",
    "dflop_jax/data/packing.py",
)


def candidate_tps(model_cfg, kind: str, tps: Sequence[int], num_devices: int) -> list[int]:
    """The tps of `tps` usable for `kind`: dividing its heads (and KV heads), within the devices; a
    colocated kind runs both models at one tp (`programs.stage_builder.check_colocated`)."""
    from models.stage_modules import audio_part

    text = (model_cfg.text.num_heads, model_cfg.text.num_kv_heads)
    if kind in AUDIO_KINDS:  # the audio stage's tp splits its heads and its MLP
        part = audio_part(model_cfg)
        if part is None:
            return []
        a = part.audio
        heads = (a.num_heads, a.intermediate_size)
    elif not hasattr(model_cfg, "vision") and (
        kind in COLOCATED_KINDS or kind.startswith("encoder")
    ):
        return []  # no vision encoder to time
    elif kind in COLOCATED_KINDS:
        heads = (model_cfg.vision.num_heads, *text)
    elif kind.startswith("encoder"):
        heads = (model_cfg.vision.num_heads,)
    else:
        heads = text
    return [t for t in sorted(set(tps)) if t <= num_devices and all(h % t == 0 for h in heads)]


def table_hash(model_cfg, settings: ProfileSettings, devices, trainable=TRAINABLE_PARTS) -> str:
    """What makes measured entries comparable: the model, dtype, device kind/count, jax version and
    the recipe (only when it freezes a part: all-trainable hashes are those of tables written before
    recipes) and the residual policy (only when it saves residuals, likewise). The grid (tps,
    buckets, kinds) and the timing repeats are not part of it, so a bigger grid reuses the entries it
    shares with a smaller one."""
    what = {
        "model": dataclasses.asdict(model_cfg),
        "compute_dtype": settings.compute_dtype,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "jax": jax.__version__,
    }
    if set(trainable) != set(TRAINABLE_PARTS):
        what["trainable"] = list(trainable)
    if settings.residuals != "recompute":
        what["residuals"] = settings.residuals
    return config_hash(what)


def _memory(compiled) -> dict[str, float]:
    m = compiled.memory_analysis()
    out = {
        "argument": float(m.argument_size_in_bytes),
        "output": float(m.output_size_in_bytes),
        "temp": float(m.temp_size_in_bytes),
        "alias": float(m.alias_size_in_bytes),
    }
    summed = out["argument"] + out["output"] + out["temp"] - out["alias"]
    out["peak"] = max(float(getattr(m, "peak_memory_in_bytes", 0) or 0), summed)
    return out


def _cost(compiled) -> tuple[float, float]:
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, (list, tuple)) else c
    return float(c.get("flops", 0.0)), float(c.get("bytes accessed", 0.0))


def time_call(call: Callable[[], object], warmup: int, runs: int, statistic: str) -> float:
    """The median or the minimum (`statistic`) of `runs` timed calls after `warmup` untimed ones."""
    for _ in range(warmup):
        jax.block_until_ready(call())
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return float(np.median(times) if statistic == "median" else np.min(times))


def measure_program(prog, settings: ProfileSettings, seed: int = 0, repeats: int = 1) -> dict:
    """Compiles `prog` (a `programs.PartProgram`) from its abstract inputs, records cost and memory
    analyses, and (unless over `settings.memory_limit_bytes`) times it on its mesh's devices.

    The programs are the ones the stage trains with: under a saving residual policy
    (`prog.jits.forward_residuals` set) the forward that keeps its residuals and the backward from
    them, else the forward and the backward that recomputes it.

    Returns CostEntry fields: flops_*, bytes_*, memory_*, param_bytes, copy_bytes,
    taken_param_bytes, input_bytes, compile_s (the seconds lowering and compiling took), and fwd_s /
    bwd_s, or status "skipped" with a reason. With repeats > 1 the timing is repeated (independent
    medians) and "fwd_reps" / "bwd_reps" list them (fwd_s / bwd_s are the first).
    """
    saving = prog.jits is not None and prog.jits.forward_residuals is not None
    t0 = time.perf_counter()
    fwd_c, bwd_c = compile_residual_programs(prog) if saving else _recompute_pair(prog)
    compile_s = time.perf_counter() - t0
    mem_f, mem_b = _memory(fwd_c), {} if bwd_c is None else _memory(bwd_c)
    (flops_f, bytes_f), (flops_b, bytes_b) = (
        _cost(fwd_c),
        (0.0, 0.0) if bwd_c is None else _cost(bwd_c),
    )
    kept = held_residual_bytes(prog, fwd_c) if saving else 0.0
    stats = dict(
        flops_fwd=flops_f, flops_bwd=flops_b, bytes_fwd=bytes_f, bytes_bwd=bytes_b,
        memory_fwd=mem_f, memory_bwd=mem_b, param_bytes=per_device_bytes(prog.masters),
        copy_bytes=prog.copy_bytes, taken_param_bytes=per_device_bytes(prog.params_abs),
        input_bytes=per_device_bytes((prog.x_abs, prog.side_abs)),
        grad_bytes=per_device_bytes(prog.gacc_abs), residual_bytes=max(kept, 0.0),
        compile_s=compile_s,
    )  # fmt: skip
    peak = max(mem_f["peak"], mem_b.get("peak", 0.0))
    if peak > settings.memory_limit_bytes:
        limit = settings.memory_limit_bytes
        reason = f"compiled peak {peak / 2**20:.0f} MiB > limit {limit / 2**20:.0f} MiB"
        return dict(stats, status="skipped", reason=reason)
    rng = np.random.default_rng(seed)
    params = prog.make_params(rng)
    x, side, seed = prog.make_inputs(rng)
    zeros = lambda a: jax.device_put(np.zeros(a.shape, a.dtype), a.sharding)
    gacc = [jax.tree.map(zeros, prog.gacc_abs)]
    # the backward's first input: the forward inputs, or the residuals one real forward kept
    held = (x, side) if not saving else (fwd_c(params, x, side)[1],)

    def backward():
        out = bwd_c(params, *held, seed, gacc[0])
        gacc[0] = out[-1]  # donated: feed the accumulator back
        return out

    fwd, bwd = [], []
    timing = (settings.warmup, settings.runs, settings.statistic)
    with jax.set_mesh(prog.mesh):
        for _ in range(repeats):
            fwd.append(time_call(lambda: fwd_c(params, x, side), *timing))
            bwd.append(0.0 if bwd_c is None else time_call(backward, *timing))
    out = dict(stats, fwd_s=fwd[0], bwd_s=bwd[0])
    return out if repeats == 1 else dict(out, fwd_reps=fwd, bwd_reps=bwd)


def _recompute_pair(prog):
    """(forward, backward or None) of `prog`, compiled: the backward re-runs the forward."""
    with jax.set_mesh(prog.mesh):
        fwd = prog.fwd.lower(prog.params_abs, prog.x_abs, prog.side_abs).compile()
        bwd = None if prog.bwd is None else prog.bwd.lower(
            prog.params_abs, prog.x_abs, prog.side_abs, prog.seed_abs, prog.gacc_abs
        ).compile()  # fmt: skip
    return fwd, bwd


def profile_entry(
    model_cfg, kind, tp, bucket, layers, devices, settings, seed=0, trainable=TRAINABLE_PARTS
) -> CostEntry:
    """Compiles, analyses and times one table part under `trainable`; over-memory entries come back
    skipped. A colocated kind's row is the smallest LLM bucket (its llm_embedding entry is then measured,
    not fitted, when the provider subtracts it)."""
    dtype = jnp.dtype(settings.compute_dtype)
    if kind in COLOCATED_KINDS:
        length = min(settings.llm_buckets)
        prog = build_colocated(model_cfg, tp, bucket, length, devices, dtype, trainable,
                               settings.residuals)  # fmt: skip
        return CostEntry(kind, tp, bucket, layers, length=length,
                         **measure_program(prog, settings, seed))  # fmt: skip
    prog = build_part(model_cfg, kind, tp, bucket, layers, devices, dtype, trainable,
                      settings.residuals)  # fmt: skip
    return CostEntry(kind, tp, bucket, layers, **measure_program(prog, settings, seed))


def _grid(
    model_cfg, settings: ProfileSettings, num_devices: int
) -> list[tuple[str, int, int, int]]:
    grid = []
    for kind in settings.kinds:
        tiles = kind.startswith("encoder") or kind in COLOCATED_KINDS
        buckets = settings.encoder_buckets if tiles else settings.llm_buckets
        if kind in AUDIO_KINDS:
            buckets = settings.audio_buckets
        layer_counts = (1, 2) if kind in LAYER_KINDS else (0,)
        for tp in candidate_tps(model_cfg, kind, settings.tps, num_devices):
            grid += [(kind, tp, b, n) for b in sorted(set(buckets)) for n in layer_counts]
    return grid


def _fresh_or_resumed(path: Path, meta: dict) -> ProfiledCostTable:
    if path.is_file():
        try:
            old = load_table(path)
        except ValueError as e:
            log.warning("ignoring unreadable cost table %s: %s", path, e)
        else:
            if (old.config_hash, old.code_version) == (meta["config_hash"], meta["code_version"]):
                log.info("resuming %s (%d entries reused)", path, len(old.entries))
                return old
            log.info("cost table %s is stale (config or code changed): re-profiling", path)
    return ProfiledCostTable(**meta)


def profile_model(
    model_cfg,
    devices: Sequence | None = None,
    settings: ProfileSettings | None = None,
    out_path: str | Path = "runs/profile/cost_table.json",
    *,
    model_name: str = "",
    progress: ProgressFn | None = None,
    plot: bool = True,
    trainable: Sequence[str] = TRAINABLE_PARTS,
) -> ProfiledCostTable:
    """Profiles every (part, tp, bucket, layers) of the grid; returns the (saved) cost table.

    Args:
      model_cfg: a `models` config with an encoder (e.g. `LlavaOnevisionConfig`: vision, text,
        tokens_per_tile...; a `Qwen2AudioConfig`: audio and text, no vision kinds).
      devices: devices to profile on (default `jax.devices()`); tp programs use the first tp.
      settings: the grid and the timing settings (None: `ProfileSettings()`).
      out_path: cost-table JSON path (resumed if it holds entries of the same config and code).
      model_name: recorded in the table.
      progress: callback (phase, done, total), e.g. `planner.progress.progress_bar`.
      plot: also write `<out_path stem>.png`.
      trainable: the training recipe's trained parts: each part is profiled with the programs it
        runs under it (module docstring).
    """
    trainable = check_trainable(trainable, "trainable")
    devices = list(jax.devices() if devices is None else devices)
    settings = ProfileSettings() if settings is None else settings
    out_path = Path(out_path)
    meta = dict(
        device_kind=devices[0].device_kind, platform=devices[0].platform,
        device_count=len(devices), config_hash=table_hash(model_cfg, settings, devices, trainable),
        code_version=code_version(*CODE_PACKAGES), model=model_name,
        jax_version=jax.__version__, flax_version=_flax_version(),
        settings={"warmup": settings.warmup, "runs": settings.runs,
                  "compute_dtype": settings.compute_dtype}, trainable=trainable,
        residuals=settings.residuals,
    )  # fmt: skip
    table = _fresh_or_resumed(out_path, meta)
    grid = _grid(model_cfg, settings, len(devices))
    todo = [key for key in grid if key not in table.entries]
    report = progress or (lambda *_: None)
    t0 = time.perf_counter()
    for i, (kind, tp, bucket, layers) in enumerate(todo):
        report("profile model", i, len(todo))
        try:
            entry = profile_entry(model_cfg, kind, tp, bucket, layers, devices, settings,
                                  trainable=trainable)  # fmt: skip
        except Exception as e:
            entry = CostEntry(kind, tp, bucket, layers, status="skipped",
                              reason=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")  # fmt: skip
        if not entry.ok:
            log.warning("skipped %s tp=%d bucket=%d layers=%d: %s",
                        kind, tp, bucket, layers, entry.reason)  # fmt: skip
        table.add(entry)
        save_table(table, out_path)
    report("profile model", len(todo), len(todo))
    save_table(table, out_path)
    log.info("profiled %d entries (%d reused) in %.1f s -> %s",
             len(todo), len(grid) - len(todo), time.perf_counter() - t0, out_path)  # fmt: skip
    if plot:
        plot_table(table, out_path.with_suffix(".png"))
    return table


def _flax_version() -> str:
    import flax

    return flax.__version__


def plot_table(table: ProfiledCostTable, path: str | Path) -> Path:
    """PNG: forward + backward milliseconds vs bucket, one panel per part, one line per (tp, layers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in (*STAGE_KINDS, *AUDIO_KINDS) if table.tps(k)]
    rows = max(2, -(-len(kinds) // 3))
    fig, axes = plt.subplots(rows, 3, figsize=(13, 3.5 * rows), squeeze=False)
    for ax in axes.flat[len(kinds) :]:
        ax.set_visible(False)
    for ax, kind in zip(axes.flat, kinds):
        for tp in table.tps(kind):
            for n in (1, 2) if kind in LAYER_KINDS else (0,):
                bs = table.buckets(kind, tp, n)
                ms = [
                    1e3 * (table.get(kind, tp, b, n).fwd_s + table.get(kind, tp, b, n).bwd_s)
                    for b in bs
                ]
                ax.plot(bs, ms, marker="o", label=f"tp{tp}" + (f" L{n}" if n else ""))
        ax.set_title(kind)
        unit = {"encoder": "tiles", "audio": "mel frames"}.get(kind.split("_")[0], "tokens")
        ax.set_xlabel(unit)
        ax.set_ylabel("fwd + bwd ms")
        ax.legend(fontsize=7)
    fig.suptitle(f"{table.model} on {table.device_count} x {table.device_kind}")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
