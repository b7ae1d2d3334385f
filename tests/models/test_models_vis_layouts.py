"""Feature layouts vs HF transformers' LLaVA-OneVision / InternVL processing and packing code."""

from __future__ import annotations

import functools
import math
import types

import numpy as np
import pytest

from models import layouts
from models.layouts import NEWLINE

SIZES = [
    (h, w)
    for h in (1, 37, 200, 384, 500, 767, 1000, 1500, 2304, 4000)
    for w in (1, 90, 384, 640, 1024, 3000)
]


def _hf_llava_ov_processor():
    proc_mod = pytest.importorskip("transformers.models.llava_onevision.processing_llava_onevision")
    cls = proc_mod.LlavaOnevisionProcessor
    fake = types.SimpleNamespace(
        image_processor=types.SimpleNamespace(
            image_grid_pinpoints=[list(p) for p in layouts.LLAVA_OV_PINPOINTS]
        ),
        num_image_tokens=729,
        vision_aspect_ratio="anyres_max_9",
    )
    fake._get_unpadded_features = functools.partial(cls._get_unpadded_features, fake)
    return functools.partial(cls._get_number_of_features, fake)


@pytest.mark.hf
def test_llava_ov_token_counts_match_hf_processor():
    count = _hf_llava_ov_processor()
    for hw in SIZES:
        layout = layouts.llava_ov_image_layout(hw)
        assert layout.num_tokens == count(hw[0], hw[1], 384, 384), hw
        rows, cols = layouts.llava_ov_grid(hw)
        assert layout.num_tiles == 1 + rows * cols


@pytest.mark.hf
def test_select_best_resolution_matches_hf():
    ipu = pytest.importorskip("transformers.image_processing_utils")
    pins = [list(p) for p in layouts.LLAVA_OV_PINPOINTS]
    for hw in SIZES:
        assert layouts.select_best_resolution(hw, pins) == tuple(
            ipu.select_best_resolution(hw, pins)
        )


def _weighted_gather(
    layout: layouts.FeatureLayout, feats: np.ndarray, newline: np.ndarray
) -> np.ndarray:
    taps, weights = layout.offset_taps(0)
    table = np.concatenate([feats, newline[None]])  # NEWLINE (-2) -> last row via index -1 below
    idx = np.where(taps == NEWLINE, table.shape[0] - 1, taps)
    return (table[idx] * weights[..., None]).sum(1)


@pytest.mark.hf
@pytest.mark.parametrize("hw", [(300, 500), (1000, 700), (2000, 2000), (1500, 2900), (100, 3000)])
def test_llava_ov_layout_reproduces_hf_pack_image_features(hw):
    torch = pytest.importorskip("torch")
    modeling = pytest.importorskip("transformers.models.llava_onevision.modeling_llava_onevision")
    p, dim = 27, 3
    layout = layouts.llava_ov_image_layout(hw)
    rng = np.random.default_rng(0)
    # float64: torch's float32 bilinear kernel rounds its weights (~1e-5 off); in float64 its strided path
    # still differs by ~1e-7. A wrong tap would be O(1) off.
    feats = rng.standard_normal((layout.num_tiles, p * p, dim))
    newline = rng.standard_normal(dim)
    cfg = types.SimpleNamespace(
        vision_config=types.SimpleNamespace(image_size=384, patch_size=14),
        image_grid_pinpoints=[list(x) for x in layouts.LLAVA_OV_PINPOINTS],
    )
    fake = types.SimpleNamespace(config=cfg)
    out, _ = modeling.LlavaOnevisionModel.pack_image_features(
        fake,
        [torch.from_numpy(feats)],
        torch.tensor([hw]),
        torch.from_numpy(newline),
        "anyres_max_9",
    )
    ref = out[0].numpy()
    flat = feats.reshape(-1, dim)
    np.testing.assert_allclose(_weighted_gather(layout, flat, newline), ref, atol=1e-6)
    if layout.is_exact_gather:
        table = np.concatenate([flat, newline[None]])
        np.testing.assert_array_equal(
            table[np.where(layout.source == NEWLINE, -1, layout.source)], ref
        )
    else:
        assert math.prod(layouts.llava_ov_grid(hw)) > 9


@pytest.mark.hf
def test_video_pooling_taps_match_torch_interpolate():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(1).standard_normal((27, 27))
    ref = torch.nn.functional.interpolate(
        torch.from_numpy(x)[None, None], size=[14, 14], mode="bilinear"
    )[0, 0]
    idx = np.arange(27 * 27).reshape(27, 27)
    taps, w = layouts._bilinear_2d(idx, (14, 14))
    np.testing.assert_allclose((x.reshape(-1)[taps] * w).sum(-1), ref.numpy(), atol=1e-12)


def test_video_layout_formula():
    for frames in (1, 8, 32):
        layout = layouts.llava_ov_video_layout(frames)
        # Published formula (LlavaOnevisionProcessor.replace_video_token): frames * ceil(27/2)^2 + 1.
        assert layout.num_tokens == frames * 196 + 1
        assert layout.num_tiles == frames and layout.tokens_per_tile == 729
        assert layout.source[-1] == NEWLINE and (layout.source[:-1] >= 0).all()
        assert (
            frames == 1 or layout.source[196] == 729
        )  # frame 1 starts at the first row of its slot


def test_multi_image_layout_and_offsets():
    layout = layouts.llava_ov_multi_image_layout()
    assert layout.num_tokens == 730 and layout.source[-1] == NEWLINE
    shifted = layout.offset(3)
    assert shifted[0] == 3 * 729 and shifted[-1] == NEWLINE


@pytest.mark.hf
def test_internvl_tile_counts_match_hf():
    got = pytest.importorskip("transformers.models.got_ocr2.image_processing_pil_got_ocr2")
    proc = got.GotOcr2ImageProcessorPil(size={"height": 448, "width": 448}, crop_to_patches=True)
    for hw in SIZES:
        layout = layouts.internvl_image_layout(hw)
        assert layout.num_tiles == proc.get_number_of_image_patches(*hw), hw
        assert layout.num_tokens == 256 * layout.num_tiles
        cols, rows = got.get_optimal_tiled_canvas(hw, (448, 448), 1, 12)
        assert layouts.internvl_grid(hw) == (rows, cols)
