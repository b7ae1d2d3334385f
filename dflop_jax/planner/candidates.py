"""Enumerating candidate layouts: device split, per-module tp/pp/dp, microbatch count, bucket ladder size.

DFLOP search: LLM (tp, pp, dp) times either a separate encoder (tp, pp, dp) on its own devices or the
encoder colocated on the first LLM stage (at that stage's tp or at its own, a divisor of it, with
tp / encoder tp replicas per LLM replica: `Layout.colocated_encoder_tp`), and for a model with an
audio encoder, times its placement: on the first LLM stage (each row's audio on the row's shard) or
on audio stages of its own (tp, pp, and a dp dividing the LLM's), using between
`num_devices - max_idle_devices` and `num_devices` devices. Uniform (data-blind) search: the encoder colocated, one tp for the whole model
(it must divide the LLM's heads; the encoder's heads are padded up to a multiple of it, Megatron's way,
when `pad_heads`, else they must divide too), dp = devices / (tp x pp). Either search crosses its
layouts with `PlannerConfig.remat` (remat on/off per candidate) when that is given.

Rules: tp divides the module's attention heads (and KV heads) and is at most a host's devices (the
encoder's degrees come from `PlannerConfig.encoder_tp` when given, else from `tp`); pp is at
most the module's layers and layers are split into balanced contiguous ranges (sizes differ by <= 1);
M x llm_dp <= global batch (every bin can hold a sample).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.planner.config import PlannerConfig


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One point of the search space (buckets are derived from it and the data; planner/buckets.py)."""

    layout: (
        Layout  # with chunks > 1: the virtual layout (chunks x pp LLM stages, in pipeline order)
    )
    microbatches: int
    num_buckets: int
    remat: bool | None = None  # None: the cost provider's own setting
    chunks: int = (
        1  # model chunks per LLM stage (interleaved 1F1B's virtual stages; colocated only)
    )

    @property
    def key(self) -> tuple:
        """A stable, total order of candidates (the last tie-break; remat off before on)."""
        return (
            tuple((s.module, s.first_layer, s.num_layers, s.tp, s.dp) for s in self.layout.stages),
            self.layout.colocated_encoder_tp or 0,
            self.layout.pooled_tiles,
            self.chunks,
            self.microbatches,
            self.num_buckets,
            -1 if self.remat is None else int(self.remat),
        )

    @property
    def physical_layout(self) -> Layout:
        """The layout on devices: `layout` itself, or with chunks each device group's stages merged."""
        return physical_layout(self.layout, self.chunks)

    def describe(self) -> str:
        remat = "" if self.remat is None else (" remat" if self.remat else " no-remat")
        lay = describe_layout(self.layout, self.chunks)
        return f"{lay} | M={self.microbatches} buckets={self.num_buckets}{remat}"


def physical_layout(virtual: Layout, chunks: int) -> Layout:
    """Device group d of a colocated virtual layout (chunks x P LLM stages) holds virtual stages
    c x P + d; its StageSpec starts at chunk 0's first layer and counts all its chunks' layers (so
    `first_layer` / `num_layers` no longer name one contiguous range)."""
    if chunks == 1:
        return virtual
    if virtual.encoder_stages or len(virtual.llm_stages) % chunks:
        raise ValueError(
            f"virtual stages: {len(virtual.llm_stages)} LLM stages with {len(virtual.encoder_stages)} "
            f"encoder stages do not make {chunks} chunks per colocated LLM stage"
        )
    llm, p = virtual.llm_stages, len(virtual.llm_stages) // chunks
    return dataclasses.replace(virtual, llm_stages=tuple(
        dataclasses.replace(llm[d], num_layers=sum(llm[c * p + d].num_layers for c in range(chunks)),
                            has_embedding=d == 0, has_head=d == p - 1)
        for d in range(p)
    ))  # fmt: skip


