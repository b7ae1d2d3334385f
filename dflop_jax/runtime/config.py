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
from dflop_jax.programs.processes import DistributedConfig
from dflop_jax.runtime.train_state import OptimizerConfig
from dflop_jax.scheduler.config import SchedulerConfig
from models.decoder_config import ATTENTION_IMPLS, REMAT_MODES


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model trained: a named architecture, the fields below, or an HF directory.

    `model: siglip-so400m+qwen2.5-7b` is short for `model: {arch: siglip-so400m+qwen2.5-7b}`.

    Attributes:
      arch: a named architecture (`dflop_jax.costs.list_archs()`) whose shapes the model takes
        (random weights unless `hf_dir` is given); "" = the fields below. Its kind is set from it.
      kind: "llava_ov" (SigLIP-style ViT + mlp2x_gelu projector + decoder), "internvl" (InternViT-style
        ViT + pixel shuffle 0.5 + LayerNorm/MLP projector + decoder; (tile/patch / 2)^2 tokens per tile,
        256 at 448 px) or "decoder" (text only). An MLLM kind must equal data.model_family.
      hf_dir: an HF model directory (config.json + safetensors) to load; "" = build from `arch` or
        the fields. With `arch` too, the directory's config.json must describe that architecture.
        Its tokenizer (tokenizer.json there) replaces the bundled byte tokenizer (`data.tokenizer`
        left at "bundled"; another directory given there is kept).
      vocab_size: 0 = the tokenizer's vocabulary size (padded to a multiple of 128).
      hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim: decoder shapes.
      vision_*: ViT shapes (llava_ov); its image and patch sizes are the data's tile and patch sizes.
      init_seed: seed of the random initialization (ignored when loading).
      vision_remat, llm_remat: activation recomputation in the backward of each vision / decoder
        layer: "none", "full" (keep only the layer's input) or "dots" (also keep the matmul
        outputs). Training from a plan.yaml applies the plan's policy instead (`resolve.RunContext`); the
        planner's memory model assumes the same policy (`costs/memory.py`).
      attention_impl: the attention kernel of every layer (vision and decoder, also with `hf_dir`):
        "auto" picks per device and part, once per process (`programs.devices.attention_kernels`:
        "xla" off GPU; on Hopper or newer "cudnn", the decoder "pallas" where cuDNN's packed layout
        is unusable; on older GPUs "pallas"), or one of "xla" (portable), "pallas" (our flash
        kernels), "cudnn" (`models/cudnn_attention.py`). The model config carries the resolved names.
      vision_attention_impl: the vision tower's kernel where it differs ("": `attention_impl`;
        "auto" as above).
      llm_layers_kept: keep only the first N decoder layers of `arch` or `hf_dir` (0 = all of them):
        a real model cut to fit fewer devices (`configs/llava_ov_7b_1gpu.yaml`). The vision tower,
        projector, embedding, final norm and LM head stay whole; from `hf_dir` the first N layers'
        weights are read and the rest are not. Planning, memory, FLOPs and MFU are the cut
        model's; an export writes the cut model. Only with `arch` or `hf_dir` (else set
        `num_layers`).
    """

    SHORTHAND = "arch"  # a bare string given for the section sets this key

    kind: Literal["llava_ov", "internvl", "decoder"] = "llava_ov"
    arch: str = ""
    hf_dir: str = ""
    vocab_size: int = 0
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    vision_hidden_size: int = 32
    vision_intermediate_size: int = 64
    vision_num_layers: int = 2
    vision_num_heads: int = 2
    init_seed: int = 0
    vision_remat: str = "none"
    llm_remat: str = "none"
    attention_impl: str = "auto"
    vision_attention_impl: str = ""
    llm_layers_kept: int = 0

    def __post_init__(self):
        if self.arch:
            from dflop_jax.costs import get_arch, list_archs

            require(self.arch in list_archs(), "model.arch", self.arch,
                    f"use one of {', '.join(list_archs())}")  # fmt: skip
            family = "internvl" if get_arch(self.arch).vision.class_token else "llava_ov"
            object.__setattr__(self, "kind", family)  # the architecture's family, not the default
            total = get_arch(self.arch).llm.num_layers
            require(self.llm_layers_kept <= total, "model.llm_layers_kept", self.llm_layers_kept,
                    f"{self.arch} has {total} decoder layers: keep 1..{total} (0 = all)")  # fmt: skip
        require(self.llm_layers_kept >= 0, "model.llm_layers_kept", self.llm_layers_kept,
                "0 (every layer) or the number of first decoder layers to keep")  # fmt: skip
        fix = "it cuts model.arch or model.hf_dir; a model built from the fields sets model.num_layers"
        require(not self.llm_layers_kept or bool(self.arch or self.hf_dir),
                "model.llm_layers_kept", self.llm_layers_kept, fix)  # fmt: skip
        impls = [*(i for i in ATTENTION_IMPLS if i), "auto"]
        require(self.attention_impl in impls, "model.attention_impl", self.attention_impl,
                f"use one of {impls}")  # fmt: skip
        require(self.vision_attention_impl in ["", *impls], "model.vision_attention_impl",
                self.vision_attention_impl, f"use one of {impls}, or '' for model.attention_impl")  # fmt: skip
        for name in ("vision_remat", "llm_remat"):
            value = getattr(self, name)
            require(value in REMAT_MODES, f"model.{name}", value, f"use one of {REMAT_MODES}")
        require(self.vocab_size >= 0, "model.vocab_size", self.vocab_size, "0 (tokenizer's) or > 0")
        for name in _MODEL_SIZES:
            value = getattr(self, name)
            require(value >= 1, f"model.{name}", value, "must be >= 1")
        require(
            self.num_heads % self.num_kv_heads == 0,
            "model.num_heads",
            self.num_heads,
            f"must be a multiple of model.num_kv_heads={self.num_kv_heads} (grouped-query attention)",
        )
        require(self.head_dim % 2 == 0, "model.head_dim", self.head_dim, "must be even (RoPE)")
        require(
            self.vision_hidden_size % self.vision_num_heads == 0,
            "model.vision_hidden_size",
            self.vision_hidden_size,
            f"must be a multiple of model.vision_num_heads={self.vision_num_heads}",
        )
        require_seed(self.init_seed, "model.init_seed")

    def inputs(self) -> list[InputPath]:
        if not self.hf_dir:
            return []
        fix = (
            "give an HF model directory (config.json + safetensors) or '' to build from the fields"
        )
        return [InputPath("hf_dir", self.hf_dir, "dir", fix, contains="config.json")]

    @property
    def remat(self) -> dict[str, str]:
        """The per-module policy, as plan.yaml records it ({"vision": ..., "llm": ...})."""
        return {"vision": self.vision_remat, "llm": self.llm_remat}

    def with_sizes_of(self, model_cfg) -> ModelConfig:
        """This section with the kind and sizes of `model_cfg`, the model built from it, for the run's
        config.yaml: with `hf_dir` or `arch` those come from config.json or the architecture (the
        fields here are ignored and would keep their defaults); otherwise the section is returned
        unchanged (its fields are the model's, `vocab_size` 0 still meaning the tokenizer's)."""
        if not (self.hf_dir or self.arch):
            return self
        text = getattr(model_cfg, "text", model_cfg)
        sizes = {
            "vocab_size": text.vocab_size, "hidden_size": text.hidden_size,
            "intermediate_size": text.intermediate_size, "num_layers": text.num_layers,
            "num_heads": text.num_heads, "num_kv_heads": text.num_kv_heads,
            "head_dim": text.head_dim,
        }  # fmt: skip
        vision = getattr(model_cfg, "vision", None)
        if vision is None:
            return dataclasses.replace(self, kind="decoder", **sizes)
        sizes |= {
            "vision_hidden_size": vision.hidden_size,
            "vision_intermediate_size": vision.intermediate_size,
            "vision_num_layers": vision.num_layers, "vision_num_heads": vision.num_heads,
        }  # fmt: skip
        from models.internvl import InternVLConfig

        kind = "internvl" if isinstance(model_cfg, InternVLConfig) else "llava_ov"
        return dataclasses.replace(self, kind=kind, **sizes)

    def attention_kernels(self) -> tuple[str, str]:
        """(vision, decoder) attention implementations with "auto" resolved for this process's
        device (`programs.devices.local_attention_kernels`, asked only when "auto" is set)."""
        vision = self.vision_attention_impl or self.attention_impl
        llm = self.attention_impl
        if "auto" in (vision, llm):
            from dflop_jax.programs.devices import local_attention_kernels

            auto = local_attention_kernels()
            vision = auto.vision if vision == "auto" else vision
            llm = auto.llm if llm == "auto" else llm
        return vision, llm

    @property
    def source(self) -> int | str:
        """Where the params come from (`programs.stage_builder.ParamSource`): the HF directory, else
        the init seed."""
        return self.hf_dir or self.init_seed

    def model_config(
        self,
        tokenizer_vocab: int,
        *,
        tile_px: int,
        patch_size: int,
        compute_dtype: str,
        pixel_norm: tuple[tuple[float, ...], tuple[float, ...]] | None = None,
    ):
        """The `models` config of the model (fp32 master params): from the fields, or from `hf_dir`'s
        config.json. No parameter is made here: each pipeline stage makes its own
        (`programs.stage_builder.build_stages(model_cfg, layout, meshes, self.source)`).

        Args:
          tokenizer_vocab: the tokenizer's vocabulary (used when `vocab_size` is 0, padded to a
            multiple of 128 so tp divides it; the padding rows are never targeted).
          tile_px, patch_size: the data's tile and patch size (the ViT's image and patch size).
          compute_dtype: dtype of the matmuls.
          pixel_norm: the data's (mean, std) (`DataConfig.mean`, `.std`), which the first encoder
            stage applies to the uint8 tiles; None = the vision family's default.

        Returns:
          A `DecoderConfig`, `LlavaOnevisionConfig` or `InternVLConfig`.
        """
        from models.decoder_config import DecoderConfig

        vision_impl, llm_impl = self.attention_kernels()
        if self.arch and not self.hf_dir:
            from dflop_jax.programs.model_configs import model_config_for_arch
            from models.stage_modules import with_attention, with_remat

            cfg = model_config_for_arch(self.arch, compute_dtype)
            cfg = with_attention(with_remat(cfg, self.remat), llm_impl, vision_impl)
            return _with_pixel_norm(self._cut(cfg), pixel_norm)
        if self.hf_dir:
            from models.hf import load_config
            from models.stage_modules import with_attention, with_remat

            cfg = load_config(self.hf_dir, dtype=compute_dtype, param_dtype="float32")
            cfg = with_attention(with_remat(cfg, self.remat), llm_impl, vision_impl)
            return _with_pixel_norm(self._cut(cfg), pixel_norm)
        dcfg = DecoderConfig(
            vocab_size=self.vocab_size or -(-tokenizer_vocab // 128) * 128,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=compute_dtype,
            param_dtype="float32",
            remat=self.llm_remat,
            attention_impl=llm_impl,
        )
        vision = {
            "hidden_size": self.vision_hidden_size,
            "intermediate_size": self.vision_intermediate_size,
            "num_layers": self.vision_num_layers,
            "num_heads": self.vision_num_heads,
            "image_size": tile_px,
            "patch_size": patch_size,
            "dtype": compute_dtype,
            "remat": self.vision_remat,
            "attention_impl": vision_impl,
        }
        if self.kind == "decoder":
            return dcfg
        if self.kind == "internvl":
            from models.internvit import InternViTConfig
            from models.internvl import internvl_config

            return _with_pixel_norm(internvl_config(InternViTConfig(**vision), dcfg), pixel_norm)
        from models.llava_onevision import llava_onevision_config
        from models.siglip import SiglipConfig

        return _with_pixel_norm(llava_onevision_config(SiglipConfig(**vision), dcfg), pixel_norm)

    def _cut(self, model_cfg):
        """`model_cfg` with only its first `llm_layers_kept` decoder layers (unchanged at 0)."""
        n = self.llm_layers_kept
        if not n:
            return model_cfg
        text = getattr(model_cfg, "text", model_cfg)
        fix = f"the model has {text.num_layers} decoder layers: keep 1..{text.num_layers} (0 = all)"
        require(n <= text.num_layers, "model.llm_layers_kept", n, fix)
        if text is model_cfg:  # a decoder-only model
            return text.replace(num_layers=n)
        return dataclasses.replace(model_cfg, text=text.replace(num_layers=n))


def _with_pixel_norm(model_cfg, pixel_norm):
    """`model_cfg` whose vision tower normalizes uint8 tiles with the data's (mean, std)."""
    if pixel_norm is None or not hasattr(model_cfg, "vision"):
        return model_cfg
    mean, std = map(tuple, pixel_norm)
    vision = model_cfg.vision.replace(pixel_mean=mean, pixel_std=std)
    return dataclasses.replace(model_cfg, vision=vision)


