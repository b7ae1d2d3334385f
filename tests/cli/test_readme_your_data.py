"""README "Your model on your data": its example records and mix are real, and every kind decodes."""

import json
import re
from pathlib import Path

import yaml

from dflop_jax.config import load_config
from dflop_jax.data import Processor, load_source
from dflop_jax.runtime.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "your_data"


def _section() -> str:
    text = (REPO / "README.md").read_text()
    return text.split("## Your model on your data", 1)[1].split("\n## ", 1)[0]


def test_the_readme_shows_the_shipped_records_and_mix():
    blocks = re.findall(r"```(json|yaml)\n(.*?)```", _section(), re.S)
    shown = {lang: [body for lang_, body in blocks if lang_ == lang] for lang in ("json", "yaml")}
    assert json.loads(shown["json"][0]) == json.loads((EXAMPLE / "records.json").read_text())
    assert yaml.safe_load(shown["yaml"][0]) == yaml.safe_load((EXAMPLE / "mix.yaml").read_text())


def test_every_record_of_the_example_decodes_with_the_demo_model():
    command = re.search(r"python -m dflop_jax.train (.*?)\n```", _section(), re.S).group(1)
    overrides = command.replace("\\\n", " ").split()
    cfg = load_config(TrainConfig, REPO / "configs" / "demo.yaml", overrides)
    records = load_source(cfg.data, cfg.seed)
    assert [r["id"] for r in records] == ["single-1", "multi-1", "video-1", "text-1"]
    processor = Processor(cfg.data)
    samples = [processor.process(r) for r in records]  # BadSample on any missing or bad file
    tiles = [processor.shape(r).tiles for r in records]
    assert tiles[0] >= 1 and tiles[1] >= 2 and tiles[2] >= 4 and tiles[3] == 0  # 4 video frames
    assert [s.modality for s in samples] == ["image", "multi_image", "video", "text"]
    assert all(s.assistant_mask.any() for s in samples)  # every record has tokens to learn
