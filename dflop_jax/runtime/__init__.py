"""MPMD pipeline runtime: stage submeshes, stage programs, the 1F1B/GPipe driver, per-stage optimizer
state, checkpoints, metrics and the training loop (`trainer.train`; `dflop_jax.train.run` resolves the
plan and calls it). `sharding.py` (logical->mesh rules) is re-exported by its owner's module only."""

from dflop_jax.runtime.checkpoint import Checkpointer, model_tree
from dflop_jax.runtime.config import CheckpointConfig, LayoutConfig, ModelConfig, TrainConfig
from dflop_jax.runtime.distributed import DistributedConfig, host_scalars
from dflop_jax.runtime.driver import Op, StepOutput, pipeline_order, run_pipeline, stage_ops
from dflop_jax.runtime.mesh import LayoutError, stage_meshes
from dflop_jax.runtime.stages import StageFns, StageProgram, enable_compilation_cache
from dflop_jax.runtime.train_state import (
    STATS,
    OptimizerConfig,
    StageOptimizer,
    apply_updates,
)

__all__ = [
    "CheckpointConfig",
    "Checkpointer",
    "DistributedConfig",
    "LayoutConfig",
    "LayoutError",
    "ModelConfig",
    "Op",
    "OptimizerConfig",
    "StageFns",
    "StageOptimizer",
    "STATS",
    "StageProgram",
    "StepOutput",
    "TrainConfig",
    "apply_updates",
    "enable_compilation_cache",
    "host_scalars",
    "model_tree",
    "pipeline_order",
    "run_pipeline",
    "stage_meshes",
    "stage_ops",
]
