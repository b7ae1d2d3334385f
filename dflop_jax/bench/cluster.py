"""Simulated cluster benchmark: the planner's layout + online scheduler vs the data-blind baseline.

    python -m dflop_jax.bench cluster [--quick | --paper] [json_out=rows.json] [eval_batches=K]

For each model (LLaVA-OV: SigLIP-SO400M + Qwen2.5-7B on the LLaVA-OV-like mix; InternVL-style:
InternViT-300M + Qwen2.5-7B on the real OmniBal InternVL statistics) and each H100 count (8, 32, 64;
global batch 4 samples per GPU), with analytic costs under full activation recomputation (remat, as
7B multimodal training runs do; without it few layouts fit 80 GB at these batch sizes).
With `--paper`: the DFLOP paper's model set (`PAPER_MODELS`: SigLIP 400M / "1B" / "6B" on the LLaVA-OV mix,
InternViT 300M / 1B / 6B on the OmniBal statistics, with Qwen2.5 7B / 32B / 72B and Llama3 8B / 70B) at
32, 64 and 128 H100s; both planners there also choose remat on or off per layout, the encoder may
take up to 4 pipeline stages and the LLM any depth up to 8; the data-blind baseline may also interleave
2 virtual stages per LLM stage (Megatron's interleaved 1F1B) and DFLOP may colocate the encoder at its
own tp, and give a separate encoder a tp the LLM cannot take (5 for InternViT-6B's 25 heads).

- DFLOP: `make_plan(mode="dflop")`, then the online scheduler (greedy) on every evaluation batch;
- data-blind: `make_plan(mode="uniform")` (encoder colocated on the first LLM stage, one tp/pp/dp,
  encoder heads padded to that tp as Megatron does, virtual stages with `--paper`, chosen with mean
  shapes), then the data-blind scheduler (loader order, largest bucket);
- data-blind, dynamic shapes: the same layout and microbatches, but each microbatch costs what its real
  load costs (as in a variable-shape PyTorch/Megatron run: no padding, stages wait on each other).

- the scheduler baselines on DFLOP's own layout (`scheduler.baselines`: data_blind, reference-like,
  reference-exact, maxtext-packer; `baselines=` picks some): the same plan, each baseline's
  microbatches at the plan's count, so the row says what DFLOP's scheduler buys over the strongest of
  them (the one with the lowest mean simulated step) on top of what its layout buys over data-blind.

`trainable=projector,llm` (a training recipe, `planner.trainable`): both planners, both schedulers
and the evaluation cost frozen parts as the runtime runs them (costs/recipe.py), e.g. the frozen-encoder
row (LLaVA-OV stage 2 with the vision tower frozen); the model cell names the recipe.

Omni rows (`models=[omni-7b, omni-32b]`: SigLIP-SO400M + Qwen2.5-7B / 32B + Qwen2-Audio's 32-layer
audio encoder, on `scheduler.omni_mix`: LLaVA-OV's mix with a share of speech and sound samples, one
row per `audio_shares`): DFLOP's planner also places the audio encoder, on the first LLM stage
(each LLM row's audio on that row's shard) or on audio stages of its own (a second encoder branch,
simulated as an in-tree), at its own tp and dp; the data-blind baseline runs it on the first LLM
stage at the uniform tp. The cost model prices it at each microbatch's audio frames per row
(`costs.layout_stage_costs`). DFLOP packs each row's windows back to back at the kept frames and
runs the microbatch's audio bucket (the planner's ladder; the scheduler balances the rows' frames,
`scheduler.objective.with_audio`); data-blind pads every clip to whole 30 s windows, as HF's
Qwen2-Audio processor does, and every row to the fullest (its dynamic-shape variant: each rank its
own row's windows). Useful work counts each row's valid frames.

All are evaluated on the same fresh global batches (a seed the planner never saw) by the pipeline
simulator. Reported: mean step time, speedup, the pipeline idle fraction (DESIGN section 9:
sum_s (step - busy_s) / (P x step); padding counts as busy, data-parallel waiting is invisible) and the
device idle fraction = 1 - useful / (P x step), where useful sums, per microbatch and stage, the mean
over data-parallel ranks of the rank's cost at its real load: time spent on padding, waiting for a
slower data-parallel rank, or in pipeline bubbles all count as idle.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time

import numpy as np

from dflop_jax.bench._cli import command, load
from dflop_jax.config import ConfigError, require
from dflop_jax.contracts.shapes import WINDOW_FRAMES
from dflop_jax.costs import AnalyticCostProvider, get_arch, get_device
from dflop_jax.costs.recipe import check_trainable
from dflop_jax.planner import (
    LayoutCosts,
    Plan,
    PlannerConfig,
    PlanningError,
    describe_layout,
    make_plan,
    problem_for,
)
from dflop_jax.planner.baseline import data_blind_scheduler
from dflop_jax.planner.progress import progress_bar
from dflop_jax.planner.scoring import online_scheduler, sample_batches
from dflop_jax.planner.variants import plan_costs, plan_virtual_layout
from dflop_jax.scheduler import Schedule, llava_ov_mix, omni_mix, omnibal_shapes
from dflop_jax.scheduler.baselines import BASELINES, run_baselines

MODELS = {
    "llava-ov": ("siglip-so400m+qwen2.5-7b", "llava-ov"),
    "internvl": ("internvit-300m+qwen2.5-7b", "omnibal"),
    # needs pipelines; not in the default run
    "llava-ov-32b": ("siglip-so400m+qwen2.5-32b", "llava-ov"),
}
# the DFLOP paper's model set: each encoder family on its own data (the reference pairs SigLIP with
# LLaVA-OV data and InternViT with InternVL's); named by their arch
PAPER_MODELS = {
    arch: (arch, data)
    for data, archs in (
        ("llava-ov", ("siglip-so400m+qwen2.5-7b", "siglip-1b+qwen2.5-7b", "siglip-6b+qwen2.5-7b",
                      "siglip-6b+llama3-8b", "siglip-6b+qwen2.5-32b", "siglip-6b+qwen2.5-72b",
                      "siglip-6b+llama3-70b")),
        ("omnibal", ("internvit-300m+qwen2.5-7b", "internvit-1b+qwen2.5-7b", "internvit-6b+qwen2.5-7b",
                     "internvit-6b+llama3-8b", "internvit-6b+qwen2.5-32b", "internvit-6b+qwen2.5-72b",
                     "internvit-6b+llama3-70b")),
    )
    for arch in archs
}  # fmt: skip
MODELS.update(PAPER_MODELS)
# vision + audio + LLM on `scheduler.omni_mix`; not in the default run
OMNI_MODELS = {
    "omni-7b": ("siglip-so400m+qwen2.5-7b+qwen2-audio", "omni"),
    "omni-32b": ("siglip-so400m+qwen2.5-32b+qwen2-audio", "omni"),
}
MODELS.update(OMNI_MODELS)
DEFAULT_MODELS = ("llava-ov", "internvl")
EVAL_SEED = 12345  # evaluation batches: never the planner's (seed 0)


@dataclasses.dataclass(frozen=True)
class Measured:
    step_s: float
    idle: float
    device_idle: float
    padding_tokens: float


@dataclasses.dataclass(frozen=True)
class AudioFrames:
    """An omni arm's audio frames per LLM row, which the cost model prices (module docstring).

    Attributes:
      padded: the data-blind packing (every clip in whole 30 s windows, every row to the fullest);
        else DFLOP's (the microbatch's audio bucket).
    """

    padded: bool

    def windows(self, row, batch) -> int:
        """A row's frames as the data-blind packing computes them: each clip in whole windows."""
        return WINDOW_FRAMES * sum(len(batch[i].audio_windows) for i in row)

    def row_frames(self, row, batch, frames: str) -> int:
        """A row's frames on its own rank: "valid" (its clips' valid frames: useful work) or
        "own" (what the data-blind packing computes for it alone: `windows`)."""
        if frames == "own":
            return self.windows(row, batch)
        return sum(sum(batch[i].audio_windows) for i in row)

    def computed(self, mb, batch) -> int:
        """Frames per row the microbatch computes (each row's audio is encoded at this size)."""
        if self.padded:
            return max((self.windows(row, batch) for row in mb.shards), default=0)
        return mb.audio_bucket


