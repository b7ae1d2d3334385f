"""The planner's search: enumerate, memory-check, screen, score by expected step time, pick, explain.

    plan = make_plan("siglip-so400m+qwen2.5-7b", "h100", 64, shapes, PlannerConfig())

Stages of the search (DESIGN section 7):
1. enumerate candidates (planner/candidates.py) and derive each one's bucket ladder (planner/buckets.py);
   pipelined candidates also come with a cost-balanced layer split of each module (planner/balance.py);
2. memory: a candidate whose peak stage memory (largest buckets, in-flight activations of its schedule)
   exceeds (1 - memory_margin) x device memory is rejected, with the overage recorded; a pipelined one
   first gets a memory-balanced split (fewer layers where more microbatches are in flight) too;
3. screen: rank the survivors by a simulation of one typical batch (quantiles of the shape
   distribution, each microbatch at the buckets of its fullest shard: `scoring.screen_buckets`); keep
   the best `screen_top` and the best `screen_per_group` per (microbatch count, colocated or not);
4. score: expected step time over K sampled global batches through the online scheduler (greedy) and
   the simulator; optionally re-score the best `refine_top` with the refining solver;
5. pick the fastest. Ties (equal to the microsecond) go to: fewer unused devices, then fewer
   microbatches, then fewer stages, then fewer buckets (fewer compiled programs), then the candidate's
   stable key -- so the choice never depends on enumeration or dict order.

Uniform mode (the data-blind baseline of DESIGN section 8): encoder colocated on the first LLM stage, one
tp/pp/dp for the whole model (encoder heads padded to the tp, Megatron's way, with analytic costs;
planner/variants.py), chosen with MEAN shapes through the data-blind scheduler, then evaluated on the K
sampled batches with that same scheduler. Both modes try an even and a cost-balanced LLM layer split
(Megatron's `--decoder-first-pipeline-num-layers` for the baseline, balanced on its fixed max shapes)
and, when `PlannerConfig.remat` lists both, remat on and off per candidate; the baseline also tries
`PlannerConfig.virtual_stages` (interleaved 1F1B; the plan's layout is then the physical one, its
virtual split in `search["virtual_layers"]`, its schedule "interleaved").

Both modes plan under `PlannerConfig.trainable` (the training recipe): the cost provider is re-made for
it, so frozen stages' times and memory (costs/recipe.py) reach the memory check, the scheduler's stage
costs and the simulation, where forward-only stages leave the backward wave (sim/pipeline.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence

from dflop_jax.config import to_dict
from dflop_jax.costs import AnalyticCostProvider, get_arch, get_device
from dflop_jax.costs.compile import CompileCost, compile_cost
from dflop_jax.costs.recipe import TRAINABLE_PARTS
from dflop_jax.planner.balance import balanced_layout, memory_balanced_layout
from dflop_jax.planner.buckets import ShapeStats
from dflop_jax.planner.candidates import Candidate, enumerate_candidates, enumerate_uniform
from dflop_jax.planner.config import PlannerConfig
from dflop_jax.planner.explain import (
    PlanningError,
    alternatives_for,
    explain_no_candidates,
    explain_over_memory,
)
from dflop_jax.planner.plan_file import Plan
from dflop_jax.planner.scoring import (
    LayoutCosts,
    SchedulePolicy,
    Score,
    ScreenBatch,
    candidate_buckets,
    expected_step_time,
    mean_shape_buckets,
    mean_shape_surrogate,
    microbatch_range,
    online_scheduler,
    problem_for,
    sample_batches,
    screen_pairs,
    screen_step_time,
    stage_in_flight,
    stage_memory_bytes,
    stage_residuals,
    used_pairs,
)
from dflop_jax.planner.variants import ProviderVariants, can_vary
from dflop_jax.scheduler import BucketSet, SampleShape

log = logging.getLogger(__name__)
# Global batches (beside the K scored ones) a priced search finds each candidate's sparse pair set on.
PAIR_BATCHES = 16

# progress(phase, done, total): called as the search advances (the CLI draws a rich progress bar)
ProgressFn = Callable[[str, int, int], None]


@dataclasses.dataclass
class Evaluated:
    """A candidate as the search sees it."""

    cand: Candidate
    buckets: BucketSet
    costs: LayoutCosts
    memory: list[float]
    screen: float  # simulated step of the typical batch (`screen_step_time`; inf: over memory)
    surrogate: float  # 1F1B surrogate of a mean-shape step (cheap, computed for every candidate)
    score: Score | None = None
    provider: object = None  # the cost provider it was scored with (planner/variants.py)
    dominated: bool = False  # remat on where the same candidate fits with remat off (`_screen_all`)
    compile: CompileCost | None = None  # its programs and compile seconds (priced runs only)
    residuals: tuple[str, ...] | None = None  # each stage's residual policy (`stage_residuals`)

    def compile_per_step(self, steps: int) -> float:
        """Its compile seconds amortized over the run's `steps` (0 when not priced)."""
        return self.compile.seconds / steps if steps and self.compile is not None else 0.0

    def rank_key(self, num_devices: int, step: float, steps: int = 0) -> tuple:
        """Ranks by `step` (a simulated step time) plus the compile time per step of a run of
        `steps`; ties as the module docstring says."""
        c, lay = self.cand, self.cand.physical_layout
        total = step + self.compile_per_step(steps)
        return (round(total, 6), num_devices - lay.num_devices, c.microbatches, lay.num_stages,
                c.chunks, c.num_buckets, c.key)  # fmt: skip


