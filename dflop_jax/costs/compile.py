"""What a plan costs before its first step: the programs a run compiles, and the seconds that takes.

    counts = program_counts(layout, buckets, multimodal=True)          # runtime/precompile.py's
    cost = compile_cost(provider, layout, buckets, multimodal=True)    # CompileCost(programs, s)

The runtime compiles every program once per shape it receives, before step 1
(`runtime/precompile.py`), so a plan's program count follows from its layout and bucket pairs
(`BucketSet.allowed`):
  - an encoder stage sees a tile bucket: one signature per tile bucket of the pairs;
  - the first LLM stage of an MLLM (taking the encoder's features, or running the encoder colocated)
    sees both: one per allowed (tile, length) pair, which is why a sparse pair set pays;
  - any other LLM stage sees a length bucket: one per length bucket of the pairs;
  - with audio buckets (a model whose first LLM stage runs the audio encoder), that stage sees
    each pair with and without audio: one per (pair, audio bucket or none); with the audio encoder
    on stages of its own, every microbatch has audio (`ScheduleProblem.audio_always`): an audio
    stage sees the audio bucket alone, the first LLM stage (taking its features) each (pair,
    audio bucket); no other stage sees the audio bucket.
Per signature an inner stage with a backward compiles two programs (its forward and its backward, or
the residual-saving pair), a forward-only stage one, the last stage one (forward, loss and backward
fused); the last stage also compiles a loss-token count per length bucket. Every stage boundary moves
one shape per signature of its sending stage, forward and (where the next stage passes a gradient
back) backward, two programs each (`programs/transfer.py`: the transport and its zero blocks), none
where both stages lie on one host and their blocks line up (`copied`: the transfer is a
device-to-device copy). The per-step programs: each stage's optimizer (4 where it trains: fresh
accumulator, reduction, norm, update; 1 otherwise), the update's glue (each trained stage's norm to
the last stage and the statistics back to every stage, 2 programs per transfer, none between stages
of as many devices on one host; the loss sum and the statistics, 2) and the learning rate (1). Not
counted: evaluation's forward programs, tied parameters' glue, a padded optimizer's checkpoint
program and multi-process reads (`runtime/precompile.py` lists them all).

Seconds: each signature's programs cost the provider's `compile_time(stage, bucket)` (a measured
table's lowering + compile seconds of the stage's parts, or the analytic per-block estimate), the
colocated stage adds its encoder's; the small programs cost `DeviceSpec.small_compile_s` each. Each
process compiles the stages on its own devices (hosts in parallel), so the run waits for the host
with the most: the figure is the largest host's serial sum. The runtime compiles in a thread pool,
so on a many-core host the wall time is lower; the planner uses the figure to rank ladders, not to
promise a time.
"""

from __future__ import annotations

import dataclasses

from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.contracts.shapes import BucketSet
from dflop_jax.costs.recipe import TRAINABLE_PARTS, stage_role

OPTIMIZER_PROGRAMS = 4  # fresh accumulator, reduction, norm, update (`StageOptimizer.lower`)
TRANSFER_PROGRAMS = 2  # the transport and its zero blocks (`transfer.Transfer.lower`)


@dataclasses.dataclass(frozen=True)
class ProgramCounts:
    """The programs a run of a plan compiles before step 1 (module docstring).

    Attributes:
      stage: per stage, its stage programs (signatures x programs per signature).
      transfers: stage-to-stage transfer programs.
      count: the last stage's loss-token count programs.
      step: the per-step programs (optimizers, the update's glue, the learning rate).
    """

    stage: tuple[int, ...]
    transfers: int
    count: int
    step: int

    @property
    def bucket_programs(self) -> int:
        """The programs that grow with the bucket pairs (stages, transfers, counts)."""
        return sum(self.stage) + self.transfers + self.count

    @property
    def total(self) -> int:
        return self.bucket_programs + self.step