def describe_layout(layout: Layout, chunks: int = 1) -> str:
    """e.g. "enc tp1 pp1 dp8 | llm tp4 pp2[14+14] dp7", "enc@llm0 | llm tp2 pp1 dp8", a colocated
    encoder at its own tp "enc@llm0 tp1 dp32 | llm tp4 pp1 dp8", with virtual stages
    "enc@llm0 | llm tp8 pp2x2[9+16+16+16] dp4" (pp x chunks, layers per virtual stage), with audio
    stages "enc tp1 pp1 dp8 | aud tp1 pp1 dp4 | llm tp4 pp2[14+14] dp8" (an audio encoder without
    stages runs on LLM stage 0, unnamed), tiles pooled "enc tp1 pp1 dp8 pooled | ..."."""

    def part(name: str, stages: tuple[StageSpec, ...], v: int = 1) -> str:
        split = f"[{'+'.join(str(s.num_layers) for s in stages)}]" if len(stages) > 1 else ""
        pp = f"{len(stages) // v}x{v}" if v > 1 else f"{len(stages)}"
        return f"{name} tp{stages[0].tp} pp{pp}{split} dp{stages[0].dp}"

    enc = part("enc", layout.encoder_stages) if layout.encoder_stages else "enc@llm0"
    if layout.colocated_encoder_tp is not None:
        enc += f" tp{layout.colocated_encoder_tp} dp{layout.encoder_dp}"
    enc += " pooled" if layout.pooled_tiles else ""
    aud = f"{part('aud', layout.audio_stages)} | " if layout.audio_stages else ""
    return f"{enc} | {aud}{part('llm', layout.llm_stages, chunks)}"


