"""The figures only a GPU can give: attention path, a real-size stage at MFU, profiler accuracy, host overhead.

    python -m dflop_jax.bench gpu [parts=attention,stage,profiler,host] [size=real|small|smoke]
                                  [remat=none,full,dots] [residuals=all,recompute]
                                  [attention=xla,cudnn,pallas] [stages=llm,encoder]
                                  [out=runs/bench_gpu] [json_out=runs/bench_gpu/gpu.json]
    python -m dflop_jax.bench gpu parts=ops|model|model_blind      # by name only (not in the default)

Each part measures against the strongest alternative in the same run:
  attention  each implementation of `models.attention.attention` that runs here (XLA; on a GPU cuDNN,
             and a Pallas kernel where this tree has one: the others are listed with why not) on packed
             rows (one long sample vs 16 packed samples): output and gradient parity against XLA and
             against a dense fp32 reference (bf16 tolerances ATTN_TOL), time, achieved TFLOP/s (model
             FLOPs: causal pairs x 4 Dh H forward, 3x that forward + backward) and XLA's temp memory.
  stage      forward + backward of LLM layers (4 Qwen2.5-7B layers at 8192 tokens) and of the SigLIP-400M
             tower on a bucket of 384 px tiles, each as the runtime's own stage program (the profiler's
             `programs.build_program` -> `programs.stage_jits.stage_jits`, bf16 compute, fp32 weights), timed
             by the profiler's `measure_program` as training runs them under a residual policy
             (`residuals=`: "all", the forward keeps its residuals and the backward runs none of it
             again; "recompute", the backward re-runs the forward): step = fwd + bwd; MFU = model
             FLOPs (`costs.flops`, 3x forward) / (step x peak), HFU counts what the backward re-runs.
             One row per attention implementation (`attention=`), then the LLM stage under each
             other residual policy and each other remat policy (`remat=`; every policy on a GPU);
             `stages=llm` keeps the LLM stage's rows only. The report names the kernels
             `model.attention_impl: auto` picks here (`auto`: its rows are those kernels' rows).
             The JSON is rewritten after each row.
  profiler   the trainer's `plan: auto` (data profile -> the model profiler on these devices -> plan;
             on one device the encoder colocated with the LLM, one stage) trains the demo's model with
             stage times measured every step: per (stage, bucket) the
             scheduler's predicted vs measured times, MAPE raw and after the adaptive correction (out
             of sample: the factors learned before the step, those its schedule was made with). The
             last stage runs fwd + bwd fused; the trainer splits its time by the predicted ratio.
  host       a pipelined decoder trained a few steps: host seconds to dispatch a step (the driver
             call, before anything blocks) vs the step time, and the loader's data wait.
  ops        the vision tower's step (the stage part's tile bucket, the `auto` kernel) traced with
             `jax.profiler`: the 20 most expensive XLA ops by time and share (`_gpu_ops.py`).
  model      a real model's training step: `configs/llava_ov_7b_1gpu.yaml` (LLaVA-OV-7B cut to the
             decoder layers one 80 GB GPU holds; the tiny arch at the CPU sizes) with `plan: auto`:
             tokens/s, MFU, host share, data wait, compilations after step 1, memory predicted vs
             compiled vs measured, stage-time MAPE raw and corrected (`_gpu_model.py`).
  model_blind  the same model, data and steps on the data-blind planner's layout and scheduler:
             tokens/s and the model part's over it (run after `model`, same `out`).
Peak FLOP/s: the `costs.device_specs` preset of the GPU `nvidia-smi` names (H200: the H100 preset, the same
dense bf16 peak), else the measured fp32 matmul peak of one device (`runtime.metrics`), as on CPU.
On CPU every figure is labelled "CPU: figures are not GPU figures": sizes are tiny, stages share cores.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Literal

import numpy as np

from dflop_jax.bench._cli import command, load
from dflop_jax.bench._gpu_model import model_blind_part, model_part, print_model
from dflop_jax.bench._gpu_ops import ops_part, print_ops
from dflop_jax.bench._gpu_train import (  # noqa: F401  (the goals are read as gpu.GOAL_*)
    GOAL_CORRECTED_MAPE,
    GOAL_RAW_MAPE,
    host_part,
    print_host,
    print_profiler,
    profiler_part,
)
from dflop_jax.config import require
from dflop_jax.host_devices import simulate_cpu_devices

BENCH_PARTS = ("attention", "stage", "profiler", "host")  # the default
BY_NAME_PARTS = ("ops", "model", "model_blind")  # heavier, run when named (the GPU check does)
STAGE_MODULES = ("llm", "encoder")
CPU_BANNER = "CPU: figures are not GPU figures"
# Goal on one H100: LLM stage MFU (the profiler's: `_gpu_train`).
GOAL_LLM_MFU = 0.55
# bf16 parity: max |a - b| / max |reference| (8-bit mantissa: 2^-8 per rounding, sums of many terms).
ATTN_TOL = {"out": 2e-2, "grad": 5e-2}


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
      model: overrides of `configs/llava_ov_7b_1gpu.yaml` for the model parts ((): as shipped);
        model_steps: their training steps.
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
    model: tuple[str, ...] = ()
    model_steps: int = 30


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
# The real model's parts at the CPU sizes: the tiny arch (56 px tiles), cut to 2 of its 4 decoder
# layers as the real config cuts Qwen2.5-7B, one profiled bucket per module, one bucket pair.
_MODEL_SMALL = ("model.arch=tiny", "model.llm_layers_kept=2", "data.tile_size=56", "data.max_grid=1",
                "data.max_frames=2", "data.max_tokens=256", "data.synth_samples=32",
                "profile.encoder_buckets=[1]", "profile.llm_buckets=[256]", "profile.warmup=0",
                "profile.runs=1", "planner.microbatches=[2]", "planner.num_buckets=[1]",
                "planner.samples=1", "global_batch=4")  # fmt: skip
_SMALL = dict(arch="tiny", attn_packed=16, host=_HOST_SMALL, host_layers=2, host_tokens=256,
              model=_MODEL_SMALL)  # fmt: skip
SIZES = {
    "smoke": Size(
        attn_lengths=(64, 128),
        attn_heads=(4, 2, 16),
        llm_layers=2,
        llm_tokens=128,
        encoder_tiles=2,
        profiler=_PROFILE_SMOKE,
        steps=3,
        model_steps=6,
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
        model_steps=8,
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
    from dflop_jax.programs.devices import run_device

    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    name = nvidia_smi_name() if gpu else None
    spec = run_device(DeviceConfig())
    peak, source = spec.peak_flops, f"costs.device_specs preset {spec.name!r} (dense bf16)"
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
               policies=("all",), impls=(), progress=lambda rows: None,
               modules=STAGE_MODULES) -> dict:  # fmt: skip
    """Each stage program timed on one device by the profiler's `measure_program`, as the runtime
    trains it under each residual policy; MFU and HFU, per attention implementation (`impls`, () =
    every one that runs here) and LLM remat policy, of the stages of `modules` ("llm", "encoder").
    `progress(rows)` after each row (partial saves). The report's `auto` names the kernels
    `model.attention_impl: auto` picks here (its rows are theirs)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from dflop_jax.contracts.profile_settings import ProfileSettings
    from dflop_jax.costs import get_arch
    from dflop_jax.costs.flops import mfu
    from dflop_jax.profiling.model_profiler import measure_program
    from dflop_jax.profiling.programs import build_program
    from dflop_jax.programs.devices import local_attention_kernels
    from dflop_jax.programs.model_section import model_config_for_arch
    from models.stage_modules import with_remat

    arch = get_arch(size.arch)
    base = model_config_for_arch(arch, "bfloat16")
    settings = ProfileSettings(tps=(1,), warmup=warmup, runs=runs, memory_limit_bytes=2.0**60)
    cases = {shape.module: c for c in _stage_cases(arch, size) for shape in [c[1]]}
    impls, _ = attention_impls(info, impls)
    rows = []
    for module, impl, remat, residuals in _stage_variants(impls, remats, policies):
        if module not in modules:
            continue
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
    auto = local_attention_kernels()
    return {"arch": size.arch, "peak_flops": info["peak_flops"], "stages": rows,
            "auto": {"llm": auto.llm, "vision": auto.vision}}  # fmt: skip


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
    if "auto" in rep:
        print(f"model.attention_impl=auto runs {rep['auto']['llm']} in the LLM stage and "
              f"{rep['auto']['vision']} in the tower here: its rows are those")  # fmt: skip
    llms = [r for r in rep["stages"] if r["module"] == "llm" and "error" not in r]
    llm = max(llms, key=lambda r: r["mfu"], default=None)
    if llm is not None and llm["mfu"] < GOAL_LLM_MFU:
        print(f"misses goal: LLM stage MFU {llm['mfu']:.1%} < {GOAL_LLM_MFU:.0%} at best "
              f"({llm['attention']}, remat {llm['remat']}, residuals {llm['residuals']}; "
              f"HFU {llm['hfu']:.1%})" + _label(info))  # fmt: skip


