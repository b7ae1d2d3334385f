"""The demo's model trained 3 steps in float32 on an explicit 2 encoder + 2 LLM stage layout with the
Pallas attention kernels (interpret mode on CPU) gives the per-step losses of the XLA path to 1e-4
relative: the kernels' gradients are right inside the pipelined trainer (every stage's backward,
packed rows of several samples, the ViT's unmasked attention too)."""

from pathlib import Path

import numpy as np
import pytest

from dflop_jax.config import load_config
from dflop_jax.resolve import RunContext, resolve_plan
from dflop_jax.runtime.config import TrainConfig
from dflop_jax.runtime.trainer import prepare_run_dir, train
from models.stage_modules import with_attention

DEMO = Path(__file__).parents[2] / "configs" / "demo.yaml"
LAYOUT = ["plan=explicit", "layout.encoder_layers=[1, 1]", "layout.encoder_tp=[1]",
          "layout.encoder_dp=2", "layout.llm_layers=[2, 2]", "layout.llm_tp=[1]", "layout.llm_dp=2",
          "layout.tiles=[8]", "layout.lengths=[512]", "layout.microbatches=[2, 3]",
          "global_batch=8", "data.synth_samples=32", "data.max_tokens=512", "checkpoint.every=0",
          "compute_dtype=float32", "device.peak_flops=1000000000.0", "optimizer.warmup_steps=0",
          "log_every=1", "steps=3"]  # fmt: skip


def _losses(tmp_path, impl) -> list[float]:
    """The run `dflop_jax.train.run` makes, its model's attention `impl`."""
    over = [f"data.synth_dir={tmp_path / 'synth'}", f"run_dir={tmp_path / impl}",
            f"compilation_cache={tmp_path / 'jax_cache'}"]  # fmt: skip
    cfg = load_config(TrainConfig, DEMO, [*LAYOUT, *over])
    model_cfg = with_attention(cfg.model_config(), impl)
    assert model_cfg.text.attention_impl == model_cfg.vision.attention_impl == impl
    prepare_run_dir(cfg)
    ctx = RunContext.of(cfg, model_cfg)
    report = train(cfg, model_cfg, ctx.arch, ctx.device, resolve_plan(ctx))
    return report.losses


@pytest.mark.slow
@pytest.mark.seconds(43)
def test_demo_trains_alike_with_pallas_and_xla_attention(tmp_path):
    xla = _losses(tmp_path, "xla")
    pallas = _losses(tmp_path, "pallas")
    assert len(xla) == len(pallas) == 3
    np.testing.assert_allclose(pallas, xla, rtol=1e-4)
