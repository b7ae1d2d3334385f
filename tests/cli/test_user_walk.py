"""The path a user walks, as they type it: their HF LLaVA-OV checkpoint and LLaVA JSON data, ONE run
config, then `profile data` -> `profile model` -> `plan` -> `train` (on 1 and on 4 simulated CPU
devices) -> `export`, each a subprocess; transformers loads the export and its logits equal ours.

Each step reads what the one before wrote in the run directory (the plan records both files by
hash); a plan made for 4 devices is refused, in one line, by a 1-device run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from models_fixtures import save_tiny_llava_ov

from dflop_jax.data.tokenizer import ASSET

pytestmark = [pytest.mark.slow, pytest.mark.hf]
ROOT = Path(__file__).resolve().parents[2]
NUM_RECORDS = 20


def write_checkpoint(hf_dir: Path) -> Path:
    """A tiny random LLaVA-OV in HF format with the bundled byte tokenizer (its <image>/<video> ids
    are the model's image/video tokens), as `save_pretrained` writes them."""
    import transformers

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(ASSET), bos_token="<|begin_of_text|>", eos_token="<|endoftext|>"
    )
    image, video = tok.convert_tokens_to_ids(["<image>", "<video>"])
    save_tiny_llava_ov(hf_dir, image_token=image, video_token=video, vocab_size=384)
    tok.save_pretrained(hf_dir)
    return hf_dir


def write_records(data_dir: Path) -> Path:
    """`NUM_RECORDS` LLaVA JSON records: single images, image pairs and text, with real JPEG files of
    several sizes and aspect ratios."""
    from PIL import Image

    rng = np.random.default_rng(0)
    (data_dir / "images").mkdir(parents=True)
    records = []
    for i in range(NUM_RECORDS):
        kind = ("single", "pair", "text")[i % 3]
        if kind == "text":
            records.append({"id": f"t{i}", "text": f"Plain text record {i} " * (1 + i % 4)})
            continue
        names = []
        for j in range(1 if kind == "single" else 2):
            h, w = (int(v) for v in rng.integers(20, 90, 2))
            name = f"img{i}_{j}.jpg"
            pixels = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(data_dir / "images" / name)
            names.append(name)
        question = "<image>\n" * len(names) + f"What is in picture {i}?"
        records.append({
            "id": f"r{i}", "image": names[0] if len(names) == 1 else names,
            "conversations": [{"from": "human", "value": question},
                              {"from": "gpt", "value": f"Noise, mostly {'red' if i % 2 else 'blue'}."}],
        })  # fmt: skip
    path = data_dir / "records.json"
    path.write_text(json.dumps(records))
    return path


def write_run_config(path: Path, hf_dir: Path, records: Path) -> Path:
    """The user's one config file: model, data, device, profile grid, planner, training."""
    config = {
        "model": {"hf_dir": str(hf_dir)},
        "data": {"source": str(records), "image_root": str(records.parent / "images"),
                 "tile_size": 28, "patch_size": 7, "max_grid": 2, "max_tokens": 512,
                 "cache_dir": ""},
        "device": "cpu",
        "plan": "auto",  # train is given the plan.yaml `plan` writes
        "profile": {"data_samples": NUM_RECORDS, "tps": [1], "encoder_buckets": [8],
                    "llm_buckets": [512], "warmup": 0, "runs": 1},
        "planner": {"tp": [1], "microbatches": [2], "num_buckets": [1], "samples": 1,
                    "screen_top": 2, "top_n": 1},
        "global_batch": 4,
        "steps": 3,
        "compute_dtype": "float32",
        "compilation_cache": "",
        "optimizer": {"lr": 0.01, "warmup_steps": 1, "decay_steps": 3},
        "checkpoint": {"every": 3},
    }  # fmt: skip
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def dflop(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    """`python -m dflop_jax.<argv>` as a user types it, in `cwd`."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", *argv], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=1200)  # fmt: skip


def ok(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0, f"{out.args}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.mark.seconds(75)
def test_hf_model_on_llava_json_from_profile_to_export(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from models_fixtures import assert_llava_ov_logits_equal

    from dflop_jax.planner import load_plan
    from models.hf import load_pretrained

    hf_dir = write_checkpoint(tmp_path / "llava-ov-tiny")
    config = write_run_config(tmp_path / "run.yaml", hf_dir, write_records(tmp_path / "data"))
    for n in (1, 4):
        run = [f"num_devices={n}", f"run_dir=runs/{n}"]
        ok(dflop(tmp_path, "dflop_jax.profile", "data", "--config", str(config), *run))
        ok(
            dflop(
                tmp_path,
                "dflop_jax.profile",
                "model",
                "--config",
                str(config),
                "--no-progress",
                *run,
            )
        )
        ok(dflop(tmp_path, "dflop_jax.plan", "--config", str(config), "--no-progress", *run))
        plan_path = tmp_path / "runs" / str(n) / "plan.yaml"
        plan = load_plan(plan_path)
        assert plan.num_devices == n
        read = tmp_path / "runs" / str(n) / "auto_plan"
        assert plan.inputs["shapes"]["path"] == str(
            (read / "data" / "shape_distribution.json").resolve()
        )
        assert plan.inputs["cost_table"]["path"] == str((read / "cost_table.json").resolve())
        assert "measured" in plan.cost_provider
        ok(dflop(tmp_path, "dflop_jax.train", "--config", str(config), *run, f"plan={plan_path}"))
        assert (tmp_path / "runs" / str(n) / "checkpoints").is_dir()

    # A plan made for 4 devices is refused by a 1-device run, in one line, before training.
    out = dflop(tmp_path, "dflop_jax.train", "--config", str(config), "num_devices=1",
                "run_dir=runs/other", "plan=runs/4/plan.yaml")  # fmt: skip
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()[-1:]
    assert line.startswith("config error: plan=runs/4/plan.yaml was made for 4 devices"), out.stderr

    ok(dflop(tmp_path, "dflop_jax.export", "run=runs/4", "out=export"))
    export = tmp_path / "export"
    ours, model_cfg = load_pretrained(export)
    assert_llava_ov_logits_equal(export, ours, model_cfg)
    # Training moved the weights the user started from.
    before = transformers.LlavaOnevisionForConditionalGeneration.from_pretrained(hf_dir)
    after = transformers.LlavaOnevisionForConditionalGeneration.from_pretrained(export)
    head = "lm_head.weight"
    assert not np.allclose(before.state_dict()[head].numpy(), after.state_dict()[head].numpy())
