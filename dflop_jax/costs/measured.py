"""A `CostProvider` backed by a measured cost table (`python -m dflop_jax.profile model`). No jax.

    table = load_table("runs/profile/cost_table.json")
    provider = MeasuredCostProvider(table, arch, get_device("cpu"), fallback=AnalyticCostProvider(arch, dev))
    fwd, bwd = provider.stage_time(StageSpec("llm", 0, 3, tp=2, has_head=True), 300)
    provider.sources()   # {"llm_layers": {"fitted": 1}, "llm_head": {"fitted": 1}}

A stage is the sum of its parts: `<module>_layers` at n layers (base + n x per-layer), plus
`<module>_embedding` and `<module>_head` if the stage holds them. Each part runs as its own program
when profiled, so the sum pays the fixed per-program cost once per part; when layers and other parts
are combined we subtract the layers' fitted base (clamped to [0, smallest part]) once per extra part,
as the stage is one program.

Times, `fit="least_squares"` (default): one smooth model per (kind, tp) fitted to ALL its entries,
    t(b)    = c0 + c1 b + c2 b^2                               (embedding, head, projector parts)
    t(n, b) = (c0 + c1 b + c2 b^2) + n (p0 + p1 b + p2 b^2)   (layer parts, 1- and 2-layer entries)
with non-negative coefficients (every term is work or fixed overhead; b^2 is attention over a packed
row), minimising the squared RELATIVE error (scheduling cares about ratios). One timing inflated by a
contended minute then moves the curve a little everywhere instead of poisoning its neighbouring buckets
and, through the 2-layer minus 1-layer difference, every layer count (`bench costmodel` compares
both rules on one profile).
Needs 3 or more profiled buckets; with fewer, or `fit="interpolate"`: piecewise-linear between
profiled buckets, linear beyond them, per_layer = c2 - c1 and base = c1 - per_layer per bucket.
Buckets outside the profiled range are flagged "extrapolated" in `sources()`.

Frozen stages (a recipe's `trainable`, costs/recipe.py), two ways by the table's own recipe
(`ProfiledCostTable.trainable`):
- a table profiled with everything trained (and every table written before recipes) times the
  trainable programs only, so under a frozen recipe a forward-only stage's time is the MEASURED
  forward, a dx-only stage's backward is DERIVED (2/3 of the measured backward; 1/2 from saved
  residuals), a projector-only encoder head stage's backward is DERIVED (the measured head backward,
  plus under "recompute" the measured stage forward minus head forward); temp stays the trainable
  program's (an upper bound) (`costs/recipe.py`, under the table's `residuals`);
- a table profiled UNDER the recipe (the profiler times each part's programs as the recipe runs
  them) is MEASURED throughout: a stage's backward is the sum of its parts' measured backwards, a
  frozen part with nothing trained before it (no backward program of its own) counting its forward
  when the stage has a backward program that re-runs its whole forward (a "recompute" table), 0 when
  the stage runs forward only or its backward starts from saved residuals; temp comes from the program
  the part runs.
A table profiled under one frozen recipe cannot cost another: `with_trainable` raises ValueError.
grads and optimizer count the trained parts' measured parameter bytes either way.

Memory (per device, in_flight = 1), from `memory_analysis()` of the backward programs, which hold the
most: params = parameter bytes, grads = the fp32 accumulator (same size), optimizer = AdamW m + v
(2 x params), activations_per_microbatch = what the runtime keeps per in-flight microbatch: the stage
input (x + side arrays) under "recompute", the parts' residuals (`residual_bytes`) under a saving
policy, temp = the rest of the backward program's peak (XLA temporaries, the incoming and outgoing
activation gradients; plus one stage input under a saving policy, the microbatch a forward reads),
summed over parts (an upper bound: parts run inside one program may reuse buffers).

The colocated encoder (a layout with no encoder stages runs it inside LLM stage 0's program):
`colocated_encoder_time` is the colocated program's share beyond the LLM embedding, measured = the
colocated_embedding entry (the runtime's colocated program with no LLM layer, at the tile bucket and a
row of `entry.length` tokens) minus the llm_embedding part at that row, piecewise-linear in the tile
bucket; LLM stage 0 then costs its LLM parts plus that share. Without colocated_embedding entries at
the stage's tp it is the encoder's parts summed as a separate stage (noted per source as usual).

The audio encoder (a model with one) is the sum of its measured parts (audio_embedding, audio_layers,
audio_head; one packed row of `bucket` mel frames each) wherever it runs: on audio stages over each
shard's rows, and on LLM stage 0 (a layout without audio stages) as those parts, a frozen encoder
re-run in that program's backward (`audio_time`). No colocated audio program is profiled: that stage
is priced as its LLM parts plus the audio parts, the program's fixed cost counted once per part.

Missing entries (a tp or kind never profiled, a skipped entry) fall back to `fallback` with a warning
logged once per (kind, tp); without a fallback they raise KeyError. Transfers are not profiled: they
come from the analytic model's output bytes / bandwidth.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from dflop_jax.contracts.cost_table import COLOCATED_KINDS, ProfiledCostTable, load_table
from dflop_jax.contracts.layout import StageSpec
from dflop_jax.costs.architectures import MLLMArch
from dflop_jax.costs.device_specs import DeviceSpec
from dflop_jax.costs.memory import StageMemory
from dflop_jax.costs.provider import AnalyticCostProvider, CostProvider, trainable_suffix
from dflop_jax.costs.recipe import (
    check_trainable,
    colocated_backward,
    recipe_backward,
    stage_role,
)

log = logging.getLogger(__name__)
_FALLBACK = "fallback=AnalyticCostProvider(...)"  # what a table without an entry needs


def interpolate(xs: np.ndarray, ys: np.ndarray, x: float) -> tuple[float, str]:
    """Piecewise-linear y(x) through (xs, ys) (xs sorted, distinct), linear beyond the ends.

    Returns (value clamped at 0, "measured" | "interpolated" | "extrapolated").
    """
    if len(xs) == 0:
        raise ValueError("no points to interpolate")
    i = int(np.searchsorted(xs, x))
    if i < len(xs) and xs[i] == x:
        return float(ys[i]), "measured"
    if len(xs) == 1:  # one point: proportional to the bucket (cost ~ work)
        return float(ys[0]) * x / float(xs[0]), "extrapolated"
    how = "interpolated" if 0 < i < len(xs) else "extrapolated"
    j = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
    return max(0.0, float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))), how


FITS = ("least_squares", "interpolate")
MIN_FIT_BUCKETS = 3  # a quadratic through fewer points is not determined


def _monomials(x: np.ndarray) -> np.ndarray:
    """[n] -> [n, 3]: 1, x, x^2."""
    return np.stack([np.ones_like(x), x, x * x], axis=1)


@dataclasses.dataclass(frozen=True)
class TimeFit:
    """Non-negative least-squares time model of one (kind, tp): see the module docstring.

    coef: [2, k] per direction (fwd, bwd); k = 3 (no layers) or 6 (base terms, then per-layer terms).
    scale: buckets are divided by it (the largest profiled bucket) to keep the problem well conditioned.
    lo, hi: the profiled bucket range.
    """

    coef: np.ndarray
    scale: float
    lo: float
    hi: float

    @classmethod
    def fit(cls, points: list[tuple[int, float, float, float]], per_layer: bool) -> TimeFit:
        """points: (layers, bucket, fwd_s, bwd_s) entries (layers used only when per_layer)."""
        n, b, fwd, bwd = (np.array(col, dtype=np.float64) for col in zip(*points))
        scale = float(b.max())
        m = _monomials(b / scale)
        design = np.concatenate([m, n[:, None] * m], axis=1) if per_layer else m
        coef = []
        for t in (fwd, bwd):
            w = 1.0 / np.maximum(t, 1e-12)  # relative error: each row divided by its own time
            coef.append(nnls(design * w[:, None], t * w)[0])
        return cls(np.array(coef), scale, float(b.min()), scale)

    def __call__(self, bucket: float, layers: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(total [fwd, bwd] at `layers` layers, base [fwd, bwd] at 0 layers) at `bucket`."""
        m = _monomials(np.array([bucket / self.scale]))[0]
        base = self.coef[:, :3] @ m
        if self.coef.shape[1] == 3:
            return base, np.zeros(2)
        return base + layers * (self.coef[:, 3:] @ m), base

    def how(self, bucket: float) -> str:
        return "fitted" if self.lo <= bucket <= self.hi else "extrapolated"


