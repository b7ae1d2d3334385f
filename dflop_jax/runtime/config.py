"""`TrainConfig`: the root config of `python -m dflop_jax.train` (one frozen dataclass per component).

python -m dflop_jax.train --config configs/demo.yaml steps=10 optimizer.lr=1e-3
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from dflop_jax.config import require, require_seed
from dflop_jax.config.inputs import InputPath
from dflop_jax.contracts import BucketSet
from dflop_jax.contracts.cost_table import RESIDUAL_POLICIES
from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.contracts.profile_settings import ProfileSettings
from dflop_jax.costs.device_specs import DeviceConfig
from dflop_jax.data.config import DataConfig
from dflop_jax.planner.config import PlannerConfig
from dflop_jax.programs.model_section import MODEL_SIZES, ModelConfig
from dflop_jax.programs.processes import DistributedConfig
from dflop_jax.runtime.optimizer_config import OptimizerConfig
from dflop_jax.scheduler.config import SchedulerConfig


@dataclasses.dataclass(frozen=True)
class LayoutConfig:
    """An explicit plan (used when `plan: explicit`): stages, degrees, buckets, microbatch counts.

    Attributes:
      encoder_layers: vision layers held by each encoder stage (empty: decoder-only model, or the
        encoder colocated).
      encoder_tp: tensor-parallel degree per encoder stage (one value = all stages).
      encoder_dp: encoder data-parallel degree.
      encoder_colocated: the whole encoder runs on LLM stage 0's devices, at its tp and dp (then
        encoder_layers and encoder_tp are empty and encoder_dp is not read).
      llm_layers: decoder layers held by each LLM stage (sum = model layers).
      llm_tp: tensor-parallel degree per LLM stage (one value = all stages).
      llm_dp: LLM data-parallel degree.
      pooled_tiles: the encoder stages take a microbatch's tiles as one pool split over their
        shards, the first LLM stage gathering the whole pool (`Layout.pooled_tiles`); else each
        LLM row's tiles in its own block.
      tiles, lengths: bucket sets (tiles per LLM row, packed by row, or with pooled_tiles per
        encoder shard; tokens per LLM row).
      audio: audio buckets, audio encoder frames per LLM row (multiples of 4, ascending; a 30 s
        window keeps up to 3000): only for a model with an audio encoder (model.kind omni or
        qwen2_audio), which needs them.
      audio_layers: audio encoder layers held by each audio stage (empty: the audio encoder runs
        on the first LLM stage); the audio stages run beside the encoder stages, both feeding
        the first LLM stage.
      audio_tp: tensor-parallel degree per audio stage (one value = all stages).
      audio_dp: the audio stages' data-parallel degree (divides llm_dp: each replica encodes whole
        LLM rows' audio).
      microbatches: (min, max) microbatches per global batch.
    """

    encoder_layers: tuple[int, ...] = (1, 1)
    encoder_tp: tuple[int, ...] = (1,)
    encoder_dp: int = 1
    llm_layers: tuple[int, ...] = (2, 2)
    llm_tp: tuple[int, ...] = (1,)
    llm_dp: int = 1
    pooled_tiles: bool = False
    tiles: tuple[int, ...] = (4,)
    lengths: tuple[int, ...] = (1024, 2048)
    microbatches: tuple[int, int] = (2, 6)
    encoder_colocated: bool = False
    audio: tuple[int, ...] = ()
    audio_layers: tuple[int, ...] = ()
    audio_tp: tuple[int, ...] = (1,)
    audio_dp: int = 1

    def __post_init__(self):
        require(len(self.llm_layers) >= 1, "layout.llm_layers", self.llm_layers, "need >= 1 stage")
        if self.encoder_colocated:
            fix = "the colocated encoder runs on LLM stage 0: give an empty list"
            require(not self.encoder_layers, "layout.encoder_layers", self.encoder_layers, fix)
            require(not self.encoder_tp, "layout.encoder_tp", self.encoder_tp, fix)
        for module in ("encoder", "audio", "llm"):
            layers, tps = getattr(self, f"{module}_layers"), getattr(self, f"{module}_tp")
            _all_positive(layers, f"layout.{module}_layers", "layers per stage")
            _all_positive(tps, f"layout.{module}_tp", "tensor-parallel degrees")
            require(
                len(tps) in (1, len(layers)),
                f"layout.{module}_tp",
                tps,
                f"give one value or one per {module} stage ({len(layers)})",
            )
        require(self.encoder_dp >= 1, "layout.encoder_dp", self.encoder_dp, "must be >= 1")
        fix = "pooled tiles need encoder stages of their own and no audio stages"
        require(not self.pooled_tiles or (bool(self.encoder_layers) and not self.encoder_colocated
                                          and not self.audio_layers),
                "layout.pooled_tiles", self.pooled_tiles, fix)  # fmt: skip
        fix = f"must divide layout.llm_dp={self.llm_dp} (each audio replica encodes whole LLM rows)"
        require(self.audio_dp >= 1 and self.llm_dp % self.audio_dp == 0, "layout.audio_dp",
                self.audio_dp, fix)  # fmt: skip
        fix = "audio stages encode audio: give layout.audio buckets too"
        require(not self.audio_layers or bool(self.audio), "layout.audio_layers",
                self.audio_layers, fix)  # fmt: skip
        require(self.llm_dp >= 1, "layout.llm_dp", self.llm_dp, "must be >= 1")
        for name in ("tiles", "lengths"):
            values = getattr(self, name)
            _all_positive(values, f"layout.{name}", "bucket sizes")
            require(
                len(values) >= 1 and list(values) == sorted(set(values)),
                f"layout.{name}",
                values,
                "give >= 1 bucket size, increasing, no repeats",
            )
        audio = list(self.audio)
        ok = audio == sorted(set(audio)) and all(a >= 4 and a % 4 == 0 for a in audio)
        fix = "give audio buckets as multiples of 4, increasing, no repeats ([] without audio)"
        require(ok, "layout.audio", self.audio, fix)
        require(
            1 <= self.microbatches[0] <= self.microbatches[1],
            "layout.microbatches",
            self.microbatches,
            "need 1 <= min <= max",
        )

    def layout(self) -> Layout:
        audio = _stages("audio", self.audio_layers, self.audio_tp, self.audio_dp)
        llm = _stages("llm", self.llm_layers, self.llm_tp, self.llm_dp)
        if self.encoder_colocated:
            return Layout((), llm, audio_stages=audio)
        enc = _stages("encoder", self.encoder_layers, self.encoder_tp, self.encoder_dp)
        return Layout(enc, llm, audio_stages=audio, pooled_tiles=self.pooled_tiles)

    def buckets(self) -> BucketSet:
        return BucketSet(tuple(self.tiles), tuple(self.lengths), audio=tuple(self.audio))


def _all_positive(values: tuple[int, ...], key: str, what: str) -> None:
    require(all(v >= 1 for v in values), key, values, f"{what} must be >= 1")


def _stages(module, layers, tps, dp) -> tuple[StageSpec, ...]:
    stages, first, n = [], 0, len(layers)
    for i, count in enumerate(layers):
        tp = tps[i] if len(tps) > 1 else tps[0]
        last = i == n - 1
        stages.append(StageSpec(module, first, count, tp, dp, has_embedding=i == 0, has_head=last))
        first += count
    return tuple(stages)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints of the run (orbax; layout-independent: params and optimizer state as the model's tree).

    Attributes:
      every: steps between saves (0 = off).
      keep: the last K checkpoints kept.
      resume: resume from the latest checkpoint in `run_dir` when there is one.
      async_save: write checkpoints in the background while training goes on.
    """

    every: int = 0
    keep: int = 2
    resume: bool = True
    async_save: bool = True

    def __post_init__(self):
        require(self.every >= 0, "checkpoint.every", self.every, "0 (off) or steps between saves")
        require(self.keep >= 1, "checkpoint.keep", self.keep, "must be >= 1")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation (off by default; `runtime/evaluate.py`).

    Attributes:
      every: evaluate after every this many steps and after the last one (0 = off).
      fraction: share of data.source's records held out of training and evaluated, chosen by a hash
        of each record's id (else its position) with `seed` (`data/split.py`); 0 = none.
      source: a separate dataset to evaluate (mix YAML or JSON/JSONL, processed like data.source);
        "" = none. With `fraction` too, both are evaluated.
      batches: global batches (`global_batch` records each) per evaluation; 0 = every full batch of
        the held-out records. The same batches at every evaluation.
      seed: the split's hash seed and the held-out records' batching order (apart from `seed`: a new
        training seed keeps the split).
    """

    every: int = 0
    fraction: float = 0.0
    source: str = ""
    batches: int = 0
    seed: int = 0

    def __post_init__(self):
        require(self.every >= 0, "eval.every", self.every, "0 (off) or steps between evaluations")
        fix = "use 0 (hold nothing out) or a share below 1, e.g. 0.05"
        require(0 <= self.fraction < 1, "eval.fraction", self.fraction, fix)
        fix = "0 (every full batch of the held-out records) or batches per evaluation"
        require(self.batches >= 0, "eval.batches", self.batches, fix)
        require_seed(self.seed, "eval.seed")
        fix = "evaluation needs held-out data: give eval.fraction > 0 or eval.source"
        require(
            not self.every or self.fraction > 0 or bool(self.source), "eval.every", self.every, fix
        )

    def inputs(self) -> list[InputPath]:
        if not self.source:
            return []
        fix = "give a mix YAML or JSON/JSONL dataset to evaluate, or '' (none)"
        return [InputPath("source", self.source, "file", fix)]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Root config of a training run.

    Attributes:
      plan: "explicit" (the `layout` section); "auto" (DFLOP's steps: data profile -> model profile ->
        plan, each reused from `run_dir/auto_plan` while fresh; see `profile` and `planner`);
        "analytic" (plan on the data's shapes with analytic costs, no profiling); or a plan.yaml path
        written by `python -m dflop_jax.plan`.
      device: the accelerator (`costs.device_specs.DeviceConfig`; "auto" = the one JAX reports) for
        planning, the scheduler's analytic costs (memory capacity, hosts; with `plan: auto` measured
        costs replace the analytic ones) and MFU's peak.
      profile: the profiling steps' settings (`python -m dflop_jax.profile data|model|auto` and
        `plan: auto`): the data profile's source and sample, the model profiler's grid and timing.
      planner: the planner's search space (`python -m dflop_jax.plan`, `plan: auto|analytic`).
      steps: optimizer steps; global_batch: records drawn per step.
      log_every: steps between console lines (every step goes to metrics.jsonl).
      run_dir: the run's directory: resolved config, metrics, checkpoints, plans, profiles.
      seed: seed of the data order and the scheduler (the model's init has `model.init_seed`).
      pipeline: dispatch order of the stage programs ("1f1b" or "gpipe").
      compute_dtype: dtype of the stage programs (params stay fp32).
      num_devices: devices the run plans for; 0 = the devices JAX sees. With `device` a preset it
        plans for a cluster one is not on (`device=h100 num_devices=64 --dry-run` compiles that plan's
        stages on as many simulated CPU devices).
      num_cpu_devices: simulated CPU devices when running on CPU (set before the first JAX call;
        `num_devices`, when set, instead).
      tensorboard: also write TensorBoard event files to run_dir/tb.
      compilation_cache: persistent XLA compilation cache directory ("" = JAX's own setting: off
        unless JAX_COMPILATION_CACHE_DIR names one). JAX writes it from process 0; the other
        processes of a multi-process run keep their stage programs in its `dflop_executables`
        folder (`programs/executable_store.py`).
      distributed: multi-process settings (else env DFLOP_COORDINATOR/NUM_PROCESSES/PROCESS_ID).
      measure_stage_times_every: every this many steps, time each stage program of one sampled
        microbatch (step % M; the other microbatches are not waited for: `runtime/driver.py`) and
        feed the times to the scheduler's adaptive correction (`Scheduler.observe`); 0 = off.
        Multi-process runs too: each stage's times come from the process owning it and are shared,
        so every process observes alike (`schedule_agreement.py`).
      prefetch: global batches the loader solves and decodes ahead in its background thread. Batch
        k (step k + 1) is scheduled with the observations of steps <= k - prefetch, a deterministic
        rule (exact resume, every process alike; `runtime/lagged_schedule.py`).
      eval: held-out evaluation (`EvalConfig`).
      residuals: what each inner stage keeps per in-flight microbatch for its backward
        (`contracts.cost_table.RESIDUAL_POLICIES`): "auto" picks per stage the policy with the least
        backward work whose memory fits the plan device (`costs.residual_policies`), or one policy
        ("all", "layers", "recompute") for every stage.
    """

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    plan: str = "explicit"
    device: DeviceConfig = DeviceConfig()
    profile: ProfileSettings = ProfileSettings()
    layout: LayoutConfig = LayoutConfig()
    planner: PlannerConfig = PlannerConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    steps: int = 30
    global_batch: int = 16
    log_every: int = 1
    run_dir: str = "runs/demo"
    seed: int = 0
    pipeline: Literal["1f1b", "gpipe"] = "1f1b"
    compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    num_devices: int = 0
    num_cpu_devices: int = 8
    tensorboard: bool = False
    compilation_cache: str = "runs/jax_cache"
    distributed: DistributedConfig = DistributedConfig()
    measure_stage_times_every: int = 5
    prefetch: int = 2
    eval: EvalConfig = EvalConfig()
    residuals: Literal["auto", "all", "layers", "recompute"] = "auto"

    def __post_init__(self):
        if self.model.hf_dir:
            _take_hf_data_settings(self)
        require(self.steps >= 1, "steps", self.steps, "must be >= 1")
        require(
            self.plan in ("explicit", "auto", "analytic") or self.plan.endswith((".yaml", ".yml")),
            "plan",
            self.plan,
            "use explicit, auto, analytic or a plan.yaml path",
        )
        require(self.global_batch >= 1, "global_batch", self.global_batch, "must be >= 1")
        require(self.log_every >= 1, "log_every", self.log_every, "must be >= 1")
        family = "llava_ov" if self.model.kind == "omni" else self.model.kind
        require(
            not self.model.has_vision or family == self.data.model_family,
            "model.kind",
            self.model.kind,
            f"must match data.model_family={self.data.model_family} (or be decoder or "
            "qwen2_audio; omni's vision tower is llava_ov's)",
        )
        require(self.num_cpu_devices >= 1, "num_cpu_devices", self.num_cpu_devices, "must be >= 1")
        fix = "0 (the devices JAX sees) or the device count to plan for"
        require(self.num_devices >= 0, "num_devices", self.num_devices, fix)
        require(
            self.measure_stage_times_every >= 0,
            "measure_stage_times_every",
            self.measure_stage_times_every,
            "0 (off) or steps between measured steps",
        )
        require(self.prefetch >= 1, "prefetch", self.prefetch, "must be >= 1 (batches ahead)")
        policies = ("auto", *RESIDUAL_POLICIES)
        require(self.residuals in policies, "residuals", self.residuals, f"use one of {policies}")
        require_seed(self.seed, "seed")
        require(
            bool(self.run_dir), "run_dir", self.run_dir, "give a directory for the run's outputs"
        )
        if self.plan == "explicit":
            _check_layout_fits_model(self.layout, self.model)
        fix = (
            "a run plans with its model's remat (model.vision_remat, model.llm_remat): leave it []"
        )
        require(not self.planner.remat, "planner.remat", self.planner.remat, fix)
        fix = f"a run plans for its own steps (steps={self.steps}): leave planner.steps at 0"
        require(not self.planner.steps, "planner.steps", self.planner.steps, fix)
        fix = "re-planning happens at checkpoints and resumes from them: set checkpoint.every"
        replans = self.planner.replan_every and self.planner.replan == "on_drift"
        ok = not replans or (self.checkpoint.every > 0 and self.checkpoint.resume)
        require(ok, "planner.replan", self.planner.replan, fix + " and checkpoint.resume=true")
        fix = "plan=auto profiles models with an encoder; use plan=analytic or explicit"
        encoder = self.model.has_vision or self.model.has_audio
        require(self.plan != "auto" or encoder, "plan", self.plan, fix)

    def model_config(self):
        """The run's `models` config (`ModelConfig.model_config`: no parameter is made), with the
        data's tile and patch sizes and pixel normalization. The run's tokenizer sizes the
        vocabulary of a model built from the fields; an HF directory or a named architecture brings
        its own, and the tokenizer is not read. Built once per command, by `resolve.RunContext`."""
        vocab = 0
        if not (self.model.hf_dir or self.model.arch):
            from dflop_jax.data import load_tokenizer

            vocab = load_tokenizer(self.data.tokenizer).vocab_size
        return self.model.model_config(vocab, tile_px=self.data.tile_px,
                                       patch_size=self.data.patch_size,
                                       compute_dtype=self.compute_dtype,
                                       pixel_norm=(self.data.mean, self.data.std),
                                       audio_mels=self.data.audio_mels)  # fmt: skip

    def inputs(self) -> list[InputPath]:
        if self.plan in ("explicit", "auto", "analytic"):
            return []
        fix = (
            "give a plan.yaml written by `python -m dflop_jax.plan`, or plan=explicit/auto/analytic"
        )
        return [InputPath("plan", self.plan, "file", fix, parse=self._check_plan_file)]

    def _check_plan_file(self, path) -> None:
        """Raises ValueError if the plan.yaml is malformed or is one this runtime cannot train."""
        from dflop_jax.planner.plan_file import load_plan
        from dflop_jax.planner.resolve import check_runnable

        check_runnable(load_plan(path).layout, self.plan, self.model.has_vision)

    def ignored_keys(self) -> dict[str, str]:
        """Sections this run does not read, given `plan` and `model.hf_dir` (set keys there are warned).
        `planner` and `profile` are never listed: `python -m dflop_jax.plan` and `... profile` read
        them whatever `plan` is."""
        out = {}
        if self.plan != "explicit":
            out["layout"] = f"read only with plan=explicit (plan={self.plan})"
        elif self.layout.encoder_colocated:
            out["layout.encoder_dp"] = "the colocated encoder's dp is layout.llm_dp"
        if not self.model.has_vision:
            why = f"model.kind={self.model.kind} has no vision encoder"
            out.update({f"model.{n}": why for n in MODEL_SIZES if n.startswith("vision_")})
        if not self.model.has_audio:
            why = f"model.kind={self.model.kind} has no audio encoder"
            out.update({f"model.{n}": why for n in MODEL_SIZES if n.startswith("audio_")})
        if self.model.hf_dir or self.model.arch:
            why = "the shapes come from model.hf_dir's config.json or model.arch"
            out.update({f"model.{name}": why for name in ("vocab_size", *MODEL_SIZES, "init_seed")})
        if self.data.source != "synthetic":
            why = f"read only with data.source=synthetic (source={self.data.source})"
            out.update(
                {
                    f"data.{n}": why
                    for n in ("synth_dir", "synth_samples", "synth_mix", "synth_seed")
                }
            )
        if not self.eval.every:
            why = "read only with eval.every > 0 (nothing is evaluated)"
            out.update({f"eval.{n}": why for n in ("source", "batches")})
        return out


