"""The records a `DataConfig` names: a mix YAML, one JSON/JSONL file, parquet or tar shards (a file, a
glob, or a directory: `shards.py`), or the synthetic dataset.

Sits above `sources.py` (file reading) and `mix.py` (mixes of files), so neither imports the other's user.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dflop_jax.config import ConfigError
from dflop_jax.data.config import DataConfig
from dflop_jax.data.mix import load_mix
from dflop_jax.data.shards import is_shard_source, open_shards
from dflop_jax.data.sources import MediaRoots, read_records, with_roots


def load_source(cfg: DataConfig, seed: int = 0) -> Sequence[dict]:
    """All records of `cfg.source`: a list (JSON, JSONL, synthetic), or a lazy random-access sequence
    when shards are named (alone or in a mix), whose records are read on access.

    Relative media paths resolve against `cfg.image_root` / `video_root` / `audio_root`, else the
    dataset's folder.
    """
    if cfg.source == "synthetic":
        from dflop_jax.data.synth import synth_dataset

        path = synth_dataset(
            cfg.synth_dir, cfg.synth_samples, cfg.synth_mix, cfg.synth_seed, cfg.tile_px
        )
    elif is_shard_source(cfg.source):
        try:
            return open_shards(cfg.source, roots=MediaRoots.of(cfg), cache_dir=cfg.cache_dir)
        except ConfigError as e:
            raise ConfigError(f"data.source={e}") from None
    else:
        path = Path(cfg.source).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"data.source={cfg.source!r}: file not found; give a mix YAML, JSON/JSONL, "
                "parquet/tar shards or 'synthetic'"
            )
    if path.suffix in (".yaml", ".yml"):
        return load_mix(
            path, seed, strict=cfg.strict, roots=MediaRoots.of(cfg), cache_dir=cfg.cache_dir
        )
    records = list(read_records(path, strict=cfg.strict))
    return with_roots(records, MediaRoots.of(cfg).under(path.parent))
