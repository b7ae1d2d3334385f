"""Online scheduler (DESIGN section 4): global batch -> microbatches x LLM shards with static-shape buckets.

Pure Python / NumPy / OR-Tools (no jax). `schedule_batch` is one-shot; `Scheduler` is the stateful
per-step object the runtime owns (its `schedule(shapes, index)` is the loader's `ScheduleFn`; adds
adaptive cost correction and checkpointable state).
"""

from dflop_jax.contracts import (
    BucketSet,
    SampleShape,
    Schedule,
    ScheduledMicrobatch,
    ScheduleProblem,
    StageCostFn,
)
from dflop_jax.scheduler.baselines import (
    BASELINES,
    data_blind_schedule,
    maxtext_packer_schedule,
    reference_exact_schedule,
    reference_like_schedule,
    run_baselines,
    strongest,
)
from dflop_jax.scheduler.config import SchedulerConfig
from dflop_jax.scheduler.correction import CostCorrection, Scheduler
from dflop_jax.scheduler.objective import CostTable, surrogate_step_time
from dflop_jax.scheduler.solve import schedule_batch
from dflop_jax.scheduler.workloads import (
    default_buckets,
    llava_ov_mix,
    load_shape_distribution,
    omni_mix,
    omnibal_shapes,
    sample_global_batch,
    save_shape_distribution,
)

__all__ = [
    "BASELINES",
    "BucketSet",
    "CostCorrection",
    "CostTable",
    "ScheduledMicrobatch",
    "SampleShape",
    "Schedule",
    "ScheduleProblem",
    "Scheduler",
    "SchedulerConfig",
    "StageCostFn",
    "data_blind_schedule",
    "default_buckets",
    "llava_ov_mix",
    "omni_mix",
    "load_shape_distribution",
    "maxtext_packer_schedule",
    "omnibal_shapes",
    "reference_exact_schedule",
    "reference_like_schedule",
    "run_baselines",
    "sample_global_batch",
    "save_shape_distribution",
    "schedule_batch",
    "strongest",
    "surrogate_step_time",
]
