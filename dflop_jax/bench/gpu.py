"""The figures only a GPU can give: attention path, a real-size stage at MFU, profiler accuracy, host overhead.

    python -m dflop_jax.bench gpu [parts=attention,stage,profiler,host] [size=real|small|smoke]
                                  [remat=none,full,dots] [residuals=all,recompute]
                                  [attention=xla,cudnn,pallas] [out=runs/bench_gpu]
                                  [json_out=runs/bench_gpu/gpu.json]

Each part measures against the strongest alternative in the same run:
  attention  each implementation of `models.attention.attention` that runs here (XLA; on a GPU cuDNN,
             and a Pallas kernel where this tree has one: the others are listed with why not) on packed
             rows (one long sample vs 16 packed samples): output and gradient parity against XLA and
             against a dense fp32 reference (bf16 tolerances ATTN_TOL), time, achieved TFLOP/s (model
             FLOPs: causal pairs x 4 Dh H forward, 3x that forward + backward) and XLA's temp memory.
  stage      forward + backward of LLM layers (4 Qwen2.5-7B layers at 8192 tokens) and of the SigLIP-400M
             tower on a bucket of 384 px tiles, each as the runtime's own stage program (the profiler's
             `programs.build_program` -> `runtime.stages.stage_jits`, bf16 compute, fp32 weights), timed
             by the profiler's `measure_program` as training runs them under a residual policy
             (`residuals=`: "all", the forward keeps its residuals and the backward runs none of it
             again; "recompute", the backward re-runs the forward): step = fwd + bwd; MFU = model
             FLOPs (`costs.flops`, 3x forward) / (step x peak), HFU counts what the backward re-runs.
             One row per attention implementation (`attention=`), then the LLM stage under each
             other residual policy and each other remat policy (`remat=`; every policy on a GPU).
             The JSON is rewritten after each row.
  profiler   the trainer's `plan: auto` (data profile -> the model profiler on these devices -> plan;
             on one device the encoder colocated with the LLM, one stage) trains the demo's model with
             stage times measured every step: per (stage, bucket) the
             scheduler's predicted vs measured times, MAPE raw and after the adaptive correction (out
             of sample: the factors learned before the step, those its schedule was made with). The
             last stage runs fwd + bwd fused; the trainer splits its time by the predicted ratio.
  host       a pipelined decoder trained a few steps: host seconds to dispatch a step (the driver
             call, before anything blocks) vs the step time, and the loader's data wait.
Peak FLOP/s: the `costs.devices` preset of the GPU `nvidia-smi` names (H200: the H100 preset, the same
dense bf16 peak), else the measured fp32 matmul peak of one device (`runtime.metrics`), as on CPU.
On CPU every figure is labelled "CPU: figures are not GPU figures": sizes are tiny, stages share cores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Literal

import numpy as np

from dflop_jax.bench._accuracy import mape
from dflop_jax.bench._cli import command, load
from dflop_jax.config import require
from dflop_jax.host_devices import simulate_cpu_devices

BENCH_PARTS = ("attention", "stage", "profiler", "host")
CPU_BANNER = "CPU: figures are not GPU figures"
# Goals on one H100: LLM stage MFU, and the profiler's stage-time prediction error.
GOAL_LLM_MFU, GOAL_RAW_MAPE, GOAL_CORRECTED_MAPE = 0.55, 0.10, 0.05
# bf16 parity: max |a - b| / max |reference| (8-bit mantissa: 2^-8 per rounding, sums of many terms).
ATTN_TOL = {"out": 2e-2, "grad": 5e-2}
DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


@dataclasses.dataclass(frozen=True)
class Size:
    """What each part runs at one size.

    Attributes:
      attn_lengths: packed row lengths; attn_heads: (query heads, kv heads, head dim); attn_packed:
        samples of the packed case.
      arch: `costs.get_arch` name of the stage part; llm_layers / llm_tokens: its LLM stage;
        encoder_tiles: its vision stage's tile bucket (the whole tower with its patch embedding).
      profiler: overrides of `configs/demo.yaml` for the profiler part (the demo's model, plan: auto).
      host: TrainConfig overrides of the host part's decoder; host_layers: its layers (split over
        up to 2 pipeline stages); host_tokens: its packed row length.
      steps: training steps of the profiler and host parts (the first ones compile).
    """

    attn_lengths: tuple[int, ...]
    attn_heads: tuple[int, int, int]
    attn_packed: int
    arch: str
    llm_layers: int
    llm_tokens: int
    encoder_tiles: int
    profiler: tuple[str, ...]
    host: tuple[str, ...]
    host_layers: int
    host_tokens: int
    steps: int


_PROFILE_SMALL = ("profile.tps=[1]", "profile.encoder_buckets=[1, 2, 4]", "profile.llm_buckets=[128, 256, 512]",
                  "profile.warmup=1", "profile.runs=2", "data.max_tokens=512", "data.max_grid=1",
                  "data.max_frames=2", "data.synth_samples=64", "planner.tp=[1]",
                  "planner.encoder_pp=[1]", "planner.llm_pp=[1]", "planner.microbatches=[2, 4]",
                  "planner.num_buckets=[2]", "planner.samples=1", "planner.screen_top=2",
                  "planner.top_n=1", "global_batch=8")  # fmt: skip
# The CI smoke size: one profiled bucket per module (predictions scale with the bucket), one planned
# bucket pair and microbatch count (the fewest programs to compile), 2-layer decoder.
_PROFILE_SMOKE = (*_PROFILE_SMALL, "profile.encoder_buckets=[1]", "profile.llm_buckets=[256]",
                  "data.max_tokens=256", "profile.warmup=0", "profile.runs=1",
                  "planner.num_buckets=[1]", "planner.microbatches=[2]")  # fmt: skip
_HOST_SMALL = ("model.hidden_size=64", "model.intermediate_size=128", "model.num_heads=4",
               "model.num_kv_heads=2", "model.head_dim=16")  # fmt: skip
_SMALL = dict(arch="tiny", attn_packed=16, host=_HOST_SMALL, host_layers=2, host_tokens=256)
SIZES = {
    "smoke": Size(
        attn_lengths=(64, 128),
        attn_heads=(4, 2, 16),
        llm_layers=2,
        llm_tokens=128,
        encoder_tiles=2,
        profiler=_PROFILE_SMOKE,
        steps=3,
        **_SMALL,
    ),
    "small": Size(
        attn_lengths=(128, 256),
        attn_heads=(4, 2, 32),
        llm_layers=4,
        llm_tokens=256,
        encoder_tiles=4,
        profiler=_PROFILE_SMALL,
        steps=6,
        **_SMALL,
    ),
    "real": Size(
        attn_lengths=(4096, 8192),
        attn_heads=(28, 4, 128),
        attn_packed=16,
        arch="siglip-so400m+qwen2.5-7b",
        llm_layers=4,
        llm_tokens=8192,
        encoder_tiles=16,
        profiler=("global_batch=16", "planner.encoder_pp=[1]", "planner.llm_pp=[1]"),
        host=(
            "model.hidden_size=2048",
            "model.intermediate_size=5504",
            "model.num_heads=16",
            "model.num_kv_heads=4",
            "model.head_dim=128",
        ),
        host_layers=16,
        host_tokens=4096,
        steps=12,
    ),
}


# ---------------------------------------------------------------------------------------------- device


def nvidia_smi_name() -> str | None:
    """The first GPU's name as `nvidia-smi` reports it (None without nvidia-smi)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return f"(nvidia-smi failed: {e})"
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def device_info() -> dict:
    """Platform, device count, GPU name, and the peak FLOP/s MFU is measured against (with its source:
    the preset of the device JAX reports; `device.*` figures are needed for a kind with none)."""
    import jax

    from dflop_jax.costs import DeviceConfig
    from dflop_jax.runtime.device import run_device

    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    name = nvidia_smi_name() if gpu else None
    spec = run_device(DeviceConfig())
    peak, source = spec.peak_flops, f"costs.devices preset {spec.name!r} (dense bf16)"
    return {"platform": dev.platform, "gpu": gpu, "gpu_name": name, "device_kind": dev.device_kind,
            "num_devices": len(jax.devices()), "peak_flops": peak, "peak_source": source}  # fmt: skip