def split_layers(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """Balanced contiguous ranges [(first, count)]: the first `num_layers % pp` stages get one more."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pp={pp}: must be in [1, {num_layers}] for {num_layers} layers")
    base, extra = divmod(num_layers, pp)
    out, first = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append((first, n))
        first += n
    return out


def module_stages(module: str, num_layers: int, tp: int, pp: int, dp: int) -> tuple[StageSpec, ...]:
    """The pp stages of one module: embedding on the first, head (projector / LM head) on the last."""
    ranges = split_layers(num_layers, pp)
    return tuple(
        StageSpec(module, first, n, tp=tp, dp=dp, has_embedding=(s == 0), has_head=(s == pp - 1))
        for s, (first, n) in enumerate(ranges)
    )


def valid_tp(candidates: tuple[int, ...], heads: tuple[int, ...], per_host: int) -> list[int]:
    """The candidate tp degrees dividing every size in `heads` (head counts, an MLP width) and
    fitting in a host."""
    return sorted(t for t in candidates if t <= per_host and all(h % t == 0 for h in heads))


def _module_shapes(
    tps: list[int], pps: tuple[int, ...], layers: int, budget: int
) -> Iterator[tuple[int, int, int]]:
    """(tp, pp, dp) with tp * pp * dp <= budget."""
    for tp in tps:
        for pp in sorted(p for p in pps if p <= layers):
            for dp in range(1, budget // (tp * pp) + 1):
                yield tp, pp, dp


def enumerate_candidates(
    arch, num_devices: int, devices_per_host: int, config: PlannerConfig
) -> list[Candidate]:
    """The DFLOP search space (see the module docstring), in a stable order.

    Args:
      arch: an MLLMArch (uses vision/llm num_layers, num_heads, llm num_kv_heads).
      num_devices: devices available.
      devices_per_host: tp limit.
      config: the planner config.
    """
    v, lm = arch.vision, arch.llm
    llm_tps = valid_tp(config.tp, (lm.num_heads, lm.num_kv_heads), devices_per_host)
    # the encoder's MLP too: an encoder_tp such as 3 divides SigLIP-6B's 48 heads, not its 8608 MLP
    enc_tps = valid_tp(
        config.encoder_tp or config.tp, (v.num_heads, v.intermediate_size), devices_per_host
    )
    low = num_devices - config.max_idle_devices
    layouts: list[Layout] = []
    for tp, pp, dp in _module_shapes(llm_tps, config.llm_pp, lm.num_layers, num_devices):
        llm = module_stages("llm", lm.num_layers, tp, pp, dp)
        for audio in _audio_placements(arch, config, (tp, dp), num_devices - tp * pp * dp,
                                       devices_per_host):  # fmt: skip
            used = tp * pp * dp + sum(s.num_devices for s in audio)
            if config.colocate and used >= low:  # the encoder at any tp dividing the stage's
                own = (t for t in enc_tps if tp % t == 0) if config.colocate_own_tp else (tp,)
                for etp in (t for t in own if t in enc_tps):
                    layouts.append(Layout((), llm, None if etp == tp else etp, audio))
            separate = (
                _module_shapes(enc_tps, config.encoder_pp, v.num_layers, num_devices - used)
                if config.encoder_stages
                else []
            )
            for etp, epp, edp in separate:
                if used + etp * epp * edp >= low:
                    enc = module_stages("encoder", v.num_layers, etp, epp, edp)
                    for pooled in _tile_packings(config, audio):
                        layouts.append(Layout(enc, llm, audio_stages=audio, pooled_tiles=pooled))
    return _with_microbatches(layouts, config)


def _tile_packings(config: PlannerConfig, audio: tuple[StageSpec, ...]) -> tuple[bool, ...]:
    """`Layout.pooled_tiles` values to try for an encoder on stages of its own: by row, and pooled
    where `PlannerConfig.pooled_tiles` allows it and no audio stage joins the first LLM stage."""
    return (False, True) if config.pooled_tiles and not audio else (False,)


def _audio_placements(
    arch, config: PlannerConfig, llm: tuple[int, int], room: int, devices_per_host: int
) -> list[tuple[StageSpec, ...]]:
    """The audio encoder's placements beside an LLM of (tp, dp) `llm` with `room` devices left: ()
    (on the first LLM stage, at its tp: where that tp divides the audio encoder's heads and MLP;
    the only one for a model without audio), then audio stages of their own at each (tp, pp, dp)
    fitting, dp dividing the LLM's."""
    a = arch.audio
    if a is None:
        return [()]
    split = (a.num_heads, a.intermediate_size)
    on_llm = [()] if valid_tp((llm[0],), split, devices_per_host) else []
    if not config.audio_stages:
        return on_llm
    tps = valid_tp(config.audio_tp or config.tp, split, devices_per_host)
    own = [module_stages("audio", a.num_layers, tp, pp, dp)
           for tp, pp, dp in _module_shapes(tps, config.audio_pp, a.num_layers, room)
           if llm[1] % dp == 0]  # fmt: skip
    return on_llm + own


def uniform_heads(arch, pad_heads: bool) -> tuple[int, ...]:
    """The head counts the uniform tp must divide (the encoder's only when they cannot be padded)."""
    lm = arch.llm
    return (lm.num_heads, lm.num_kv_heads) + (() if pad_heads else (arch.vision.num_heads,))


def enumerate_uniform(
    arch, num_devices: int, devices_per_host: int, config: PlannerConfig, pad_heads: bool = False
) -> list[Candidate]:
    """The data-blind search space: encoder colocated, one tp for both modules (encoder heads padded to
    it with `pad_heads`), all devices in use, one bucket size per module (its fixed maximum length)."""
    lm = arch.llm
    tps = valid_tp(config.tp, uniform_heads(arch, pad_heads), devices_per_host)
    layouts = []
    for tp, pp, dp in _module_shapes(tps, config.llm_pp, lm.num_layers, num_devices):
        if tp * pp * dp < num_devices - config.max_idle_devices:
            continue
        for v in sorted(set(config.virtual_stages) | {1}):
            if v == 1 or (pp > 1 and pp * v <= lm.num_layers and config.schedule == "1f1b"):
                layouts.append((Layout((), module_stages("llm", lm.num_layers, tp, pp * v, dp)), v))
    return _with_microbatches(layouts, config, num_buckets=(1,))


def _with_microbatches(
    layouts: list[Layout] | list[tuple[Layout, int]], config: PlannerConfig, num_buckets=None
) -> list[Candidate]:
    """Each layout (or (virtual layout, chunks)) crossed with the microbatch counts (interleaving
    needs a multiple of the stage count), bucket ladder sizes and remat settings."""
    num_buckets = config.num_buckets if num_buckets is None else num_buckets
    pairs = [x if isinstance(x, tuple) else (x, 1) for x in layouts]
    out = [
        Candidate(layout, m, nb, remat, v)
        for layout, v in pairs
        for m in sorted(config.microbatches)
        if m * layout.llm_dp <= config.global_batch
        and (v == 1 or m % (len(layout.llm_stages) // v) == 0)
        for nb in sorted(num_buckets)
        for remat in (config.remat or (None,))
    ]
    return sorted(out, key=lambda c: c.key)
