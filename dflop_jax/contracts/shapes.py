"""What every layer knows of a sample and of the compiled shapes: `SampleShape` and `BucketSet`.

The lowest contract of the project (DESIGN sections 3 and 4): the data layer builds `SampleShape`s from
metadata, the scheduler and planner reason about them, the runtime compiles one program per bucket.
Pure Python; imports nothing from dflop_jax.
"""

from __future__ import annotations

import dataclasses
from typing import Any

WINDOW_FRAMES = 3000  # log-mel frames of one 30 s audio encoder window (100 a second)
CONV_CONTEXT = 2  # frames the audio encoder's convolutions read past a window's last valid one


def encoder_outputs(valid: int, pool: int = 2) -> int:
    """Encoder outputs (Qwen2-Audio: audio tokens) of `valid` valid frames: conv stride 2, then pool."""
    return ((valid - 1) // 2 + 1) // pool


def kept_frames(valid: int, pool: int = 2) -> int:
    """Frames the audio encoder runs for a window of `valid` valid frames: valid + CONV_CONTEXT
    rounded up to 2 * pool (conv stride 2, then the pool), at most one window (past its end HF's
    convolutions see zero padding too). Packed windows then start at multiples of 2 * pool."""
    multiple = 2 * pool
    return min(-(-(valid + CONV_CONTEXT) // multiple) * multiple, WINDOW_FRAMES)


def row_audio_frames(tokens: int) -> int:
    """The most audio frames a row of `tokens` LLM tokens can hold. A clip's tokens are its bos and
    eos and one per encoder output o of each window, and a window keeps at most 4 o + 8 frames
    (`kept_frames`: valid + 2 rounded up to 4, valid <= 4 o + 3), so a one-window clip runs at most
    4 frames per token; each further window is a whole 30 s one (750 outputs) adding 8 frames past
    4 per token. The audio ladder ends here, so a row the length ladder holds never lacks one."""
    return 4 * tokens + 8 * (tokens // 752)


@dataclasses.dataclass(frozen=True)
class SampleShape:
    """What the scheduler knows of a sample before any pixel is decoded.

    Attributes:
      id: the sample's id in its dataset (opaque to the scheduler).
      tiles: encoder tiles (images tiles + video frames); 0 for text-only.
      tokens: all LLM tokens of the sample (text + image + newline tokens), exactly as the model sees them.
      modality: "text", "image", "multi_image", "video", "audio" or "omni" (audio with images or
        video) (reporting only).
      audio_windows: valid log-mel frames (100 per second) of each 30 s audio window the sample's
        clips are cut into, in order; () for a sample without audio. The audio encoder's work follows
        them (its frames per window), and its tokens are among `tokens`.
    """

    id: Any
    tiles: int
    tokens: int
    modality: str = "text"
    audio_windows: tuple[int, ...] = ()

    @property
    def audio_seconds(self) -> float:
        """Seconds of audio (each valid frame is 10 ms)."""
        return sum(self.audio_windows) / 100.0

    @property
    def audio_frames(self) -> int:
        """Frames the audio encoder runs for the sample's windows (`kept_frames` of each)."""
        return sum(kept_frames(v) for v in self.audio_windows)


@dataclasses.dataclass(frozen=True)
class BucketSet:
    """The static shapes a stage program is compiled for.

    Attributes:
      tiles: tile buckets T, ascending: tiles per encoder data-parallel shard (or per LLM row, tiles
        packed by row) per microbatch.
      lengths: length buckets S, ascending: tokens of the one packed row per LLM data-parallel shard
        per microbatch.
      pairs: the (T, S) pairs a microbatch may take, ascending; empty = every pair of the grid. A
        program that sees both sizes (a colocated stage, the first LLM stage taking the encoder's
        features) is compiled once per pair, so a sparse set covering the data compiles far fewer
        programs than the grid. The largest pair (max T, max S) is always in the set: any
        microbatch the grid holds fits it, and the scheduler runs a microbatch at the cheapest
        allowed pair at least as large as its need (`covering`).
      audio: audio buckets A, ascending: audio encoder frames per LLM row (its samples' windows
        packed back to back, `ScheduledMicrobatch.audio_bucket`); multiples of 4, so every packed
        window starts where the encoder's stride and pool need it. Empty: no audio. Only the
        stage that runs the audio encoder sees A, so the ladder adds programs to that stage alone.
    """

    tiles: tuple[int, ...]
    lengths: tuple[int, ...]
    pairs: tuple[tuple[int, int], ...] = ()
    audio: tuple[int, ...] = ()

    def __post_init__(self):
        for name, values in (("tiles", self.tiles), ("lengths", self.lengths)):
            if not values or list(values) != sorted(set(values)) or values[0] < 1:
                raise ValueError(
                    f"buckets.{name}={values}: need distinct positive sizes, ascending"
                )
        a = tuple(self.audio)
        object.__setattr__(self, "audio", a)
        if a and (list(a) != sorted(set(a)) or a[0] < 4 or any(x % 4 for x in a)):
            raise ValueError(f"buckets.audio={list(a)}: need distinct multiples of 4, ascending")
        if not self.pairs:
            return
        pairs = tuple(tuple(p) for p in self.pairs)
        object.__setattr__(self, "pairs", pairs)
        if list(pairs) != sorted(set(pairs)):
            raise ValueError(f"buckets.pairs={list(pairs)}: need distinct pairs, ascending")
        outside = [p for p in pairs if p[0] not in self.tiles or p[1] not in self.lengths]
        if outside:
            raise ValueError(
                f"buckets.pairs {outside} are not (tile bucket, length bucket) pairs of "
                f"tiles={list(self.tiles)} lengths={list(self.lengths)}"
            )
        if self.top not in pairs:
            raise ValueError(
                f"buckets.pairs={list(pairs)} must hold the largest pair {self.top}: it is the "
                "one every microbatch fits"
            )
        if len(pairs) == len(self.tiles) * len(self.lengths):  # the grid: one spelling of it
            object.__setattr__(self, "pairs", ())

    @property
    def top(self) -> tuple[int, int]:
        """The largest pair (max T, max S)."""
        return self.tiles[-1], self.lengths[-1]

    @property
    def grid(self) -> bool:
        """True when every (T, S) pair of the two ladders is allowed."""
        return not self.pairs

    def allowed(self) -> tuple[tuple[int, int], ...]:
        """The (T, S) pairs a microbatch may take, ascending (the whole grid when `pairs` is empty)."""
        return self.pairs or tuple((t, s) for t in self.tiles for s in self.lengths)

    def allows(self, tile_bucket: int, length_bucket: int) -> bool:
        if not self.pairs:
            return tile_bucket in self.tiles and length_bucket in self.lengths
        return (tile_bucket, length_bucket) in self.pairs

    def covering(self, tiles: float, tokens: float) -> list[tuple[int, int]]:
        """The allowed pairs holding a microbatch of `tiles` per shard and `tokens` per row (those
        with T >= tiles and S >= tokens), ascending; [] when none does."""
        return [(t, s) for t, s in self.allowed() if t >= tiles and s >= tokens]

    def smallest_covering(self, tiles: float, tokens: float) -> tuple[int, int]:
        """The allowed pair of least area (T x S, ties: smaller S) holding (`tiles`, `tokens`), or the
        largest pair when none holds it: a cost-free stand-in for the scheduler's cheapest pair."""
        pairs = self.covering(tiles, tokens)
        return min(pairs, key=lambda p: (p[0] * p[1], p[1], p[0])) if pairs else self.top

    def audio_bucket(self, frames: int) -> int:
        """The smallest audio bucket holding `frames` (0 for none); ValueError past the largest."""
        if frames <= 0:
            return 0
        for a in self.audio:
            if a >= frames:
                return a
        raise ValueError(
            f"{frames} audio frames in one LLM row > the largest audio bucket "
            f"{self.audio[-1] if self.audio else 0} (buckets.audio={list(self.audio)})"
        )

    def to_dict(self) -> dict:
        """As plan.yaml writes it (`pairs` only when sparse, `audio` only when there is audio)."""
        out: dict = {"tiles": list(self.tiles), "lengths": list(self.lengths)}
        if not self.grid:
            out["pairs"] = [list(p) for p in self.pairs]
        if self.audio:
            out["audio"] = list(self.audio)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> BucketSet:
        pairs = tuple(tuple(int(v) for v in p) for p in d.get("pairs") or ())
        audio = tuple(int(v) for v in d.get("audio") or ())
        return cls(
            tuple(int(v) for v in d["tiles"]), tuple(int(v) for v in d["lengths"]), pairs, audio
        )
