"""uint8 tiles are normalized inside the first encoder stage: the same hidden states as the float path
with the HF processors' host normalization, per vision family, and the data's (mean, std) reach it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflop_jax.data.config import DataConfig
from dflop_jax.programs.model_section import ModelConfig
from models.internvit import InternViTConfig
from models.siglip import SiglipConfig
from models.vit import VisionStage, normalize_pixels

SMALL = dict(
    hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, image_size=28, patch_size=7
)


def _host_normalized(tiles: np.ndarray, mean, std) -> np.ndarray:
    """The HF image processors' rescale + normalize, in float64 (an independent reference)."""
    x = tiles.astype(np.float64) / 255.0
    return ((x - np.asarray(mean, np.float64)) / np.asarray(std, np.float64)).astype(np.float32)


def _tiles(n=3, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 28, 28, 3), dtype=np.uint8)


@pytest.mark.parametrize(
    "cfg, mean, std",
    [
        (SiglipConfig(**SMALL), (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
        (InternViTConfig(**SMALL), (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    ],
    ids=["siglip", "internvit"],
)
def test_uint8_tiles_through_the_first_stage_equal_the_host_normalized_float_path(cfg, mean, std):
    # the family's numbers are exactly the data layer's (what the HF processors use)
    family = "llava_ov" if isinstance(cfg, SiglipConfig) else "internvl"
    data = DataConfig(model_family=family)
    assert (cfg.pixel_mean, cfg.pixel_std) == (data.mean, data.std) == (mean, std)
    stage = VisionStage(cfg, first_layer=0, num_layers=1, has_embedding=True, has_head=False,
                        rngs=nnx.Rngs(0))  # fmt: skip
    tiles = _tiles()
    on_device = stage(jnp.asarray(tiles))  # uint8 in: normalized inside the stage
    float_path = stage(jnp.asarray(_host_normalized(tiles, mean, std)))  # float in: unchanged
    np.testing.assert_allclose(np.asarray(on_device), np.asarray(float_path), rtol=1e-5, atol=1e-5)
    # a wrong normalization is far outside that tolerance
    wrong = stage(jnp.asarray(_host_normalized(tiles, (0.5,) * 3, (0.25,) * 3)))
    assert np.abs(np.asarray(on_device) - np.asarray(wrong)).max() > 1e-2


def test_normalize_pixels_matches_the_host_reference_and_passes_floats():
    tiles, mean, std = _tiles(), (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    got = normalize_pixels(jnp.asarray(tiles), mean, std)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), _host_normalized(tiles, mean, std), atol=1e-6)
    x = jnp.asarray(_host_normalized(tiles, mean, std))
    assert normalize_pixels(x, mean, std) is x


def test_the_data_pixel_norm_reaches_the_model_config():
    model = ModelConfig(kind="internvl", num_layers=1, hidden_size=32, intermediate_size=64,
                        num_heads=2, num_kv_heads=1, head_dim=16, vision_num_layers=1,
                        vision_hidden_size=16, vision_intermediate_size=32, vision_num_heads=2)  # fmt: skip
    kw = dict(tile_px=28, patch_size=14, compute_dtype="float32")
    assert model.model_config(300, **kw).vision.pixel_mean == (0.485, 0.456, 0.406)
    norm = ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    vision = model.model_config(300, **kw, pixel_norm=norm).vision
    assert (vision.pixel_mean, vision.pixel_std) == norm


def test_a_bad_pixel_norm_is_refused():
    with pytest.raises(ValueError, match="pixel_std"):
        SiglipConfig(**SMALL, pixel_std=(0.5, 0.0, 0.5))
    with pytest.raises(ValueError, match="pixel_mean"):
        SiglipConfig(**SMALL, pixel_mean=(0.5, 0.5))