def make_plan(
    arch,
    device,
    num_devices: int,
    shapes: Sequence[SampleShape],
    config: PlannerConfig,
    provider=None,
    progress: ProgressFn | None = None,
    mode: str | None = None,
) -> Plan:
    """Finds the layout with the lowest expected step time (see the module docstring).

    Args:
      arch: an MLLMArch or its name (`dflop_jax.costs.list_archs()`).
      device: a DeviceSpec or preset name ("h100", "a100", "cpu").
      num_devices: devices available.
      shapes: the shape distribution (samples to draw global batches from).
      config: search space and scoring settings.
      provider: a CostProvider; None -> AnalyticCostProvider(arch, device); planned under
        `config.trainable` (its `with_trainable`).
      progress: optional progress callback.
      mode: "dflop" (data-aware search) or "uniform" (data-blind baseline layout); None = `config.mode`.
    Raises:
      PlanningError: an infeasible request, with the constraint and by how much.
    """
    t0 = time.perf_counter()
    arch = get_arch(arch) if isinstance(arch, str) else arch
    device = get_device(device) if isinstance(device, str) else device
    shapes = list(shapes)
    mode = config.mode if mode is None else mode
    _check_request(num_devices, shapes, mode)
    provider = provider if provider is not None else AnalyticCostProvider(arch, device)
    provider = _with_recipe(provider, config.trainable)
    report = progress if progress is not None else (lambda *_: None)
    usable = device.memory_bytes * (1.0 - config.memory_margin)

    cands, pad = _candidates(arch, device, num_devices, config, provider, mode)
    evaluated = _screen_all(cands, shapes, config, ProviderVariants(provider, pad), usable, report)
    ranked = _ranked(evaluated, shapes, (num_devices, device, usable), config, mode, report)
    search = _search_summary(mode, len(cands), evaluated, ranked, usable, config, t0)
    log.info("plan: %s in %.1fs", ranked[0].cand.describe(), search["wall_time_s"])
    return _plan_of(ranked, evaluated, (arch, device, num_devices, usable), mode, config, search)


