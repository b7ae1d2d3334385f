"""Processed samples whose features trace back to their tiles, and random schedules of them, for the
packing tests (`data/packing.py`): each sample's tile t is `loader_fakes.tagged_tile(id, t)`."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from loader_fakes import TILE, tagged_tile

from dflop_jax.data.sample_arrays import NEWLINE, TEXT, ProcessedSample

TPT = 3  # feature rows per tile of a `make_sample` sample
IMAGE_TOKEN = 9


def make_sample(idx: int, n_tiles: int, n_text: int, rng: np.random.Generator, newline=True):
    """Text, then each tile's TPT image tokens (+ a newline token), then text.

    Tile t of sample idx is `tagged_tile(idx, t)` (uint8, as the processor's tiles), so a feature row can be traced to its tile.
    """
    head = n_text // 2
    ids, src = [], []
    ids += list(rng.integers(100, 10_000, head))
    src += [TEXT] * head
    for t in range(n_tiles):
        ids += [IMAGE_TOKEN] * TPT
        src += [t * TPT + j for j in range(TPT)]
        if newline:
            ids.append(IMAGE_TOKEN)
            src.append(NEWLINE)
    tail = n_text - head
    ids += list(rng.integers(100, 10_000, tail))
    src += [TEXT] * tail
    ids = np.array(ids, np.int32)
    src = np.array(src, np.int32)
    assistant = (rng.random(len(ids)) < 0.5) & (src == TEXT)
    tiles = (
        np.stack([tagged_tile(idx, t) for t in range(n_tiles)])
        if n_tiles
        else (np.zeros((0, *TILE), np.uint8))
    )
    pool = np.arange(n_tiles) % 2 == 1
    modality = "image" if n_tiles else "text"
    return ProcessedSample(idx, ids, assistant, src, tiles, pool, modality)


@st.composite
def packing_cases(draw):
    """A random schedule to pack: (encoder_dp, llm_dp, (tiles, text tokens) of each sample, the
    microbatch count, each sample's row among all the microbatches' rows, extra length-bucket tokens,
    extra tile-bucket slots, a seed)."""
    encoder_dp = draw(st.integers(1, 3))
    llm_dp = draw(st.integers(1, 3))
    n = draw(st.integers(1, 10))
    sizes = [(draw(st.integers(0, 4)), draw(st.integers(1, 6))) for _ in range(n)]
    n_mb = draw(st.integers(1, 3))
    bins = [draw(st.integers(0, n_mb * llm_dp - 1)) for _ in range(n)]
    extra_s = draw(st.integers(0, 5))
    extra_t = draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**16))
    return encoder_dp, llm_dp, sizes, n_mb, bins, extra_s, extra_t, seed