def _printers():
    """{part: printer(report part, device info)}."""
    own = {"attention": _print_attention, "stage": _print_stage}
    labelled = {"profiler": print_profiler, "host": print_host, "ops": print_ops,
                "model": print_model, "model_blind": print_model}  # fmt: skip
    return own | {
        k: (lambda rep, info, f=f: f(rep, info, _label(info))) for k, f in labelled.items()
    }


def run(parts, size_name: str | None, out: Path, warmup: int, runs: int, info: dict,
        remats=("none",), save=lambda report: None, residuals=("all",),
        attention=(), stages=STAGE_MODULES) -> dict:  # fmt: skip
    """Runs `parts` and returns the report (device info `info`, size, one entry per part); `save`
    is called with the report after each part and each stage program (a killed run keeps those).
    `remats`, `residuals`: the stage part's LLM remat and residual policies; `attention`: the
    attention implementations of the attention and stage parts (() = every one that runs here);
    `stages`: the stage part's modules."""
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
                                          stage_progress, stages)  # fmt: skip
            elif part == "profiler":
                report[part] = profiler_part(size, info, out)
            elif part == "host":
                report[part] = host_part(size, info, out)
            elif part == "ops":
                report[part] = ops_part(size, info, out, warmup, runs)
            elif part == "model":
                report[part] = model_part(size, info, out)
            else:
                report[part] = model_blind_part(size, info, out)
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
      parts: parts to run, from attention, stage, profiler, host (the default), and, run only when
        named, ops (the vision tower op by op), model and model_blind (a real model's training
        step, DFLOP's and the data-blind one's; model first).
      size: "real" (the default on a GPU), "small" (the default on CPU) or "smoke" (CI); "" = by device.
      remat: LLM remat policies for the stage part ([] = every policy on a GPU, none on CPU).
      residuals: residual policies of the stage part, the first for every row (`RESIDUAL_POLICIES`;
        [] = all then recompute on a GPU, all on CPU).
      attention: attention implementations of the attention and stage parts, from xla, cudnn,
        pallas ([] = every one that runs here; the attention part always adds XLA, its reference).
      stages: the stage part's stages, from llm, encoder ([llm]: the LLM stage's rows only).
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
    stages: tuple[str, ...] = STAGE_MODULES
    out: str = "runs/bench_gpu"
    json_out: str = ""
    warmup: int = 2
    runs: int = 5

    def __post_init__(self):
        known = (*BENCH_PARTS, *BY_NAME_PARTS)
        bad = [p for p in self.parts if p not in known]
        require(bool(self.parts) and not bad, "parts", list(self.parts),
                f"choose from {', '.join(known)}")  # fmt: skip
        bad = [m for m in self.stages if m not in STAGE_MODULES]
        require(bool(self.stages) and not bad, "stages", list(self.stages),
                f"choose from {', '.join(STAGE_MODULES)}")  # fmt: skip
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
                 residuals, cfg.attention, cfg.stages)  # fmt: skip
    printers = _printers()
    for part in parts:
        if "error" in report[part]:
            print(f"\n## {part}: failed: {report[part]['error']}" + _label(info))
        else:
            printers[part](report[part], report["device"])
    if cfg.json_out:
        _write_json(report, cfg.json_out)
        print(f"\nwrote {cfg.json_out}")
    return 1 if any("error" in report[p] for p in parts) else 0
