"""Profile -> plan, each step reused when its output is fresh (DFLOP's profiling + optimization steps).

    plan = ensure_plan(AutoPlanConfig(...), model_cfg, cache_dir="runs/demo/auto_plan", arch=arch)
    shapes, digest = data_profile(cfg, data_cfg, cache, timings)       # step 1 alone (profile data)
    table, digest = model_profile(cfg, model_cfg, cache, timings, ...)  # step 2 alone (profile model)
    plan, measured = profiled_plan(AutoPlanConfig(...), model_cfg, "runs/demo/auto_plan", data_cfg,
                                   arch=arch)

Steps, in `cache_dir`:
  1. data profile  -> data/shape_distribution.json (`dflop_jax.data.shape_profile.profile_data`), or a given
     shape file / synthetic mix ("llava-ov", "omnibal") when `data_source` names one;
  2. model profile -> cost_table.json (+ .png) (`profile_model`), resumed entry by entry, under the
     planner's recipe (`planner.trainable`: each part timed with the programs it runs under it);
  3. plan          -> plan.yaml (`planner.make_plan` with a `MeasuredCostProvider`, analytic fallback)
     plus cost_sources.json (which cost entries were measured / interpolated / extrapolated / analytic).
Each output has a `<name>.stamp.json` holding the hash of everything it depends on (configs, the
previous step's stamp, the code version of the packages that produce it); a step runs again iff its
output or stamp is missing or the hash differs. `timings.json` records each step's seconds (0 if reused).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

from dflop_jax.config import InputPath, require, require_seed
from dflop_jax.contracts.profile_settings import SYNTHETIC_SHAPES, ProfileSettings
from dflop_jax.costs.architectures import MLLMArch
from dflop_jax.costs.device_specs import DeviceSpec
from dflop_jax.planner.config import PlannerConfig
from dflop_jax.profiling.table import code_version, config_hash

log = logging.getLogger(__name__)
SYNTHETIC = SYNTHETIC_SHAPES


@dataclasses.dataclass(frozen=True)
class AutoPlanConfig:
    """What the pipeline needs besides the model config; a run's (`plan: auto` and the profile
    commands alike) is `resolve.plan_sources.auto_plan_config`, from its `profile`, `planner`, resolved
    device and device count.

    Attributes:
      device: the planned devices' spec (the run's resolved `DeviceSpec`): capacity and hosts; the
        data step alone needs none.
      num_devices: devices to plan for.
      data_source: "dataset" (profile the training data config passed to `ensure_plan`), a
        shape-distribution JSON path, or a synthetic mix ("llava-ov", "omnibal")
        (`profile.data_source` of a run).
      data_samples: records drawn by the data profiler (or samples of the synthetic llava-ov mix).
      seed: data sampling seed.
      profile: the model profiler's grid and timing.
      planner: the planner's search space.
    """

    device: DeviceSpec | None = None
    num_devices: int = 8
    data_source: str = "dataset"
    data_samples: int = 2000
    seed: int = 0
    profile: ProfileSettings = ProfileSettings()
    planner: PlannerConfig = PlannerConfig()

    def __post_init__(self):
        require(self.num_devices >= 1, "num_devices", self.num_devices, "must be >= 1")
        require(self.data_samples >= 1, "data_samples", self.data_samples, "must be >= 1")
        require_seed(self.seed, "seed")

    def inputs(self) -> list[InputPath]:
        if self.data_source in ("dataset", *SYNTHETIC):
            return []
        fix = f"give a shape-distribution JSON, 'dataset' or one of {SYNTHETIC}"
        return [InputPath("data_source", self.data_source, "file", fix)]


def _device(cfg: AutoPlanConfig) -> DeviceSpec:
    """The planned devices' spec; the data step alone runs without one."""
    if cfg.device is None:
        raise ValueError(
            "AutoPlanConfig.device is unset: profiling the model and planning need the "
            "run's device spec (resolve.plan_sources.auto_plan_config gives it)"
        )
    return cfg.device


def _stamp_path(out: Path) -> Path:
    return out.with_name(out.name + ".stamp.json")


def _fresh(out: Path, digest: str) -> bool:
    stamp = _stamp_path(out)
    if not (out.is_file() and stamp.is_file()):
        return False
    try:
        return json.loads(stamp.read_text()).get("hash") == digest
    except json.JSONDecodeError:
        return False


