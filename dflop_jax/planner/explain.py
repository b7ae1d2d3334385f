"""Why the planner said no, and why each alternative lost: messages for people, never stack traces."""

from __future__ import annotations

from dflop_jax.planner.candidates import uniform_heads, valid_tp
from dflop_jax.planner.config import PlannerConfig
from dflop_jax.planner.plan_file import Alternative

_GIB = 2**30
MAX_MEMORY_ALTERNATIVES = 2  # over-memory layouts listed because they would have screened faster


class PlanningError(ValueError):
    """An infeasible planning request; the message names the constraint and by how much."""


def explain_no_candidates(
    arch, num_devices: int, device, config: PlannerConfig, mode: str, pad_heads: bool = False
) -> str:
    lm = arch.llm
    heads = uniform_heads(arch, pad_heads) if mode == "uniform" else (lm.num_heads, lm.num_kv_heads)
    tps = valid_tp(config.tp, heads, device.devices_per_host)
    if not tps:
        return (
            f"no tensor-parallel degree fits: planner.tp={list(config.tp)} must divide the heads {list(heads)} "
            f"of {arch.name} and be <= {device.devices_per_host} devices per host; add 1 to planner.tp"
        )
    if config.global_batch < min(config.microbatches):
        return (
            f"planner.global_batch={config.global_batch} is smaller than the smallest microbatch count "
            f"{min(config.microbatches)}: every microbatch needs at least one sample"
        )
    need = 2 if (mode == "dflop" and not config.colocate) else 1
    if num_devices < need:
        return f"num_devices={num_devices}: a separate encoder needs at least {need} devices (set planner.colocate=true)"
    return (
        f"no layout uses between {num_devices - config.max_idle_devices} and {num_devices} devices with "
        f"tp in {tps}, llm pp in {sorted(config.llm_pp)}, encoder pp in {sorted(config.encoder_pp)} "
        f"({mode} mode); change num_devices, planner.max_idle_devices or the candidate lists"
    )


def explain_over_memory(evaluated, device, config: PlannerConfig) -> str:
    """The closest candidate to fitting: which stage, how much it needs, how much is usable."""
    usable = device.memory_bytes * (1.0 - config.memory_margin)
    best = min(evaluated, key=lambda e: (max(e.memory), e.cand.key))
    s = max(range(len(best.memory)), key=lambda i: best.memory[i])
    stage = best.cand.physical_layout.stages[s]
    return (
        f"no layout fits in memory: of {len(evaluated)} candidates the closest, {best.cand.describe()}, "
        f"needs {best.memory[s] / _GIB:.1f} GiB per device on stage {s} ({stage.module} layers "
        f"{stage.first_layer}-{stage.first_layer + stage.num_layers - 1}, tp={stage.tp}) but only "
        f"{usable / _GIB:.1f} GiB is usable ({device.name}: {device.memory_bytes / _GIB:.1f} GiB x "
        f"(1 - memory_margin {config.memory_margin})); over by {(best.memory[s] - usable) / _GIB:.1f} GiB. "
        "Use more devices, a smaller planner.global_batch, more planner.microbatches, or remat"
    )


def over_memory_reason(memory: list[float], usable: float) -> str:
    s = max(range(len(memory)), key=lambda i: memory[i])
    return (
        f"over memory by {(memory[s] - usable) / _GIB:.1f} GiB on stage {s} "
        f"({memory[s] / _GIB:.1f} GiB > {usable / _GIB:.1f} GiB usable)"
    )


def alternatives_for(
    ranked, evaluated, usable: float, top_n: int, mode: str, steps: int = 0
) -> tuple[Alternative, ...]:
    """The next `top_n` scored candidates ("slower by x%", counting the compile time per step of a
    run of `steps` where it was priced) plus up to two layouts rejected for memory whose mean-shape
    surrogate beat the winner's ("over memory by y GiB")."""
    best = ranked[0]
    out = []
    for e in ranked[1:]:
        if len(out) >= top_n:
            break
        if e.score is not None and e.score.failed:
            out.append(Alternative(e.cand.describe(), e.cand.microbatches, None, e.score.solver))
            continue
        if e.score is not None:
            step, ref, what = e.score.mean, best.score.mean, "expected step"
        elif mode == "uniform":
            step, ref, what = e.screen, best.screen, "mean-shape step"
        else:
            continue
        total, ref_total = step + e.compile_per_step(steps), ref + best.compile_per_step(steps)
        reason = f"{what} {step * 1e3:.1f} ms: slower by {(step / ref - 1) * 100:.1f}%"
        if total != step:
            reason = (f"{what} {step * 1e3:.1f} ms + compile {e.compile.seconds:.0f} s over "
                      f"{steps} steps: slower by {(total / ref_total - 1) * 100:.1f}%")  # fmt: skip
        if total <= ref_total:
            reason += ", equal or faster: lost the tie-break (devices, microbatches, stages)"
        out.append(Alternative(e.cand.describe(), e.cand.microbatches, step, reason))
    over = sorted((e for e in evaluated if max(e.memory) > usable and e.surrogate < best.surrogate),
                  key=lambda e: (e.surrogate, e.cand.key))  # fmt: skip
    for e in over[:MAX_MEMORY_ALTERNATIVES]:
        out.append(
            Alternative(
                e.cand.describe(), e.cand.microbatches, None, over_memory_reason(e.memory, usable)
            )
        )
    return tuple(out)