def evaluate(
    plan: Plan,
    batches,
    scheduler,
    costs: LayoutCosts,
    dynamic: bool = False,
    audio: AudioFrames | None = None,
) -> Measured:
    """Mean simulated step / idle / device idle of `plan` over `batches` (see the module docstring);
    `audio`: an omni model's audio frames per row (None: the schedule's audio buckets)."""
    problem = problem_for(costs, plan.microbatch_range, plan.buckets)
    audio = audio or AudioFrames(padded=False)
    rows = []
    for batch in batches:
        sched = scheduler(batch, problem)
        # [M, R, P, 2] at the real loads (the rows' valid audio frames: useful work)
        shard = _shard_costs(sched, batch, costs, plan, audio, "valid")
        if dynamic:
            times, loads = (
                _shard_costs(sched, batch, costs, plan, audio, "own").max(axis=1),
                _real_loads(sched, batch, plan),
            )
        else:
            loads = [(mb.tile_bucket, mb.length_bucket, audio.computed(mb, batch))
                     for mb in sched.microbatches]  # fmt: skip
            times = np.stack([costs.stage(*key) for key in loads])
        res = costs.simulate(times, np.stack([costs.transfer(*key) for key in loads]),
                             plan.schedule)  # fmt: skip
        useful = shard.mean(axis=1).sum()
        rows.append((res.step_time, res.idle_fraction, 1 - useful / (res.num_stages * res.step_time),
                     0.0 if dynamic else sched.info["padding_tokens"]))  # fmt: skip
    return Measured(*(float(np.mean(c)) for c in zip(*rows)))


