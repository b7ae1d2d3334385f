"""InternVL vs HF `InternVLForConditionalGeneration` (tiny random model, float32): a dynamic-tiled image."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

pytestmark = pytest.mark.hf
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from models import layouts  # noqa: E402
from models.hf import load_pretrained  # noqa: E402

TOL = 1e-4
IMG = 90


def test_internvl_logits_match_hf(tmp_path):
    from transformers.models.internvl.configuration_internvl import InternVLVisionConfig

    vision = InternVLVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=28,
        patch_size=7,
    )
    text = transformers.Qwen2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    cfg = transformers.InternVLConfig(
        vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_id=IMG
    )
    torch.manual_seed(0)
    ref = transformers.InternVLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # constant-initialized layer scales / cls / positions: randomize
        for p in ref.model.vision_tower.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ref.save_pretrained(tmp_path)
    model, ours = load_pretrained(tmp_path)
    assert ours.tokens_per_tile == 4  # 4x4 patches, pixel shuffle 0.5
    layout = layouts.internvl_image_layout((60, 130), tile_size=28, max_tiles=6, tokens_per_tile=4)
    assert layout.num_tiles == 1 + np.prod(
        layouts.internvl_grid((60, 130), tile_size=28, max_tiles=6)
    )
    px = np.random.default_rng(0).standard_normal((layout.num_tiles, 3, 28, 28)).astype(np.float32)
    tokens = np.array([[1, 2] + [IMG] * layout.num_tokens + [3, 4, 5]], np.int32)
    with torch.no_grad():
        want = ref(
            input_ids=torch.from_numpy(tokens).long(), pixel_values=torch.from_numpy(px)
        ).logits.numpy()
    fidx = np.concatenate([[layouts.TEXT] * 2, layout.offset(0), [layouts.TEXT] * 3])[None].astype(
        np.int32
    )
    s = tokens.shape[1]
    got = nnx.jit(lambda m, *a: m(*a))(
        model,
        jnp.asarray(px.transpose(0, 2, 3, 1)),
        jnp.zeros(layout.num_tiles, bool),
        jnp.asarray(tokens),
        jnp.ones((1, s), jnp.int32),
        jnp.arange(s, dtype=jnp.int32)[None],
        jnp.asarray(fidx),
    )
    np.testing.assert_allclose(np.asarray(got), want, atol=TOL)
