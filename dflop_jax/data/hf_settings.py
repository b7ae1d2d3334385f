"""The data settings an HF model directory carries: its tokenizer, chat template and image processor.

A model trained on its own data keeps the tokenization, prompt format and pixel preprocessing it was
pretrained with; `TrainConfig` fills the data keys left at "auto" from `model.hf_dir` with
`hf_data_settings`. Reading is plain JSON (no JAX, no transformers). A file the directory lacks leaves
the key to its family default, logged once.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from dflop_jax.config import ConfigError

log = logging.getLogger(__name__)


def hf_data_settings(hf_dir: str) -> dict:
    """`DataConfig` values `hf_dir` determines: tokenizer, chat_template, tile_size, pixel_mean,
    pixel_std, max_grid, max_tiles (only those the directory has a file or key for).

    tokenizer.json -> tokenizer; its chat template (chat_template.jinja or tokenizer_config.json's)
    -> chat_template "from_tokenizer"; preprocessor_config.json's `size` (or `crop_size`) -> tile_size,
    `image_mean` / `image_std` -> pixel_mean / pixel_std, `image_grid_pinpoints` (LLaVA-OV) ->
    max_grid (the largest pinpoint side over the tile size), `max_patches` (InternVL's HF processor)
    or config.json's `max_dynamic_patch` (InternVL's own format) -> max_tiles.
    """
    from dflop_jax.data.tokenizer import _chat_template, _read_json

    root = Path(hf_dir).expanduser()
    out: dict = {}
    if (root / "tokenizer.json").is_file():
        out["tokenizer"] = hf_dir
        if _chat_template(root, _read_json(root / "tokenizer_config.json")):
            out["chat_template"] = "from_tokenizer"
        else:
            log.info("%s: the tokenizer has no chat template; data.chat_template=qwen2.5", hf_dir)
    else:
        log.info("%s: no tokenizer.json; data.tokenizer=bundled, chat_template=qwen2.5", hf_dir)
    max_tiles = _read_json(root / "config.json").get("max_dynamic_patch")
    pre = root / "preprocessor_config.json"
    if not pre.is_file():
        if max_tiles:
            out["max_tiles"] = int(max_tiles)
        log.info("%s: no preprocessor_config.json; pixel mean/std are the family's", hf_dir)
        return out
    proc = _read_json(pre)
    tile = _side(proc.get("crop_size")) or _side(proc.get("size"))
    if tile:
        out["tile_size"] = tile
    for key, name in (("image_mean", "pixel_mean"), ("image_std", "pixel_std")):
        value = proc.get(key)
        if isinstance(value, (int, float)):  # one value for all channels
            value = [value] * 3
        if value:
            out[name] = tuple(float(v) for v in value)
    pinpoints = proc.get("image_grid_pinpoints")
    if pinpoints and tile:
        out["max_grid"] = max(max(p) for p in pinpoints) // tile
    max_tiles = proc.get("max_patches") or max_tiles
    if max_tiles:
        out["max_tiles"] = int(max_tiles)
    return out


def vision_image_size(hf_dir: str) -> int | None:
    """The image side the vision tower of `hf_dir`'s config.json is built for (None if it names none)."""
    path = Path(hf_dir).expanduser() / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None  # model.hf_dir's own check reports a missing or broken config.json
    side = cfg.get("force_image_size") or (cfg.get("vision_config") or {}).get("image_size")
    return _side(side)


def _side(size) -> int | None:
    """A square side from the forms HF processors write: 384, [384, 384], {"height": 384, "width":
    384} or {"shortest_edge": 384}. A non-square size is refused (tiles are square)."""
    if isinstance(size, int):
        return size
    if isinstance(size, (list, tuple)) and size:
        sides = set(size)
    elif isinstance(size, dict):
        sides = {size[k] for k in ("height", "width") if k in size} or {
            size[k] for k in ("shortest_edge",) if k in size
        }
    else:
        return None
    if len(sides) != 1:
        raise ConfigError(
            f"preprocessor_config.json size {size} is not square; set data.tile_size by hand"
        )
    return int(sides.pop())