def _tiles_per_shard(mb, batch, plan: Plan) -> int:
    """The microbatch's real tiles in tile-bucket units: the fullest row's, packed by row
    (`Layout.tiles_by_row`), else an even share of the encoder shards."""
    if plan.layout.tiles_by_row:
        return max((sum(batch[i].tiles for i in sh) for sh in mb.shards), default=0)
    return math.ceil(sum(batch[i].tiles for i in mb.samples()) / plan.layout.encoder_dp)


def _real_loads(sched: Schedule, batch, plan: Plan) -> list[tuple[int, int, int]]:
    """Per microbatch (its tiles in tile-bucket units, tokens of the largest LLM shard, 30 s
    windows' frames of the fullest row) actually present (the transfers' sizes)."""
    padded = AudioFrames(padded=True)
    return [
        (
            _tiles_per_shard(mb, batch, plan),
            max(max(sum(batch[i].tokens for i in sh) for sh in mb.shards), 1),
            padded.computed(mb, batch),
        )
        for mb in sched.microbatches
    ]


def _shard_costs(
    sched: Schedule, batch, costs: LayoutCosts, plan: Plan, audio: AudioFrames, frames: str
) -> np.ndarray:
    """[M, R, P, 2]: each LLM data-parallel rank's stage costs at its real load (tiles as
    `_tiles_per_shard` counts them; its row's "valid" mel frames, or with "own" the frames the
    data-blind packing computes for its own row alone; an audio stage's shard at that many frames
    per row it holds); a rank whose load is lighter than another's waits for it."""
    out = []
    for mb in sched.microbatches:
        t = _tiles_per_shard(mb, batch, plan)
        out.append([costs.stage(t, max(sum(batch[i].tokens for i in sh), 1),
                                audio.row_frames(sh, batch, frames)) for sh in mb.shards])  # fmt: skip
    return np.asarray(out)


def baseline_steps(plan: Plan, batches, costs: LayoutCosts, names) -> dict[str, dict]:
    """Per scheduler baseline on `plan`'s layout: its `Measured` figures (as dicts) through `evaluate`,
    or {"error": ...} when it cannot schedule a batch (e.g. it overflows the largest buckets)."""
    out = {}
    for name in names:

        def sched(batch, problem, name=name):
            return run_baselines(batch, problem, plan.microbatches, [name])[name]

        try:
            out[name] = dataclasses.asdict(evaluate(plan, batches, sched, costs))
        except ValueError as e:
            out[name] = {"error": str(e).replace("|", "/")}
    return out


def strongest_baseline(dflop_step: float, baselines: dict[str, dict]) -> dict:
    """The baseline with the lowest mean step (ties: the first), and DFLOP's speedup over it."""
    ok = {n: b["step_s"] for n, b in baselines.items() if "step_s" in b}
    if not ok:
        return {"name": None, "step_s": float("nan"), "speedup": float("nan")}
    name = min(ok, key=ok.get)
    return {"name": name, "step_s": ok[name], "speedup": ok[name] / dflop_step}


