"""The optimizer's hyperparameters (`optimizer.*`) and the per-stage optax transformation.

AdamW with linear warmup and cosine decay, decoupled weight decay on matrices only; under a training
recipe (frozen parts, per-part learning-rate and weight-decay scales) one AdamW per trained part and
`optax.set_to_zero` for the frozen ones. Clipping by the global gradient norm is not part of the
transformation: it needs every stage's gradient and happens before it (`runtime/train_state.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import optax

from dflop_jax.config import require
from dflop_jax.programs.param_paths import param_labels
from models.stage_modules import TRAINABLE_PARTS


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup and cosine decay; clipping by the global gradient norm.

    Attributes:
      lr: peak learning rate.
      warmup_steps: linear warmup from 0 to `lr`.
      decay_steps: total schedule length (cosine decays to `end_lr_ratio * lr` by then).
      end_lr_ratio: final learning rate as a fraction of `lr`.
      b1, b2, eps: Adam moments.
      weight_decay: decoupled decay, applied to matrices only (ndim >= 2).
      clip_norm: max global gradient norm (0 disables clipping).
      trainable: the parts trained ("vision", "projector", "llm"; `models.stage_modules.param_part`); the
        others are frozen: no optimizer state, no update, no share of the gradient norm.
      lr_scale, weight_decay_scale: per-part multipliers of `lr` and `weight_decay` (missing = 1),
        e.g. {vision: 0.2} (LLaVA-OV stage 2: the vision tower at 1/5 of the rate).
      zero1: shard the AdamW moments (and the reduced gradient) over the stage's "data" axis;
        False keeps them replicated like the params (the pre-ZeRO layout, for comparison).
    """

    lr: float = 3e-3
    warmup_steps: int = 5
    decay_steps: int = 100
    end_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    zero1: bool = True
    trainable: tuple[str, ...] = TRAINABLE_PARTS
    lr_scale: dict[str, float] = dataclasses.field(default_factory=dict)
    weight_decay_scale: dict[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        parts, chosen = set(TRAINABLE_PARTS), self.trainable
        ok = 0 < len(chosen) == len(set(chosen)) and set(chosen) <= parts
        fix = f"give a non-empty subset of {list(TRAINABLE_PARTS)}, no repeats"
        require(ok, "optimizer.trainable", list(chosen), fix)
        ok = set(self.lr_scale) <= parts and all(v > 0 for v in self.lr_scale.values())
        fix = f"keys from {list(TRAINABLE_PARTS)}, values > 0"
        require(ok, "optimizer.lr_scale", self.lr_scale, fix)
        wd = self.weight_decay_scale
        ok = set(wd) <= parts and all(v >= 0 for v in wd.values())
        fix = f"keys from {list(TRAINABLE_PARTS)}, values >= 0"
        require(ok, "optimizer.weight_decay_scale", wd, fix)
        require(self.lr > 0, "optimizer.lr", self.lr, "must be > 0")
        require(self.warmup_steps >= 0, "optimizer.warmup_steps", self.warmup_steps, "must be >= 0")
        require(
            self.decay_steps > self.warmup_steps,
            "optimizer.decay_steps",
            self.decay_steps,
            "must exceed optimizer.warmup_steps",
        )
        require(
            0 <= self.end_lr_ratio <= 1, "optimizer.end_lr_ratio", self.end_lr_ratio, "in [0, 1]"
        )
        require(
            self.clip_norm >= 0, "optimizer.clip_norm", self.clip_norm, "must be >= 0 (0 = off)"
        )
        for name in ("b1", "b2"):
            value = getattr(self, name)
            require(0 <= value < 1, f"optimizer.{name}", value, "must be in [0, 1)")
        require(self.eps > 0, "optimizer.eps", self.eps, "must be > 0")
        require(self.weight_decay >= 0, "optimizer.weight_decay", self.weight_decay, "must be >= 0")

    def schedule(self) -> optax.Schedule:
        return optax.warmup_cosine_decay_schedule(
            0.0, self.lr, self.warmup_steps, self.decay_steps, self.lr * self.end_lr_ratio
        )

    def _adamw(self, part: str) -> optax.GradientTransformation:
        lr, wd = self.lr_scale.get(part, 1.0), self.weight_decay_scale.get(part, 1.0)
        schedule = self.schedule()
        return optax.adamw(
            schedule if lr == 1 else lambda step: lr * schedule(step),
            b1=self.b1,
            b2=self.b2,
            eps=self.eps,
            weight_decay=self.weight_decay * wd,
            mask=lambda params: jax.tree.map(lambda a: a.ndim >= 2, params),
        )

    def build(self) -> optax.GradientTransformation:
        """The per-stage transformation (clipping is applied before it, across stages): AdamW, or with
        a recipe (frozen parts, per-part scales) one AdamW per trained part and `set_to_zero` for the
        frozen ones (`optax.multi_transform`: a frozen leaf holds no optimizer state)."""
        if (
            set(self.trainable) == set(TRAINABLE_PARTS)
            and not self.lr_scale
            and not self.weight_decay_scale
        ):
            return self._adamw("llm")  # the plain AdamW state tree (checkpoints of such runs)
        parts = {
            p: self._adamw(p) if p in self.trainable else optax.set_to_zero()
            for p in TRAINABLE_PARTS
        }
        return optax.multi_transform(parts, param_labels)
