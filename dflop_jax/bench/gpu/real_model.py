"""`bench gpu parts=model,model_blind`: a real model's training step on this device, DFLOP vs data-blind.

model        trains `configs/llava_ov_7b_1gpu.yaml` (the size's overrides: none at size=real, the tiny
             arch at the CPU sizes) for `size.model_steps` steps as the config says (`plan: auto`:
             the model profiled here, then planned), on one device, stage times measured every
             MEASURE_EVERY steps, and reports over the steady steps (`arm_figures`): tokens/s, MFU (the
             cut model's FLOPs), the host's share of the step (dispatch / step time), the data wait;
             the programs compiled after step 1 (the run summary's `programs_after_precompile`); the
             stage-time MAPE raw and corrected (the summary's `pred_raw_mape` / `pred_corrected_mape`);
             and the memory of its stage (one device: one stage), three ways (`memory_figures`):
               predicted  the memory model at the plan's largest buckets under the residual policy
                          the run trains (`resolve.dry_run.predicted_stage_memory`, as the dry run);
               compiled   the largest stage program the trainer compiled (arguments, the weights'
                          bf16 copies among them, + outputs - aliased + temporaries) plus its
                          optimizer state's bytes and those of the fp32 master weights it
                          takes as copies;
               measured   `jax.devices()[0].memory_stats()`: peak bytes in use (None where the
                          platform keeps no statistics, e.g. CPU), also written after every step
                          to the run's device_memory.json (a run cut short keeps it).
model_blind  the data-blind arm on the same device, data and steps: the data-blind planner's layout on
             the cost table the model part profiled (`bench train`'s `blind_plan`), trained with
             `scheduler.solver=data_blind` and no stage timing; its tokens/s and the model part's over
             it (read from the model part's run: run `model` first, with the same `out`).
Steady steps: after the first, none compiling, none timing its stages (those wait for a microbatch).
"""

from __future__ import annotations

import contextlib
import json
import statistics
from pathlib import Path

MODEL_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "llava_ov_7b_1gpu.yaml"
MEASURE_EVERY = 2  # stage-timing steps of the model part (the MAPEs), left out of its throughput
_GIB = 2**30


def arm_figures(rows: list[dict]) -> dict:
    """Throughput and host figures of one run's metrics.jsonl rows over its steady steps (module
    docstring; all steps after the first where none is steady): tokens/s and MFU weighted by step
    time, medians of step time, host share (dispatch / step time) and data wait."""
    later = rows[1:] or rows
    steady = [r for r in later if not r["recompiles"] and not r.get("stage_times_measured")]
    steady = steady or later
    seconds = sum(r["step_time_s"] for r in steady)
    med = lambda key: statistics.median(r[key] for r in steady)  # noqa: E731
    return {
        "steps": len(rows),
        "steady_steps": len(steady),
        "tokens_per_s": sum(r["tokens_per_s"] * r["step_time_s"] for r in steady) / seconds,
        "mfu": sum(r["mfu"] * r["step_time_s"] for r in steady) / seconds,
        "step_time_s": med("step_time_s"),
        "first_step_s": rows[0]["step_time_s"],
        "host_share": statistics.median(r["dispatch_s"] / r["step_time_s"] for r in steady),
        "data_wait_s": med("data_wait_s"),
        "predicted_step_time_s": med("predicted_step_time_s"),
        "compiles_after_step_1": sum(r["recompiles"] for r in rows[1:]),
        "llm_padding_ratio": statistics.mean(r["llm_padding_ratio"] for r in steady),
        "first_loss": rows[0]["loss"],
        "final_loss": rows[-1]["loss"],
    }


def device_memory() -> dict:
    """The first device's allocator statistics in GiB: peak in use, limit (None where not kept)."""
    import jax

    try:
        stats = jax.devices()[0].memory_stats() or {}
    except (NotImplementedError, RuntimeError):
        stats = {}
    gib = lambda key: None if stats.get(key) is None else stats[key] / _GIB  # noqa: E731
    return {"measured_peak_gib": gib("peak_bytes_in_use"), "device_limit_gib": gib("bytes_limit")}


