"""The cost-table interface ("cost of stage s at bucket b on tp t") and its analytic provider.

Everything downstream (scheduler, simulator, planner) uses only `CostProvider` and the `layout_*`
helpers here, so a measured provider (profiling issue) can replace the analytic one without changes.

    provider = AnalyticCostProvider(get_arch("siglip-so400m+qwen2.5-7b"), get_device("h100"))
    costs = layout_stage_costs(provider, layout)      # (tile_bucket, length_bucket) -> [P, 2] seconds
    fwd, bwd = provider.stage_time(layout.llm_stages[0], 8192)

Analytic model, per data-parallel shard of one microbatch on a stage with tensor parallelism tp:
  time = FLOPs / (peak * matmul_efficiency * tp)
         + tp communication: Megatron-style 2 all-reduces of the [tokens, D] activations per layer in
           forward and 2 in backward (+2 more for the recomputed forward under remat), ring all-reduce
           2 (tp-1)/tp * bytes / intra-host bandwidth
         + layer_overhead_s per layer (and per embedding/head block) per pass.
  Backward = 2 x forward FLOPs (+1 x forward of the layers under remat).
  LLM attention at a static bucket S costs S*S/2 (query, key) pairs: a flash-style kernel skips the
  blocks above the causal diagonal but cannot skip cross-segment blocks it only learns of at run time
  (an assumption; a measured table replaces it). With `flash_attention=False` (XLA's dense attention,
  what the runtime runs on CPU) the full S*S square is computed and its scores are stored (memory.py);
  the default stays True on every device so plans for long rows remain possible on CPU previews.
  `attention_impl` ("xla", "pallas", "cudnn": what `model.attention_impl` runs) changes memory only
  (memory.py: Pallas's backward partials, cuDNN's dense mask bias). Its time is the same S*S/2 pairs
  here: the XLA and Pallas paths do skip other samples' blocks at run time (cuDNN does not), which a
  static bucket cannot see; a measured table (the profiler runs the configured implementation on
  packed rows) carries the difference.
Transfers: the bytes the busiest device of a boundary sends or receives, at the link's bandwidth
(intra- or inter-host); between stages of one module that is one data shard's output. The encoder's
features cross once, split over the first LLM stage's devices, and that stage all-gathers them in its
mesh (a ring: each device receives the others' blocks) at its own bandwidth (`boundary_shards`); dL/dx
returns the same way (a reduce-scatter, the same bytes). The update after each step's pipeline:
costs/update.py.
With `trainable` (a recipe, costs/recipe.py) frozen stages cost what the runtime runs for them: forward
only (backward 0), dx only (2/3 of the backward), or an encoder head stage's projector alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np

from dflop_jax.contracts.batch_schedule import StageCostFn
from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.contracts.pipeline_order import depths
from dflop_jax.contracts.shapes import BucketSet
from dflop_jax.costs import flops
from dflop_jax.costs.architectures import MLLMArch
from dflop_jax.costs.device_specs import DeviceSpec
from dflop_jax.costs.memory import (
    ATTENTION_IMPLS,
    RESIDUAL_POLICIES,
    StageMemory,
    pick_residuals,
    remat_policy,
    stage_memory,
)
from dflop_jax.costs.recipe import (
    TRAINABLE_PARTS,
    check_trainable,
    colocated_backward,
    recipe_backward,
    stage_role,
)

TransferCostFn = Callable[[int, int], np.ndarray]


class CostProvider(Protocol):
    """Stage costs for one data-parallel shard of one microbatch.

    `bucket` is tiles per encoder shard for encoder stages and tokens of the one packed row per LLM
    shard for LLM stages; bucket 0 costs nothing.
    """

    name: str
    device: DeviceSpec
    arch: MLLMArch
    compute_bytes: int  # bytes per element of the programs' compute dtype (2: bf16, 4: fp32)

    def stage_time(self, stage: StageSpec, bucket: int) -> tuple[float, float]:
        """(forward seconds, backward seconds)."""
        ...

    def stage_memory(self, stage: StageSpec, bucket: int) -> StageMemory:
        """Bytes per device (in_flight = 1)."""
        ...

    def transfer_time(self, stage: StageSpec, bucket: int, cross_host: bool = True) -> float:
        """Seconds to send this stage's output activations (one shard) to the next stage."""
        ...

    def compile_time(self, stage: StageSpec, bucket: int) -> float:
        """Seconds to lower and compile the stage's programs for one shape (`costs/compile.py`)."""
        ...