@dataclasses.dataclass(frozen=True)
class CompileCost:
    """A plan's programs and the seconds to compile them (module docstring).

    Attributes:
      programs: `ProgramCounts.total`.
      seconds: the host with the most to compile, its serial seconds.
      per_stage_s: each stage's seconds (its signatures' programs; transfers and step programs apart).
    """

    programs: int
    seconds: float
    per_stage_s: tuple[float, ...]


def stage_buckets(layout: Layout, buckets: BucketSet, multimodal: bool) -> list[list[tuple]]:
    """Per stage, the bucket signatures it receives (module docstring): (tile bucket,) for an
    encoder stage, (tile, length) for an MLLM's first LLM stage ((tile, length, audio) with audio
    buckets, audio 0 for a microbatch without audio), (length,) for the others."""
    pairs = buckets.allowed()
    tiles = sorted({(t,) for t, _ in pairs})
    lengths = sorted({(s,) for _, s in pairs})
    first = list(pairs)
    if buckets.audio:
        audio = buckets.audio if layout.audio_stages else (0, *buckets.audio)
        first = [p + (a,) for p in pairs for a in audio]
    out = []
    for stage in layout.stages:
        if stage.module == "encoder":
            out.append(tiles)
        elif stage.module == "audio":
            out.append([(a,) for a in buckets.audio])
        elif (multimodal or buckets.audio) and stage.has_embedding:
            out.append(first)
        else:
            out.append(lengths)
    return out


def signature_length(sig: tuple) -> int:
    """The length bucket of an LLM stage's signature ((length,), (tile, length[, audio]))."""
    return sig[1] if len(sig) > 1 else sig[0]


def _roles(layout: Layout, multimodal: bool, trainable: tuple[str, ...], audio: bool):
    colocated, first = multimodal and not layout.encoder_stages, layout.first_llm
    apart = bool(layout.audio_stages)
    return [
        stage_role(
            s,
            trainable,
            multimodal or audio,
            colocated=colocated and i == first,
            audio=audio and i == first and not apart,
            audio_x=apart and i == first,
        )
        for i, s in enumerate(layout.stages)
    ]


def program_counts(
    layout: Layout,
    buckets: BucketSet,
    multimodal: bool = True,
    trainable: tuple[str, ...] = TRAINABLE_PARTS,
    devices_per_host: int | None = None,
) -> ProgramCounts:
    """The programs a run of `layout` with `buckets` compiles before step 1 (module docstring);
    `devices_per_host`: None for a run on one host."""
    sigs = stage_buckets(layout, buckets, multimodal)
    roles = _roles(layout, multimodal, trainable, bool(buckets.audio))
    last = layout.num_stages - 1
    stage = []
    for i, (n, role) in enumerate(zip(sigs, roles)):
        per_signature = 1 if i == last or not role.has_backward else 2
        stage.append(len(n) * per_signature)
    hosts = _stage_host_spans(layout, devices_per_host)
    transfers, children, stages = 0, layout.children, layout.stages
    for i in range(last):
        c = children[i]
        features = stages[i].module == "encoder" and stages[c].module == "llm"
        if hosts[i] == hosts[c] is not None and copied(stages[i], stages[c], features):
            continue
        llm = stages[i].module == "llm"
        shapes = len({signature_length(sig) if llm else sig[0] for sig in sigs[i]})
        back = roles[c].input_grad
        transfers += shapes * TRANSFER_PROGRAMS * (2 if back else 1)
    count = len({signature_length(sig) for sig in sigs[last]})
    trains = [role.kind == "train" for role in roles]
    step = sum(OPTIMIZER_PROGRAMS if t else 1 for t in trains)
    for i in range(last):  # its norm in (where it trains), the statistics out
        copy = (
            hosts[i] == hosts[last] is not None
            and stages[i].num_devices == stages[last].num_devices
        )
        step += 0 if copy else TRANSFER_PROGRAMS * (1 + trains[i])
    step += 2 + 1  # the loss sum and `_combine`; the learning rate
    return ProgramCounts(tuple(stage), transfers, count, step)


