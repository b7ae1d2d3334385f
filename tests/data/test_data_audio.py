"""Audio decoding (PyAV) and Whisper log-mel features against independent references: transformers'
`WhisperFeatureExtractor` (its numpy path and its torch path) and mel filter bank, HF's encoder
output-length formula, scipy's polyphase resampler, and PCM written with the stdlib `wave` module."""

from __future__ import annotations

import io

import numpy as np
import pytest
from audio_fixtures import wav_bytes

from dflop_jax.data import audio
from dflop_jax.data.audio import (
    AudioWindow,
    audio_windows,
    decode_audio,
    encoder_outputs,
    kept_frames,
    load_audio,
)
from dflop_jax.data.bad_sample import BadSample

pytest.importorskip("av")
SR = audio.SAMPLE_RATE


def _sweep_with_gap(seconds: float = 4.0) -> np.ndarray:
    """int16 [N, 1]: a linear chirp 50 Hz -> 7.5 kHz at half scale, with 0.5 s of silence in it."""
    t = np.arange(int(seconds * SR)) / SR
    f0, f1 = 50.0, 7500.0
    x = 0.5 * np.sin(2 * np.pi * (f0 * t + (f1 - f0) / (2 * seconds) * t**2))
    x[int(1.5 * SR) : 2 * SR] = 0.0
    return np.round(x * 32767).astype(np.int16)[:, None]


