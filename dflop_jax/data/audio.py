"""Audio: decoding to 16 kHz mono float32 (PyAV) and Whisper log-mel features, one 30 s window at a time.

- `decode_audio(src, location)`: a file or encoded bytes (parquet / tar shards embed them); every
  channel resampled to 16 kHz by PyAV's resampler (libswresample), then averaged to mono (the mean of
  the channels, as librosa's `to_mono`, Qwen2-Audio's loader; PyAV's own mono downmix scales by
  1/sqrt(2) instead).
- `log_mel(samples, n_mels, frames)`: HF `WhisperFeatureExtractor`'s numpy path step for step
  (n_fft 400, hop 160, periodic Hann window, reflect-padded centred frames, power spectrum, Slaney
  mel filters 0-8 kHz, log10 of max(., 1e-10), floor at max - 8, (x + 4) / 4), on the clip followed
  by silence, as HF zero-pads it to 30 s, but only for the frames kept.
- Frames kept: HF pads every clip to 3000 frames (30 s) and marks ceil(samples / 160) of them valid
  (`feature_attention_mask`). Here a window keeps its valid frames plus the two the encoder's
  convolutions read past the last valid one, rounded up to a multiple of 2 * pool (conv stride 2,
  then the pool), at most 3000 (`kept_frames`): the cost follows the clip, and the kept frames are
  exactly HF's first frames, so the encoder's valid outputs equal HF's.
- A clip longer than 30 s is cut into consecutive 30 s windows, each featurized alone as
  `WhisperFeatureExtractor` would featurize it (its own max - 8 floor). A last window too short for
  one encoder output (under 3 frames with pool 2: 30 ms) is dropped.
- Bad input raises `BadSample`: "missing_file", "unreadable_audio" (PyAV cannot open or decode it,
  or no audio stream), "empty_audio" (no samples, or too few for one encoder output),
  "audio_too_long" (longer than the caller's `max_seconds`).
PyAV is an optional extra (`pip install dflop_jax[video]`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dflop_jax.contracts.shapes import CONV_CONTEXT, WINDOW_FRAMES, encoder_outputs, kept_frames
from dflop_jax.data.bad_sample import BadSample

__all__ = [
    "CONV_CONTEXT",
    "SAMPLE_RATE",
    "WINDOW_FRAMES",
    "AudioWindow",
    "audio_windows",
    "decode_audio",
    "encoder_outputs",
    "kept_frames",
    "load_audio",
    "log_mel",
    "valid_frames",
    "window_frames",
]

SAMPLE_RATE = 16000
N_FFT = 400
HOP = 160
WINDOW_SAMPLES = 30 * SAMPLE_RATE  # one encoder window: 30 s (WINDOW_FRAMES = 3000 frames)

AudioSource = Path | bytes  # a file, or encoded bytes embedded in the dataset


@dataclasses.dataclass(frozen=True)
class AudioWindow:
    """One encoder window: features [frames, n_mels] float32, of which `valid_frames` are the clip's
    (the rest: the log-mel of the silence after it, as HF pads)."""

    features: np.ndarray
    valid_frames: int


def valid_frames(num_samples: int) -> int:
    """Frames of a clip of `num_samples` (<= 30 s) that HF's `feature_attention_mask` marks valid."""
    return -(-num_samples // HOP)


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney mel scale: linear below 1 kHz, logarithmic above."""
    mel = 3.0 * hz / 200.0
    log = hz >= 1000.0
    mel[log] = 15.0 + np.log(hz[log] / 1000.0) * (27.0 / np.log(6.4))
    return mel


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    hz = 200.0 * mel / 3.0
    log = mel >= 15.0
    hz[log] = 1000.0 * np.exp(np.log(6.4) / 27.0 * (mel[log] - 15.0))
    return hz


@functools.lru_cache(maxsize=4)
def mel_filters(n_mels: int) -> np.ndarray:
    """[N_FFT/2 + 1, n_mels] float64 Slaney-normalized triangular filters over 0-8 kHz."""
    edges = np.array([0.0, SAMPLE_RATE / 2])
    lo, hi = _hz_to_mel(edges)
    centers = _mel_to_hz(np.linspace(lo, hi, n_mels + 2))  # [n_mels + 2] Hz
    bins = np.linspace(0, SAMPLE_RATE // 2, N_FFT // 2 + 1)  # [201] Hz
    slopes = centers[None, :] - bins[:, None]  # [201, n_mels + 2]
    width = np.diff(centers)
    down = -slopes[:, :-2] / width[:-1]
    up = slopes[:, 2:] / width[1:]
    tri = np.maximum(0.0, np.minimum(down, up))
    return tri * (2.0 / (centers[2:] - centers[:-2]))[None, :]


def log_mel(samples: np.ndarray, n_mels: int, frames: int) -> np.ndarray:
    """[frames, n_mels] float32 log-mel features of `samples` [N] (16 kHz, N <= 30 s) followed by
    silence: `WhisperFeatureExtractor`'s first `frames` frames of the clip padded to 30 s."""
    # Zeros far enough past the last kept frame that its window never reaches the reflected end.
    length = min(frames * HOP + N_FFT // 2, WINDOW_SAMPLES)
    if len(samples) > length:
        raise ValueError(f"log_mel: {len(samples)} samples do not fit {frames} frames")
    padded = np.zeros(length, np.float32)
    padded[: len(samples)] = samples
    x = np.pad(padded, N_FFT // 2, mode="reflect").astype(np.float64)
    window = np.hanning(N_FFT + 1)[:-1]  # periodic Hann
    framed = np.lib.stride_tricks.sliding_window_view(x, N_FFT)[::HOP][:frames] * window
    spectrum = np.fft.rfft(framed, axis=-1).astype(np.complex64)  # HF stores the FFT as complex64
    power = np.abs(spectrum.astype(np.complex128)) ** 2  # [frames, 201]
    mel = np.maximum(1e-10, power @ mel_filters(n_mels))
    log = np.log10(mel).astype(np.float32)
    log = np.maximum(log, log.max() - 8.0)
    return (log + 4.0) / 4.0


def window_frames(num_samples: int, location: str, pool: int = 2) -> tuple[int, ...]:
    """Valid frames of each 30 s window of a clip of `num_samples` (16 kHz): what the encoder sees of
    it, known without computing a feature. Raises BadSample("empty_audio") for a clip too short
    for one encoder output; a tail window too short for one is dropped."""
    out = []
    for start in range(0, num_samples, WINDOW_SAMPLES):
        chunk = min(WINDOW_SAMPLES, num_samples - start)
        valid = valid_frames(chunk)
        if encoder_outputs(valid, pool) == 0:
            if out:  # a tail too short for one output: dropped
                break
            raise BadSample(
                "empty_audio", location,
                f"{chunk} samples ({1000 * chunk / SAMPLE_RATE:.0f} ms) give no encoder output",
            )  # fmt: skip
        out.append(valid)
    return tuple(out)


def audio_windows(
    samples: np.ndarray, location: str, *, n_mels: int = 128, pool: int = 2
) -> list[AudioWindow]:
    """The clip `samples` [N] (16 kHz mono) as 30 s windows of kept frames (`kept_frames`)."""
    if len(samples) == 0:
        raise BadSample("empty_audio", location, "no samples")
    out = []
    for w, valid in enumerate(window_frames(len(samples), location, pool)):
        chunk = samples[w * WINDOW_SAMPLES : (w + 1) * WINDOW_SAMPLES]
        out.append(AudioWindow(log_mel(chunk, n_mels, kept_frames(valid, pool)), valid))
    return out


def load_audio(
    src: AudioSource,
    location: str,
    *,
    n_mels: int = 128,
    pool: int = 2,
    max_seconds: float | None = None,
) -> list[AudioWindow]:
    """Decodes `src` and featurizes it window by window; raises BadSample (see the module doc)."""
    samples = decode_audio(src, location, max_seconds=max_seconds)
    return audio_windows(samples, location, n_mels=n_mels, pool=pool)


@contextlib.contextmanager
def _open_audio(src: AudioSource, location: str) -> Iterator[tuple]:
    """(container, name) of a file or encoded bytes; PyAV errors in the block raise BadSample."""
    av = _import_av(location)
    if isinstance(src, bytes):
        name, fp = f"embedded audio ({len(src)} bytes)", io.BytesIO(src)
    else:
        if not Path(src).is_file():
            raise BadSample("missing_file", location, f"audio not found: {src}")
        name, fp = str(src), str(src)
    try:
        with av.open(fp) as container:
            yield container, name
    except (av.error.FFmpegError, OSError, ValueError) as e:
        raise BadSample("unreadable_audio", location, f"{name}: {e}") from None


def _header_seconds(container, stream) -> float | None:
    """The duration the container's header states (None when it states none)."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return container.duration / 1_000_000  # microseconds (av.time_base)
    return None


def _too_long(location: str, name: str, seconds: float, max_seconds: float) -> BadSample:
    return BadSample(
        "audio_too_long", location, f"{name}: {seconds:.1f} s > max_seconds={max_seconds:g}"
    )


def decode_audio(
    src: AudioSource, location: str, *, max_seconds: float | None = None
) -> np.ndarray:
    """[N] float32 samples at 16 kHz, mono. A clip whose header or decoded length exceeds
    `max_seconds` raises BadSample("audio_too_long") without decoding the rest."""
    with _open_audio(src, location) as (container, name):
        if not container.streams.audio:
            raise BadSample("unreadable_audio", location, f"{name}: no audio stream")
        stream = container.streams.audio[0]
        seconds = _header_seconds(container, stream)
        if max_seconds is not None and seconds is not None and seconds > max_seconds:
            raise _too_long(location, name, seconds, max_seconds)
        limit = None if max_seconds is None else int(max_seconds * SAMPLE_RATE)
        chunks = _resampled(container, stream, location, name, limit)
    if not chunks:
        raise BadSample("empty_audio", location, f"{name}: no samples decoded")
    return np.concatenate(chunks, axis=1).mean(axis=0, dtype=np.float32)


def _resampled(container, stream, location, name, limit) -> list[np.ndarray]:
    """[channels, n] float32 chunks at 16 kHz (the resampler set up from the first frame)."""
    import av

    resampler, chunks, total = None, [], 0
    for frame in itertools.chain(container.decode(stream), [None]):  # None flushes the resampler
        if frame is not None and resampler is None:
            resampler = av.AudioResampler(format="fltp", layout=frame.layout.name, rate=SAMPLE_RATE)
        if resampler is None:
            break
        for out in resampler.resample(frame):
            chunks.append(out.to_ndarray())
            total += chunks[-1].shape[1]
        if limit is not None and total > limit:
            raise _too_long(location, name, total / SAMPLE_RATE, limit / SAMPLE_RATE)
    return chunks


def _import_av(location: str):
    try:
        import av
    except ImportError:
        raise BadSample(
            "unreadable_audio", location, "PyAV is not installed: pip install 'dflop_jax[video]'"
        ) from None
    return av
