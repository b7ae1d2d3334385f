"""Export a training run's checkpoint as an HF model directory (config.json, safetensors, tokenizer).

    python -m dflop_jax.export --run runs/demo --out runs/demo/hf            # the latest checkpoint
    python -m dflop_jax.export --run runs/demo --step 8 --out /tmp/hf --shard-gb 2

Any layout and process count that saved the checkpoint exports alike; transformers loads the result
(`AutoModelForCausalLM` for a decoder-only run, `LlavaOnevisionForConditionalGeneration` /
`InternVLForConditionalGeneration` for the multimodal ones). Runs on the host (no accelerator needed).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflop_jax.export", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--run", type=Path, required=True, help="run directory (config.yaml, checkpoints/)"
    )
    parser.add_argument("--out", type=Path, required=True, help="HF directory to write")
    parser.add_argument(
        "--step", type=int, default=None, help="checkpoint step (default: the latest)"
    )
    parser.add_argument(
        "--shard-gb", type=float, default=4.0, help="max safetensors shard size (GB)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on metadata it can do without
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # tensors pass through the host only

    from dflop_jax.config import ConfigError
    from dflop_jax.runtime.hf_export import ExportError, export_run
    from models.hf import CheckpointError

    try:
        report = export_run(
            args.run, args.out, step=args.step, max_shard_bytes=int(args.shard_gb * 1e9)
        )
    except (ExportError, ConfigError, CheckpointError) as e:
        print(f"export error: {e}", file=sys.stderr)
        return 2
    print(f"exported step {report.step}: {report.tensors} tensors, {report.bytes / 1e9:.3f} GB "
          f"-> {args.out} ({len(report.files)} files)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
