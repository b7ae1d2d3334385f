"""Image decoding to RGB: every mode a dataset carries gives the right pixel values, and no warning.

Each image is built with Pillow in its own mode, saved to a file and read back through `load_image`;
expected pixels come from the colour formulas (alpha over white, CMYK, 16-bit scaling), not from
Pillow's conversions.
"""

import warnings

import numpy as np
import pytest
from PIL import Image

from dflop_jax.data.bad_sample import BadSample
from dflop_jax.data.images import load_image, to_rgb


def _quiet_load(path) -> np.ndarray:
    """[H, W, 3] uint8 RGB of the file, asserting that decoding emitted no warning at all."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        img = load_image(path, "test")
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
    assert img.mode == "RGB"
    return np.asarray(img)


def _over_white(rgb, alpha) -> np.ndarray:
    """The alpha-compositing formula: out = rgb * a + 255 * (1 - a), a = alpha / 255."""
    rgb, a = np.asarray(rgb, np.float64), np.asarray(alpha, np.float64)[..., None] / 255
    return rgb * a + 255 * (1 - a)


def _row(mode, pixels) -> Image.Image:
    """A 1-row image of `mode` holding `pixels` left to right."""
    img = Image.new(mode, (len(pixels), 1))
    for x, p in enumerate(pixels):
        img.putpixel((x, 0), p)
    return img


def test_rgba_is_composited_over_white(tmp_path):
    pixels = [(255, 0, 0, 255), (255, 0, 0, 0), (0, 0, 255, 128), (10, 200, 30, 64)]
    _row("RGBA", pixels).save(tmp_path / "a.png")
    want = _over_white([p[:3] for p in pixels], [p[3] for p in pixels])
    got = _quiet_load(tmp_path / "a.png")[0]
    np.testing.assert_allclose(got, want, atol=1)  # 8-bit rounding
    assert got[0].tolist() == [255, 0, 0] and got[1].tolist() == [255, 255, 255]


def test_grey_with_alpha_is_composited_over_white(tmp_path):
    pixels = [(0, 255), (0, 0), (100, 128)]
    _row("LA", pixels).save(tmp_path / "la.png")
    want = _over_white([[v] * 3 for v, _ in pixels], [a for _, a in pixels])
    np.testing.assert_allclose(_quiet_load(tmp_path / "la.png")[0], want, atol=1)


def test_palette_with_byte_transparency_warns_nowhere(tmp_path):
    img = _row("P", [0, 1, 2])
    img.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255])
    img.info["transparency"] = bytes([255, 0, 128])  # per-entry alpha: opaque, clear, half
    img.save(tmp_path / "p.png")
    with Image.open(tmp_path / "p.png") as raw:  # the case Pillow warns about on .convert("RGB")
        assert isinstance(raw.info["transparency"], bytes)
        with pytest.warns(UserWarning, match="Palette images with Transparency"):
            raw.convert("RGB")
    want = _over_white([[255, 0, 0], [0, 255, 0], [0, 0, 255]], [255, 0, 128])
    np.testing.assert_allclose(_quiet_load(tmp_path / "p.png")[0], want, atol=1)


def test_palette_with_one_transparent_index(tmp_path):
    img = _row("P", [0, 1])
    img.putpalette([0, 0, 0, 30, 60, 90])
    img.save(tmp_path / "p.gif", transparency=0)  # GIF style: index 0 is see-through
    assert _quiet_load(tmp_path / "p.gif")[0].tolist() == [[255, 255, 255], [30, 60, 90]]


def test_cmyk(tmp_path):
    pixels = [(255, 0, 0, 0), (0, 0, 0, 255), (0, 0, 0, 0), (128, 0, 64, 128)]
    _row("CMYK", pixels).save(tmp_path / "c.tif")
    cmyk = np.asarray(pixels, np.float64) / 255
    want = 255 * (1 - cmyk[:, :3]) * (1 - cmyk[:, 3:])  # each ink and black absorb independently
    got = _quiet_load(tmp_path / "c.tif")[0]
    np.testing.assert_allclose(got, want, atol=1)
    assert got[:3].tolist() == [[0, 255, 255], [0, 0, 0], [255, 255, 255]]


@pytest.mark.parametrize(
    ("dtype", "suffix"), [(np.uint16, "png"), (np.int32, "tif")], ids=["I;16", "I"]
)
def test_sixteen_bit_grey_is_scaled_not_clipped(tmp_path, dtype, suffix):
    values = np.array([[0, 257, 1000, 32896, 65535]], dtype)
    Image.fromarray(values).save(tmp_path / f"g.{suffix}")
    got = _quiet_load(tmp_path / f"g.{suffix}")[0]
    want = np.round(values[0] / 257.0)  # 65535 -> 255: one 8-bit step per 257 16-bit steps
    assert got.tolist() == [[int(v)] * 3 for v in want] == [[v] * 3 for v in (0, 1, 4, 128, 255)]


def test_thirty_two_bit_grey_clips_to_the_sixteen_bit_range():
    img = Image.fromarray(np.array([[-5, 70000, 514]], np.int32))
    assert np.asarray(to_rgb(img))[0, :, 0].tolist() == [0, 255, 2]


def test_sixteen_bit_grey_with_a_transparent_level():
    img = Image.fromarray(np.array([[0, 0, 65535, 25700]], np.uint16))
    img.info["transparency"] = 0
    assert np.asarray(to_rgb(img))[0, :, 0].tolist() == [255, 255, 255, 100]


@pytest.mark.parametrize(("mode", "pixels", "want"), [
    ("L", [0, 77, 255], [0, 77, 255]),
    ("1", [0, 1, 0], [0, 255, 0]),
])  # fmt: skip
def test_grey_and_one_bit(tmp_path, mode, pixels, want):
    _row(mode, pixels).save(tmp_path / "g.png")
    assert _quiet_load(tmp_path / "g.png")[0].tolist() == [[v] * 3 for v in want]


def test_rgb_is_unchanged(tmp_path):
    pixels = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "rgb.png")
    np.testing.assert_array_equal(_quiet_load(tmp_path / "rgb.png"), pixels)


def test_unconvertible_mode_is_a_corrupt_image(tmp_path, monkeypatch):
    Image.new("RGB", (4, 4)).save(tmp_path / "x.png")

    def refuse(self, mode=None, *args, **kwargs):
        raise ValueError(f"conversion from {self.mode} to {mode} not supported")

    monkeypatch.setattr(Image.Image, "convert", refuse)
    with pytest.raises(BadSample, match="corrupt_image.*not supported"):
        load_image(tmp_path / "x.png", "test")
