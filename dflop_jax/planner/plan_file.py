"""The planner's answer (`Plan`) and its `plan.yaml` form, written for people and read back by the runtime.

    plan = make_plan(...); save_plan(plan, "plan.yaml"); plan = load_plan("plan.yaml")

plan.yaml lists each stage (module, layer range, tp, dp, devices, predicted memory vs capacity), the
buckets (and the sparse set of (tile, length) pairs where the planner narrowed it), the microbatch
count, the predicted step time (mean, p90 over the sampled batches), what compiling it costs and why
its ladder won (where the planner priced compiling), the cost provider, and the top alternatives
with the reason each lost.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from dflop_jax.contracts import BucketSet
from dflop_jax.contracts.layout import Layout, StageSpec

PLAN_VERSION = 1
_GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Alternative:
    """A runner-up (or a rejected layout) and why it lost: "slower by 4.1%", "over memory by 3.2 GiB"."""

    description: str
    microbatches: int
    step_time_s: float | None
    reason: str


@dataclasses.dataclass(frozen=True)
class StageCheck:
    """What compiling a stage's programs at its real sizes found (`python -m dflop_jax.plan --check`;
    `profiling/compile_check.py` explains the terms). Bytes per device.

    Attributes:
      stage: index in layout order.
      parts: the programs compiled ("llm", or "encoder" then "llm" for a colocated encoder).
      program_bytes: per part, `memory_analysis()` arguments + outputs - aliased + temporaries.
      params, grads, optimizer: fp32 master weights and their compute-dtype copies, gradient
        accumulator, AdamW m + v.
      inputs: stage inputs of the `in_flight` microbatches alive under 1F1B (under a saving residual
        policy one microbatch's: the others keep their residuals instead).
      transient: the largest part's temporaries, incoming dy and outgoing dx.
      compile_s: seconds to lower and compile the parts.
      residuals: under a saving residual policy ("all", "layers"), the residuals the `in_flight`
        microbatches keep from their forward to their backward (0 under "recompute").
      policy: the residual policy the stage's programs were compiled under (what the run trains).
      predicted: the memory model's bytes for the stage under `policy` (0: not recorded; the plan's
        own prediction, made at "recompute", stands for it).
      flops_forward, flops_backward: XLA's FLOP count of the compiled training programs at these
        buckets (`profiling/compile_check.py`; the backward of the last stage: its fused program
        minus its forward); 0: not recorded.
    """

    stage: int
    parts: tuple[str, ...]
    program_bytes: tuple[float, ...]
    params: float
    grads: float
    optimizer: float
    inputs: float
    transient: float
    in_flight: int
    compile_s: float
    residuals: float = 0.0
    policy: str = "recompute"
    predicted: float = 0.0
    flops_forward: float = 0.0
    flops_backward: float = 0.0

    @property
    def total(self) -> float:
        """Peak bytes per device the runtime holds for the stage."""
        return sum(getattr(self, k) for k in _CHECK_TERMS)


_CHECK_TERMS = ("params", "grads", "optimizer", "inputs", "residuals", "transient")


@dataclasses.dataclass(frozen=True)
class Plan:
    """A chosen layout with its predictions.

    Attributes:
      model, device, num_devices: the request.
      cost_provider: name of the cost provider used.
      mode: "dflop" (data-aware search) or "uniform" (data-blind baseline layout).
      layout: the stages.
      buckets: tile and length buckets.
      microbatches: M per global batch (the fewest the scheduler uses).
      max_microbatches: the most the scheduler may use (a batch that does not fit M microbatches of the
        largest buckets gets more); `ScheduleProblem.microbatches = (microbatches, max_microbatches)`.
      global_batch: samples per global batch.
      schedule: simulated pipeline schedule ("1f1b" / "gpipe").
      step_time_mean_s, step_time_p90_s: simulated step time over the sampled global batches.
      idle_fraction: mean simulated idle fraction (DESIGN section 9).
      stage_memory_bytes: predicted peak bytes per device of each stage (layout order).
      memory_capacity_bytes: usable device memory (capacity x (1 - margin)).
      device_memory_bytes: device capacity.
      alternatives: the next best candidates and notable rejections.
      search: counts of the search (enumerated, over memory, screened, scored) and its wall time.
      planner_config: the PlannerConfig as a dict.
      checks: per stage, what compiling it found (empty unless `plan --check` ran).
      inputs: what the plan was made from: per input ("shapes", "cost_table") its file's path and
        sha256, or the built-in source's name; {} where the caller records none.
      compile: what the plan costs before its first step, where the planner priced it
        (`planner.steps`): programs, estimated compile seconds (`costs/compile.py`), the run's steps,
        that time per step, the bucket pairs and the padding of the sampled batches; {} otherwise.
      ladders: the chosen layout at each ladder size scored (buckets, pairs, programs, compile
        seconds, padding, step time, and step time plus compile per step, which the planner
        minimized), smallest first; why the ladder won.
      residuals: each stage's residual policy (`contracts.cost_table.RESIDUAL_POLICIES`): what
        its memory and times were planned under and what a run of the plan trains (`residuals:
        auto`); () where the planner chose none (an interleaved baseline).
    """

    model: str
    device: str
    num_devices: int
    cost_provider: str
    mode: str
    layout: Layout
    buckets: BucketSet
    microbatches: int
    max_microbatches: int
    global_batch: int
    schedule: str
    step_time_mean_s: float
    step_time_p90_s: float
    idle_fraction: float
    stage_memory_bytes: tuple[float, ...]
    memory_capacity_bytes: float
    device_memory_bytes: float
    alternatives: tuple[Alternative, ...] = ()
    search: dict = dataclasses.field(default_factory=dict)
    planner_config: dict = dataclasses.field(default_factory=dict)
    checks: tuple[StageCheck, ...] = ()
    inputs: dict = dataclasses.field(default_factory=dict)
    compile: dict = dataclasses.field(default_factory=dict)
    ladders: tuple[dict, ...] = ()
    residuals: tuple[str, ...] = ()

    def __post_init__(self):
        if len(self.stage_memory_bytes) != self.layout.num_stages:
            raise ValueError(
                f"stage_memory_bytes has {len(self.stage_memory_bytes)} entries for {self.layout.num_stages} stages"
            )
        if self.residuals and len(self.residuals) != self.layout.num_stages:
            raise ValueError(
                f"residuals has {len(self.residuals)} entries for {self.layout.num_stages} stages"
            )
        if self.checks and len(self.checks) != self.layout.num_stages:
            raise ValueError(
                f"checks has {len(self.checks)} entries for {self.layout.num_stages} stages"
            )

    @property
    def remat(self) -> dict[str, str]:
        """The activation recomputation the plan's memory and times assume, per module ("none" /
        "full" / "dots"): the runtime applies it (`models` `remat` of the vision tower and decoder).
        A searched choice (`search.remat`) wins over the cost provider's own setting (its name)."""
        chosen = self.search.get("remat")
        if chosen is not None:
            policy = "full" if chosen else "none"
            return {"vision": policy, "llm": policy}
        name = self.cost_provider
        if "+remat:" in name:  # "+remat:vision=dots,llm=full"
            spelled = name.split("+remat:", 1)[1].split("+", 1)[0]
            return dict(item.split("=", 1) for item in spelled.split(","))
        policy = "full" if name.endswith("+remat") or "+remat+" in name else "none"
        return {"vision": policy, "llm": policy}

    @property
    def microbatch_range(self) -> tuple[int, int]:
        """For `ScheduleProblem.microbatches`."""
        return (self.microbatches, self.max_microbatches)


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    stages = []
    for i, (s, mem) in enumerate(zip(plan.layout.stages, plan.stage_memory_bytes)):
        stages.append(
            {
                "stage": i,
                "module": s.module,
                "first_layer": s.first_layer,
                "num_layers": s.num_layers,
                "tp": s.tp,
                "dp": s.dp,
                "devices": s.num_devices,
                "has_embedding": s.has_embedding,
                "has_head": s.has_head,
                **({"residuals": plan.residuals[i]} if plan.residuals else {}),
                "memory_gib": round(mem / _GIB, 2),
            }
        )
        if plan.checks:
            stages[-1].update(_checked_stage(plan.checks[i], mem))
    return {
        "dflop_plan": PLAN_VERSION,
        "model": plan.model,
        "device": plan.device,
        "num_devices": plan.num_devices,
        "devices_used": plan.layout.num_devices,
        "cost_provider": plan.cost_provider,
        "mode": plan.mode,
        "encoder_colocated": not plan.layout.encoder_stages,
        "remat": plan.remat,
        **_optional_layout_keys(plan.layout),
        "schedule": plan.schedule,
        "global_batch": plan.global_batch,
        "microbatches": plan.microbatches,
        "max_microbatches": plan.max_microbatches,
        "predicted": {
            "step_time_mean_s": float(plan.step_time_mean_s),
            "step_time_p90_s": float(plan.step_time_p90_s),
            "idle_fraction": float(plan.idle_fraction),
        },
        "memory": {
            "device_gib": round(plan.device_memory_bytes / _GIB, 2),
            "usable_gib": round(plan.memory_capacity_bytes / _GIB, 2),
            "peak_stage_gib": round(max(plan.stage_memory_bytes) / _GIB, 2),
        },
        **({"inputs": plan.inputs} if plan.inputs else {}),
        "layout": stages,
        "buckets": plan.buckets.to_dict(),
        **({"compile": dict(plan.compile)} if plan.compile else {}),
        **({"ladders": [dict(row) for row in plan.ladders]} if plan.ladders else {}),
        "alternatives": [
            {
                "layout": a.description,
                "microbatches": a.microbatches,
                "step_time_s": None if a.step_time_s is None else float(a.step_time_s),
                "lost_because": a.reason,
            }
            for a in plan.alternatives
        ],
        "search": dict(plan.search),
        "planner_config": dict(plan.planner_config),
        # exact bytes for a lossless round trip (memory_gib above is rounded for people)
        "stage_memory_bytes": [float(m) for m in plan.stage_memory_bytes],
        "memory_capacity_bytes": float(plan.memory_capacity_bytes),
        "device_memory_bytes": float(plan.device_memory_bytes),
    }