@contextlib.contextmanager
def _captured_run(run_dir: Path):
    """Records what a training run compiled before step 1 and what it planned: per program compiled
    by `precompile` its bytes and whether it is a per-step (update) program, and the (cfg, model_cfg,
    resolved plan) `trainer.train` was called with; after each logged step the device's memory
    statistics go to `run_dir/device_memory.json`. Wraps the runtime's references for the duration."""
    from dflop_jax.profiling.compile_check import program_bytes
    from dflop_jax.runtime import metrics, precompile, trainer

    seen: dict = {"programs": [], "train": None}
    timed, train = precompile._timed, trainer.train
    log = metrics.MetricsLog.log

    def timed_(lowering, store):
        compiled, seconds = timed(lowering, store)
        try:
            size = program_bytes(compiled)
        except Exception:  # a platform without memory analysis: the figure is left out
            size = None
        # the per-step programs are the precompile's `extra`, its "step" kind
        seen["programs"].append({"update": lowering.kind == "step", "bytes": size})
        return compiled, seconds

    def train_(cfg, model_cfg, arch, device, plan, *args, **kwargs):
        seen["train"] = (cfg, model_cfg, plan)
        return train(cfg, model_cfg, arch, device, plan, *args, **kwargs)

    def log_(self, row):
        log(self, row)
        (run_dir / "device_memory.json").write_text(
            json.dumps({"step": row.step, **device_memory()})
        )

    precompile._timed, trainer.train = timed_, train_
    metrics.MetricsLog.log = log_
    try:
        yield seen
    finally:
        precompile._timed, trainer.train = timed, train
        metrics.MetricsLog.log = log


def _device_bytes(tree) -> float:
    """Bytes of a pytree of arrays on one device (its first shard of each leaf)."""
    import jax

    return float(sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree)))


def memory_figures(seen: dict, report) -> dict:
    """Predicted, compiled and measured memory of a one-stage run (module docstring), GiB."""
    from dflop_jax.resolve import RunContext
    from dflop_jax.resolve.dry_run import predicted_stage_memory

    out: dict = {}
    if seen["train"] is not None:
        cfg, model_cfg, plan = seen["train"]
        stages = predicted_stage_memory(RunContext.of(cfg, model_cfg), plan)
        out["predicted_gib"] = max(m.total() for m in stages) / _GIB
        out["residuals"] = list(plan.residuals or ())
        out["buckets"] = {"tiles": list(plan.buckets.tiles), "lengths": list(plan.buckets.lengths)}
    sizes = [p["bytes"] for p in seen["programs"] if not p["update"] and p["bytes"] is not None]
    if sizes and report.optimizers:
        opt = max(_device_bytes(o.shards) for o in report.optimizers)
        # the masters beside the copies the programs take (a master they take is in `sizes`)
        masters = max(
            _device_bytes([a for a, c in zip(o.stage.leaves, o.stage.cast_leaves) if c])
            for o in report.optimizers
        )
        out["compiled_program_gib"] = max(sizes) / _GIB
        out["optimizer_state_gib"] = opt / _GIB
        out["master_params_gib"] = masters / _GIB
        out["compiled_gib"] = (max(sizes) + opt + masters) / _GIB
    return out | device_memory()


def _overrides(size, info: dict, out: Path, run_dir: Path) -> list[str]:
    """The model parts' common overrides: one device, the size's model, fresh files under `out`."""
    return [*size.model, "num_devices=1", f"run_dir={run_dir}",
            f"data.synth_dir={out / 'synth_model'}", f"steps={size.model_steps}",
            "checkpoint.every=0", f"compilation_cache={out / 'jax_cache'}",
            f"device.peak_flops={info['peak_flops']}"]  # fmt: skip


