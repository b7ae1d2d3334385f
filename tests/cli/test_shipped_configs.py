"""The shipped training configs of real models: what each resolves to, and the 64-GPU dry run."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from multiprocess_launch import own_devices_env

from dflop_jax.config import load_config
from dflop_jax.runtime.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]
# config stem -> (kind, decoder hidden size, decoder layers, vision layers)
SHIPPED = {
    "llava_ov_0.5b": ("llava_ov", 896, 24, 26),
    "llava_ov_7b": ("llava_ov", 3584, 28, 26),
    "internvl_8b": ("internvl", 3584, 28, 24),
}
CASES = [(stem, n) for stem in SHIPPED for n in (8, 64)]


@pytest.mark.parametrize("stem, n", CASES, ids=[f"{s}_h100x{n}" for s, n in CASES])
def test_each_shipped_config_is_its_model_on_its_devices(stem, n):
    cfg = load_config(TrainConfig, REPO / "configs" / f"{stem}_h100x{n}.yaml")
    kind, hidden, layers, vision_layers = SHIPPED[stem]
    assert (cfg.device.preset, cfg.num_devices, cfg.model.hf_dir) == ("h100", n, "")
    assert cfg.model.kind == cfg.data.model_family == kind
    model_cfg = cfg.model.model_config(0, tile_px=cfg.data.tile_px, patch_size=14,
                                       compute_dtype=cfg.compute_dtype)  # fmt: skip
    assert (model_cfg.text.hidden_size, model_cfg.text.num_layers) == (hidden, layers)
    assert model_cfg.vision.num_layers == vision_layers
    assert model_cfg.vision.image_size == cfg.data.tile_px
    assert cfg.model.attention_impl == "auto"  # resolved per device: the model carries the result
    assert (model_cfg.vision.attention_impl, model_cfg.text.attention_impl) == (
        cfg.model.attention_kernels()
    )


# 64 simulated devices compiling a 7B model's stages at real sizes, at every bucket for the FLOPs: 12
# minutes on 2 cores at load 5 (2 stages; 33 minutes for an earlier 4-stage plan), so in the third
# tier (`long`, by hand).
@pytest.mark.slow
@pytest.mark.long
def test_the_7b_64_gpu_config_dry_runs_on_cpu(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "dflop_jax.train", "--config", "configs/llava_ov_7b_h100x64.yaml",
         "--dry-run", f"run_dir={tmp_path}", f"data.synth_dir={tmp_path / 'synth'}",
         "data.synth_samples=64", "compilation_cache="],
        capture_output=True, text=True, cwd=REPO, timeout=3600, env=own_devices_env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    stages = yaml.safe_load((tmp_path / "dry_run.yaml").read_text())["layout"]
    plan = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    assert plan["num_devices"] == 64 and plan["device"] == "h100"
    assert len(stages) == len(plan["layout"]) >= 2  # every stage of the plan compiled
    for s in stages:  # compiled at real sizes: a 7B model's stage holds GiBs
        assert s["compiled_memory_gib"] > 1 and s["compile_s"] > 0


# --- configs/llava_ov_7b_1gpu.yaml: LLaVA-OV-7B's real layers on one 80 GB GPU -------------------

ONE_GPU = REPO / "configs" / "llava_ov_7b_1gpu.yaml"
KEPT = 5  # the decoder layers the memory model fits on one H100 with the config's data and batch


def test_the_1gpu_config_is_the_real_tower_and_the_first_decoder_layers():
    cfg = load_config(TrainConfig, ONE_GPU)
    assert (cfg.model.arch, cfg.model.llm_layers_kept, cfg.model.hf_dir) == (
        "siglip-so400m+qwen2.5-7b", KEPT, "")  # fmt: skip
    assert cfg.plan == "auto" and cfg.model.attention_impl == "auto"
    assert (cfg.data.source, cfg.data.synth_mix, cfg.data.tile_px) == ("synthetic", "llava-ov", 384)
    assert cfg.optimizer.trainable == ("vision", "projector", "llm")  # every part: 16 B/param
    model_cfg = cfg.model.model_config(0, tile_px=cfg.data.tile_px, patch_size=14,
                                       compute_dtype=cfg.compute_dtype)  # fmt: skip
    assert (model_cfg.text.num_layers, model_cfg.vision.num_layers) == (KEPT, 26)
    assert (model_cfg.text.hidden_size, model_cfg.vision.image_size) == (3584, 384)


@pytest.mark.parametrize("layers, fits", [(KEPT, True), (KEPT + 1, False)])
def test_the_1gpu_config_keeps_as_many_decoder_layers_as_fit_an_h100(tmp_path, layers, fits):
    """The analytic planner on one H100 (80 GB, 10% kept free), the LLaVA-OV shape mix: the config's
    cut fits, one more decoder layer does not."""
    from dflop_jax.config import ConfigError
    from dflop_jax.planner.explain import PlanningError
    from dflop_jax.resolve import RunContext
    from dflop_jax.resolve.plan_sources import plan_from_run_dir

    cfg = load_config(TrainConfig, ONE_GPU, [f"model.llm_layers_kept={layers}", "device=h100",
                                             "num_devices=1", "profile.data_source=llava-ov",
                                             "profile.data_samples=500", f"run_dir={tmp_path}"])  # fmt: skip
    ctx = RunContext.build(cfg)
    if not fits:
        with pytest.raises((PlanningError, ConfigError), match="no layout fits in memory"):
            plan_from_run_dir(ctx)
        return
    plan = plan_from_run_dir(ctx)
    assert plan.layout.num_stages == 1 and plan.layout.llm_stages[0].num_layers == KEPT
    assert max(plan.stage_memory_bytes) <= plan.memory_capacity_bytes


# A 7B-wide stage (the SigLIP tower + 5 decoder layers) compiled at real sizes on CPU: about a minute
# on 2 cores, so in the third tier with the 64-GPU dry run.
@pytest.mark.slow
@pytest.mark.long
def test_the_1gpu_config_dry_runs_on_cpu_with_the_analytic_planner(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "dflop_jax.train", "--config", str(ONE_GPU), "--dry-run",
         "device=h100", "num_devices=1", f"run_dir={tmp_path}",
         f"data.synth_dir={tmp_path / 'synth'}", "compilation_cache="],
        capture_output=True, text=True, cwd=REPO, timeout=3600, env=own_devices_env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    # plan: auto needs a GPU to profile on: the dry run says it plans analytically instead
    assert "plans with the analytic costs (plan=analytic)" in out.stdout
    report = yaml.safe_load((tmp_path / "dry_run.yaml").read_text())
    assert "analytic" in report["plan_note"]
    (stage,) = report["layout"]  # one device: the encoder colocated in the one stage
    assert stage["compiled"]["parts"] == ["encoder+llm"]
    usable = 80e9 * 0.9 / 2**30  # the h100 preset less planner.memory_margin
    # the plan fits the margin; XLA:CPU's program holds more than an accelerator's (it computes the
    # bf16 activations in f32: docs/benchmarks.md), within the band below and the device's memory
    assert 40 < stage["memory_gib"] <= usable and 40 < stage["compiled_memory_gib"] <= 80e9 / 2**30
    assert stage["compiled_memory_gib"] == pytest.approx(stage["memory_gib"], rel=0.15)
