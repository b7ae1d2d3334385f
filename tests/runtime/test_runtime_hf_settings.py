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
    transformers = pytest.importorskip("transformers")

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


def test_the_run_config_records_the_hf_model_and_loads_back_to_it(hf_dir, tmp_path):
    """run_dir/config.yaml holds the sizes of the model trained (config.json's), not the section's
    defaults, keeps hf_dir, and reads back (resume, export) to the same model."""
    import yaml

    from dflop_jax.resolve import RunContext
    from dflop_jax.runtime.hf_export import run_config, with_token_ids
    from dflop_jax.runtime.trainer import prepare_run_dir

    def model_config_of(cfg):  # as `python -m dflop_jax.export` resolves the run
        return with_token_ids(RunContext.build(cfg, read_plan=False).model_cfg, cfg)

    cfg = _load(f"model.hf_dir={hf_dir}", f"run_dir={tmp_path / 'run'}", "compilation_cache=")
    prepare_run_dir(cfg, model_config_of(cfg))
    written = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]
    hf = json.loads((hf_dir / "config.json").read_text())
    text, vision = hf["text_config"], hf["vision_config"]
    assert written["hf_dir"] == str(hf_dir) and written["kind"] == "llava_ov"
    want = {
        "vocab_size": text["vocab_size"], "hidden_size": text["hidden_size"],
        "intermediate_size": text["intermediate_size"], "num_layers": text["num_hidden_layers"],
        "num_heads": text["num_attention_heads"], "num_kv_heads": text["num_key_value_heads"],
        "head_dim": text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"],
        "vision_hidden_size": vision["hidden_size"],
        "vision_intermediate_size": vision["intermediate_size"],
        "vision_num_layers": vision["num_hidden_layers"],
        "vision_num_heads": vision["num_attention_heads"],
    }  # fmt: skip
    assert {k: written[k] for k in want} == want
    again = run_config(tmp_path / "run")  # validated as `python -m dflop_jax.export` reads it
    assert again.model.hf_dir == str(hf_dir)
    assert model_config_of(again) == model_config_of(cfg)
    resumed = load_config(TrainConfig, tmp_path / "run" / "config.yaml")  # --config run/config.yaml
    assert resumed.model == again.model and resumed.data == cfg.data
