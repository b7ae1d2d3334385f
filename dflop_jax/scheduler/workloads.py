"""Sample-shape distributions: the real OmniBal statistics and a LLaVA-OV-like mix (the file format,
re-exported here, is `dflop_jax.contracts.shape_distribution`).

The real per-sample statistics ship with the package, in `dflop_jax/data/workload_stats/omnibal_internvl/`
(`*.json.gz` and a README with their origin and licence), so an installed package or a bare clone has them.

LLaVA-OV-like mix (DESIGN section 10; proportions roughly those of the DFLOP paper's mix of LLaVA-OV
single-image subsets, M4-Instruct and LLaVA-Video-178K, plus some text-only turns):
    single image 45%  anyres_max_9: a base tile + an a x b grid (a, b in 1..6) -> 1 + a*b tiles;
                      LLM tokens 729 * (1 + min(a*b, 9)) + newline tokens + text
    multi-image  20%  2..16 images, one tile and 729 tokens each, + text
    video        25%  1..32 frames at 1 fps (0-32 s clips), one tile and 196 tokens per frame, + text
    text         10%  short QA to long chats (log-normal, 20..4000 tokens)
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dflop_jax.contracts.shape_distribution import (  # noqa: F401 - re-exported
    load_shape_distribution,
    save_shape_distribution,
)
from dflop_jax.contracts.shapes import WINDOW_FRAMES, BucketSet, SampleShape, encoder_outputs

OMNIBAL_SUBSETS = ("ai2d", "chartqa", "docvqa", "synthdog_en")
LLAVA_OV_MIX = {"image": 0.45, "multi_image": 0.20, "video": 0.25, "text": 0.10}


# Package data found by path, not through `dflop_jax.data` (whose import pulls in the data pipeline).
OMNIBAL_DIR = Path(__file__).resolve().parents[1] / "data" / "workload_stats" / "omnibal_internvl"


def omnibal_shapes(subsets: Sequence[str] | None = None) -> list[SampleShape]:
    """The real InternVL single-image statistics (tiles = vit_num, tokens = token_num), ids "subset:j"."""
    out: list[SampleShape] = []
    for name in subsets if subsets is not None else OMNIBAL_SUBSETS:
        if name not in OMNIBAL_SUBSETS:
            raise ValueError(
                f"omnibal subset {name!r} unknown; known: {', '.join(OMNIBAL_SUBSETS)}"
            )
        files = sorted(OMNIBAL_DIR.glob(f"{name}_*wh_token_lengths.json.gz"))
        if not files:  # a package installed without its data files
            raise FileNotFoundError(
                f"{OMNIBAL_DIR}: no {name}_*wh_token_lengths.json.gz; reinstall dflop_jax with its package data"
            )
        with gzip.open(files[0], "rt") as f:
            records = json.load(f)
        out += [
            SampleShape(f"{name}:{j}", int(r["vit_num"]), int(r["token_num"]), "image")
            for j, r in enumerate(records)
        ]
    return out


def llava_ov_mix(n: int, seed: int = 0) -> list[SampleShape]:
    """n synthetic LLaVA-OV-like samples (module docstring), ids "ov:j", reproducible for a seed."""
    rng = np.random.default_rng(seed)
    kinds = rng.choice(list(LLAVA_OV_MIX), size=n, p=list(LLAVA_OV_MIX.values()))
    return [SampleShape(f"ov:{j}", *_ov_sample(str(k), rng), str(k)) for j, k in enumerate(kinds)]


def omni_mix(n: int, seed: int = 0, audio_share: float = 0.3) -> list[SampleShape]:
    """n samples of LLaVA-OV's mix (`llava_ov_mix`) of which a share `audio_share` hold audio,
    ids "omni:j": 70% speech (1-35 s, lognormal around 10 s, LibriSpeech-like: transcribed or asked
    about) and 30% sound (20-65 s: two or three 30 s encoder windows, described); each clip's mel
    frames (100 a second) cut into windows (`SampleShape.audio_windows`), its LLM tokens
    Qwen2-Audio's (`<|audio_bos|>`, one per encoder output, `<|audio_eos|>`) plus the text's
    (about 3.5 BPE tokens a second of speech when transcribed)."""
    if not 0.0 <= audio_share <= 1.0:
        raise ValueError(f"audio_share={audio_share}: between 0 and 1")
    rng = np.random.default_rng(seed)
    base = llava_ov_mix(n, seed)
    heard = rng.random(n) < audio_share
    out = []
    for j, (s, h) in enumerate(zip(base, heard)):
        if not h:
            out.append(dataclasses.replace(s, id=f"omni:{j}"))
            continue
        speech = rng.random() < 0.7
        seconds = float(np.clip(rng.lognormal(2.3, 0.55), 1, 35)) if speech else rng.uniform(20, 65)
        frames = math.ceil(seconds * 100)
        windows = (WINDOW_FRAMES,) * (frames // WINDOW_FRAMES) + (
            (frames % WINDOW_FRAMES,) if frames % WINDOW_FRAMES else ()
        )
        text = int(3.5 * seconds) + 20 if speech else _text_tokens(rng, 120, 20, 400)
        tokens = sum(encoder_outputs(v) for v in windows) + 2 + text
        out.append(SampleShape(f"omni:{j}", 0, tokens, "speech" if speech else "sound", windows))
    return out


def _text_tokens(rng: np.random.Generator, median: float, lo: int, hi: int) -> int:
    return int(np.clip(rng.lognormal(math.log(median), 0.9), lo, hi))


def _ov_sample(kind: str, rng: np.random.Generator) -> tuple[int, int]:
    """(tiles, tokens) of one sample of `kind`."""
    if kind == "image":
        a, b = (
            int(x)
            for x in rng.choice(np.arange(1, 7), size=2, p=[0.3, 0.25, 0.17, 0.12, 0.09, 0.07])
        )
        kept = min(a * b, 9)  # anyres_max_9: the grid's features are pooled down to at most 9 tiles
        rows = round(27 * a * math.sqrt(kept / (a * b)))
        return 1 + a * b, 729 * (1 + kept) + rows + _text_tokens(rng, 120, 10, 2000)
    if kind == "multi_image":
        k = int(rng.integers(2, 17))
        return k, 729 * k + _text_tokens(rng, 150, 10, 2000)
    if kind == "video":
        f = int(rng.integers(1, 33))
        return f, 196 * f + _text_tokens(rng, 200, 10, 2000)
    return 0, _text_tokens(rng, 250, 20, 4000)


def sample_global_batch(
    shapes: Sequence[SampleShape], n: int, rng: np.random.Generator
) -> list[SampleShape]:
    """n samples drawn from `shapes` (without replacement when possible), ids kept."""
    idx = rng.choice(len(shapes), size=n, replace=n > len(shapes))
    return [shapes[int(i)] for i in idx]


def default_buckets(
    shapes: Sequence[SampleShape],
    microbatches: int,
    encoder_dp: int = 1,
    llm_dp: int = 1,
    batch_size: int | None = None,
    num_lengths: int = 6,
    num_tiles: int = 5,
    multiple: int = 128,
    growth: float = 2**0.5,
    by_row: bool = False,
) -> BucketSet:
    """Geometric (ratio `growth`) bucket sets whose largest covers the largest sample and 1.5x the mean load.

    Args:
      shapes: a batch or a distribution of samples.
      microbatches: microbatches per global batch (the mean load is per microbatch and shard).
      batch_size: samples per global batch (default len(shapes)).
      multiple: length buckets are multiples of this.
      growth: ratio between consecutive buckets (finer buckets: less padding, more compiled programs).
      by_row: tiles are packed by row (`ScheduleProblem.tiles_by_row`): tile buckets count a row's
        tiles, the largest covering the largest sample's.
    """
    n = batch_size if batch_size is not None else len(shapes)
    tok = np.array([s.tokens for s in shapes], dtype=np.float64)
    til = np.array([s.tiles for s in shapes], dtype=np.float64)
    mean_bin_tok = tok.mean() * n / (microbatches * llm_dp)
    shards = llm_dp if by_row else encoder_dp
    mean_mb_tiles = til.mean() * n / (microbatches * shards)
    top_s = max(tok.max(), 1.5 * mean_bin_tok)
    top_t = max(math.ceil(til.max() / (1 if by_row else encoder_dp)), 1.5 * mean_mb_tiles, 1.0)
    lengths = {int(math.ceil(top_s / growth**j / multiple) * multiple) for j in range(num_lengths)}
    tiles = {max(1, int(math.ceil(top_t / growth**j))) for j in range(num_tiles)}
    return BucketSet(tuple(sorted(tiles)), tuple(sorted(x for x in lengths if x > 0)))
