"""Images: size from the header (no pixel decoding), full decoding, and tiling as the layouts assume.

Tile orders follow `models/layouts.py`: LLaVA-OV anyres = base tile (whole image squashed to one tile),
then the best-fit grid row-major; LLaVA-OV multi-image = one padded-square tile; InternVL = the grid
row-major, then the thumbnail last when there is more than one grid tile.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from dflop_jax.data.bad_sample import BadSample

_RESAMPLE = Image.Resampling.BICUBIC
WHITE = (255, 255, 255)  # what transparent pixels become (`to_rgb` says why)
_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})
_SIXTEEN_BIT = frozenset({"I", "I;16", "I;16L", "I;16B", "I;16N"})


ImageSource = Path | bytes  # a file, or encoded bytes embedded in the dataset (parquet, tar shards)


@contextlib.contextmanager
def _open_image(src: ImageSource, location: str) -> Iterator[Image.Image]:
    """Opens a file or encoded bytes with Pillow; a missing file or any decode error in the block
    raises BadSample."""
    if isinstance(src, bytes):
        name, fp = f"embedded image ({len(src)} bytes)", io.BytesIO(src)
    else:
        if not src.is_file():
            raise BadSample("missing_file", location, f"image not found: {src}")
        name, fp = str(src), src
    try:
        with Image.open(fp) as img:
            yield img
    except (
        UnidentifiedImageError,
        Image.DecompressionBombError,
        OSError,
        SyntaxError,
        ValueError,
    ) as e:
        raise BadSample("corrupt_image", location, f"{name}: {e}") from None


def image_size(src: ImageSource, location: str) -> tuple[int, int]:
    """(height, width) from the header; Pillow opens lazily and decodes no pixels here."""
    with _open_image(src, location) as img:
        w, h = img.size
    if h < 1 or w < 1:
        raise BadSample("corrupt_image", location, f"empty image {w}x{h}")
    return h, w


def load_image(src: ImageSource, location: str) -> Image.Image:
    """Decodes the whole image as RGB (`to_rgb`); truncated or corrupt data raises BadSample("corrupt_image")."""
    with _open_image(src, location) as img:
        img.load()
        return to_rgb(img)


def to_rgb(img: Image.Image) -> Image.Image:
    """8-bit RGB from any mode datasets carry, without a Pillow warning reaching the console.

    - Transparency (RGBA, LA, PA, or a palette / L / RGB image with a `transparency` entry, including
      palette alpha given as bytes, which a direct `.convert("RGB")` warns about): composited over
      WHITE. LLaVA's processors call `.convert("RGB")`, which drops alpha and shows whatever colour
      the encoder left under transparent pixels (often black, so a transparent-background chart or
      diagram with black ink turns black on black); white is what such images are drawn to be seen
      on, and what HF's Idefics processor and vLLM composite over. Opaque pixels are unchanged.
    - 16-bit grayscale (I;16*, and I, as Pillow opens 16-bit PNG/TIFF/PGM): scaled by 255/65535.
      Pillow's own conversion clips at 255, which turns nearly every 16-bit scan white.
    - L, 1, CMYK (Pillow's multiplicative CMYK -> RGB), YCbCr, palettes without transparency: Pillow.
    """
    if img.mode in _SIXTEEN_BIT:
        img = _sixteen_bit_to_l(img)
    if img.mode in _ALPHA_MODES or "transparency" in img.info:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", img.size, WHITE + (255,)), rgba).convert(
            "RGB"
        )
    return img.convert("RGB")


def _sixteen_bit_to_l(img: Image.Image) -> Image.Image:
    """L (or LA, when one grey level is marked transparent), 0..65535 mapped to 0..255 rounding."""
    raw = np.asarray(img).astype(np.int64)
    grey = Image.fromarray(((np.clip(raw, 0, 65535) * 255 + 32767) // 65535).astype(np.uint8))
    transparent = img.info.get("transparency")
    if not isinstance(transparent, int):
        return grey
    alpha = Image.fromarray(np.where(raw == transparent, 0, 255).astype(np.uint8))
    return Image.merge("LA", (grey, alpha))


def _array(img: Image.Image) -> np.ndarray:
    return np.asarray(img, np.uint8)


def squash_tile(img: Image.Image, tile: int) -> np.ndarray:
    """[tile, tile, 3] uint8: the whole image resized to one tile (LLaVA-OV base tile, video frames)."""
    return _array(img.resize((tile, tile), _RESAMPLE))


def pad_square_tile(img: Image.Image, tile: int, mean: tuple[float, float, float]) -> np.ndarray:
    """[tile, tile, 3] uint8: padded to a centered square with the mean colour, then resized (LLaVA "pad")."""
    w, h = img.size
    side = max(w, h)
    canvas = Image.new("RGB", (side, side), tuple(int(m * 255) for m in mean))
    canvas.paste(img, ((side - w) // 2, (side - h) // 2))
    return squash_tile(canvas, tile)


def anyres_grid_tiles(img: Image.Image, rows: int, cols: int, tile: int) -> np.ndarray:
    """[rows*cols, tile, tile, 3] uint8: fit inside (rows*tile, cols*tile) keeping aspect, pad centered, cut."""
    w, h = img.size
    target_h, target_w = rows * tile, cols * tile
    scale = min(target_w / w, target_h / h)
    new_w, new_h = max(1, min(target_w, round(w * scale))), max(1, min(target_h, round(h * scale)))
    canvas = Image.new("RGB", (target_w, target_h), (0, 0, 0))
    canvas.paste(
        img.resize((new_w, new_h), _RESAMPLE), ((target_w - new_w) // 2, (target_h - new_h) // 2)
    )
    return _cut(_array(canvas), rows, cols, tile)


def resize_grid_tiles(img: Image.Image, rows: int, cols: int, tile: int) -> np.ndarray:
    """[rows*cols, tile, tile, 3] uint8: resized to exactly (rows*tile, cols*tile), cut row-major (InternVL)."""
    return _cut(_array(img.resize((cols * tile, rows * tile), _RESAMPLE)), rows, cols, tile)


def _cut(canvas: np.ndarray, rows: int, cols: int, tile: int) -> np.ndarray:
    # [rows*tile, cols*tile, 3] -> [rows, tile, cols, tile, 3] -> [rows, cols, tile, tile, 3] -> row-major tiles
    return (
        canvas.reshape(rows, tile, cols, tile, 3)
        .transpose(0, 2, 1, 3, 4)
        .reshape(-1, tile, tile, 3)
    )
