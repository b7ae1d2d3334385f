"""The cost-table file: what the model profiler measured, one entry per (kind, tp, bucket, layers).

The profiler writes it, `dflop_jax.costs.measured.MeasuredCostProvider` reads it: a contract between the
two, so pure Python that imports nothing from dflop_jax.
JSON, indented, one entry per line-group, e.g.:

    {"version": 2, "device_kind": "cpu", "platform": "cpu", "device_count": 8,
     "jax_version": "0.10.2", "flax_version": "0.12.8", "config_hash": "3f2a...", "code_version": "9c1e...",
     "model": "tiny", "settings": {"warmup": 2, "runs": 5, "compute_dtype": "float32"},
     "entries": [{"kind": "llm_layers", "tp": 1, "bucket": 256, "layers": 1, "status": "ok",
                  "fwd_s": 0.0012, "bwd_s": 0.0031, "flops_fwd": 1.2e7, "flops_bwd": 3.9e7,
                  "bytes_fwd": ..., "bytes_bwd": ...,
                  "memory_fwd": {"argument": .., "output": .., "temp": .., "alias": .., "peak": ..},
                  "memory_bwd": {...}}, ...]}

Stage kinds (a planner `StageSpec` is the sum of its parts, see `costs/measured.py`):
  encoder_layers (layers 1 and 2), encoder_embedding (patch + position embedding),
  encoder_head (post-norm + projector), llm_layers (1 and 2), llm_embedding (token embedding + image
  feature placement), llm_head (final norm + LM head + loss).
The colocated stage (`models.mllm.ColocatedStage`: the whole encoder and the first LLM layers in ONE
program on LLM stage 0's mesh) adds colocated_embedding (COLOCATED_KINDS): that program with no LLM
layer (ViT + projector + token embedding + each row placing its own tiles' features), at `bucket`
tiles per shard and a row of `length` tokens; the provider takes the colocated stage's encoder share
from it (`costs/measured.py`).
A model with an audio encoder (omni) adds the audio encoder's parts (AUDIO_KINDS): audio_embedding
(the two convolutions + positions), audio_layers (1 and 2), audio_head (pool + norm + projector), each
the runtime's audio stage program (`programs.stage_builder`'s audio stage) over one packed audio row.
Buckets: tiles per encoder shard for encoder kinds (and the colocated kind), tokens of the packed row
for LLM kinds, mel frames of the one packed audio row per shard for audio kinds.
A table is profiled under a training recipe (`trainable`, the parts trained; absent in files written
before recipes existed, which profiled everything trained): each part's programs are the runtime's for
that part under the recipe (`programs.stage_jits.stage_jits` with `trained` / `input_grad`): a frozen
part behind a trained one times its dx-only backward, a frozen part with nothing trained before it has
no backward program (bwd_s 0, memory_bwd empty), a trained part after frozen ones computes no dx.
`grad_bytes` is the per-device gradient accumulator of the trained leaves (absent: `param_bytes`).
A table is profiled under one residual policy (`residuals`, RESIDUAL_POLICIES; absent in files written
before it was recorded, which timed "recompute"): an inner part's programs are the ones a stage under
that policy trains with, under "all" / "layers" the forward that returns its residuals and the
backward from them (`residual_bytes`: what the forward hands over per microbatch), under
"recompute" the forward and the backward that re-runs it. The LLM head part always times the last
stage's fused program (forward, loss and backward in one, no forward run twice).
Memory fields are per device, from `compiled.memory_analysis()`; `peak` is XLA's peak when it reports
one, else argument + output + temp - alias. Entries that could not run have status "skipped" and a
`reason` (e.g. over device memory, tp does not divide the heads).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

TABLE_VERSION = 3
ENCODER_KINDS = ("encoder_layers", "encoder_embedding", "encoder_head")
LLM_KINDS = ("llm_layers", "llm_embedding", "llm_head")
STAGE_KINDS = ENCODER_KINDS + LLM_KINDS
COLOCATED_KINDS = ("colocated_embedding",)
AUDIO_KINDS = ("audio_layers", "audio_embedding", "audio_head")
ALL_KINDS = STAGE_KINDS + COLOCATED_KINDS + AUDIO_KINDS
LAYER_KINDS = ("encoder_layers", "llm_layers", "audio_layers")
MEMORY_FIELDS = ("argument", "output", "temp", "alias", "peak")
TRAINABLE_PARTS = ("vision", "projector", "llm")  # what a training recipe trains or freezes
# What an inner stage keeps per in-flight microbatch for its backward (`programs.stage_jits` builds them):
#   "all"        every residual of the stage forward (its `jax.vjp`): the backward runs no forward;
#   "layers"     the same programs over a stage built with layer remat (`jax.checkpoint` per layer,
#                the models' `remat="full"`): the residuals are the layer inputs, and the backward
#                rebuilds one layer's forward at a time;
#   "recompute"  the stage input only: the backward re-runs the whole stage forward under `jax.vjp`.
RESIDUAL_POLICIES = ("all", "layers", "recompute")


@dataclasses.dataclass(frozen=True)
class CostEntry:
    """One profiled program pair (forward program, backward program) at one shape.

    Attributes:
      kind: one of ALL_KINDS.
      tp: tensor-parallel degree (devices of the ("data", "model") = (1, tp) mesh).
      bucket: tiles (encoder kinds), tokens (LLM kinds) or mel frames (audio kinds) of one shard.
      layers: transformer layers in the program (1 or 2 for *_layers kinds, else 0).
      status: "ok" or "skipped".
      reason: why skipped ("" if ok).
      fwd_s, bwd_s: median seconds of the forward program and of the backward program, as a stage
        under the table's residual policy trains (module docstring).
      flops_fwd, flops_bwd, bytes_fwd, bytes_bwd: `compiled.cost_analysis()` "flops" and
        "bytes accessed" (per device for sharded programs).
      memory_fwd, memory_bwd: `compiled.memory_analysis()` bytes per device (MEMORY_FIELDS).
      param_bytes: parameter bytes per device (fp32 masters, sharded by tp).
      copy_bytes: bytes per device of the parameters' compute-dtype copies, which the stage holds
        beside the masters and its programs take in their place (0: the programs take the masters,
        at fp32 compute).
      taken_param_bytes: bytes per device of the parameters as the programs take them: the copies,
        and the masters of the leaves without one (a frozen table only a gather reads); None: the
        masters (`param_bytes`).
      input_bytes: bytes per device of the program's stage input (x and the side arrays).
      length: tokens of the packed row of a colocated kind's program (0 for the other kinds).
      grad_bytes: bytes per device of the program's gradient accumulator (its trained leaves, per
        data replica); None: `param_bytes` (every leaf trained: tables written before recipes).
      residual_bytes: bytes per device the forward hands its backward per microbatch under a saving
        residual policy (its outputs but y); 0 under "recompute" and for programs that save none.
      compile_s: seconds to lower and compile the entry's programs (forward and backward, one after
        the other) on the profiling host: what a stage of this part costs before its first step
        (`costs/compile.py`); 0 in tables written before it was recorded.
    """

    kind: str
    tp: int
    bucket: int
    layers: int
    status: str = "ok"
    reason: str = ""
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    flops_fwd: float = 0.0
    flops_bwd: float = 0.0
    bytes_fwd: float = 0.0
    bytes_bwd: float = 0.0
    memory_fwd: dict[str, float] = dataclasses.field(default_factory=dict)
    memory_bwd: dict[str, float] = dataclasses.field(default_factory=dict)
    param_bytes: float = 0.0
    copy_bytes: float = 0.0
    taken_param_bytes: float | None = None
    input_bytes: float = 0.0
    length: int = 0
    grad_bytes: float | None = None
    residual_bytes: float = 0.0
    compile_s: float = 0.0

    @property
    def program_param_bytes(self) -> float:
        """Bytes per device of the parameters as the programs take them (`taken_param_bytes`):
        the part of a program's peak that is held parameters."""
        return self.param_bytes if self.taken_param_bytes is None else self.taken_param_bytes

    @property
    def accumulator_bytes(self) -> float:
        """Bytes per device of the gradient accumulator (`grad_bytes`, else `param_bytes`)."""
        return self.param_bytes if self.grad_bytes is None else self.grad_bytes

    def __post_init__(self):
        if self.kind not in ALL_KINDS:
            raise ValueError(f"cost entry kind={self.kind!r}: use one of {ALL_KINDS}")
        if self.status not in ("ok", "skipped"):
            raise ValueError(f"cost entry status={self.status!r}: use 'ok' or 'skipped'")

    @property
    def key(self) -> tuple[str, int, int, int]:
        return (self.kind, self.tp, self.bucket, self.layers)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclasses.dataclass