def _candidates(arch, device, num_devices: int, config: PlannerConfig, provider, mode: str):
    """The layouts to consider and whether encoder heads may be padded to the tp (uniform mode with
    analytic costs: planner/variants.py); raises when there are none, saying why."""
    if config.remat and not can_vary(provider):
        raise PlanningError(
            f"planner.remat={list(config.remat)} needs analytic costs; {provider.name} has one setting"
        )
    pad = mode == "uniform" and can_vary(provider)
    if mode == "uniform":
        cands = enumerate_uniform(arch, num_devices, device.devices_per_host, config, pad)
    else:
        cands = enumerate_candidates(arch, num_devices, device.devices_per_host, config)
    if not cands:
        raise PlanningError(explain_no_candidates(arch, num_devices, device, config, mode, pad))
    return cands, pad


def _ranked(
    evaluated: list[Evaluated], shapes, target: tuple, config: PlannerConfig, mode: str, report
) -> list[Evaluated]:
    """The candidates that fit (and are not dominated), fastest first by expected step time over
    the sampled batches (the scored ones first; `_score_uniform` or `_score_dflop`). `target`:
    (num_devices, device, usable memory per device). Raises when none fits in memory or none
    could be scheduled."""
    num_devices, device, usable = target
    fits = [e for e in evaluated if max(e.memory) <= usable and not e.dominated]
    if not fits:
        raise PlanningError(explain_over_memory(evaluated, device, config))
    by_screen = sorted(fits, key=lambda e: e.rank_key(num_devices, e.screen, config.steps))

    batches = sample_batches(shapes, config.global_batch, config.samples, config.seed)
    if mode == "uniform":
        ranked = _score_uniform(by_screen, shapes, batches, config, num_devices)
    else:
        discovery = sample_batches(shapes, config.global_batch, PAIR_BATCHES, config.seed + 1)
        multimodal = any(s.tiles for s in shapes)
        ranked = _score_dflop(by_screen, (batches, discovery, multimodal), config, num_devices,
                              report)  # fmt: skip
    best = ranked[0]
    if best.score is None or best.score.failed:
        raise PlanningError(
            f"the scheduler could not pack the sampled batches for any memory-feasible layout "
            f"(first: {best.cand.describe()}: {best.score.solver if best.score else 'not scored'}); "
            "check the shape distribution and planner.global_batch"
        )
    return ranked


def _search_summary(
    mode: str, candidates: int, evaluated, ranked, usable: float, config: PlannerConfig, t0: float
) -> dict:
    """The plan's `search` record: what was searched, pruned and scored, the winner's solver,
    remat and virtual split, and the wall time since `t0`."""
    best = ranked[0]
    return {
        "mode": mode,
        "candidates": candidates,
        "over_memory": sum(max(e.memory) > usable for e in evaluated),
        "dominated": sum(e.dominated for e in evaluated),
        "scored": sum(e.score is not None for e in ranked),
        "sampled_batches": config.samples,
        "solver": best.score.solver,
        "remat": best.cand.remat,
        "encoder_heads": best.provider.arch.vision.num_heads,
        "virtual_stages": best.cand.chunks,
        "virtual_layers": [s.num_layers for s in best.cand.layout.llm_stages],
        "wall_time_s": round(time.perf_counter() - t0, 3),
    }


def _plan_of(
    ranked, evaluated, target: tuple, mode: str, config: PlannerConfig, search: dict
) -> Plan:
    """The Plan of the winner `ranked[0]`, with the runners-up, its compile cost and ladders.
    `target`: (arch, device, num_devices, usable memory per device)."""
    arch, device, num_devices, usable = target
    best = ranked[0]
    return Plan(
        model=arch.name,
        device=device.name,
        num_devices=num_devices,
        cost_provider=str(best.provider.name),
        mode=mode,
        layout=best.cand.physical_layout,
        buckets=best.buckets,
        microbatches=best.cand.microbatches,
        max_microbatches=microbatch_range(best.cand.microbatches, config.microbatch_slack)[1],
        global_batch=config.global_batch,
        schedule="interleaved" if best.cand.chunks > 1 else config.schedule,
        step_time_mean_s=best.score.mean,
        step_time_p90_s=best.score.p90,
        idle_fraction=best.score.idle,
        stage_memory_bytes=tuple(best.memory),
        memory_capacity_bytes=usable,
        device_memory_bytes=device.memory_bytes,
        alternatives=alternatives_for(ranked, evaluated, usable, config.top_n, mode, config.steps),
        search=search,
        planner_config=to_dict(config),
        compile=_compile_summary(best, config.steps),
        ladders=_ladders(best, ranked, config.steps),
        residuals=best.residuals or (),
    )


