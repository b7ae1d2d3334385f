"""One process of the multi-process recipe test (tests/multiprocess/test_runtime_multiprocess_frozen.py).

    python tests/frozen_worker.py <processes> <rank> <host:port> <out dir> <recipe>...

The tiny LLaVA-OV of tests/runtime/test_runtime_frozen.py over its 2 encoder + 2 LLM stage layout
(`pipeline_fixtures.SEPARATE_LAYOUT`; 8 devices, 4 per process: the encoder stages on process 0, the
LLM stages on process 1), one pipelined step per recipe (`pipeline_reference.TRAINABLE_BY_RECIPE`)
with the same microbatches and optimizer. Each process writes `<out>/<recipe>_rank<rank>.npz`: the
step's loss and global gradient norm (read on every process) and the initial and the updated params
of its own stages under their model-level paths
("init:encoder/params/vision/...", "param:...").
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the fixture modules under tests/

from dflop_jax.host_devices import simulate_cpu_devices  # noqa: E402  (before jax starts)


def _local_params(layout, stages) -> dict:
    """{"module/params/...": host array} of this process's stages."""
    import jax

    from dflop_jax.programs.param_paths import key_name
    from dflop_jax.runtime.checkpoint import model_tree

    out = {}
    for spec, stage in zip(layout.stages, stages):
        if getattr(stage, "local", True):
            tree = jax.device_get(model_tree([spec], [stage.params], [{}]))
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
                out["/".join(key_name(k) for k in path)] = leaf
    return out


def step(recipe: str, out_dir: Path) -> None:
    """One pipelined step of `recipe`; writes this process's share of its result."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from pipeline_fixtures import MLLM_TEXT, SEPARATE_LAYOUT, SEPARATE_VISION, separate_batch
    from pipeline_reference import RECIPE_HYPERPARAMS, TRAINABLE_BY_RECIPE

    from dflop_jax.programs.meshes import stage_meshes
    from dflop_jax.programs.processes import host_scalars
    from dflop_jax.programs.stage_builder import build_stages
    from dflop_jax.runtime.driver import connect, run_pipeline
    from dflop_jax.runtime.optimizer_config import OptimizerConfig
    from dflop_jax.runtime.train_state import StageOptimizer, apply_updates
    from models.llava_onevision import llava_onevision_config

    trainable = TRAINABLE_BY_RECIPE[recipe]
    cfg = llava_onevision_config(SEPARATE_VISION, MLLM_TEXT)
    stages = build_stages(cfg, SEPARATE_LAYOUT, stage_meshes(SEPARATE_LAYOUT), 0,
                          compute_dtype=jnp.float32, trainable=trainable)  # fmt: skip
    opt = OptimizerConfig(**RECIPE_HYPERPARAMS, trainable=trainable)
    opts = [StageOptimizer(s, opt.build()) for s in stages]
    connect(stages)
    initial = _local_params(SEPARATE_LAYOUT, stages)
    mbs = separate_batch()
    norm = sum(float(m["loss_mask"].sum()) for m in mbs)
    out = run_pipeline(stages, mbs, norm, "1f1b")
    stats = apply_updates(opts, out.grads, opt.clip_norm, out.loss)
    loss, grad_norm = host_scalars([stats[-1]], recipe)[:2]
    params = _local_params(SEPARATE_LAYOUT, stages)
    np.savez(out_dir / f"{recipe}_rank{jax.process_index()}.npz", loss=loss, norm=grad_norm,
             **{f"param:{k}": v for k, v in params.items()},
             **{f"init:{k}": v for k, v in initial.items()})  # fmt: skip
    print(f"{recipe}: loss {loss:.6f} norm {grad_norm:.6f}, {len(params)} params", flush=True)


def main(processes: int, rank: int, coordinator: str, out_dir: str, *recipes: str) -> None:
    simulate_cpu_devices(8 // processes)
    from dflop_jax.programs import watchdog
    from dflop_jax.programs.processes import DistributedConfig, initialize

    initialize(DistributedConfig(coordinator, processes, rank, timeout_s=60))
    for recipe in recipes:
        step(recipe, Path(out_dir))
        watchdog.progress(1)
    watchdog.finish()  # a clean exit (the watchdog reports any other exit to the peers)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]), int(args[1]), *args[2:])