def _write_stamp(out: Path, digest: str, seconds: float) -> None:
    _stamp_path(out).write_text(json.dumps({"hash": digest, "seconds": seconds}) + "\n")


def _step(name: str, out: Path, digest: str, build, timings: dict) -> Path:
    """Runs `build()` (which writes `out`) unless `out` is fresh for `digest`; logs and times it."""
    if _fresh(out, digest):
        log.info("%s: reusing %s", name, out)
        timings[name] = 0.0
        return out
    t0 = time.perf_counter()
    build()
    timings[name] = time.perf_counter() - t0
    _write_stamp(out, digest, timings[name])
    log.info("%s: done in %.1f s -> %s", name, timings[name], out)
    return out


def data_profile(
    cfg: AutoPlanConfig, data_cfg, cache: Path, timings: dict, progress=None
) -> tuple[Path | str, str]:
    """Step 1 (`python -m dflop_jax.profile data`): (shape file path or synthetic name, its digest)."""
    if cfg.data_source in SYNTHETIC:
        return cfg.data_source, config_hash([cfg.data_source, cfg.data_samples, cfg.seed])
    if cfg.data_source != "dataset":
        path = Path(cfg.data_source)
        if not path.is_file():
            raise FileNotFoundError(f"data_source={path}: no such shape-distribution file")
        return path, config_hash([str(path), path.stat().st_mtime_ns, path.stat().st_size])
    if data_cfg is None:
        raise ValueError("data_source='dataset' needs the training data config (data_cfg)")
    from dflop_jax.data.shape_profile import profile_data

    out = shape_file(cache)
    digest = config_hash([data_cfg, cfg.data_samples, cfg.seed, code_version("dflop_jax/data")])
    _step("data profile", out, digest,
          lambda: profile_data(data_cfg, cfg.data_samples, cfg.seed, out.parent, progress),
          timings)  # fmt: skip
    return out, digest


def shape_file(cache: str | Path) -> Path:
    """Where the data profile writes the shape distribution in `cache`."""
    return Path(cache) / "data" / "shape_distribution.json"


def cost_table_file(cache: str | Path) -> Path:
    """Where the model profile writes the cost table in `cache`."""
    return Path(cache) / "cost_table.json"


def model_profile(
    cfg: AutoPlanConfig, model_cfg, cache: Path, timings: dict, *, name: str, devices, progress=None
) -> tuple[Path, str]:
    """Step 2 (`python -m dflop_jax.profile model`): (the cost table's path, its digest), profiled on
    `devices` under the planner's recipe unless fresh."""
    from dflop_jax.profiling import model_profiler

    device = _device(cfg)
    settings = dataclasses.replace(cfg.profile, memory_limit_bytes=device.memory_bytes)
    table_path = cost_table_file(cache)
    grid = [settings.tps, settings.encoder_buckets, settings.llm_buckets, settings.kinds]
    if hasattr(model_cfg, "audio"):  # a digest unchanged for the models without audio
        grid.append(settings.audio_buckets)
    recipe = cfg.planner.trainable  # profiled as it trains: frozen parts' own programs
    model_digest = config_hash([model_profiler.table_hash(model_cfg, settings, devices, recipe),
                                grid, code_version(*model_profiler.CODE_PACKAGES)])  # fmt: skip
    _step("model profile", table_path, model_digest,
          lambda: model_profiler.profile_model(model_cfg, devices, settings, table_path,
                                               model_name=name, trainable=recipe,
                                               progress=progress),
          timings)  # fmt: skip
    return table_path, model_digest