def _with_recipe(provider, trainable: tuple[str, ...]):
    """`provider` under the planner's recipe (its `with_trainable`); a provider without one can plan
    only the full recipe."""
    if hasattr(provider, "with_trainable"):
        return provider.with_trainable(trainable)
    if set(trainable) != set(TRAINABLE_PARTS):
        raise PlanningError(f"planner.trainable={list(trainable)}: cost provider "
                            f"{provider.name} cannot model frozen parts")  # fmt: skip
    return provider


def _check_request(num_devices: int, shapes: list[SampleShape], mode: str) -> None:
    if mode not in ("dflop", "uniform"):
        raise PlanningError(f"mode={mode!r}: choose 'dflop' or 'uniform'")
    if not isinstance(num_devices, int) or num_devices < 1:
        raise PlanningError(f"num_devices={num_devices!r}: need at least 1 device")
    if not shapes:
        raise PlanningError(
            "the shape distribution is empty: give at least one sample (tiles, tokens)"
        )


def _screen_all(
    cands, shapes, config: PlannerConfig, variants: ProviderVariants, usable: float, report
) -> list[Evaluated]:
    """Buckets, memory and the mean-shape scores of every candidate (simulated only if it fits);
    pipelined candidates also get a cost-balanced layer split (planner/balance.py).

    Pruned (marked `dominated`, not simulated): a candidate with remat on whose twin with remat off
    (same layout, chunks, M, buckets) fits in memory. Remat only adds the recomputed forward to every
    backward, so the twin's stage costs are at least as low at every bucket pair, with the same
    transfers: the twin's simulated step is never longer for any schedule (the simulator is monotone
    in its durations). Remat off is enumerated first (`Candidate.key`), so the twin is known by then."""
    stats = ShapeStats.of(shapes)
    typical = ScreenBatch.of(shapes, config.global_batch)
    costs_of: dict = {}
    fit_without_remat: set = set()
    out = []

    def evaluate(cand, provider):
        twin = (cand.layout, cand.chunks, cand.microbatches, cand.num_buckets)
        e = _evaluate(cand, (stats, typical), config, provider, usable, costs_of,
                      cand.remat is True and twin in fit_without_remat)  # fmt: skip
        if cand.remat is False and max(e.memory) <= usable:
            fit_without_remat.add(twin)
        return e

    for i, cand in enumerate(cands):
        provider = variants.get(cand.layout, cand.remat)
        out.append(evaluate(cand, provider))
        if any(len(m) > 1 for m in (cand.layout.llm_stages, cand.layout.encoder_stages,
                                    cand.layout.audio_stages)):  # fmt: skip
            even = out[-1]
            key = mean_shape_buckets(cand, even.buckets, stats, config)
            layouts = [balanced_layout(provider, cand.layout, even.costs.stage(*key), key)]
            if max(even.memory) > usable and cand.chunks == 1:  # fewer layers where more in flight
                b = even.buckets
                largest = (b.tiles[-1], b.lengths[-1], b.audio[-1] if b.audio else 0)
                counts = stage_in_flight(cand, config)
                layouts.append(
                    memory_balanced_layout(provider, cand.layout, even.memory, largest, counts)
                )
            for layout in dict.fromkeys(layouts):  # distinct, in order
                if layout != cand.layout:
                    variant = dataclasses.replace(cand, layout=layout)
                    out.append(evaluate(variant, provider))
        if i % 64 == 0 or i == len(cands) - 1:
            report("screen", i + 1, len(cands))
    return out


