"""Export a training run's checkpoint as an HF directory (config, weights, tokenizer, processor).

    python -m dflop_jax.export run=runs/demo out=runs/demo/hf            # the latest checkpoint
    python -m dflop_jax.export run=runs/demo step=8 out=/tmp/hf shard_gb=2

Any layout and process count that saved the checkpoint exports alike; transformers loads the result
(`AutoModelForCausalLM` for a decoder-only run, `LlavaOnevisionForConditionalGeneration` /
`InternVLForConditionalGeneration` for the multimodal ones). Runs on the host (no accelerator needed).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path

from dflop_jax.config import require
from dflop_jax.config.cli import Command, config_error, load_command_config

COMMAND = Command(
    prog="python -m dflop_jax.export",
    description=__doc__.split("\n")[0],
    example="python -m dflop_jax.export run=runs/demo out=runs/demo/hf",
)


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    """What to export and where.

    Attributes:
      run: the training run's directory (config.yaml, checkpoints/).
      out: the HF directory to write.
      step: the checkpoint step; 0 = the latest.
      shard_gb: largest safetensors shard, in GB.
    """

    run: str = ""
    out: str = ""
    step: int = 0
    shard_gb: float = 4.0

    def __post_init__(self):
        require(bool(self.run), "run", self.run, "give the run directory, e.g. run=runs/demo")
        require(bool(self.out), "out", self.out, "give the HF directory to write, e.g. out=/tmp/hf")
        require(self.step >= 0, "step", self.step, "0 (the latest) or a saved step")
        require(self.shard_gb > 0, "shard_gb", self.shard_gb, "must be > 0")


def main(argv: list[str] | None = None) -> int:
    args = COMMAND.parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on metadata it can do without
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # tensors pass through the host only

    from dflop_jax.config import ConfigError
    from dflop_jax.resolve import RunContext
    from dflop_jax.runtime.hf_export import ExportError, export_run, run_config
    from models.hf import CheckpointError

    try:
        cfg = load_command_config(ExportConfig, args)
        # the run resolved as every command resolves it; its plan is not needed (nor read)
        ctx = RunContext.build(run_config(Path(cfg.run)), read_plan=False)
        report = export_run(ctx.cfg, ctx.model_cfg, cfg.run, cfg.out, step=cfg.step or None,
                            max_shard_bytes=int(cfg.shard_gb * 1e9))  # fmt: skip
    except ConfigError as e:
        return config_error(e)
    except (ExportError, CheckpointError) as e:
        print(f"export error: {e}", file=sys.stderr)
        return 2
    copied = f", {report.copied} copied unchanged from model.hf_dir" if report.copied else ""
    print(f"exported step {report.step}: {report.tensors} tensors{copied}, "
          f"{report.bytes / 1e9:.3f} GB -> {cfg.out} ({len(report.files)} files)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
