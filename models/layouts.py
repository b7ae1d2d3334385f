"""Where every image placeholder token of an MLLM sample takes its feature from (pure NumPy, no jax).

The encoder sees an image as tiles; the projector turns each tile into `tokens_per_tile` feature rows.
A `FeatureLayout` says, for the i-th image placeholder token of one image / video, which feature row
(`tile * tokens_per_tile + j`, tiles in the order they are given to the encoder) or the learned
image-newline embedding (NEWLINE = -2) fills it. The data layer cuts tiles in exactly this order and
offsets `source` by the tile slots it assigns; the model places features with a gather
(`models/placement.py`).

LLaVA-OneVision (HF `transformers` 5.x, `LlavaOnevisionModel.pack_image_features` and
`LlavaOnevisionProcessor._get_number_of_features`):
  - single image ("anyres_max_N"): tile 0 is the base image resized to 384x384, then the grid tiles of the
    best pinpoint resolution row-major. Tokens: the base tile's 729 features, then the grid's feature map
    (rows*27 x cols*27) with the padding rows/columns removed (`unpad_image`), bilinearly downscaled when
    it exceeds ~N tiles' worth of features (ratio > 1.1), one NEWLINE after every feature row.
  - images of a multi-image sample: one tile each (padded to square); 729 features, then one NEWLINE.
  - video: one tile per frame, each pooled 27x27 -> 14x14 bilinearly (196 tokens) after the projector,
    then ONE newline after the last frame (`get_video_features`). Convention: the model writes a pooled
    tile's 196 features into the FIRST 196 rows of that tile's slot (slot size stays 729), so frame f,
    pooled feature j is row f * 729 + j.
  Bilinear downscaling is not a gather: such layouts also carry `taps` / `tap_weights` ([n, 4]) giving
  the exact weighted combination (torch `interpolate(mode="bilinear", align_corners=False)`); `source`
  then holds the heaviest tap (nearest neighbour), which is an approximation of HF.

InternVL (HF `GotOcr2ImageProcessor` crop_to_patches + `InternVLProcessor`): tiles of 448 px on the grid
with the aspect ratio closest to the image (<= max_tiles), row-major, then a thumbnail LAST when the grid
has more than one tile; 256 tokens per tile (pixel shuffle 0.5 of 32x32 patches), no newline tokens. The
`<img>` / `</img>` tokens around them are ordinary text tokens and are not part of the layout.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

TEXT = -1
NEWLINE = -2

LLAVA_OV_PINPOINTS: tuple[tuple[int, int], ...] = tuple(
    (384 * r, 384 * c) for r in range(1, 7) for c in range(1, 7)
)


@dataclasses.dataclass(frozen=True)
class FeatureLayout:
    """Feature sources of one image / video's placeholder tokens.

    Attributes:
      num_tiles: tiles this image adds to the encoder input.
      tokens_per_tile: rows of one tile's projected feature slot.
      source: [n] int32, `tile * tokens_per_tile + j` or NEWLINE, for each placeholder token.
      taps: [n, 4] int32 or None; exact bilinear sources (same index convention) when features are
        interpolated; NEWLINE rows repeat NEWLINE.
      tap_weights: [n, 4] float32 or None; weights of `taps` (rows sum to 1).
    """

    num_tiles: int
    tokens_per_tile: int
    source: np.ndarray
    taps: np.ndarray | None = None
    tap_weights: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.source.shape[0])

    @property
    def is_exact_gather(self) -> bool:
        """True when `source` alone reproduces the reference (no interpolated features)."""
        return self.taps is None

    def offset(self, tile_offset: int) -> np.ndarray:
        """[n] int32 `source` with this image's tiles starting at tile slot `tile_offset`."""
        return _shift(self.source, tile_offset * self.tokens_per_tile)

    def offset_taps(self, tile_offset: int) -> tuple[np.ndarray, np.ndarray]:
        """([n, 4] int32, [n, 4] float32) exact taps shifted like `offset`; a gather is one tap of weight 1."""
        if self.taps is None:
            taps = np.repeat(self.source[:, None], 4, axis=1)
            weights = np.zeros(taps.shape, np.float32)
            weights[:, 0] = 1.0
        else:
            taps, weights = self.taps, self.tap_weights
        return _shift(taps, tile_offset * self.tokens_per_tile), weights


def _shift(index: np.ndarray, rows: int) -> np.ndarray:
    return np.where(index >= 0, index + rows, index).astype(np.int32)