def _evaluate(
    cand, data: tuple, config: PlannerConfig, provider, usable: float, costs_of: dict,
    dominated: bool = False,
) -> Evaluated:  # fmt: skip
    """`data`: (ShapeStats, ScreenBatch) of the shape distribution."""
    stats, typical = data
    buckets = candidate_buckets(cand, stats, config)
    residuals = stage_residuals(provider, cand, buckets, config, usable)
    key = (cand.layout, cand.chunks, provider.name, residuals)
    if key not in costs_of:
        costs_of[key] = LayoutCosts.build(provider, cand.layout, cand.chunks, residuals)
    costs = costs_of[key]
    memory = stage_memory_bytes(provider, cand, buckets, config, residuals)
    surrogate = mean_shape_surrogate(costs, cand, buckets, stats, config)
    fits = max(memory) <= usable and not dominated
    screen = screen_step_time(costs, cand, buckets, typical, config.schedule) if fits else math.inf
    priced = config.steps and fits
    multimodal = stats.max_tiles > 0  # a data set without tiles plans a decoder-only model
    compiled = _compile(provider, cand, screen_pairs(cand, buckets, typical), multimodal, config)
    return Evaluated(cand, buckets, costs, memory, screen, surrogate, provider=provider,
                     dominated=dominated, compile=compiled if priced else None,
                     residuals=residuals)  # fmt: skip


def _compile(provider, cand: Candidate, buckets: BucketSet, multimodal: bool,
             config: PlannerConfig) -> CompileCost:  # fmt: skip
    """The candidate's programs and compile seconds (`costs/compile.py`) with `buckets`."""
    return compile_cost(provider, cand.physical_layout, buckets, multimodal, config.trainable)


def shortlist(by_screen: list[Evaluated], config: PlannerConfig) -> list[Evaluated]:
    """The candidates worth the full scoring, in screen order: the best `screen_top` overall plus the
    best `screen_per_group` of every (microbatch count, encoder colocated or not) group -- the screen's
    one typical batch is blind to batch-to-batch variance, which favours some groups unfairly."""
    keep = {id(e) for e in by_screen[: config.screen_top]}
    seen: dict[tuple, int] = {}
    for e in by_screen:
        group = (e.cand.microbatches, not e.cand.layout.encoder_stages)
        seen[group] = seen.get(group, 0) + 1
        if seen[group] <= config.screen_per_group:
            keep.add(id(e))
    return [e for e in by_screen if id(e) in keep]


def _score_dflop(
    by_screen: list[Evaluated], batches: tuple, config: PlannerConfig, num_devices: int, report
):
    """Scores the shortlist on the sampled batches (`batches`: the scored ones and those the pair
    sets are found on), then the winner's other ladder sizes (so the ladder is chosen against the
    run's compile time), and optionally refines the best few."""
    scored, discovery, multimodal = batches
    scheduler = online_scheduler(config.solver, config.seed)
    steps = config.steps

    def rank(es):
        return sorted(es, key=lambda e: e.rank_key(num_devices, e.score.mean, steps))

    top = shortlist(by_screen, config)
    for i, e in enumerate(top):
        _score_priced(e, scored, (discovery, multimodal), scheduler, config)
        report("score", i + 1, len(top))
    ranked = rank(top)
    ladders = [e for e in by_screen if e.score is None and _same_but_ladder(e, ranked[0])]
    for i, e in enumerate(ladders):
        _score_priced(e, scored, (discovery, multimodal), scheduler, config)
        report("ladders", i + 1, len(ladders))
    top += ladders
    ranked = rank(top)
    if config.refine_top:
        refiner = online_scheduler(config.refine_solver, config.seed, config.refine_time_limit_s)
        for i, e in enumerate(ranked[: config.refine_top]):
            refined = _score(e, scored, refiner, config)
            e.score = refined if refined.mean < e.score.mean else e.score
            report("refine", i + 1, min(config.refine_top, len(ranked)))
        ranked = rank(top)
    return ranked + [e for e in by_screen if e.score is None]


