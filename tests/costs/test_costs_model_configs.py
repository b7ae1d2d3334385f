"""The cost presets agree with the runtime's model presets (models/), via the duck-typed converters."""

import pytest

from dflop_jax.costs import (
    LLM_PRESETS,
    arch_from_configs,
    get_arch,
    get_vision,
    llm_arch_from_config,
    param_count,
    vision_arch_from_config,
    vision_flops_per_tile,
)

decoder_config = pytest.importorskip("models.decoder_config")
siglip = pytest.importorskip("models.siglip")
internvit = pytest.importorskip("models.internvit")


@pytest.mark.parametrize("name", [n for n in LLM_PRESETS if n != "tiny"])
def test_llm_presets_match_models(name):
    cfg = decoder_config.DECODER_PRESETS[name]
    assert param_count(llm_arch_from_config(cfg)) == param_count(LLM_PRESETS[name])


def test_siglip_feature_tower_matches_preset():
    # LLaVA-OV reads hidden_states[-2] of the 27-layer model == the 26-layer preset's last layer output.
    cfg = siglip.feature_layer_config(siglip.SIGLIP_PRESETS["siglip-so400m"], -2)
    v = vision_arch_from_config(cfg, tokens_per_tile=729)
    assert v.num_layers == 26 and not v.pixel_shuffle
    assert param_count(v) == param_count(get_vision("siglip-so400m"))
    assert vision_flops_per_tile(v) == vision_flops_per_tile(get_vision("siglip-so400m"))


@pytest.mark.parametrize("name", ["internvit-300m", "internvit-6b"])
def test_internvit_presets_match_models(name):
    cfg = internvit.INTERNVIT_PRESETS[name]
    v = vision_arch_from_config(cfg, tokens_per_tile=256)
    assert v.pixel_shuffle and v.seq_len == 1025
    assert param_count(v) == param_count(get_vision(name))


def test_arch_from_configs_picks_projector():
    arch = arch_from_configs(
        internvit.INTERNVIT_PRESETS["internvit-300m"],
        decoder_config.DECODER_PRESETS["qwen2.5-7b"],
        256,
    )
    assert arch.projector == get_arch("internvit-300m+qwen2.5-7b").projector