def run_case(
    model: str,
    num_devices: int,
    config: PlannerConfig,
    eval_batches: int,
    remat: bool,
    progress,
    baselines: tuple[str, ...] = tuple(BASELINES),
    audio_share: float = 0.3,
) -> dict:
    """One row: both plans, evaluated (module docstring); `audio_share`: an omni model's share of
    samples with audio."""
    arch_name, data = MODELS[model]
    shapes = {"llava-ov": lambda: llava_ov_mix(4000, 0), "omnibal": omnibal_shapes,
              "omni": lambda: omni_mix(4000, 0, audio_share)}[data]()  # fmt: skip
    arch, device = get_arch(arch_name), get_device("h100")
    provider = AnalyticCostProvider(arch, device, remat=remat, trainable=config.trainable)
    args = (arch, device, num_devices, shapes, config, provider, progress)
    (dflop, t_dflop), (blind, t_blind) = _plan(args, "dflop"), _plan(args, "uniform")
    if not isinstance(dflop, Plan) or not isinstance(blind, Plan):
        raise PlanningError(f"DFLOP: {_outcome(dflop, arch)}; data-blind: {_outcome(blind, arch)}")
    batches = sample_batches(shapes, config.global_batch, eval_batches, EVAL_SEED)
    d_costs, b_costs = plan_costs(dflop, provider), plan_costs(blind, provider)
    omni = arch.audio is not None
    padded = AudioFrames(padded=True)
    d = evaluate(dflop, batches, online_scheduler("greedy", 0), d_costs)
    b = evaluate(blind, batches, data_blind_scheduler(), b_costs, audio=padded)
    bd = evaluate(blind, batches, data_blind_scheduler(), b_costs, dynamic=True, audio=padded)
    base = baseline_steps(dflop, batches, d_costs, baselines)
    name = model + (f" audio {audio_share:.0%}" if omni else "") + _recipe(config.trainable)
    return {
        "model": name, "arch": arch_name, "gpus": num_devices, "global_batch": config.global_batch,
        "dflop_layout": _layout_cell(dflop, arch), "blind_layout": _layout_cell(blind, arch),
        "dflop": dataclasses.asdict(d), "blind": dataclasses.asdict(b), "blind_dynamic": dataclasses.asdict(bd),
        "speedup": b.step_s / d.step_s, "speedup_vs_dynamic": bd.step_s / d.step_s,
        "idle_reduction": 1 - d.idle / b.idle if b.idle > 0 else float("nan"),
        "idle_reduction_vs_dynamic": 1 - d.idle / bd.idle if bd.idle > 0 else float("nan"),
        "device_idle_reduction": 1 - d.device_idle / b.device_idle if b.device_idle > 0 else float("nan"),
        "device_idle_reduction_vs_dynamic": 1 - d.device_idle / bd.device_idle if bd.device_idle > 0 else float("nan"),
        "baselines": base, "strongest_baseline": strongest_baseline(d.step_s, base),
        "plan_time_s": t_dflop + t_blind, "plan_time_dflop_s": t_dflop, "plan_time_blind_s": t_blind,
    }  # fmt: skip


def _recipe(trainable: tuple[str, ...]) -> str:
    """ "" for full training, else " [projector,llm]"."""
    return "" if set(trainable) == {"vision", "projector", "llm"} else f" [{','.join(trainable)}]"


def _plan(args: tuple, mode: str) -> tuple[Plan | PlanningError, float]:
    """(`make_plan(*args, mode=mode)` or the PlanningError it raised, seconds it took): both planners
    run even when one finds nothing, so a case with no plan says which found one."""
    t0 = time.perf_counter()
    try:
        plan = make_plan(*args, mode=mode)
    except PlanningError as e:
        plan = e
    return plan, time.perf_counter() - t0


def _outcome(plan: Plan | PlanningError, arch) -> str:
    return f"found {_layout_cell(plan, arch)}" if isinstance(plan, Plan) else str(plan)


def _layout_cell(plan: Plan, arch) -> str:
    """e.g. "enc@llm0 / llm tp4 pp1 dp8 M=8 remat, enc heads 25->28"."""
    layout, chunks = plan_virtual_layout(plan)
    out = f"{describe_layout(layout, chunks)} M={plan.microbatches}".replace(" | ", " / ")
    remat = plan.search["remat"]
    out += "" if remat is None else (" remat" if remat else " no-remat")
    heads = plan.search["encoder_heads"]
    return out + (
        "" if heads == arch.vision.num_heads else f", enc heads {arch.vision.num_heads}->{heads}"
    )


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.0%}"