def select_best_resolution(orig_hw: tuple[int, int], pinpoints) -> tuple[int, int]:
    """HF `select_best_resolution`: the (h, w) pinpoint keeping the most pixels, then wasting the fewest."""
    orig_h, orig_w = orig_hw
    best, best_eff, best_waste = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / orig_w, h / orig_h)
        eff = min(int(orig_w * scale) * int(orig_h * scale), orig_w * orig_h)
        waste = w * h - eff
        if eff > best_eff or (eff == best_eff and waste < best_waste):
            best, best_eff, best_waste = (int(h), int(w)), eff, waste
    if best is None:
        raise ValueError(
            f"select_best_resolution: no pinpoint fits image {orig_hw}; pass non-empty pinpoints"
        )
    return best


def llava_ov_grid(
    orig_hw: tuple[int, int], pinpoints=LLAVA_OV_PINPOINTS, tile_size: int = 384
) -> tuple[int, int]:
    """(rows, cols) of the anyres grid tiles of an image of size `orig_hw` (the base tile not counted)."""
    h, w = select_best_resolution(orig_hw, pinpoints)
    return h // tile_size, w // tile_size


def bilinear_taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray]:
    """1-D torch bilinear (align_corners=False) taps: ([n_out, 2] int, [n_out, 2] float) for `size=n_out`."""
    scale = n_in / n_out
    src = np.maximum((np.arange(n_out) + 0.5) * scale - 0.5, 0.0)
    i0 = np.floor(src).astype(np.int64)
    i1 = np.minimum(i0 + 1, n_in - 1)
    frac = src - i0
    return np.stack([i0, i1], 1), np.stack([1.0 - frac, frac], 1)