def _take_hf_data_settings(cfg: TrainConfig) -> None:
    """`cfg.data`'s keys left at auto := what `cfg.model.hf_dir` carries (`data.hf_settings`): the
    model's tokenizer (the bundled byte-level one never matches an HF model's embedding), its chat
    template, tile size, pixel mean/std and tiling limits. A value the user set is kept. Then the tile size must be
    the one the vision tower is built for."""
    from dflop_jax.data.hf_settings import hf_data_settings, vision_image_size

    d, hf_dir = cfg.data, cfg.model.hf_dir
    found = hf_data_settings(hf_dir)
    unset = {
        "tokenizer": d.tokenizer == "bundled",
        "chat_template": d.chat_template == "auto",
        "tile_size": d.tile_size == 0,
        "pixel_mean": not d.pixel_mean,
        "pixel_std": not d.pixel_std,
        "max_grid": d.max_grid == 0,
        "max_tiles": d.max_tiles == 0,
    }
    side = vision_image_size(hf_dir) if cfg.model.has_vision else None
    if side and "tile_size" not in found:  # no preprocessor size: the tower's own
        found["tile_size"] = side
    take = {k: v for k, v in found.items() if unset[k]}
    if take.get("tokenizer", d.tokenizer) != hf_dir:  # the template belongs to hf_dir's tokenizer
        take.pop("chat_template", None)
    data = dataclasses.replace(d, **take)
    object.__setattr__(cfg, "data", data)  # frozen: set once, while the config is being made
    fix = f"{hf_dir}'s vision tower is built for {side} px tiles: use {side} (or 0 = auto)"
    require(side is None or data.tile_px == side, "data.tile_size", data.tile_px, fix)