def _checked_stage(c: StageCheck, planned: float) -> dict[str, Any]:
    """A plan.yaml stage's check: compared with the memory model's figure under the policy it was
    compiled at (`checked_memory_gib`); a check that recorded none compares with the plan's own."""
    if not c.predicted:
        return check_to_dict(c, planned)
    return {"checked_memory_gib": round(c.predicted / _GIB, 2), **check_to_dict(c, c.predicted)}


def check_to_dict(c: StageCheck, predicted: float) -> dict[str, Any]:
    return {
        "residuals": c.policy,
        "compiled_memory_gib": round(c.total / _GIB, 2),
        "compiled_vs_predicted": round(c.total / predicted - 1, 3) if predicted > 0 else None,
        "compile_s": round(c.compile_s, 1),
        "compiled": {
            "parts": list(c.parts),
            "program_bytes": [float(b) for b in c.program_bytes],
            **{k: float(getattr(c, k)) for k in _CHECK_TERMS},
            "in_flight": c.in_flight,
            "predicted": float(c.predicted),
            "flops_forward": float(c.flops_forward),
            "flops_backward": float(c.flops_backward),
        },
    }


def _check_from_dict(i: int, s: dict[str, Any]) -> StageCheck:
    c = s["compiled"]
    return StageCheck(
        stage=i,
        parts=tuple(str(p) for p in c["parts"]),
        program_bytes=tuple(float(b) for b in c["program_bytes"]),
        # a recompute check may have been written before it had a residual term: it held none
        **{k: float(c.get(k, 0.0) if k == "residuals" else c[k]) for k in _CHECK_TERMS},
        in_flight=int(c["in_flight"]),
        compile_s=float(s["compile_s"]),
        policy=str(s.get("residuals", "recompute")),
        predicted=float(c.get("predicted", 0.0)),
        flops_forward=float(c.get("flops_forward", 0.0)),
        flops_backward=float(c.get("flops_backward", 0.0)),
    )


