"""What is compiled and where it runs: the floor the model profiler and the training runtime stand on.

One builder of stage programs (`stage_builder.build_stages` -> `stage_jits.stage_jits`, wrapped in
`stage_program.StageProgram`), so the profiler times the programs the run trains; the logical ->
mesh sharding rules (`sharding`), the stage meshes (`meshes`), the transfers between them
(`transfer`), the packed gradient accumulator (`accumulator`), the ZeRO-1 layout of optimizer
state (`zero1_layout`), parameter paths and training
masks (`param_paths`), the accelerator and its kernels (`devices`), the job's processes and their
exchanges (`processes`, `watchdog`), and the run config's `model:` section with the `models` config
it becomes (`model_section`). It imports neither `profiling` nor `runtime`.
"""

from dflop_jax.programs.devices import enable_compilation_cache
from dflop_jax.programs.meshes import LayoutError, stage_meshes
from dflop_jax.programs.processes import DistributedConfig, host_scalars
from dflop_jax.programs.stage_fns import StageFns
from dflop_jax.programs.stage_program import StageProgram

__all__ = [
    "DistributedConfig",
    "LayoutError",
    "StageFns",
    "StageProgram",
    "enable_compilation_cache",
    "host_scalars",
    "stage_meshes",
]