def _noise(n: int, seed: int = 0) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def _hf_features(samples: np.ndarray, n_mels: int, *, numpy_path: bool):
    """(features [n_mels, 3000], valid frames) from `WhisperFeatureExtractor`, through its numpy
    path or its default (torch, when installed) path."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.whisper import feature_extraction_whisper as fx

    fe = transformers.WhisperFeatureExtractor(feature_size=n_mels)
    with pytest.MonkeyPatch.context() as mp:
        if numpy_path:
            mp.setattr(fx, "is_torch_available", lambda: False)
        out = fe(samples, sampling_rate=SR, return_attention_mask=True, return_tensors="np")
    return out["input_features"][0], int(out["attention_mask"].sum())


def _check_window(window: AudioWindow, samples: np.ndarray, n_mels: int, torch_path=True) -> None:
    frames = window.features.shape[0]
    want, valid = _hf_features(samples, n_mels, numpy_path=True)
    assert window.valid_frames == valid and frames == kept_frames(valid)
    # float64 throughout as HF's numpy path; float32 values of O(1): 1e-6 is a few ulps.
    np.testing.assert_allclose(window.features, want[:, :frames].T, atol=1e-6)
    if torch_path:
        # HF's torch path runs its STFT in float32; HF states the paths agree to 1e-5.
        fast, _ = _hf_features(samples, n_mels, numpy_path=False)
        np.testing.assert_allclose(window.features, fast[:, :frames].T, atol=1e-5)


@pytest.mark.hf
@pytest.mark.parametrize("n_mels", [80, 128])
def test_mel_filters_equal_transformers(n_mels):
    pytest.importorskip("transformers")
    from transformers.audio_utils import mel_filter_bank

    want = mel_filter_bank(num_frequency_bins=201, num_mel_filters=n_mels, min_frequency=0.0,
                           max_frequency=8000.0, sampling_rate=SR, norm="slaney", mel_scale="slaney")  # fmt: skip
    np.testing.assert_allclose(audio.mel_filters(n_mels), want, rtol=1e-12, atol=0)


@pytest.mark.hf
@pytest.mark.parametrize("n_mels", [80, 128])
@pytest.mark.parametrize("signal", ["noise", "sweep_wav", "full_window", "tiny"])
def test_features_match_whisper_feature_extractor(n_mels, signal):
    if signal == "sweep_wav":  # written as 16-bit PCM, decoded through PyAV
        samples = decode_audio(wav_bytes(_sweep_with_gap(), SR), "sweep")
    else:
        samples = _noise({"noise": 3 * SR + 37, "full_window": 30 * SR, "tiny": 700}[signal])
    (window,) = audio_windows(samples, "test", n_mels=n_mels)
    assert window.features.dtype == np.float32 and window.features.shape[1] == n_mels
    # Pure tones leave bins 5+ decades below a frame's peak, where the torch path's float32 STFT
    # strays from its own float64 numpy path by up to ~6e-5 (more than HF's stated 1e-5): the
    # sweep is held to the numpy path, which these features follow.
    _check_window(window, samples, n_mels, torch_path=signal != "sweep_wav")


@pytest.mark.hf
def test_long_clip_is_cut_into_windows_each_featurized_alone():
    samples = _noise(65 * SR + 11, seed=1)
    windows = audio_windows(samples, "long", n_mels=80)
    assert [w.valid_frames for w in windows] == [3000, 3000, 501]
    assert [w.features.shape[0] for w in windows] == [3000, 3000, 504]
    for i, w in enumerate(windows):
        _check_window(w, samples[i * 30 * SR : (i + 1) * 30 * SR], 80)


def test_tail_too_short_for_one_output_is_dropped():
    samples = _noise(30 * SR + 20, seed=2)  # 20 samples past the window: 1 frame, no output
    assert [w.valid_frames for w in audio_windows(samples, "t", n_mels=80)] == [3000]
    with pytest.raises(BadSample, match="empty_audio: 20 samples"):
        audio_windows(samples[:20], "t", n_mels=80)
    assert len(audio_windows(samples[:20], "t", n_mels=80, pool=1)) == 1  # Whisper: no pool


@pytest.mark.hf
def test_frame_and_output_counts_follow_hf():
    torch = pytest.importorskip("torch")
    from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

    valid = np.arange(1, 3001)
    _, want = Qwen2AudioEncoder._get_feat_extract_output_lengths(None, torch.as_tensor(valid))
    assert [encoder_outputs(int(v)) for v in valid] == want.tolist()
    kept = np.array([kept_frames(int(v)) for v in valid])
    assert (kept % 4 == 0).all() and (kept <= 3000).all()
    # every frame the convolutions read for a valid output is kept (or past the window's end)
    assert ((kept >= valid + 2) | (kept == 3000)).all()
    assert [kept_frames(v) for v in (1, 2, 9, 22, 2997, 3000)] == [4, 4, 12, 24, 3000, 3000]
    assert kept_frames(9, pool=1) == 12 and kept_frames(10, pool=1) == 12


def test_decode_resamples_every_channel_and_averages_them():
    from scipy.signal import resample_poly

    rate = 44100
    t = np.arange(int(2.5 * rate)) / rate
    stereo = np.stack([0.5 * np.sin(2 * np.pi * 440 * t), 0.3 * np.sin(2 * np.pi * 1000 * t)], 1)
    pcm = np.round(stereo * 32767).astype(np.int16)
    got = decode_audio(wav_bytes(pcm, rate), "stereo")
    want = resample_poly((pcm / 32768.0).mean(axis=1), 160, 441)  # mean of channels, 16 kHz
    assert got.dtype == np.float32 and got.shape == want.shape == (40000,)
    # Two different anti-alias filters; away from the edges both pass these tones to ~1e-3.
    np.testing.assert_allclose(got[500:-500], want[500:-500], atol=1e-3)


def test_decode_of_16khz_mono_pcm_is_exact(tmp_path):
    pcm = _sweep_with_gap(1.0)
    data = wav_bytes(pcm, SR)
    (tmp_path / "a.wav").write_bytes(data)
    from_bytes, from_path = decode_audio(data, "b"), decode_audio(tmp_path / "a.wav", "p")
    np.testing.assert_array_equal(from_bytes, pcm[:, 0] / np.float32(32768))
    np.testing.assert_array_equal(from_path, from_bytes)
    (window,) = load_audio(tmp_path / "a.wav", "p", n_mels=80)
    assert window.valid_frames == 100 and window.features.shape == (104, 80)


def test_bad_audio_raises_each_reason(tmp_path, monkeypatch):
    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, "PNG")
    three_seconds = wav_bytes(_sweep_with_gap(3.0), SR)
    cases = {
        "missing_file": (tmp_path / "absent.wav", {}),
        "unreadable_audio": (b"RIFF not really a wave file" * 20, {}),
        "empty_audio": (wav_bytes(np.zeros((0, 1), np.int16), SR), {}),
        "audio_too_long": (three_seconds, {"max_seconds": 2.0}),
    }
    for reason, (src, kw) in cases.items():
        with pytest.raises(BadSample) as e:
            load_audio(src, "rec7", **kw)
        assert e.value.reason == reason and e.value.location == "rec7"
    with pytest.raises(BadSample, match="no audio stream"):
        decode_audio(png.getvalue(), "img")
    monkeypatch.setattr(audio, "_header_seconds", lambda *a: None)  # no duration in the header:
    with pytest.raises(BadSample, match="audio_too_long"):  # the decoded length counts
        decode_audio(three_seconds, "rec8", max_seconds=2.0)
    assert len(decode_audio(three_seconds, "rec9", max_seconds=3.0)) == 3 * SR