def model_part(size, info: dict, out: Path) -> dict:
    """The real model trained as configured (module docstring)."""
    from dflop_jax.bench.gpu.training_parts import metric_rows, train_in_process
    from dflop_jax.planner import describe_layout

    run_dir = out / "model_run"
    overrides = [
        *_overrides(size, info, out, run_dir),
        f"measure_stage_times_every={MEASURE_EVERY}",
    ]
    with _captured_run(run_dir) as seen:
        cfg, report = train_in_process(MODEL_CONFIG, overrides)
    summary = report.summary
    model_cfg = seen["train"][1] if seen["train"] else None
    text = getattr(model_cfg, "text", None)
    return {
        "config": str(MODEL_CONFIG.name),
        "overrides": list(size.model),
        "plan": cfg.plan,
        "layout": describe_layout(report.layout),
        "llm_layers": None if text is None else text.num_layers,
        "attention": None
        if text is None
        else [model_cfg.vision.attention_impl, text.attention_impl],
        **arm_figures(metric_rows(run_dir)),
        "programs_after_precompile": summary.get("programs_after_precompile"),
        "stage_time_mape_raw": summary.get("pred_raw_mape"),
        "stage_time_mape_corrected": summary.get("pred_corrected_mape"),
        "correction_observations": summary.get("correction_observations"),
        "memory": memory_figures(seen, report),
    }


def model_blind_part(size, info: dict, out: Path) -> dict:
    """The data-blind arm (module docstring), against the model part's run in `out`."""
    from dflop_jax.bench.gpu.training_parts import metric_rows, train_in_process
    from dflop_jax.bench.train import blind_plan
    from dflop_jax.config import load_config
    from dflop_jax.planner import describe_layout
    from dflop_jax.runtime.config import TrainConfig

    dflop_dir, run_dir = out / "model_run", out / "model_blind_run"
    dflop_cfg = load_config(TrainConfig, MODEL_CONFIG, _overrides(size, info, out, dflop_dir))
    plan = blind_plan(dflop_cfg, dflop_dir, out / "model_blind_plan.yaml")
    overrides = [*_overrides(size, info, out, run_dir), f"plan={plan}",
                 "scheduler.solver=data_blind", "measure_stage_times_every=0"]  # fmt: skip
    _, report = train_in_process(MODEL_CONFIG, overrides)
    blind = arm_figures(metric_rows(run_dir))
    dflop_rows = (dflop_dir / "metrics.jsonl").is_file() and metric_rows(dflop_dir)
    dflop = arm_figures(dflop_rows) if dflop_rows else None
    ratio = dflop["tokens_per_s"] / blind["tokens_per_s"] if dflop else None
    return {"layout": describe_layout(report.layout), **blind,
            "dflop_tokens_per_s": dflop["tokens_per_s"] if dflop else None,
            "dflop_over_blind": ratio}  # fmt: skip


def print_model(rep: dict, info: dict, label: str) -> None:
    """The model part's or the model_blind part's figures, a few lines."""
    blind = "dflop_over_blind" in rep
    name = "data-blind arm" if blind else f"{rep['config']} ({rep['llm_layers']} decoder layers)"
    print(f"\n## real model step: {name}, layout {rep['layout']}" + label)
    print(f"{rep['steady_steps']} steady of {rep['steps']} steps: {rep['tokens_per_s']:,.0f} tokens/s, "
          f"MFU {rep['mfu']:.1%}, step {rep['step_time_s']:.3f} s (first {rep['first_step_s']:.1f} s), "
          f"host share {rep['host_share']:.1%}, data wait {rep['data_wait_s'] * 1e3:.1f} ms, "
          f"{rep['compiles_after_step_1']} compilations after step 1")  # fmt: skip
    if blind:
        ratio = rep["dflop_over_blind"]
        print("DFLOP over data-blind tokens/s: " + ("-" if ratio is None else f"{ratio:.2f}x"))
        return
    mem = rep["memory"]
    fmt = lambda key: "-" if mem.get(key) is None else f"{mem[key]:.2f} GiB"  # noqa: E731
    print(f"memory: predicted {fmt('predicted_gib')}, compiled {fmt('compiled_gib')}, measured peak "
          f"{fmt('measured_peak_gib')} of {fmt('device_limit_gib')}; programs after precompile "
          f"{rep['programs_after_precompile']}")  # fmt: skip
    raw, cor = rep["stage_time_mape_raw"], rep["stage_time_mape_corrected"]
    pct = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    print(f"stage-time MAPE raw {pct(raw)}, corrected {pct(cor)} "
          f"({rep['correction_observations']} observations)")  # fmt: skip
