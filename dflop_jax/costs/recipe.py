"""What a training recipe (`optimizer.trainable`) makes each pipeline stage run: its role.

`stage_role` is the one place a stage's role is decided. The runtime's stage builder
(`programs.stage_builder.build_stages`) gives each stage program its role, from which it takes whether
the stage has a backward program and whether its input gets a gradient (programs/stage_jits.py); the
profiler (`profiling/programs.py`), the cost providers and the memory model read the same function.
Which parameter leaves a part covers is the models' labelling (`models.stage_modules.param_part`, the
runtime's trained-leaf masks); `stage_parts` names the same parts per stage.
Roles by what a stage trains and whether its input needs a gradient (some part before it trains):

- "train": it holds a trained part: a backward program with weight gradients of the trained parts only
  (fp32 accumulator, ZeRO-1 AdamW state for them alone);
- "dx": nothing trained, but a trained part lies before it: the backward program pulls the cotangent
  to x only (no weight gradients, no accumulator, no optimizer state);
- "forward": nothing trained and nothing before it trains: forward only (no backward program, no stage
  input kept for one); such stages form a prefix of the pipeline and leave the backward wave.

Time factors (the same for the analytic and the measured provider, which both know the trainable
program's backward), by the residual policy the trainable programs were timed under
(`contracts.cost_table.RESIDUAL_POLICIES`; the analytic provider applies "recompute"'s, an upper
bound): under "recompute" a trainable backward program is recompute (~1 forward) + dx (~1 forward) +
weight gradients (~1 forward), so a dx-only backward is `DX_FRACTION` = 2/3 of it; from saved residuals
("all") it is dx + weight gradients, so `SAVED_DX_FRACTION` = 1/2; under "layers" the differentiated
layers are rebuilt, 2/3 again. An encoder stage whose vision layers are frozen but whose projector trains
(LLaVA-OV stage 1, encoder stage with the head) and whose input needs no gradient back-propagates
through the projector only: backward = projector backward, plus, under "recompute", its frozen layers'
forward re-run (stage forward - projector forward).

A colocated encoder (no encoder stages: the whole encoder inside LLM stage 0's colocated program) never
runs forward only: the colocated stage always trains something (it holds a part of each module:
`stage_role(..., colocated=True)`, the runtime's view of that one program), and its backward program
recomputes the whole stage forward under "recompute", so a frozen encoder adds its FORWARD to that
backward (no backward of its own: nothing trained in it, no dx into it; nothing under a saving
policy), and a projector-only one the projector's backward, plus its frozen layers' forward under
"recompute" (`colocated_backward`).

The parts are `contracts.cost_table.TRAINABLE_PARTS` (the models name the same ones in
`models.stage_modules.TRAINABLE_PARTS`; not imported: the cost layer imports no JAX).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from dflop_jax.contracts.cost_table import TRAINABLE_PARTS
from dflop_jax.contracts.layout import StageSpec

DX_FRACTION = 2.0 / 3.0  # dx-only backward / trainable backward (recompute + dx, no weight grads)
SAVED_DX_FRACTION = 0.5  # the same from saved residuals: dx of dx + weight gradients


def check_trainable(trainable: Iterable[str], key: str = "trainable") -> tuple[str, ...]:
    """`trainable` as a tuple, or ValueError (one line) unless a non-empty subset of TRAINABLE_PARTS."""
    chosen = tuple(trainable) if not isinstance(trainable, str) else (trainable,)
    if not chosen or len(set(chosen)) != len(chosen) or not set(chosen) <= set(TRAINABLE_PARTS):
        raise ValueError(
            f"{key}={list(chosen)}: give a non-empty subset of {list(TRAINABLE_PARTS)}, no repeats"
        )
    return chosen


def stage_parts(stage: StageSpec, colocated: bool = False, audio: bool = False) -> tuple[str, ...]:
    """The recipe parts whose parameters `stage` holds (encoder layers/embedding: vision; encoder
    head: projector; any LLM stage: llm; the colocated stage, and an LLM stage holding the audio
    encoder (`audio`: its tower counts as "vision", its projector as "projector"): all three)."""
    if stage.module == "llm":
        return TRAINABLE_PARTS if colocated or audio else ("llm",)
    body = ("vision",) if stage.num_layers or stage.has_embedding else ()
    return body + (("projector",) if stage.has_head else ())


def _upstream(
    stage: StageSpec, multimodal: bool, colocated: bool, audio_x: bool = False
) -> tuple[str, ...]:
    """Parts that run before `stage`'s input (encoder stages first, then LLM stages; none before
    the colocated stage, which takes the tiles, unless it takes the audio stages' features)."""
    if colocated:
        return ("vision", "projector") if audio_x else ()
    if stage.module in ("encoder", "audio"):  # an encoder branch: its tower, then its head
        return () if stage.has_embedding else ("vision",)
    mm = ("vision", "projector") if multimodal else ()
    return mm if stage.has_embedding else mm + ("llm",)


