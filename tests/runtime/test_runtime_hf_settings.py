"""An HF model directory brings its data settings: `model.hf_dir`'s tokenizer, chat template, tile
size and pixel mean/std fill the data keys left at auto; a value the user sets wins; a tile size the
vision tower cannot take is one config error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from models_fixtures import save_tiny_llava_ov

from dflop_jax.config import ConfigError, load_config
from dflop_jax.data.chat import ChatTemplate
from dflop_jax.data.tokenizer import ASSET, load_tokenizer
from dflop_jax.runtime.config import TrainConfig

pytestmark = pytest.mark.hf
MEAN, STD = (0.1, 0.2, 0.3), (0.4, 0.5, 0.6)
TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny LLaVA-OV (28 px tiles) with a tokenizer carrying a chat template and an image processor
    with non-default mean/std, each written by transformers' `save_pretrained`."""
    import transformers

    path = save_tiny_llava_ov(tmp_path_factory.mktemp("hf") / "model")
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(ASSET), bos_token="<|begin_of_text|>", eos_token="<|endoftext|>"
    )
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    proc = transformers.LlavaOnevisionImageProcessor(
        size={"height": 28, "width": 28},
        image_mean=list(MEAN),
        image_std=list(STD),
        image_grid_pinpoints=[[28, 28], [28, 84], [84, 56]],
    )
    proc.save_pretrained(path)
    return path


def _load(*overrides: str) -> TrainConfig:
    return load_config(TrainConfig, None, ["data.synth_samples=4", *overrides])


def test_auto_keys_take_the_directory_settings(hf_dir):
    cfg = _load(f"model.hf_dir={hf_dir}")
    assert cfg.data.tokenizer == str(hf_dir)
    assert cfg.data.chat_template == "from_tokenizer"
    assert (cfg.data.tile_px, cfg.data.mean, cfg.data.std) == (28, MEAN, STD)
    assert cfg.data.anyres_grid == 3  # the largest pinpoint side, 84 px, over 28 px tiles
    tok = load_tokenizer(cfg.data.tokenizer)
    rendered = ChatTemplate.for_config(cfg.data.chat_template, tok).render(
        [{"role": "user", "content": "hi"}]
    )
    assert rendered == "<<user>>hi"


def test_a_value_the_user_sets_wins(hf_dir):
    cfg = _load(
        f"model.hf_dir={hf_dir}",
        "data.chat_template=llama3",
        "data.pixel_mean=[0.5,0.5,0.5]",
        "data.pixel_std=[0.25,0.25,0.25]",
        "data.max_grid=2",
    )
    assert cfg.data.chat_template == "llama3"
    assert (cfg.data.mean, cfg.data.std) == ((0.5,) * 3, (0.25,) * 3)
    assert cfg.data.anyres_grid == 2
    assert cfg.data.tokenizer == str(hf_dir)  # the keys not set still come from the directory


def test_a_tile_size_the_vision_tower_cannot_take_is_a_config_error(hf_dir):
    with pytest.raises(ConfigError, match=r"data\.tile_size.*built for 28 px"):
        _load(f"model.hf_dir={hf_dir}", "data.tile_size=56")


def test_missing_files_keep_todays_defaults(hf_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((hf_dir / "config.json").read_text())
    cfg = _load(f"model.hf_dir={bare}")
    assert (cfg.data.tokenizer, cfg.data.chat_template) == ("bundled", "auto")
    assert cfg.data.tile_px == 28  # the vision tower's image_size
    assert (cfg.data.mean, cfg.data.std) == ((0.5,) * 3, (0.5,) * 3)  # SigLIP's
    assert cfg.data.anyres_grid == 6


def test_without_hf_dir_auto_is_todays_default():
    cfg = _load()
    assert (cfg.data.tokenizer, cfg.data.tile_px, cfg.data.anyres_grid) == ("bundled", 384, 6)
    assert (
        ChatTemplate.for_config("auto", load_tokenizer("bundled"))._source
        == ChatTemplate.for_config("qwen2.5", load_tokenizer("bundled"))._source
    )


def test_a_non_square_processor_size_is_one_error(hf_dir, tmp_path):
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text((hf_dir / "config.json").read_text())
    (odd / "preprocessor_config.json").write_text(json.dumps({"size": {"height": 28, "width": 56}}))
    with pytest.raises(ConfigError, match="not square"):
        _load(f"model.hf_dir={odd}")


def test_internvl_max_dynamic_patch_sets_max_tiles(tmp_path):
    hf = tmp_path / "internvl"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"max_dynamic_patch": 6, "force_image_size": 448}))
    over = ["model.kind=internvl", "data.model_family=internvl", f"model.hf_dir={hf}"]
    cfg = _load(*over)
    assert (cfg.data.dynamic_max_tiles, cfg.data.tile_px) == (6, 448)
    assert _load(*over, "data.max_tiles=2").data.dynamic_max_tiles == 2