def copied(a: StageSpec, b: StageSpec, features: bool) -> bool:
    """Whether stage `a`'s output reaches stage `b` (and dL/dx comes back) by device-to-device
    copies, no program (`programs/transfer.py`'s `copies`, for two stages on one host): the
    encoder's features (`features`: split over "data" at the encoder, over all of the LLM stage's
    devices there) from tp 1 and dp n into a stage of n devices; any other output (split over
    "data" on both sides) at the receiving stage's own dp and tp."""
    if features:
        return a.tp == 1 and a.dp == b.dp * b.tp
    return (a.dp, a.tp) == (b.dp, b.tp)


def _stage_host_spans(layout: Layout, devices_per_host: int | None) -> list[int | None]:
    """Each stage's host, None for a stage that spans hosts; all 0 without `devices_per_host`
    (one host)."""
    if devices_per_host is None:
        return [0] * layout.num_stages
    hosts = _stage_hosts(layout, devices_per_host)
    ends = _stage_hosts(layout, devices_per_host, last_device=True)
    return [h if h == e else None for h, e in zip(hosts, ends)]


def compile_cost(
    provider,
    layout: Layout,
    buckets: BucketSet,
    multimodal: bool = True,
    trainable: tuple[str, ...] = TRAINABLE_PARTS,
) -> CompileCost:
    """The programs of `program_counts` and the seconds to compile them on the busiest host
    (module docstring)."""
    from dflop_jax.costs.provider import colocated_encoder_stage

    counts = program_counts(
        layout, buckets, multimodal, trainable, provider.device.devices_per_host
    )
    sigs = stage_buckets(layout, buckets, multimodal)
    colocated = multimodal and not layout.encoder_stages
    encoder = colocated_encoder_stage(provider.arch, layout) if colocated else None
    audio = getattr(provider.arch, "audio", None)
    # the audio encoder's blocks (its layers, the convolutions, the head), at the nominal figure
    audio_s = (audio.num_layers + 2) * provider.device.compile_block_s if audio else 0.0
    per_stage = []
    for i, stage in enumerate(layout.stages):
        seconds = 0.0
        for sig in sigs[i]:
            if stage.module == "audio":  # nominal: the blocks, whatever the frames
                seconds += _compile_time(provider, stage, sig[0])
                continue
            bucket = (
                layout.encoder_tiles(sig[0]) if stage.module == "encoder" else signature_length(sig)
            )
            seconds += _compile_time(provider, stage, bucket)
            if encoder is not None and i == layout.first_llm:
                seconds += _compile_time(provider, encoder, layout.encoder_tiles(sig[0]))
            if len(sig) == 3 and sig[2] and not layout.audio_stages:
                seconds += audio_s
        per_stage.append(seconds)
    small = counts.transfers + counts.count + counts.step
    hosts = _stage_hosts(layout, provider.device.devices_per_host)
    busiest = {}
    for h, s in zip(hosts, per_stage):
        busiest[h] = busiest.get(h, 0.0) + s
    share = small * provider.device.small_compile_s / max(len(busiest), 1)
    seconds = max(busiest.values()) + share
    return CompileCost(counts.total, seconds, tuple(per_stage))


def _compile_time(provider, stage: StageSpec, bucket: int) -> float:
    """The provider's `compile_time`, or for a provider without one the device's nominal per-block
    figure."""
    own = getattr(provider, "compile_time", None)
    if own is not None:
        return own(stage, bucket)
    return block_count(stage) * provider.device.compile_block_s


def _stage_hosts(layout: Layout, devices_per_host: int, last_device: bool = False) -> list[int]:
    """The host of each stage's first device (its last with `last_device`), stages on consecutive
    devices in pipeline order."""
    out, start = [], 0
    for s in layout.stages:
        out.append((start + (s.num_devices - 1 if last_device else 0)) // devices_per_host)
        start += s.num_devices
    return out


def block_count(stage: StageSpec) -> int:
    """The blocks a stage's programs hold: its layers, and its embedding and head."""
    return stage.num_layers + int(stage.has_embedding) + int(stage.has_head)