def format_tables(rows: list[dict], failures: list[dict] = ()) -> str:
    """Markdown: layouts, then figures (simulation with analytic costs), then the cases with no plan."""
    head = "| model | GPUs | global batch | DFLOP layout | data-blind layout |\n|---|---|---|---|---|\n"
    lay = "".join(
        f"| {r['model']} | {r['gpus']} | {r['global_batch']} | {r['dflop_layout']} | {r['blind_layout']} |\n"
        for r in rows
    )
    cols = ("| model | GPUs | step DFLOP (s) | step blind (s) | speedup | pipeline idle DFLOP / blind | "
            "device idle DFLOP / blind | device idle cut | LLM padding DFLOP / blind | "
            "blind dynamic-shape: step (s) / device idle | speedup / device idle cut vs it | "
            "strongest scheduler baseline on DFLOP's layout: name, step (s) | speedup vs it | "
            "planning s DFLOP / blind |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")  # fmt: skip
    num = "".join(
        f"| {r['model']} | {r['gpus']} | {r['dflop']['step_s']:.2f} | {r['blind']['step_s']:.2f} | "
        f"{r['speedup']:.2f}x | {r['dflop']['idle']:.1%} / {r['blind']['idle']:.1%} | "
        f"{r['dflop']['device_idle']:.1%} / {r['blind']['device_idle']:.1%} | {_pct(r['device_idle_reduction'])} | "
        f"{r['dflop']['padding_tokens']:.1%} / {r['blind']['padding_tokens']:.1%} | "
        f"{r['blind_dynamic']['step_s']:.2f} / {r['blind_dynamic']['device_idle']:.1%} | "
        f"{r['speedup_vs_dynamic']:.2f}x / {_pct(r['device_idle_reduction_vs_dynamic'])} | "
        f"{_strongest_cells(r)} | "
        f"{r['plan_time_dflop_s']:.0f} / {r['plan_time_blind_s']:.0f} |\n"
        for r in rows
    )  # fmt: skip
    out = head + lay + "\n" + cols + num
    if failures:
        out += "\n| model | GPUs | no plan |\n|---|---|---|\n"
        out += "".join(f"| {f['model']} | {f['gpus']} | {f['error']} |\n" for f in failures)
    return out


def _strongest_cells(row: dict) -> str:
    """ "name, step | speedup" of the row's strongest baseline ("none | n/a" when none ran)."""
    sb = row.get("strongest_baseline") or {"name": None}
    if sb["name"] is None:
        return "none | n/a"
    return f"{sb['name']}, {sb['step_s']:.2f} | {sb['speedup']:.2f}x"


def _settings(cfg: ClusterBenchConfig, args) -> tuple[list[int], list[str], int, int]:
    """(GPU counts, models, evaluation batches, planner samples): the config's, else the mode's."""
    default_gpus = (32, 64, 128) if args.paper else ((8, 32) if args.quick else (8, 32, 64))
    default_models = (
        PAPER_MODELS if args.paper else (("llava-ov",) if args.quick else DEFAULT_MODELS)
    )
    return (
        list(cfg.gpus or default_gpus),
        list(cfg.models or default_models),
        cfg.eval_batches or (3 if args.quick else 8),
        cfg.samples or (2 if args.quick else 4),
    )


def _planner_config(n: int, cfg: ClusterBenchConfig, args) -> PlannerConfig:
    """Global batch 4 per GPU; `--paper` also searches remat on/off, up to 4 encoder stages, every
    LLM pipeline depth up to 8, every encoder tp up to 8 that divides its heads and MLP (DFLOP: 5
    for InternViT-6B's 25 heads, 7 for InternViT-1B's 28) and (the data-blind baseline) 2 virtual
    stages per LLM stage."""
    extra = {"remat": (False, True), "encoder_pp": (1, 2, 4), "llm_pp": tuple(range(1, 9)),
             "encoder_tp": tuple(range(1, 9)), "virtual_stages": (1, 2)} if args.paper else {}  # fmt: skip
    return PlannerConfig(global_batch=4 * n, samples=_settings(cfg, args)[3], trainable=cfg.trainable,
                         screen_per_group=1 if args.quick else 2, **extra)  # fmt: skip


COMMAND = command(
    "cluster",
    __doc__.split("\n\n")[0],
    "python -m dflop_jax.bench cluster --quick gpus=8 eval_batches=1 samples=1 baselines=[]",
    quick="8 and 32 GPUs, LLaVA-OV only, fewer batches",
    paper="the paper's model set at 32, 64, 128 GPUs",
)