@dataclasses.dataclass(frozen=True)
class _Part:
    """Per-device costs of one part of a stage at one bucket: times, parameter/input/temp bytes."""

    fwd: float
    bwd: float
    base_fwd: float  # fitted per-program fixed cost (layers kinds), else 0
    base_bwd: float
    params: float
    inputs: float
    temp: float
    residuals: float = 0.0  # what its saving forward hands the backward per microbatch (else 0)


class MeasuredCostProvider:
    """CostProvider over a cost table (see the module docstring).

    Args:
      table: a `ProfiledCostTable` or the path of a cost-table file.
      arch: the architecture the table was profiled for (used by the fallback and for transfers).
      device: the device preset (memory capacity, hosts) of the measured devices.
      fallback: provider for entries the table lacks (None: missing entries raise KeyError).
      fit: "least_squares" (a smooth fit of all entries per kind and tp) or "interpolate"
        (piecewise-linear between buckets); see the module docstring.
      trainable: the recipe to cost (None: the table's own); see the module docstring.
    """

    def __init__(
        self,
        table: ProfiledCostTable | str | Path,
        arch: MLLMArch,
        device: DeviceSpec,
        fallback: CostProvider | None = None,
        fit: str = "least_squares",
        trainable: tuple[str, ...] | None = None,
    ):
        if fit not in FITS:
            raise ValueError(f"fit={fit!r}: choose one of {FITS}")
        self.fit = fit
        self._fits: dict[tuple[str, int], TimeFit | None] = {}
        self.table = table if isinstance(table, ProfiledCostTable) else load_table(table)
        self.arch, self.device, self.fallback = arch, device, fallback
        self.trainable = self.table.trainable
        self.name = f"measured:{self.table.model or arch.name}@{self.table.device_kind}"
        self.name += trainable_suffix(self.trainable)
        if trainable is not None:
            self._set_recipe(trainable)
        self._transfer = AnalyticCostProvider(arch, device)
        # the profiled programs' compute dtype: the bytes of the weight copies an update makes
        self.compute_bytes = 4 if self.table.settings.get("compute_dtype") == "float32" else 2
        self._curves: dict[tuple[str, int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._sources: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._warned: set[tuple[str, int]] = set()

    # ------------------------------------------------------------ table access

    def _curve(self, kind: str, tp: int, layers: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(buckets [n], values [n, 7]: fwd, bwd, params, inputs, temp, residuals, forward temp) of
        the ok entries."""
        key = (kind, tp, layers)
        if key not in self._curves:
            buckets = self.table.buckets(kind, tp, layers)
            rows = []
            for b in buckets:
                e = self.table.get(kind, tp, b, layers)
                params = e.param_bytes + e.copy_bytes  # held: the masters and their copies
                taken = e.program_param_bytes  # a program's share of them
                # the program the part runs: its backward, or its forward when it has none
                peak = (e.memory_bwd or e.memory_fwd).get("peak", 0.0)
                temp = max(0.0, peak - taken - e.accumulator_bytes - e.input_bytes)
                forward_temp = 0.0
                if e.residual_bytes:  # a saving pair: each program's transient beyond the state,
                    # the input and the residuals, both kept unclamped (linear in the layers); the
                    # larger one counts (`_measured_part`), as `compile_check` assembles a stage
                    kept = e.residual_bytes
                    temp = peak - taken - e.accumulator_bytes - kept
                    forward_temp = e.memory_fwd.get("peak", 0.0) - taken - e.input_bytes - kept
                rows.append([e.fwd_s, e.bwd_s, params, e.input_bytes, temp, e.residual_bytes,
                             forward_temp])  # fmt: skip
            self._curves[key] = (
                (np.array(buckets, dtype=np.float64), np.array(rows, dtype=np.float64))
                if buckets
                else None
            )
        return self._curves[key]

    def _time_fit(self, kind: str, tp: int) -> TimeFit | None:
        """The least-squares time model of (kind, tp), or None (interpolate: too few buckets)."""
        key = (kind, tp)
        if key not in self._fits:
            counts = (1, 2) if kind.endswith("_layers") else (0,)
            points = []
            for n in counts:
                for b in self.table.buckets(kind, tp, n):
                    e = self.table.get(kind, tp, b, n)
                    points.append((n, b, e.fwd_s, e.bwd_s))
            enough = all(len(self.table.buckets(kind, tp, n)) >= MIN_FIT_BUCKETS for n in counts)
            self._fits[key] = (
                TimeFit.fit(points, per_layer=counts != (0,))
                if self.fit == "least_squares" and enough
                else None
            )
        return self._fits[key]

    def _measured_part(self, kind: str, tp: int, bucket: int, layers: int) -> _Part | None:
        is_layers = kind.endswith("_layers")
        curves = [self._curve(kind, tp, n) for n in ((1, 2) if is_layers else (0,))]
        if any(c is None for c in curves):
            return None
        values, hows = zip(*(self._interp(c, bucket) for c in curves))
        if is_layers:  # cost(n) = base + n * per_layer, per bucket from the 1- and 2-layer entries
            v1, v2 = values
            value, base = v1 + (layers - 1) * (v2 - v1), 2 * v1 - v2
            how = hows[0] if hows[0] == hows[1] else "extrapolated"
        else:
            value, base, how = values[0], np.zeros(7), hows[0]
        times, base_times = np.maximum(value[:2], 0.0), np.maximum(base[:2], 0.0)
        fit = self._time_fit(kind, tp)
        if fit is not None:  # memory columns stay interpolated: they are exact, not noisy
            times, base_times = (np.maximum(v, 0.0) for v in fit(bucket, layers))
            how = fit.how(bucket)
        self._note(kind, how)
        inputs = values[0][3]
        return _Part(times[0], times[1], base_times[0], base_times[1], max(value[2], 0.0), inputs,
                     max(value[4], value[6], 0.0), max(value[5], 0.0))  # fmt: skip

    @staticmethod
    def _interp(curve, bucket: int) -> tuple[np.ndarray, str]:
        xs, ys = curve
        out, hows = [], set()
        for col in range(ys.shape[1]):
            value, how = interpolate(xs, ys[:, col], float(bucket))
            out.append(value)
            hows.add(how)
        how = "extrapolated" if "extrapolated" in hows else hows.pop()
        return np.array(out), how

    def _note(self, kind: str, how: str) -> None:
        self._sources[kind][how] += 1

    def _fallback_part(self, module: str, part: str, stage: StageSpec, bucket: int) -> _Part:
        kind = f"{module}_{part}"
        missing = f"cost table has no {kind} entries for tp={stage.tp}"
        fallback = self._use_fallback(kind, stage.tp, missing,
                                      f"profile tp={stage.tp} or pass {_FALLBACK}")  # fmt: skip
        spec = _part_spec(module, part, stage)
        fwd, bwd = fallback.stage_time(spec, bucket)
        mem = fallback.stage_memory(spec, bucket)
        return _Part(fwd, bwd, 0.0, 0.0, mem.params, mem.activations_per_microbatch, mem.temp)

    def _use_fallback(self, kind: str, tp: int, missing: str, fix: str):
        """The fallback (under the table's recipe, `_part_fallback`) for `kind` at `tp`, which the
        table lacks (`missing` says what): a KeyError without one; warned once per (kind, tp) and
        noted as a fallback source."""
        if self.fallback is None:
            raise KeyError(f"{missing} and there is no fallback; {fix}")
        if (kind, tp) not in self._warned:
            self._warned.add((kind, tp))
            log.warning("%s: using %s for them", missing, self.fallback.name)
        self._note(kind, "fallback")
        return self._part_fallback()

    def _part_fallback(self):
        """The fallback for a part: under a table profiled under the recipe, which holds each
        part's recipe programs, the fallback under that recipe too (made once per recipe)."""
        if not self._measured_recipe or not hasattr(self.fallback, "with_trainable"):
            return self.fallback
        if getattr(self, "_recipe_fallback", None) is None:
            self._recipe_fallback = self.fallback.with_trainable(self.trainable)
        return self._recipe_fallback

    def _parts(self, stage: StageSpec, bucket: int) -> list[_Part]:
        wanted = []  # the stage's input enters through its first part
        if stage.has_embedding:
            wanted.append("embedding")
        if stage.num_layers > 0:
            wanted.append("layers")
        if stage.has_head:
            wanted.append("head")
        parts = []
        for part in wanted:
            kind = f"{stage.module}_{part}"
            layers = stage.num_layers if part == "layers" else 0
            got = self._measured_part(kind, stage.tp, bucket, layers)
            parts.append(
                got if got is not None else self._fallback_part(stage.module, part, stage, bucket)
            )
        return parts

    # ------------------------------------------------------------ CostProvider

    def stage_time(self, stage: StageSpec, bucket: int) -> tuple[float, float]:
        if bucket < 0:
            raise ValueError(f"bucket={bucket}: must be >= 0")
        if bucket == 0:
            return 0.0, 0.0
        fwd, bwd = self._priced(stage, self._parts(stage, bucket))
        return float(fwd), float(bwd)  # plain floats: plans are written as YAML

    def _priced(self, stage: StageSpec, parts: list[_Part], rule=recipe_backward):
        """(fwd, bwd) of `stage` run as one program of `parts` under the recipe: each part's
        recipe program as timed (a table profiled under it, module docstring), else derived from
        the trainable programs' timings by `rule` (`recipe_backward`; `colocated_backward` for
        parts run inside a program that has a backward, costs/recipe.py)."""
        role = stage_role(stage, self.trainable, self._multimodal)
        if self._measured_recipe:
            inside = rule is colocated_backward  # the enclosing program re-runs a frozen forward
            return self._summed(parts, self._recipe_bwds(stage, parts, inside or role.has_backward))
        fwd, bwd = self._summed(parts, [p.bwd for p in parts])
        return fwd, rule(role, fwd, bwd, parts[-1].fwd, parts[-1].bwd, self.table.residuals)

    @staticmethod
    def _summed(parts: list[_Part], bwds: list[float]) -> tuple[float, float]:
        """(fwd, bwd) of parts run as one program: their sum, one fixed per-program cost."""
        fwd, bwd = sum(p.fwd for p in parts), sum(bwds)
        base = [p for p in parts if p.base_fwd > 0 or p.base_bwd > 0]
        if base and len(parts) > 1:  # one program, one fixed cost: drop the extra parts' share
            extra = len(parts) - 1
            fwd -= extra * min(base[0].base_fwd, min(p.fwd for p in parts))
            bwd -= extra * min(base[0].base_bwd, min(bwds))
        return fwd, bwd

    def _recipe_bwds(self, stage: StageSpec, parts: list[_Part], has_backward: bool) -> list[float]:
        """Per part of `stage` under a table profiled under the recipe: its measured backward, or,
        for a part with no backward program of its own, its forward when the stage has a backward
        program that re-runs the stage forward ("recompute"), else 0 (forward only, or a backward
        from saved residuals, which holds none of that part's)."""
        out = []
        for p, (module, part) in zip(parts, _held_parts(stage)):
            own = stage_role(_part_spec(module, part, stage), self.trainable, self._multimodal)
            rerun = has_backward and self.table.residuals == "recompute"
            out.append(p.bwd if own.kind != "forward" else (p.fwd if rerun else 0.0))
        return out

    def colocated_encoder_time(self, encoder: StageSpec, tile_bucket: int) -> tuple[float, float]:
        """(fwd, bwd) seconds the colocated `encoder` (the whole encoder on LLM stage 0's devices)
        adds to that stage's program at `tile_bucket` tiles per shard (module docstring)."""
        if tile_bucket <= 0:
            return 0.0, 0.0
        kind = COLOCATED_KINDS[0]
        entries = [self.table.get(kind, encoder.tp, b, 0)
                   for b in self.table.buckets(kind, encoder.tp, 0)]  # fmt: skip
        if not entries:  # the encoder's parts as a stage of its own, re-run in the stage's backward
            return self._colocated_recipe(
                encoder, tile_bucket, *self._trainable_time(encoder, tile_bucket)
            )
        shares = []
        for e in entries:
            emb = StageSpec("llm", 0, 0, tp=encoder.tp, has_embedding=True)
            f, b = self.stage_time(emb, e.length)
            shares.append((e.fwd_s - f, e.bwd_s - b))
        xs, ys = np.array([e.bucket for e in entries], dtype=np.float64), np.array(shares)
        (fwd, how), (bwd, _) = (interpolate(xs, ys[:, i], float(tile_bucket)) for i in (0, 1))
        self._note(kind, how)
        return self._colocated_recipe(encoder, tile_bucket, fwd, bwd)

    def audio_time(
        self, stage: StageSpec, frames: int, rule=recipe_backward, rows: int = 1
    ) -> tuple[float, float]:
        """(fwd, bwd) seconds of the audio encoder `stage` over `rows` packed audio rows of `frames`
        mel frames per shard, under `rule` (`recipe_backward`; `colocated_backward` for the encoder
        inside LLM stage 0's program, whose backward re-runs a frozen encoder's forward under
        "recompute"). Its parts are the audio kinds measured at one row of `frames` (module
        docstring); `rows` rows run as one program: `rows` x the row's time less the extra rows'
        fixed per-program cost. A table without the audio kinds at the stage's tp prices the whole
        encoder by the fallback (noted as "audio_encoder: fallback", warned once)."""
        if frames <= 0 or rows <= 0:
            return 0.0, 0.0
        parts = [
            self._measured_part(f"audio_{part}", stage.tp, frames,
                                stage.num_layers if part == "layers" else 0)
            for _, part in _held_parts(stage)
        ]  # fmt: skip
        if any(p is None for p in parts):
            fallback = self._use_fallback("audio_encoder", stage.tp,
                                          f"the cost table has no audio encoder entries for "
                                          f"tp={stage.tp}",
                                          f"profile the audio kinds or pass {_FALLBACK}")  # fmt: skip
            return fallback.audio_time(stage, frames, rule, rows)
        fwd, bwd = self._priced(stage, parts, rule)
        return _rows_time(parts, float(fwd), float(bwd), rows)

    def _trainable_time(self, stage: StageSpec, bucket: int) -> tuple[float, float]:
        """(fwd, bwd) of `stage` as this table times it with the recipe's backward rule undone:
        the trainable programs' for an all-trained table; under a recipe table, the recipe's."""
        parts = self._parts(stage, bucket)
        if self._measured_recipe:
            return self._summed(parts, self._recipe_bwds(stage, parts, True))
        return self._summed(parts, [p.bwd for p in parts])

    def _colocated_recipe(self, encoder: StageSpec, tiles: int, fwd: float, bwd: float):
        """(fwd, bwd) of a colocated encoder from its time in the colocated program, frozen parts by
        `recipe.colocated_backward` (an all-trained table's timings; a recipe table's, whose colocated
        program was profiled under the recipe, are already the recipe's: returned as they are)."""
        if self._measured_recipe:
            return float(fwd), float(bwd)
        role = stage_role(encoder, self.trainable, self._multimodal)
        head = self._parts(StageSpec("encoder", 0, 0, tp=encoder.tp, has_head=True), tiles)[0]
        bwd = colocated_backward(role, fwd, bwd, head.fwd, head.bwd, self.table.residuals)
        return float(fwd), float(bwd)

    def stage_memory(self, stage: StageSpec, bucket: int) -> StageMemory:
        if bucket <= 0:
            bucket = 1  # state still lives on the device; activations of the smallest shape
        parts = self._parts(stage, bucket)
        params = float(sum(p.params for p in parts))
        role = stage_role(stage, self.trainable, self._multimodal)
        trained = float(
            sum(p.params for p, name in zip(parts, _recipe_parts(stage)) if name in role.trains)
        )
        forward = role.kind == "forward"
        # Under a saving policy an in-flight microbatch holds its parts' residuals, not the stage
        # input; one input (the microbatch a forward reads) stays transient.
        kept = float(sum(p.residuals for p in parts))
        held = 0.0 if forward else (kept or float(parts[0].inputs))
        transient = float(parts[0].inputs) if forward or kept else 0.0
        return StageMemory(
            params=params,
            grads=trained,
            optimizer=2.0 * trained,
            activations_per_microbatch=held,
            # a recipe table's: each part's own program; else the trainable program's (an upper
            # bound for a frozen stage's)
            temp=float(sum(p.temp for p in parts)) + transient,
        )

    def transfer_time(self, stage: StageSpec, bucket: int, cross_host: bool = True) -> float:
        return self._transfer.transfer_time(stage, bucket, cross_host)

    def compile_time(self, stage: StageSpec, bucket: int) -> float:
        """Seconds to lower and compile the stage's programs for one shape: its parts' measured
        `compile_s` at the bucket (piecewise-linear between profiled buckets; layers: the 1-layer
        entry plus the 2-layer entry's extra per further layer), summed; the fallback's figure
        where the table has none (a table written before compile times were recorded)."""
        total = 0.0
        for module, part in _held_parts(stage):
            layers = stage.num_layers if part == "layers" else 0
            value = self._compile_part(f"{module}_{part}", stage.tp, bucket, layers)
            if value is None:
                fallback = self.fallback or self._transfer
                return fallback.compile_time(stage, bucket)
            total += value
        return total

    def _compile_part(self, kind: str, tp: int, bucket: int, layers: int) -> float | None:
        counts = (1, 2) if kind.endswith("_layers") else (0,)
        values = []
        for n in counts:
            points = [(b, self.table.get(kind, tp, b, n).compile_s)
                      for b in self.table.buckets(kind, tp, n)]  # fmt: skip
            points = [(b, c) for b, c in points if c > 0]
            if not points:
                return None
            xs, ys = (np.array(col, dtype=np.float64) for col in zip(*points))
            values.append(interpolate(xs, ys, float(bucket))[0])
        if len(values) == 1:
            return values[0]
        return values[0] + (layers - 1) * max(values[1] - values[0], 0.0)

    @property
    def _multimodal(self) -> bool:
        return self.arch.vision is not None

    @property
    def _measured_recipe(self) -> bool:
        """Whether the table was profiled under this (frozen) recipe: costs measured, not derived."""
        return not self.table.all_trained

    def _set_recipe(self, trainable) -> None:
        chosen = check_trainable(trainable)
        if not self.table.all_trained and set(chosen) != set(self.table.trainable):
            raise ValueError(
                f"the cost table was profiled under trainable={list(self.table.trainable)} and "
                f"cannot cost trainable={list(chosen)}: profile under that recipe (or with "
                "everything trained, from which frozen costs are derived)"
            )
        self.trainable = chosen
        self._recipe_fallback = None
        self.name = self.name.split("+train:", 1)[0] + trainable_suffix(chosen)

    def with_trainable(self, trainable: tuple[str, ...]) -> MeasuredCostProvider:
        """This provider (sharing its table and fits) under another recipe.

        Raises:
          ValueError: the table was profiled under another frozen recipe (module docstring).
        """
        if tuple(trainable) == self.trainable:
            return self
        other = copy.copy(self)
        other._set_recipe(trainable)
        return other

    def sources(self) -> dict[str, dict[str, int]]:
        """Per entry kind, how many lookups were measured / interpolated / extrapolated / fallback."""
        return {k: dict(v) for k, v in sorted(self._sources.items())}


def _rows_time(parts: list[_Part], fwd: float, bwd: float, rows: int) -> tuple[float, float]:
    """(fwd, bwd) of `rows` rows of one row's (fwd, bwd) in one program: the fixed per-program cost
    (the layers part's fitted base, at most the row's time) paid once."""
    base = next((p for p in parts if p.base_fwd > 0 or p.base_bwd > 0), None)
    fixed = (0.0, 0.0) if base is None else (min(base.base_fwd, fwd), min(base.base_bwd, bwd))
    return (rows * fwd - (rows - 1) * fixed[0], rows * bwd - (rows - 1) * fixed[1])


def _held_parts(stage: StageSpec) -> list[tuple[str, str]]:
    """(module, part) of each part of `MeasuredCostProvider._parts`, in order."""
    held = (("embedding", stage.has_embedding), ("layers", stage.num_layers > 0),
            ("head", stage.has_head))  # fmt: skip
    return [(stage.module, part) for part, h in held if h]


def _part_spec(module: str, part: str, stage: StageSpec) -> StageSpec:
    """One part of `stage` as a stage of its own (what the profiler compiled for it)."""
    return StageSpec(module, 0, stage.num_layers if part == "layers" else 0, tp=stage.tp,
                     has_embedding=part == "embedding", has_head=part == "head")  # fmt: skip


def _recipe_parts(stage: StageSpec) -> list[str]:
    """Per part of `MeasuredCostProvider._parts` (embedding, layers, head as held), its recipe part."""
    if stage.module == "llm":
        return ["llm"] * len(_held_parts(stage))
    return ["projector" if part == "head" else "vision" for _, part in _held_parts(stage)]