def save_plan(plan: Plan, path: str | Path) -> Path:
    """Writes `plan` as YAML (parent directories created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"# DFLOP plan: {plan.model} on {plan.num_devices} x {plan.device} ({plan.mode}).\n"
        f"# Predicted step {plan.step_time_mean_s * 1e3:.1f} ms (p90 {plan.step_time_p90_s * 1e3:.1f} ms), "
        f"idle {plan.idle_fraction:.1%}. Written by python -m dflop_jax.plan.\n"
    )
    path.write_text(
        header + yaml.dump(plan_to_dict(plan), Dumper=_Dumper, sort_keys=False, width=110)
    )
    return path


class _Dumper(yaml.SafeDumper):
    """Safe YAML with short scalar lists on one line (`tiles: [16, 19, 21]`)."""


def _represent_list(dumper: yaml.SafeDumper, data: list):
    flow = all(isinstance(v, (int, float, str, bool)) or v is None for v in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def load_plan(path: str | Path) -> Plan:
    """Reads a plan.yaml written by `save_plan`.

    Raises:
      ValueError: missing file, wrong version, or a malformed entry (naming it).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"plan file not found: {path}")
    d = yaml.safe_load(path.read_text())
    if not isinstance(d, dict) or d.get("dflop_plan") != PLAN_VERSION:
        raise ValueError(
            f"{path}: not a dflop plan (expected `dflop_plan: {PLAN_VERSION}` at the top level)"
        )
    try:
        return _plan_from_dict(d)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: malformed plan: {type(e).__name__}: {e}") from None


