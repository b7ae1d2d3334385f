"""Step time and per-device memory of one mid-size dp stage, to compare runtime versions (ZeRO-1).

    PYTHONPATH=<checkout> python scripts/zero1_measure.py [--dp 4] [--steps 3]

One LLM stage (embedding + 4 decoder layers + head, ~22M params) on a (dp, 1) mesh of simulated CPU
devices, M=4 microbatches per step through the runtime's driver and optimizer. Prints the median step
time after a warm-up step, the resident state per device (params, gradient accumulator, optimizer
state: the bytes of device 0's shards) and the compiled `memory_analysis()` of the fused last-stage
program. Runs against any checkout with the same public runtime API (main before ZeRO-1 too).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ARGS = argparse.ArgumentParser()
ARGS.add_argument("--dp", type=int, default=4)
ARGS.add_argument("--steps", type=int, default=3)
ARGS.add_argument("--microbatches", type=int, default=4)
ARGS.add_argument("--length", type=int, default=256)


def main() -> None:
    args = ARGS.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.dp}"
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from models_fixtures import tiny_decoder_config

    from dflop_jax.costs.layout import Layout, StageSpec
    from dflop_jax.runtime.driver import run_pipeline
    from dflop_jax.runtime.mesh import stage_meshes
    from dflop_jax.runtime.model_stages import build_stages
    from dflop_jax.runtime.train_state import OptimizerConfig, StageOptimizer, apply_updates

    cfg = tiny_decoder_config(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8,
        num_kv_heads=4, head_dim=64, max_position_embeddings=args.length, dtype="float32",
    )  # fmt: skip
    spec = StageSpec("llm", 0, 4, tp=1, dp=args.dp, has_embedding=True, has_head=True)
    layout = Layout((), (spec,))
    stages = build_stages(cfg, layout, stage_meshes(layout), 0, compute_dtype=jnp.bfloat16)
    opt_cfg = OptimizerConfig()
    opts = [StageOptimizer(s, opt_cfg.build()) for s in stages]
    rng = np.random.default_rng(0)
    rows, n = args.dp, args.length
    mbs = [
        {
            "tokens": rng.integers(0, cfg.vocab_size, (rows, n)).astype(np.int32),
            "feature_index": np.full((rows, n), -1, np.int32),
            "segment_ids": np.ones((rows, n), np.int32),
            "positions": np.tile(np.arange(n, dtype=np.int32), (rows, 1)),
            "targets": rng.integers(0, cfg.vocab_size, (rows, n)).astype(np.int32),
            "loss_mask": np.ones((rows, n), np.float32),
        }
        for _ in range(args.microbatches)
    ]
    norm = float(rows * n * args.microbatches)
    times = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        out = run_pipeline(stages, mbs, norm, "1f1b")
        if step == args.steps:
            grads = out.grads[0]
            resident = {
                "params": _dev0(stages[0].params),
                "grad_accumulator": _dev0(grads),
                "optimizer_state": _dev0(opts[0].state),
            }
        apply_updates(opts, out.grads, opt_cfg.clip_norm)
        jax.block_until_ready(stages[0].params)
        if step:
            times.append(time.perf_counter() - t0)
    stage = stages[0]
    side = stage.put_side(mbs[0])
    acc = stage.zero_grads()
    with jax.set_mesh(stage.mesh):
        m = stage.jits.last.lower(stage.params, None, side, np.float32(norm), acc).compile()
    ma = m.memory_analysis()
    n_params = sum(a.size for a in jax.tree.leaves(stage.params))
    mib = 2**20
    print(f"params {n_params / 1e6:.1f}M, dp {args.dp}, M {args.microbatches}, len {n}")
    print(f"step time median {np.median(times):.3f} s over {len(times)} steps {np.round(times, 3)}")
    for k, v in resident.items():
        print(f"resident {k}: {v / mib:.1f} MiB per device")
    print(f"resident total: {sum(resident.values()) / mib:.1f} MiB per device")
    print(
        f"last program memory_analysis: args {ma.argument_size_in_bytes / mib:.1f} MiB, "
        f"outputs {ma.output_size_in_bytes / mib:.1f}, alias {ma.alias_size_in_bytes / mib:.1f}, "
        f"temp {ma.temp_size_in_bytes / mib:.1f}"
    )


def _dev0(tree) -> int:
    """Bytes of `tree`'s shards on the first device of their mesh."""
    import jax

    total = 0
    for a in jax.tree.leaves(tree):
        if hasattr(a, "addressable_shards"):
            first = a.sharding.mesh.devices.flat[0]
            shards = [s for s in a.addressable_shards if s.device == first]
            total += shards[0].data.nbytes if shards else 0
    return total


if __name__ == "__main__":
    main()
