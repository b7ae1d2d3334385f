"""The data settings an HF model directory carries: its tokenizer, chat template and image processor.

A model trained on its own data keeps the tokenization, prompt format and pixel preprocessing it was
pretrained with; `TrainConfig` fills the data keys left at "auto" from `model.hf_dir` with
`hf_data_settings`. Reading is plain JSON (no JAX, no transformers). A file the directory lacks leaves
the key to its family default, logged once. `processor_config` is the way back: the
preprocessor_config.json of a run's data settings (`python -m dflop_jax.export` writes it).
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
    out |= processor_settings(_read_json(pre))
    if max_tiles and "max_tiles" not in out:
        out["max_tiles"] = int(max_tiles)
    return out


def processor_settings(proc: dict) -> dict:
    """The `DataConfig` values a preprocessor_config.json dict gives (`hf_data_settings`)."""
    out: dict = {}
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
    if proc.get("max_patches"):
        out["max_tiles"] = int(proc["max_patches"])
    return out


# The HF image processors of the two families as transformers writes them, less the settings a run
# decides (`processor_config`).
_FAMILY_PROCESSORS = {
    "llava_ov": {
        "image_processor_type": "LlavaOnevisionImageProcessor",
        "processor_class": "LlavaOnevisionProcessor",
        "do_convert_rgb": True, "do_resize": True, "resample": 3, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "do_pad": True,
    },
    "internvl": {
        "image_processor_type": "GotOcr2ImageProcessor",
        "processor_class": "InternVLProcessor",
        "do_convert_rgb": True, "do_resize": True, "resample": 3, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "crop_to_patches": True, "min_patches": 1,
    },
}  # fmt: skip


def processor_config(data_cfg, base: dict | None = None) -> dict:
    """preprocessor_config.json of a run's data settings, the inverse of `hf_data_settings`: `base`
    (an HF directory's own, its other keys kept; None = the family's image processor) with the
    run's tile size, pixel mean/std and LLaVA-OV pinpoints grid or InternVL tile budget wherever
    `base` reads back to other values (so `base` comes back unchanged when it gave the run its
    settings)."""
    family = data_cfg.model_family
    out = dict(_FAMILY_PROCESSORS[family] if base is None else base)
    tile, have = data_cfg.tile_px, processor_settings(out)
    if have.get("tile_size") != tile:
        out["size"] = {"height": tile, "width": tile}
        if out.get("crop_size"):
            out["crop_size"] = {"height": tile, "width": tile}
    for key, name, value in (("image_mean", "pixel_mean", data_cfg.mean),
                             ("image_std", "pixel_std", data_cfg.std)):  # fmt: skip
        if have.get(name) != tuple(value):
            out[key] = list(value)
    if family == "llava_ov" and have.get("max_grid") != data_cfg.anyres_grid:
        grid = range(1, data_cfg.anyres_grid + 1)
        out["image_grid_pinpoints"] = [[tile * r, tile * c] for r in grid for c in grid]
    if family == "internvl" and have.get("max_tiles") != data_cfg.dynamic_max_tiles:
        out["max_patches"] = data_cfg.dynamic_max_tiles
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
