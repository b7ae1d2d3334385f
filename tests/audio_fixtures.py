"""WAV clips for the audio tests, written with the stdlib `wave` module (an encoder independent of the
PyAV decoder under test)."""

from __future__ import annotations

import io
import wave

import numpy as np


def wav_bytes(pcm: np.ndarray, rate: int) -> bytes:
    """WAV bytes of int16 PCM, [N] (mono) or [N, channels]."""
    pcm = pcm[:, None] if pcm.ndim == 1 else pcm
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(pcm.shape[1])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.astype("<i2").tobytes())
    return buf.getvalue()


def tone(seconds: float, hz: float, rate: int = 16000, amplitude: float = 6000) -> np.ndarray:
    """[N] int16: a sine of `hz` for `seconds` at `rate` samples per second."""
    t = np.arange(round(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * hz * t)).astype("<i2")
