"""The training config's model section: keys that reach the `models` config."""

import pytest

from dflop_jax.config import ConfigError, from_dict
from dflop_jax.runtime.config import ModelConfig, TrainConfig


@pytest.mark.parametrize("kind", ["llava_ov", "internvl", "decoder"])
def test_attention_impl_reaches_every_attention_layer(kind):
    cfg = ModelConfig(kind=kind, attention_impl="cudnn")
    model_cfg = cfg.model_config(100, tile_px=56, patch_size=14, compute_dtype="float32")
    text = model_cfg if kind == "decoder" else model_cfg.text
    assert text.attention_impl == "cudnn"
    if kind != "decoder":
        assert model_cfg.vision.attention_impl == "cudnn"


@pytest.mark.parametrize("source", ["built", "arch"])
def test_vision_attention_impl_sets_the_vision_tower_alone(source):
    """The vision tower's kernel where it differs from the decoder's (cuDNN refuses SigLIP tiles)."""
    keys = {"arch": "siglip-so400m+qwen2.5-7b"} if source == "arch" else {}
    cfg = ModelConfig(**keys, attention_impl="cudnn", vision_attention_impl="pallas")
    model_cfg = cfg.model_config(100, tile_px=56, patch_size=14, compute_dtype="float32")
    assert (model_cfg.text.attention_impl, model_cfg.vision.attention_impl) == ("cudnn", "pallas")


def test_a_bad_vision_attention_impl_is_one_config_error():
    with pytest.raises(ConfigError, match=r"^model.vision_attention_impl='flash': use one of"):
        from_dict(TrainConfig, {"model": {"vision_attention_impl": "flash"}})


def test_a_bad_attention_impl_is_one_config_error():
    with pytest.raises(ConfigError, match=r"^model.attention_impl='flash': use one of \['xla'"):
        from_dict(TrainConfig, {"model": {"attention_impl": "flash"}})


def test_an_hf_dir_brings_its_tokenizer_unless_another_is_given(tmp_path):
    import shutil

    from dflop_jax.data.tokenizer import ASSET

    hf, other = tmp_path / "hf", tmp_path / "tok"
    for d in (hf, other):
        d.mkdir()
        shutil.copy(ASSET, d / "tokenizer.json")
    (hf / "config.json").write_text("{}")
    cfg = from_dict(TrainConfig, {"model": {"hf_dir": str(hf)}})
    assert cfg.data.tokenizer == str(hf)
    given = from_dict(
        TrainConfig, {"model": {"hf_dir": str(hf)}, "data": {"tokenizer": str(other)}}
    )
    assert given.data.tokenizer == str(other)
    (hf / "tokenizer.json").unlink()  # a weights-only directory: the bundled tokenizer stays
    assert from_dict(TrainConfig, {"model": {"hf_dir": str(hf)}}).data.tokenizer == "bundled"


def test_an_arch_section_records_the_architectures_sizes():
    """run_dir/config.yaml's model section (`with_sizes_of`) says the named architecture's sizes;
    a section built from its fields is already what it builds."""
    from dflop_jax.costs import get_arch

    cfg = ModelConfig(arch="siglip-so400m+qwen2.5-7b")
    model_cfg = cfg.model_config(100, tile_px=384, patch_size=14, compute_dtype="float32")
    recorded, arch = cfg.with_sizes_of(model_cfg), get_arch(cfg.arch)
    assert (recorded.hidden_size, recorded.num_layers, recorded.num_kv_heads) == (
        arch.llm.hidden_size, arch.llm.num_layers, arch.llm.num_kv_heads
    )  # fmt: skip
    assert (recorded.vision_hidden_size, recorded.vision_num_layers) == (
        arch.vision.hidden_size, arch.vision.num_layers
    )  # fmt: skip
    assert recorded.vocab_size == arch.llm.vocab_size and recorded.hidden_size != cfg.hidden_size
    assert (
        recorded.model_config(100, tile_px=384, patch_size=14, compute_dtype="float32") == model_cfg
    )
    built = ModelConfig(kind="decoder")
    assert built.with_sizes_of(built.model_config(100, tile_px=56, patch_size=14,
                                                  compute_dtype="float32")) is built  # fmt: skip