@dataclasses.dataclass(frozen=True)
class StageRole:
    """What a stage runs under a recipe.

    Attributes:
      trains: its trained parts; frozen: its frozen parts; input_grad: its input needs a gradient.
    """

    trains: tuple[str, ...]
    frozen: tuple[str, ...]
    input_grad: bool

    @property
    def kind(self) -> str:
        """ "train", "dx" or "forward" (module docstring)."""
        if self.trains:
            return "train"
        return "dx" if self.input_grad else "forward"

    @property
    def has_backward(self) -> bool:
        """Whether the stage has a backward program (kind "train" or "dx")."""
        return self.kind != "forward"

    @property
    def head_only(self) -> bool:
        """An encoder head stage training its projector only, nothing before it needing dx."""
        return self.trains == ("projector",) and "vision" in self.frozen and not self.input_grad


ALL_TRAIN = StageRole(TRAINABLE_PARTS, (), True)


def stage_role(
    stage: StageSpec,
    trainable: Iterable[str],
    multimodal: bool = True,
    colocated: bool = False,
    audio: bool = False,
    audio_x: bool = False,
) -> StageRole:
    """The role of `stage` under `trainable` (module docstring).

    Args:
      multimodal: the model has an encoder (it runs before the first LLM stage).
      colocated: `stage` is LLM stage 0 holding the whole encoder too (a multimodal layout without
        encoder stages, as the runtime builds it): one program of all three parts, no stage input.
        The cost models leave it False and cost that stage as LLM stage 0 plus the encoder
        (`colocated_backward`).
      audio: `stage` also holds the whole audio encoder (an omni model's first LLM stage): it holds
        all three parts; its input (the vision features, when not colocated) is as LLM stage 0's.
      audio_x: `stage` takes the features of the audio encoder's own stages (an omni model's first
        LLM stage): a colocated one has an input, the audio branch's.
    """
    chosen = set(trainable)
    parts = stage_parts(stage, colocated, audio)
    return StageRole(
        tuple(p for p in parts if p in chosen),
        tuple(p for p in parts if p not in chosen),
        any(p in chosen for p in _upstream(stage, multimodal, colocated, audio_x)),
    )


def recipe_backward(
    role: StageRole,
    fwd: float,
    bwd: float,
    head_fwd: float = 0.0,
    head_bwd: float = 0.0,
    residuals: str = "recompute",
) -> float:
    """Backward seconds of a stage under its role, from the trainable program's (fwd, bwd) and, for a
    head-only stage, its projector's (head_fwd, head_bwd), under the residual policy those programs
    ran with (module docstring: "all" recomputes nothing, "layers" the differentiated layers only,
    "recompute" the whole stage)."""
    if role.kind == "forward":
        return 0.0
    if role.kind == "dx":
        return (SAVED_DX_FRACTION if residuals == "all" else DX_FRACTION) * bwd
    if role.head_only:
        return head_bwd + (max(fwd - head_fwd, 0.0) if residuals == "recompute" else 0.0)
    return bwd


def colocated_backward(
    role: StageRole,
    fwd: float,
    bwd: float,
    head_fwd: float = 0.0,
    head_bwd: float = 0.0,
    residuals: str = "recompute",
) -> float:
    """Backward seconds a colocated encoder of role `role` adds to the colocated stage's backward program
    (module docstring), from its trainable (fwd, bwd) and its projector's (head_fwd, head_bwd)."""
    if role.kind == "forward":  # nothing differentiated: re-run only by a backward that recomputes
        return fwd if residuals == "recompute" else 0.0
    return recipe_backward(role, fwd, bwd, head_fwd, head_bwd, residuals)