def _same_but_ladder(e: Evaluated, best: Evaluated) -> bool:
    a, b = e.cand, best.cand
    return (a.layout, a.microbatches, a.remat, a.chunks) == (
        b.layout, b.microbatches, b.remat, b.chunks,
    ) and a.num_buckets != b.num_buckets  # fmt: skip


def _score_priced(e: Evaluated, scored, pairs: tuple, scheduler, config: PlannerConfig) -> None:
    """Scores `e`; in a priced run (`planner.steps`) on the sparse pair set its schedules use on the
    discovery batches (`pairs`: (those batches, multimodal); `used_pairs`: what a stage seeing both
    buckets compiles, the rest rounded up to an allowed pair), with its compile cost for that set."""
    if config.steps:
        discovery, multimodal = pairs
        e.buckets = used_pairs(discovery, _problem(e, config), scheduler)
        e.compile = _compile(e.provider, e.cand, e.buckets, multimodal, config)
    e.score = _score(e, scored, scheduler, config)


def _problem(e: Evaluated, config: PlannerConfig):
    return problem_for(
        e.costs, microbatch_range(e.cand.microbatches, config.microbatch_slack), e.buckets
    )


def _score(e: Evaluated, batches, scheduler: SchedulePolicy, config: PlannerConfig) -> Score:
    return expected_step_time(batches, e.costs, _problem(e, config), scheduler, config.schedule)


def _compile_summary(best: Evaluated, steps: int) -> dict:
    """plan.yaml's `compile`: the winner's programs, compile seconds, and what that costs per step
    of a run of `steps` (empty when compiling was not priced)."""
    if best.compile is None:
        return {}
    c, score = best.compile, best.score
    return {
        "programs": c.programs,
        "estimated_s": round(c.seconds, 1),
        "steps": steps,
        "per_step_s": round(c.seconds / steps, 6),
        "pairs": len(best.buckets.allowed()),
        "padding_tokens": round(score.padding_tokens, 4),
        "padding_tiles": round(score.padding_tiles, 4),
    }


def _ladders(best: Evaluated, ranked: list[Evaluated], steps: int) -> tuple[dict, ...]:
    """The winner's layout at each ladder size scored, smallest first: buckets, programs, compile
    seconds, padding, step time and the total per step the ranking compared (why the ladder won)."""
    if best.compile is None:
        return ()
    rows = [e for e in ranked if e.score is not None and e.compile is not None
            and (e is best or _same_but_ladder(e, best))]  # fmt: skip
    out = []
    for e in sorted(rows, key=lambda e: e.cand.num_buckets):
        out.append({
            "num_buckets": e.cand.num_buckets,
            "pairs": len(e.buckets.allowed()),
            "programs": e.compile.programs,
            "compile_s": round(e.compile.seconds, 1),
            "padding_tokens": round(e.score.padding_tokens, 4),
            "padding_tiles": round(e.score.padding_tiles, 4),
            "step_time_s": round(e.score.mean, 6),
            "per_step_s": round(e.score.mean + e.compile_per_step(steps), 6),
            "chosen": e is best,
        })  # fmt: skip
    return tuple(out)


def _score_uniform(
    by_screen: list[Evaluated], shapes, batches, config: PlannerConfig, num_devices: int
):
    """Data-blind: rank by the data-blind scheduler on a batch of mean-shape samples, then evaluate the
    winner (and the listed alternatives) on the sampled batches with the same scheduler."""
    from dflop_jax.planner.baseline import data_blind_scheduler, mean_shape_batch

    mean_batch = [mean_shape_batch(shapes, config.global_batch)]
    scheduler = data_blind_scheduler()
    for e in by_screen:
        e.screen = _score(e, mean_batch, scheduler, config).mean
    ranked = sorted(by_screen, key=lambda e: e.rank_key(num_devices, e.screen))
    for e in ranked[: 1 + config.top_n]:
        e.score = _score(e, batches, scheduler, config)
    return ranked