def _bilinear_2d(index_map: np.ndarray, out_hw: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Taps of a bilinear resize of a [h, w] map of feature indices: ([oh, ow, 4], [oh, ow, 4])."""
    ys, wy = bilinear_taps(index_map.shape[0], out_hw[0])
    xs, wx = bilinear_taps(index_map.shape[1], out_hw[1])
    taps = index_map[ys[:, None, :, None], xs[None, :, None, :]]  # [oh, ow, 2, 2]
    weights = wy[:, None, :, None] * wx[None, :, None, :]
    return taps.reshape(*out_hw, 4), weights.reshape(*out_hw, 4)


def _rows_with_newline(values: np.ndarray, fill) -> np.ndarray:
    """[h, w, *k] -> [h * (w + 1), *k] with `fill` appended after every row."""
    pad = np.full((values.shape[0], 1, *values.shape[2:]), fill, values.dtype)
    return np.concatenate([values, pad], axis=1).reshape(-1, *values.shape[2:])


def _unpad_slices(orig_hw: tuple[int, int], cur_h: int, cur_w: int) -> tuple[slice, slice]:
    """HF `unpad_image`: the feature rows/cols that are not letterbox padding."""
    orig_h, orig_w = orig_hw
    if orig_w / orig_h > cur_w / cur_h:
        new_h = int(round(orig_h * (cur_w / orig_w), 7))
        pad = (cur_h - new_h) // 2
        return slice(pad, cur_h - pad), slice(0, cur_w)
    new_w = int(round(orig_w * (cur_h / orig_h), 7))
    pad = (cur_w - new_w) // 2
    return slice(0, cur_h), slice(pad, cur_w - pad)


def parse_anyres_max(vision_aspect_ratio: str) -> int:
    """N of an "anyres_max_N" aspect-ratio setting."""
    digits = vision_aspect_ratio.removeprefix("anyres_max_")
    if digits == vision_aspect_ratio or not digits.isdigit():
        raise ValueError(
            f"vision_aspect_ratio={vision_aspect_ratio!r}: expected 'anyres_max_N', e.g. 'anyres_max_9'"
        )
    return int(digits)


def llava_ov_image_layout(
    orig_hw: tuple[int, int],
    *,
    pinpoints=LLAVA_OV_PINPOINTS,
    tile_size: int = 384,
    patches_per_side: int = 27,
    max_num_patches: int | None = None,
    vision_aspect_ratio: str = "anyres_max_9",
) -> FeatureLayout:
    """Layout of a single-image sample's image (base tile + anyres grid), as HF LLaVA-OV packs it.

    Args:
      orig_hw: the original image (height, width) in pixels.
      pinpoints: candidate (h, w) resolutions, multiples of `tile_size`.
      tile_size: encoder input side in pixels.
      patches_per_side: encoder patches per tile side (tokens_per_tile = its square).
      max_num_patches: N of "anyres_max_N"; parsed from `vision_aspect_ratio` when None.
      vision_aspect_ratio: HF config string "anyres_max_N".
    """
    if max_num_patches is None:
        max_num_patches = parse_anyres_max(vision_aspect_ratio)
    p = patches_per_side
    tpt = p * p
    rows, cols = llava_ov_grid(orig_hw, pinpoints, tile_size)
    # Feature map of the grid: position (y, x) comes from tile 1 + (y//p)*cols + x//p, patch (y%p, x%p).
    y = np.arange(rows * p)[:, None]
    x = np.arange(cols * p)[None, :]
    grid = (1 + (y // p) * cols + x // p) * tpt + (y % p) * p + (x % p)
    ys, xs = _unpad_slices(orig_hw, rows * p, cols * p)
    grid = grid[ys, xs]
    cur_h, cur_w = grid.shape
    ratio = math.sqrt(cur_h * cur_w / (max_num_patches * p**2))
    base = np.arange(tpt, dtype=np.int32)
    if ratio <= 1.1:
        source = np.concatenate([base, _rows_with_newline(grid, NEWLINE)]).astype(np.int32)
        return FeatureLayout(1 + rows * cols, tpt, source)
    out_hw = (int(cur_h // ratio), int(cur_w // ratio))
    taps, weights = _bilinear_2d(grid, out_hw)
    nearest = np.take_along_axis(taps, np.argmax(weights, -1)[..., None], -1)[..., 0]
    source = np.concatenate([base, _rows_with_newline(nearest, NEWLINE)]).astype(np.int32)
    base_taps = np.repeat(base[:, None], 4, 1)
    base_w = np.zeros((tpt, 4), np.float32)
    base_w[:, 0] = 1.0
    all_taps = np.concatenate([base_taps, _rows_with_newline(taps, NEWLINE)]).astype(np.int32)
    all_w = np.concatenate([base_w, _rows_with_newline(weights.astype(np.float32), 0.0)])
    all_w[all_taps[:, 0] == NEWLINE, 0] = 1.0
    return FeatureLayout(1 + rows * cols, tpt, source, all_taps, all_w.astype(np.float32))


def llava_ov_multi_image_layout(*, patches_per_side: int = 27) -> FeatureLayout:
    """Layout of one image of a multi-image sample: one padded-square tile, its features, one NEWLINE."""
    tpt = patches_per_side**2
    return FeatureLayout(1, tpt, np.append(np.arange(tpt), NEWLINE).astype(np.int32))


def pooled_side(patches_per_side: int = 27) -> int:
    """Side of a video frame's feature map after LLaVA-OV's 2x2 bilinear pooling (ceil(p / 2))."""
    return math.ceil(patches_per_side / 2)


def llava_ov_video_layout(num_frames: int, *, patches_per_side: int = 27) -> FeatureLayout:
    """Layout of a video: per frame the pooled features (first rows of its tile slot), one final NEWLINE."""
    if num_frames < 1:
        raise ValueError(
            f"llava_ov_video_layout: num_frames={num_frames}; a video needs at least 1 frame"
        )
    tpt = patches_per_side**2
    per_frame = pooled_side(patches_per_side) ** 2
    feats = (np.arange(num_frames)[:, None] * tpt + np.arange(per_frame)[None, :]).reshape(-1)
    return FeatureLayout(num_frames, tpt, np.append(feats, NEWLINE).astype(np.int32))


def internvl_grid(
    orig_hw: tuple[int, int], *, tile_size: int = 448, min_tiles: int = 1, max_tiles: int = 12
) -> tuple[int, int]:
    """(rows, cols) of InternVL's dynamic tiling (HF `get_optimal_tiled_canvas`)."""
    arrangements = sorted(
        (
            (w, h)
            for w in range(1, max_tiles + 1)
            for h in range(1, max_tiles + 1)
            if min_tiles <= w * h <= max_tiles
        ),
        key=lambda g: g[0] * g[1],
    )
    orig_h, orig_w = orig_hw
    aspect, area = orig_w / orig_h, orig_w * orig_h
    best_diff, best = float("inf"), (1, 1)
    for cols, rows in arrangements:
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best_diff, best = diff, (cols, rows)
        elif diff == best_diff and area > 0.5 * tile_size * tile_size * cols * rows:
            best = (cols, rows)
    return best[1], best[0]


def internvl_image_layout(
    orig_hw: tuple[int, int],
    *,
    tile_size: int = 448,
    min_tiles: int = 1,
    max_tiles: int = 12,
    use_thumbnail: bool = True,
    tokens_per_tile: int = 256,
) -> FeatureLayout:
    """Layout of an InternVL image: grid tiles row-major, thumbnail last (if > 1 tile), 256 tokens each."""
    if max_tiles > 1:
        rows, cols = internvl_grid(
            orig_hw, tile_size=tile_size, min_tiles=min_tiles, max_tiles=max_tiles
        )
        n = rows * cols
        n = n + 1 if use_thumbnail and n > 1 else n
    else:
        n = 1
    return FeatureLayout(n, tokens_per_tile, np.arange(n * tokens_per_tile, dtype=np.int32))