def _check_layout_fits_model(lay: LayoutConfig, m: ModelConfig) -> None:
    """An explicit layout must place every layer of the model and split its heads evenly, and has
    audio buckets exactly when the model has an audio encoder."""
    if m.has_audio:
        fix = (f"model.kind={m.kind} needs audio buckets (frames of audio per LLM row), "
               "e.g. [752, 3000]")  # fmt: skip
        require(bool(lay.audio), "layout.audio", lay.audio, fix)
        if m.hf_dir:  # the audio shapes are known once config.json is read
            pass
        elif lay.audio_layers:
            _check_module_stages(lay, "audio", m)
        else:
            fix = (f"each must divide model.audio_num_heads={m.audio_num_heads} too (LLM stage 0 "
                   "runs the audio encoder without layout.audio_layers)")  # fmt: skip
            require(m.audio_num_heads % lay.llm_tp[0] == 0, "layout.llm_tp", lay.llm_tp, fix)
    else:
        fix = f"model.kind={m.kind} has no audio encoder: leave it []"
        require(not lay.audio, "layout.audio", lay.audio, fix)
        require(not lay.audio_layers, "layout.audio_layers", lay.audio_layers, fix)
    if not m.has_vision:
        fix = f"model.kind={m.kind} has no vision encoder: give layout.encoder_layers=[]"
        require(not lay.encoder_layers, "layout.encoder_layers", lay.encoder_layers, fix)
        fix = f"model.kind={m.kind} has no vision encoder to colocate"
        require(not lay.encoder_colocated, "layout.encoder_colocated", True, fix)
    elif not lay.encoder_colocated:
        fix = (f"model.kind={m.kind} needs >= 1 encoder stage, or layout.encoder_colocated=true "
               "(or model.kind=decoder)")  # fmt: skip
        require(bool(lay.encoder_layers), "layout.encoder_layers", lay.encoder_layers, fix)
    if m.hf_dir or m.arch:  # the shapes are known once config.json (or the arch) is read
        return
    _check_module_stages(lay, "llm", m)
    if not m.has_vision:
        return
    if lay.encoder_colocated:  # the colocated stage runs both models at LLM stage 0's tp
        fix = f"with layout.encoder_colocated it must divide model.vision_num_heads={m.vision_num_heads} too"
        tp0 = lay.llm_tp[0]
        require(m.vision_num_heads % tp0 == 0, "layout.llm_tp", lay.llm_tp, fix)
        return
    _check_module_stages(lay, "encoder", m)


def _check_module_stages(lay: LayoutConfig, module: str, m: ModelConfig) -> None:
    """`layout.<module>_layers` add up to the model's layers of that module and each
    `layout.<module>_tp` divides its attention heads (model.num_*, vision_num_*, audio_num_*)."""
    sizes = {"llm": "", "encoder": "vision_", "audio": "audio_"}[module]
    layers, tps = getattr(lay, f"{module}_layers"), getattr(lay, f"{module}_tp")
    total, heads = getattr(m, f"{sizes}num_layers"), getattr(m, f"{sizes}num_heads")
    fix = f"must add up to model.{sizes}num_layers={total}"
    require(sum(layers) == total, f"layout.{module}_layers", layers, fix)
    fix = f"each must divide model.{sizes}num_heads={heads}"
    require(all(heads % tp == 0 for tp in tps), f"layout.{module}_tp", tps, fix)