# ------------------------------------------------------------------------------------------- attention


def _attention_inputs(length: int, samples: int, heads: tuple[int, int, int], rng):
    """bf16 q, k, v of one packed row of `samples` equal segments (no padding), and an fp32 cotangent."""
    import jax.numpy as jnp

    h, kv, dh = heads
    q, k, v, dy = (rng.standard_normal((1, length, n, dh)).astype(np.float32)
                   for n in (h, kv, kv, h))  # fmt: skip
    seg = np.repeat(np.arange(1, samples + 1, dtype=np.int32), length // samples)[None]
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    return bf(q), bf(k), bf(v), jnp.asarray(seg), jnp.asarray(dy)


def _reference_attention(q, k, v, seg):
    """Dense fp32 segment-causal attention, one head at a time (independent of `models/`)."""
    import jax
    import jax.numpy as jnp

    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    rep, length, dh = q.shape[2] // k.shape[2], q.shape[1], q.shape[3]
    mask = (seg[0][:, None] == seg[0][None, :]) & jnp.tril(jnp.ones((length, length), bool))

    def head(h):
        s = (q[0, :, h] @ k[0, :, h // rep].T) * dh**-0.5
        p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
        return p @ v[0, :, h // rep]

    return jax.lax.map(head, jnp.arange(q.shape[2])).transpose(1, 0, 2)[None]


def _fwd_bwd(fn):
    """jit of (q, k, v, seg, dy) -> (out, (dq, dk, dv)) of `fn(q, k, v, seg)`."""
    import jax

    def run(q, k, v, seg, dy):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
        return out, vjp(dy.astype(out.dtype))

    return jax.jit(run)


def _time(fn, args, warmup: int, runs: int) -> float:
    """Median seconds of `fn(*args)` after `warmup` untimed calls."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _rel_err(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def _parity(a, b) -> dict:
    """Relative max errors of outputs and of each gradient of result `a` against result `b`."""
    (out_a, grads_a), (out_b, grads_b) = a, b
    grad = max(_rel_err(ga, gb) for ga, gb in zip(grads_a, grads_b))
    out = _rel_err(out_a, out_b)
    return {"out": out, "grad": grad, "ok": out <= ATTN_TOL["out"] and grad <= ATTN_TOL["grad"]}


def _compiled(fn, args):
    """(compiled program, its temp bytes from XLA's memory analysis, None where not reported)."""
    import jax

    compiled = jax.jit(fn).lower(*args).compile()
    mem = compiled.memory_analysis()
    return compiled, (None if mem is None else int(mem.temp_size_in_bytes))


def attention_case(length: int, samples: int, heads, impls, warmup: int, runs: int) -> dict:
    """One packed row: each implementation's time, TFLOP/s, temp memory and parity (vs fp32 and vs XLA)."""
    import jax

    from dflop_jax.costs.flops import causal_pairs
    from models.attention import attention

    q, k, v, seg, dy = _attention_inputs(length, samples, heads, np.random.default_rng(length))
    fwd_flops = 4.0 * heads[2] * heads[0] * causal_pairs([length // samples] * samples)
    ref = jax.device_get(_fwd_bwd(_reference_attention)(q, k, v, seg, dy))
    row = {"length": length, "samples": samples, "fwd_flops": fwd_flops, "impls": {}}
    results = {}
    for impl in impls:
        fn = lambda q, k, v, seg, impl=impl: attention(q, k, v, segment_ids=seg, causal=True,  # noqa: E731
                                                       implementation=impl)  # fmt: skip
        fwd, fwd_mem = _compiled(fn, (q, k, v, seg))
        both, both_mem = _compiled(_fwd_bwd(fn), (q, k, v, seg, dy))
        results[impl] = jax.device_get(both(q, k, v, seg, dy))
        t_f = _time(fwd, (q, k, v, seg), warmup, runs)
        t_fb = _time(both, (q, k, v, seg, dy), warmup, runs)
        row["impls"][impl] = {"fwd_s": t_f, "fwd_bwd_s": t_fb, "fwd_tflops": fwd_flops / t_f / 1e12,
                              "fwd_bwd_tflops": 3 * fwd_flops / t_fb / 1e12,
                              "fwd_temp_bytes": fwd_mem, "fwd_bwd_temp_bytes": both_mem,
                              "vs_fp32": _parity(results[impl], ref)}  # fmt: skip
    for impl in results:  # a probe of one implementation alone has no XLA result to compare with
        if impl != "xla" and "xla" in results:
            row[f"{impl}_vs_xla"] = _parity(results[impl], results["xla"])
    return row


def attention_impls(info: dict, wanted=()) -> tuple[tuple[str, ...], dict[str, str]]:
    """(the implementations to measure, {implementation: why not} for the others).

    Of `wanted` (() = all): XLA always runs; on a GPU every other implementation the decoder accepts
    (`models.decoder_config.ATTENTION_IMPLS`: cuDNN, and a Pallas kernel where this tree has one)
    that runs a small packed row forward and backward here."""
    from models.decoder_config import ATTENTION_IMPLS

    others = tuple(i for i in ("cudnn", "pallas") if not wanted or i in wanted)
    xla = ["xla"] if not wanted or "xla" in wanted else []
    if not info["gpu"]:
        return tuple(xla), {i: "needs a GPU" for i in others}
    usable, missing = xla, {}
    for impl in others:
        if impl not in ATTENTION_IMPLS:
            missing[impl] = (
                f"not built: not in models.decoder_config.ATTENTION_IMPLS {ATTENTION_IMPLS}"
            )
            continue
        try:
            if impl == "cudnn":  # its paths fall back to Pallas where cuDNN is absent: probe cuDNN
                _probe_cudnn()
            attention_case(256, 2, (4, 2, 64), (impl,), 0, 1)
        except Exception as e:  # the probe's purpose: an implementation that cannot run here
            missing[impl] = (
                f"fails here: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            )
            continue
        usable.append(impl)
    return tuple(usable), missing


def _probe_cudnn() -> None:
    """One bf16 forward and backward of jax's cuDNN attention (raises where cuDNN cannot run)."""
    import jax
    import jax.numpy as jnp

    from models.cudnn_attention import prefix_attention

    q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
    loss = lambda q: prefix_attention(q, q, q, None, True).astype(jnp.float32).sum()
    jax.block_until_ready(jax.grad(loss)(q))


def attention_part(size: Size, info: dict, warmup: int, runs: int, wanted=()) -> dict:
    """Packed rows at the size's lengths, one sample and `size.attn_packed` samples, per implementation
    of `wanted` (() = all that run here) and XLA, the reference of the parity columns."""
    impls, missing = attention_impls(info, (*wanted, "xla") if wanted else ())
    cases = [attention_case(n, s, size.attn_heads, impls, warmup, runs)
             for n in size.attn_lengths for s in (1, size.attn_packed)]  # fmt: skip
    note = (
        None
        if info["gpu"]
        else "CPU: the cuDNN and (compiled) Pallas paths need a GPU; only the XLA path ran"
    )
    return {"heads": list(size.attn_heads), "tolerance": ATTN_TOL, "impls": list(impls),
            "not_measured": missing, "note": note, "cases": cases}  # fmt: skip


# ----------------------------------------------------------------------------------------------- stage


def _stage_cases(arch, size: Size):
    """(name, StageShape, bucket, model FLOPs of fwd + bwd) of the stage part."""
    from dflop_jax.costs.flops import causal_pairs, llm_layer_flops, vision_flops_per_tile
    from dflop_jax.profiling.programs import StageShape

    n, tiles = size.llm_tokens, size.encoder_tiles
    llm = 3 * size.llm_layers * llm_layer_flops(arch.llm, n, causal_pairs([n]))
    vit = 3 * tiles * vision_flops_per_tile(arch.vision)
    return (
        (f"llm {size.llm_layers} layers", StageShape("llm", size.llm_layers), n, llm),
        (f"vision tower {arch.vision.num_layers} layers + patch embedding",
         StageShape("encoder", arch.vision.num_layers, has_embedding=True), tiles, vit),
    )  # fmt: skip


def _stage_variants(impls, remats, policies) -> list[tuple[str, str, str, str]]:
    """(module, attention implementation, LLM remat, residual policy) per stage program timed, most
    telling first (a deadline keeps the first rows): the LLM stage per implementation under the first
    residual policy (no remat), then under each other policy with the first implementation after
    XLA (the fused kernel where one runs), the vision tower per implementation, then the LLM stage
    under each other remat policy (first policy, that implementation)."""
    best = impls[1] if len(impls) > 1 else impls[0]
    first = policies[0]
    return ([("llm", i, "none", first) for i in impls]
            + [("llm", best, "none", p) for p in policies[1:]]
            + [("encoder", i, "none", first) for i in impls]
            + [("llm", best, r, first) for r in remats if r != "none"])  # fmt: skip


def hardware_factor(residuals: str, remat: str) -> float:
    """Executed over model FLOPs of a stage step (matmuls): the backward's own 2x, plus the forward
    again where the backward re-runs it ("recompute": the stage's; "layers": each layer's; full
    layer remat under "recompute": a third time). "dots" remat keeps the matmuls' outputs."""
    again = (residuals != "all") + (residuals == "recompute" and remat == "full")
    return (3 + again) / 3


def stage_part(size: Size, info: dict, warmup: int, runs: int, remats=("none",),
               policies=("all",), impls=(), progress=lambda rows: None) -> dict:  # fmt: skip
    """Each stage program timed on one device by the profiler's `measure_program`, as the runtime
    trains it under each residual policy; MFU and HFU, per attention implementation (`impls`, () =
    every one that runs here) and LLM remat policy. `progress(rows)` after each row (partial saves)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from dflop_jax.costs import get_arch
    from dflop_jax.costs.flops import mfu
    from dflop_jax.profiling.model_config import model_config_for_arch
    from dflop_jax.profiling.model_profiler import measure_program
    from dflop_jax.profiling.programs import build_program
    from dflop_jax.profiling.settings import ProfileSettings
    from models.stages import with_remat

    arch = get_arch(size.arch)
    base = model_config_for_arch(arch, "bfloat16")
    settings = ProfileSettings(tps=(1,), warmup=warmup, runs=runs, memory_limit_bytes=2.0**60)
    cases = {shape.module: c for c in _stage_cases(arch, size) for shape in [c[1]]}
    impls, _ = attention_impls(info, impls)
    rows = []
    for module, impl, remat, residuals in _stage_variants(impls, remats, policies):
        name, shape, bucket, flops = cases[module]
        model_cfg = with_remat(base, {"vision": "none", "llm": remat})
        model_cfg = dataclasses.replace(model_cfg,
                                        vision=model_cfg.vision.replace(attention_impl=impl),
                                        text=model_cfg.text.replace(attention_impl=impl))  # fmt: skip
        key = {
            "stage": name,
            "module": shape.module,
            "bucket": bucket,
            "attention": impl,
            "remat": remat,
            "residuals": residuals,
        }
        try:
            prog = build_program(model_cfg, shape, 1, bucket, jax.devices()[:1], jnp.bfloat16,
                                 residuals=residuals)  # fmt: skip
            m = measure_program(prog, settings)
        except (
            Exception
        ) as e:  # one variant failing (out of memory, a kernel's limits) keeps the rest
            rows.append({**key, "error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"})
            progress(rows)
            continue
        step = m["fwd_s"] + m["bwd_s"]
        rows.append({**key, "fwd_s": m["fwd_s"], "bwd_s": m["bwd_s"], "step_s": step,
                     "model_flops": flops,
                     # XLA's count: a loop body once, whatever its trips (not the tiled attention's)
                     "xla_flops": m["flops_fwd"] + m["flops_bwd"],
                     "xla_bytes": m["bytes_fwd"] + m["bytes_bwd"],
                     "memory_peak_bytes": max(m["memory_fwd"]["peak"],
                                              m["memory_bwd"].get("peak", 0.0)),
                     "mfu": mfu(flops, step, 1, info["peak_flops"]),
                     "hfu": hardware_factor(residuals, remat) * flops / (step * info["peak_flops"])})  # fmt: skip
        progress(rows)
    return {"arch": size.arch, "peak_flops": info["peak_flops"], "stages": rows}


# -------------------------------------------------------------------------------------------- profiler


@contextlib.contextmanager
def _recorded_observations():
    """Records what the scheduler observes: per microbatch its buckets, measured [P, 2] stage times, the
    raw prediction and the corrected one taken before the observation updates the factors.

    The trainer exposes only window MAPEs, so this wraps `Scheduler.observe` for the duration.
    """
    from dflop_jax.scheduler.correction import Scheduler

    records: list[dict] = []
    original = Scheduler.observe

    def observe(self, schedule, measured):
        tix = {t: i for i, t in enumerate(self.correction.tiles)}
        six = {s: i for i, s in enumerate(self.correction.lengths)}
        for mb, meas in zip(schedule.microbatches, np.asarray(measured, np.float64)):
            raw = np.asarray(self.problem.stage_costs(mb.tile_bucket, mb.length_bucket))
            factor = self.correction.factor(tix[mb.tile_bucket], six[mb.length_bucket])
            records.append({"tile_bucket": int(mb.tile_bucket), "length_bucket": int(mb.length_bucket),
                            "raw": raw.tolist(), "corrected": (raw * factor).tolist(),
                            "measured": meas.tolist()})  # fmt: skip
        return original(self, schedule, measured)

    Scheduler.observe = observe
    try:
        yield records
    finally:
        Scheduler.observe = original


def stage_time_pairs(records: list[dict], layout) -> list[dict]:
    """One row per (observed microbatch, stage, direction) with a measured time > 0: the stage's bucket
    (tiles for encoder stages, tokens for LLM stages), raw and corrected predictions, measured."""
    rows = []
    for r in records:
        for p, spec in enumerate(layout.stages):
            bucket = r["tile_bucket"] if spec.module == "encoder" else r["length_bucket"]
            for d, direction in enumerate(("fwd", "bwd")):
                if r["measured"][p][d] > 0:
                    rows.append({"stage": p, "module": spec.module, "bucket": bucket,
                                 "direction": direction, "raw": r["raw"][p][d],
                                 "corrected": r["corrected"][p][d],
                                 "measured": r["measured"][p][d]})  # fmt: skip
    return rows


def summarize_pairs(pairs: list[dict]) -> dict:
    """MAPE (mean, worst) raw and corrected over all pairs, and per (stage, bucket) means."""
    col = lambda k, rows: np.array([r[k] for r in rows])  # noqa: E731
    groups: dict[tuple, list[dict]] = {}
    for r in pairs:
        groups.setdefault((r["stage"], r["module"], r["bucket"]), []).append(r)
    table = [{"stage": s, "module": m, "bucket": b, "n": len(rows),
              "measured": float(col("measured", rows).mean()), "raw": float(col("raw", rows).mean()),
              "raw_mape": mape(col("raw", rows), col("measured", rows))[0],
              "corrected_mape": mape(col("corrected", rows), col("measured", rows))[0]}
             for (s, m, b), rows in sorted(groups.items())]  # fmt: skip
    return {"mape_raw": mape(col("raw", pairs), col("measured", pairs)),
            "mape_corrected": mape(col("corrected", pairs), col("measured", pairs)),
            "per_stage_bucket": table}  # fmt: skip


def _train(config: Path | None, overrides: list[str]):
    """(config, report) of the trainer's library `run` on a fresh run directory (quiet console)."""
    from rich.console import Console

    from dflop_jax.config import load_config
    from dflop_jax.runtime.config import TrainConfig
    from dflop_jax.train import run

    cfg = load_config(TrainConfig, config, overrides)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    return cfg, run(cfg, console=Console(quiet=True))


def _metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]


def profiler_part(size: Size, info: dict, out: Path) -> dict:
    """plan: auto (the model profiler on these devices) then training with stage times measured."""
    from dflop_jax.planner import describe_layout

    # One device: the encoder runs inside the LLM stage (colocated), one stage, tp 1.
    single = ("planner.colocate=true", "planner.encoder_pp=[1]", "planner.llm_pp=[1]",
              "planner.tp=[1]", "profile.tps=[1]", "num_cpu_devices=1")  # fmt: skip
    run_dir = out / "profiler_run"
    # The scheduler observes a step's stage times `prefetch` batches later (`lagged_schedule.py`):
    # prefetch 1 and 2 more steps, so the measured steps 2..steps are all observed.
    overrides = [*size.profiler, *(single if info["num_devices"] < 2 else ()),
                 f"run_dir={run_dir}", f"data.synth_dir={out / 'synth_mm'}",
                 f"steps={size.steps + 2}", "prefetch=1", "measure_stage_times_every=1",
                 "checkpoint.every=0",
                 f"compilation_cache={out / 'jax_cache'}", f"device.peak_flops={info['peak_flops']}"]  # fmt: skip
    with _recorded_observations() as records:
        cfg, report = _train(DEMO_CONFIG, overrides)
    pairs = stage_time_pairs(records, report.layout)
    if not pairs:
        return {"skipped": "no stage times were observed (every measured microbatch compiled)"}
    timings = run_dir / "auto_plan" / "timings.json"
    last = _metric_rows(run_dir)[-1]
    profiled = {"encoder": cfg.profile.encoder_buckets, "llm": cfg.profile.llm_buckets}
    outside = sorted({(p["module"], p["bucket"]) for p in pairs
                      if not min(profiled[p["module"]]) <= p["bucket"] <= max(profiled[p["module"]])})  # fmt: skip
    return {"layout": describe_layout(report.layout), "steps": size.steps + 2, "pairs": pairs,
            **summarize_pairs(pairs), "profiled_buckets": profiled,
            "outside_profiled": [list(x) for x in outside],
            "stage_dp": [s.dp for s in report.layout.stages],
            "scheduler_window_mape": [last["pred_raw_mape"], last["pred_corrected_mape"]],
            "profile_timings_s": json.loads(timings.read_text()) if timings.exists() else None}  # fmt: skip


# ------------------------------------------------------------------------------------------------ host


@contextlib.contextmanager
def _timed_dispatch():
    """Host seconds of each `run_pipeline` call the trainer makes (it returns before the device is
    done: the step's outputs are fetched afterwards). Wraps the trainer's reference for the duration."""
    from dflop_jax.runtime import trainer

    seconds: list[float] = []
    original = trainer.run_pipeline

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = original(*args, **kwargs)
        seconds.append(time.perf_counter() - t0)
        return out

    trainer.run_pipeline = timed
    try:
        yield seconds
    finally:
        trainer.run_pipeline = original


def host_part(size: Size, info: dict, out: Path) -> dict:
    """A decoder pipelined over up to 2 devices: dispatch vs step time and data wait per steady step."""
    stages = min(2, info["num_devices"])
    split = [size.host_layers // stages] * stages
    run_dir = out / "host_run"
    overrides = [*size.host, "model.kind=decoder", f"model.num_layers={size.host_layers}",
                 "layout.encoder_layers=[]", f"layout.llm_layers={split}",
                 f"layout.llm_tp={[1] * stages}", f"layout.lengths=[{size.host_tokens}]",
                 "layout.microbatches=[4, 8]", "plan=explicit", "data.synth_mix=text",
                 f"data.synth_dir={out / 'synth_text'}", "data.synth_samples=96",
                 f"data.max_tokens={size.host_tokens}", "scheduler.solver=greedy",
                 "global_batch=8", f"steps={size.steps}", "checkpoint.every=0",
                 "measure_stage_times_every=0", f"run_dir={run_dir}",
                 f"compilation_cache={out / 'jax_cache'}", f"device.peak_flops={info['peak_flops']}"]  # fmt: skip
    with _timed_dispatch() as dispatch:
        _train(None, overrides)
    rows = _metric_rows(run_dir)
    steps = [{"step": r["step"], "dispatch_s": d, "step_time_s": r["step_time_s"],
              "data_wait_s": r["data_wait_s"], "recompiles": r["recompiles"]}
             for r, d in zip(rows, dispatch)]  # fmt: skip
    steady = [s for s in steps[1:] if s["recompiles"] == 0] or steps[-1:]
    med = lambda k: float(np.median([s[k] for s in steady]))  # noqa: E731
    return {"pipeline_stages": stages, "layers": size.host_layers, "tokens": size.host_tokens,
            "steps": steps, "steady_steps": len(steady), "dispatch_s": med("dispatch_s"),
            "step_time_s": med("step_time_s"), "data_wait_s": med("data_wait_s"),
            "dispatch_fraction": med("dispatch_s") / med("step_time_s")}  # fmt: skip


# ------------------------------------------------------------------------------------------- reporting


def _label(info: dict) -> str:
    return f"  [{CPU_BANNER}]" if not info["gpu"] else f"  [{info['gpu_name']}]"


def _print_attention(rep: dict, info: dict) -> None:
    print(f"\n## attention (H, K, Dh) = {tuple(rep['heads'])}, causal, tolerance {rep['tolerance']}"
          + _label(info))  # fmt: skip
    if rep["note"]:
        print(rep["note"])
    print("| tokens | samples | path | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | "
          "fwd+bwd temp MiB | err vs fp32 out / grad |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for c in rep["cases"]:
        for impl, r in c["impls"].items():
            p, temp = r["vs_fp32"], r["fwd_bwd_temp_bytes"]
            print(f"| {c['length']} | {c['samples']} | {impl} | {r['fwd_s'] * 1e3:.2f} | "
                  f"{r['fwd_tflops']:.3g} | {r['fwd_bwd_s'] * 1e3:.2f} | {r['fwd_bwd_tflops']:.3g} | "
                  f"{'-' if temp is None else f'{temp / 2**20:.1f}'} | "
                  f"{p['out']:.2e} / {p['grad']:.2e}{'' if p['ok'] else ' OVER TOLERANCE'} |")  # fmt: skip
        for impl in c["impls"]:
            if f"{impl}_vs_xla" in c:
                p = c[f"{impl}_vs_xla"]
                print(f"{impl} vs xla at {c['length']}x{c['samples']}: out {p['out']:.2e}, grad "
                      f"{p['grad']:.2e} ({'within' if p['ok'] else 'OVER'} tolerance)")  # fmt: skip
    for impl, why in rep.get("not_measured", {}).items():
        print(f"{impl}: not measured: {why}")


def _print_stage(rep: dict, info: dict) -> None:
    print(f"\n## stage programs ({rep['arch']}), peak {rep['peak_flops'] / 1e12:.3g} TFLOP/s "
          f"({info['peak_source']})" + _label(info))  # fmt: skip
    print("| stage | bucket | attention | LLM remat | residuals | fwd ms | bwd ms | step ms | "
          "peak GiB | MFU | HFU (with what the backward re-runs) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rep["stages"]:
        head = (f"| {r['stage']} | {r['bucket']} | {r['attention']} | {r['remat']} | "
                f"{r['residuals']} |")  # fmt: skip
        if "error" in r:
            print(f"{head} failed: {r['error'][:200]} |||||")
            continue
        print(f"{head} {r['fwd_s'] * 1e3:.1f} | {r['bwd_s'] * 1e3:.1f} | {r['step_s'] * 1e3:.1f} | "
              f"{r['memory_peak_bytes'] / 2**30:.2f} | {r['mfu']:.1%} | {r['hfu']:.1%} |")  # fmt: skip
    llms = [r for r in rep["stages"] if r["module"] == "llm" and "error" not in r]
    llm = max(llms, key=lambda r: r["mfu"], default=None)
    if llm is not None and llm["mfu"] < GOAL_LLM_MFU:
        print(f"misses goal: LLM stage MFU {llm['mfu']:.1%} < {GOAL_LLM_MFU:.0%} at best "
              f"({llm['attention']}, remat {llm['remat']}, residuals {llm['residuals']}; "
              f"HFU {llm['hfu']:.1%})" + _label(info))  # fmt: skip


def _print_profiler(rep: dict, info: dict) -> None:
    print("\n## profiler accuracy (plan: auto, then training)" + _label(info))
    if "skipped" in rep:
        print(f"skipped: {rep['skipped']}")
        return
    print(f"layout {rep['layout']}, {len(rep['pairs'])} measured (stage, direction) times")
    print(
        "| stage | module | bucket | n | measured ms | predicted ms | raw MAPE | corrected MAPE |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rep["per_stage_bucket"]:
        print(f"| {r['stage']} | {r['module']} | {r['bucket']} | {r['n']} | {r['measured'] * 1e3:.2f} "
              f"| {r['raw'] * 1e3:.2f} | {r['raw_mape']:.1%} | {r['corrected_mape']:.1%} |")  # fmt: skip
    (raw, raw_w), (cor, cor_w) = rep["mape_raw"], rep["mape_corrected"]
    print(f"MAPE raw {raw:.1%} (worst {raw_w:.1%}), corrected {cor:.1%} (worst {cor_w:.1%})"
          + _label(info))  # fmt: skip
    if raw > GOAL_RAW_MAPE:
        print(f"misses goal: raw MAPE {raw:.1%} > {GOAL_RAW_MAPE:.0%}" + _label(info))
        _print_causes(rep, info)
    if cor > GOAL_CORRECTED_MAPE:
        print(f"misses goal: corrected MAPE {cor:.1%} > {GOAL_CORRECTED_MAPE:.0%}" + _label(info))


def _print_causes(rep: dict, info: dict) -> None:
    """The effects this run can name: buckets the profile extrapolates to, replicas sharing CPU cores."""
    if rep["outside_profiled"]:
        print(f"  extrapolated: buckets outside the profiled grid {rep['profiled_buckets']}: "
              + ", ".join(f"{m} {b}" for m, b in rep["outside_profiled"]))  # fmt: skip
    if not info["gpu"] and max(rep["stage_dp"]) > 1:
        print(f"  CPU: stages of dp {rep['stage_dp']} run their replicas on shared cores; the "
              "profile timed one device alone")  # fmt: skip


def _print_host(rep: dict, info: dict) -> None:
    print(f"\n## host overhead: decoder, {rep['layers']} layers over {rep['pipeline_stages']} "
          f"pipeline stage(s), {rep['tokens']}-token rows" + _label(info))  # fmt: skip
    print(f"median over {rep['steady_steps']} steady steps: dispatch {rep['dispatch_s'] * 1e3:.1f} ms, "
          f"step {rep['step_time_s'] * 1e3:.1f} ms ({rep['dispatch_fraction']:.0%} of the step "
          f"spent dispatching), data wait {rep['data_wait_s'] * 1e3:.1f} ms")  # fmt: skip


PRINTERS = {"attention": _print_attention, "stage": _print_stage, "profiler": _print_profiler,
            "host": _print_host}  # fmt: skip


def run(parts, size_name: str | None, out: Path, warmup: int, runs: int, info: dict,
        remats=("none",), save=lambda report: None, residuals=("all",),
        attention=()) -> dict:  # fmt: skip
    """Runs `parts` and returns the report (device info `info`, size, one entry per part); `save`
    is called with the report after each part and each stage program (a killed run keeps those).
    `remats`, `residuals`: the stage part's LLM remat and residual policies; `attention`: the
    attention implementations of the attention and stage parts (() = every one that runs here)."""
    size_name = size_name or ("real" if info["gpu"] else "small")
    size = SIZES[size_name]
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": info, "size": size_name, "banner": None if info["gpu"] else CPU_BANNER}

    def stage_progress(rows):
        report["stage"] = {"partial": True, "arch": size.arch, "stages": rows}
        save(report)

    for part in parts:
        try:
            if part == "attention":
                report[part] = attention_part(size, info, warmup, runs, attention)
            elif part == "stage":
                report[part] = stage_part(size, info, warmup, runs, remats, residuals, attention,
                                          stage_progress)  # fmt: skip
            elif part == "profiler":
                report[part] = profiler_part(size, info, out)
            else:
                report[part] = host_part(size, info, out)
        except Exception as e:  # one part failing (e.g. out of memory) keeps the others' figures
            report[part] = {
                "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            }
        save(report)
    return report


def _write_json(report: dict, path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=1))


COMMAND = command(
    "gpu",
    __doc__.split("\n\n")[0],
    "python -m dflop_jax.bench gpu parts=attention size=smoke warmup=0 runs=1",
)


@dataclasses.dataclass(frozen=True)
class GpuBenchConfig:
    """Which parts to measure, at what size, and where their files go.

    Attributes:
      parts: parts to run, from attention, stage, profiler, host.
      size: "real" (the default on a GPU), "small" (the default on CPU) or "smoke" (CI); "" = by device.
      remat: LLM remat policies for the stage part ([] = every policy on a GPU, none on CPU).
      residuals: residual policies of the stage part, the first for every row (`RESIDUAL_POLICIES`;
        [] = all then recompute on a GPU, all on CPU).
      attention: attention implementations of the attention and stage parts, from xla, cudnn,
        pallas ([] = every one that runs here; the attention part always adds XLA, its reference).
      out: folder for the runs' files.
      json_out: write the report as JSON to this path, after every part and row ("" = none).
      warmup: untimed runs per timed program.
      runs: timed runs per program (median).
    """

    parts: tuple[str, ...] = BENCH_PARTS
    size: Literal["", "real", "small", "smoke"] = ""
    remat: tuple[str, ...] = ()
    residuals: tuple[str, ...] = ()
    attention: tuple[str, ...] = ()
    out: str = "runs/bench_gpu"
    json_out: str = ""
    warmup: int = 2
    runs: int = 5

    def __post_init__(self):
        bad = [p for p in self.parts if p not in BENCH_PARTS]
        require(bool(self.parts) and not bad, "parts", list(self.parts),
                f"choose from {', '.join(BENCH_PARTS)}")  # fmt: skip
        from models.decoder_config import ATTENTION_IMPLS, REMAT_MODES

        bad = [r for r in self.remat if r not in REMAT_MODES]
        require(not bad, "remat", list(self.remat), f"choose from {', '.join(REMAT_MODES)}")
        from dflop_jax.contracts.cost_table import RESIDUAL_POLICIES

        bad = [r for r in self.residuals if r not in RESIDUAL_POLICIES]
        require(not bad, "residuals", list(self.residuals),
                f"choose from {', '.join(RESIDUAL_POLICIES)}")  # fmt: skip
        impls = [a for a in ATTENTION_IMPLS if a]
        bad = [a for a in self.attention if a not in impls]
        require(not bad, "attention", list(self.attention), f"choose from {', '.join(impls)}")
        require(self.warmup >= 0, "warmup", self.warmup, "must be >= 0")
        require(self.runs >= 1, "runs", self.runs, "must be >= 1")


def main(argv: list[str] | None = None) -> int:
    cfg, _ = load(COMMAND, GpuBenchConfig, argv)
    simulate_cpu_devices(8)  # before jax starts its backend (CPU only; harmless on GPU hosts)
    info = device_info()
    print(f"GPU: {info['gpu_name']}" if info["gpu"] else CPU_BANNER)
    from models.decoder_config import REMAT_MODES

    remats = cfg.remat or (REMAT_MODES if info["gpu"] else ("none",))
    residuals = cfg.residuals or (("all", "recompute") if info["gpu"] else ("all",))
    save = lambda report: _write_json(report, cfg.json_out)  # noqa: E731
    parts = list(cfg.parts)
    report = run(parts, cfg.size or None, Path(cfg.out), cfg.warmup, cfg.runs, info, remats, save,
                 residuals, cfg.attention)  # fmt: skip
    for part in parts:
        if "error" in report[part]:
            print(f"\n## {part}: failed: {report[part]['error']}" + _label(info))
        else:
            PRINTERS[part](report[part], report["device"])
    if cfg.json_out:
        _write_json(report, cfg.json_out)
        print(f"\nwrote {cfg.json_out}")
    return 1 if any("error" in report[p] for p in parts) else 0