def ensure_plan(
    cfg: AutoPlanConfig,
    model_cfg,
    cache_dir: str | Path,
    data_cfg=None,
    *,
    arch: MLLMArch,
    plan: bool = True,
    devices=None,
    progress=None,
):
    """Data profile -> model profile -> plan, reusing fresh outputs in `cache_dir` (module docstring).

    Args:
      cfg: devices, data source, profiler grid, planner settings.
      model_cfg: the `models` MLLM config being trained (e.g. `LlavaOnevisionConfig`).
      cache_dir: where the step outputs and stamps live (e.g. `<workdir>/auto_plan`).
      data_cfg: the training `dflop_jax.data.DataConfig` (needed when cfg.data_source == "dataset").
      arch: the model's architecture (`costs.arch_of_model(model_cfg, name)`, the run's
        `RunContext.arch`); its name is the model's in the cost table and the plan.
      plan: False stops after the two profiles (DFLOP's profiling step alone) and returns None.
      devices: the devices the model profile runs on (default `jax.devices()`; a multi-process run
        profiles on process 0's own devices).
      progress: `progress(phase, done, total)` of the three steps (`planner.progress.progress_bar`).

    Returns:
      the `planner.Plan` (also saved as `cache_dir/plan.yaml`).
    """
    import jax

    from dflop_jax.costs import AnalyticCostProvider
    from dflop_jax.costs.measured import MeasuredCostProvider
    from dflop_jax.planner import load_plan, make_plan, save_plan
    from dflop_jax.planner.resolve import load_shapes
    from dflop_jax.planner.space import fit_search_space

    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    device = _device(cfg)
    # before any profiling: a search space these devices cannot hold is one config error
    cfg = dataclasses.replace(
        cfg, planner=fit_search_space(arch, cfg.num_devices, device, cfg.planner)
    )
    shapes_src, data_digest = data_profile(cfg, data_cfg, cache, timings, progress)
    devices = list(jax.devices() if devices is None else devices)
    table_path, model_digest = model_profile(cfg, model_cfg, cache, timings, name=arch.name,
                                             devices=devices, progress=progress)  # fmt: skip
    if not plan:
        (cache / "timings.json").write_text(json.dumps(timings, indent=1) + "\n")
        return None

    plan_path = cache / "plan.yaml"
    plan_digest = config_hash([data_digest, model_digest, cfg.planner, device, cfg.num_devices,
                               code_version("dflop_jax/planner", "dflop_jax/scheduler",
                                            "dflop_jax/sim", "dflop_jax/costs")])  # fmt: skip

    def run_planner():
        provider = MeasuredCostProvider(
            table_path, arch, device, AnalyticCostProvider(arch, device)
        )
        shapes = load_shapes(shapes_src, cfg.data_samples, cfg.seed, audio=arch.audio is not None)
        plan = make_plan(arch, device, cfg.num_devices, shapes, cfg.planner, provider, progress)
        save_plan(plan, plan_path)
        sources = provider.sources()
        (cache / "cost_sources.json").write_text(json.dumps(sources, indent=1) + "\n")
        fallback = {k: v["fallback"] for k, v in sources.items() if "fallback" in v}
        if fallback:
            log.warning(
                "plan used analytic costs for %s (see %s)", fallback, cache / "cost_sources.json"
            )

    _step("plan", plan_path, plan_digest, run_planner, timings)
    (cache / "timings.json").write_text(json.dumps(timings, indent=1) + "\n")
    log.info("auto plan: %s", ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    return load_plan(plan_path)


def profiled_plan(
    cfg: AutoPlanConfig, model_cfg, cache_dir: str | Path, data_cfg, *, arch: MLLMArch,
    share_timeout_s: int = 3600, progress=None,
):  # fmt: skip
    """`plan: auto` of a training run: `ensure_plan` on these devices, and the measured cost provider
    (analytic fallback) the scheduler then predicts with.

    Multi-process runs: process 0 profiles on its local devices and plans for the whole job; the
    others wait (at most `share_timeout_s`) and receive `plan.yaml` and `cost_table.json` from it
    (`programs.processes.share_files`), so every process trains and schedules from the same bytes.

    Returns:
      (planner `Plan`, `MeasuredCostProvider`).
    """
    import jax

    from dflop_jax.costs import AnalyticCostProvider
    from dflop_jax.costs.measured import MeasuredCostProvider
    from dflop_jax.planner import load_plan
    from dflop_jax.programs.processes import share_files

    if not (hasattr(model_cfg, "vision") or hasattr(model_cfg, "audio")):
        raise ValueError("plan=auto profiles models with an encoder; use plan=analytic or explicit")
    # Timings differ between processes, so each would plan differently: process 0 profiles on its
    # own devices and plans for all of them; every other process takes its plan and cost table.
    if jax.process_index() == 0:
        ensure_plan(cfg, model_cfg, cache_dir, data_cfg=data_cfg, arch=arch,
                    devices=jax.local_devices(), progress=progress)  # fmt: skip
    cache = Path(cache_dir)
    share_files([cache / "plan.yaml", cache / "cost_table.json"], "auto-plan", share_timeout_s)
    plan = load_plan(cache / "plan.yaml")
    device = _device(cfg)
    table = Path(cache_dir) / "cost_table.json"
    return plan, MeasuredCostProvider(
        table, arch, device, fallback=AnalyticCostProvider(arch, device)
    )
