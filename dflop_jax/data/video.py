"""Video: frame counts from container metadata (PyAV) or a frame-folder listing, and sampled frame decoding.

Sampling (LLaVA-Video style): one frame every `native_fps / fps` frames; if that gives more than
`max_frames`, `max_frames` frames spread uniformly over the clip instead. A folder of frame images
(sorted by name) is taken as already extracted at `fps`, so only the `max_frames` cap applies.
PyAV is an optional extra (`pip install dflop_jax[video]`); frame folders need only Pillow.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from dflop_jax.data.bad_sample import BadSample
from dflop_jax.data.images import load_image

FRAME_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


def sample_indices(total: int, native_fps: float, fps: float, max_frames: int) -> np.ndarray:
    """[k] int64 indices of the frames to keep out of `total` (k >= 1 when total >= 1)."""
    if total < 1:
        return np.zeros(0, np.int64)
    step = max(1, round(native_fps / fps))
    idx = np.arange(0, total, step)
    if len(idx) > max_frames:
        idx = np.linspace(0, total - 1, max_frames).round().astype(np.int64)
    return idx.astype(np.int64)


def frame_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)


def video_indices(path: Path, location: str, fps: float, max_frames: int) -> np.ndarray:
    """The frame indices that will be decoded, from metadata only (no frame is decoded)."""
    if not path.exists():
        raise BadSample("missing_file", location, f"video not found: {path}")
    if path.is_dir():
        total, native = len(frame_files(path)), fps
    else:
        total, native = _container_frames(path, location)
    idx = sample_indices(total, native, fps, max_frames)
    if len(idx) == 0:
        raise BadSample("unreadable_video", location, f"{path}: no frames")
    return idx


def _container_frames(path: Path, location: str) -> tuple[int, float]:
    """(frame count, native fps) from the container header; frames = duration * rate when not stored."""
    av = _import_av(location)
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            rate = float(stream.average_rate or stream.base_rate or 0)
            total = stream.frames
            if not total and stream.duration and stream.time_base:
                total = round(float(stream.duration * stream.time_base) * rate)
    except (av.error.FFmpegError, IndexError, OSError) as e:
        raise BadSample("unreadable_video", location, f"{path}: {e}") from None
    if not total or rate <= 0:
        raise BadSample(
            "unreadable_video", location, f"{path}: no frame count / rate in the header"
        )
    return int(total), rate


def load_frames(path: Path, location: str, indices: np.ndarray) -> list[Image.Image]:
    """Decodes exactly the frames at `indices` (RGB); a clip shorter than its header claims is unreadable."""
    if path.is_dir():
        files = frame_files(path)
        return [load_image(files[i], location) for i in indices]
    av = _import_av(location)
    wanted, frames = set(int(i) for i in indices), {}
    try:
        with av.open(str(path)) as container:
            for i, frame in enumerate(container.decode(video=0)):
                if i in wanted:
                    frames[i] = frame.to_image().convert("RGB")
                if i >= indices[-1]:
                    break
    except (av.error.FFmpegError, OSError) as e:
        raise BadSample("unreadable_video", location, f"{path}: {e}") from None
    if len(frames) != len(wanted):
        raise BadSample(
            "unreadable_video", location, f"{path}: decoded {len(frames)} of {len(wanted)} frames"
        )
    return [frames[int(i)] for i in indices]


def _import_av(location: str):
    try:
        import av
    except ImportError:
        raise BadSample(
            "unreadable_video", location, "PyAV is not installed: pip install 'dflop_jax[video]'"
        ) from None
    return av