# Sizes of a ModelConfig that must be >= 1.
_MODEL_SIZES = (
    "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
    "vision_hidden_size", "vision_intermediate_size", "vision_num_layers", "vision_num_heads",
)  # fmt: skip


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
      tiles, lengths: bucket sets (tiles per LLM row, packed by row; tokens per LLM row).
      microbatches: (min, max) microbatches per global batch.
    """

    encoder_layers: tuple[int, ...] = (1, 1)
    encoder_tp: tuple[int, ...] = (1,)
    encoder_dp: int = 1
    llm_layers: tuple[int, ...] = (2, 2)
    llm_tp: tuple[int, ...] = (1,)
    llm_dp: int = 1
    tiles: tuple[int, ...] = (4,)
    lengths: tuple[int, ...] = (1024, 2048)
    microbatches: tuple[int, int] = (2, 6)
    encoder_colocated: bool = False

    def __post_init__(self):
        require(len(self.llm_layers) >= 1, "layout.llm_layers", self.llm_layers, "need >= 1 stage")
        if self.encoder_colocated:
            fix = "the colocated encoder runs on LLM stage 0: give an empty list"
            require(not self.encoder_layers, "layout.encoder_layers", self.encoder_layers, fix)
            require(not self.encoder_tp, "layout.encoder_tp", self.encoder_tp, fix)
        for module in ("encoder", "llm"):
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
        require(
            1 <= self.microbatches[0] <= self.microbatches[1],
            "layout.microbatches",
            self.microbatches,
            "need 1 <= min <= max",
        )

    def layout(self) -> Layout:
        if self.encoder_colocated:
            return Layout((), _stages("llm", self.llm_layers, self.llm_tp, self.llm_dp))
        enc = _stages("encoder", self.encoder_layers, self.encoder_tp, self.encoder_dp)
        return Layout(enc, _stages("llm", self.llm_layers, self.llm_tp, self.llm_dp))

    def buckets(self) -> BucketSet:
        return BucketSet(tuple(self.tiles), tuple(self.lengths))


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
        unless JAX_COMPILATION_CACHE_DIR names one).
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
        require(
            self.model.kind in ("decoder", self.data.model_family),
            "model.kind",
            self.model.kind,
            f"must match data.model_family={self.data.model_family} (or be decoder)",
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
        fix = "plan=auto profiles multimodal models only; use plan=analytic or explicit"
        require(self.plan != "auto" or self.model.kind != "decoder", "plan", self.plan, fix)

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

        check_runnable(load_plan(path).layout, self.plan, self.model.kind != "decoder")

    def ignored_keys(self) -> dict[str, str]:
        """Sections this run does not read, given `plan` and `model.hf_dir` (set keys there are warned).
        `planner` and `profile` are never listed: `python -m dflop_jax.plan` and `... profile` read
        them whatever `plan` is."""
        out = {}
        if self.plan != "explicit":
            out["layout"] = f"read only with plan=explicit (plan={self.plan})"
        elif self.layout.encoder_colocated:
            out["layout.encoder_dp"] = "the colocated encoder's dp is layout.llm_dp"
        if self.model.kind == "decoder":
            why = "model.kind=decoder has no vision encoder"
            out.update({f"model.{n}": why for n in _MODEL_SIZES if n.startswith("vision_")})
        if self.model.hf_dir or self.model.arch:
            why = "the shapes come from model.hf_dir's config.json or model.arch"
            out.update(
                {f"model.{name}": why for name in ("vocab_size", *_MODEL_SIZES, "init_seed")}
            )
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
    side = vision_image_size(hf_dir) if cfg.model.kind != "decoder" else None
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
    """An explicit layout must place every layer of the model and split its heads evenly."""
    if m.kind == "decoder":
        fix = "model.kind=decoder has no encoder: give layout.encoder_layers=[]"
        require(not lay.encoder_layers, "layout.encoder_layers", lay.encoder_layers, fix)
        fix = "model.kind=decoder has no encoder to colocate"
        require(not lay.encoder_colocated, "layout.encoder_colocated", True, fix)
    elif not lay.encoder_colocated:
        fix = (f"model.kind={m.kind} needs >= 1 encoder stage, or layout.encoder_colocated=true "
               "(or model.kind=decoder)")  # fmt: skip
        require(bool(lay.encoder_layers), "layout.encoder_layers", lay.encoder_layers, fix)
    if m.hf_dir or m.arch:  # the shapes are known once config.json (or the arch) is read
        return
    fix = f"must add up to model.num_layers={m.num_layers}"
    require(sum(lay.llm_layers) == m.num_layers, "layout.llm_layers", lay.llm_layers, fix)
    fix = f"each must divide model.num_heads={m.num_heads}"
    require(all(m.num_heads % tp == 0 for tp in lay.llm_tp), "layout.llm_tp", lay.llm_tp, fix)
    if m.kind == "decoder":
        return
    if lay.encoder_colocated:  # the colocated stage runs both models at LLM stage 0's tp
        fix = f"with layout.encoder_colocated it must divide model.vision_num_heads={m.vision_num_heads} too"
        tp0 = lay.llm_tp[0]
        require(m.vision_num_heads % tp0 == 0, "layout.llm_tp", lay.llm_tp, fix)
        return
    fix = f"must add up to model.vision_num_layers={m.vision_num_layers}"
    require(sum(lay.encoder_layers) == m.vision_num_layers, "layout.encoder_layers",
            lay.encoder_layers, fix)  # fmt: skip
    fix = f"each must divide model.vision_num_heads={m.vision_num_heads}"
    require(all(m.vision_num_heads % tp == 0 for tp in lay.encoder_tp), "layout.encoder_tp",
            lay.encoder_tp, fix)  # fmt: skip
