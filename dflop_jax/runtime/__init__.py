"""Running a training job on the compiled programs (`dflop_jax/programs/`): the 1F1B/GPipe driver,
per-stage optimizer state, checkpoints, metrics, evaluation, re-planning and the training loop
(`trainer.train`; `dflop_jax.train.run` resolves the plan and calls it)."""

from dflop_jax.programs.model_section import ModelConfig
from dflop_jax.runtime.checkpoint import Checkpointer, model_tree
from dflop_jax.runtime.config import CheckpointConfig, LayoutConfig, TrainConfig
from dflop_jax.runtime.driver import Op, StepOutput, pipeline_order, run_pipeline, stage_ops
from dflop_jax.runtime.optimizer_config import OptimizerConfig
from dflop_jax.runtime.train_state import STATS, StageOptimizer, apply_updates

__all__ = [
    "CheckpointConfig",
    "Checkpointer",
    "LayoutConfig",
    "ModelConfig",
    "Op",
    "OptimizerConfig",
    "StageOptimizer",
    "STATS",
    "StepOutput",
    "TrainConfig",
    "apply_updates",
    "model_tree",
    "pipeline_order",
    "run_pipeline",
    "stage_ops",
]