class ProfiledCostTable:
    """A whole profile (the cost-table file in memory): metadata plus entries keyed by (kind, tp, bucket, layers)."""

    device_kind: str
    platform: str
    device_count: int
    config_hash: str
    code_version: str
    model: str = ""
    jax_version: str = ""
    flax_version: str = ""
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    trainable: tuple[str, ...] = TRAINABLE_PARTS  # the recipe profiled (module docstring)
    residuals: str = "recompute"  # the residual policy profiled (module docstring)
    entries: dict[tuple[str, int, int, int], CostEntry] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.trainable = tuple(self.trainable)
        if not self.trainable or not set(self.trainable) <= set(TRAINABLE_PARTS):
            raise ValueError(
                f"cost table trainable={list(self.trainable)}: a subset of {TRAINABLE_PARTS}"
            )
        if self.residuals not in RESIDUAL_POLICIES:
            raise ValueError(
                f"cost table residuals={self.residuals!r}: use one of {list(RESIDUAL_POLICIES)}"
            )

    @property
    def all_trained(self) -> bool:
        """Whether the table was profiled with every part trained (the default recipe)."""
        return set(self.trainable) == set(TRAINABLE_PARTS)

    def add(self, entry: CostEntry) -> None:
        self.entries[entry.key] = entry

    def get(self, kind: str, tp: int, bucket: int, layers: int) -> CostEntry | None:
        return self.entries.get((kind, tp, bucket, layers))

    def buckets(self, kind: str, tp: int, layers: int) -> list[int]:
        """Sorted buckets with an "ok" entry for (kind, tp, layers)."""
        return sorted(
            b
            for (k, t, b, n), e in self.entries.items()
            if (k, t, n) == (kind, tp, layers) and e.ok
        )

    def tps(self, kind: str) -> list[int]:
        return sorted({t for (k, t, _, _), e in self.entries.items() if k == kind and e.ok})

    def skipped(self) -> list[CostEntry]:
        return [e for e in self.entries.values() if not e.ok]


def save_table(table: ProfiledCostTable, path: str | Path) -> Path:
    """Writes `table` as JSON (atomically: a crash mid-write keeps the previous file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in dataclasses.asdict(table).items() if k != "entries"}
    meta["trainable"] = list(table.trainable)
    entries = [dataclasses.asdict(e) for _, e in sorted(table.entries.items())]
    doc = {"version": TABLE_VERSION, **meta, "entries": entries}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return path


def load_table(path: str | Path) -> ProfiledCostTable:
    """Reads a cost-table file.

    Raises:
      FileNotFoundError: no such file. ValueError: not a cost table of this version.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"cost table not found: {path} (run `python -m dflop_jax.profile model`)"
        )
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a JSON cost table ({e})") from None
    if not isinstance(doc, dict) or doc.get("version") != TABLE_VERSION:
        raise ValueError(f"{path}: cost table version must be {TABLE_VERSION}; re-run the profiler")
    fields = {f.name for f in dataclasses.fields(ProfiledCostTable)} - {"entries"}
    table = ProfiledCostTable(**{k: doc[k] for k in fields if k in doc})
    for raw in doc["entries"]:
        table.add(CostEntry(**raw))
    return table
