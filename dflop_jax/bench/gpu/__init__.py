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
             `jax.profiler`: the 20 most expensive XLA ops by time and share (`op_profile.py`).
  model      a real model's training step: `configs/llava_ov_7b_1gpu.yaml` (LLaVA-OV-7B cut to the
             decoder layers one 80 GB GPU holds; the tiny arch at the CPU sizes) with `plan: auto`:
             tokens/s, MFU, host share, data wait, compilations after step 1, memory predicted vs
             compiled vs measured, stage-time MAPE raw and corrected (`real_model.py`).
  model_blind  the same model, data and steps on the data-blind planner's layout and scheduler:
             tokens/s and the model part's over it (run after `model`, same `out`).
Peak FLOP/s: the `costs.device_specs` preset of the GPU `nvidia-smi` names (H200: the H100 preset, the same
dense bf16 peak), else the measured fp32 matmul peak of one device (`runtime.metrics`), as on CPU.
On CPU every figure is labelled "CPU: figures are not GPU figures": sizes are tiny, stages share cores.

This package: the command (`main`, `run`, `GpuBenchConfig`) here; `sizes.py` the sizes, parts and
goals; `device.py` the device and its peak; one module per part or pair of parts:
`attention_kernels.py` (attention), `stage_programs.py` (stage), `training_parts.py` (profiler,
host), `op_profile.py` (ops), `real_model.py` (model, model_blind); `printing.py` the console report.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Literal

from dflop_jax.bench._cli import command, load
from dflop_jax.bench.gpu.attention_kernels import (
    ATTN_TOL,
    attention_case,
    attention_impls,
    attention_part,
)
from dflop_jax.bench.gpu.device import device_info, nvidia_smi_name
from dflop_jax.bench.gpu.op_profile import ops_part
from dflop_jax.bench.gpu.printing import device_label, part_printers
from dflop_jax.bench.gpu.real_model import model_blind_part, model_part
from dflop_jax.bench.gpu.sizes import (
    BENCH_PARTS,
    BY_NAME_PARTS,
    CPU_BANNER,
    GOAL_CORRECTED_MAPE,
    GOAL_LLM_MFU,
    GOAL_RAW_MAPE,
    SIZES,
    STAGE_MODULES,
    Size,
)
from dflop_jax.bench.gpu.stage_programs import hardware_factor, stage_part
from dflop_jax.bench.gpu.training_parts import host_part, profiler_part
from dflop_jax.config import require
from dflop_jax.host_devices import simulate_cpu_devices

__all__ = [
    "ATTN_TOL",
    "BENCH_PARTS",
    "BY_NAME_PARTS",
    "COMMAND",
    "CPU_BANNER",
    "GOAL_CORRECTED_MAPE",
    "GOAL_LLM_MFU",
    "GOAL_RAW_MAPE",
    "SIZES",
    "STAGE_MODULES",
    "GpuBenchConfig",
    "Size",
    "attention_case",
    "attention_impls",
    "attention_part",
    "device_info",
    "hardware_factor",
    "main",
    "nvidia_smi_name",
    "run",
    "stage_part",
]


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
    printers = part_printers()
    for part in parts:
        if "error" in report[part]:
            print(f"\n## {part}: failed: {report[part]['error']}" + device_label(info))
        else:
            printers[part](report[part], report["device"])
    if cfg.json_out:
        _write_json(report, cfg.json_out)
        print(f"\nwrote {cfg.json_out}")
    return 1 if any("error" in report[p] for p in parts) else 0
