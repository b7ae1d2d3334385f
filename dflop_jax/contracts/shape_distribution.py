"""The shape-distribution file: the dataset's per-sample (tiles, tokens, modality), as the data profiler
writes it and the planner, scheduler CLI and simulator read it.

    {"version": 1, "source": "...", "samples": [{"tiles": int, "tokens": int, "modality": str,
     "audio": [valid frames per 30 s window, ...]}, ...], "summary": {...}}

`audio` is written only for samples with audio, and read as () when absent.

Pure Python; imports nothing above `contracts`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from dflop_jax.contracts.shapes import SampleShape

FORMAT_VERSION = 1


def load_shape_distribution(path: str | Path) -> list[SampleShape]:
    """Reads a shape-distribution JSON file; sample ids are their positions in the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a shape distribution: {e}") from None
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION or "samples" not in data:
        raise ValueError(f"{path}: expected {{'version': {FORMAT_VERSION}, 'samples': [...]}}")
    out = []
    for i, s in enumerate(data["samples"]):
        try:
            audio = tuple(int(v) for v in s.get("audio", ()))
            modality = str(s.get("modality", "text"))
            out.append(SampleShape(i, int(s["tiles"]), int(s["tokens"]), modality, audio))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"{path}: samples[{i}]={s!r}: need tiles and tokens integers ({e})"
            ) from None
    return out


def save_shape_distribution(
    shapes: Sequence[SampleShape], path: str | Path, source: str, summary: dict
) -> None:
    """Writes `shapes` in the shared shape-distribution format."""
    samples = [
        {"tiles": int(s.tiles), "tokens": int(s.tokens), "modality": s.modality}
        | ({"audio": [int(v) for v in s.audio_windows]} if s.audio_windows else {})
        for s in shapes
    ]
    data = {"version": FORMAT_VERSION, "source": source, "samples": samples, "summary": summary}
    Path(path).write_text(json.dumps(data))