def _optional_layout_keys(layout: Layout) -> dict[str, int | bool]:
    """The layout's keys written only when set (older plans stay unchanged): the colocated
    encoder's own tp, and `pooled_tiles`."""
    tp = layout.colocated_encoder_tp
    out: dict[str, int | bool] = {} if tp is None else {"encoder_colocated_tp": tp}
    return out | ({"pooled_tiles": True} if layout.pooled_tiles else {})


def _plan_from_dict(d: dict[str, Any]) -> Plan:
    stages = [
        StageSpec(
            s["module"],
            int(s["first_layer"]),
            int(s["num_layers"]),
            int(s["tp"]),
            int(s["dp"]),
            bool(s["has_embedding"]),
            bool(s["has_head"]),
        )  # fmt: skip
        for s in d["layout"]
    ]
    layout = Layout(
        tuple(s for s in stages if s.module == "encoder"),
        tuple(s for s in stages if s.module == "llm"),
        d.get("encoder_colocated_tp"),
        tuple(s for s in stages if s.module == "audio"),
        bool(d.get("pooled_tiles", False)),
    )
    pred = d["predicted"]
    return Plan(
        model=str(d["model"]),
        device=str(d["device"]),
        num_devices=int(d["num_devices"]),
        cost_provider=str(d["cost_provider"]),
        mode=str(d["mode"]),
        layout=layout,
        buckets=BucketSet.from_dict(d["buckets"]),
        microbatches=int(d["microbatches"]),
        max_microbatches=int(d["max_microbatches"]),
        global_batch=int(d["global_batch"]),
        schedule=str(d["schedule"]),
        step_time_mean_s=float(pred["step_time_mean_s"]),
        step_time_p90_s=float(pred["step_time_p90_s"]),
        idle_fraction=float(pred["idle_fraction"]),
        stage_memory_bytes=tuple(float(m) for m in d["stage_memory_bytes"]),
        memory_capacity_bytes=float(d["memory_capacity_bytes"]),
        device_memory_bytes=float(d["device_memory_bytes"]),
        alternatives=tuple(
            Alternative(
                str(a["layout"]), int(a["microbatches"]), a["step_time_s"], str(a["lost_because"])
            )
            for a in d["alternatives"]
        ),
        search=dict(d["search"]),
        planner_config=dict(d["planner_config"]),
        checks=tuple(_check_from_dict(i, s) for i, s in enumerate(d["layout"]) if "compiled" in s),
        inputs=dict(d.get("inputs") or {}),
        compile=dict(d.get("compile") or {}),
        ladders=tuple(dict(row) for row in d.get("ladders") or ()),
        residuals=_planned_residuals(d),
    )


def _planned_residuals(d: dict[str, Any]) -> tuple[str, ...]:
    """Each stage's residual policy (a check compiles the plan's, so its entry of the same name
    agrees); () for a plan written before the planner chose them."""
    if not all("residuals" in s for s in d["layout"]):
        return ()
    return tuple(str(s["residuals"]) for s in d["layout"])