@dataclasses.dataclass(frozen=True)
class ClusterBenchConfig:
    """Which simulated clusters to plan and evaluate (an empty or 0 value: the mode's default).

    Attributes:
      gpus: H100 counts (default 8, 32, 64; --quick 8, 32; --paper 32, 64, 128).
      models: model names from `MODELS` (default llava-ov, internvl; --quick llava-ov; --paper the
        paper's set).
      eval_batches: evaluation global batches (default 8; --quick 3).
      samples: the planner's sampled batches K (default 4; --quick 2).
      remat: cost model with activation recomputation (full remat).
      baselines: scheduler baselines run on DFLOP's layout ([] for none; reference-exact spends ~1 s of
        CP-SAT per evaluation batch).
      trainable: trained parts (a training recipe), e.g. [projector, llm]: a frozen encoder.
      audio_shares: for an omni model, the shares of samples with audio, one row each.
      json_out: also write the rows as JSON here, after every case ("" = none).
    """

    gpus: tuple[int, ...] = ()
    models: tuple[str, ...] = ()
    eval_batches: int = 0
    samples: int = 0
    remat: bool = True
    baselines: tuple[str, ...] = tuple(BASELINES)
    trainable: tuple[str, ...] = ("vision", "projector", "llm")
    audio_shares: tuple[float, ...] = (0.1, 0.3, 0.6)
    json_out: str = ""

    def __post_init__(self):
        require(all(g >= 1 for g in self.gpus), "gpus", list(self.gpus), "GPU counts are >= 1")
        unknown = [m for m in self.models if m not in MODELS]
        require(not unknown, "models", list(self.models), f"choose from {', '.join(MODELS)}")
        require(self.eval_batches >= 0, "eval_batches", self.eval_batches, "must be >= 0")
        require(self.samples >= 0, "samples", self.samples, "must be >= 0")
        ok = bool(self.audio_shares) and all(0 < a <= 1 for a in self.audio_shares)
        require(ok, "audio_shares", list(self.audio_shares), "give shares in (0, 1]")
        bad = [b for b in self.baselines if b not in BASELINES]
        require(not bad, "baselines", list(self.baselines),
                f"unknown baseline {bad[:1]}; choose from {', '.join(BASELINES)} or []")  # fmt: skip
        try:
            check_trainable(self.trainable, "trainable")
        except ValueError as e:
            raise ConfigError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    cfg, args = load(COMMAND, ClusterBenchConfig, argv)
    if args.quick and args.paper:
        print("error: --quick and --paper are two presets; give one", file=sys.stderr)
        return 2
    gpus, models, eval_batches, _ = _settings(cfg, args)
    rows, failures = [], []
    with progress_bar() as progress:
        for n in (
            gpus
        ):  # every model at one size before the next size: a cut-short sweep stays comparable
            for model in models:
                _run_one(model, n, cfg, args, eval_batches, progress, rows, failures)
                if (
                    cfg.json_out
                ):  # after every case, so a long sweep's figures survive an interruption
                    _dump(cfg.json_out, rows, failures)
    print("Simulation with analytic costs (H100 preset), not measured on GPUs.\n")
    print(format_tables(rows, failures))
    return 1 if failures else 0


def _run_one(
    model: str,
    n: int,
    cfg: ClusterBenchConfig,
    args,
    eval_batches: int,
    progress,
    rows: list,
    failures: list,
) -> None:
    """One case appended to `rows`, or, with no plan, to `failures`; a one-line summary on stderr."""
    for share in cfg.audio_shares if model in OMNI_MODELS else (0.0,):
        try:
            r = run_case(model, n, _planner_config(n, cfg, args), eval_batches, cfg.remat,
                         progress, cfg.baselines, share)  # fmt: skip
        except (FileNotFoundError, ValueError) as e:  # PlanningError is a ValueError
            print(f"error: {model} x{n}: {e}", file=sys.stderr)
            failures.append({"model": model, "gpus": n, "error": str(e).replace("|", "/")})
            continue
        rows.append(r)
        _report(r)


def _report(r: dict) -> None:
    """A case's one-line summary on stderr."""
    model, n = r["model"], r["gpus"]
    sb = r["strongest_baseline"]
    vs = "" if sb["name"] is None else f", {sb['speedup']:.2f}x vs {sb['name']} on its layout"
    print(f"{model} x{n}: speedup {r['speedup']:.2f}x{vs}, device idle {r['dflop']['device_idle']:.1%} vs "
          f"{r['blind']['device_idle']:.1%} (planning {r['plan_time_s']:.0f}s)", file=sys.stderr)  # fmt: skip


def _dump(path: str, rows: list, failures: list) -> None:
    with open(path, "w") as f:
        json.dump({"rows": rows, "failures": failures}, f, indent=1)
