"""Parameter counts of the presets against HF transformers models built on the meta device (no weights)."""

import pytest

from dflop_jax.costs import LLM_PRESETS, get_arch, get_vision, param_count

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["siglip-so400m", "siglip-1b", "siglip-6b"])
def test_siglip_towers_as_llava_onevision_uses_them(name):
    v = get_vision(name)
    cfg = transformers.SiglipVisionConfig(
        hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, patch_size=v.patch_size,
        image_size=v.image_size, num_hidden_layers=v.num_layers, num_attention_heads=v.num_heads,
        vision_use_head=False,
    )  # fmt: skip
    with torch.device("meta"):
        hf = _count(transformers.SiglipVisionModel(cfg))
    # HF also builds post_layernorm (2 * D), which LLaVA-OV's feature layer -1 never uses.
    assert param_count(v) + 2 * v.hidden_size == hf


@pytest.mark.parametrize(
    "name", ["internvit-300m", "internvit-1b", "internvit-6b", "internvit-6b-dflop"]
)
def test_internvit_towers(name):
    v = get_vision(name)
    cfg = transformers.InternVLVisionConfig(
        hidden_size=v.hidden_size, num_hidden_layers=v.num_layers, num_attention_heads=v.num_heads,
        intermediate_size=v.intermediate_size, use_qk_norm=v.qk_norm, norm_type=v.norm,
        attention_bias=v.qkv_bias, image_size=v.image_size, patch_size=v.patch_size,
    )  # fmt: skip
    with torch.device("meta"):
        assert param_count(v) == _count(transformers.InternVLVisionModel(cfg))


@pytest.mark.parametrize("name", [n for n in LLM_PRESETS if n != "tiny"])
def test_llm_presets(name):
    m = LLM_PRESETS[name]
    qwen = name.startswith("qwen")
    cfg_cls = transformers.Qwen2Config if qwen else transformers.LlamaConfig
    cfg = cfg_cls(
        hidden_size=m.hidden_size, num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads, intermediate_size=m.intermediate_size,
        vocab_size=m.vocab_size, tie_word_embeddings=m.tie_embeddings,
    )  # fmt: skip
    model_cls = transformers.Qwen2ForCausalLM if qwen else transformers.LlamaForCausalLM
    with torch.device("meta"):
        assert param_count(m) == _count(model_cls(cfg))


@pytest.mark.parametrize("name", ["siglip-so400m+qwen2.5-7b", "internvit-300m+qwen2.5-0.5b"])
def test_projectors(name):
    from transformers.models.internvl.modeling_internvl import InternVLMultiModalProjector
    from transformers.models.llava_onevision.modeling_llava_onevision import (
        LlavaOnevisionMultiModalProjector,
    )

    arch = get_arch(name)
    vision = {"hidden_size": arch.vision.hidden_size}
    text = {"hidden_size": arch.llm.hidden_size}
    with torch.device("meta"):
        if arch.projector.kind == "mlp2x_gelu":
            cfg = transformers.LlavaOnevisionConfig(vision_config=vision, text_config=text)
            hf = LlavaOnevisionMultiModalProjector(cfg)
        else:
            cfg = transformers.InternVLConfig(vision_config=vision, text_config=text)
            hf = InternVLMultiModalProjector(cfg)
    assert param_count(arch.projector) == _count(hf)