class AnalyticCostProvider:
    """FLOPs / effective peak + tp all-reduces + per-layer overhead (see the module docstring)."""

    def __init__(
        self,
        arch: MLLMArch,
        device: DeviceSpec,
        *,
        remat: bool | Mapping[str, str] = False,
        compute_bytes: int = 2,
        flash_attention: bool = True,
        trainable: tuple[str, ...] = TRAINABLE_PARTS,
        attention_impl: str = "xla",
    ):
        """`remat`: activation recomputation, True / False for both modules or a per-module policy
        {"vision": ..., "llm": ...} of "none" / "full" / "dots" (what the runtime applies).
        `trainable`: the recipe's trained parts (`optimizer.trainable`; costs/recipe.py)."""
        if compute_bytes not in (2, 4):
            raise ValueError(f"compute_bytes={compute_bytes}: use 2 (bf16) or 4 (fp32)")
        self.arch = arch
        self.device = device
        self.remat = remat
        self.policy = (
            {m: remat_policy(remat) for m in ("vision", "llm")}
            if isinstance(remat, bool)
            else {m: remat_policy(remat[m]) for m in ("vision", "llm")}
        )
        self.compute_bytes = compute_bytes
        self.trainable = check_trainable(trainable)
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl={attention_impl!r}: use one of {ATTENTION_IMPLS}")
        self.attention_impl = attention_impl
        # None: what the runtime uses on this device (fused kernel on GPUs, dense XLA on CPU)
        self.flash_attention = (
            device.flash_attention if flash_attention is None else flash_attention
        )
        self.name = (
            f"analytic:{arch.name}@{device.name}"
            + remat_suffix(self.policy)
            + ("" if self.flash_attention else "+dense-attn")
            + ("" if attention_impl == "xla" else f"+{attention_impl}")
            + trainable_suffix(self.trainable)
        )
        self._memory: dict[tuple[StageSpec, int], StageMemory] = {}  # the planner asks ~10^5 times
        self._times: dict[tuple[StageSpec, int], tuple[float, float]] = {}

    # ------------------------------------------------------------ compute

    def _allreduce_s(self, nbytes: float, tp: int) -> float:
        if tp == 1:
            return 0.0
        return 2.0 * (tp - 1) / tp * nbytes / self.device.intra_host_bandwidth

    def _time(
        self, stage: StageSpec, fwd_flops: float, layer_flops: float, ar_bytes: float, blocks: int
    ) -> tuple[float, float]:
        """Forward/backward seconds from forward FLOPs, the recomputable layers' FLOPs, per-layer
        all-reduce bytes and the number of blocks (layers + embedding/head) paying the fixed overhead."""
        dev, tp, layers = self.device, stage.tp, stage.num_layers
        rate = dev.effective_flops * tp
        ar = self._allreduce_s(ar_bytes, tp)
        fwd = fwd_flops / rate + 2 * layers * ar + blocks * dev.layer_overhead_s
        bwd = 2 * fwd_flops / rate + 2 * layers * ar + 2 * blocks * dev.layer_overhead_s
        if self.policy["llm" if stage.module == "llm" else "vision"] != "none":
            bwd += layer_flops / rate + 2 * layers * ar + layers * dev.layer_overhead_s
        return fwd, bwd

    def _encoder_time(self, stage: StageSpec, tiles: int) -> tuple[float, float]:
        v, p, cb = self.arch.vision, self.arch.projector, self.compute_bytes
        layer = stage.num_layers * flops.vision_layer_flops(v, tiles)
        total = layer
        total += tiles * flops.vision_embedding_flops(v) if stage.has_embedding else 0.0
        total += tiles * flops.projector_flops_per_tile(self.arch) if stage.has_head else 0.0
        ar_bytes = tiles * v.seq_len * v.hidden_size * cb
        blocks = stage.num_layers + int(stage.has_embedding) + int(stage.has_head)
        fwd, bwd = self._time(stage, total, layer, ar_bytes, blocks)
        if stage.has_head:  # tp projector: column- then row-parallel, one all-reduce each way
            out_tokens = tiles * v.tokens_per_tile
            fwd += self._allreduce_s(out_tokens * p.out_dim * cb, stage.tp)
            bwd += self._allreduce_s(out_tokens * p.in_dim * cb, stage.tp)
        return fwd, bwd

    def audio_time(
        self, stage: StageSpec, frames: int, rule=recipe_backward, rows: int = 1
    ) -> tuple[float, float]:
        """(fwd, bwd) seconds of an audio encoder stage (its layers, + the convolutions, + the pool,
        norm and projector) over `rows` packed rows of `frames` mel frames per data shard (the work
        of rows x frames frames: attention stays within windows), priced as a vision stage is
        (FLOPs / effective peak, tp all-reduces per layer, per-block overhead, the encoders' remat;
        the backward by its role under the recipe and `rule`: `colocated_backward` for the encoder
        run inside LLM stage 0's program). Attention stays within 30 s windows
        (`costs.flops.audio_layer_flops`). Memoized, as `stage_time` is."""
        key = ("audio", stage, frames, rule, rows)
        if key not in self._times:
            self._times[key] = self._audio_time(stage, frames * rows, rule)
        return self._times[key]

    def _audio_time(self, stage: StageSpec, frames: int, rule) -> tuple[float, float]:
        if frames <= 0:
            return 0.0, 0.0
        self._check_stage(stage)
        a, cb = self.arch.audio, self.compute_bytes
        layer = stage.num_layers * flops.audio_layer_flops(a, frames)
        total = flops.stage_forward_flops(self.arch, stage, frames)
        blocks = stage.num_layers + int(stage.has_embedding) + int(stage.has_head)
        fwd, bwd = self._time(stage, total, layer, frames / 2 * a.hidden_size * cb, blocks)
        return fwd, rule(stage_role(stage, self.trainable, True), fwd, bwd)

    def _llm_time(self, stage: StageSpec, tokens: int) -> tuple[float, float]:
        m = self.arch.llm
        pairs = tokens * tokens / 2.0 if self.flash_attention else float(tokens * tokens)
        layer = stage.num_layers * flops.llm_layer_flops(m, tokens, pairs)
        total = layer + (flops.llm_head_flops(m, tokens) if stage.has_head else 0.0)
        ar_bytes = tokens * m.hidden_size * self.compute_bytes
        blocks = stage.num_layers + int(stage.has_embedding) + int(stage.has_head)
        fwd, bwd = self._time(stage, total, layer, ar_bytes, blocks)
        # Vocab-parallel embedding: all-reduce of its output forward; vocab-parallel head: all-reduce
        # of its input gradient backward (the cross-entropy's [tokens] reductions are negligible).
        fwd += self._allreduce_s(ar_bytes, stage.tp) if stage.has_embedding else 0.0
        bwd += self._allreduce_s(ar_bytes, stage.tp) if stage.has_head else 0.0
        return fwd, bwd

    def _check_stage(self, stage: StageSpec) -> None:
        if stage.module == "audio" and self.arch.audio is None:
            raise ValueError(f"an audio stage, but {self.arch.name} has no audio encoder")
        total = {"encoder": self.arch.vision.num_layers, "llm": self.arch.llm.num_layers,
                 "audio": getattr(self.arch.audio, "num_layers", 0)}[stage.module]  # fmt: skip
        if stage.first_layer + stage.num_layers > total:
            raise ValueError(
                f"{stage.module} stage layers [{stage.first_layer}, {stage.first_layer + stage.num_layers})"
                f" exceed the {total} layers of {self.arch.name}"
            )

    def stage_time(self, stage: StageSpec, bucket: int) -> tuple[float, float]:
        """Memoized per (stage, bucket): the planner asks ~10^6 times, for few distinct ones."""
        key = (stage, bucket)
        if key not in self._times:
            self._times[key] = self._stage_time(stage, bucket)
        return self._times[key]

    def _stage_time(self, stage: StageSpec, bucket: int) -> tuple[float, float]:
        if bucket < 0:
            raise ValueError(f"bucket={bucket}: must be >= 0")
        self._check_stage(stage)
        if bucket == 0:
            return 0.0, 0.0
        if stage.module == "audio":  # `bucket`: mel frames per data shard
            return self.audio_time(stage, bucket)
        return self._recipe_time(stage, bucket, recipe_backward)

    def colocated_encoder_time(self, encoder: StageSpec, tile_bucket: int) -> tuple[float, float]:
        """(fwd, bwd) seconds the colocated `encoder` adds to LLM stage 0's colocated program: its cost
        as a stage, but a frozen encoder is re-run forward in the colocated stage's backward
        (`recipe.colocated_backward`)."""
        if tile_bucket <= 0:
            return 0.0, 0.0
        self._check_stage(encoder)
        return self._recipe_time(encoder, tile_bucket, colocated_backward)

    def _recipe_time(self, stage: StageSpec, bucket: int, rule) -> tuple[float, float]:
        """(fwd, bwd) of `stage` at `bucket` (> 0), the backward by `rule` (costs/recipe.py) from the
        trainable program's and, for a projector-only head, the projector's."""
        timed = self._encoder_time if stage.module == "encoder" else self._llm_time
        fwd, bwd = timed(stage, bucket)
        role = stage_role(stage, self.trainable, self.arch.vision is not None)
        head = (0.0, 0.0)
        if role.head_only:
            head = self._encoder_time(StageSpec("encoder", 0, 0, stage.tp, has_head=True), bucket)
        return fwd, rule(role, fwd, bwd, *head)

    def with_remat(self, remat: bool | Mapping[str, str]) -> AnalyticCostProvider:
        """This provider with another layer remat (itself if the same)."""
        policy = (
            {m: remat_policy(remat) for m in ("vision", "llm")}
            if isinstance(remat, bool)
            else {m: remat_policy(remat[m]) for m in ("vision", "llm")}
        )
        if policy == self.policy:
            return self
        return AnalyticCostProvider(self.arch, self.device, remat=policy,
                                    compute_bytes=self.compute_bytes,
                                    flash_attention=self.flash_attention, trainable=self.trainable,
                                    attention_impl=self.attention_impl)  # fmt: skip

    def with_trainable(self, trainable: tuple[str, ...]) -> AnalyticCostProvider:
        """This provider under another recipe (itself if the same)."""
        if tuple(trainable) == self.trainable:
            return self
        return AnalyticCostProvider(self.arch, self.device, remat=self.remat,
                                    compute_bytes=self.compute_bytes,
                                    flash_attention=self.flash_attention, trainable=trainable,
                                    attention_impl=self.attention_impl)  # fmt: skip

    def stage_memory(
        self, stage: StageSpec, bucket: int, residuals: str = "recompute"
    ) -> StageMemory:
        """Memoized per (stage, bucket, residual policy): StageMemory is immutable and the model a
        pure function."""
        key = (stage, bucket, residuals)
        if key not in self._memory:
            self._check_stage(stage)
            remat = self.policy["llm" if stage.module == "llm" else "vision"]
            self._memory[key] = stage_memory(
                self.arch,
                stage,
                bucket,
                remat,
                self.compute_bytes,
                self.flash_attention,
                self.trainable,
                dot_bytes=self.device.dot_bytes,
                residuals=residuals,
                attention_impl=self.attention_impl,
            )
        return self._memory[key]

    def output_bytes(self, stage: StageSpec, bucket: int) -> float:
        """Bytes of one shard's output activations (the projector output if the stage holds it)."""
        a, cb = self.arch, self.compute_bytes
        if stage.module == "audio":  # `bucket` frames: conv stride 2, then the head's pool of 2
            if stage.has_head:
                return float(bucket // 4 * a.llm.hidden_size * cb)
            return float(bucket // 2 * a.audio.hidden_size * cb)
        if stage.module == "encoder":
            if stage.has_head:
                return float(bucket * a.vision.tokens_per_tile * a.llm.hidden_size * cb)
            return float(bucket * a.vision.seq_len * a.vision.hidden_size * cb)
        return 0.0 if stage.has_head else float(bucket * a.llm.hidden_size * cb)

    def transfer_time(self, stage: StageSpec, bucket: int, cross_host: bool = True) -> float:
        bw = self.device.inter_host_bandwidth if cross_host else self.device.intra_host_bandwidth
        return self.output_bytes(stage, bucket) / bw

    def compile_time(self, stage: StageSpec, bucket: int) -> float:
        """The device's nominal seconds per block (`DeviceSpec.compile_block_s`) times the stage's
        blocks: compile time follows a program's ops, not its sizes."""
        del bucket
        blocks = stage.num_layers + int(stage.has_embedding) + int(stage.has_head)
        return blocks * self.device.compile_block_s


def trainable_suffix(trainable: tuple[str, ...]) -> str:
    """ "" for the full recipe, else "+train:projector,llm" (plans name the recipe they assume)."""
    return "" if set(trainable) == set(TRAINABLE_PARTS) else "+train:" + ",".join(trainable)


def remat_suffix(policy: Mapping[str, str]) -> str:
    """ "+remat" for full remat of both modules (what `plan_file.Plan.remat` reads back), else the
    policy spelled out ("+remat:vision=dots,llm=full"), "" for none."""
    if all(p == "none" for p in policy.values()):
        return ""
    if all(p == "full" for p in policy.values()):
        return "+remat"
    return "+remat:" + ",".join(f"{m}={p}" for m, p in policy.items())


# ---------------------------------------------------------------- layouts


def colocated_encoder_stage(arch: MLLMArch, layout: Layout) -> StageSpec | None:
    """The whole encoder (+ embedding + projector) on LLM stage 0's devices, at the layout's encoder
    tp with `layout.encoder_dp` replicas (the data-blind baseline: LLM stage 0's tp and dp); None
    for a model without a vision encoder."""
    if not arch.has_vision:
        return None
    return StageSpec("encoder", 0, arch.vision.num_layers, tp=layout.encoder_tp,
                     dp=layout.encoder_dp, has_embedding=True, has_head=True)  # fmt: skip


def colocated_encoder_time(
    provider: CostProvider, encoder: StageSpec, tile_bucket: int
) -> tuple[float, float]:
    """(fwd, bwd) seconds a colocated `encoder` adds to LLM stage 0's program: the provider's own
    rule when it has one (a measured table's colocated-stage entries, `costs/measured.py`), else the
    encoder's cost as a stage of its own."""
    own = getattr(provider, "colocated_encoder_time", None)
    return (
        own(encoder, tile_bucket) if own is not None else provider.stage_time(encoder, tile_bucket)
    )


def colocated_audio_stage(arch: MLLMArch, layout: Layout) -> StageSpec | None:
    """The whole audio encoder (+ convolutions + projector) on LLM stage 0's devices, at its tp with
    one replica per LLM row, as the runtime runs it without audio stages; None for a model without
    audio or a layout with audio stages."""
    if arch.audio is None or layout.audio_stages:
        return None
    first = layout.llm_stages[0]
    return StageSpec("audio", 0, arch.audio.num_layers, tp=first.tp, dp=first.dp,
                     has_embedding=True, has_head=True)  # fmt: skip


def colocated_audio_time(
    provider: CostProvider, audio: StageSpec, frames: int
) -> tuple[float, float]:
    """(fwd, bwd) seconds the audio encoder adds to LLM stage 0's program at `frames` per row: its
    cost as a stage, a frozen encoder re-run forward in that program's backward
    (`recipe.colocated_backward`); a provider without an audio model prices it at 0."""
    timed = getattr(provider, "audio_time", None)
    return timed(audio, frames, colocated_backward) if timed is not None else (0.0, 0.0)


def _stage_buckets(
    layout: Layout, tile_bucket: int, length_bucket: int, audio_bucket: int = 0
) -> list[int]:
    """Each stage's bucket: an encoder stage's tiles per shard (`Layout.encoder_tiles`: with tiles
    packed by row, llm_dp padded row blocks over the encoder's shards), an audio stage's mel frames
    per shard (`Layout.audio_frames`), an LLM stage's length."""
    by = {"encoder": layout.encoder_tiles(tile_bucket), "audio": layout.audio_frames(audio_bucket),
          "llm": length_bucket}  # fmt: skip
    return [by[s.module] for s in layout.stages]


def layout_stage_costs(
    provider: CostProvider, layout: Layout, residuals: Sequence[str] | None = None
) -> StageCostFn:
    """(tile_bucket, length_bucket, audio_bucket=0) -> [num_stages, 2] (fwd, bwd) seconds, stages in
    pipeline order.

    With no encoder stages, the encoder runs colocated on LLM stage 0 (one colocated program) and its
    cost at the tile bucket (`colocated_encoder_time`) is added to that stage: the colocated stage is
    ONE stage, as the runtime runs and times it. So is a model's audio encoder without audio stages
    (`colocated_audio_time`, at the audio bucket: frames per LLM row); audio stages are priced over
    their shard's rows, llm_dp / audio dp rows of the audio bucket each (`audio_time`'s `rows`).
    `residuals`: each stage's residual policy; a stage
    whose backward runs its forward again ("layers", "recompute") costs it (`policy_provider`).
    Results are memoized per bucket triple.
    """
    stages, first = layout.stages, layout.first_llm
    policies = residuals or [None] * len(stages)
    timers = [policy_provider(provider, s.module, r) for s, r in zip(stages, policies)]
    coloc = None if layout.encoder_stages else colocated_encoder_stage(provider.arch, layout)
    audio = colocated_audio_stage(provider.arch, layout)
    encoder = policy_provider(provider, "encoder", policies[first])
    rows = layout.audio_rows
    cache: dict[tuple[int, int, int], np.ndarray] = {}

    def costs(tile_bucket: int, length_bucket: int, audio_bucket: int = 0) -> np.ndarray:
        key = (int(tile_bucket), int(length_bucket), int(audio_bucket))
        if key not in cache:
            buckets = _stage_buckets(layout, *key)
            out = np.array(
                [_timed(t, s, b, key[2], rows) for t, s, b in zip(timers, stages, buckets)],
                dtype=np.float64,
            )
            if coloc is not None:  # on LLM stage 0 (after any audio stages)
                out[first] += colocated_encoder_time(encoder, coloc, layout.encoder_tiles(key[0]))
            if audio is not None:
                out[first] += colocated_audio_time(encoder, audio, key[2])
            out.setflags(write=False)
            cache[key] = out
        return cache[key]

    return costs


def _timed(provider, stage: StageSpec, bucket: int, audio_bucket: int, rows: int):
    """(fwd, bwd) of `stage` at its `bucket`; an audio stage by `audio_time` over its `rows` rows
    of `audio_bucket` frames each (a provider without it: `stage_time` at the shard's frames)."""
    timed = getattr(provider, "audio_time", None)
    if stage.module != "audio" or timed is None:
        return provider.stage_time(stage, bucket)
    return timed(stage, audio_bucket, rows=rows)


def policy_provider(provider: CostProvider, module: str, residuals: str | None) -> CostProvider:
    """The provider whose times are a stage's under residual policy `residuals` (None: the
    provider's own). An analytic provider without layer remat for `module` prices "layers" and
    "recompute" as its layer-remat twin (the backward runs the layers' forward again; "recompute"
    also re-runs the embedding and head, left out). A measured table times the programs of one
    policy (`ProfiledCostTable.residuals`); a stage under a policy whose backward re-runs the
    forward where the table's does not, or the other way round, is priced by `RerunTimes`."""
    if residuals is None:
        return provider
    if isinstance(provider, AnalyticCostProvider):
        if residuals == "all":
            return provider
        part = "llm" if module == "llm" else "vision"  # an audio stage: the encoders' remat
        if provider.policy[part] != "none":
            return provider
        return provider.with_remat({**provider.policy, part: "full"})
    timed = getattr(getattr(provider, "table", None), "residuals", None)
    if timed is None:
        return provider
    rerun = _reruns_forward(residuals) - _reruns_forward(timed)
    return RerunTimes(provider, rerun) if rerun else provider


def _reruns_forward(residuals: str) -> int:
    """1 where a backward under `residuals` runs its stage's forward again ("recompute": the whole
    stage; "layers": each layer's, rebuilt from its saved input), 0 where it starts from the saved
    residuals ("all")."""
    return int(residuals != "all")


@dataclasses.dataclass(frozen=True)
class RerunTimes:
    """A measured provider's times for a stage under a residual policy its table did not time:
    `rerun` +1, a backward that re-runs the forward ("recompute", "layers") where the table timed
    the backward from saved residuals, costs the measured forward more; -1 the other way round.
    First order: under "layers" the embedding and head are not run again, so +1 overstates such
    a stage by their forward. Forwards, memory and everything else are the provider's own."""

    provider: CostProvider
    rerun: int

    def _moved(self, times: tuple[float, float], inside: bool = False) -> tuple[float, float]:
        """`inside`: an encoder run in LLM stage 0's program, whose backward re-runs (or stops
        re-running) the encoder's forward with the stage's, even a frozen encoder's (no backward
        of its own)."""
        fwd, bwd = times
        if bwd <= 0 and not inside:  # a forward-only stage has no backward to re-run it in
            return fwd, bwd
        return fwd, max(bwd + self.rerun * fwd, 0.0)

    def stage_time(self, stage: StageSpec, bucket: int) -> tuple[float, float]:
        return self._moved(self.provider.stage_time(stage, bucket))

    def colocated_encoder_time(self, encoder: StageSpec, tile_bucket: int) -> tuple[float, float]:
        return self._moved(colocated_encoder_time(self.provider, encoder, tile_bucket), True)

    def audio_time(
        self, stage: StageSpec, frames: int, rule=recipe_backward, rows: int = 1
    ) -> tuple[float, float]:
        times = self.provider.audio_time(stage, frames, rule, rows)
        return self._moved(times, inside=rule is colocated_backward)

    def __getattr__(self, name: str):
        if name == "provider":  # not set yet (copy, pickle): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.provider, name)


def stage_crosses_host(layout: Layout, index: int, devices_per_host: int) -> bool:
    """Whether stage `index` and the stage it feeds (`Layout.children`) span more than one host,
    placing stages on consecutive device ids in pipeline order (host = device_id // devices_per_host)."""
    ends = np.cumsum([s.num_devices for s in layout.stages])

    def hosts(i: int) -> set[int]:
        first, last = ends[i] - layout.stages[i].num_devices, ends[i] - 1
        return set(range(first // devices_per_host, last // devices_per_host + 1))

    return len(hosts(index) | hosts(layout.children[index])) > 1


def boundary_shards(layout: Layout, index: int, bucket: int) -> tuple[float, float]:
    """(across, within): the bytes the boundary after stage `index` (to the stage it feeds,
    `Layout.children`) moves in sequence at `bucket` (the sending stage's), in units of one sending
    data shard's output.

    across: what its busiest device sends or receives over the link between the stages. Between
    stages of one module each device of the next stage takes its own shard: 1. The encoder's
    features [encoder_dp * T, ...] (T = `bucket`, tiles per encoder shard) go to the first LLM
    stage once, packed by row (`Layout.tiles_by_row`): row r's block of tiles split over the tp
    devices of LLM row r (`programs/stage_builder.py`), so each LLM device receives
    encoder_dp * T / (dp x tp) tiles, and each encoder shard of T tiles leaves from its tp
    replicas, about T / tp tiles each (the transfer sends every piece from one replica).
    within: the in-mesh all-gather of each row's block over its tp devices inside the LLM stage's
    program, a ring in which each device receives the tp - 1 other pieces of its row's block (0
    where tp = 1); dL/dx's reduce-scatter moves the same. Tiles pooled (`Layout.pooled_tiles`): the
    pool arrives split the same way and is gathered whole, each device receiving the dp x tp - 1
    other pieces.
    """
    a, b = layout.stages[index], layout.stages[layout.children[index]]
    if not (a.module == "encoder" and b.module == "llm") or bucket < 1:
        return 1.0, 0.0
    block = -(-a.dp * bucket // b.num_devices)  # tiles per LLM device
    sent = -(-bucket // a.tp)  # tiles per encoder device
    gathered = b.num_devices if layout.pooled_tiles else b.tp
    return max(block, sent) / bucket, (gathered - 1) * block / bucket


def layout_transfer_costs(provider: CostProvider, layout: Layout) -> TransferCostFn:
    """(tile_bucket, length_bucket, audio_bucket=0) -> [num_stages - 1] seconds to move activations
    from each stage to the one it feeds (`boundary_shards`; an audio stage's shard sends its rows'
    features from one replica): the busiest device's bytes at the link's bandwidth between the
    stages, plus an in-mesh gather at the receiving stage's own (inter-host where it spans hosts)."""
    stages, children = layout.stages, layout.children
    per_host = provider.device.devices_per_host
    cross = [stage_crosses_host(layout, i, per_host) for i in range(len(stages) - 1)]
    spans = [stages[children[i]].num_devices > per_host for i in range(len(stages) - 1)]

    def costs(tile_bucket: int, length_bucket: int, audio_bucket: int = 0) -> np.ndarray:
        buckets = _stage_buckets(layout, tile_bucket, length_bucket, audio_bucket)
        out = []
        for i in range(len(stages) - 1):
            across, within = boundary_shards(layout, i, buckets[i])
            t = across * provider.transfer_time(stages[i], buckets[i], cross[i])
            if within:
                t += within * provider.transfer_time(stages[i], buckets[i], spans[i])
            out.append(t)
        return np.array(out, dtype=np.float64)

    return costs


def one_f_one_b_in_flight(
    num_stages: int, microbatches: int | None = None, children: tuple[int, ...] | None = None
) -> list[int]:
    """Microbatches whose activations are alive at once on each stage under 1F1B: min(P - i, M), or
    with encoder branches (`children`, `contracts.pipeline_order.depths`) min(depth, M)."""
    ahead = depths(children) if children is not None else range(num_stages, 0, -1)
    return [d if microbatches is None else min(d, microbatches) for d in ahead]


def residual_policies(
    provider: CostProvider,
    layout: Layout,
    buckets: BucketSet | tuple[int, int],
    in_flight: Sequence[int],
    budget: float,
) -> list[str]:
    """Each stage's residual policy (`memory.pick_residuals`): the one with the least backward work
    whose peak with the stage's `in_flight` microbatches fits `budget` bytes per device."""
    per_policy = {
        r: layout_memory(provider, layout, buckets, in_flight, [r] * layout.num_stages)
        for r in RESIDUAL_POLICIES
    }
    return [
        pick_residuals({r: per_policy[r][i] for r in RESIDUAL_POLICIES}, n, budget)
        for i, n in enumerate(in_flight)
    ]


def layout_memory(
    provider: CostProvider,
    layout: Layout,
    buckets: BucketSet | tuple[int, int],
    in_flight: int | Sequence[int] | None = None,
    residuals: Sequence[str] | None = None,
) -> list[StageMemory]:
    """Per-stage memory at the largest buckets, each with its 1F1B in-flight count set.

    Args:
      buckets: a `BucketSet` (its largest sizes are used) or (tile_bucket, length_bucket).
      in_flight: None -> P - i; an int M (microbatch count) -> min(P - i, M); a sequence -> per stage.
      residuals: each stage's residual policy (None: "recompute" everywhere; another policy needs
        a provider whose `stage_memory` takes one, the analytic provider).

    Returns:
      one `StageMemory` per stage in pipeline order; `.total()` is the stage's peak bytes per device.
    """
    if isinstance(buckets, BucketSet):
        tile_bucket, length_bucket = buckets.tiles[-1], buckets.lengths[-1]
    else:
        tile_bucket, length_bucket = buckets
    p = layout.num_stages
    if in_flight is None or isinstance(in_flight, (int, np.integer)):
        counts = one_f_one_b_in_flight(p, None if in_flight is None else int(in_flight))
    else:  # any sequence or array of per-stage counts
        counts = [int(c) for c in in_flight]
    if len(counts) != p:
        raise ValueError(f"in_flight has {len(counts)} entries for {p} stages")
    policies = ["recompute"] * p if residuals is None else list(residuals)

    def memory(stage: StageSpec, bucket: int, policy: str) -> StageMemory:
        if policy == "recompute":
            return provider.stage_memory(stage, bucket)
        return provider.stage_memory(stage, bucket, policy)

    # an audio shard's frames: its LLM rows' audio rows at the largest audio bucket
    audio_bucket = buckets.audio[-1] if isinstance(buckets, BucketSet) and buckets.audio else 0
    buckets_of = _stage_buckets(layout, tile_bucket, length_bucket, audio_bucket)
    mems = [memory(s, b, r) for s, b, r in zip(layout.stages, buckets_of, policies)]
    first = layout.first_llm
    encoder = None if layout.encoder_stages else colocated_encoder_stage(provider.arch, layout)
    if encoder is not None:
        mems[first] = mems[first] + memory(encoder, tile_bucket, policies[first])
    audio = colocated_audio_stage(provider.arch, layout)
    if audio is not None and audio_bucket:
        mems[first] = mems[first] + memory(audio, audio_bucket, policies[first])
    if layout.pooled_tiles:
        extra = pooled_features_bytes(provider, layout, tile_bucket)
        mems[first] = dataclasses.replace(mems[first], temp=mems[first].temp + extra)
    return [dataclasses.replace(m, in_flight=c) for m, c in zip(mems, counts)]


def pooled_features_bytes(provider: CostProvider, layout: Layout, tile_bucket: int) -> float:
    """What the first LLM stage of a layout with pooled tiles (`Layout.pooled_tiles`) holds beyond
    a row's features, per device: the whole pool gathered (encoder_dp x `tile_bucket` tiles of
    tokens_per_tile features) and its gradient, each replica's share of which is summed over
    "data". An upper bound: the row's own features, which the stage model counts, are not taken
    off."""
    arch = provider.arch
    cb = getattr(provider, "compute_bytes", 2)
    pool = layout.encoder_dp * tile_bucket * arch.vision.tokens_per_tile
    return 2.0 * pool * arch.llm.hidden_size * cb
