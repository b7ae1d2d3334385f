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
